"""The one seam between the proxy and the model's tokenizer.

The proxy renders and tokenizes conversations itself (so it can hash prompt
blocks for prefix-aware routing and send token ids the replicas do not
tokenize again). `load_tokenizer("default")` is `replica.tokenizer.Tokenizer`
(the model's own tokenizer and chat template, no torch); `load_tokenizer("bytes")`
is `ByteTokenizer`, a dependency-free stand-in with the same methods that the
tests and the replica stub use.
"""

from __future__ import annotations

import asyncio

# Prompts longer than this (characters) are rendered and tokenized in a thread, so
# a huge prompt does not stall the relay of every other stream for milliseconds.
INLINE_CHARS = 8192


class ByteTokenizer:
    """UTF-8 bytes as token ids and a ChatML-like template. Id 0 is EOS."""

    eos_token_ids = (0,)
    fingerprint = "bytes-v1"
    fim = None  # no fill-in-the-middle tokens

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 < i < 256).decode(errors="replace")

    def piece(self, token_id: int) -> tuple[str, bytes]:
        raw = bytes([token_id]) if 0 <= token_id < 256 else b""
        return raw.decode(errors="replace"), raw

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        out = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))


def load_tokenizer(spec: str):
    """`"bytes"` -> ByteTokenizer; anything else -> replica.tokenizer.Tokenizer.from_spec(spec)."""
    if spec == "bytes":
        return ByteTokenizer()
    from replica.tokenizer import Tokenizer  # imports tokenizers + jinja2 only, never torch

    return Tokenizer.from_spec(spec)


def _encode(tokenizer, messages: list[dict] | None, prompt: str | list[int] | None) -> list[int]:
    if messages is not None:
        return list(tokenizer.encode_chat(messages))
    if isinstance(prompt, list):
        return prompt
    return list(tokenizer.encode(prompt))


def prompt_chars(messages: list[dict] | None, prompt: str | list[int] | None) -> int:
    if messages is not None:
        return sum(len(m["content"]) for m in messages)
    return len(prompt) if isinstance(prompt, str) else 0


async def encode_prompt(tokenizer, messages: list[dict] | None, prompt: str | list[int] | None) -> list[int]:
    """Token ids of a conversation (chat template, generation prompt) or of a raw prompt."""
    if prompt_chars(messages, prompt) <= INLINE_CHARS:
        return _encode(tokenizer, messages, prompt)
    return await asyncio.to_thread(_encode, tokenizer, messages, prompt)


def encode_reply(tokenizer, messages: list[dict], reply_ids: list[int], done) -> None:
    """Token ids of a conversation followed by a reply, as the next turn renders them
    (the reply as text, the template's end of turn, no generation prompt), handed to
    `done(ids)`: at once for a short chat, from a worker thread for a long one. A
    conversation the template cannot render raises ValueError (ChatTemplateError)."""
    def render() -> list[int]:
        reply = {"role": "assistant", "content": tokenizer.decode(reply_ids)}
        return list(tokenizer.encode_chat([*messages, reply], add_generation_prompt=False))

    if prompt_chars(messages, None) <= INLINE_CHARS:
        done(render())
        return
    fut = asyncio.get_running_loop().run_in_executor(None, render)
    fut.add_done_callback(lambda f: None if f.cancelled() or f.exception() else done(f.result()))
