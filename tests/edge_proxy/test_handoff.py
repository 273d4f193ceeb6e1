"""edge_proxy.handoff without sockets: what a drain asks each successor to pull, and that every
stream moves (`Proxy.hand_off`) whatever the pull answers: cached blocks counted on success, none
on a refusal, a pull that outlasts the drain's budget given up at the budget; a second pull for
the blocks that filled while the first ran, the move right after a token; the draining replica's
hot chains placed and pulled after the streams' first pulls, and its hold let go. The streams are
simulated (`feed`: a token every 5 ms, what a replica would send); the real thing, on real
replicas: test_drain_handoff.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest

from edge_proxy.__main__ import parse_args
from edge_proxy.auth import KeyStore
from edge_proxy.core import Proxy
from edge_proxy.handoff import MOVE_TOKENS, Handoff, computed
from edge_proxy.pool import PoolConfig, ReplicaPool
from edge_proxy.prompt import ByteTokenizer
from edge_proxy.routing import Decision
from wire import protocol as P
from wire.hashing import block_hashes

pytestmark = pytest.mark.anyio


class StubProxy:
    """What Handoff uses of core.Proxy: its pool (secret, TLS, replicas), successor, chain_home, hand_off,
    a metric."""

    def __init__(self, successor: str | None = "B"):
        self.pool = SimpleNamespace(cfg=PoolConfig(secret="s3cret"), ssl=None, block_size=BLOCK,
                                    conns=[SimpleNamespace(id="B", base_url="http://b:8000")])
        self.to = successor
        self.moved: list[tuple] = []
        self.all_moved = asyncio.Event()
        self.expect = 0
        self.homes: list[tuple[list[int], int]] = []  # chain_home's questions
        self.hot_blocks = 0
        self.metrics = SimpleNamespace(handoff_hot_blocks=SimpleNamespace(inc=self._count_hot))

    def _count_hot(self, by: int) -> None:
        self.hot_blocks += by

    def successor(self, s):
        return Decision(self.to, "failover", 3) if self.to else None

    def chain_home(self, hashes, tokens):
        self.homes.append((hashes, tokens))
        return Decision(self.to, "failover", 0) if self.to else None

    def hand_off(self, s, conn, d: Decision) -> None:
        self.moved.append((s.cid, conn.id, d))
        if len(self.moved) == self.expect:
            self.all_moved.set()


DRAINING = SimpleNamespace(id="A", base_url="http://a:8000")
BLOCK = 16


def stream(cid: str, n: int = 1):
    return SimpleNamespace(cid=cid, gen=SimpleNamespace(prompt_ids=list(range(40)), cache_salt="salt"),
                           ids=[7, 8, 9], samples=None if n == 1 else [[7], [8]], done=False, conn=DRAINING)


class Source:
    """The draining replica's side: its hot chains (none unless given) listed with a hold, the hold let go."""

    def __init__(self, chains=()):
        self.chains = list(chains)
        self.asked: list[dict] = []
        self.released: list[str] = []

    def serve(self, request: httpx.Request) -> httpx.Response | None:
        if request.url.path == "/v1/kv/hot" and request.method == "POST":
            self.asked.append(json.loads(request.content))
            return httpx.Response(200, json={"chains": self.chains, "hold": "h1"})
        if request.url.path.startswith("/v1/kv/hot/") and request.method == "DELETE":
            self.released.append(request.url.path.rsplit("/", 1)[1])
            return httpx.Response(204)
        return None


def transport(handler, source: Source) -> httpx.MockTransport:
    """Pulls go to `handler`, the draining replica's hot-chain routes to `source`."""

    async def route(request: httpx.Request) -> httpx.Response:
        got = source.serve(request)
        if got is None:
            got = handler(request)
            if asyncio.iscoroutine(got):
                got = await got
        return got

    return httpx.MockTransport(route)


def answer(request: httpx.Request, **fields) -> httpx.Response:
    """A successful pull of every full block asked for."""
    blocks = len(json.loads(request.content)["token_ids"]) // BLOCK
    return httpx.Response(200, json={"status": 200, "blocks": blocks, "cached": 0, "imported": blocks,
                                     "complete": True, **fields})


async def feed(h: Handoff, streams, proxy: StubProxy, seen=None, step_s: float = 0.005) -> None:
    """The draining replica streaming: a token every `step_s` to each stream until every one moved
    (`seen(stream)` after each)."""
    while not proxy.all_moved.is_set():
        await asyncio.sleep(step_s)  # the simulated replica's decode step
        for s in streams:
            s.ids.append(len(s.ids))
            h.on_tokens(s)
            if seen is not None:
                seen(s)


async def drain(proxy: StubProxy, handler, streams, budget_s: float = 2.0, seen=None, step_s: float = 0.005,
                source: Source | None = None) -> None:
    proxy.expect = len(streams)
    h = Handoff(proxy, budget_s=budget_s, transport=transport(handler, source or Source()))
    h.drain(DRAINING, streams)
    tokens = asyncio.ensure_future(feed(h, streams, proxy, seen, step_s))
    await asyncio.wait_for(proxy.all_moved.wait(), 10)
    await asyncio.gather(*h.tasks, tokens)


async def test_each_stream_is_pulled_from_the_draining_replica_then_moved_with_its_blocks():
    asked = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append((str(request.url), request.headers["authorization"], json.loads(request.content)))
        return answer(request)

    p = StubProxy()
    streams = [stream("r1"), stream("r2")]
    moved_at = {}
    p.hand_off = lambda st, conn, d: (moved_at.setdefault(st.cid, computed(st)), StubProxy.hand_off(p, st, conn, d))
    await drain(p, handler, streams)
    assert [m[0] for m in sorted(p.moved)] == ["r1", "r2"]
    assert all(conn == "A" and d == Decision("B", "failover", 3) for _, conn, d in p.moved)
    url, auth, body = asked[0]
    assert url == "http://b:8000/v1/kv/pull" and auth == "Bearer s3cret"
    # the prompt and the ids generated but the last (sampled, never computed), from the draining replica
    assert body["source"] == "http://a:8000" and body["token_ids"] == list(range(40)) + [7, 8]
    assert body["cache_salt"] == "salt" and 0 < body["timeout_ms"] <= 2000
    # 42 computed ids, 10 of them past the 2 full blocks: each stream's second pull waited for its third block
    # to fill, so the move leaves the successor the few ids computed since, not 10
    assert sorted(len(b["token_ids"]) for _, _, b in asked) == [42, 42, 48, 48]
    assert all(0 < moved_at[cid] - 3 * BLOCK <= MOVE_TOKENS for cid in ("r1", "r2")), moved_at


async def test_a_stream_moves_with_its_partial_block_to_recompute_when_the_block_would_not_fill_in_time():
    asked = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(len(json.loads(request.content)["token_ids"]))
        return answer(request)

    p = StubProxy()
    # a token every 50 ms: the third block fills 6 tokens (300 ms) on, past the 0.3 s budget: no waiting for it
    await drain(p, handler, [stream("r1")], budget_s=0.3, step_s=0.05)
    assert asked == [42] and p.moved == [("r1", "A", Decision("B", "failover", 2))]


async def test_the_blocks_that_filled_during_the_pull_are_pulled_too_then_the_stream_moves_after_a_token():
    asked, s = [], stream("r1")
    crossed = asyncio.Event()  # the stream's ids reached a third full block while the first pull ran

    async def handler(request: httpx.Request) -> httpx.Response:
        asked.append(len(json.loads(request.content)["token_ids"]))
        if len(asked) == 1:
            await crossed.wait()  # a long pull: the stream goes on meanwhile (feed)
        return answer(request)

    def seen(st) -> None:
        if len(st.gen.prompt_ids) + len(st.ids) > 3 * BLOCK + 2:
            crossed.set()

    p = StubProxy()
    moved_at = []
    p.hand_off = lambda st, conn, d: (moved_at.append(len(st.ids)), StubProxy.hand_off(p, st, conn, d))
    await drain(p, handler, [s], seen=seen)
    # the second pull asked for the ids of the third block too, starting as a block filled
    assert asked[0] == 42 and asked[1] > 3 * BLOCK and asked[1] % BLOCK == 0
    (_, _, d), = p.moved
    assert d.cached_blocks == asked[-1] // BLOCK  # every full block of the last pull counted
    # moved right after a token, every full block of its ids there: only the last partial block to compute
    assert (len(s.gen.prompt_ids) + moved_at[0] - 1) // BLOCK <= d.cached_blocks


async def test_a_pull_slower_than_the_rest_of_a_block_catches_up_from_the_next_block_boundary():
    s, asked, waiting = stream("r1"), [], []  # 42 computed ids: 10 into the stream's third block
    SLOW = 12  # tokens the stream gains while any pull runs: more than a part-filled block has left

    async def handler(request: httpx.Request) -> httpx.Response:
        ev = asyncio.Event()
        waiting.append((len(s.ids) + SLOW, ev))
        await ev.wait()
        asked.append(len(json.loads(request.content)["token_ids"]))
        return answer(request)

    def seen(st) -> None:
        for n, ev in waiting:
            if len(st.ids) >= n:
                ev.set()

    p = StubProxy()
    moved_at = []
    p.hand_off = lambda st, conn, d: (moved_at.append(len(st.ids)), StubProxy.hand_off(p, st, conn, d))
    await drain(p, handler, [s], seen=seen)
    # the first pull (42 ids) ended a block behind; the second started as the next block filled, so it ended
    # before another one did (pulling again at once, 6 into a block, every pull would end a block behind)
    # (the third pull is the partial block's once full: 12 more ids computed during the second, over MOVE_TOKENS)
    assert asked[0] == 42 and asked[1] % BLOCK == 0 and asked[2] == asked[1] + BLOCK and len(asked) == 3, asked
    (_, _, d), = p.moved
    assert d.cached_blocks == asked[2] // BLOCK
    assert (len(s.gen.prompt_ids) + moved_at[0] - 1) // BLOCK <= d.cached_blocks


async def test_a_refused_or_broken_pull_still_moves_the_stream_with_what_arrived():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(502, json={"status": 502, "blocks": 2, "cached": 0, "imported": 1,
                                         "error": "the export stream broke"})

    p = StubProxy()
    await drain(p, handler, [stream("r1")])
    assert p.moved == [("r1", "A", Decision("B", "failover", 1))]  # the block that arrived is whole: it counts


async def test_a_pull_past_the_budget_is_given_up_and_the_stream_moves_by_recompute():
    never = asyncio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        await never.wait()  # a source or successor that never answers
        raise AssertionError("unreachable")

    p = StubProxy()
    t0 = asyncio.get_running_loop().time()
    await drain(p, handler, [stream("r1")], budget_s=0.2)
    assert p.moved == [("r1", "A", Decision("B", "failover", 0))]
    assert 0.2 <= asyncio.get_running_loop().time() - t0 < 5


async def test_n_samples_move_without_a_pull_and_nothing_moves_without_a_successor():
    def handler(request: httpx.Request) -> httpx.Response:
        raise AssertionError("no pull for n > 1 samples")

    p = StubProxy()
    await drain(p, handler, [stream("r1", n=2)])
    assert p.moved == [("r1", "A", Decision("B", "failover", 0))]
    alone = StubProxy(successor=None)
    h = Handoff(alone, transport=transport(handler, Source()))
    h.drain(DRAINING, [stream("r2")])
    await asyncio.gather(*h.tasks)
    assert alone.moved == []  # it stays on the draining replica: it finishes there, or fails over at its exit


async def test_hot_chains_are_placed_and_pulled_after_the_streams_first_pulls_then_the_hold_is_let_go():
    pulls = []  # (what, ids) in the order the successor was asked
    chains = [{"seed": 0, "token_ids": list(range(100, 132))}, {"seed": 99, "token_ids": list(range(200, 216))}]
    source = Source(chains)

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        pulls.append(("chain" if "seed" in body else "stream", body.get("seed"), body["token_ids"]))
        assert "cache_salt" not in body or "seed" not in body  # a chain is named by its seed alone
        return answer(request)

    p = StubProxy()
    await drain(p, handler, [stream("r1")], source=source)
    assert source.asked[0]["max_blocks"] > 0 and source.asked[0]["hold_s"] > 2.0  # it outlasts the budget
    first_chain = next(i for i, (what, _, _) in enumerate(pulls) if what == "chain")
    assert pulls[0][0] == "stream" and first_chain > 0  # the stream's first (long) pull went first
    assert [(seed, ids) for what, seed, ids in pulls if what == "chain"] == [(0, chains[0]["token_ids"]),
                                                                           (99, chains[1]["token_ids"])]
    # each placed where its next turn would go, by its chained hashes from its seed
    assert p.homes == [(block_hashes(chains[0]["token_ids"], BLOCK, prev=0), 32),
                       (block_hashes(chains[1]["token_ids"], BLOCK, prev=99), 16)]
    assert p.hot_blocks == 3 and source.released == ["h1"]


async def test_with_no_hot_blocks_the_source_is_not_asked():
    source = Source([{"seed": 5, "token_ids": list(range(48))}])
    p = StubProxy()
    h = Handoff(p, transport=transport(answer, source), hot_blocks=0)
    h.drain(DRAINING, [])
    await asyncio.gather(*h.tasks)
    assert source.asked == [] and p.hot_blocks == 0


async def test_a_drained_replica_without_streams_still_hands_its_hot_chains_on():
    pulls = []

    def handler(request: httpx.Request) -> httpx.Response:
        pulls.append(json.loads(request.content))
        return answer(request)

    source = Source([{"seed": 5, "token_ids": list(range(48))}])
    p = StubProxy()
    h = Handoff(p, transport=transport(handler, source))
    h.drain(DRAINING, [])
    await asyncio.gather(*h.tasks)
    assert [(b["seed"], b["source"]) for b in pulls] == [(5, "http://a:8000")]
    assert p.hot_blocks == 3 and source.released == ["h1"] and p.moved == []
    # with no other replica ready the chains stay, and the hold is let go all the same
    alone, quiet = StubProxy(successor=None), Source([{"seed": 5, "token_ids": list(range(48))}])
    h = Handoff(alone, transport=transport(handler, quiet))
    h.drain(DRAINING, [])
    await asyncio.gather(*h.tasks)
    assert len(pulls) == 1 and quiet.released == ["h1"]


async def test_a_replica_whose_load_says_draining_is_not_ready_and_its_streams_are_handed_on_once():
    told = []
    events = SimpleNamespace(on_draining=lambda conn, streams: told.append((conn.id, streams)))
    pool = ReplicaPool(["ws://127.0.0.1:9/v1/replica"], PoolConfig(), events)
    conn = pool.conns[0]
    conn.connected, conn.hello = True, P.Hello("A", "m", 16, 2048)
    conn.id, conn.streams = "A", {"x-1": "stream 1", "x-2": "stream 2"}
    conn._dispatch([P.Load(2, 0, 10, 20)], 0.0)
    assert conn.ready and told == []
    conn._dispatch([P.Load(2, 0, 10, 20, draining=True)], 0.0)
    conn._dispatch([P.Load(2, 0, 10, 20, draining=True)], 0.0)
    assert not conn.ready and pool.ready() == []
    assert told == [("A", ["stream 1", "stream 2"])]  # once, still registered there (they stream on meanwhile)
    assert conn.streams and conn.base_url == "http://127.0.0.1:9"


async def test_a_replica_that_leaves_discovery_idle_hands_its_hot_chains_on_as_it_goes():
    told = []
    events = SimpleNamespace(on_draining=lambda conn, streams: told.append((conn.id, list(streams))),
                             on_lost=lambda conn, streams, cause: None)
    pool = ReplicaPool(["ws://127.0.0.1:9/v1/replica", "ws://127.0.0.1:10/v1/replica"], PoolConfig(), events)
    up, down = pool.conns
    up.connected, up.hello, up.id = True, P.Hello("A", "m", 16, 2048), "A"
    pool.remove(up.url)
    pool.remove(down.url)  # down: nothing to pull from it
    assert told == [("A", [])] and pool.conns == []


async def test_the_budget_is_the_proxys_flag_and_must_be_positive():

    base = ["--replica", "ws://127.0.0.1:9/v1/replica"]
    assert parse_args(base).handoff_budget_s == 4.0
    cfg = parse_args(base + ["--handoff-budget", "8"])
    assert cfg.handoff_budget_s == 8.0
    assert Proxy(cfg, ByteTokenizer(), KeyStore([], anonymous=True)).handoff.budget_s == 8.0
    assert parse_args(base).handoff_hot_blocks == 128
    assert Proxy(parse_args(base + ["--handoff-hot-blocks", "0"]), ByteTokenizer(),
                 KeyStore([], anonymous=True)).handoff.hot_blocks == 0
    with pytest.raises(ValueError, match="--handoff-hot-blocks must be 0..4096"):
        parse_args(base + ["--handoff-hot-blocks", "-1"])
    with pytest.raises(ValueError, match="--handoff-budget must be > 0"):
        parse_args(base + ["--handoff-budget", "0"])
