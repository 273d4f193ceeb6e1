"""Cross-region failover at the proxy: with no healthy replica in its own region, a
proxy forwards the request to the nearest other region's proxy instead of failing
(`Proxy.submit`; peers from `--peer REGION=URL@RTT_MS`, `ProxyConfig.peers`).

Pure part: `parse_peer` (the `--peer` syntax), `peer_order` (nearest first, from a
topology's links) and `next_peer` (skip peers known down or already tried).
Socket part: `PeerLink`,
which keeps one multiplexed public-protocol WebSocket per peer proxy (through
the inter-region relay, so the forwarded request really pays the RTT between
regions) and relays a forwarded request's deltas and end to a sink with the
proxy's own sink interface (`sinks.DeltaSink`: `delta(request, text, ntokens)`,
`finish(request, msg)`).

Rules that keep forwarding safe:
- a forwarded request is never forwarded again (the link announces itself with
  the `X-Edgechat-Forwarded-By` header; the receiving proxy must not forward what
  arrives with it), so two regions without replicas cannot bounce a request;
- a peer that answers `unavailable` or `shutting_down`, or cannot be reached, is
  marked down for `down_s` and the next peer in RTT order is tried;
- the final `done` keeps the serving region in `region` and names the
  forwarding region in `forwarded_from` (`Forwarded.mark`), so users see it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from time import perf_counter

from edge_proxy import protocol as pp

FORWARDED_HEADER = "X-Edgechat-Forwarded-By"
RETRYABLE = frozenset({pp.UNAVAILABLE, pp.SHUTTING_DOWN, "disconnected"})


@dataclass(frozen=True)
class Peer:
    region: str
    url: str  # ws://host:port/v1/stream of the peer proxy (or the relay in front of it)
    rtt_ms: float


def parse_peer(spec: str) -> Peer:
    """`REGION=ws://host:port/v1/stream@RTT_MS` -> Peer."""
    region, eq, rest = spec.partition("=")
    url, at, rtt = rest.rpartition("@")
    if not (eq and at and region.strip() and url.startswith(("ws://", "wss://"))):
        raise ValueError(f"peer {spec!r}: expected REGION=ws://host:port/v1/stream@RTT_MS")
    try:
        rtt_ms = float(rtt)
    except ValueError:
        raise ValueError(f"peer {spec!r}: RTT {rtt!r} is not a number of milliseconds") from None
    if not rtt_ms >= 0:
        raise ValueError(f"peer {spec!r}: RTT must be >= 0 ms")
    return Peer(region.strip(), url, rtt_ms)


def peer_order(own: str, links: dict[frozenset, float], urls: dict[str, str]) -> list[Peer]:
    """Peers of `own` that have a link and a URL, nearest first (ties by name)."""
    out = []
    for pair, rtt in links.items():
        if own in pair:
            (other,) = pair - {own}
            if other in urls:
                out.append(Peer(other, urls[other], rtt))
    return sorted(out, key=lambda p: (p.rtt_ms, p.region))


def next_peer(peers: list[Peer], down_until: dict[str, float], tried: set[str], now: float) -> Peer | None:
    """First peer, in RTT order, neither tried for this request nor marked down."""
    for p in peers:
        if p.region not in tried and down_until.get(p.region, 0.0) <= now:
            return p
    return None


@dataclass(eq=False)  # hashable by identity, like ProxiedRequest: sinks key their outboxes by it
class Forwarded:
    """A forwarded request; its sink sees it as a `sinks.Served`, like a `stream.ProxiedRequest`."""

    cid: str
    own_region: str
    sink: object
    link: PeerLink
    peer: Peer | None = None
    req: object = None  # the peer's edge_proxy.client.Request
    done: bool = False
    tried: set = field(default_factory=set)
    task: asyncio.Task | None = None
    t0: float = field(default_factory=perf_counter)  # arrival here: timings include the trip to the peer
    t_first: float = 0.0
    ids: list = field(default_factory=list)  # token ids the peer sent (requests with `resumable`)

    def cancel(self, notify: bool) -> None:
        """Client cancel (`notify`: answer done/abort) or disconnect (answer nothing)."""
        if self.done:
            return
        if self.req is not None and self.req.id in self.req.client.requests:
            self.link._spawn(self.req.cancel())
            if notify:
                return  # the peer answers done/abort, relayed by `_run`
        self.done = True  # not started at a peer yet (or a disconnect): stop here
        if self.task is not None:
            self.task.cancel()
        if notify:
            self.sink.finish(self, self.mark(pp.Done(self.cid, "abort", pp.Usage(), pp.Timing(),
                                                             self.peer.region if self.peer else self.own_region, "")))

    def mark(self, d: pp.Done) -> pp.Done:
        """The peer's done under the client's id; `region` already names the serving region,
        `forwarded_from` names this one, and the timings run from the arrival here."""
        now = perf_counter()
        d.id = self.cid
        d.forwarded_from = self.own_region
        d.timing.ttft_ms = round((self.t_first - self.t0) * 1e3, 3) if self.t_first else 0.0
        d.timing.total_ms = round((now - self.t0) * 1e3, 3)
        return d


class PeerLink:
    """One proxy's connections to the other regions' proxies."""

    def __init__(self, own_region: str, peers: list[Peer], api_key: str | None = None, down_s: float = 2.0,
                 connect_timeout_s: float = 2.0):
        self.own_region, self.peers = own_region, peers
        self.api_key, self.down_s, self.connect_timeout_s = api_key, down_s, connect_timeout_s
        self.clients: dict[str, object] = {}  # region -> EdgeClient
        self.down_until: dict[str, float] = {}
        self.forwarded = 0
        self._locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task] = set()

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for c in list(self.clients.values()):
            await c.close()
        self.clients.clear()

    async def _client(self, peer: Peer):
        from websockets.asyncio.client import connect

        from edge_proxy.client import EdgeClient

        lock = self._locks.setdefault(peer.region, asyncio.Lock())
        async with lock:
            c = self.clients.get(peer.region)
            if c is not None and c.closed:
                self.clients.pop(peer.region, None)
                c = None
            if c is None:
                headers = {FORWARDED_HEADER: self.own_region}
                if self.api_key:
                    headers["Authorization"] = f"Bearer {self.api_key}"
                ws = await connect(peer.url, additional_headers=headers, compression=None, proxy=None,
                                   open_timeout=self.connect_timeout_s)
                c = self.clients[peer.region] = EdgeClient(ws)
            return c

    def forward(self, cid: str, sink, generate_kw: dict) -> Forwarded:
        """Start forwarding; the sink hears every delta and one final done or error."""
        f = Forwarded(cid, self.own_region, sink, self)
        f.task = self._spawn(self._run(f, generate_kw))
        self.forwarded += 1
        return f

    async def _run(self, f: Forwarded, kw: dict) -> None:
        from websockets.exceptions import InvalidHandshake

        last = pp.Error(pp.UNAVAILABLE, f"no healthy replica in {self.own_region} and no peer region reachable",
                        f.cid, 1.0)
        while not f.done:
            peer = next_peer(self.peers, self.down_until, f.tried, time.monotonic())
            if peer is None:
                break
            f.tried.add(peer.region)
            f.peer = peer
            try:
                client = await self._client(peer)
                f.req = await client.generate(**kw)
            except (OSError, TimeoutError, InvalidHandshake) as e:
                self.down_until[peer.region] = time.monotonic() + self.down_s
                last = pp.Error(pp.UNAVAILABLE, f"peer {peer.region}: {e}", f.cid, 1.0)
                continue
            async for m in _frames(f.req):
                if type(m) is pp.Delta:
                    if not f.t_first:
                        f.t_first = perf_counter()
                    if m.ids:
                        f.ids += m.ids
                    f.sink.delta(f, m.text, m.tokens)
                elif type(m) is pp.Done:
                    f.done = True
                    f.sink.finish(f, f.mark(m))
                    return
                else:  # Error
                    if m.code in RETRYABLE and f.req.tokens == 0:
                        self.down_until[peer.region] = time.monotonic() + self.down_s
                        last = pp.Error(m.code, f"peer {peer.region}: {m.message}", f.cid, m.retry_after_s)
                        break
                    f.done = True
                    f.sink.finish(f, pp.Error(m.code, f"peer {peer.region}: {m.message}", f.cid, m.retry_after_s))
                    return
        if not f.done:
            f.done = True
            f.sink.finish(f, last)


async def _frames(req):
    """The raw frames of one client Request (delta, then done or error)."""
    while True:
        m = await req.q.get()
        yield m
        if type(m) is not pp.Delta:
            return
