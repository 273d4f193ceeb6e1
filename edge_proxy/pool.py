"""Replica pool: one persistent, multiplexed WebSocket per replica, with health.

Each `ReplicaConn` keeps its socket up (reconnecting with capped backoff),
carries every request routed there (internal ids, one msgpack frame per flush of
queued messages), and knows the replica's last `Load`, its cached blocks
(`BlockIndex`) and this proxy's outstanding requests on it.

A frame is built message by message (`frame_of`): a message that cannot be
encoded fails its own request (`bad_request`) and everything else queued in the
same loop turn (other tenants' Generates, Aborts) still leaves in that frame.

A replica is *ready* when its socket is open, it said `Hello` with the pool's block
size, and its `/healthz` passes. It is *lost* (its streams handed to
`events.on_lost(conn, streams, cause)` for failover) when:

- the socket closes or errors (`disconnect`), including keepalive pings going
  unanswered for `ping_interval_s + ping_timeout_s`;
- requests are in flight and nothing at all arrived for `stall_timeout_s` (or
  `stall_steps` of the replica's reported step time, if longer) after tokens had
  been flowing, or for `start_timeout_s` while none has started (a cold engine's
  first step can take seconds on a CPU) (`stall`: replicas report `Load` every
  ~0.5 s and between steps, so silence means a stuck engine);
- `/healthz` failed `healthz_failures` times in a row (`healthz`).

Replicas join and leave while serving (`add`, `remove`: `discovery.DnsDiscovery`). One that
leaves while it is up and streaming is a planned removal (a Kubernetes pod terminating leaves its
Service's endpoints as its preStop drains it; a roll): it is not ready from then on, its streams
are handed to `events.on_draining` as if it drained (`edge_proxy.handoff` moves them with their
KV, from the replica still serving them), and it leaves the pool once it has no stream left,
once its link drops (its streams then fail over, cause `disconnect`), or `leave_timeout_s` after
it left (what is still there then fails over, cause `removed`). Cutting its streams at once
instead would recompute every one of them on a successor while the KV is still there to pull.
A URL back in DNS while it is still leaving is ready again (a readiness flap); one that leaves
idle, or down, goes at once (an idle one that is up handed to `events.on_draining` with no
stream first: its hot chains, the conversations it caches, move all the same).

A replica's Hello names its role (`Hello.role`: prefill, decode or both, the default): `ready()`
lists the replicas that take streams (decode and both), `prefill_ready()` the prefill ones, which
only compute prompts for others to pull (edge_proxy.disagg). Every proxy learns roles alike, from
the replicas.

A replica whose `Load` says `draining` (SIGTERM, `POST /v1/drain`: replica.api.drain) is not
ready from then on (nothing new goes there) and its streams are handed to
`events.on_draining(conn, streams)` once, still registered on it and streaming
(`edge_proxy.handoff` moves them); a new Hello (a restarted replica) clears it.

A replica's Load counts a request from the loop turn its API process accepts it
(`replica.api.queued_load`), before the engine's next step: every proxy sees a placement one
hop after it was sent. `effective_load` adds this proxy's requests the last Load does not count
(own_inflight - own_at_report). Which those are, the Load says: each names the last Generate of
ours the replica had received when it built it (`Load.seen_id`, per connection), so it counts
that one and every one sent before it, none sent after (one socket keeps them in order).
`unseen` holds our Generates sent and not yet named; at a Load, own_at_report = own_inflight -
those of them still ours (and pending_tokens their uncached prompts). Without the name, a proxy
that sent X then Y, with X's Load arriving between, took it as counting both: Y was missing
from the replica's figure until Y's own Load, one hop later, so a new request placed in that
hop saw the replica one request lighter where others' requests were there too (the floor
`max(own, ...)` covers only a replica holding ours alone). A replica that names none ("": an
older one, or none received yet on this connection) is taken to count every request of ours,
as before.

The reader is the per-token hot path: decode a frame, look each message's id up
in one dict, hand the message and its request to the pool's `events` (the
`RequestEvents` of the proxy that owns the requests). Nothing on it awaits a client.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import ssl
from collections import deque
from dataclasses import dataclass
from time import perf_counter
from typing import Protocol
from urllib.parse import urlsplit, urlunsplit

import httpx
import msgspec

from edge_proxy.admission import LoadView
from edge_proxy.prefix_index import BlockIndex
from edge_proxy.replica_link import LinkClosed, LinkRefused, ReplicaLink
from edge_proxy.routing import compute_groups, effective_load
from wire import protocol as P

log = logging.getLogger("edge_proxy.pool")

AUTH_CLOSE_CODE = 4401


@dataclass(frozen=True)
class PoolConfig:
    secret: str = ""  # shared secret sent as `Authorization: Bearer`
    ca_file: str = ""  # CA bundle for wss:// replicas (their TLS certificates); "" -> the system's
    ping_interval_s: float = 1.0
    ping_timeout_s: float = 2.0
    stall_timeout_s: float = 2.0
    stall_steps: float = 4.0  # a slow engine (long steps on CPU) gets this many step times of silence
    start_timeout_s: float = 30.0  # silence allowed before the first token of a busy period
    leave_timeout_s: float = 30.0  # a replica gone from DNS keeps its streams this long at most (Kubernetes' grace)
    healthz_interval_s: float = 2.0
    healthz_failures: int = 2
    hello_timeout_s: float = 5.0
    backoff_min_s: float = 0.05
    backoff_max_s: float = 2.0
    max_frame_bytes: int = 64 << 20  # replica -> proxy frames (a step's tokens, KV events)


class RequestEvents(Protocol):
    """What the pool tells the owner of its requests (`core.Proxy`) about a request `s` it was
    given with `ReplicaConn.start`; `on_lost`: `conn` is lost, its `streams` registered nowhere."""

    def on_tokens(self, s, msg: P.Tokens, now: float) -> None: ...
    def on_finished(self, s, msg: P.Finished, now: float) -> None: ...
    def on_replica_error(self, s, err: P.Error) -> None: ...
    def on_lost(self, conn: ReplicaConn, streams: list, cause: str) -> None: ...
    def on_draining(self, conn: ReplicaConn, streams: list) -> None: ...


def array_header(n: int) -> bytes:
    """The msgpack header of an array of `n` elements."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def frame_of(msgs: list, encode, on_error) -> bytes | None:
    """A frame (msgpack array) of the messages of `msgs` that encode, each encoded on its
    own; `on_error(msg, exc)` for the others. None when none is left."""
    parts = []
    for m in msgs:
        try:
            parts.append(encode(m))
        except (OverflowError, TypeError, ValueError, msgspec.EncodeError) as e:
            on_error(m, e)
    return array_header(len(parts)) + b"".join(parts) if parts else None


def healthz_url(ws_url: str) -> str:
    u = urlsplit(ws_url)
    scheme = {"ws": "http", "wss": "https"}.get(u.scheme)
    if scheme is None or not u.netloc:
        raise ValueError(f"replica URL must look like ws://host:port/v1/replica, got {ws_url!r}")
    return urlunsplit((scheme, u.netloc, "/healthz", "", ""))


class ReplicaConn:
    def __init__(self, url: str, pool: ReplicaPool):
        self.url = url
        self.http_url = healthz_url(url)
        self.pool = pool
        self.cfg = pool.cfg
        self.id = url  # replaced by Hello.replica_id
        self.hello: P.Hello | None = None
        self.group = ""  # its compute group among the connected replicas (`routing.compute_groups`) ...
        self.share = 1.0  # ... and the fraction of that group's compute it uses at once
        self.link: ReplicaLink | None = None
        self.connected = False
        self.healthy = True  # /healthz verdict
        self.refused = False  # the replica refused our secret (4401)
        self.mismatch = ""  # why its last Hello was refused (tokenizer, block size); "" once accepted
        self.draining = False  # its Load said so: routed nothing new, its streams handed on
        self.leaving_since = 0.0  # when it left discovery with streams (0: it has not); routed nothing new
        self.streams: dict[str, object] = {}  # internal id -> the request (stream.ProxiedRequest)
        self.index = BlockIndex()
        self.load: P.Load | None = None
        self.load_event = asyncio.Event()  # set on every Load report (watchers clear it)
        self.own_inflight = 0  # this proxy's requests on it
        self.own_at_report = 0  # those of them its last Load counts
        self.unseen: deque[str] = deque()  # our Generates sent (in order) that no Load has named yet
        self.seen_id = ""  # the last one a Load named
        self.pending_tokens = 0  # uncached prompt tokens of ours its last Load does not count
        self.prefilling: dict[str, int] = {}  # this proxy's requests on it without a first token: id -> uncached tokens
        self.prefill_pending = 0  # their sum: the prefill queued ahead of a new request, as far as this proxy knows
        self.fresh_chains: set[str] = set()  # our new conversations on it (Generate.new_chain) no Load has counted
        self.last_rx = 0.0
        self.busy_since = 0.0  # when the first of the current streams was sent
        self.last_tokens_rx = 0.0
        self._codec = P.Codec()
        self._encode = msgspec.msgpack.Encoder().encode  # one message at a time (`frame_of`)
        self._out: list = []
        self._seq = 0
        self._prefix = secrets.token_hex(4) + "-"
        self._healthz_fail = 0
        self.connected_at = 0.0  # when its current connection said Hello

    def __repr__(self):
        return f"ReplicaConn({self.id!r}, ready={self.ready})"

    @property
    def ready(self) -> bool:
        return self.connected and self.healthy and not self.draining and not self.leaving_since

    @property
    def role(self) -> str:
        """What its Hello says it does: "prefill", "decode" or "both" (also an older replica's, that says none)."""
        return (self.hello.role if self.hello is not None else "") or "both"

    @property
    def base_url(self) -> str:
        """Its HTTP API (the KV routes): the WebSocket's host and port."""
        return self.http_url.removesuffix("/healthz")

    # -- routing inputs --------------------------------------------------------

    def effective_load(self) -> float:
        reported = self.load.running + self.load.waiting if self.load is not None else 0
        return effective_load(reported, self.own_inflight, self.own_at_report)

    def chains(self) -> int:
        """The conversations it holds (Load.chains: it counts a new one from the moment it has it) and
        ours sent after the request its last Load names (`seen_id`, as `effective_load`); -1: it reports none."""
        if self.load is None or self.load.chains < 0:
            return -1
        return self.load.chains + len(self.fresh_chains)

    def stalled(self, now: float) -> bool:
        """In-flight work and silence past the stall limit."""
        if not (self.connected and self.streams):
            return False
        if self.last_tokens_rx < self.busy_since:  # nothing produced yet: maybe a cold first step
            return now - max(self.last_rx, self.busy_since) > self.cfg.start_timeout_s
        limit = self.cfg.stall_timeout_s
        if self.load is not None:
            limit = max(limit, self.cfg.stall_steps * self.load.step_ms / 1e3)
        return now - self.last_rx > limit

    def load_view(self) -> LoadView:
        """Admission's inputs: the last Load, plus this proxy's requests on the replica
        (each sample with the steps it may still take, in arrival order)."""
        ld = self.load
        ahead = []
        for s in self.streams.values():
            mt = s.gen.sampling.max_tokens
            if s.samples is None:
                ahead.append(mt - len(s.ids))
            else:
                ahead += [mt - len(s.samples[i]) for i in s.running]
        if ld is None:
            return LoadView(pending_tokens=self.pending_tokens, ahead=ahead)
        foreign = max(0, ld.running + ld.waiting - self.own_at_report)
        return LoadView(ld.step_ms, ld.tokens_per_s, ld.waiting_tokens, self.pending_tokens, ld.max_running, ahead,
                        foreign)

    # -- outgoing --------------------------------------------------------------

    def start(self, stream, gen: P.Generate, uncached: int | None = None) -> str:
        """Register `stream` under a fresh internal id and queue its Generate; `uncached`:
        the prompt tokens the replica is expected to prefill (default: all of them)."""
        self._seq += 1
        rid = gen.id = f"{self._prefix}{self._seq}"
        if not self.streams:
            self.busy_since = perf_counter()
        self.streams[rid] = stream
        self.own_inflight += 1
        self.unseen.append(rid)
        u = len(gen.prompt_ids) if uncached is None else uncached
        self.pending_tokens += u
        self.prefilling[rid] = u
        self.prefill_pending += u
        if gen.new_chain:
            self.fresh_chains.add(rid)
        self._send(gen)
        return rid

    def release(self, rid: str, abort: bool) -> None:
        """Forget a request (finished, cancelled or moved); tell the replica to stop when `abort`."""
        if self.streams.pop(rid, None) is not None:
            self.own_inflight -= 1
            self._prefilled(rid)
            self.fresh_chains.discard(rid)
            if abort and self.connected:
                self._send(P.Abort(rid))

    def _send(self, msg) -> None:
        """Queue a message; everything queued in one loop iteration leaves as one frame."""
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(msg)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if out and self.link is not None:
            frame = frame_of(out, self._encode, self._unsendable)
            if frame is not None:
                self.link.send(frame)

    def _unsendable(self, msg, exc: Exception) -> None:
        """`msg` cannot be encoded (the edge's bounds should have caught it): fail its request only."""
        log.error("replica %s: cannot encode %s %r: %s", self.id, type(msg).__name__, getattr(msg, "id", None), exc)
        s = self.streams.get(msg.id) if type(msg) is P.Generate else None
        if s is not None:
            self.release(msg.id, abort=False)  # the replica never saw it
            self.pool.events.on_replica_error(
                s, P.Error(P.BAD_REQUEST, f"the request cannot be encoded for the replica: {exc}", msg.id))

    # -- incoming (the hot path: runs inside the link's data_received) ----------

    def _on_frame(self, data: bytes, now: float) -> None:
        self.last_rx = now
        try:
            msgs = self._codec.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.error("replica %s sent an undecodable frame (%s); dropping the connection", self.id, e)
            self.lose("bad_frame")
            return
        self._dispatch(msgs, now)

    def _dispatch(self, msgs: list, now: float) -> None:
        streams, events = self.streams, self.pool.events
        for m in msgs:
            t = type(m)
            if t is P.Tokens:
                self.last_tokens_rx = now
                if self.prefilling:
                    self._prefilled(m.id)
                s = streams.get(m.id)
                if s is not None:
                    events.on_tokens(s, m, now)
            elif t is P.Finished:
                s = streams.get(m.id)
                if s is not None:
                    events.on_finished(s, m, now)
            elif t is P.Load:
                self.load = m
                self._counted(m.seen_id)
                self.load_event.set()
                if m.draining and not self.draining:
                    self._drains()
            elif t is P.KvEvents:
                self.index.apply(m)

            elif t is P.Error:
                s = streams.get(m.id) if m.id is not None else None
                if s is not None:
                    events.on_replica_error(s, m)
                else:
                    log.warning("replica %s: %s: %s", self.id, m.code, m.message)
            else:
                log.warning("replica %s sent unexpected %s", self.id, t.__name__)

    def _counted(self, seen_id: str) -> None:
        """A Load that counts our Generates up to `seen_id` (every one when ""): own_at_report
        and pending_tokens are what it leaves out of ours."""
        unseen = self.unseen
        if seen_id and seen_id in unseen:  # every one up to it is counted now
            while unseen.popleft() != seen_id:
                pass
        elif seen_id != self.seen_id or not seen_id:  # names none, or one we never sent: all of ours, as before
            unseen.clear()
        self.seen_id = seen_id
        left = [rid for rid in unseen if rid in self.streams]  # sent after it, still ours
        self.own_at_report = self.own_inflight - len(left)
        if self.fresh_chains:
            self.fresh_chains.intersection_update(left)
        self.pending_tokens = sum(self.prefilling.get(rid, 0) for rid in left)

    def _drains(self) -> None:
        log.info("replica %s drains with %d streams in flight", self.id, len(self.streams))
        self.draining = True
        if self.connected:
            self.pool.on_state_change()
            if not self.leaving_since:  # (leaving discovery handed them on already)
                self.pool.events.on_draining(self, list(self.streams.values()))

    def _prefilled(self, rid: str) -> None:
        """`rid`'s prompt is no longer queued prefill here (its first token came, or it ended)."""
        u = self.prefilling.pop(rid, None)
        if u is not None:
            self.prefill_pending -= u

    def _on_first_frame(self, data: bytes, now: float) -> None:
        """Until Hello: the first frame must start with it (the rest of it is ordinary traffic)."""
        self.link.on_frame = self._on_frame
        try:
            msgs = self._codec.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            msgs = []
        if not msgs or type(msgs[0]) is not P.Hello:
            log.error("replica %s did not start with Hello", self.url)
            self.link.abort()
            return
        hello = msgs[0]
        if not self.pool.accept_hello(self, hello):
            self.link.abort()
            return
        self.link.up = True
        self.hello, self.id = hello, hello.replica_id
        self.index.reset()
        self.load = None
        self.draining = False
        self.own_at_report = 0
        self.unseen.clear()  # a new connection: the replica has received none of ours on it
        self.seen_id = ""
        self.last_rx = now
        self.connected = True
        self.connected_at = now
        self._healthz_fail = 0  # a replica that just said Hello is up: probes that failed before do not count
        self.refused = False
        log.info("replica %s ready at %s (model %s)", self.id, self.url, hello.model)
        self._dispatch(msgs[1:], now)  # the replica sends its KV state and Load along with Hello
        self.pool.on_state_change()

    # -- lifecycle -------------------------------------------------------------

    def lose(self, cause: str) -> None:
        """Take every stream off this replica and hand them to failover; not ready until reconnected."""
        was_ready = self.connected and self.healthy  # (a draining replica is not `ready`, but up)
        self.connected = False
        lost = list(self.streams.values())
        self.streams.clear()
        self.own_inflight = 0
        self.pending_tokens = 0
        self.unseen.clear()
        self.prefilling.clear()
        self.prefill_pending = 0
        self.fresh_chains.clear()
        self._out.clear()
        if was_ready:
            self.pool.on_state_change()
        if lost:
            log.warning("replica %s lost (%s) with %d streams in flight", self.id, cause, len(lost))
        self.pool.events.on_lost(self, lost, cause)
        if self.link is not None:
            self.link.abort()  # no closing handshake with a peer we no longer trust

    async def run(self) -> None:
        """Keep a connection up: connect, wait for Hello, keep alive, and start over when it ends."""
        cfg = self.cfg
        backoff = cfg.backoff_min_s
        headers = {"Authorization": f"Bearer {cfg.secret}"} if cfg.secret else None
        while True:
            cause = None
            # Frames may arrive in the same segment as the handshake response: the link
            # must be ours (self.link) before it connects.
            self.link = ReplicaLink(self.url, headers, self._on_first_frame, cfg.max_frame_bytes, self.pool.ssl)
            try:
                await self.link.connect(cfg.hello_timeout_s)
            except LinkRefused as e:  # refused before the upgrade (HTTP 401/403) or not a replica at all
                cause = "refused" if e.status in (401, 403) else None
                if cause is None:
                    log.warning("replica %s: handshake answered HTTP %d", self.url, e.status)
                self.link = None
            except (OSError, TimeoutError, LinkClosed) as e:
                log.debug("replica %s: connect failed: %s", self.url, e)
                if self.connected:
                    self.lose("disconnect")
                self.link = None
            else:
                cause = await self._serve_link(self.link)
                self.link = None
            if cause == "refused":
                self._refused()
                backoff = cfg.backoff_max_s
            elif cause == "disconnect":
                backoff = cfg.backoff_min_s  # it was up: reconnect at once
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, cfg.backoff_max_s)

    async def _serve_link(self, link: ReplicaLink) -> str:
        """Wait for Hello, then keep alive until the link closes. Returns why it ended:
        "refused" (close 4401), "disconnect" (it had been up) or "no_hello"."""
        cfg = self.cfg
        keepalive = asyncio.get_running_loop().create_task(self._keepalive(link))
        try:
            done, _ = await asyncio.wait([link.closed], timeout=cfg.hello_timeout_s)
            if not done and not link.up:
                log.error("replica %s sent no Hello within %g s", self.url, cfg.hello_timeout_s)
                link.abort()
            closed = await link.closed
        finally:
            keepalive.cancel()
        if self.connected:
            self.lose("disconnect")
        if closed.code == AUTH_CLOSE_CODE:
            return "refused"
        return "disconnect" if link.up else "no_hello"

    async def _keepalive(self, link: ReplicaLink) -> None:
        """Ping every `ping_interval_s`; no pong for `ping_interval_s + ping_timeout_s` loses the replica."""
        cfg = self.cfg
        while True:
            await asyncio.sleep(cfg.ping_interval_s)
            if perf_counter() - link.last_pong > cfg.ping_interval_s + cfg.ping_timeout_s:
                log.warning("replica %s: no pong for %g s", self.id, cfg.ping_interval_s + cfg.ping_timeout_s)
                if self.connected:
                    self.lose("ping_timeout")
                link.abort()
                return
            link.ping()

    def _refused(self) -> None:
        if not self.refused:
            log.error("replica %s refused the proxy's secret; check EDGECHAT_REPLICA_SECRET", self.url)
        self.refused = True

    async def healthz(self, client: httpx.AsyncClient) -> None:
        started = perf_counter()
        try:
            r = await client.get(self.http_url)
            ok = r.status_code == 200
        except httpx.HTTPError:
            ok = False
        if not ok and started < self.connected_at:
            return  # sent before the replica (re)connected: a restarted replica is not failing for it
        if ok:
            self._healthz_fail = 0
            if not self.healthy:
                self.healthy = True
                self.pool.on_state_change()
            return
        self._healthz_fail += 1
        if self._healthz_fail >= self.cfg.healthz_failures and self.healthy:
            self.healthy = False
            log.warning("replica %s failing /healthz", self.id)
            if self.connected:
                self.lose("healthz")
            else:
                self.pool.on_state_change()


class ReplicaPool:
    def __init__(self, urls: list[str], cfg: PoolConfig, events: RequestEvents, tokenizer: str = ""):
        self.cfg = cfg
        self.tokenizer = tokenizer  # our tokenizer's fingerprint; a replica announcing another is refused
        self.events = events  # told about every request it carries
        self.conns = [ReplicaConn(u, self) for u in urls]
        self.block_size = 0
        self.max_model_len = 0
        self._changed = asyncio.Condition()
        self._tasks: list[asyncio.Task] = []
        self._runs: dict[ReplicaConn, asyncio.Task] = {}  # each connection's run() (added and removed live)
        self._http: httpx.AsyncClient | None = None
        # wss:// replicas: the system's CAs, or the private CA of `--replica-ca` (a self-signed replica's cert)
        self.ssl = ssl.create_default_context(cafile=cfg.ca_file or None) if cfg.ca_file else None
        self.state_listeners: list = []

    def ready(self, exclude: frozenset | set = frozenset()) -> list[ReplicaConn]:
        """The ready replicas that take streams (a prefill-role one never does)."""
        return [c for c in self.conns if c.ready and c.id not in exclude and c.role != "prefill"]

    def prefill_ready(self) -> list[ReplicaConn]:
        """The ready prefill-role replicas (edge_proxy.disagg)."""
        return [c for c in self.conns if c.ready and c.role == "prefill"]

    def models(self) -> list[str]:
        return sorted({c.hello.model for c in self.conns if c.hello is not None})

    def accept_hello(self, conn: ReplicaConn, hello: P.Hello) -> bool:
        if any(c is not conn and c.connected and c.id == hello.replica_id for c in self.conns):
            log.error("replica at %s claims id %r, already used by another connected replica", conn.url,
                      hello.replica_id)
            return False
        mismatch = ""
        if self.tokenizer and hello.tokenizer and hello.tokenizer != self.tokenizer:
            mismatch = f"tokenizer {hello.tokenizer}, this proxy's is {self.tokenizer}"
        elif self.block_size and hello.block_size != self.block_size:
            mismatch = f"block size {hello.block_size}, the pool uses {self.block_size}"
        elif hello.role and hello.role not in P.ROLES:
            mismatch = f"role {hello.role[:40]!r}, not one of {', '.join(P.ROLES)}"
        conn.mismatch = mismatch
        if mismatch:
            log.error("replica %s at %s has %s: not routing to it", hello.replica_id, conn.url, mismatch)
            self.on_state_change()
            return False
        self.block_size = hello.block_size
        self.max_model_len = (min(self.max_model_len, hello.max_model_len) if self.max_model_len
                              else hello.max_model_len)
        return True

    def on_state_change(self) -> None:
        live = [c for c in self.conns if c.connected and c.hello is not None]
        groups = compute_groups({c.id: c.hello.compute for c in live}, {c.id: c.hello.uses for c in live})
        for c in live:
            c.group, c.share = groups[c.id]
        for fn in self.state_listeners:
            fn()
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def wait_ready(self, n: int = 1, timeout: float | None = None) -> bool:
        """Wait until at least `n` replicas are ready; False on timeout."""
        return await self.wait_for(lambda: len(self.ready()) >= n, timeout)

    async def wait_for(self, predicate, timeout: float | None = None) -> bool:
        """Wait until `predicate()` holds, re-checked on every readiness change; False on timeout."""
        async def wait():
            async with self._changed:
                await self._changed.wait_for(predicate)

        try:
            await asyncio.wait_for(wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def start(self) -> None:
        self._http = httpx.AsyncClient(trust_env=False, timeout=max(self.cfg.healthz_interval_s, 0.5),
                                       verify=self.ssl or True)
        self._runs = {c: asyncio.create_task(c.run()) for c in self.conns}
        self._tasks = [asyncio.create_task(self._watchdog())]
        if self.cfg.healthz_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._healthz_loop()))

    async def stop(self) -> None:
        tasks = self._tasks + list(self._runs.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks, self._runs = [], {}
        for c in self.conns:
            if c.link is not None:
                c.link.abort()
        if self._http is not None:
            await self._http.aclose()

    def add(self, url: str) -> ReplicaConn:
        """A replica joins live (discovery): it connects, says Hello (tokenizer and block size
        checked) and sends its KV snapshot and Load, as the replicas given at start do."""
        conn = next((c for c in self.conns if c.url == url and c.leaving_since), None)
        if conn is not None:  # back before it had left: ready again (streams already handed on stay moved)
            conn.leaving_since = 0.0
            self.on_state_change()
            return conn
        conn = ReplicaConn(url, self)
        self.conns.append(conn)
        if self._tasks:  # started
            self._runs[conn] = asyncio.create_task(conn.run())
        return conn

    def remove(self, url: str) -> None:
        """A replica leaves live (discovery): no new request goes to it; one up with streams hands
        them on as a drain does and goes once they left (`_watchdog`), any other goes now."""
        conn = next((c for c in self.conns if c.url == url and not c.leaving_since), None)
        if conn is None:
            return
        if conn.connected and conn.streams:
            log.info("replica %s left discovery with %d streams in flight: handing them on", conn.id,
                     len(conn.streams))
            conn.leaving_since = perf_counter()
            self.on_state_change()
            if not conn.draining:  # (draining: its streams were handed on already)
                self.events.on_draining(conn, list(conn.streams.values()))
            return
        if conn.connected and not conn.draining:  # idle, still up: its hot chains move all the same (handoff)
            self.events.on_draining(conn, [])
        self._drop(conn)

    def _drop(self, conn: ReplicaConn) -> None:
        """`conn` leaves the pool: its run stops, and streams still on it fail over (cause `removed`)."""
        self.conns.remove(conn)  # out of routing before its streams look for a new home
        run = self._runs.pop(conn, None)
        if run is not None:
            run.cancel()
        if conn.connected:
            conn.lose("removed")
        elif conn.link is not None:
            conn.link.abort()
        self.on_state_change()

    async def _watchdog(self) -> None:
        period = min(0.1, self.cfg.stall_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            now = perf_counter()
            for c in list(self.conns):
                if c.stalled(now):
                    c.lose("stall")
                if c.leaving_since and (not c.streams or not c.connected
                                        or now - c.leaving_since > self.cfg.leave_timeout_s):
                    self._drop(c)

    async def _healthz_loop(self) -> None:
        while True:
            await asyncio.gather(*(c.healthz(self._http) for c in self.conns))
            await asyncio.sleep(self.cfg.healthz_interval_s)
