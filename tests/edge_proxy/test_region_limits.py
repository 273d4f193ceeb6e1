"""One region, two proxies over the same replica stub(s) (issue 44): a key's rate limit and
in-flight cap are the region's, each proxy enforcing its share, not each its own copy."""

import asyncio
import time

import httpx
import pytest

from edge_proxy import protocol as pp
from edge_proxy.auth import KeyStore, parse_env
from edge_proxy.client import EdgeClient, EdgeError
from edge_proxy.discovery import DiscoveryConfig, ProxyCensus
from edge_proxy.limits import RegionShare, shared_cap, shared_rate

from dns_pods import zone
from conftest import KEYS, stubs, two_proxies

pytestmark = pytest.mark.anyio


async def test_a_keys_rate_across_two_proxies_is_its_limit():
    """20 requests a second for the region, a burst of 20: each of two proxies keeps a bucket
    of 10 a second, 10 banked. Clients hammer both for 2 s (4 at a time on each, each sending
    its next as its last is answered: far over the limit). Each proxy's count is what its
    bucket allows over the time its requests arrived, which lies between the span from the
    first answer to the last send and the span from the first send to the last answer (the
    proxies run in this process, on this clock): at most its burst plus its rate over the
    outer span, at least its rate over the inner one (its burst, 1 s of tokens, covers what a
    stall of the loop lets go to waste). Two proxies each enforcing the whole limit would
    take twice as many."""
    keys = KEYS + [{"key": "sk-metered", "tenant": "metered", "rate_per_s": 20, "burst": 20}]
    rate, burst, clients, duration = 10.0, 10.0, 4, 2.0  # each proxy's share; its clients; seconds
    async with stubs("a", step_s=0.001) as reps, two_proxies(reps, keys=keys, region_proxies=2) as proxies:
        async with httpx.AsyncClient(trust_env=False, headers={"Authorization": "Bearer sk-metered"}) as h:
            t0 = time.monotonic()

            async def hammer(p) -> list[tuple[float, float, int]]:
                out = []
                while time.monotonic() - t0 < duration:
                    sent = time.monotonic()
                    r = await h.post(p.http + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
                    out.append((sent, time.monotonic(), r.status_code))
                return out

            runs = await asyncio.gather(*(hammer(p) for p in proxies for _ in range(clients)))
    for i in range(2):
        calls = [c for run in runs[i * clients:(i + 1) * clients] for c in run]
        assert {code for _, _, code in calls} <= {200, 429}
        accepted = sum(code == 200 for _, _, code in calls)
        outer = max(end for _, end, _ in calls) - min(sent for sent, _, _ in calls)
        inner = max(sent for sent, _, _ in calls) - min(end for _, end, _ in calls)
        assert len(calls) > 2 * (burst + rate * outer), "the clients did not offer twice the limit"
        assert rate * inner <= accepted <= burst + rate * outer, (i, accepted, inner, outer, len(calls))


async def test_a_keys_inflight_cap_across_two_proxies_is_its_limit():
    """A cap of 4 requests in flight for the region: 2 on each of two proxies."""
    keys = KEYS + [{"key": "sk-capped", "tenant": "capped", "max_inflight": 4}]
    async with stubs("a", "b") as reps, two_proxies(reps, keys=keys, region_proxies=2) as proxies:
        clients = [await EdgeClient.connect(p.ws_url, api_key="sk-capped") for p in proxies]
        try:
            running = [await c.generate(prompt=f"long {i}", max_tokens=1000) for c in clients for i in range(2)]
            for r in running:  # admitted: streaming
                await anext(aiter(r))
            for c in clients:
                with pytest.raises(EdgeError) as e:
                    await c.complete(prompt="one more", max_tokens=1)
                assert e.value.code == pp.RATE_LIMITED
            for r in running:
                await r.cancel()
            _, d = await clients[0].complete(prompt="after", max_tokens=1)  # the cap frees as they end
            assert d.finish_reason == "length"
        finally:
            for c in clients:
                await c.close()


def test_a_keys_limits_split_over_the_regions_processes():
    share = RegionShare(proxies=3, workers=2).fraction
    assert shared_rate(60.0, 12.0, share) == (10.0, 2.0) and shared_rate(6.0, 2.0, share) == (1.0, 1.0)
    assert shared_cap(12, share) == 2 and shared_cap(3, share) == 1 and shared_cap(0, share) == 0
    with pytest.raises(ValueError):
        RegionShare(proxies=0)
    keys = KeyStore(parse_env("sk-x=x:interactive:30:6:9"), salt_secret="s")
    k = keys.check("sk-x")
    assert (k.rate, k.burst, k.max_inflight, k.inflight_cap) == (30.0, 6.0, 9, 9)
    keys.set_share(1 / 3)
    assert (k.bucket.rate, k.bucket.burst, k.inflight_cap) == (10.0, 2.0, 3)
    assert k.bucket.tokens == 2.0  # what was banked, down to the new burst


async def test_the_proxies_headless_service_counts_the_region():
    """--proxies-dns: a proxy pod's share follows the count of its Service's records; an
    outage or an empty answer keeps the last count."""
    async with zone() as z:
        z.set("edgechat-proxy.edgechat.test", ["127.0.0.2", "127.0.0.3"])
        seen = []
        census = ProxyCensus(DiscoveryConfig("edgechat-proxy.edgechat.test", interval_s=0.25, server=z.server),
                             seen.append)
        await census.refresh()
        z.set("edgechat-proxy.edgechat.test", ["127.0.0.2", "127.0.0.3", "127.0.0.4"])
        await census.refresh()
        z.set("edgechat-proxy.edgechat.test", [])
        await census.refresh()
        assert seen == [2, 3] and census.count == 3
