"""Cross-region failover: a proxy with no ready replica forwards to a peer region's proxy,
which never forwards a forwarded request again."""

import asyncio
from types import SimpleNamespace

import httpx
import msgspec
import pytest

from edge_proxy import protocol as pp
from edge_proxy.__main__ import parse_args
from edge_proxy.client import EdgeClient, EdgeError
from edge_proxy.peering import FORWARDED_HEADER, Peer, parse_peer

from tests.edge_proxy.conftest import proxy_for, stubs

pytestmark = pytest.mark.anyio
HI = [{"role": "user", "content": "hello there"}]
NOWHERE = [SimpleNamespace(url="ws://127.0.0.1:1/v1/replica")]  # a region whose only replica never answers


def peer(region: str, running, rtt: float = 20.0) -> Peer:
    return Peer(region, running.ws_url, rtt)


async def test_no_replica_here_forwards_to_the_peer_region():
    async with stubs("us-0") as reps, proxy_for(reps, region="us") as us, \
            proxy_for(NOWHERE, wait_ready=0, region="eu", peers=(peer("us", us),), peer_key="sk-peer") as eu:
        kw = dict(messages=HI, max_tokens=6, temperature=0.0)
        async with await EdgeClient.connect(eu.ws_url, api_key="sk-alice") as c:
            text, done = await c.complete(**kw)
        assert done.region == "us" and done.forwarded_from == "eu" and done.replica == "us-0"
        assert done.usage.completion_tokens == 6 and done.timing.total_ms >= done.timing.ttft_ms > 0
        async with await EdgeClient.connect(us.ws_url, api_key="sk-alice") as c:
            direct, ddone = await c.complete(**kw)
        assert text == direct and ddone.forwarded_from == ""  # the same stream; served locally: not marked

        async with httpx.AsyncClient(base_url=eu.http, headers={"Authorization": "Bearer sk-alice"}) as h:
            r = await h.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 3})
        assert r.status_code == 200, r.text
        ext = r.json()["edgechat"]
        assert ext["region"] == "us" and ext["forwarded_from"] == "eu"
        assert eu.proxy.peers.forwarded == 2 and us.proxy.peers is None

        async with await EdgeClient.connect(eu.ws_url, api_key="sk-alice") as c:  # cancel, relayed to the peer
            req = await c.generate(messages=HI, max_tokens=1000)
            async for _ in req:
                break
            await req.cancel()
            _, done = await req.result()
        assert done.finish_reason == "abort" and done.forwarded_from == "eu"
        await asyncio.wait_for(reps[0].abort_event.wait(), 5)


async def test_a_forwarded_request_keeps_its_tenant_and_only_peer_keys_may_name_one():
    """At the peer, each forwarded request runs under its own tenant's cache salt (the
    peer key names the tenant); a client key naming a tenant is refused."""
    from edge_proxy.auth import cache_salt

    from tests.edge_proxy.conftest import SECRET

    async with stubs("us-0") as reps, proxy_for(reps, region="us") as us, \
            proxy_for(NOWHERE, wait_ready=0, region="eu", peers=(peer("us", us),), peer_key="sk-peer") as eu:
        for key in ("sk-alice", "sk-bob"):
            async with await EdgeClient.connect(eu.ws_url, api_key=key) as c:
                _, done = await c.complete(messages=HI, max_tokens=2)
            assert done.forwarded_from == "eu"
        assert [g.cache_salt for g in reps[0].generates] == [cache_salt("alice", SECRET), cache_salt("bob", SECRET)]
        async with await EdgeClient.connect(us.ws_url, api_key="sk-alice") as c:
            with pytest.raises(EdgeError) as ei:
                await c.complete(messages=HI, max_tokens=2, tenant="bob")
        assert ei.value.code == pp.FORBIDDEN and "not a peer key" in str(ei.value)
        assert len(reps[0].generates) == 2


async def test_a_forwarded_request_is_never_forwarded_again():
    async with proxy_for(NOWHERE, wait_ready=0, region="us") as us, \
            proxy_for(NOWHERE, wait_ready=0, region="eu", peers=(peer("us", us),), peer_key="sk-peer") as eu:
        us.proxy.peers = type(eu.proxy.peers)("us", [peer("eu", eu)], "sk-peer")  # each the other's peer
        try:
            async with await EdgeClient.connect(eu.ws_url, api_key="sk-alice") as c:
                with pytest.raises(EdgeError) as ei:
                    await c.complete(messages=HI, max_tokens=3)
            assert ei.value.code == pp.UNAVAILABLE and "peer us" in str(ei.value)
            assert eu.proxy.peers.forwarded == 1 and us.proxy.peers.forwarded == 0  # no bounce back

            headers = {"Authorization": "Bearer sk-alice", FORWARDED_HEADER: "eu"}
            async with httpx.AsyncClient(base_url=us.http, headers=headers) as h:
                r = await h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            assert r.status_code == 503 and r.json()["error"]["code"] == pp.UNAVAILABLE
            assert us.proxy.peers.forwarded == 0
        finally:
            await us.proxy.peers.close()


async def test_an_unreachable_peer_is_unavailable():
    dead = Peer("ap", "ws://127.0.0.1:1/v1/stream", 5.0)
    async with proxy_for(NOWHERE, wait_ready=0, region="eu", peers=(dead,)) as eu:
        async with await EdgeClient.connect(eu.ws_url, api_key="sk-alice") as c:
            with pytest.raises(EdgeError) as ei:
                await c.complete(messages=HI, max_tokens=3)
        assert ei.value.code == pp.UNAVAILABLE and "peer ap" in str(ei.value)


def test_peer_flag_and_done_json():
    base = ["--replica", "ws://127.0.0.1:9/v1/replica", "--region", "eu"]
    cfg = parse_args(base + ["--peer", "us=ws://127.0.0.1:9/v1/stream@80", "--peer", "ap=wss://h:1/v1/stream@10"])
    assert [(p.region, p.rtt_ms) for p in cfg.peers] == [("ap", 10.0), ("us", 80.0)]  # nearest first
    assert parse_peer("us=ws://u@h:1/v1/stream@7.5") == Peer("us", "ws://u@h:1/v1/stream", 7.5)
    for bad in ("us", "us=ws://h:1/v1/stream", "us=http://h:1@5", "us=ws://h:1@x", "=ws://h:1@5"):
        with pytest.raises(ValueError):
            parse_peer(bad)
    with pytest.raises(ValueError, match="other regions"):
        parse_args(base + ["--peer", "eu=ws://h:1/v1/stream@5"])
    old = b'{"type":"done","id":"r","finish_reason":"stop","usage":{},"timing":{},"region":"eu","replica":"a"}'
    assert pp.ServerCodec().decode(old).forwarded_from == ""  # frames from an older proxy still decode
    d = pp.Done("r", "stop", pp.Usage(), pp.Timing(), "us", "a", forwarded_from="eu")
    assert msgspec.json.decode(pp.ClientCodec().encode(d))["forwarded_from"] == "eu"


async def test_forwarded_requests_count_against_max_inflight_and_drain_waits_for_them():
    from edge_proxy.admission import AdmissionConfig

    async with stubs("us-0", step_s=0.02) as reps, proxy_for(reps, region="us") as us, \
            proxy_for(NOWHERE, wait_ready=0, region="eu", peers=(peer("us", us),), peer_key="sk-peer",
                      admission=AdmissionConfig(max_inflight=1)) as eu:
        async with await EdgeClient.connect(eu.ws_url, api_key="sk-alice") as c:
            req = await c.generate(messages=HI, max_tokens=15)
            async for _ in req:
                break
            assert len(eu.proxy.forwarding) == 1
            with pytest.raises(EdgeError) as ei:
                await c.complete(messages=HI, max_tokens=2)
            assert ei.value.code == pp.OVERLOADED
            assert not await eu.proxy.drain(0.01)  # the forwarded stream is still open
            assert await eu.proxy.drain(10)
            text, done = await req.result()
        assert done.finish_reason == "length" and done.usage.completion_tokens == 15 and not eu.proxy.forwarding
