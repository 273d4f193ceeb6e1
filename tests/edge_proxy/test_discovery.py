"""Live replica discovery (`--replicas-dns`) against a real DNS server on loopback whose
records change while the proxy serves: replicas join within one refresh, leave with
their streams resumed exactly elsewhere, and an outage keeps the last known set.

Stub replicas listen on one port at different loopback addresses (127.0.0.2, .3, ...),
as pods behind a headless Service do.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace
from time import perf_counter

import pytest

from edge_proxy.client import EdgeClient
from edge_proxy.discovery import DiscoveryConfig, DnsDiscovery, replica_url

from conftest import FAST_POOL, proxy_for
from dns_pods import INTERVAL, NAME, discovery, pods, refreshes, zone

pytestmark = pytest.mark.anyio


def urls(p) -> set[str]:
    return {c.url for c in p.proxy.pool.conns}


# -- the configuration and the resolver ----------------------------------------


def test_names_ports_and_servers_parse():
    assert DiscoveryConfig.parse("edgechat-replica") == DiscoveryConfig("edgechat-replica", 8000)
    c = DiscoveryConfig.parse("edgechat-replica.ns.svc.cluster.local:9000", 1.5, "[::1]:5353")
    assert (c.name, c.port, c.interval_s, c.srv) == ("edgechat-replica.ns.svc.cluster.local", 9000, 1.5, False)
    assert DiscoveryConfig.parse("_ws._tcp.edgechat-replica").srv
    for bad, msg in [("_ws._tcp.r:80", "SRV name carries its own ports"), ("r:http", "must be a number"),
                     ("r:0", "1..65535"), (":80", "needs a DNS name")]:
        with pytest.raises(ValueError, match=msg):
            DiscoveryConfig.parse(bad)
    with pytest.raises(ValueError, match="IP address"):
        DiscoveryConfig.parse("r", server="dns.example:53")
    with pytest.raises(ValueError, match="interval"):
        DiscoveryConfig.parse("r", interval_s=0)
    assert replica_url("fd00::7", 8000) == "ws://[fd00::7]:8000/v1/replica"


async def test_a_aaaa_srv_and_large_answers_resolve_to_replica_urls():
    async with zone() as z:
        z.set(NAME, ["127.0.0.2", "::1"])
        d = DnsDiscovery(discovery(z, 8000), pool=None)
        assert await d.resolve() == {"ws://127.0.0.2:8000/v1/replica", "ws://[::1]:8000/v1/replica"}

        # SRV: each target's port; addresses from the additional section, or asked for when absent.
        z.set_srv("_ws._tcp." + NAME, [("r-0.edgechat.test", 9001), ("r-1.edgechat.test", 9002)])
        z.set("r-0.edgechat.test", ["127.0.0.5"])
        z.set("r-1.edgechat.test", ["127.0.0.6"])
        srv = DnsDiscovery(discovery(z, 8000, "_ws._tcp." + NAME), pool=None)
        want = {"ws://127.0.0.5:9001/v1/replica", "ws://127.0.0.6:9002/v1/replica"}
        assert await srv.resolve() == want
        z.glue = False
        asked = z.queries
        assert await srv.resolve() == want and z.queries == asked + 1 + 2 * 2  # SRV, then A and AAAA per target

        # 300 endpoints do not fit a UDP answer: truncated, asked again over TCP.
        many = [f"127.0.{i // 250}.{i % 250 + 2}" for i in range(300)]
        z.set(NAME, many)
        asked = z.queries
        assert await d.resolve() == {f"ws://{a}:8000/v1/replica" for a in many}
        assert z.queries == asked + 3  # A over UDP (truncated), A over TCP, AAAA (none left) over UDP

        # No such name: a real answer, the empty set; no answer at all: an outage.
        assert await DnsDiscovery(discovery(z, 8000, "nothing.edgechat.test"), pool=None).resolve() == set()


# -- the proxy following the records -----------------------------------------------


async def test_a_replica_added_is_used_within_one_refresh():
    async with zone() as z, pods() as k:
        await k.start("127.0.0.2", "a")
        z.set(NAME, ["127.0.0.2"])
        async with proxy_for([], wait_ready=1, discovery=discovery(z, k.port)) as p:
            b = await k.start("127.0.0.3", "b")
            z.set(NAME, ["127.0.0.2", "127.0.0.3"])
            t0 = perf_counter()
            assert await p.proxy.pool.wait_ready(2, timeout=10)
            joined = perf_counter() - t0
            assert joined < INTERVAL + 1.0, f"joined {joined:.2f} s after the record appeared"
            assert p.proxy.pool.conns[-1].hello.replica_id == "b"
            async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
                reqs = [await c.generate(prompt=f"question {i}", max_tokens=20) for i in range(6)]
                dones = [(await r.result())[1] for r in reqs]
            assert {d.replica for d in dones} == {"a", "b"} and len(b.generates) >= 2


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, seed=77)],
                         ids=["greedy", "seeded"])
async def test_a_replica_leaving_mid_stream_hands_its_streams_on_with_identical_text(sampling):
    """Leaving DNS while up and streaming is a planned removal (a pod terminating, a roll): its streams
    are handed on as a drain's are (a stub has no KV to pull: moved by exact resume, cause `drain`),
    and the proxy lets the replica go once none is left on it."""
    async with zone() as z, pods(step_s=0.02) as k:
        a, _ = await k.start("127.0.0.2", "a"), await k.start("127.0.0.3", "b")
        z.set(NAME, ["127.0.0.2", "127.0.0.3"])
        async with proxy_for([], wait_ready=2, discovery=discovery(z, k.port)) as p:
            prompts = [f"story {i}" for i in range(6)]
            async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
                want = [t for t, _ in await asyncio.gather(*(c.complete(prompt=q, max_tokens=60, **sampling)
                                                               for q in prompts))]
                reqs = [await c.generate(prompt=q, max_tokens=60, **sampling) for q in prompts]
                await asyncio.wait_for(a.token_event.wait(), 5)
                while min(a.produced().values(), default=0) < 5:  # every stream on `a` is mid-way
                    a.token_event.clear()
                    await asyncio.wait_for(a.token_event.wait(), 5)
                moved = len(a.produced())
                assert moved >= 1
                z.set(NAME, ["127.0.0.3"])  # `a` leaves the Service; the process itself keeps running
                got = [await r.result() for r in reqs]
            assert [text for text, _ in got] == want
            assert sum(d.failovers for _, d in got) == moved
            assert all(d.replica == "b" for _, d in got if d.failovers)
            assert await p.proxy.pool.wait_for(lambda: urls(p) == {replica_url("127.0.0.3", k.port)}, timeout=5)
            assert p.proxy.metrics.failovers.get("drain") == moved and not p.proxy.metrics.failovers.get("removed")
            assert "127.0.0.2" in k.live and not a.conns  # not a crash: the proxy hung up


async def test_a_replica_left_with_no_successor_keeps_its_stream_then_goes_at_its_bound():
    """With no other replica ready a leaving replica's stream stays on it (nothing to hand it to); past
    `leave_timeout_s` what is still there fails over (cause `removed`), here onto a replica that came
    meanwhile, exactly; one that finished there meanwhile never moved."""
    pool = replace(FAST_POOL, leave_timeout_s=1.0)
    async with zone() as z, pods(step_s=0.02) as k:
        a = await k.start("127.0.0.2", "a")
        z.set(NAME, ["127.0.0.2"])
        async with proxy_for([], wait_ready=1, discovery=discovery(z, k.port), pool=pool) as p:
            async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
                want, _ = await c.complete(prompt="a long story", max_tokens=150, temperature=0)
                short_want, _ = await c.complete(prompt="short", max_tokens=12, temperature=0)
                long_req = await c.generate(prompt="a long story", max_tokens=150, temperature=0)
                short = await c.generate(prompt="short", max_tokens=12, temperature=0)
                while min(a.produced().values(), default=0) < 3:
                    a.token_event.clear()
                    await asyncio.wait_for(a.token_event.wait(), 5)
                z.set(NAME, [])  # `a` leaves with both streams and nobody to take them
                assert await p.proxy.pool.wait_for(lambda: not p.proxy.pool.ready(), timeout=5)
                short_text, short_done = await short.result()  # finished where it was
                assert (short_text, short_done.failovers, short_done.replica) == (short_want, 0, "a")
                await k.start("127.0.0.3", "b")
                z.set(NAME, ["127.0.0.3"])
                text, done = await long_req.result()
            assert text == want and done.failovers == 1 and done.replica == "b"
            assert p.proxy.metrics.failovers.get("removed") == 1
            assert urls(p) == {replica_url("127.0.0.3", k.port)}


async def test_a_replica_back_in_dns_while_leaving_is_ready_again():
    async with zone() as z, pods(step_s=0.05) as k:
        a = await k.start("127.0.0.2", "a")
        z.set(NAME, ["127.0.0.2"])
        async with proxy_for([], wait_ready=1, discovery=discovery(z, k.port)) as p:
            pool = p.proxy.pool
            async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
                req = await c.generate(prompt="a long story", max_tokens=80)  # 4 s: the leave and the flap back take two refreshes
                await asyncio.wait_for(a.token_event.wait(), 5)
                z.set(NAME, [])
                assert await pool.wait_for(lambda: not pool.ready(), timeout=5)  # leaving, still streaming
                z.set(NAME, ["127.0.0.2"])  # a readiness flap: back before it had gone
                assert await pool.wait_for(lambda: len(pool.ready()) == 1, timeout=5)
                assert len(pool.conns) == 1  # the same connection, not a second one to the same URL
                _, done = await req.result()
            assert done.failovers == 0 and done.replica == "a"


async def test_a_dns_outage_keeps_the_last_known_set():
    async with zone() as z, pods() as k:
        for i in range(2):
            await k.start(f"127.0.0.{i + 2}", f"r{i}")
        z.set(NAME, ["127.0.0.2", "127.0.0.3"])
        await k.start("127.0.0.9", "static")
        static = SimpleNamespace(url=replica_url("127.0.0.9", k.port))  # given with --replica
        async with proxy_for([static], wait_ready=1, discovery=discovery(z, k.port)) as p:
            d = p.proxy.discovery
            assert await p.proxy.pool.wait_ready(3, timeout=10)
            known = urls(p)
            for outage, n in (("servfail", 2), ("silent", 1)):  # silent: each refresh waits out its timeout
                z.mode = outage
                await refreshes(d, n)
                assert d.outage and urls(p) == known and len(p.proxy.pool.ready()) == 3
            await z.stop()  # the server is gone altogether
            await refreshes(d, 1)
            assert d.outage and urls(p) == known
            async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
                _, done = await c.complete(prompt="still serving?", max_tokens=5)
            assert done.finish_reason == "length"
            assert p.proxy.metrics.dns_refreshes.get("outage") >= 4

            # It answers again, with a changed set: applied at once.
            z.mode = "up"
            await z.start("127.0.0.1", z.port)
            z.set(NAME, ["127.0.0.3"])
            await refreshes(d, 2)
            assert not d.outage and urls(p) == {replica_url("127.0.0.3", k.port), replica_url("127.0.0.9", k.port)}
            # No address at all is an answer too: the discovered replicas go, the static one stays.
            z.set(NAME, [])
            await refreshes(d, 1)
            assert urls(p) == {replica_url("127.0.0.9", k.port)}

