"""The replica's API process: a Starlette app in front of the engine process.

  WS   /v1/replica           proxy protocol (wire.protocol), many requests per socket
  POST /v1/chat/completions  OpenAI-compatible, SSE or JSON (wire.openai_routes, replica.api.openai_http)
  POST /v1/completions       OpenAI-compatible, SSE or JSON
  POST /infill               llama.cpp's fill-in-the-middle (IDE plugins)
  GET  /v1/models[/{id}], /healthz (alias /health, the path vLLM and SGLang serve), /metrics
  GET  /v1/kv/spec, POST /v1/kv/export, POST /v1/kv/pull, POST|DELETE /v1/kv/hot
                             KV between replicas (replica.api.kv_routes)
  POST /v1/prefill           compute a prompt into the prefix cache, for another replica to pull (replica.api.prefill)
  POST /v1/drain             admit nothing new, exit once the proxies moved the streams (replica.api.drain)

Every path but /healthz and /health requires the replica secret (`replica.api.auth`);
GET /metrics also takes the read-only metrics token, where one is given.
/healthz answers 503 while the engine process starts or restarts.
Bad input gets an error naming the problem; the connection and the engine keep
serving everyone else. A cancel, a closed socket or a dropped HTTP client sends an
Abort to the engine at once.
"""

from __future__ import annotations

import contextlib
import itertools
import logging

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.websockets import WebSocket

from wire import protocol as P
from replica.api.auth import RequireSecret
from replica.api.drain import Drain
from replica.config import EngineConfig
from replica.api.engine_client import EngineClient
from replica.api.frame_split import split_frame
from replica.api.kv_routes import KvRoutes
from replica.api.kv_transport import HttpKvTransport
from replica.api.metrics import ReplicaMetrics
from replica.api.openai_http import ReplicaBackend
from replica.api.prefill import PrefillRoute
from wire.metrics import CONTENT_TYPE
from wire.openai_routes import OpenAIRoutes
from wire.openai_stream import http_error
from replica.tokenizer import Tokenizer
from replica.validation import MAX_ID_CHARS
from wire.ws_frames import BINARY, WebSocketFront
from wire.ws_writer import Batch, FrameWriter

log = logging.getLogger("replica.api.app")

MAX_FRAME_BYTES = 4 << 20
ENGINE_RESTARTING = 1013  # WebSocket close code "try again later"


class ReplicaConnection:
    """One proxy's WebSocket. Each message of a frame is decoded and handled on its own,
    so a malformed or failing message fails its request only; every message produced in
    one event-loop turn goes out in one frame (`wire.ws_writer`: a `Batch` written into
    uvicorn's transport at the end of the turn; while the transport is over its high-water
    mark, messages queue behind one task waiting for it to drain). Request ids are the
    proxy's, unique among this connection's live requests; each Generate gets an engine
    id never used before (`c<connection>/<n>`), so a reused id is a new request that no
    late message of its predecessor can reach."""

    _ids = itertools.count()

    def __init__(self, client: EngineClient, send):
        self.client = client
        self.prefix = f"c{next(self._ids)}/"
        self._seq = itertools.count()
        self.live: dict[str, str] = {}  # this connection's requests in flight: proxy id -> engine id
        self.names: dict[str, str] = {}  # engine id -> proxy id
        self.codec = P.Codec()
        self.out = Batch(self.codec.encode)
        self.writer = FrameWriter(send, self.out, BINARY)  # `send`: the raw ASGI send (uvicorn's own)
        self._frame = msgspec.msgpack.Decoder(list[msgspec.Raw])
        self._message = msgspec.msgpack.Decoder(P.Message)
        self.seen_id = ""  # the proxy's id of the last Generate received: every Load sent here names it

    def sink(self, msg) -> None:
        if type(msg) is P.Load:  # one Load goes to every connection: this one's copy says what it counts of ours
            msg = msgspec.structs.replace(msg, seen_id=self.seen_id)
        engine_id = getattr(msg, "id", None)
        if engine_id is not None and engine_id in self.names:
            msg.id = self.names[engine_id]
            if isinstance(msg, (P.Finished, P.Error)) and not self.client.running(engine_id):
                del self.names[engine_id]  # its last sample finished
                if self.live.get(msg.id) == engine_id:
                    del self.live[msg.id]
        self.out.append(msg)
        self.writer.wake()

    def shut(self) -> None:
        """The engine was lost: after the errors already queued, close the socket, so the
        proxy counts this replica out until it reconnects to a restarted engine."""
        self.writer.close(ENGINE_RESTARTING, "engine process restarting", drain=True)

    def handle(self, data: bytes) -> None:
        try:
            try:
                raws = self._frame.decode(data)
            except RecursionError:  # a message nested too deep: find the messages without recursion
                raws = split_frame(data)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
            self.sink(P.Error(code=P.BAD_REQUEST, message=f"malformed frame: {e}"))
            return
        for raw in raws:
            try:
                self._handle_one(raw)
            except Exception:  # noqa: BLE001 - last resort: one message must not end the connection
                log.exception("replica: handling a message failed")
                self.sink(P.Error(code=P.INTERNAL, message="replica failed to handle a message"))

    def _handle_one(self, raw) -> None:
        try:
            msg = self._message.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
            self.sink(P.Error(code=P.BAD_REQUEST, message=f"malformed message: {e}", id=self._id_of(raw)))
            return
        try:
            self._on_message(msg)
        except Exception as e:  # noqa: BLE001 - one request's failure must not end the connection
            log.exception("replica: handling %s failed", type(msg).__name__)
            rid = getattr(msg, "id", None)
            if isinstance(msg, P.Generate) and rid in self.live:
                self.client.abort(self.live.pop(rid))
            self.sink(P.Error(code=P.INTERNAL, message=f"replica failed to handle it: {type(e).__name__}",
                              id=rid if isinstance(rid, str) else None))

    def _on_message(self, msg) -> None:
        if isinstance(msg, P.Generate):
            if not msg.id or len(msg.id) > MAX_ID_CHARS:  # named by nobody: not echoed back
                self.sink(P.Error(code=P.BAD_REQUEST, message=f"request ids are 1..{MAX_ID_CHARS} characters"))
                return
            self.seen_id = msg.id  # counted from now on by every Load (a refusal's Error goes out before it)
            if msg.id in self.live:
                self.sink(P.Error(code=P.BAD_REQUEST, message=f"request id {msg.id!r} is already in flight",
                                  id=msg.id))
                return
            engine_id = f"{self.prefix}{next(self._seq)}"
            self.live[msg.id], self.names[engine_id] = engine_id, msg.id
            msg.id = engine_id
            self.client.submit(msg, self.sink)  # a rejection comes back through sink at once
        elif isinstance(msg, P.Abort):
            engine_id = self.live.pop(msg.id, None)
            if engine_id is not None:
                self.names.pop(engine_id, None)
                self.client.abort(engine_id)
        else:
            self.sink(P.Error(code=P.BAD_REQUEST, message=f"unexpected message {type(msg).__name__}"))

    def _id_of(self, raw) -> str | None:
        """The request id of a message that did not decode, when it has a usable one that
        names no live request (an error must not end a request that is fine)."""
        try:
            fields = split_frame(raw)  # a message is an array too: [tag, id, ...]; no recursion
            rid = msgspec.msgpack.decode(fields[1]) if len(fields) > 1 else None
        except (ValueError, msgspec.DecodeError, RecursionError):
            return None
        ok = isinstance(rid, str) and 0 < len(rid) <= MAX_ID_CHARS and rid not in self.live
        return rid if ok else None

    def close(self) -> None:
        """The proxy's socket is gone: write nothing more, abort its requests."""
        self.writer.stop()
        for engine_id in self.live.values():
            self.client.abort(engine_id)
        self.live.clear()
        self.names.clear()


def create_app(cfg: EngineConfig, tokenizer: Tokenizer, *, model_name: str, secret: str,
               replica_id: str = "replica", metrics_token: str = "", drain: Drain | None = None,
               role: str = "both") -> RequireSecret:
    """The API process's ASGI app; every path but /healthz requires `secret` (never optional);
    GET /metrics takes `metrics_token` too (Prometheus' read-only credential), where one is given.
    `drain`: started by POST /v1/drain (and by the server on SIGTERM); its end exits the server.
    `role`: said in the Hello (wire.protocol.ROLES: prefill/decode disaggregation, edge_proxy.disagg)."""
    client_box: dict[str, EngineClient] = {}
    drain = drain or Drain()
    fingerprint = tokenizer.fingerprint  # hashed once here, not on the event loop when a proxy connects
    metrics = ReplicaMetrics(lambda: client_box["c"].load if "c" in client_box else None)
    kv_transport = HttpKvTransport(secret)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        client = EngineClient(cfg, tokenizer, replica_id, metrics)
        client_box["c"] = client
        await client.start()
        try:
            yield
        finally:
            await kv_transport.aclose()
            await client.stop()

    def client() -> EngineClient:
        return client_box["c"]

    drain.client = client

    # -- proxy WebSocket (called with the raw ASGI send: wire.ws_frames.WebSocketFront) --
    async def replica_ws(scope, receive, send):
        ws = WebSocket(scope, receive, send)
        await ws.accept()
        c = client()
        if not c.ready.is_set():  # no Hello without an engine: the proxy retries the connection
            await ws.close(code=ENGINE_RESTARTING, reason="engine process restarting")
            return
        conn = ReplicaConnection(c, send)
        # The served name (not the spec), and the fingerprint of the tokenizer the proxy must use.
        conn.sink(msgspec.structs.replace(c.hello, model=model_name, tokenizer=fingerprint,
                                          role="" if role == "both" else role, kv_slots=0, kv_slot_bytes=0))
        conn.sink(P.KvEvents(stored=list(c.cached_blocks), cleared=True))
        if c.load is not None:
            conn.sink(c.load)
        c.subscribers.add(conn.sink)
        c.lost_listeners.add(conn.shut)
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
            c.lost_listeners.discard(conn.shut)
            conn.close()

    # -- OpenAI HTTP -------------------------------------------------------------------
    def c_max_len() -> int:
        h = client().hello
        return h.max_model_len if h else 2048

    oa = OpenAIRoutes(ReplicaBackend(client, tokenizer, model_name, metrics, c_max_len, cfg.max_num_seqs))

    async def healthz(request: Request):
        c = client_box.get("c")
        if c is None or not c.ready.is_set():  # starting, or its engine process restarting
            return JSONResponse({"status": "unavailable"}, status_code=503)
        ld = c.load
        return JSONResponse({"status": "ok", "replica": replica_id, "model": model_name,
                             "running": ld.running if ld else 0, "waiting": ld.waiting if ld else 0,
                             "draining": c.draining})

    async def drain_endpoint(request: Request):
        if "c" not in client_box:
            return JSONResponse({"error": {"message": "the replica is starting", "code": 503}}, status_code=503)
        drain.start()
        return JSONResponse({"draining": True, "streams": len(client().streams)}, status_code=202)

    async def metrics_endpoint(request: Request):
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    routes = [
        *(Route(path, endpoint, methods=methods) for path, endpoint, methods in oa.routes()),
        Route("/healthz", healthz),
        Route("/health", healthz),  # what routers built for vLLM/SGLang workers probe
        Route("/metrics", metrics_endpoint),
        Route("/v1/drain", drain_endpoint, methods=["POST"]),
        *KvRoutes(client, kv_transport, drain.holds).routes(),  # KV export and import between replicas
        *PrefillRoute(client).routes(),  # a prompt computed for another replica to pull
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    return RequireSecret(WebSocketFront(app, "/v1/replica", replica_ws), secret, open_paths=("/healthz", "/health"),
                         metrics_token=metrics_token, metrics_path="/metrics")
