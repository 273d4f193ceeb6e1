"""Connection guard: caps, header/body timeouts and descriptor reserve, below ASGI.

uvicorn accepts every connection and waits for its headers for ever, so 300
clients trickling a request line a byte at a time hold 300 descriptors, and past
the process's file limit nobody (not even `/healthz`) gets in. `ConnectionGuard`
sits in uvicorn's protocol objects (`guarded_protocols`) and sees every
connection before a byte of HTTP is parsed:

- **caps**: at most `max_per_address` connections per source address and
  `max_connections` per proxy worker, the latter lowered to the process's
  `RLIMIT_NOFILE` minus `reserve_fds` (replica links, health checks, logs), so
  the process never runs out of descriptors: accept() keeps working and a
  refusal can always be written. A refused connection gets `503` with a JSON
  body (`too_many_connections`) and is closed.
- **eviction**: at the proxy cap, a new connection evicts the oldest connection
  that is not in a request (still sending its headers, or idle between
  requests) instead of being refused, so a slowloris crowd cannot lock out
  health checks and real clients; a request or WebSocket under way is never evicted.
- **timeouts**: the headers of a request must be complete within
  `header_timeout_s` of the connection (or of its first byte, on a kept-alive
  connection), and its body within `body_timeout_s` after them; else the
  connection is closed. WebSockets, once upgraded, are governed by pings.

Refusals, evictions and timeouts are counted (`counts`) and logged at most once
per `log_every_s` with their totals.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

from edge_proxy import protocol as pp

log = logging.getLogger("edge_proxy.connections")


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 8192  # per proxy worker, before the descriptor limit lowers it
    max_per_address: int = 1024  # loopback benches and NAT: raise it (--max-connections-per-address)
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    reserve_fds: int = 64  # descriptors never used for client connections
    log_every_s: float = 5.0

    def __post_init__(self):
        if self.max_connections < 1 or self.max_per_address < 1:
            raise ValueError("max_connections and max_per_address must be >= 1")
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0):
            raise ValueError("header and body timeouts must be > 0 s")


def refusal(status: int, code: str, message: str) -> bytes:
    """A complete HTTP/1.1 response that closes the connection."""
    body = f'{{"type":"error","code":"{code}","message":"{message}"}}'.encode()
    reason = {503: "Service Unavailable", 408: "Request Timeout"}[status]
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\nretry-after: 1\r\n\r\n").encode() + body


class _Conn:
    __slots__ = ("addr", "timer", "idle")

    def __init__(self, addr: str):
        self.addr = addr
        self.timer: asyncio.TimerHandle | None = None
        self.idle = True  # no request under way: may be evicted


class ConnectionGuard:
    def __init__(self, limits: ConnectionLimits, fd_limit: int | None = None):
        self.limits = limits
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0] if fd_limit is None else fd_limit
        self.max_total = limits.max_connections
        if soft != resource.RLIM_INFINITY and soft - limits.reserve_fds < self.max_total:
            self.max_total = max(1, soft - limits.reserve_fds)
            log.info("connection cap %d (file limit %d minus %d reserved)", self.max_total, soft, limits.reserve_fds)
        self._conns: dict[object, _Conn] = {}  # transport -> state
        self._idle: OrderedDict[object, None] = OrderedDict()  # transports without a request, oldest first
        self._by_addr: Counter[str] = Counter()
        self.counts: Counter[str] = Counter()  # refused_address, refused_total, evicted, header_timeout, body_timeout
        self._unlogged: Counter[str] = Counter()
        self._last_log = 0.0

    def __len__(self) -> int:
        return len(self._conns)

    # -- lifecycle (called by the protocol objects) ----------------------------

    def opened(self, transport) -> bool:
        """A new connection: admit it (True) or write a refusal and close it (False)."""
        peer = transport.get_extra_info("peername")
        addr = peer[0] if isinstance(peer, tuple) else str(peer)
        if self._by_addr[addr] >= self.limits.max_per_address:
            return self._refuse(transport, "refused_address",
                                f"{addr} has {self._by_addr[addr]} connections open (the cap per address)")
        if len(self._conns) >= self.max_total and not self._evict_one():
            return self._refuse(transport, "refused_total", f"the proxy has {len(self._conns)} connections open")
        c = self._conns[transport] = _Conn(addr)
        self._by_addr[addr] += 1
        self._idle[transport] = None
        self._arm(transport, c, self.limits.header_timeout_s, "header_timeout")
        return True

    def closed(self, transport) -> None:
        c = self._conns.pop(transport, None)
        if c is None:
            return
        self._idle.pop(transport, None)
        if c.timer is not None:
            c.timer.cancel()
        self._by_addr[c.addr] -= 1
        if self._by_addr[c.addr] <= 0:
            del self._by_addr[c.addr]

    def request_begins(self, transport) -> None:
        """First byte of a request on a kept-alive connection: its headers are due."""
        c = self._conns.get(transport)
        if c is not None and c.timer is None:
            self._arm(transport, c, self.limits.header_timeout_s, "header_timeout")

    def headers_complete(self, transport) -> None:
        c = self._conns.get(transport)
        if c is not None:
            c.idle = False
            self._idle.pop(transport, None)
            self._arm(transport, c, self.limits.body_timeout_s, "body_timeout")

    def body_complete(self, transport) -> None:
        c = self._conns.get(transport)
        if c is not None and c.timer is not None:
            c.timer.cancel()
            c.timer = None

    def response_complete(self, transport) -> None:
        """The connection is idle again (keep-alive): evictable until its next request."""
        c = self._conns.get(transport)
        if c is not None:
            c.idle = True
            self._idle[transport] = None

    def upgraded(self, transport) -> None:
        """Now a WebSocket: no more HTTP timeouts, never evicted."""
        c = self._conns.get(transport)
        if c is not None:
            c.idle = False
            self._idle.pop(transport, None)
            if c.timer is not None:
                c.timer.cancel()
                c.timer = None

    # -- policy ----------------------------------------------------------------

    def _arm(self, transport, c: _Conn, delay: float, what: str) -> None:
        if c.timer is not None:
            c.timer.cancel()
        c.timer = asyncio.get_running_loop().call_later(delay, self._expired, transport, what)

    def _expired(self, transport, what: str) -> None:
        c = self._conns.get(transport)
        if c is None:
            return
        c.timer = None
        self._note(what, f"closed a connection from {c.addr}: request not received in time")
        self.closed(transport)
        if not transport.is_closing():
            transport.write(refusal(408, what, "request not received in time"))
            transport.close()  # after the refusal is written

    def _evict_one(self) -> bool:
        if not self._idle:
            return False
        transport = next(iter(self._idle))
        addr = self._conns[transport].addr
        self.closed(transport)
        transport.abort()
        self._note("evicted", f"evicted an idle connection from {addr} at the cap of {self.max_total}")
        return True

    def _refuse(self, transport, what: str, why: str) -> bool:
        self._note(what, f"refused a connection: {why}")
        transport.write(refusal(503, pp.TOO_MANY_CONNECTIONS, why))
        transport.close()
        return False

    def _note(self, what: str, line: str) -> None:
        self.counts[what] += 1
        self._unlogged[what] += 1
        now = time.monotonic()
        if now - self._last_log >= self.limits.log_every_s:
            self._last_log = now
            totals = ", ".join(f"{k} {v}" for k, v in sorted(self._unlogged.items()))
            log.warning("%s (since the last report: %s; %d connections open)", line, totals, len(self._conns))
            self._unlogged.clear()


def guarded_protocols(http_cls: type, ws_cls: type, guard: ConnectionGuard) -> tuple[type, type]:
    """uvicorn's HTTP (httptools) and WebSocket protocol classes, reporting to `guard`."""

    class GuardedHttp(http_cls):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            guard.opened(transport)

        def connection_lost(self, exc) -> None:
            guard.closed(self.transport)
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            guard.request_begins(self.transport)
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            guard.headers_complete(self.transport)
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            guard.body_complete(self.transport)
            super().on_message_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            guard.response_complete(self.transport)

    class GuardedWs(ws_cls):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            guard.upgraded(transport)

        def connection_lost(self, exc) -> None:
            guard.closed(self.transport)
            super().connection_lost(exc)

    return GuardedHttp, GuardedWs
