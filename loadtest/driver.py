"""The load driver: arrivals, users, connections, and the end of a run.

Open loop: users (sessions) arrive at Poisson or gamma-distributed times at a
given rate, whatever the service's latency, so a slow service meets the same
offered load (no coordinated omission). Closed loop: a fixed number of users,
each starting a new session as soon as the last one ends. A run stops starting
work at its duration or once it has sent its request count; requests in flight
then get `drain_s` to finish, after which the rest are cut and counted as
unfinished.

Each arriving user belongs to a client location (round-robin over the
locations given) and connects to the nearest healthy region of that location,
found by probing `/healthz` RTTs (edge_proxy.select), falling over in RTT order.
The built-in topology's locations each sit next to one region (their relay to
it has the smallest RTT), so every region gets its own location's share of the load.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import sys
from dataclasses import dataclass, field
from time import perf_counter

from websockets.exceptions import InvalidHandshake

from loadtest import workloads as W
from loadtest.client import Call, HttpConn, WsConn
from loadtest.metrics import Recorder
from edge_proxy.select import probe_regions, rank, ws_url


@dataclass
class Location:
    """A client population: the regions it can reach (name -> http URL), nearest first after probing."""

    name: str
    regions: dict[str, str]
    order: list[str] = field(default_factory=list)
    rtt_ms: dict[str, float] = field(default_factory=dict)
    # rank by these, then by measured RTT (a topology without relays; one location per --url REGION=URL)
    declared_rtt_ms: dict[str, float] | None = None


@dataclass
class RunConfig:
    mix: dict[str, float]
    rate: float = 0.0  # sessions per second (open loop); 0 -> closed loop with `concurrency`
    concurrency: int = 0
    arrival: str = "poisson"  # poisson | gamma
    burstiness: float = 1.0  # gamma shape; 1 = Poisson, < 1 burstier
    duration_s: float = 0.0  # stop starting work after this long (0: no limit)
    requests: int = 0  # stop after sending this many requests (0: no limit)
    protocol: str = "ws"  # ws | http
    api_key: str | None = None
    seed: int = 0
    slos: dict[str, float] = field(default_factory=dict)
    drain_s: float = 60.0
    knobs: W.Knobs = field(default_factory=W.Knobs)
    progress: bool = True

    def __post_init__(self):
        if (self.rate > 0) == (self.concurrency > 0):
            raise ValueError("give exactly one of --rate (open loop) and --concurrency (closed loop)")
        if self.duration_s <= 0 and self.requests <= 0:
            raise ValueError("give --duration or --requests (or both)")
        if self.arrival not in ("poisson", "gamma"):
            raise ValueError(f"arrival must be poisson or gamma, got {self.arrival!r}")
        if self.burstiness <= 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.protocol not in ("ws", "http"):
            raise ValueError(f"protocol must be ws or http, got {self.protocol!r}")


def interarrivals(rng: random.Random, rate: float, arrival: str, burstiness: float):
    """Gaps between arrivals with mean 1/rate: exponential, or gamma(shape=burstiness)."""
    while True:
        if arrival == "poisson" or burstiness == 1.0:
            yield rng.expovariate(rate)
        else:
            yield rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


class User:
    """One simulated user's session: the workloads call these."""

    def __init__(self, run: Run, loc: Location, workload: str, sid: str):
        self.run, self.loc, self.workload, self.sid = run, loc, workload, sid
        self.conn: WsConn | None = None
        self.region = ""
        self.pending: set[asyncio.Task] = set()

    @property
    def stopped(self) -> bool:
        return self.run.stop.is_set()

    async def think(self, seconds: float) -> bool:
        """Wait `seconds` (think time); False when the run stopped meanwhile."""
        if self.stopped:
            return False
        if seconds > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.run.stop.wait(), seconds)
        return not self.stopped

    async def _conn(self):
        if self.run.cfg.protocol == "http":
            self.region = self.loc.order[0]
            return self.run.http_conn(self.loc.regions[self.region])
        if self.conn is None:
            last = None
            for region in self.loc.order:  # nearest healthy first, then in RTT order
                try:
                    self.conn = await WsConn.open(ws_url(self.loc.regions[region]), self.run.cfg.api_key)
                    self.region = region
                    break
                except (OSError, TimeoutError, InvalidHandshake) as e:
                    last = e
            if self.conn is None:
                raise ConnectionError(f"no region of {self.loc.name} accepted a connection: {last}")
            self.run.conns.add(self.conn)
        return self.conn

    async def start(self, *, deadline_ms: float = 0.0, replaces: Call | None = None, **kw) -> Call | None:
        """Send a request; `replaces`: the call it supersedes (aborted in the same step over the
        WebSocket, cancelled first over HTTP), counted as a cancellation."""
        if not self.run.take():
            return None
        try:
            conn = await self._conn()
        except ConnectionError as e:
            self.run.connect_errors += 1
            self.run.note(str(e))
            return None
        if replaces is not None and not replaces.finished.is_set() and not replaces.t_cancel:
            if isinstance(conn, WsConn):
                replaces.mark_cancelled()
                kw["replaces"] = replaces.id
            else:
                await replaces.cancel()
        call = await conn.request(session=self.sid, deadline_ms=deadline_ms, **kw)
        t = asyncio.get_running_loop().create_task(self._record(call, deadline_ms))
        self.pending.add(t)
        t.add_done_callback(self.pending.discard)
        return call

    async def _record(self, call: Call, deadline_ms: float) -> None:
        await call.finished.wait()
        self.run.rec.record(self.workload, self.region, call, deadline_ms, cut=self.run.cutting)

    async def request(self, *, cancel_after_tokens: int | None = None, **kw) -> Call | None:
        call = await self.start(**kw)
        if call is None:
            return None
        if cancel_after_tokens is not None:
            await call.tokens_or_end(cancel_after_tokens)
            await call.cancel()  # barge-in
        await call.finished.wait()
        return call

    async def supersede(self, call: Call) -> None:
        await call.cancel()

    async def finish(self, call: Call) -> None:
        await call.finished.wait()

    async def close(self) -> None:
        if self.pending:
            await asyncio.gather(*self.pending, return_exceptions=True)
        if self.conn is not None:
            self.run.conns.discard(self.conn)
            await self.conn.close()


class Run:
    """One load level against one set of locations."""

    def __init__(self, cfg: RunConfig, locations: list[Location], out=None):
        if not locations:
            raise ValueError("no client location to drive")
        self.cfg, self.locations = cfg, locations
        self.out = out if out is not None else sys.stderr
        self.corpus = W.load_corpus()
        self.stop = asyncio.Event()
        self.rec = Recorder(cfg.slos)
        self.sent = 0
        self.sessions = 0
        self.connect_errors = 0
        self.cutting = False
        self.conns: set[WsConn] = set()
        self._http: dict[str, HttpConn] = {}
        self._tasks: set[asyncio.Task] = set()
        self._notes: list[str] = []
        self.t0 = 0.0
        self.elapsed = 0.0

    def note(self, msg: str) -> None:
        if msg not in self._notes:
            self._notes.append(msg)

    def take(self) -> bool:
        """Count one request against the budget; False once the run has stopped."""
        if self.stop.is_set():
            return False
        self.sent += 1
        if self.cfg.requests and self.sent >= self.cfg.requests:
            self.stop.set()
        return True

    def http_conn(self, url: str) -> HttpConn:
        c = self._http.get(url)
        if c is None:
            c = self._http[url] = HttpConn(url, self.cfg.api_key)
        return c

    async def probe(self) -> None:
        for loc in self.locations:
            probes = await probe_regions(loc.regions)
            loc.rtt_ms = {p.region: round(p.rtt_ms, 2) for p in probes if p.healthy}
            loc.order = [p.region for p in rank(probes)]
            if loc.declared_rtt_ms is not None:  # who is near is said, not measured (stable: RTT order after)
                loc.order.sort(key=lambda r: loc.declared_rtt_ms.get(r, float("inf")))
            if not loc.order:
                raise ConnectionError(f"client location {loc.name}: no healthy region "
                                      f"({'; '.join(f'{p.region}: {p.detail}' for p in probes)})")

    async def _session(self, n: int, loc: Location) -> None:
        rng = random.Random(self.cfg.seed * 1_000_003 + n)  # one stream per session: repeatable runs
        names, weights = zip(*self.cfg.mix.items())
        workload = rng.choices(names, weights)[0]
        user = User(self, loc, workload, f"s{self.cfg.seed}-{n}")
        try:
            await W.WORKLOADS[workload](user, rng, self.corpus, self.cfg.knobs)
        finally:
            await user.close()

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._task_done)
        return t

    def _task_done(self, t: asyncio.Task) -> None:
        self._tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:
            self.note(f"session failed: {t.exception()!r}")

    async def _open_loop(self) -> None:
        rng = random.Random(self.cfg.seed)
        gaps = interarrivals(rng, self.cfg.rate, self.cfg.arrival, self.cfg.burstiness)
        locs = itertools.cycle(self.locations)
        t_next = perf_counter()
        for n in itertools.count():
            if self.stop.is_set():
                return
            self._spawn(self._session(n, next(locs)))
            self.sessions += 1
            t_next += next(gaps)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), max(t_next - perf_counter(), 0.0))

    async def _closed_loop(self) -> None:
        counter = itertools.count()
        locs = itertools.cycle(self.locations)

        async def worker(loc: Location) -> None:
            while not self.stop.is_set():
                self.sessions += 1
                await self._session(next(counter), loc)

        await asyncio.gather(*(worker(next(locs)) for _ in range(self.cfg.concurrency)))

    async def _progress(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self._print_progress()

    def _print_progress(self, end: str = "\r") -> None:
        if not self.cfg.progress:
            return
        el = perf_counter() - self.t0
        tot = self.rec.totals().get("all")
        done = tot.requests if tot else 0
        errs = sum(tot.errors.values()) if tot else 0
        ttft = tot.ttft.percentile_ms(50) if tot and tot.ttft.n else float("nan")
        itl = tot.itl.percentile_ms(99) if tot and tot.itl.n else float("nan")
        limit = f"/{self.cfg.requests}" if self.cfg.requests else ""
        dur = f"/{self.cfg.duration_s:g}" if self.cfg.duration_s else ""
        print(f"  {el:6.1f}{dur} s  sent {self.sent}{limit}  done {done}  in flight {self.sent - done}  "
              f"errors {errs}  TTFT p50 {ttft:.0f} ms  ITL p99 {itl:.0f} ms   ", end=end, file=self.out, flush=True)

    async def run(self) -> dict:
        await self.probe()
        self.t0 = self.rec.t0 = perf_counter()
        progress = asyncio.get_running_loop().create_task(self._progress())
        loop_task = self._spawn(self._open_loop() if self.cfg.rate > 0 else self._closed_loop())
        try:
            if self.cfg.duration_s > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), self.cfg.duration_s)
                self.stop.set()
            else:
                await self.stop.wait()
            self.elapsed = perf_counter() - self.t0
            await asyncio.gather(loop_task, return_exceptions=True)
            rest = list(self._tasks)
            if rest:
                _, late = await asyncio.wait(rest, timeout=self.cfg.drain_s)
                if late:
                    self.cutting = True
                    self.note(f"{len(late)} sessions still running {self.cfg.drain_s:g} s after the end: cut")
                    for c in list(self.conns):
                        await c.ws.close()
                    for h in self._http.values():
                        await h.close()
                    await asyncio.wait(late, timeout=10)
                    for t in late:
                        t.cancel()
                    await asyncio.gather(*late, return_exceptions=True)
        finally:
            progress.cancel()
            await asyncio.gather(progress, return_exceptions=True)
            self._print_progress(end="\n")
            for h in self._http.values():
                await h.close()
        wall = perf_counter() - self.t0
        return {
            "duration_s": round(self.elapsed, 3), "wall_s": round(wall, 3), "sessions": self.sessions,
            "requests_sent": self.sent, "connect_errors": self.connect_errors,
            "locations": {loc.name: {"order": loc.order, "rtt_ms": loc.rtt_ms} for loc in self.locations},
            "notes": self._notes, **self.rec.summary(self.elapsed),
        }
