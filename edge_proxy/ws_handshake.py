"""The public WebSocket's front door (`/v1/stream`): who may open one.

Handshake checks, in order: Origin (the page's own origin, or the `--allowed-origin`
list; 403), subprotocols (an offer must include `edgechat.v1`; 400), failed-auth
throttle of the source address (429), API key from `Authorization: Bearer` or the
subprotocol `bearer.<key>` (401), draining (503). A refusal is an HTTP answer with a
JSON body in the public protocol's error shape (`Retry-After` where it has one).

`StreamEndpoint` is a plain ASGI callable mounted in front of Starlette (see `app.py`,
`wire.ws_frames.WebSocketFront`), so the accepted socket keeps uvicorn's own `send`;
Starlette's `WebSocket` does the handshake only. An accepted socket is a
`ws_requests.ClientConnection`; every connection of a server shares one
`wire.ws_writer.TurnFlusher` (one write per client per event-loop turn).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.responses import JSONResponse
from starlette.websockets import WebSocket

from edge_proxy import protocol as pp
from edge_proxy.auth import bearer
from edge_proxy.peering import FORWARDED_HEADER
from edge_proxy.ws_requests import ClientConnection
from wire.ws_writer import TurnFlusher

SUBPROTOCOL = "edgechat.v1"
KEY_SUBPROTOCOL_PREFIX = "bearer."

_DEFAULT_PORTS = {"http": 80, "ws": 80, "https": 443, "wss": 443}
_DENY_STATUS = {pp.UNAUTHORIZED: 401, pp.RATE_LIMITED: 429}


def same_origin(origin: str, host: str | None, scheme: str) -> bool:
    """Does `origin` (scheme://host[:port]) name the server the request came to (its Host header,
    over `scheme`: ws/http or wss/https)? A page the proxy serves itself connects from there."""
    try:
        o = urlsplit(origin)
        port = o.port or _DEFAULT_PORTS.get(o.scheme)
        h = urlsplit(f"//{host}") if host else None
        hport = (h.port if h is not None else None) or _DEFAULT_PORTS.get(scheme)
    except ValueError:
        return False
    secure = scheme in ("https", "wss")
    return (h is not None and o.hostname is not None and o.scheme == ("https" if secure else "http")
            and o.hostname == h.hostname and port == hport)


def origin_allowed(origin: str | None, allowed: tuple[str, ...], host: str | None = None,
                   scheme: str = "ws") -> bool:
    """Non-browser clients send no Origin; browsers must come from the server's own origin
    (its page at `/`) or one on the allowlist."""
    return origin is None or "*" in allowed or origin in allowed or same_origin(origin, host, scheme)


def _deny(status: int, code: str, message: str, retry_after_s: float | None = None) -> JSONResponse:
    body = {"type": "error", "code": code, "message": message}
    headers = None
    if retry_after_s:
        body["retry_after_s"] = retry_after_s
        headers = {"Retry-After": str(max(1, round(retry_after_s)))}
    return JSONResponse(body, status_code=status, headers=headers)


class StreamEndpoint:
    """ASGI app for the public WebSocket (`/v1/stream`)."""

    def __init__(self, proxy):
        self.proxy = proxy
        self.flusher = TurnFlusher()

    async def __call__(self, scope, receive, send) -> None:
        proxy, ws = self.proxy, WebSocket(scope, receive, send)
        if not origin_allowed(ws.headers.get("origin"), proxy.cfg.allowed_origins, ws.headers.get("host"),
                              scope.get("scheme", "ws")):
            await ws.send_denial_response(_deny(403, pp.FORBIDDEN, "origin not allowed"))
            return
        offered = [p.strip() for h in ws.headers.getlist("sec-websocket-protocol") for p in h.split(",")]
        offered = [p for p in offered if p]
        if offered and SUBPROTOCOL not in offered:  # we could select none: browsers fail such a handshake
            await ws.send_denial_response(_deny(400, pp.BAD_REQUEST, f"offer the subprotocol {SUBPROTOCOL!r}"))
            return
        token = bearer(ws.headers.get("authorization"))
        if token is None:
            token = next((p[len(KEY_SUBPROTOCOL_PREFIX):] for p in offered if p.startswith(KEY_SUBPROTOCOL_PREFIX)),
                         None)
        client = scope.get("client")
        try:
            key = proxy.authenticate(token, client[0] if client else None)
        except pp.ProtocolError as e:
            await ws.send_denial_response(_deny(_DENY_STATUS[e.code], e.code, e.message, e.retry_after_s))
            return
        if proxy.draining:
            await ws.send_denial_response(_deny(503, pp.SHUTTING_DOWN, "the proxy is draining"))
            return
        await ws.accept(subprotocol=SUBPROTOCOL if offered else None)
        await ClientConnection(receive, send, proxy, key, ws.headers.get(FORWARDED_HEADER), self.flusher).run()
