"""A plan's prompts as token ids, with the model's tokenizer (chat template, text,
ids, fill-in-the-middle): the same steps at the proxy and the replica (no torch)."""

from __future__ import annotations

import msgspec

from wire import protocol as P
from wire import tools as T
from wire.openai import Fim, OpenAIError, Plan


def prompt_ids(tokenizer, prompt, tools: T.Tools | None = None) -> list[int]:
    """Token ids of one prompt of a plan (chat messages, text, ids or FIM) with the model's tokenizer;
    a chat's tools, tool calls and results rendered as the model's format wants (wire.tools).
    Raises OpenAIError when the model cannot do it (no chat template, no FIM tokens)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        try:
            return T.chat_ids(tokenizer, prompt, tools)
        except T.ToolError as e:
            raise OpenAIError(str(e), e.param) from None
        except ValueError as e:  # replica.tokenizer.ChatTemplateError
            raise OpenAIError(str(e), "messages") from None
    if isinstance(prompt, Fim):
        fim = getattr(tokenizer, "fim", None)
        if fim is None:
            raise OpenAIError("fill-in-the-middle (suffix, /infill) needs a model whose tokenizer has FIM tokens "
                              "(StarCoder <fim_prefix>, Qwen2.5-Coder <|fim_prefix|>, CodeLlama <PRE>, "
                              "DeepSeek-Coder <｜fim▁begin｜>); this model's has none", "suffix")
        return fim.encode(tokenizer, prompt.prefix, prompt.suffix, prompt.extra, prompt.middle)
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    return list(prompt)


def prompt_chars(prompt) -> int:
    """How much text a prompt holds (to tokenize long ones off the event loop)."""
    if isinstance(prompt, Fim):
        return len(prompt.prefix) + len(prompt.suffix) + len(prompt.middle) + sum(len(t) for _, t in prompt.extra)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        return sum(len(m["content"]) for m in prompt)
    return len(prompt) if isinstance(prompt, str) else 0


def prompt_text(tokenizer, prompt, ids: list[int]) -> str:
    """What `echo` shows of a prompt: its text, or its ids decoded."""
    return prompt if isinstance(prompt, str) else tokenizer.decode(ids)


def sampling_for(plan: Plan, tokenizer) -> P.SamplingParams:
    """The plan's sampling for this model: the FIM convention's end-of-infill token as a
    stop id when it has one; the grammar of a required or named tool choice in the
    model's tool-call format."""
    sp = plan.sampling
    fim = getattr(tokenizer, "fim", None)
    if plan.prompts and isinstance(plan.prompts[0], Fim) and fim is not None and fim.end is not None \
            and fim.end not in sp.stop_token_ids:
        sp = msgspec.structs.replace(sp, stop_token_ids=[*sp.stop_token_ids, fim.end])
    if plan.tools is not None and plan.tools.forced:
        sp = msgspec.structs.replace(sp, grammar=tool_grammar(plan.tools, tokenizer))
    return sp


def tool_format(tokenizer) -> T.ToolFormat:
    """The model's tool-call format (wire.tools), or OpenAIError naming `tools`."""
    try:
        return T.ToolFormat.of(getattr(tokenizer, "chat_template", None))
    except T.ToolError as e:
        raise OpenAIError(str(e), e.param) from None


def tool_grammar(tools: T.Tools, tokenizer) -> str:
    try:
        return tool_format(tokenizer).grammar(tools)
    except T.ToolError as e:
        raise OpenAIError(str(e), e.param) from None
    except ValueError as e:  # wire.structured.StructuredError: a function's parameters schema
        raise OpenAIError(f"tools: {e}", "tools") from None
