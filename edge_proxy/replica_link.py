"""One WebSocket client connection to a replica, as a plain asyncio Protocol over
websockets' sans-I/O `ClientProtocol`.

Why not `websockets.asyncio.client`: its reader puts each frame in a queue and
wakes a task that `await`s it. Here a frame is decoded and handed to its streams
inside `data_received`, in the same loop callback the bytes arrived in: one task
switch fewer on every token's way to the client, and no per-frame allocation of
futures. Outgoing frames are written straight to the transport (the caller
batches messages per loop iteration).

`closed` resolves to a `LinkClosed(code, reason)` when the connection ends; a
refused handshake raises `LinkRefused(status)` from `connect`.
"""

from __future__ import annotations

import asyncio
import os
from time import perf_counter

from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.protocol import State
from websockets.uri import parse_uri


class LinkRefused(Exception):
    """The server answered the upgrade with an HTTP status instead of 101."""

    def __init__(self, status: int):
        super().__init__(f"handshake answered HTTP {status}")
        self.status = status


class LinkClosed(Exception):
    def __init__(self, code: int | None, reason: str):
        super().__init__(f"closed ({code}): {reason}")
        self.code, self.reason = code, reason


class ReplicaLink(asyncio.Protocol):
    def __init__(self, url: str, headers: dict[str, str] | None, on_frame, max_size: int):
        self.proto = ClientProtocol(parse_uri(url), max_size=max_size)
        self.request = self.proto.connect()
        for k, v in (headers or {}).items():
            self.request.headers[k] = v
        self.on_frame = on_frame  # (bytes, perf_counter time) -> None, may be swapped after Hello
        loop = asyncio.get_running_loop()
        self.opened: asyncio.Future[None] = loop.create_future()
        self.closed: asyncio.Future[LinkClosed] = loop.create_future()  # resolved (not raised) on loss
        self.transport: asyncio.Transport | None = None
        self.last_pong = perf_counter()
        self.up = False  # set by the owner once the peer proved to be a replica (Hello)
        self._frag: list[bytes] = []

    # -- asyncio.Protocol ------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.proto.send_request(self.request)
        self._write_out()

    def data_received(self, data: bytes) -> None:
        now = perf_counter()
        proto = self.proto
        proto.receive_data(data)
        for ev in proto.events_received():
            if type(ev) is Frame:
                op = ev.opcode
                if op is Opcode.BINARY or op is Opcode.TEXT:
                    if ev.fin:
                        self.on_frame(ev.data, now)
                    else:
                        self._frag.append(ev.data)
                elif op is Opcode.CONT:
                    self._frag.append(ev.data)
                    if ev.fin:
                        data, self._frag = b"".join(self._frag), []
                        self.on_frame(data, now)
                elif op is Opcode.PONG:
                    self.last_pong = now
            elif type(ev) is Response and not self.opened.done():
                if proto.handshake_exc is None:
                    self.opened.set_result(None)
                else:
                    self.opened.set_exception(LinkRefused(ev.status_code))
        self._write_out()  # pongs, close replies
        if proto.state is State.CLOSED or proto.close_expected():
            self.transport.close()

    def eof_received(self) -> bool:
        self.proto.receive_eof()
        self._write_out()
        return False

    def connection_lost(self, exc) -> None:
        p = self.proto
        code = p.close_rcvd.code if p.close_rcvd is not None else None
        reason = p.close_rcvd.reason if p.close_rcvd is not None else (str(exc) if exc else "connection lost")
        err = LinkClosed(code, reason)
        if not self.opened.done():
            self.opened.set_exception(err)
        if not self.closed.done():
            self.closed.set_result(err)

    # -- sending ---------------------------------------------------------------

    def _write_out(self) -> None:
        out = self.proto.data_to_send()
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(out))

    def send(self, data: bytes) -> None:
        if self.proto.state is State.OPEN:
            self.proto.send_binary(data)
            self._write_out()

    def ping(self) -> None:
        if self.proto.state is State.OPEN:
            self.proto.send_ping(os.urandom(4))
            self._write_out()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    async def connect(self, timeout: float) -> None:
        """Open the TCP connection and complete the WebSocket handshake.
        Raises OSError, TimeoutError, LinkRefused or LinkClosed."""
        uri = self.proto.uri
        if uri.secure:
            raise ValueError(f"wss:// replicas are not supported yet: {uri}")
        try:
            async with asyncio.timeout(timeout):
                await asyncio.get_running_loop().create_connection(lambda: self, uri.host, uri.port)
                await self.opened
        except BaseException:
            self.abort()
            raise
