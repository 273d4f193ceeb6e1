"""edge_proxy.disagg and the pool's roles without sockets (httpx.MockTransport answers for the
replicas): a prefill-role replica takes no stream; a cold prompt on a decode-role replica is
prefilled on the prefill replica with the least work ahead, then pulled by the decode replica,
and starts there with the blocks it holds; a warm one, a "both" replica's, or one whose prefill
fails is served colocated. The real thing, on real replicas: test_disagg.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest

from edge_proxy.__main__ import parse_args
from edge_proxy.auth import KeyStore
from edge_proxy.core import Proxy
from edge_proxy.disagg import MIN_BLOCKS, Disagg
from edge_proxy.metrics import ProxyMetrics
from edge_proxy.pool import PoolConfig, ReplicaPool
from edge_proxy.prompt import ByteTokenizer
from edge_proxy.routing import Decision
from wire import protocol as P
from wire.hashing import block_hashes

pytestmark = pytest.mark.anyio
BS = 16


class StubProxy:
    """What Disagg uses of core.Proxy: its pool, metrics and `prefilled`."""

    def __init__(self, roles: dict[str, str]):
        self.pool = ReplicaPool([f"ws://{rid.lower()}:8000/v1/replica" for rid in roles], PoolConfig(secret="s3cret"),
                                SimpleNamespace())
        self.pool.block_size = BS
        for conn, (rid, role) in zip(self.pool.conns, roles.items()):
            conn.connected, conn.hello, conn.id = True, P.Hello(rid, "m", BS, 4096, role=role), rid
        self.metrics = ProxyMetrics()
        self.started: list[tuple] = []
        self.done = asyncio.Event()

    def conn(self, rid: str):
        return next(c for c in self.pool.conns if c.id == rid)

    def prefilled(self, s, conn, d: Decision, deadline_ms: float) -> None:
        self.started.append((s.cid, conn.id, d))
        self.done.set()


def stream(cid: str, tokens: int):
    ids = list(range(100, 100 + tokens))
    return SimpleNamespace(cid=cid, gen=P.Generate("", ids, P.SamplingParams(), "salt"),
                           hashes=block_hashes(ids, BS, "salt"), ids=[], done=False,
                           span=SimpleNamespace(add_event=lambda name, attrs: None))


async def test_a_prefill_replica_takes_no_stream_and_an_unknown_role_is_refused():
    proxy = StubProxy({"P": "prefill", "D": "decode", "B": ""})
    assert [c.id for c in proxy.pool.ready()] == ["D", "B"]
    assert [c.id for c in proxy.pool.prefill_ready()] == ["P"] and proxy.conn("B").role == "both"
    conn = proxy.pool.conns[0]
    conn.connected = False
    assert not proxy.pool.accept_hello(conn, P.Hello("P", "m", BS, 4096, role="prefil"))
    assert conn.mismatch == "role 'prefil', not one of both, prefill, decode"


async def test_only_a_cold_prompt_on_a_decode_replica_is_prefilled_elsewhere():
    proxy = StubProxy({"P": "prefill", "D": "decode", "B": "both"})
    dis = Disagg(proxy)
    cold = stream("r1", (MIN_BLOCKS + 1) * BS)  # MIN_BLOCKS usable full blocks: the last token's block is computed
    assert dis.prefill_replica(cold, proxy.conn("D"), Decision("D", "load", 0)).id == "P"
    assert dis.prefill_replica(cold, proxy.conn("D"), Decision("D", "prefix", 1)) is None  # warm enough there
    assert dis.prefill_replica(cold, proxy.conn("B"), Decision("B", "load", 0)) is None  # "both" serves it itself
    assert dis.prefill_replica(stream("r2", MIN_BLOCKS * BS), proxy.conn("D"), Decision("D", "load", 0)) is None
    resumed = stream("r3", (MIN_BLOCKS + 1) * BS)
    resumed.ids = [7, 8]  # a client's resume: computed with the prompt on D
    assert dis.prefill_replica(resumed, proxy.conn("D"), Decision("D", "load", 0)) is None
    proxy.conn("P").connected = False
    assert dis.prefill_replica(cold, proxy.conn("D"), Decision("D", "load", 0)) is None  # none ready


async def test_the_threshold_is_the_proxys_flag():
    base = ["--replica", "ws://127.0.0.1:9/v1/replica"]
    assert parse_args(base).disagg_min_blocks == MIN_BLOCKS
    cfg = parse_args(base + ["--disagg-min-blocks", "8"])
    assert Proxy(cfg, ByteTokenizer(), KeyStore([], anonymous=True)).disagg.min_blocks == 8
    with pytest.raises(ValueError, match="--disagg-min-blocks must be >= 1"):
        parse_args(base + ["--disagg-min-blocks", "0"])
    proxy = StubProxy({"P": "prefill", "D": "decode"})
    dis = Disagg(proxy, min_blocks=8)
    assert dis.prefill_replica(stream("r1", 8 * BS), proxy.conn("D"), Decision("D", "load", 0)) is None  # 7 usable
    assert dis.prefill_replica(stream("r2", 9 * BS), proxy.conn("D"), Decision("D", "load", 0)).id == "P"
    assert dis.prefill_replica(stream("r3", 9 * BS), proxy.conn("D"), Decision("D", "prefix", 1)) is None


async def test_the_prefill_replica_is_the_one_with_the_least_work_ahead():
    proxy = StubProxy({"P1": "prefill", "P2": "prefill", "D": "decode"})
    dis = Disagg(proxy)
    s = stream("r1", 10 * BS + 3)
    proxy.conn("P2").index.apply(P.KvEvents(stored=s.hashes[:4]))  # P2 holds 4 of its blocks
    assert dis.prefill_replica(s, proxy.conn("D"), Decision("D", "load", 0)).id == "P2"
    dis.pending["P2"] = 5 * BS  # ... but this proxy has 5 blocks' worth in flight there
    assert dis.prefill_replica(s, proxy.conn("D"), Decision("D", "load", 0)).id == "P1"


async def test_the_prompt_is_prefilled_pulled_then_started_with_the_pulled_blocks():
    asked = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append((str(request.url), request.headers["authorization"], json.loads(request.content)))
        if request.url.path == "/v1/prefill":
            return httpx.Response(200, json={"blocks": 6, "cached_tokens": 0, "ms": 5.0})
        return httpx.Response(200, json={"status": 200, "blocks": 6, "cached": 0, "imported": 6, "complete": True})

    proxy = StubProxy({"P": "prefill", "D": "decode"})
    dis = Disagg(proxy, transport=httpx.MockTransport(handler))
    s = stream("r1", 6 * BS + 5)
    assert dis.take(s, proxy.conn("D"), Decision("D", "load", 0), 0.0)
    await asyncio.wait_for(proxy.done.wait(), 10)
    await dis.close()
    assert proxy.started == [("r1", "D", Decision("D", "load", 6))]
    (u1, a1, b1), (u2, a2, b2) = asked
    assert u1 == "http://p:8000/v1/prefill" and a1 == a2 == "Bearer s3cret"
    assert b1 == {"token_ids": s.gen.prompt_ids, "cache_salt": "salt"}  # all of it: its rows computed as D would
    assert u2 == "http://d:8000/v1/kv/pull" and b2["source"] == "http://p:8000"
    assert b2["token_ids"] == s.gen.prompt_ids[: 6 * BS] and b2["cache_salt"] == "salt"  # the blocks D can use
    assert dis.pending == {}
    m = proxy.metrics
    assert m.disagg.get("pulled") == 1 and m.disagg.get("fallback") == 0 and m.disagg_blocks.get() == 6


async def test_a_failed_prefill_starts_the_stream_colocated_without_a_pull():
    asked = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return httpx.Response(503, json={"error": {"message": "the replica is draining", "code": 503}})

    proxy = StubProxy({"P": "prefill", "D": "decode"})
    dis = Disagg(proxy, transport=httpx.MockTransport(handler))
    assert dis.take(stream("r1", 6 * BS + 5), proxy.conn("D"), Decision("D", "prefix", 1), 0.0)
    await asyncio.wait_for(proxy.done.wait(), 10)
    await dis.close()
    assert asked == ["/v1/prefill"] and proxy.started == [("r1", "D", Decision("D", "prefix", 1))]
    assert proxy.metrics.disagg.get("fallback") == 1 and proxy.metrics.disagg_blocks.get() == 0
