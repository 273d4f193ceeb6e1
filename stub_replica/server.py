"""A replica stub speaking the real internal protocol over a real WebSocket.

For tests and `bench/proxy.py`: deterministic streams, no model. It serves
`ws://host:port/v1/replica` (Hello, Load, KvEvents, Tokens, Finished, Error) and
`GET /healthz`, checks the shared secret like a replica (close 4401), and can be
told to crash, lag or refuse.

Streams: token `p` of a request is a pure function of (prompt ids, seed, p),
drawn from the printable bytes of " abcdefghijklmnopqrstuvwxyz" (so with the
proxy's `ByteTokenizer` the text is the token's character). A prompt holding
`poison_token` is a query of death: it crashes the stub or fails with
`engine_fault`, as `poison_action` says. Greedy requests
(temperature 0) ignore the seed. A resumed request must carry exactly the
tokens the stub would have produced (else `Error(bad_request)`: a proxy bug) and
continues at position `len(resume_ids)`. With n > 1, sample i is the stream of
seed `sample_seed(seed, i)` and its messages carry `index = i` (each sample
resumes on its own); with logprobs every token has logprob -1 and the requested
number of alternatives (the token first). One engine tick every `step_s` emits
one token for every running request, all tokens for one connection in one frame.
With `jitter`, each request starts at a random phase within its step, as streams
of independent users would. With `max_running` (like a replica's `max_num_seqs`)
at most that many requests run at once; the rest wait in arrival order, are
reported as `waiting` in `Load`, and start as slots free.

Prefix cache: per (salt-chained) block hash, LRU over `total_blocks`; each new
request reports `cached_tokens` for its leading cached blocks and broadcasts the
newly stored/evicted hashes as KvEvents to every connection; a finished stream's
blocks (prompt + the ids it computed) are stored too, as an engine's are.

`stamp=True` (bench): each token's text is the stub's send time,
`time.perf_counter_ns()` (CLOCK_MONOTONIC, comparable across processes) + ";".

    python -m stub_replica --port 9001 --id stub-a [--step-ms 50 --stamp --jitter --max-running 8]
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import hmac
from collections import deque
import random
import signal
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import xxhash
from websockets.asyncio.server import serve
from websockets.exceptions import ConnectionClosed
from websockets.protocol import State

from wire import protocol as P
from wire.hashing import ChainTips, block_hashes, salt_seed

ALPHABET = b" abcdefghijklmnopqrstuvwxyz"
TICK_S = 0.001  # engine loop granularity (the event loop's timers have 1 ms resolution)


def token_at(prompt_key: int, seed: int, pos: int) -> int:
    return ALPHABET[xxhash.xxh3_64_intdigest(pos.to_bytes(8, "little"), seed=(prompt_key ^ seed) & (2**64 - 1))
                    % len(ALPHABET)]


def prompt_key(prompt_ids: list[int]) -> int:
    return xxhash.xxh3_64_intdigest(array("I", prompt_ids).tobytes())


def expected_tokens(prompt_ids: list[int], sampling: P.SamplingParams, n: int, start: int = 0,
                    index: int = 0) -> list[int]:
    """What the stub generates for this prompt (sample `index`): positions start..n-1."""
    k, seed = prompt_key(prompt_ids), _seed(sampling, index)
    return [token_at(k, seed, p) for p in range(start, n)]


def _seed(sp: P.SamplingParams, index: int = 0) -> int:
    return 0 if sp.temperature == 0 or sp.seed is None else P.sample_seed(sp.seed, index)


@dataclass
class StubConfig:
    replica_id: str = "stub-0"
    model: str = "stub"
    secret: str = ""
    block_size: int = 16
    max_model_len: int = 4096
    total_blocks: int = 4096
    step_s: float = 0.01
    load_interval_s: float = 0.05
    stamp: bool = False
    jitter: bool = False
    load_override: dict = field(default_factory=dict)  # Load fields to report instead of the real ones
    kv_events: bool = True  # False: a replica that never reports its cache (the proxy must guess)
    tokenizer: str = "bytes-v1"  # fingerprint in Hello (edge_proxy.prompt.ByteTokenizer's)
    compute: list = field(default_factory=list)  # Hello.compute: the units it claims to compute on ([]: its own)
    uses: int = 0  # Hello.uses: how many of them at once (0: all)
    max_running: int = 0  # requests producing tokens at once (0: no limit); the rest wait
    poison_token: int = -1  # a prompt holding this id is a query of death: see poison_action
    poison_action: str = "crash"  # crash: the whole stub dies (as a killed process); fault: Error(engine_fault)


class _Req:
    __slots__ = ("conn", "gen", "key", "seed", "pos", "due", "cached", "t_arrival", "ttft_ms", "index", "rid", "last")

    def __init__(self, conn, gen: P.Generate, due: float, cached: int, index: int = 0, start: int = 0):
        self.conn, self.gen, self.due, self.cached, self.index = conn, gen, due, cached, index
        self.key, self.seed = prompt_key(gen.prompt_ids), _seed(gen.sampling, index)
        self.pos = start
        self.rid = gen.id if gen.sampling.n == 1 else f"{gen.id}#{index}"  # key in _Conn.reqs
        self.t_arrival = time.perf_counter()
        self.ttft_ms = 0.0
        self.last = 0.0  # when its previous token went out


class _Conn:
    def __init__(self, ws):
        self.ws = ws
        self.reqs: dict[str, _Req] = {}
        self.out: list = []


class StubReplica:
    def __init__(self, cfg: StubConfig | None = None, **kw):
        self.cfg = cfg or StubConfig(**kw)
        self.port = 0
        self.lag = False  # stop sending anything (pings are still answered)
        self.refuse = False  # refuse every new connection as if its secret were wrong
        self.refuse_http = False  # refuse before the upgrade (HTTP 403, as Starlette does) instead of close 4401
        self.healthy = True  # /healthz 200 or 503
        self.frozen = False  # see freeze()
        self.generates: list[P.Generate] = []
        self.aborts: list[tuple[str, int]] = []  # (request id, tokens it had produced when the Abort came)
        self.tokens_sent = 0
        self.conns: set[_Conn] = set()
        self._codec = P.Codec()
        self._cache: OrderedDict[int, None] = OrderedDict()
        self._tips = ChainTips()  # the chains (conversations) cached, as an engine counts them (Load.chains)
        self._report_due = False  # a Load is queued for the end of this loop turn (`_report_soon`)
        self._heap: list = []  # (due, seq, _Req)
        # The step as it runs, not as configured: a starved host stretches it, and Load says
        # so as a real replica's measured step does (the proxy's admission plans with it).
        self._step_s = self.cfg.step_s
        self._seq = 0
        self._server = None
        self._tasks: list[asyncio.Task] = []
        self._dirty: set[_Conn] = set()  # connections with queued messages
        self._running: set[_Req] = set()  # with max_running: the requests holding a slot
        self._waiting: deque[_Req] = deque()  # with max_running: admitted, waiting for a slot
        self._waiter: asyncio.Future | None = None
        self._crashing: asyncio.Task | None = None
        self.abort_event = asyncio.Event()  # set on the first Abort received
        self.connected_event = asyncio.Event()  # set once a peer is connected
        self.token_event = asyncio.Event()  # set once a token was produced
        self.ended_event = asyncio.Event()  # set whenever a request ends (finished, aborted, connection gone)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/replica"

    # -- server ------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> StubReplica:
        self._server = await serve(self._handler, host, port, process_request=self._http, compression=None,
                                   ping_interval=None, max_size=64 << 20, max_queue=None)
        self.port = self._server.sockets[0].getsockname()[1]
        self._tasks = [asyncio.create_task(self._engine()), asyncio.create_task(self._reporter())]
        return self

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            self._server.close()
            for ws in list(self._server.connections):
                ws.transport.abort()
            await self._server.wait_closed()

    async def crash(self) -> None:
        """Die like a killed process: connections reset, port closed, state gone."""
        for c in list(self.conns):
            c.ws.transport.abort()
        self.conns.clear()
        self._heap.clear()
        self._running.clear()
        self._waiting.clear()
        await self.stop()

    def produced(self) -> dict[str, int]:
        """Tokens produced so far by each running request."""
        return {rid: r.pos for c in self.conns for rid, r in c.reqs.items()}

    @property
    def active(self) -> int:
        """Requests the stub holds (running or waiting for a slot)."""
        return sum(len(c.reqs) for c in self.conns)

    async def until_idle(self, timeout: float = 5.0) -> None:
        """Wait until the stub holds no request."""
        async with asyncio.timeout(timeout):
            while self.active:
                self.ended_event.clear()
                await self.ended_event.wait()

    def freeze(self) -> None:
        """Like SIGSTOP: sockets stay open, nothing is read or sent (pings go unanswered)."""
        self.lag = self.frozen = True
        for c in self.conns:
            c.ws.transport.pause_reading()

    def _http(self, connection, request):
        if request.path == "/healthz":
            return connection.respond(200 if self.healthy else 503, "ok\n" if self.healthy else "sick\n")
        if request.path != "/v1/replica":
            return connection.respond(404, "not found\n")
        if self.refuse_http and not self._authorized(request.headers):
            return connection.respond(403, "unauthorized\n")
        return None

    def _authorized(self, headers) -> bool:
        if self.refuse:
            return False
        if not self.cfg.secret:
            return True
        got = (headers.get("Authorization") or "").encode()
        return hmac.compare_digest(got, f"Bearer {self.cfg.secret}".encode())

    async def _handler(self, ws) -> None:
        if not self._authorized(ws.request.headers):
            await ws.close(4401, "unauthorized")
            return
        if self.frozen:
            ws.transport.pause_reading()
            await ws.wait_closed()
            return
        c = _Conn(ws)
        cfg = self.cfg
        # Like the replica: Hello, then the whole cache state, in the first frame.
        first = [P.Hello(cfg.replica_id, cfg.model, cfg.block_size, cfg.max_model_len, tokenizer=cfg.tokenizer,
                         compute=list(cfg.compute), uses=cfg.uses)]
        if cfg.kv_events:
            first.append(P.KvEvents(stored=list(self._cache), cleared=True))
        await ws.send(self._codec.encode(first))
        self.conns.add(c)
        self.connected_event.set()
        try:
            async for data in ws:
                for m in self._codec.decode(data):
                    if type(m) is P.Generate:
                        self._admit(c, m)
                    elif type(m) is P.Abort:
                        for rid in [m.id] + [k for k in c.reqs if k.startswith(m.id + "#")]:
                            r = c.reqs.pop(rid, None)
                            if r is not None:
                                self.aborts.append((rid, r.pos))
                                self.abort_event.set()
                                self._free(r)
        except ConnectionClosed:
            pass
        finally:
            self.conns.discard(c)
            gone, c.reqs = list(c.reqs.values()), {}
            for r in gone:
                self._free(r)

    # -- engine ----------------------------------------------------------------

    def _queue(self, c: _Conn, msg) -> None:
        c.out.append(msg)
        self._dirty.add(c)
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _admit(self, c: _Conn, g: P.Generate) -> None:
        self.generates.append(g)
        if self.cfg.poison_token in g.prompt_ids:
            if self.cfg.poison_action == "fault":
                self._queue(c, P.Error(P.ENGINE_FAULT, "this request made the engine fail (stub poison)", g.id))
            else:
                self._crashing = asyncio.get_running_loop().create_task(self.crash())
            return
        sp = g.sampling
        samples = g.samples()
        if any(resume and resume != expected_tokens(g.prompt_ids, sp, len(resume), index=i) for i, resume in samples):
            self._queue(c, P.Error(P.BAD_REQUEST, "resume_ids differ from this request's stream", g.id))
            return
        if len(g.prompt_ids) + sp.max_tokens > self.cfg.max_model_len:
            self._queue(c, P.Error(P.PROMPT_TOO_LONG, "prompt + max_tokens over max_model_len", g.id))
            return
        cached = self._cache_prompt(g)
        for i, resume in samples:
            r = _Req(c, g, 0.0, cached, i, len(resume))
            c.reqs[r.rid] = r
            if self.cfg.max_running and len(self._running) >= self.cfg.max_running:
                self._waiting.append(r)
            else:
                self._run(r)
        self._report_soon()

    def _run(self, r: _Req) -> None:
        if self.cfg.max_running:
            self._running.add(r)
        r.due = time.perf_counter() + (random.random() * self.cfg.step_s if self.cfg.jitter else 0.0)
        self._seq += 1
        heapq.heappush(self._heap, (r.due, self._seq, r))
        self._wake()

    def _free(self, r: _Req) -> None:
        """`r` ended (finished, aborted, connection gone): its slot goes to the next waiting request."""
        self.ended_event.set()
        if r not in self._running:
            return
        self._running.discard(r)
        while self._waiting and len(self._running) < self.cfg.max_running:
            w = self._waiting.popleft()
            if w.conn.reqs.get(w.rid) is w and w.conn in self.conns:
                self._run(w)

    def _cache_prompt(self, g: P.Generate) -> int:
        return self._store(block_hashes(g.prompt_ids, self.cfg.block_size, g.cache_salt), g.cache_salt)

    def _cache_reply(self, r: _Req) -> None:
        """A finished stream's blocks stay cached, as an engine's do: its prompt and the ids
        it computed (every generated id but the last, which was sampled, never computed)."""
        g = r.gen
        ids = g.prompt_ids + [token_at(r.key, r.seed, p) for p in range(r.pos - 1)]
        self._store(block_hashes(ids, self.cfg.block_size, g.cache_salt), g.cache_salt)

    def _store(self, hashes: list[int], salt: str) -> int:
        """Cache these chained blocks (KV events to every connection); the leading ones already held, in tokens."""
        cache, cached, stored, removed = self._cache, 0, [], []
        prev = salt_seed(salt)
        for i, h in enumerate(hashes):
            if h in cache:
                cache.move_to_end(h)
                if cached == i:
                    cached += 1
            else:
                cache[h] = None
                stored.append(h)
                self._tips.add(h, prev)
            prev = h
        while len(cache) > self.cfg.total_blocks:
            removed.append(cache.popitem(last=False)[0])
            self._tips.remove(removed[-1])
        if (stored or removed) and self.cfg.kv_events:
            ev = P.KvEvents(stored, removed)
            for c in self.conns:
                self._queue(c, ev)
        return cached * self.cfg.block_size

    async def _sleep(self, delay: float | None) -> None:
        """Until `delay` passes or `_wake` is called."""
        loop = asyncio.get_running_loop()
        self._waiter = w = loop.create_future()
        h = loop.call_later(delay, self._wake) if delay is not None else None
        try:
            await w
        finally:
            self._waiter = None
            if h is not None:
                h.cancel()

    async def _engine(self) -> None:
        heap, step = self._heap, self.cfg.step_s
        tick = min(TICK_S, step)
        while True:
            now = time.perf_counter()
            horizon = now + tick / 2  # what falls due within half a tick goes now: no busy-waiting
            while heap and heap[0][0] <= horizon:
                _, _, r = heapq.heappop(heap)
                if r.conn.reqs.get(r.rid) is not r:
                    continue  # aborted or connection gone
                if r.last:  # a pause (lag, freeze) counts as ten steps at most
                    self._step_s += 0.05 * (min(now - r.last, 10 * step) - self._step_s)
                r.last = now
                self._emit(r, now)
                if r.conn.reqs.get(r.rid) is r:
                    r.due = max(r.due + step, now)  # an overloaded host falls behind instead of bursting
                    self._seq += 1
                    heapq.heappush(heap, (r.due, self._seq, r))
            if self._dirty and not self.lag:
                self._flush()
            await self._sleep(max(heap[0][0] - time.perf_counter(), tick) if heap else None)

    def _emit(self, r: _Req, now: float) -> None:
        g = r.gen
        tok = token_at(r.key, r.seed, r.pos)
        r.pos += 1
        self.tokens_sent += 1
        self.token_event.set()
        if not r.ttft_ms:
            r.ttft_ms = (now - r.t_arrival) * 1e3
        c = r.conn
        k = g.sampling.logprobs
        lps = [] if k is None else [P.TokenLogprob(-1.0, [tok, *ALPHABET[:k]][:k], [-1.0] * k)]
        c.out.append(P.Tokens(g.id, [tok], "" if self.cfg.stamp else chr(tok), r.index, lps))  # stamped in _flush
        self._dirty.add(c)
        if r.pos >= g.sampling.max_tokens:
            c.out.append(P.Finished(g.id, P.FINISH_LENGTH, P.Usage(len(g.prompt_ids), r.pos, r.cached), r.ttft_ms,
                                    index=r.index))
            del c.reqs[r.rid]
            self._free(r)
            self._cache_reply(r)

    def _flush(self) -> None:
        dirty, self._dirty = self._dirty, set()
        for c in dirty:
            out, c.out = c.out, []
            if not out or c not in self.conns:
                continue
            if self.cfg.stamp:
                stamp = f"{time.perf_counter_ns()};"
                for m in out:
                    if type(m) is P.Tokens:
                        m.text = stamp
            # Straight through the sans-I/O protocol to the transport: the asyncio
            # `send()` costs several times more, and the bench's direct baseline sends
            # one frame per token per connection.
            ws = c.ws
            if ws.protocol.state is State.OPEN and not ws.transport.is_closing():
                ws.protocol.send_binary(self._codec.encode(out))
                ws.transport.write(b"".join(ws.protocol.data_to_send()))

    async def _reporter(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.load_interval_s)
            self._report()

    def _report_soon(self) -> None:
        """A Load at the end of this loop turn, as a replica's API process sends one the turn it accepts a
        request (replica.api.queued_load): every proxy sees a placement one hop later."""
        if not self._report_due:
            self._report_due = True
            asyncio.get_running_loop().call_soon(self._report)

    def _report(self) -> None:
        self._report_due = False
        if self.lag:
            return
        cfg, held = self.cfg, self.active
        running = len(self._running) if cfg.max_running else held
        fields = dict(running=running, waiting=held - running, free_blocks=cfg.total_blocks - len(self._cache),
                      total_blocks=cfg.total_blocks, step_ms=max(cfg.step_s, self._step_s) * 1e3,
                      tokens_per_s=running / max(cfg.step_s, self._step_s), max_running=cfg.max_running,
                      chains=self._tips.tips if cfg.kv_events else -1)
        fields.update(cfg.load_override)
        load = P.Load(**fields)
        for c in self.conns:
            self._queue(c, load)


async def _main(a) -> None:
    stub = StubReplica(StubConfig(replica_id=a.id, secret=a.secret, step_s=a.step_ms / 1e3, stamp=a.stamp,
                                  jitter=a.jitter, load_interval_s=a.load_interval_ms / 1e3, block_size=a.block_size,
                                  max_running=a.max_running, tokenizer=a.tokenizer))
    await stub.start(a.host, a.port)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    print(f"READY {stub.port}", flush=True)
    await stop.wait()
    await stub.stop()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m stub_replica")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--id", default="stub-0")
    p.add_argument("--secret", default="")
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--stamp", action="store_true")
    p.add_argument("--jitter", action="store_true")
    p.add_argument("--max-running", type=int, default=0, help="requests run at once (0: no limit); the rest wait")
    p.add_argument("--tokenizer", default=StubConfig.tokenizer, help="tokenizer fingerprint announced in Hello")
    p.add_argument("--load-interval-ms", type=float, default=500.0)
    a = p.parse_args(argv)
    import uvloop

    uvloop.run(_main(a))
