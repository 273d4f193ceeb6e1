"""One OpenAI (or /infill) HTTP answer, driven by its generations' messages: the
plumbing the proxy and the replica share (asyncio and raw ASGI only, no torch).

The process starts the request's generations with sinks that feed a `Pump`:
`(prompt index, Tokens | Finished)` as they arrive, `End(p, reason)` when the
process ends prompt p itself (the proxy's Done), an `OpenAIError` when one fails.
`Pump.reply` waits for the first item, so a request refused by the engine gets its
real status code rather than an error inside a 200 stream, then returns an ASGI
callable that streams SSE (everything that arrived within one event-loop turn in
one write) or answers with the whole JSON body. A client that goes away aborts
the generations at once; an error after the stream started is sent as
`data: {"error": ...}` before `[DONE]`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from wire import infill as IF
from wire import openai as O
from wire import openai_prompts as OP
from wire.openai import OpenAIError
from wire.openai_render import DONE, Response

_enc = msgspec.json.Encoder()
_GONE = object()


@dataclass
class End:
    """The process ended prompt p's generation: unfinished choices finish with `reason`."""

    p: int
    reason: str
    extra: dict | None = None  # added to the answer (the proxy's `edgechat` object)


def json_response(status: int, body: bytes, headers: dict | None = None):
    async def app(scope, receive, send) -> None:
        hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        hdrs += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
        await send({"type": "http.response.start", "status": status, "headers": hdrs})
        await send({"type": "http.response.body", "body": body})
    return app


def error_response(e: OpenAIError):
    headers = {"Retry-After": str(max(1, round(e.retry_after_s)))} if e.retry_after_s else None
    return json_response(e.status, _enc.encode(e.body()), headers)


class Pump:
    """The queue between a request's generations and its HTTP answer."""

    def __init__(self, receive, hold: bool = False):
        self.q: asyncio.Queue = asyncio.Queue()
        self.abort: Callable[[], None] = lambda: None  # stops every generation (set once they are started)
        self.hold = hold  # Finished waits for End (the proxy: its Done adds to the last chunk)
        self._first = None  # the item `reply` looked at, not consumed yet
        self._watch = asyncio.get_running_loop().create_task(self._watch_disconnect(receive))

    def put(self, item) -> None:
        self.q.put_nowait(item)

    async def get(self):
        if self._first is not None:
            item, self._first = self._first, None
            return item
        return await self.q.get()

    def get_nowait(self):
        """The next item if one is in, else None."""
        if self._first is not None:
            item, self._first = self._first, None
            return item
        return None if self.q.empty() else self.q.get_nowait()

    async def _watch_disconnect(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.abort()
        self.q.put_nowait(_GONE)

    def close(self) -> None:
        self._watch.cancel()

    async def reply(self, resp, stream: bool):
        """The ASGI answer once the first item is in (a JSON error if it is one)."""
        first = await self.q.get()
        if first is _GONE:
            self.close()
            return json_response(499, b"")
        if isinstance(first, OpenAIError):
            self.abort()
            self.close()
            return error_response(first)
        self._first = first
        return _Streamed(self, resp) if stream else _Whole(self, resp)

    def feed(self, resp, item) -> tuple[bytes, OpenAIError | None]:
        """Render one item; (bytes, the error that ends the answer or None)."""
        if isinstance(item, tuple):
            out = resp.message(item[0], item[1], hold=self.hold)
            if getattr(resp, "cut", False):
                self.abort()  # /infill n_indent or t_max_predict_ms: the answer is complete
            return out, None
        if isinstance(item, End):
            if item.extra:
                resp.extra = item.extra
            return resp.end(item.p, item.reason), None
        if isinstance(item, OpenAIError):
            self.abort()
            return b"", item
        raise TypeError(f"unexpected item {type(item).__name__}")


class _Streamed:
    def __init__(self, pump: Pump, resp):
        self.pump, self.resp = pump, resp

    async def __call__(self, scope, receive, send) -> None:
        pump, resp = self.pump, self.resp
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]})
            out = [resp.start()]
            while True:
                item = await pump.get()
                while True:
                    if item is _GONE:
                        return
                    data, err = pump.feed(resp, item)
                    out.append(data)
                    if err is not None:
                        out.append(b"data: " + _enc.encode(err.body()) + b"\n\n" + DONE)
                        await send({"type": "http.response.body", "body": b"".join(out), "more_body": False})
                        return
                    if resp.done:
                        out.append(resp.close())
                        await send({"type": "http.response.body", "body": b"".join(out), "more_body": False})
                        return
                    item = pump.get_nowait()
                    if item is None:
                        break
                body = b"".join(out)
                out.clear()
                if body:
                    await send({"type": "http.response.body", "body": body, "more_body": True})
        except OSError:
            return  # the client went away mid-send (uvicorn's ClientDisconnected)
        finally:
            pump.abort()  # a no-op once every generation finished; else the client went away
            pump.close()


class _Whole:
    def __init__(self, pump: Pump, resp):
        self.pump, self.resp = pump, resp

    async def __call__(self, scope, receive, send) -> None:
        pump, resp = self.pump, self.resp
        try:
            while not resp.done:
                item = await pump.get()
                if item is _GONE:
                    return
                _, err = pump.feed(resp, item)
                if err is not None:
                    return await error_response(err)(scope, receive, send)
            await json_response(200, resp.answer())(scope, receive, send)
        finally:
            pump.abort()  # a no-op once every generation finished
            pump.close()


class Disconnected(Exception):
    """The client went away before its request's body was read (answered 499, to nobody)."""


async def read_body(request, limit: int) -> bytes:
    """The request body, read from the ASGI `receive` of a Starlette Request; refused with 413
    past `limit` bytes; `Disconnected` when the client goes away first."""
    too_large = OpenAIError(f"request body over {limit} bytes", None, 413, "too_large")
    cl = request.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > limit:
        raise too_large
    body = bytearray()
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise Disconnected
        if message["type"] != "http.request":
            continue
        body += message.get("body", b"")
        if len(body) > limit:
            raise too_large
        if not message.get("more_body", False):
            return bytes(body)


async def http_error(request, exc):
    """Starlette's 404/405 (unknown route, wrong method) in OpenAI's error shape."""
    status = getattr(exc, "status_code", 500)
    code = {404: "not_found", 405: "method_not_allowed"}.get(status, "internal")
    message = f"{request.method} {request.url.path}: " + ("no such route" if status == 404 else
                                                          "method not allowed" if status == 405 else str(exc))
    return json_response(status, _enc.encode(OpenAIError(message, None, status, code).body()),
                         getattr(exc, "headers", None))


def parse(kind: str, body: bytes) -> tuple[O.Plan, IF.InfillRequest | None]:
    """A chat / completion / infill body as a validated plan (and the /infill request)."""
    if kind == "infill":
        return IF.parse(body)
    return O.fan_out(O.parse_chat(body) if kind == "chat" else O.parse_completion(body)), None


def response(kind: str, plan: O.Plan, ireq, rid: str, model: str, tokenizer, ids: list[list[int]]):
    """The answer's renderer: OpenAI's (wire.openai_render) or llama.cpp's (wire.infill)."""
    if kind == "infill":
        return IF.InfillResponse(plan, ireq, model, len(ids[0]))
    texts = [OP.prompt_text(tokenizer, p, i) for p, i in zip(plan.prompts, ids)] if plan.echo else None
    fmt = OP.tool_format(tokenizer).name if plan.tools is not None and plan.tools.shown else ""
    return Response(plan, rid, model, int(time.time()), tokenizer.piece, ids, texts, fmt)
