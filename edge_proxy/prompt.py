"""The one seam between the proxy and the model's tokenizer.

The proxy renders and tokenizes conversations itself (so it can hash prompt
blocks for prefix-aware routing and send token ids the replicas do not
tokenize again). `load_tokenizer("default")` is `replica.tokenizer.Tokenizer`
(the model's own tokenizer and chat template, no torch); `load_tokenizer("bytes")`
is `ByteTokenizer`, a dependency-free stand-in with the same methods that the
tests and the replica stub use.

Rendering and tokenizing never run on the event loop: `TokenizerPool` runs them
in a few threads (the model tokenizer releases the GIL while it works, see
`replica.tokenizer.Tokenizer.encode`), and at most `max_jobs` prompts wait for or
occupy those threads; past that a request is refused with `overloaded` at once.
Size limits (`edge_proxy.limits`) are checked before a prompt gets here.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future, ThreadPoolExecutor

from edge_proxy import protocol as pp
from edge_proxy.limits import Limits, check_plan_prompt
from wire import openai_prompts as OP
from wire.tools import chat_ids


class ByteTokenizer:
    """UTF-8 bytes as token ids and a ChatML-like template. Id 0 is EOS."""

    eos_token_ids = (0,)
    fingerprint = "bytes-v1"
    fim = None  # no fill-in-the-middle tokens

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())  # (bytes have no special tokens to add)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
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


def encode(tokenizer, messages: list[dict] | None, prompt: str | list[int] | None, tools=None) -> list[int]:
    """Token ids of a conversation (chat template, generation prompt; tools, tool calls and
    results as wire.tools renders them) or of a raw prompt."""
    if messages is not None:
        return chat_ids(tokenizer, messages, tools)
    if isinstance(prompt, list):
        return prompt
    return list(tokenizer.encode(prompt))


def reply_ids(tokenizer, messages: list[dict], reply: list[int]) -> list[int]:
    """Token ids of a conversation followed by a reply, as the next turn renders them
    (the reply as text, the template's end of turn, no generation prompt)."""
    turn = {"role": "assistant", "content": tokenizer.decode(reply)}
    return list(tokenizer.encode_chat([*messages, turn], add_generation_prompt=False))


class TokenizerPool:
    """A bounded pool of tokenizer threads (one per Proxy)."""

    def __init__(self, tokenizer, threads: int = 2, max_jobs: int = 64):
        if threads < 1 or max_jobs < threads:
            raise ValueError(f"a tokenizer pool needs threads >= 1 and max_jobs >= threads, got {threads}, {max_jobs}")
        self.tokenizer = tokenizer
        self.threads, self.max_jobs = threads, max_jobs
        self.jobs = 0  # submitted and not yet finished (or cancelled before starting)
        self._ex = ThreadPoolExecutor(threads, thread_name_prefix="edge_proxy-tokenize")

    async def run(self, fn, *args) -> list[int]:
        """`fn(*args)` (rendering, tokenizing) in a pool thread; its exceptions propagate.
        Raises `ProtocolError(overloaded)` at once when `max_jobs` are already in the pool."""
        if self.jobs >= self.max_jobs:
            raise pp.ProtocolError(pp.OVERLOADED, f"{self.jobs} prompts are being tokenized; retry shortly", 1.0)
        return await asyncio.wrap_future(self._submit(fn, *args))

    async def encode(self, messages: list[dict] | None, prompt: str | list[int] | None, tools=None) -> list[int]:
        """`encode(...)` with this pool's tokenizer, in a pool thread."""
        return await self.run(encode, self.tokenizer, messages, prompt, tools)

    def reply_ids(self, messages: list[dict], reply: list[int], done) -> None:
        """Best effort, for a check rather than a request: `done(ids)` on the event loop with
        `reply_ids(...)`, or nothing when no thread is free or the template refuses."""
        if self.jobs >= self.threads:
            return
        loop = asyncio.get_running_loop()
        job = self._submit(reply_ids, self.tokenizer, messages, reply)
        job.add_done_callback(lambda j: None if j.cancelled() or j.exception() is not None
                              else self._call(loop, done, j.result()))

    def _submit(self, fn, *args) -> Future:
        loop = asyncio.get_running_loop()
        self.jobs += 1
        job: Future = self._ex.submit(fn, *args)
        # Released when the job really ends: a cancelled waiter (client gone) leaves a
        # running job counted until its thread is free again.
        job.add_done_callback(lambda _: self._call(loop, self._release))
        return job

    @staticmethod
    def _call(loop: asyncio.AbstractEventLoop, fn, *args) -> None:  # from a worker thread
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _release(self) -> None:
        self.jobs -= 1

    def close(self) -> None:
        self._ex.shutdown(wait=False, cancel_futures=True)


async def run_checked(pool: TokenizerPool, limits: Limits, prompt, fn, *args):
    """`fn(*args)` (rendering, tokenizing, decoding) in `pool`, never on the event loop, once
    `prompt` (one prompt of an OpenAI plan: messages, text, token ids or `wire.openai.Fim`) is
    within the proxy's size limits. Raises `ProtocolError` (limits, a full pool) or what `fn` raises."""
    check_plan_prompt(prompt, limits)
    return await pool.run(fn, *args)


async def plan_prompt_ids(pool: TokenizerPool, limits: Limits, prompt, tools=None) -> list[int]:
    """Token ids of one prompt of an OpenAI plan or a fill-in-the-middle request (`wire.openai.Fim`),
    after the proxy's size limits, in `pool` (never on the event loop). Raises `ProtocolError`
    (limits, a full pool) or `wire.openai.OpenAIError` (the model cannot: no chat template, no FIM tokens)."""
    return await run_checked(pool, limits, prompt, OP.prompt_ids, pool.tokenizer, prompt, tools)
