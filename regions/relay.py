"""Latency emulation in userspace: a TCP relay that delays each direction by a
one-way latency with jitter, preserving byte order.

Every chunk read on one side is written to the other side at

    deliver_at = max(previous deliver_at, read_time + one_way * (1 + U(-j, j)))

so jitter never reorders bytes (TCP would not either), and a burst keeps its
spacing. A new connection pays the TCP handshake too: the relay opens the
upstream socket at once but holds the client's first bytes until one RTT after
accept, as a real SYN / SYN-ACK exchange would. No kernel netem needed.

Backpressure: each direction buffers at most `max_buffer` bytes (1 MiB) of
delayed data; past that the relay stops reading that side until the writer
catches up, so a fast sender cannot grow the relay's memory without bound.

    relay = await Relay(listen_port, "127.0.0.1", upstream_port, rtt_ms=80, jitter=0.1).start()
    ...
    await relay.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
from collections import deque
from time import perf_counter

CHUNK = 64 << 10
MAX_BUFFER = 1 << 20


class _Pipe:
    """One direction: read chunks, hold each until its delivery time, write in order."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float, jitter: float,
                 rng: random.Random, not_before: float = 0.0, max_buffer: int = MAX_BUFFER):
        self.reader, self.writer = reader, writer
        self.delay_s, self.jitter, self.rng = delay_s, jitter, rng
        self.not_before = not_before  # nothing leaves before this (handshake emulation)
        self.max_buffer = max_buffer
        self.queue: deque[tuple[float, bytes]] = deque()
        self.buffered = 0
        self.last_due = 0.0
        self.wake = asyncio.Event()
        self.room = asyncio.Event()
        self.room.set()

    def _due(self, now: float) -> float:
        d = self.delay_s
        if self.jitter:
            d *= 1.0 + self.rng.uniform(-self.jitter, self.jitter)
        self.last_due = max(self.last_due, now + d, self.not_before + self.delay_s)
        return self.last_due

    async def read_loop(self) -> None:
        try:
            while True:
                await self.room.wait()
                data = await self.reader.read(CHUNK)
                now = perf_counter()
                if not data:
                    break
                self.queue.append((self._due(now), data))
                self.buffered += len(data)
                if self.buffered >= self.max_buffer:
                    self.room.clear()
                self.wake.set()
        except (ConnectionError, OSError):
            pass
        finally:
            self.queue.append((self._due(perf_counter()), b""))  # EOF travels with the same delay
            self.wake.set()

    async def write_loop(self, on_fail) -> None:
        try:
            while True:
                while not self.queue:
                    self.wake.clear()
                    await self.wake.wait()
                due, data = self.queue[0]
                wait = due - perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                    continue  # re-check: the head cannot change, but time may have been short
                # Everything already due goes out in one write.
                parts = []
                now = perf_counter()
                while self.queue and self.queue[0][0] <= now and self.queue[0][1]:
                    parts.append(self.queue.popleft()[1])
                if parts:
                    chunk = b"".join(parts)
                    self.writer.write(chunk)
                    self.buffered -= len(chunk)
                    await self.writer.drain()
                    if self.buffered < self.max_buffer:
                        self.room.set()
                    continue
                self.queue.popleft()  # EOF
                if self.writer.can_write_eof():
                    self.writer.write_eof()
                return
        except (ConnectionError, OSError):
            on_fail()  # the peer is gone: tear down both sides


class Relay:
    """Listen on `listen_port`; relay every connection to `upstream` with `rtt_ms` / 2 each way."""

    def __init__(self, listen_port: int, upstream_host: str, upstream_port: int, rtt_ms: float,
                 jitter: float = 0.0, host: str = "127.0.0.1", seed: int | None = None, name: str = "relay",
                 handshake: bool = True):
        assert rtt_ms >= 0 and 0 <= jitter < 1, "rtt_ms >= 0 and jitter in [0, 1)"
        self.listen_port, self.host = listen_port, host
        self.upstream = (upstream_host, upstream_port)
        self.rtt_ms, self.jitter, self.name = rtt_ms, jitter, name
        self.handshake = handshake
        self.rng = random.Random(seed)
        self.port = 0
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> Relay:
        self._server = await asyncio.start_server(self._accept, self.host, self.listen_port, backlog=1024,
                                                  reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.transport.abort()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        t = asyncio.get_running_loop().create_task(self._serve(reader, writer, perf_counter()))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _serve(self, c_reader, c_writer, t_accept: float) -> None:
        self.connections += 1
        self._writers.add(c_writer)
        u_writer = None
        try:
            try:
                u_reader, u_writer = await asyncio.open_connection(*self.upstream)
            except OSError:
                return  # upstream down: the client sees a reset, as it would from the real host
            self._writers.add(u_writer)
            for w in (c_writer, u_writer):
                sock = w.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            one_way = self.rtt_ms / 2e3
            not_before = t_accept + 2 * one_way if self.handshake else 0.0
            up = _Pipe(c_reader, u_writer, one_way, self.jitter, self.rng, not_before)
            down = _Pipe(u_reader, c_writer, one_way, self.jitter, self.rng)

            def fail():
                c_writer.transport.abort()
                u_writer.transport.abort()

            await asyncio.gather(up.read_loop(), up.write_loop(fail), down.read_loop(), down.write_loop(fail))
        finally:
            for w in (c_writer, u_writer):
                if w is not None:
                    self._writers.discard(w)
                    with contextlib.suppress(OSError, RuntimeError):
                        w.close()
