"""Client-side region choice: rank by /healthz RTT, skip the unhealthy, fail over in RTT order."""

import pytest

from edge_proxy.client import EdgeClient
from regions.relay import Relay
from edge_proxy.select import NoRegionAvailable, Probe, probe_regions, rank, ws_url

from tests.regions.inproc import region

pytestmark = pytest.mark.anyio
HI = [{"role": "user", "content": "hello"}]


def test_rank_is_nearest_healthy_first_and_stable():
    ps = [Probe("us", "u", 90.0, True), Probe("eu", "e", 10.0, True), Probe("ap", "a", 5.0, False, "503"),
          Probe("sa", "s", 10.0, True)]
    assert [p.region for p in rank(ps)] == ["eu", "sa", "us"]
    assert rank([]) == []


def test_ws_url():
    assert ws_url("http://h:1/") == "ws://h:1/v1/stream"
    assert ws_url("https://h") == "wss://h/v1/stream"
    with pytest.raises(ValueError):
        ws_url("h:1")


async def test_probe_picks_the_region_with_the_lower_rtt_and_fails_over():
    async with region("eu") as eu, region("us") as us:
        near = await Relay(0, "127.0.0.1", eu.port, rtt_ms=30.0).start()
        far = await Relay(0, "127.0.0.1", us.port, rtt_ms=5.0).start()
        try:
            regions = {"eu": near.url, "us": far.url, "down": "http://127.0.0.1:1"}
            probes = {p.region: p for p in await probe_regions(regions, samples=3)}
            assert 30.0 <= probes["eu"].rtt_ms < 60.0 and probes["us"].rtt_ms < 30.0
            assert not probes["down"].healthy and probes["down"].detail
            assert [p.region for p in rank(list(probes.values()))] == ["us", "eu"]

            client, chosen = await EdgeClient.connect_nearest(regions)  # the reference client's entry
            async with client:
                _, done = await client.complete(messages=HI, max_tokens=3)
            assert chosen.region == "us" and done.region == "us"

            us.proxy.draining = True  # /healthz 503: clients move to the next region in RTT order
            client, chosen = await EdgeClient.connect_nearest(regions)
            async with client:
                _, done = await client.complete(messages=HI, max_tokens=3)
            assert chosen.region == "eu" and done.region == "eu"
            us.proxy.draining = False
        finally:
            await near.stop()
            await far.stop()


async def test_no_region_reachable():
    with pytest.raises(NoRegionAvailable, match="no region reachable"):
        await EdgeClient.connect_nearest({"a": "http://127.0.0.1:1"})

