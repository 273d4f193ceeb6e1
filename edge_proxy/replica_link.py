"""One WebSocket client connection to a replica: a plain asyncio Protocol with its
own small RFC 6455 framing, because this is the per-token hot path.

Why not `websockets.asyncio.client`: its reader queues each frame and wakes a task
that awaits it. Here a frame is decoded and handed to its streams inside
`data_received`, in the loop callback its bytes arrived in: one task switch fewer
per token. Why not websockets' sans-I/O parser either: it is a stack of
generators, about 7 us per frame warm but 70 us cold, and a stream at 20 tokens/s
is always cold. The subset needed between our proxy and our replica is small:

- transport: TCP for `ws://`, TLS for `wss://` (the pool's SSLContext: the system's
  CAs, or `--replica-ca` for a private one);
- handshake: GET with `Sec-WebSocket-Key` (+ `Authorization`); expects 101 and
  the matching `Sec-WebSocket-Accept` (helpers from `websockets.utils`); any other
  status raises `LinkRefused(status)`. No extensions, no subprotocols.
- incoming frames (server -> client, never masked): binary/text, possibly
  fragmented; ping (answered with pong), pong (recorded), close (answered).
  Frames over `max_size` or masked frames close the link (1009 / 1002).
- outgoing frames are masked, as clients must (mask keys from `os.urandom`).

`closed` resolves to `LinkClosed(code, reason)` when the connection ends.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import struct
from time import perf_counter
from urllib.parse import urlsplit

from websockets.utils import accept_key, generate_key

try:
    from websockets.speedups import apply_mask
except ImportError:  # pragma: no cover - the C speedups ship with websockets wheels
    from websockets.utils import apply_mask

OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
MAX_HEADER_BYTES = 16 << 10
_U16, _U64 = struct.Struct("!H"), struct.Struct("!Q")


class LinkRefused(Exception):
    """The server answered the upgrade with an HTTP status other than 101."""

    def __init__(self, status: int):
        super().__init__(f"handshake answered HTTP {status}")
        self.status = status


class LinkClosed(Exception):
    def __init__(self, code: int | None, reason: str):
        super().__init__(f"closed ({code}): {reason}")
        self.code, self.reason = code, reason


def encode_frame(opcode: int, payload: bytes) -> bytes:
    """A final, masked client frame."""
    n = len(payload)
    if n < 126:
        head = bytes((0x80 | opcode, 0x80 | n))
    elif n < 1 << 16:
        head = bytes((0x80 | opcode, 0x80 | 126)) + _U16.pack(n)
    else:
        head = bytes((0x80 | opcode, 0x80 | 127)) + _U64.pack(n)
    mask = os.urandom(4)
    return head + mask + apply_mask(payload, mask)


class ReplicaLink(asyncio.Protocol):
    def __init__(self, url: str, headers: dict[str, str] | None, on_frame, max_size: int,
                 ssl_context: ssl.SSLContext | None = None):
        u = urlsplit(url)
        if u.scheme not in ("ws", "wss") or not u.hostname:
            raise ValueError(f"replica URL must look like ws://host:port/path (or wss://), got {url!r}")
        self.host, self.port = u.hostname, u.port or (443 if u.scheme == "wss" else 80)
        self.ssl = (ssl_context or ssl.create_default_context()) if u.scheme == "wss" else None
        self.path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        self.headers = headers or {}
        self.on_frame = on_frame  # (bytes, perf_counter time) -> None; may be swapped after Hello
        self.max_size = max_size
        loop = asyncio.get_running_loop()
        self.opened: asyncio.Future[None] = loop.create_future()
        self.closed: asyncio.Future[LinkClosed] = loop.create_future()  # resolved (not raised) on loss
        self.transport: asyncio.Transport | None = None
        self.last_pong = perf_counter()
        self.up = False  # set by the owner once the peer proved to be a replica (Hello)
        self._key = generate_key()
        self._buf = bytearray()
        self._frag: list[bytes] = []
        self._open = False
        self._close_code: int | None = None
        self._close_reason = ""

    # -- asyncio.Protocol ------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        lines = [f"GET {self.path} HTTP/1.1", f"Host: {self.host}:{self.port}", "Upgrade: websocket",
                 "Connection: Upgrade", f"Sec-WebSocket-Key: {self._key}", "Sec-WebSocket-Version: 13"]
        lines += [f"{k}: {v}" for k, v in self.headers.items()]
        transport.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))

    def data_received(self, data: bytes) -> None:
        now = perf_counter()
        buf = self._buf
        buf += data
        if not self._open and not self._handshake():
            return
        pos, n = 0, len(buf)
        while n - pos >= 2:
            b0, b1 = buf[pos], buf[pos + 1]
            length, hdr = b1 & 0x7F, 2
            if length == 126:
                if n - pos < 4:
                    break
                length, hdr = _U16.unpack_from(buf, pos + 2)[0], 4
            elif length == 127:
                if n - pos < 10:
                    break
                length, hdr = _U64.unpack_from(buf, pos + 2)[0], 10
            if b1 & 0x80:
                self._fail(1002, "masked frame from the server")
                return
            if length > self.max_size:
                self._fail(1009, f"frame of {length} bytes over {self.max_size}")
                return
            if n - pos < hdr + length:
                break
            payload = bytes(buf[pos + hdr:pos + hdr + length])
            pos += hdr + length
            op = b0 & 0x0F
            if op == OP_BINARY or op == OP_TEXT or op == OP_CONT:
                if b0 & 0x80 and not self._frag:
                    self.on_frame(payload, now)
                else:
                    self._frag.append(payload)
                    if b0 & 0x80:
                        payload, self._frag = b"".join(self._frag), []
                        self.on_frame(payload, now)
            elif op == OP_PING:
                self._write(encode_frame(OP_PONG, payload))
            elif op == OP_PONG:
                self.last_pong = now
            elif op == OP_CLOSE:
                self._on_close(payload)
                return
            else:
                self._fail(1002, f"unknown opcode {op}")
                return
            if self.transport is None or self.transport.is_closing():
                return  # the frame's handler closed the link
        del buf[:pos]

    def _handshake(self) -> bool:
        """Parse the 101 response from the buffer; True once open (leftover bytes are frames)."""
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > MAX_HEADER_BYTES:
                self._fail_open(LinkRefused(0))
            return False
        head = bytes(self._buf[:end]).decode("latin-1").split("\r\n")
        del self._buf[:end + 4]
        parts = head[0].split(" ", 2)
        status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
        fields = {}
        for line in head[1:]:
            k, _, v = line.partition(":")
            fields[k.strip().lower()] = v.strip()
        if status != 101:
            self._fail_open(LinkRefused(status))
            return False
        if (fields.get("upgrade", "").lower() != "websocket"
                or fields.get("sec-websocket-accept") != accept_key(self._key)):
            self._fail_open(LinkRefused(status))
            return False
        self._open = True
        self.last_pong = perf_counter()  # keepalive counts from the upgrade, not from a connect that waited
        if not self.opened.done():
            self.opened.set_result(None)
        return True

    def _on_close(self, payload: bytes) -> None:
        if len(payload) >= 2:
            self._close_code = _U16.unpack_from(payload)[0]
            self._close_reason = payload[2:].decode(errors="replace")
        else:
            self._close_code = 1005
        self._write(encode_frame(OP_CLOSE, payload[:2]))
        self.transport.close()

    def _fail(self, code: int, reason: str) -> None:
        self._close_code, self._close_reason = code, reason
        self._write(encode_frame(OP_CLOSE, _U16.pack(code) + reason.encode()[:120]))
        self.transport.abort()

    def _fail_open(self, exc: Exception) -> None:
        if not self.opened.done():
            self.opened.set_exception(exc)
        self.transport.abort()

    def connection_lost(self, exc) -> None:
        reason = self._close_reason or (str(exc) if exc else "connection lost")
        err = LinkClosed(self._close_code, reason)
        if not self.opened.done():
            self.opened.set_exception(err)
        if not self.closed.done():
            self.closed.set_result(err)

    # -- sending ---------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        t = self.transport
        if t is not None and not t.is_closing():
            t.write(data)

    def send(self, data: bytes) -> None:
        if self._open:
            self._write(encode_frame(OP_BINARY, data))

    def ping(self) -> None:
        if self._open:
            self._write(encode_frame(OP_PING, os.urandom(4)))

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    async def connect(self, timeout: float) -> None:
        """Open the TCP connection and complete the WebSocket handshake.
        Raises OSError, TimeoutError, LinkRefused or LinkClosed."""
        try:
            async with asyncio.timeout(timeout):
                await asyncio.get_running_loop().create_connection(
                    lambda: self, self.host, self.port, ssl=self.ssl, server_hostname=self.host if self.ssl else None)
                await self.opened
        except BaseException:
            if not self.opened.done():
                self.opened.cancel()  # nobody will await it any more
            self.abort()
            raise
