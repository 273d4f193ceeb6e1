"""Cross-region forwarding: peer order, skipping peers that are down, relaying to a sink."""

import asyncio

import pytest

from edge_proxy import protocol as pp
from edge_proxy.client import EdgeClient
from edge_proxy.peering import Peer, PeerLink, next_peer, peer_order
from regions.relay import Relay

from tests.regions.inproc import region

pytestmark = pytest.mark.anyio
HI = [{"role": "user", "content": "hello there"}]


def test_peer_order_and_next_peer():
    links = {frozenset(("eu", "us")): 80.0, frozenset(("eu", "ap")): 150.0, frozenset(("us", "ap")): 100.0}
    urls = {"us": "ws://u", "ap": "ws://a", "eu": "ws://e"}
    peers = peer_order("eu", links, urls)
    assert [(p.region, p.rtt_ms) for p in peers] == [("us", 80.0), ("ap", 150.0)]
    assert [p.region for p in peer_order("eu", links, {"ap": "ws://a"})] == ["ap"]  # no URL, no peer
    assert next_peer(peers, {}, set(), 0.0).region == "us"
    assert next_peer(peers, {"us": 5.0}, set(), 1.0).region == "ap"  # down until t=5
    assert next_peer(peers, {"us": 5.0}, set(), 6.0).region == "us"
    assert next_peer(peers, {}, {"us", "ap"}, 0.0) is None


class Sink:
    def __init__(self):
        self.text, self.final, self.ended, self.first = "", None, asyncio.Event(), asyncio.Event()

    def delta(self, s, text, n):
        self.text += text
        self.first.set()

    def finish(self, s, msg):
        self.final = msg
        self.ended.set()


async def test_forward_to_the_nearest_reachable_peer():
    async with region("us") as us:
        relay = await Relay(0, "127.0.0.1", us.port, rtt_ms=20.0).start()
        dead = Peer("ap", "ws://127.0.0.1:1/v1/stream", 10.0)  # nearer, but nothing listens
        link = PeerLink("eu", [dead, Peer("us", f"ws://127.0.0.1:{relay.port}/v1/stream", 20.0)])
        try:
            sink = Sink()
            kw = dict(messages=HI, max_tokens=6, temperature=0.0)
            f = link.forward("c1", sink, kw)
            await asyncio.wait_for(sink.ended.wait(), 10)
            assert type(sink.final) is pp.Done and sink.final.id == "c1"
            assert sink.final.region == "us" and sink.final.usage.completion_tokens == 6
            assert f.tried == {"ap", "us"} and "ap" in link.down_until
            async with await EdgeClient.connect(us.ws) as c:
                direct, _ = await c.complete(**kw)
            assert sink.text == direct  # the same stream as asking the peer directly

            sink2 = Sink()
            f2 = link.forward("c2", sink2, dict(messages=HI, max_tokens=500))
            await asyncio.wait_for(sink2.first.wait(), 5)
            assert f2.tried == {"us"}  # the dead peer is skipped while marked down
            f2.cancel(notify=True)
            await asyncio.wait_for(sink2.ended.wait(), 5)
            assert sink2.final.finish_reason == "abort"
            await asyncio.wait_for(us.stubs[0].abort_event.wait(), 5)
        finally:
            await link.close()
            await relay.stop()


async def test_a_peer_without_replicas_passes_to_the_next():
    async with region("us") as us, region("sa") as sa:
        us.proxy.draining = True  # answers shutting_down: not a final answer for a forwarded request
        link = PeerLink("eu", [Peer("us", us.ws, 10.0), Peer("sa", sa.ws, 90.0)])
        try:
            sink = Sink()
            link.forward("c1", sink, dict(messages=HI, max_tokens=3))
            await asyncio.wait_for(sink.ended.wait(), 10)
            assert type(sink.final) is pp.Done and sink.final.region == "sa"
            sa.proxy.draining = True
            sink = Sink()
            link.down_until.clear()
            link.forward("c2", sink, dict(messages=HI, max_tokens=3))
            await asyncio.wait_for(sink.ended.wait(), 10)
            assert type(sink.final) is pp.Error and sink.final.code == pp.SHUTTING_DOWN and sink.final.id == "c2"
        finally:
            us.proxy.draining = sa.proxy.draining = False
            await link.close()
