"""OpenAI-compatible HTTP: POST /v1/chat/completions, POST /v1/completions, GET /v1/models.

Extensions beyond OpenAI's schema (all optional): body fields `session`,
`priority`, `deadline_ms`, `top_k`; headers `X-Session-ID`, `X-Priority`,
`X-Deadline-Ms`, `traceparent`, `X-Edgechat-Forwarded-By` (set by a peer region's
proxy: never forwarded again); query parameter `session_id`. Responses carry an
`edgechat` object (timing, region, replica, failovers, and `forwarded_from` when
another region's proxy forwarded the request to the region that served it) and `usage` includes
`prompt_tokens_details.cached_tokens`.

Streaming responses are Server-Sent Events written by `SseResponse`, a plain
ASGI callable that also watches for `http.disconnect`, so a client that goes away
aborts the replica's work at once (non-streaming responses do the same while
they wait). Each chunk is a pre-rendered JSON prefix + the JSON-encoded delta
text + a suffix: no dict building per token.
"""

from __future__ import annotations

import asyncio
import secrets
import time

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from edge_proxy import protocol as pp
from edge_proxy.auth import bearer
from edge_proxy.core import SubmitRequest
from edge_proxy.peering import FORWARDED_HEADER

STATUS = {pp.BAD_REQUEST: 400, pp.UNAUTHORIZED: 401, pp.FORBIDDEN: 403, pp.NOT_FOUND: 404, pp.TOO_LARGE: 413,
          pp.PROMPT_TOO_LONG: 400, pp.RATE_LIMITED: 429, pp.OVERLOADED: 503, pp.UNAVAILABLE: 503,
          pp.SHUTTING_DOWN: 503, pp.INTERNAL: 500}


class ContentPart(msgspec.Struct):
    type: str
    text: str = ""


class OAMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    session: str | None = None
    priority: str | None = None
    deadline_ms: float = 0.0


class ChatRequest(_Common, kw_only=True):
    messages: list[OAMessage]


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[int]


def error_response(e: pp.ProtocolError) -> JSONResponse:
    headers = {"Retry-After": str(max(1, round(e.retry_after_s)))} if e.retry_after_s else None
    return JSONResponse({"error": {"message": e.message, "type": e.code, "code": e.code}},
                        status_code=STATUS.get(e.code, 500), headers=headers)


def _text_of(m: OAMessage) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    return "".join(p.text for p in m.content if p.type == "text")


def _sampling(r: _Common) -> pp.Sampling:
    stop = [r.stop] if isinstance(r.stop, str) else list(r.stop or [])
    mt = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
    return pp.Sampling(max_tokens=mt if mt is not None else 256, temperature=r.temperature, top_p=r.top_p,
                       top_k=r.top_k, seed=r.seed, stop=stop)


async def _read_body(request: Request, limit: int) -> bytes:
    cl = request.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > limit:
        raise pp.ProtocolError(pp.TOO_LARGE, f"body over {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise pp.ProtocolError(pp.TOO_LARGE, f"body over {limit} bytes")
    return bytes(body)


def _decode(body: bytes, typ):
    try:
        return msgspec.json.decode(body, type=typ)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise pp.ProtocolError(pp.BAD_REQUEST, f"invalid request body: {e}") from None


class _Sink:
    """Collects one stream's output for an HTTP response (streaming or not)."""

    __slots__ = ("text", "ntok", "final", "_wake")

    def __init__(self):
        self.text: list[str] = []
        self.ntok = 0
        self.final = None
        self._wake = asyncio.Event()

    def delta(self, s, text: str, ntok: int) -> None:
        self.text.append(text)
        self.ntok += ntok
        self._wake.set()

    def finish(self, s, msg) -> None:
        self.final = msg
        self._wake.set()

    async def wait(self) -> None:
        await self._wake.wait()
        self._wake.clear()

    def wake(self) -> None:
        self._wake.set()


async def _watch_disconnect(receive, on_disconnect) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            on_disconnect()
            return


class SseResponse:
    """ASGI callable streaming one request as OpenAI-style SSE chunks."""

    def __init__(self, stream, sink: _Sink, head: bytes, tail: bytes, first: bytes, finish_tpl, usage_tpl):
        self.stream, self.sink = stream, sink
        self.head, self.tail, self.first = head, tail, first  # data: {...,"content": | text | ,...}\n\n
        self.finish_tpl, self.usage_tpl = finish_tpl, usage_tpl

    async def __call__(self, scope, receive, send) -> None:
        stream, sink = self.stream, self.sink
        watcher = asyncio.get_running_loop().create_task(
            _watch_disconnect(receive, lambda: (stream.cancel(notify=False), sink.wake())))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]})
            await send({"type": "http.response.body", "body": self.first, "more_body": True})
            enc = msgspec.json.encode
            while True:
                await sink.wait()
                if sink.text:
                    text = "".join(sink.text)
                    sink.text.clear()
                    await send({"type": "http.response.body", "body": self.head + enc(text) + self.tail,
                                "more_body": True})
                final = sink.final
                if final is not None:
                    body = self.finish_tpl(final)
                    if self.usage_tpl is not None and type(final) is pp.Done:
                        body += self.usage_tpl(final)
                    await send({"type": "http.response.body", "body": body + b"data: [DONE]\n\n",
                                "more_body": False})
                    return
                if stream.done:  # client went away (cancelled without a final message)
                    return
        except OSError:
            stream.cancel(notify=False)
        finally:
            watcher.cancel()


class WaitResponse:
    """ASGI callable answering a non-streaming request once it is done (or aborting it on disconnect)."""

    def __init__(self, stream, sink: _Sink, render):
        self.stream, self.sink, self.render = stream, sink, render

    async def __call__(self, scope, receive, send) -> None:
        stream, sink = self.stream, self.sink
        watcher = asyncio.get_running_loop().create_task(
            _watch_disconnect(receive, lambda: (stream.cancel(notify=False), sink.wake())))
        try:
            while sink.final is None and not stream.done:
                await sink.wait()
            if sink.final is None:
                return
            if type(sink.final) is pp.Error:
                resp = error_response(pp.ProtocolError(sink.final.code, sink.final.message))
            else:
                resp = Response(self.render("".join(sink.text), sink.final), media_type="application/json")
            await resp(scope, receive, send)
        finally:
            watcher.cancel()


def _usage(d: pp.Done) -> dict:
    u = d.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
            "completion_tokens_details": {"accepted_prediction_tokens": u.accepted_draft_tokens}}


def _ext(d: pp.Done) -> dict:
    ext = {"timing": msgspec.to_builtins(d.timing), "region": d.region, "replica": d.replica,
           "failovers": d.failovers}
    if d.forwarded_from:
        ext["forwarded_from"] = d.forwarded_from
    return ext


def _sse(obj) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


class OpenAIRoutes:
    def __init__(self, proxy):
        self.proxy = proxy

    def _auth(self, request: Request):
        key = self.proxy.keys.check(bearer(request.headers.get("authorization")))
        if key is None:
            raise pp.ProtocolError(pp.UNAUTHORIZED, "missing or unknown API key")
        return key

    def _model(self, name: str | None) -> str:
        models = self.proxy.pool.models()
        if name and models and name not in models:
            raise pp.ProtocolError(pp.NOT_FOUND, f"model {name!r} is not served here; see GET /v1/models")
        return name or (models[0] if models else "default")

    async def models(self, request: Request) -> Response:
        try:
            self._auth(request)
        except pp.ProtocolError as e:
            return error_response(e)
        return JSONResponse({"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "edgechat"} for m in self.proxy.pool.models()]})

    async def chat(self, request: Request) -> Response:
        return await self._handle(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._handle(request, chat=False)

    async def _handle(self, request: Request, chat: bool):
        try:
            key = self._auth(request)
            r = _decode(await _read_body(request, self.proxy.cfg.max_frame_bytes),
                        ChatRequest if chat else CompletionRequest)
            if r.n != 1:
                raise pp.ProtocolError(pp.BAD_REQUEST, "only n=1 is supported")
            model = self._model(r.model)
            h = request.headers
            deadline = r.deadline_ms or float(h.get("x-deadline-ms") or 0)
            req = SubmitRequest(
                cid=("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12),
                messages=[{"role": m.role, "content": _text_of(m)} for m in r.messages] if chat else None,
                prompt=None if chat else r.prompt,
                session=r.session or h.get("x-session-id") or request.query_params.get("session_id"),
                sampling=_sampling(r), priority=r.priority or h.get("x-priority"), deadline_ms=deadline,
                traceparent=h.get("traceparent"), forwarded_by=h.get(FORWARDED_HEADER))
            sink = _Sink()
            stream = await self.proxy.submit(key, req, sink)
        except pp.ProtocolError as e:
            return error_response(e)
        except ClientDisconnect:
            return Response(status_code=499)
        except ValueError as e:  # malformed numeric header
            return error_response(pp.ProtocolError(pp.BAD_REQUEST, str(e)))
        created = int(time.time())
        if r.stream:
            return self._sse(stream, sink, req.cid, model, created, chat,
                             r.stream_options is not None and r.stream_options.include_usage)
        return WaitResponse(stream, sink, lambda text, d: self._render(req.cid, model, created, chat, text, d))

    @staticmethod
    def _render(cid: str, model: str, created: int, chat: bool, text: str, d: pp.Done) -> bytes:
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": d.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": d.finish_reason}
            obj = "text_completion"
        return msgspec.json.encode({"id": cid, "object": obj, "created": created, "model": model,
                                    "choices": [choice], "usage": _usage(d), "edgechat": _ext(d)})

    @staticmethod
    def _sse(stream, sink, cid, model, created, chat, include_usage) -> SseResponse:
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": cid, "object": obj, "created": created, "model": model}
        # Render a chunk with a marker for the text, then split around it.
        marker = "\x00MARK\x00"
        choice = {"index": 0, "delta": {"content": marker}, "finish_reason": None} if chat else \
            {"index": 0, "text": marker, "finish_reason": None}
        rendered = _sse({**base, "choices": [choice]})
        head, tail = rendered.split(msgspec.json.encode(marker))
        first = _sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                           "finish_reason": None}]}) if chat else b""

        def finish_tpl(final) -> bytes:
            if type(final) is pp.Error:
                return _sse({"error": {"message": final.message, "type": final.code, "code": final.code}})
            done = {"index": 0, "delta": {}, "finish_reason": final.finish_reason} if chat else \
                {"index": 0, "text": "", "finish_reason": final.finish_reason}
            return _sse({**base, "choices": [done], "edgechat": _ext(final)})

        usage_tpl = (lambda d: _sse({**base, "choices": [], "usage": _usage(d)})) if include_usage else None
        return SseResponse(stream, sink, head, tail, first, finish_tpl, usage_tpl)
