"""A rolling restart of the replicas (stop one, start one, repeatedly) under steady load from
the load tester, with the proxy following the replicas by DNS: zero failed requests.

Each replaced "pod" gets a new address, as on Kubernetes. The two orders a cluster produces
alternate: the pod leaves DNS first and stops once the proxy has moved its streams (preStop
long enough: the proxy hands a leaving replica's streams on as a drain's, cause `drain`), or it
stops while its record is still served (SIGTERM racing the endpoint update: cause `disconnect`).
Either way its streams resume exactly elsewhere: the stub answers a resume that does not
continue its own stream with an error, which the load tester would count.
"""

from __future__ import annotations

import asyncio

import pytest

from edge_proxy.discovery import replica_url
from loadtest import workloads as W
from loadtest.driver import Location, Run, RunConfig

from conftest import proxy_for
from dns_pods import NAME, discovery, pods, zone

pytestmark = pytest.mark.anyio
CYCLES = 4


async def test_rolling_restart_under_load_fails_no_request():
    async with zone() as z, pods(step_s=0.01) as k:
        for i in range(3):
            await k.start(f"127.0.0.{i + 2}", f"r{i}")
        z.set(NAME, list(k.live))
        async with proxy_for([], wait_ready=3, discovery=discovery(z, k.port)) as p:
            pool = p.proxy.pool
            knobs = W.Knobs(input_words=(3, 8), output_tokens=(30, 60))
            run = Run(RunConfig({"random": 1.0}, concurrency=12, duration_s=120, api_key="sk-alice", seed=5,
                                knobs=knobs, progress=False, drain_s=30), [Location("local", {"local": p.http})])

            async def roll() -> None:
                await asyncio.sleep(0.5)  # load is flowing
                for cycle in range(CYCLES):
                    old = next(iter(k.live))  # the oldest pod
                    url = replica_url(old, k.port)
                    z.set(NAME, [a for a in k.live if a != old])
                    if cycle % 2 == 0:  # leaves DNS, then stops once the proxy let go of it
                        assert await pool.wait_for(lambda: url not in {c.url for c in pool.conns}, timeout=10)
                    await k.stop(old)
                    new = f"127.0.0.{cycle + 5}"
                    await k.start(new, f"r{cycle + 3}")
                    z.set(NAME, list(k.live))
                    assert await pool.wait_for(lambda: len(pool.ready()) == 3 and replica_url(new, k.port) in
                                               {c.url for c in pool.ready()}, timeout=10)
                    await asyncio.sleep(0.3)  # the new replica takes a share of the load
                run.stop.set()

            result, _ = await asyncio.gather(run.run(), roll())
            failovers = {c: p.proxy.metrics.failovers.get(c) for c in ("drain", "disconnect")}
    tot = result["totals"]["all"]
    # the message names what became of a missing request first (pytest shortens long reprs)
    assert tot["requests"] >= 50 and tot["completed"] == tot["requests"] == result["requests_sent"], \
        (f"errors {tot['errors']}, rejections {tot['rejections']}, unfinished {tot['unfinished']}", tot, result)
    assert not tot["errors"] and not tot["rejections"] and not tot["unfinished"] and not result["connect_errors"]
    assert failovers["drain"] > 0 and failovers["disconnect"] > 0  # streams moved, in both orders
