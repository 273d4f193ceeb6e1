"""Server WebSocket frames written straight into uvicorn's transport (proxy and replica).

Under uvicorn's sans-I/O websockets protocol (`ws="websockets-sansio"`, what both
servers run) a server frame is a 2-10 byte header and the payload, and the
websockets state machine behind ASGI `send` (a Frame object, extension hooks, an
output queue, `writable.wait()` and a task switch per message) costs more than
the rest of a token's per-hop work. The per-token senders (the proxy's client
sockets, the replica's proxy sockets) write whole frames themselves from the event
loop's thread, through their one writer (`wire.ws_writer.FrameWriter`); pings, pongs
and the close handshake stay with uvicorn, which also writes whole frames from that
thread, so the two never interleave inside one. With permessage-deflate negotiated
an uncompressed message (RSV1 clear) is still valid (RFC 7692 6).
"""

from __future__ import annotations

import struct

try:  # the protocol uvicorn runs for ws="websockets-sansio"
    from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
except ImportError:  # pragma: no cover - another uvicorn: frames go through ASGI send
    WebSocketsSansIOProtocol = None

TEXT, BINARY = 0x1, 0x2
_U16, _U64 = struct.Struct("!BBH"), struct.Struct("!BBQ")


def server_frame(payload: bytes, opcode: int = TEXT) -> bytes:
    """A final, unmasked server frame (RFC 6455 5.2) carrying `payload`."""
    n, b0 = len(payload), 0x80 | opcode
    if n < 126:
        return bytes((b0, n)) + payload
    if n < 1 << 16:
        return _U16.pack(b0, 126, n) + payload
    return _U64.pack(b0, 127, n) + payload


def text_frame(payload: bytes) -> bytes:
    """A final server text frame carrying UTF-8 `payload`."""
    return server_frame(payload, TEXT)


def binary_frame(payload: bytes) -> bytes:
    return server_frame(payload, BINARY)


def direct_protocol(send):
    """uvicorn's protocol object behind an ASGI `send`, when frames may be written to its transport."""
    proto = getattr(send, "__self__", None)
    if WebSocketsSansIOProtocol is None or not isinstance(proto, WebSocketsSansIOProtocol):
        return None
    if not all(hasattr(proto, a) for a in ("transport", "writable", "disconnected", "close_sent")):
        return None  # pragma: no cover - a uvicorn whose protocol keeps its state elsewhere
    return proto


def gone(proto) -> bool:
    """Is `proto`'s connection closed or closing (nothing more may be written to it)?"""
    return proto.disconnected or proto.close_sent or proto.transport.is_closing()


class WebSocketFront:
    """Plain ASGI front: the per-token WebSocket at `path` goes straight to `handler` with
    uvicorn's own `send` (Starlette's exception wrapper would hide the protocol behind it,
    and `direct_protocol` would find nothing); HTTP, the lifespan and anything else go to
    the Starlette `app`."""

    def __init__(self, app, path: str, handler):
        self.app, self.path, self.handler = app, path, handler
        self.state = app.state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "websocket" and scope["path"] == self.path:
            await self.handler(scope, receive, send)
        else:
            await self.app(scope, receive, send)
