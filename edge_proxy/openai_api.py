"""The proxy behind the OpenAI routes (wire.openai_routes: POST /v1/chat/completions,
POST /v1/completions, GET /v1/models[/{id}], llama.cpp's POST /infill and GET /props,
POST /tokenize, POST /detokenize, GET /version): `ProxyBackend` is what the proxy adds
to them.

Callers are API keys (`Authorization: Bearer`, the failed-auth throttle); the models
are the pool's (each with the smallest context its replicas announce); a prompt (or
a /tokenize, /detokenize body) is checked against the proxy's limits (edge_proxy.limits)
and rendered, tokenized or decoded in its tokenizer threads, never on the event loop;
each prompt of a request is one proxy stream (routing, failover and exact resume as
for the WebSocket), whose messages feed the routes' shared renderer; a client that
goes away cancels them at once. The proxy's
refusals (auth, rate limit, admission, limits) keep their codes, in OpenAI's shape.

Extensions beyond OpenAI's schema (all optional): body fields `session`,
`priority`, `deadline_ms`, `cache_salt` and vLLM's sampling extensions; headers
`X-Session-ID`, `X-Priority`, `X-Deadline-Ms`, `traceparent`,
`X-Edgechat-Forwarded-By` (set by a peer region's proxy: never forwarded again);
query parameter `session_id`. Answers carry an `edgechat` object (timing, region,
replica, failovers, and `forwarded_from` when another region's proxy forwarded the
request to the region that served it).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from edge_proxy import protocol as pp
from edge_proxy.auth import bearer
from edge_proxy.core import SubmitRequest
from edge_proxy.peering import FORWARDED_HEADER
from edge_proxy.prompt import run_checked
from wire import openai as O
from wire import protocol as P
from wire.openai_routes import PromptSink, Submission

_NAMES = {v: k for k, v in O.PRIORITIES.items()}


def openai_error(e: pp.ProtocolError | pp.Error) -> O.OpenAIError:
    return O.error_of(e.code, e.message, e.retry_after_s)


def _ext(d: pp.Done) -> dict:
    ext = {"timing": msgspec.to_builtins(d.timing), "region": d.region, "replica": d.replica,
           "failovers": d.failovers}
    if d.forwarded_from:
        ext["forwarded_from"] = d.forwarded_from
    return {"edgechat": ext}


class _Sink:
    """One prompt's proxy stream -> its PromptSink (a `sinks.TokenSink`)."""

    __slots__ = ("sink",)

    def __init__(self, sink: PromptSink):
        self.sink = sink

    def tokens(self, s, msg) -> None:
        self.sink(msg)

    def delta(self, s, text: str, ntok: int) -> None:
        # A request forwarded to a peer region (public protocol: text and a token count). Only
        # the count of ids is used: no logprobs can be asked of a forwarded request.
        self.sink(P.Tokens("", [0] * ntok, text))

    def finish(self, s, msg) -> None:
        if type(msg) is pp.Done:
            self.sink.end(msg.finish_reason, _ext(msg))
        else:
            self.sink.fail(openai_error(msg))


class ProxyBackend:
    """wire.openai_routes.OpenAIBackend over a `core.Proxy`."""

    hold = True  # a prompt's Done adds the `edgechat` object to its last chunk

    def __init__(self, proxy):
        self.proxy = proxy

    @property
    def tokenizer(self):
        return self.proxy.tokenizer

    @property
    def max_body_bytes(self) -> int:
        return self.proxy.cfg.max_frame_bytes

    def authorize(self, request):
        client = request.client
        try:
            return self.proxy.authenticate(bearer(request.headers.get("authorization")),
                                           client.host if client else None)
        except pp.ProtocolError as e:  # unauthorized, or rate_limited (failed-auth throttle)
            raise openai_error(e) from None

    def models(self) -> dict[str, int]:
        """The pool's models; each one's context is the smallest its replicas announced."""
        out: dict[str, int] = {}
        for c in self.proxy.pool.conns:
            if c.hello is not None:
                n = c.hello.max_model_len
                out[c.hello.model] = min(out.get(c.hello.model, n), n)
        return dict(sorted(out.items()))

    def served_model(self, name: str | None) -> str:
        models = self.proxy.pool.models()
        if name and models and name not in models:
            raise O.not_found_model(name)
        return name or (models[0] if models else "default")

    def slots(self) -> int:
        """Requests the ready replicas run at once (each one's `max_num_seqs`, 1 while it reported none)."""
        return sum((c.load.max_running or 1) if c.load is not None else 1 for c in self.proxy.pool.ready())

    async def run_tokenizer(self, prompt, fn, *args):
        try:
            return await run_checked(self.proxy.tokenizers, self.proxy.cfg.limits, prompt, fn, *args)
        except pp.ProtocolError as e:  # the proxy's limits, or its tokenizer threads all busy
            raise openai_error(e) from None

    async def submit(self, sub: Submission, p: int, sink: PromptSink) -> Callable[[], None]:
        plan, request, ids = sub.plan, sub.request, sub.ids[p]
        h, prompt, chat = request.headers, plan.prompts[p], plan.kind == "chat"
        req = SubmitRequest(
            cid=sub.rid if len(sub.ids) == 1 else f"{sub.rid}/{p}",
            messages=prompt if chat else None,
            prompt=None if chat else prompt if isinstance(prompt, str) else ids, ids=ids,
            session=plan.session or h.get("x-session-id") or request.query_params.get("session_id"),
            sampling=sub.sampling, priority=_NAMES.get(plan.priority) or h.get("x-priority"),
            deadline_ms=plan.deadline_ms or float(h.get("x-deadline-ms") or 0),  # a malformed one: a 400
            traceparent=h.get("traceparent"), forwarded_by=h.get(FORWARDED_HEADER),
            cache_salt=plan.cache_salt, tools=plan.tools)
        try:
            stream = await self.proxy.submit(sub.caller, req, _Sink(sink))
        except pp.ProtocolError as e:  # auth's rate limit, admission, lengths, routing
            raise openai_error(e) from None
        return lambda: self.proxy.cancel(stream, notify=False)

    def count_error(self, code: str) -> None:
        pass  # the proxy counts its refusals where it makes them (ProxyMetrics.rejected)
