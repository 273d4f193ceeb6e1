"""Limits before work: what a request may cost, checked before it is rendered,
tokenized or queued, for every front end. Every limit is checked here and only
here; the front ends and `core.Proxy.submit` call these.

The WebSocket schema (`protocol.py`) bounds each field while decoding, and
`wire.protocol.SamplingParams.validate` checks every request's sampling (both
front ends) before anything is queued; this module bounds the prompt, the
session id, a WebSocket frame and the requests open on one connection.

Sizes are counted without doing the work they would cost: the prompt's UTF-8
bytes (roles and contents), the number of messages, the length of each role.
A prompt within them is tokenized off the event loop (`prompt.TokenizerPool`);
its token count is then checked against the context (`check_prompt_tokens`).

Shapes: the OpenAI API passes messages as dicts (`check_prompt`,
`check_plan_prompt`); the WebSocket checks its count of `protocol.Message`
structs as soon as the frame is decoded (`check_message_count`, the one
definition of that limit), then its messages go through `check_prompt` as dicts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from edge_proxy import protocol as pp


@dataclass(frozen=True)
class Limits:
    max_prompt_bytes: int = 256 << 10  # UTF-8 bytes of a prompt, or of all messages' roles and contents
    max_messages: int = 1024
    max_role_chars: int = 64
    max_prompt_ids: int = 1 << 17  # a prompt given as token ids (OpenAI /v1/completions)
    tokenizer_threads: int = max(1, min(4, (os.cpu_count() or 2) // 2))  # the event loop keeps a core
    max_tokenizing: int = 64  # prompts being tokenized or waiting for a thread; more -> `overloaded`

    def __post_init__(self):
        for name in ("max_prompt_bytes", "max_messages", "max_role_chars", "max_prompt_ids", "tokenizer_threads",
                     "max_tokenizing"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def utf8_len(s: str) -> int:
    return len(s) if s.isascii() else len(s.encode("utf-8", "surrogatepass"))


def check_message_count(n: int, lim: Limits) -> None:
    """Refuse a chat of more than `max_messages` messages (`prompt_too_long`)."""
    if n > lim.max_messages:
        raise pp.ProtocolError(pp.PROMPT_TOO_LONG, f"{n} messages; at most {lim.max_messages} are accepted")


def check_prompt(messages: list[dict] | None, prompt: str | list[int] | None, lim: Limits) -> None:
    """Refuse a prompt over the size limits (`prompt_too_long`) or malformed (`bad_request`),
    in time linear in the number of messages, without rendering or tokenizing it."""
    if (messages is None) == (prompt is None):
        raise pp.ProtocolError(pp.BAD_REQUEST, "give exactly one of messages and prompt")
    if messages is not None:
        check_message_count(len(messages), lim)
        size = 0
        for i, m in enumerate(messages):
            role, content = m["role"], m["content"]
            if not isinstance(role, str) or not isinstance(content, str):
                raise pp.ProtocolError(pp.BAD_REQUEST, f"messages[{i}]: role and content must be strings")
            if not role or len(role) > lim.max_role_chars:
                raise pp.ProtocolError(pp.BAD_REQUEST, f"messages[{i}].role must be 1..{lim.max_role_chars} "
                                                       "characters")
            size += len(role) + utf8_len(content)
            for c in m.get("tool_calls") or ():  # an assistant's calls are prompt text too
                size += utf8_len(c["function"]["name"]) + utf8_len(c["function"]["arguments"])
            if size > lim.max_prompt_bytes:
                raise pp.ProtocolError(pp.PROMPT_TOO_LONG, f"the messages are over {lim.max_prompt_bytes} bytes")
        return
    if isinstance(prompt, str):
        if utf8_len(prompt) > lim.max_prompt_bytes:
            raise pp.ProtocolError(pp.PROMPT_TOO_LONG, f"the prompt is over {lim.max_prompt_bytes} bytes")
        return
    if len(prompt) > lim.max_prompt_ids:
        raise pp.ProtocolError(pp.PROMPT_TOO_LONG, f"the prompt has {len(prompt)} token ids; at most "
                                                   f"{lim.max_prompt_ids} are accepted")
    for i, t in enumerate(prompt):
        if type(t) is not int or not 0 <= t <= pp.INT32_MAX:
            raise pp.ProtocolError(pp.BAD_REQUEST, f"prompt[{i}] is not a token id (an int in [0, 2**31))")


def check_plan_prompt(prompt, lim: Limits) -> None:
    """`check_prompt` for one prompt of an OpenAI request plan (`wire.openai.Plan.prompts`):
    chat messages, text, token ids, or a fill-in-the-middle prompt (`wire.openai.Fim`)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        check_prompt(prompt, None, lim)
    elif isinstance(prompt, (str, list)):
        check_prompt(None, prompt, lim)
    else:  # Fim
        size = sum(utf8_len(t) for t in (prompt.prefix, prompt.suffix, prompt.middle))
        size += sum(utf8_len(name) + utf8_len(text) for name, text in prompt.extra)
        if size > lim.max_prompt_bytes:
            raise pp.ProtocolError(pp.PROMPT_TOO_LONG, f"the prompt is over {lim.max_prompt_bytes} bytes")


def check_prompt_tokens(n: int, max_tokens: int, max_prompt_tokens: int, max_model_len: int) -> None:
    """After tokenizing: refuse an empty prompt, one over the proxy's `max_prompt_tokens`
    (0: no limit of its own) or one whose reply (`max_tokens`) would not fit the model's
    context (`max_model_len`, 0 while unknown)."""
    if n == 0:
        raise pp.ProtocolError(pp.BAD_REQUEST, "the prompt is empty")
    if max_prompt_tokens and n > max_prompt_tokens:
        raise pp.ProtocolError(pp.PROMPT_TOO_LONG, f"prompt has {n} tokens; this proxy accepts at most "
                                                   f"{max_prompt_tokens}")
    if max_model_len and n + max_tokens > max_model_len:
        raise pp.ProtocolError(pp.PROMPT_TOO_LONG, f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds "
                                                   f"the model's context of {max_model_len} tokens")


def check_session_id(session: str) -> None:
    """Session ids are 1..`protocol.MAX_SESSION_CHARS` characters (the WebSocket schema
    bounds them while decoding; the OpenAI API's come from a body field, header or query)."""
    if not session or len(session) > pp.MAX_SESSION_CHARS:
        raise pp.ProtocolError(pp.BAD_REQUEST, f"session ids are 1..{pp.MAX_SESSION_CHARS} characters")


def check_frame_size(n: int, max_bytes: int) -> None:
    """A public WebSocket message of `n` bytes (`too_large` past `max_frame_bytes`; uvicorn's
    `ws_max_size` already refuses larger ones: this guards bytes against characters)."""
    if n > max_bytes:
        raise pp.ProtocolError(pp.TOO_LARGE, f"frame over {max_bytes} bytes")


def check_open_requests(n: int, max_open: int) -> None:
    """A connection with `n` requests open may open another while under `max_open_per_connection`."""
    if n >= max_open:
        raise pp.ProtocolError(pp.RATE_LIMITED, f"{n} requests are open on this connection; wait for one to end",
                               1.0)


# -- a key's limits, for the region: its share on this process ----------------------------------
#
# A key's `rate_per_s`, `burst` and `max_inflight` are the region's: every proxy process of the
# region (pods x `--workers` each) takes an equal share, `share = 1 / processes`, and enforces
# it alone, with nothing asked of anyone per request. A load balancer that spreads a key's
# requests over the processes (HTTP requests, or the turns of a conversation) so holds the key
# to its limit within what one process's bucket holds; a key whose traffic all lands on one
# process (one long-lived WebSocket) gets that process's share only. Why not a shared store:
# it would put a network round trip (or a lock) before every request and make a store's outage
# every proxy's, for limits whose point is to be approximate and cheap.


@dataclass(frozen=True)
class RegionShare:
    proxies: int = 1  # proxy pods of the region (`--region-proxies`, or counted by `--proxies-dns`)
    workers: int = 1  # processes of each (`--workers`)

    def __post_init__(self):
        if self.proxies < 1 or self.workers < 1:
            raise ValueError(f"a region has at least one proxy of one worker, got {self.proxies} x {self.workers}")

    @property
    def fraction(self) -> float:
        return 1.0 / (self.proxies * self.workers)


def shared_rate(rate: float, burst: float, share: float) -> tuple[float, float]:
    """This process's token bucket of a key's region-wide `rate` and `burst` (a burst of one
    request at least: every process can admit a request)."""
    return rate * share, max(burst * share, 1.0)


def shared_cap(cap: int, share: float) -> int:
    """This process's part of a key's region-wide in-flight cap (0: none): its floor, so the
    region never holds more than the cap, at least one (a cap below the process count
    admits one a process)."""
    return max(int(cap * share + 1e-9), 1) if cap else 0


def check_key_inflight(n: int, cap: int, key_id: str) -> None:
    """A key with `n` requests in flight on this process, against its share `cap` (0: none)."""
    if cap and n >= cap:
        raise pp.ProtocolError(pp.RATE_LIMITED, f"API key {key_id} is at its limit of requests in flight "
                                                f"({cap} on this proxy process, its share of the region's)", 1.0)
