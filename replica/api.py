"""The replica's API process: a Starlette app in front of the engine process.

  WS   /v1/replica           proxy protocol (wire.protocol), many requests per socket
  POST /v1/chat/completions  OpenAI-compatible, SSE or JSON
  POST /v1/completions       OpenAI-compatible, SSE or JSON
  GET  /v1/models, /healthz (alias /health, the path vLLM and SGLang serve), /metrics

Bad input gets an error naming the problem; the connection and the engine keep
serving everyone else. A cancel, a closed socket or a dropped HTTP client sends an
Abort to the engine at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import time
import uuid

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from wire import openai as O
from wire import protocol as P
from replica.config import EngineConfig
from replica.engine_client import EngineClient
from wire.metrics import ReplicaMetrics
from replica.tokenizer import Tokenizer

MAX_FRAME_BYTES = 4 << 20
STATUS = {P.BAD_REQUEST: 400, P.PROMPT_TOO_LONG: 400, P.UNAUTHORIZED: 401, P.NOT_FOUND: 404, P.OVERLOADED: 503,
          P.INTERNAL: 500}


class ReplicaConnection:
    """One proxy's WebSocket: request ids are namespaced per connection, and every
    message produced in one event-loop turn goes out in one frame."""

    _ids = itertools.count()

    def __init__(self, ws: WebSocket, client: EngineClient):
        self.ws, self.client = ws, client
        self.prefix = f"c{next(self._ids)}/"
        self.live: set[str] = set()  # this connection's request ids in flight (engine ids: prefix + id)
        self.pending: list = []
        self.codec = P.Codec()
        self.closed = False

    def sink(self, msg) -> None:
        if getattr(msg, "id", None) and msg.id.startswith(self.prefix):
            msg.id = msg.id[len(self.prefix):]
            if isinstance(msg, (P.Finished, P.Error)):
                self.live.discard(msg.id)
        if not self.pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self.pending.append(msg)

    def _flush(self) -> None:
        if self.closed or not self.pending:
            return
        frame, self.pending = self.codec.encode(self.pending), []
        asyncio.ensure_future(self._send(frame))

    async def _send(self, frame: bytes) -> None:
        with contextlib.suppress(WebSocketDisconnect, RuntimeError):
            await self.ws.send_bytes(frame)

    def handle(self, data: bytes) -> None:
        try:
            msgs = self.codec.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.sink(P.Error(code=P.BAD_REQUEST, message=f"malformed frame: {e}"))
            return
        for msg in msgs:
            if isinstance(msg, P.Generate):
                if msg.id in self.live:
                    self.sink(P.Error(code=P.BAD_REQUEST, message=f"request id {msg.id!r} is already in flight",
                                      id=msg.id))
                    continue
                self.live.add(msg.id)
                msg.id = self.prefix + msg.id
                self.client.submit(msg, self.sink)
            elif isinstance(msg, P.Abort):
                self.live.discard(msg.id)
                self.client.abort(self.prefix + msg.id)
            else:
                self.sink(P.Error(code=P.BAD_REQUEST, message=f"unexpected message {type(msg).__name__}"))

    def close(self) -> None:
        self.closed = True
        for rid in self.live:
            self.client.abort(self.prefix + rid)
        self.live.clear()


def create_app(cfg: EngineConfig, tokenizer: Tokenizer, *, model_name: str, replica_id: str = "replica",
               secret: str | None = None) -> Starlette:
    client_box: dict[str, EngineClient] = {}
    fingerprint = tokenizer.fingerprint  # hashed once here, not on the event loop when a proxy connects
    metrics = ReplicaMetrics(lambda: client_box["c"].load if "c" in client_box else None)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        client = EngineClient(cfg, tokenizer, replica_id, metrics)
        client_box["c"] = client
        await client.start()
        try:
            yield
        finally:
            await client.stop()

    def client() -> EngineClient:
        return client_box["c"]

    def authorized(headers) -> bool:
        if secret is None:
            return True
        got = headers.get("authorization", "")
        return hmac.compare_digest(got.encode(), f"Bearer {secret}".encode())

    # -- proxy WebSocket -------------------------------------------------------------
    async def replica_ws(ws: WebSocket):
        if not authorized(ws.headers):
            await ws.close(code=4401, reason="unauthorized")
            return
        await ws.accept()
        c = client()
        conn = ReplicaConnection(ws, c)
        # The served name (not the spec), and the fingerprint of the tokenizer the proxy must use.
        conn.sink(msgspec.structs.replace(c.hello, model=model_name, tokenizer=fingerprint))
        conn.sink(P.KvEvents(stored=list(c.cached_blocks), cleared=True))
        if c.load is not None:
            conn.sink(c.load)
        c.subscribers.add(conn.sink)
        try:
            while True:
                message = await ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                data = message.get("bytes")
                if data is None:
                    conn.sink(P.Error(code=P.BAD_REQUEST, message="frames must be binary msgpack"))
                elif len(data) > MAX_FRAME_BYTES:
                    conn.sink(P.Error(code=P.BAD_REQUEST, message=f"frame larger than {MAX_FRAME_BYTES} bytes"))
                else:
                    conn.handle(data)
        finally:
            c.subscribers.discard(conn.sink)
            conn.close()

    # -- OpenAI HTTP -------------------------------------------------------------------
    def error(code: str, message: str) -> JSONResponse:
        metrics.errors.inc(code)
        return JSONResponse(O.error_body(code, message), status_code=STATUS.get(code, 400))

    async def generate(request: Request, kind: str) -> Response:
        body = await request.body()
        schema = O.ChatCompletionRequest if kind == "chat" else O.CompletionRequest
        try:
            req = msgspec.json.decode(body, type=schema)
            sampling = req.sampling(default_max_tokens=min(1024, max(1, c_max_len() // 2)))
            if kind == "chat":
                messages = [{"role": m.role, "content": m.text()} for m in req.messages]
                prompt_ids = tokenizer.encode_chat(messages)
            else:
                prompt_ids = req.prompt if isinstance(req.prompt, list) else tokenizer.encode(req.prompt)
        except msgspec.ValidationError as e:
            return error(P.BAD_REQUEST, f"invalid request: {e}")
        except msgspec.DecodeError as e:
            return error(P.BAD_REQUEST, f"malformed JSON body: {e}")
        except ValueError as e:
            return error(P.BAD_REQUEST, f"invalid request: {e}")
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        gen = P.Generate(id=rid, prompt_ids=prompt_ids, sampling=sampling, priority=req.priority,
                         cache_salt=req.cache_salt, traceparent=request.headers.get("traceparent", ""))
        queue: asyncio.Queue = asyncio.Queue()
        c = client()
        try:
            c.submit(gen, queue.put_nowait)
        except ConnectionError as e:
            return error(P.INTERNAL, str(e))
        model = req.model or model_name
        disconnect = asyncio.ensure_future(wait_disconnect(request))
        # Wait for the first message before answering, so a rejected request gets
        # its real status code rather than an error inside a 200 stream.
        first = await next_message(queue, disconnect)
        if first is None or isinstance(first, P.Error):
            disconnect.cancel()
            c.abort(rid)
            return Response(status_code=499) if first is None else error(first.code, first.message)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            disconnect.cancel()  # StreamingResponse watches for the disconnect itself
            return StreamingResponse(sse(c, first, queue, rid, kind, model, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await collect(c, first, queue, disconnect, rid, kind, model)

    def c_max_len() -> int:
        h = client().hello
        return h.max_model_len if h else 2048

    async def sse(c: EngineClient, msg, queue: asyncio.Queue, rid: str, kind: str, model: str, include_usage: bool):
        enc = msgspec.json.Encoder()
        created = int(time.time())
        first = True
        try:
            while True:
                if isinstance(msg, P.Error):
                    metrics.errors.inc(msg.code)
                    yield b"data: " + enc.encode(O.error_body(msg.code, msg.message)) + b"\n\n"
                    break
                finish = msg.finish_reason if isinstance(msg, P.Finished) else None
                if msg.text or finish or first:
                    yield b"data: " + enc.encode(O.chunk(kind, rid, model, created, msg.text, finish, first)) + b"\n\n"
                    first = False
                if finish:
                    if include_usage:
                        body = O.chunk(kind, rid, model, created, None, None)
                        body["choices"], body["usage"] = [], O.usage_dict(msg.usage)
                        yield b"data: " + enc.encode(body) + b"\n\n"
                    break
                msg = await queue.get()
            yield b"data: [DONE]\n\n"
        finally:
            c.abort(rid)  # no-op when finished; frees the engine's work when the client left

    async def collect(c: EngineClient, msg, queue: asyncio.Queue, disconnect: asyncio.Future, rid: str, kind: str,
                      model: str):
        parts: list[str] = []
        try:
            while msg is not None:
                if isinstance(msg, P.Error):
                    return error(msg.code, msg.message)
                parts.append(msg.text)
                if isinstance(msg, P.Finished):
                    return JSONResponse(O.completion(kind, rid, model, "".join(parts), msg.finish_reason, msg.usage))
                msg = await next_message(queue, disconnect)
            return Response(status_code=499)  # client went away
        finally:
            disconnect.cancel()
            c.abort(rid)

    async def next_message(queue: asyncio.Queue, disconnect: asyncio.Future):
        """The stream's next message, or None when the client disconnected first."""
        if not queue.empty():
            return queue.get_nowait()
        get = asyncio.ensure_future(queue.get())
        await asyncio.wait([get, disconnect], return_when=asyncio.FIRST_COMPLETED)
        if get.done():
            return get.result()
        get.cancel()
        return None

    async def wait_disconnect(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def chat_completions(request: Request):
        return await generate(request, "chat")

    async def completions(request: Request):
        return await generate(request, "completion")

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": 0, "owned_by": "edgechat",
             "max_model_len": c_max_len()}]})

    async def healthz(request: Request):
        c = client_box.get("c")
        if c is None or c.dead or not c.ready.is_set():
            return JSONResponse({"status": "unavailable"}, status_code=503)
        ld = c.load
        return JSONResponse({"status": "ok", "replica": replica_id, "model": model_name,
                             "running": ld.running if ld else 0, "waiting": ld.waiting if ld else 0})

    async def metrics_endpoint(request: Request):
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    routes = [
        WebSocketRoute("/v1/replica", replica_ws),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models),
        Route("/healthz", healthz),
        Route("/health", healthz),  # what routers built for vLLM/SGLang workers probe
        Route("/metrics", metrics_endpoint),
    ]
    return Starlette(routes=routes, lifespan=lifespan)
