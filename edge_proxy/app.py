"""The ASGI app: routes only. Starlette and uvicorn move bytes; `core.Proxy` decides.

    WS   /v1/stream              public protocol (edge_proxy.protocol)
    GET  /, /static/*            the chat page (plain HTML + JS modules from edge_proxy/static, no build step)
    POST /v1/chat/completions    OpenAI-compatible, SSE with "stream": true
    POST /v1/completions
    POST /infill                 llama.cpp's fill-in-the-middle (IDE plugins)
    GET  /v1/models[/{id}]       each with its context length (max_model_len)
    POST /tokenize, /detokenize  vLLM's (also llama.cpp's /tokenize body); rendered and tokenized off the loop
    GET  /version                {"version": ...}
    GET  /props                  what IDE plugins read of llama.cpp's (n_ctx, total_slots, chat_template, ...)
    anything else                a JSON 404 / 405 in OpenAI's error shape
    GET  /healthz, /health       200 while serving; 503 when draining or no replica is ready (no key needed)
    GET  /metrics                Prometheus text, every worker's together (edge_proxy.metrics)

CORS: with `--allowed-origin`, the HTTP API answers preflights and cross-origin requests
from those origins (Starlette's CORSMiddleware); the page at `/` needs none (same origin).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from edge_proxy.auth import ENV_VAR, KeyStore, load_entries
from edge_proxy.config import ProxyConfig
from edge_proxy.connections import ConnectionGuard
from edge_proxy.core import Proxy
from edge_proxy.openai_api import ProxyBackend
from edge_proxy.prompt import load_tokenizer
from edge_proxy.ws_handshake import StreamEndpoint
from wire.metrics import CONTENT_TYPE
from wire.openai_routes import OpenAIRoutes
from wire.openai_stream import http_error
from wire.ws_frames import WebSocketFront


STATIC = Path(__file__).with_name("static")
# The page loads nothing but its own files and talks only to its own origin.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache",
}
CORS_HEADERS = ["Authorization", "Content-Type", "X-Session-ID", "X-Priority", "X-Deadline-Ms", "traceparent"]


def cors(origins: tuple[str, ...]) -> list[Middleware]:
    """CORS for the HTTP API from `origins` (`--allowed-origin`; "*" for any). Keys travel in the
    Authorization header, never cookies, so no credentials mode is offered."""
    if not origins:
        return []
    return [Middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["GET", "POST"],
                       allow_headers=CORS_HEADERS, expose_headers=["Retry-After"], max_age=600)]


class StaticPage(StaticFiles):
    """The page's files, with the page's headers."""

    def file_response(self, *args, **kw):
        r = super().file_response(*args, **kw)
        r.headers.update(PAGE_HEADERS)
        return r


def build_proxy(cfg: ProxyConfig, tokenizer=None, keys: KeyStore | None = None, tracer=None) -> Proxy:
    if keys is None:
        entries = load_entries(cfg.api_keys_file or None, cfg.api_keys_env or os.environ.get(ENV_VAR))
        keys = KeyStore(entries, salt_secret=cfg.pool.secret, anonymous=cfg.allow_anonymous)
    return Proxy(cfg, tokenizer if tokenizer is not None else load_tokenizer(cfg.tokenizer), keys, tracer=tracer)


class EdgeApp(WebSocketFront):
    """The public WebSocket `/v1/stream` (the per-token hot path) straight to its endpoint,
    the rest to Starlette. `guard` is the connection guard the server's protocols report
    to (`server.uvicorn_config`)."""

    def __init__(self, app: Starlette, stream: StreamEndpoint, guard: ConnectionGuard):
        super().__init__(app, "/v1/stream", stream)
        self.guard = guard


def create_app(proxy: Proxy) -> EdgeApp:
    oa = OpenAIRoutes(ProxyBackend(proxy))
    guard = ConnectionGuard(proxy.cfg.connections)

    async def healthz(request: Request):
        ready = len(proxy.pool.ready())
        ok = ready > 0 and not proxy.draining
        return JSONResponse({"status": "ok" if ok else ("draining" if proxy.draining else "no_replica"),
                             "replicas_ready": ready, "prefill_ready": len(proxy.pool.prefill_ready()),
                             "inflight": len(proxy.streams) + len(proxy.forwarding),
                             "connections": len(guard), "pid": os.getpid()},
                            status_code=200 if ok else 503)

    async def metrics(request: Request):
        return Response(proxy.render_metrics(), media_type=CONTENT_TYPE)

    async def page(request: Request):
        return FileResponse(STATIC / "index.html", headers=PAGE_HEADERS)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await proxy.start()
        try:
            yield
        finally:
            await proxy.stop()

    app = Starlette(routes=[
        *(Route(path, endpoint, methods=methods) for path, endpoint, methods in oa.routes()),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/health", healthz, methods=["GET"]),  # vLLM's and llama.cpp's name (llama.vscode probes it)
        Route("/metrics", metrics, methods=["GET"]),
        Route("/", page, methods=["GET"]),
        Mount("/static", StaticPage(directory=STATIC)),
    ], lifespan=lifespan, exception_handlers={HTTPException: http_error}, middleware=cors(proxy.cfg.allowed_origins))
    app.state.proxy = proxy
    return EdgeApp(app, StreamEndpoint(proxy), guard)
