"""The replica's API process: a Starlette app in front of the engine process.

  WS   /v1/replica           proxy protocol (wire.protocol), many requests per socket
  POST /v1/chat/completions  OpenAI-compatible, SSE or JSON (replica.openai_http)
  POST /v1/completions       OpenAI-compatible, SSE or JSON
  POST /infill               llama.cpp's fill-in-the-middle (IDE plugins)
  GET  /v1/models[/{id}], /healthz (alias /health, the path vLLM and SGLang serve), /metrics

Bad input gets an error naming the problem; the connection and the engine keep
serving everyone else. A cancel, a closed socket or a dropped HTTP client sends an
Abort to the engine at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from wire import protocol as P
from replica.config import EngineConfig
from replica.engine_client import EngineClient
from replica.openai_http import OpenAIRoutes
from wire.metrics import ReplicaMetrics
from wire.openai_stream import http_error
from replica.tokenizer import Tokenizer

MAX_FRAME_BYTES = 4 << 20


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
            engine_id, msg.id = msg.id, msg.id[len(self.prefix):]
            if isinstance(msg, (P.Finished, P.Error)) and not self.client.running(engine_id):
                self.live.discard(msg.id)  # its last sample finished
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
    def c_max_len() -> int:
        h = client().hello
        return h.max_model_len if h else 2048

    oa = OpenAIRoutes(client, tokenizer, model_name, metrics, c_max_len)

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
        Route("/v1/chat/completions", oa.chat, methods=["POST"]),
        Route("/v1/completions", oa.completions, methods=["POST"]),
        Route("/infill", oa.infill, methods=["POST"]),
        Route("/v1/models", oa.models, methods=["GET"]),
        Route("/v1/models/{model:path}", oa.model, methods=["GET"]),
        Route("/healthz", healthz),
        Route("/health", healthz),  # what routers built for vLLM/SGLang workers probe
        Route("/metrics", metrics_endpoint),
    ]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
