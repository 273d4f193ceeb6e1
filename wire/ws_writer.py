"""The one writer of the per-token WebSocket senders: the proxy's client sockets
(`edge_proxy.ws_requests`, JSON text frames) and the replica's proxy sockets
(`replica.api.app`, one msgpack binary frame per write).

A sender queues messages in its *box* and wakes its `FrameWriter`; the box decides
what the queued messages become (the client outbox merges a stream's tokens into one
delta, `Batch` packs every message into one frame), the writer decides when and how
they leave:

- under uvicorn's sans-I/O protocol (`ws_frames.direct_protocol`), at the end of the
  event-loop turn that queued them (`TurnFlusher`: one callback per turn for all the
  writers touched in it), as consecutive frames in one `transport.write`, waking no
  task (`ws_frames`: why this is safe);
- while the transport is over its high-water mark (uvicorn's `pause_writing`, 64 KiB),
  one task waits for it to drain and then writes everything queued meanwhile, which
  the box has coalesced; once the connection is gone (`ws_frames.gone`) what is queued
  is dropped (the connection's own end cleans up its requests);
- with any other ASGI server, one task sends the box's messages through ASGI `send`,
  one ASGI message each, while what queues behind a blocked send coalesces in the box.

How much a box may hold is its owner's policy: a client that falls too far behind is
closed (`close`, 1008 `too_slow`); the replica's box is unbounded (its reader is a proxy).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol

from wire.ws_frames import TEXT, direct_protocol, gone, server_frame


class Box(Protocol):
    """What a writer sends: messages queued since its last write."""

    def __bool__(self) -> bool: ...  # anything queued

    def take(self) -> list[bytes]: ...  # the payloads of the messages to send now, in order; empties the box

    def clear(self) -> None: ...  # drop everything queued


class Batch:
    """A box whose queued messages leave as one payload, `encode(messages)` (a msgpack array)."""

    __slots__ = ("encode", "messages")

    def __init__(self, encode):
        self.encode = encode
        self.messages: list = []

    def __bool__(self) -> bool:
        return bool(self.messages)

    def append(self, msg) -> None:
        self.messages.append(msg)

    def take(self) -> list[bytes]:
        messages, self.messages = self.messages, []
        return [self.encode(messages)]

    def clear(self) -> None:
        self.messages = []


class TurnFlusher:
    """Flushes every writer touched in this event-loop turn, once, at its end."""

    __slots__ = ("dirty", "scheduled")

    def __init__(self):
        self.dirty: list[FrameWriter] = []
        self.scheduled = False

    def mark(self, writer: FrameWriter) -> None:
        self.dirty.append(writer)
        if not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        dirty, self.dirty, self.scheduled = self.dirty, [], False
        for w in dirty:
            w.flush()


class FrameWriter:
    """Writes one socket's `box` (see the module's docstring); `send` is the raw ASGI send
    (uvicorn's own: `ws_frames.WebSocketFront`), `opcode` the frames' (TEXT or BINARY),
    `flusher` shared by the writers of one server (default: the writer's own)."""

    __slots__ = ("send", "box", "opcode", "proto", "flusher", "closed", "_marked", "_task", "_closer")

    def __init__(self, send, box: Box, opcode: int = TEXT, flusher: TurnFlusher | None = None):
        self.send, self.box, self.opcode = send, box, opcode
        self.proto = direct_protocol(send)  # uvicorn's protocol: frames straight into its transport; or None
        self.flusher = flusher or TurnFlusher()
        self.closed = False  # nothing more is written
        self._marked = False  # on the flusher for this turn
        self._task: asyncio.Task | None = None  # the ASGI sender, or the task waiting for the transport to drain
        self._closer: asyncio.Task | None = None

    def wake(self) -> None:
        """Something was queued in the box (the hot path: no task is woken under uvicorn)."""
        if self.closed:
            self.box.clear()
        elif self._task is not None:
            return  # a send blocked on the client, or a wait for the transport: it takes this along
        elif self.proto is None:
            self._task = asyncio.get_running_loop().create_task(self._send_all())
        elif not self._marked:
            self._marked = True
            self.flusher.mark(self)

    def flush(self) -> None:
        """Write what is queued into the transport now, unless it is full (then a task waits for it)."""
        self._marked = False
        if self.closed or self._task is not None or not self.box:
            return
        proto = self.proto
        if gone(proto):
            self.box.clear()
        elif proto.writable.is_set():
            op = self.opcode
            proto.transport.write(b"".join([server_frame(p, op) for p in self.box.take()]))
        else:
            self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        try:
            await self.proto.writable.wait()  # uvicorn sets it on resume_writing and on connection_lost
        finally:
            self._task = None
        self.flush()

    async def _send_all(self) -> None:
        send, text = self.send, self.opcode == TEXT
        try:
            while self.box and not self.closed:
                for p in self.box.take():
                    await send({"type": "websocket.send", "text": p.decode()} if text
                               else {"type": "websocket.send", "bytes": p})
        except (OSError, RuntimeError):  # the client is gone (uvicorn's ClientDisconnected), or the socket closed
            self.closed = True
            self.box.clear()
        finally:
            self._task = None

    def close(self, code: int, reason: str, drain: bool = False) -> None:
        """Close the socket with `code` (through ASGI send: the server runs the closing
        handshake). With `drain`, after everything queued has been written, else at once,
        dropping it."""
        if not drain:
            self.closed = True
            self.box.clear()
        self._closer = asyncio.get_running_loop().create_task(self._close(code, reason, drain))

    async def _close(self, code: int, reason: str, drain: bool) -> None:
        if drain:
            if self.proto is not None:
                self.flush()
            elif self.box and self._task is None:
                self.wake()
            while self._task is not None:
                await self._task
            self.closed = True
            self.box.clear()
        with contextlib.suppress(OSError, RuntimeError):  # already gone
            await self.send({"type": "websocket.close", "code": code, "reason": reason})

    def stop(self) -> None:
        """The connection is over: write nothing more, end the writer's tasks."""
        self.closed = True
        self.box.clear()
        for t in (self._task, self._closer):
            if t is not None:
                t.cancel()
