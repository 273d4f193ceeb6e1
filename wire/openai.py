"""OpenAI-compatible request schemas (msgspec) and response bodies.

Unknown fields are rejected with an error that names them; accepted-but-unsupported
features (n > 1, penalties, logprobs) are rejected explicitly rather than ignored.
Imports no torch (the edge proxy reuses these schemas).
"""

from __future__ import annotations

import time

import msgspec

from wire import protocol as P


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: str = ""


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        for part in self.content:
            if part.type != "text":
                raise ValueError(f"content part type {part.type!r} is not supported (text only)")
        return "".join(p.text for p in self.content)


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class _Common(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # extension, as in vLLM
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []  # extension
    ignore_eos: bool = False  # extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: bool | int | None = None
    priority: int = P.INTERACTIVE  # extension: 0 interactive, 1 batch
    cache_salt: str = ""  # extension: tenant isolation of the prefix cache

    def sampling(self, default_max_tokens: int) -> P.SamplingParams:
        if self.n != 1:
            raise ValueError("n must be 1")
        if self.frequency_penalty or self.presence_penalty:
            raise ValueError("frequency_penalty and presence_penalty are not supported")
        if self.logprobs:
            raise ValueError("logprobs are not supported")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        max_tokens = self.max_completion_tokens or self.max_tokens
        return P.SamplingParams(max_tokens=default_max_tokens if max_tokens is None else max_tokens,
                                temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                                stop=stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos)


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[int]


def error_body(code: str, message: str) -> dict:
    return {"error": {"message": message, "type": code, "code": code}}


def usage_dict(u: P.Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
            "completion_tokens_details": {"accepted_prediction_tokens": u.accepted_draft_tokens}}


def chunk(kind: str, rid: str, model: str, created: int, text: str | None, finish: str | None,
          first: bool = False) -> dict:
    """One streaming chunk; text=None with finish=None is the usage-only chunk."""
    if kind == "chat":
        delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


def completion(kind: str, rid: str, model: str, text: str, finish: str, usage: P.Usage) -> dict:
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage_dict(usage)}
