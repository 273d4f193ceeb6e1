"""Routing at scale without models: the proxy's routing code over simulated replicas.

    .venv/bin/python bench/routing_sim.py                      # 1,000 conversations, 16 replicas
    .venv/bin/python bench/routing_sim.py --conversations 200 --replicas 4 --modes auto,round_robin

What is real: `edge_proxy.routing` (the router of each mode), `edge_proxy.prefix_index`
(one `BlockIndex` per replica, fed by the proxy's own expectations and by
`wire.protocol.KvEvents` messages), `wire.hashing` (the block hashes), and the
proxy's bookkeeping order: index the prompt when routed, the prompt + streamed ids
when a stream ends. What is simulated (a discrete-event clock, no sockets):

* replicas: continuous batching (decodes first, chunked prefill under a token
  budget, step time = base + per decode + per prefill token), a prefix cache of
  `--cache-blocks` block hashes with LRU eviction that reuses the longest cached
  prefix, and KV events for every block stored or evicted, delivered to the proxy
  `--event-delay-ms` later (the replica -> proxy hop; 0 = in the step's frame);
* clients: `--concurrency` conversations at a time (closed loop), each with its own
  system prompt, `--turns` turns, replies of 16..64 ids; with probability
  `--retokenize` a reply comes back in the next turn re-tokenized (one id differs
  at a random place), as a chat template re-rendering it would.

Figures: "cached" = cached prompt tokens / prompt tokens on later turns, the oracle
the same with every conversation on one replica with an unbounded cache (with
`--turns 1`: over every request, the oracle holding the system prompt everywhere);
requests per replica as min / max / the largest deviation from the mean; TTFT in
simulated milliseconds.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge_proxy.prefix_index import BlockIndex, reply_hashes  # noqa: E402
from edge_proxy.routing import MODES, Candidate, RouterConfig, make_router  # noqa: E402
from wire.hashing import block_hashes  # noqa: E402
from wire.protocol import KvEvents  # noqa: E402

BS = 16
SESSIONS = {"auto": (False, True), "prefix": (False,), "sticky": (True,), "round_robin": (False,)}  # runs per mode
EOS, NL, GEN = 2, 198, [1, 9520, 198]  # ChatML-like: reply end, newline, "<|im_start|>assistant\n"


@dataclass
class SimConfig:
    conversations: int = 1000
    replicas: int = 16
    concurrency: int = 96
    turns: int = 4
    system_tokens: int = 160
    shared: bool = False  # every conversation under one system prompt (the shared-prefix workload)
    user_tokens: tuple[int, int] = (8, 32)
    reply_tokens: tuple[int, int] = (16, 64)
    retokenize: float = 0.05
    cache_blocks: int = 1400  # ~1 GiB of KV for the default model on CPU
    event_delay_ms: float = 0.0
    events_only: bool = False  # ablation: the index learns from KV events alone (no expected blocks)
    think_ms: float = 0.0
    step_ms: float = 25.0  # per step ...
    decode_ms: float = 1.5  # ... + per decoding sequence
    prefill_ms: float = 0.25  # ... + per prefill token
    budget: int = 512  # tokens per step
    seed: int = 0


@dataclass
class Req:
    conv: int
    turn: int
    prompt: list[int]
    hashes: list[int]
    reply: list[int]  # the ids the replica will generate
    arrival: float
    replica: str = ""
    computed: int = 0  # prompt tokens computed (cached ones included)
    cached: int = 0
    out: int = 0  # ids generated
    ttft: float = 0.0


@dataclass
class Replica:
    id: str
    cache: OrderedDict = field(default_factory=OrderedDict)  # hash -> None, LRU
    waiting: list[Req] = field(default_factory=list)
    running: list[Req] = field(default_factory=list)
    busy: bool = False
    served: int = 0


class Sim:
    def __init__(self, cfg: SimConfig, mode: str, sessions: bool, router_cfg: RouterConfig | None = None):
        self.cfg, self.sessions = cfg, sessions
        self.rng = random.Random(cfg.seed)
        self.router = make_router(router_cfg or RouterConfig(mode=mode))
        self.reps = {f"r{i:02d}": Replica(f"r{i:02d}") for i in range(cfg.replicas)}
        self.index = {r: BlockIndex(capacity=cfg.cache_blocks * 2) for r in self.reps}
        self.load = {r: 0 for r in self.reps}
        self.session_at: dict[int, str] = {}
        self.clock = 0.0
        self.heap: list = []
        self.seq = itertools.count()
        self.later = [0, 0, 0]  # prompt tokens, cached tokens, oracle cached tokens (turns >= 2)
        self.ttfts: list[float] = []
        self.hits = self.later_turns = 0

    # -- event loop ---------------------------------------------------------------------
    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), fn, args))

    def run(self) -> dict:
        convs = iter(range(self.cfg.conversations))
        for c in itertools.islice(convs, self.cfg.concurrency):
            self.at(self.rng.uniform(0, 50), self.start_conv, c, convs)
        while self.heap:
            self.clock, _, fn, args = heapq.heappop(self.heap)
            fn(*args)
        return self.report()

    # -- clients ------------------------------------------------------------------------
    def start_conv(self, c: int, convs) -> None:
        rng = random.Random((self.cfg.seed << 20) + c)
        srng = random.Random(-1) if self.cfg.shared else rng
        system = [1, 1000] + [srng.randrange(3000, 49000) for _ in range(self.cfg.system_tokens)] + [EOS, NL]
        self.turn(c, 1, system, None, rng, convs)

    def turn(self, c: int, t: int, history: list[int], prev: Req | None, rng, convs) -> None:
        cfg = self.cfg
        user = [1, 4093] + [rng.randrange(3000, 49000) for _ in range(rng.randint(*cfg.user_tokens))] + [EOS, NL]
        prompt = history + user + GEN
        reply = [rng.randrange(3000, 49000) for _ in range(rng.randint(*cfg.reply_tokens))]
        if rng.random() < 0.5:
            reply.append(EOS)
        req = Req(c, t, prompt, block_hashes(prompt, BS), reply, self.clock)
        if prev is None and self.cfg.turns == 1:  # one turn each: the oracle holds the system prompt
            held = history
        elif prev is not None:  # the oracle: the previous turn's replica, nothing evicted
            held = prev.prompt + prev.reply[:-1]
        if prev is not None or self.cfg.turns == 1:
            common = next((i for i, (a, b) in enumerate(zip(held, prompt)) if a != b), min(len(held), len(prompt)))
            self.later[2] += min(common // BS, (len(prompt) - 1) // BS) * BS
        self.route(req)
        req.conv_state = (history, rng, convs)  # type: ignore[attr-defined]

    def finished(self, req: Req) -> None:
        history, rng, convs = req.conv_state  # type: ignore[attr-defined]
        self.ttfts.append(req.ttft)
        if req.turn > 1 or self.cfg.turns == 1:
            self.later[0] += len(req.prompt)
            self.later[1] += req.cached
            self.later_turns += 1
            self.hits += req.cached > 0
        if req.turn == self.cfg.turns:
            nxt = next(convs, None)
            if nxt is not None:
                self.at(self.clock + self.cfg.think_ms, self.start_conv, nxt, convs)
            return
        text = req.reply[:-1] if req.reply[-1] == EOS else list(req.reply)
        if text and rng.random() < self.cfg.retokenize:  # the template re-renders the reply into other ids
            text[rng.randrange(len(text))] += 1
        history = req.prompt + text + [EOS, NL]
        self.at(self.clock + self.cfg.think_ms, self.turn, req.conv, req.turn + 1, history, req, rng, convs)

    # -- the proxy ----------------------------------------------------------------------
    def route(self, req: Req) -> None:
        now = self.clock / 1e3
        cands = []
        for r, idx in self.index.items():
            n = idx.match(req.hashes, now)
            cands.append(Candidate(r, float(self.load[r]), n, held_blocks=len(idx),
                                   history=idx.history(req.hashes, n, req.prompt, BS)))
        session = f"conv{req.conv}" if self.sessions else None
        d = self.router.route(cands, len(req.prompt), BS, key=str(req.hashes[0]), session_key=session,
                              session_current=self.session_at.get(req.conv))
        req.replica = d.replica
        self.session_at[req.conv] = d.replica
        self.load[d.replica] += 1
        if not self.cfg.events_only:
            self.index[d.replica].expect(req.hashes, now)
        rep = self.reps[d.replica]
        rep.served += 1
        rep.waiting.append(req)
        self.kick(rep)

    def stream_ended(self, req: Req) -> None:
        self.load[req.replica] -= 1
        if not self.cfg.events_only:
            self.index[req.replica].expect_reply(req.prompt, req.hashes, req.reply, BS, "", self.clock / 1e3)
        self.finished(req)

    def deliver(self, replica: str, ev: KvEvents) -> None:
        self.index[replica].apply(ev)

    # -- replicas -----------------------------------------------------------------------
    def kick(self, rep: Replica) -> None:
        if not rep.busy and (rep.waiting or rep.running):
            rep.busy = True
            self.step(rep)

    def step(self, rep: Replica) -> None:
        """Plan one step now; its results land when it ends."""
        cfg = self.cfg
        decodes = [r for r in rep.running if r.computed >= len(r.prompt)]
        budget = cfg.budget - len(decodes)
        chunks = []
        for r in rep.running + rep.waiting:
            if budget <= 0:
                break
            if r.computed < len(r.prompt):
                if r in rep.waiting:
                    rep.waiting.remove(r)
                    rep.running.append(r)
                    r.cached = r.computed = self.match(rep, r)
                n = min(budget, len(r.prompt) - r.computed)
                chunks.append((r, n))
                budget -= n
        dt = cfg.step_ms + cfg.decode_ms * len(decodes) + cfg.prefill_ms * sum(n for _, n in chunks)
        self.at(self.clock + dt, self.step_done, rep, decodes, chunks)

    def match(self, rep: Replica, r: Req) -> int:
        n = 0
        for h in r.hashes[: (len(r.prompt) - 1) // BS]:  # one token is always computed
            if h not in rep.cache:
                break
            rep.cache.move_to_end(h)
            n += 1
        return n * BS

    def step_done(self, rep: Replica, decodes: list[Req], chunks: list) -> None:
        stored: list[int] = []
        removed: list[int] = []
        for r, n in chunks:
            r.computed += n
            if r.computed >= len(r.prompt):
                r.ttft = self.clock - r.arrival
                r.out = 1
                self.store(rep, r.hashes, stored, removed)
        for r in decodes:
            r.out += 1
            if r.out >= len(r.reply):
                rep.running.remove(r)
                self.store(rep, reply_hashes(r.prompt, r.hashes, r.reply, BS, ""), stored, removed)
                self.at(self.clock, self.stream_ended, r)
        if stored or removed:
            self.at(self.clock + self.cfg.event_delay_ms, self.deliver, rep.id, KvEvents(stored, removed))
        rep.busy = False
        self.kick(rep)

    def store(self, rep: Replica, hashes: list[int], stored: list[int], removed: list[int]) -> None:
        for h in hashes:
            if h in rep.cache:
                rep.cache.move_to_end(h)
                continue
            rep.cache[h] = None
            stored.append(h)
            if len(rep.cache) > self.cfg.cache_blocks:
                old, _ = rep.cache.popitem(last=False)
                removed.append(old)

    # -- figures ------------------------------------------------------------------------
    def report(self) -> dict:
        served = sorted(r.served for r in self.reps.values())
        mean = sum(served) / len(served)
        t = sorted(self.ttfts)
        return {"cached": self.later[1] / self.later[0], "oracle": self.later[2] / self.later[0],
                "hits": self.hits, "later": self.later_turns, "min": served[0], "max": served[-1],
                "dev": max(abs(s - mean) for s in served) / mean, "p50": t[len(t) // 2],
                "p99": t[min(len(t) - 1, int(len(t) * 0.99))]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = SimConfig()
    p.add_argument("--conversations", type=int, default=d.conversations)
    p.add_argument("--replicas", type=int, default=d.replicas)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--system-tokens", type=int, default=d.system_tokens)
    p.add_argument("--shared", action="store_true", help="one system prompt for every conversation")
    p.add_argument("--retokenize", type=float, default=d.retokenize)
    p.add_argument("--cache-blocks", type=int, default=d.cache_blocks)
    p.add_argument("--event-delay-ms", type=float, default=d.event_delay_ms)
    p.add_argument("--think-ms", type=float, default=d.think_ms)
    p.add_argument("--events-only", action="store_true", help="ablation: no expected blocks, KV events alone")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--modes", default="auto,prefix,sticky,round_robin")
    a = p.parse_args()
    cfg = SimConfig(a.conversations, a.replicas, a.concurrency, a.turns, a.system_tokens, a.shared,
                    retokenize=a.retokenize,
                    cache_blocks=a.cache_blocks, event_delay_ms=a.event_delay_ms, events_only=a.events_only,
                    think_ms=a.think_ms, seed=a.seed)
    runs = []
    for mode in a.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"--modes: {mode!r} is not one of {', '.join(MODES)}")
        for sessions in SESSIONS[mode]:
            runs.append((mode, sessions, Sim(cfg, mode, sessions).run()))
    print(f"routing simulation: {cfg.conversations} conversations x {cfg.turns} turns, {cfg.replicas} replicas, "
          f"{cfg.concurrency} at a time, {cfg.cache_blocks} cached blocks per replica, KV events "
          f"{cfg.event_delay_ms:g} ms late{' (the index learns from them alone)' if cfg.events_only else ''}, "
          f"{cfg.retokenize:.0%} replies re-tokenized, seed {cfg.seed}")
    print(f"{'mode':<12} | {'session':<7} | {'cached':>6} | {'oracle':>6} | {'of oracle':>9} | {'later hits':>12} | "
          f"{'req/replica min-max':>19} | {'max dev':>7} | {'TTFT p50/p99 ms':>15}")
    print("-" * 118)
    for mode, sessions, r in runs:
        print(f"{mode:<12} | {'yes' if sessions else 'no':<7} | {r['cached']:6.3f} | {r['oracle']:6.3f} | "
              f"{r['cached'] / r['oracle']:9.1%} | {r['hits']:>5}/{r['later']:<6} | {r['min']:>9}-{r['max']:<9} | "
              f"{r['dev']:7.1%} | {r['p50']:6.0f} / {r['p99']:<6.0f}")


if __name__ == "__main__":
    main()
