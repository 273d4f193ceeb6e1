"""POST /tokenize and POST /detokenize, in vLLM's shapes (no torch).

    /tokenize    {"prompt": text} or {"messages": [...]}, optional "model",
                 "add_special_tokens" (default: true for a prompt, false for messages, as vLLM),
                 "add_generation_prompt" (messages; default true)
                 -> {"count", "max_model_len", "tokens"}
    /detokenize  {"tokens": [ids]}, optional "model" -> {"prompt": text}

Messages are rendered with the model's chat template as /v1/chat/completions renders them
(tool calls and results included, wire.tools), so with the defaults `count` is that
request's `usage.prompt_tokens`. llama.cpp's /tokenize body is taken too
(`{"content", "add_special", "parse_special"}`: llama.vscode counts tokens with it); its
answer's `tokens` is the same list. Detokenizing keeps special tokens (<|im_start|>...), so
a tokenized chat decodes back to the text its template rendered.
Not honoured, a 400 naming the field: vLLM's `continue_final_message`, `return_token_strs`
and any other field; llama.cpp's `parse_special: false` and `with_pieces`.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from wire import openai as O
from wire import tools as T
from wire.openai import OpenAIError


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[O.ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    content: str | None = None  # llama.cpp's name for the prompt
    add_special: bool = False  # llama.cpp's add_special_tokens (its default: false)
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tokens: list[int]
    model: str | None = None


@dataclass
class Tokenize:
    """A validated /tokenize request: `prompt` is text, or messages as the chat template takes them."""

    model: str | None
    prompt: str | list[dict]
    add_special_tokens: bool
    add_generation_prompt: bool


def parse_tokenize(body: bytes) -> Tokenize:
    r = O.decode(body, TokenizeRequest)
    given = [name for name in ("prompt", "messages", "content") if getattr(r, name) is not None]
    if len(given) != 1:
        raise OpenAIError("give exactly one of prompt, messages (and llama.cpp's content)",
                          given[1] if len(given) > 1 else "prompt")
    for name, wrong in (("continue_final_message", True), ("return_token_strs", True), ("parse_special", False),
                        ("with_pieces", True)):
        if getattr(r, name) is wrong:
            O.refuse(name, "not served by this tokenize endpoint")
    if r.content is not None:
        return Tokenize(r.model, r.content, r.add_special, False)
    if r.messages is not None:
        special = False if r.add_special_tokens is None else r.add_special_tokens
        return Tokenize(r.model, O.messages(r.messages), special, r.add_generation_prompt)
    return Tokenize(r.model, r.prompt, True if r.add_special_tokens is None else r.add_special_tokens, False)


def tokenize(tokenizer, t: Tokenize) -> list[int]:
    """The token ids of a /tokenize request. Raises OpenAIError when the model cannot render
    the messages (no chat template, a tool call its format cannot show)."""
    if isinstance(t.prompt, str):
        return list(tokenizer.encode(t.prompt, add_special_tokens=t.add_special_tokens))
    messages, kw = t.prompt, {}
    try:
        if any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            messages, kw = T.ToolFormat.of(getattr(tokenizer, "chat_template", None)).render(messages, None)
        text = tokenizer.apply_chat_template(messages, t.add_generation_prompt, **kw)
    except T.ToolError as e:
        raise OpenAIError(str(e), e.param) from None
    except ValueError as e:  # replica.tokenizer.ChatTemplateError
        raise OpenAIError(str(e), "messages") from None
    return list(tokenizer.encode(text, add_special_tokens=t.add_special_tokens))


def parse_detokenize(body: bytes, vocab_size: int | None) -> DetokenizeRequest:
    r = O.decode(body, DetokenizeRequest)
    bound = vocab_size or 1 << 31
    for i, t in enumerate(r.tokens):
        if not 0 <= t < bound:
            raise OpenAIError(f"tokens[{i}] = {t} is not a token id of this model (0 <= id < {bound})",
                              f"tokens[{i}]")
    return r


def detokenize(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)
