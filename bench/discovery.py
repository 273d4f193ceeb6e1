"""Live discovery (`--replicas-dns`): how fast a replica added to DNS takes traffic, and what
a client sees when its replica leaves DNS mid-stream, per refresh interval.

    .venv/bin/python bench/discovery.py                       # intervals 0.5, 1, 2 s; 5 trials each
    .venv/bin/python bench/discovery.py --intervals 2 --trials 10

Everything in one process on loopback: a DNS zone (`regions.dns_zone`, UDP+TCP), replica
stubs at 127.0.0.N on one port (pods behind a headless Service, 20 ms per token), and the
proxy (uvicorn, the public WebSocket). Per trial:

  join   a record is added; time until the proxy has the replica ready (Hello, KV snapshot)
  leave  10 streams run on two replicas; one replica's record is removed. `moved` = streams
         resumed elsewhere; `detect` = time from the change until the proxy let go of the
         replica; `gap` = the longest wait between two tokens of a moved stream, as its
         client saw it (the resume on another replica included), next to the 20 ms step.

`detect` is bounded by the interval (the change lands anywhere within one); on Kubernetes
add the DNS TTL (CoreDNS: 5 s) to both figures.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import platform
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from time import perf_counter

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge_proxy.app import create_app  # noqa: E402
from edge_proxy.auth import KeyStore  # noqa: E402
from edge_proxy.client import EdgeClient  # noqa: E402
from edge_proxy.config import ProxyConfig  # noqa: E402
from edge_proxy.core import Proxy  # noqa: E402
from edge_proxy.discovery import DiscoveryConfig, replica_url  # noqa: E402
from edge_proxy.pool import PoolConfig  # noqa: E402
from edge_proxy.prompt import ByteTokenizer  # noqa: E402
from edge_proxy.server import DrainingServer, bind, uvicorn_config  # noqa: E402
from regions.dns_zone import DnsZone  # noqa: E402
from stub_replica.server import StubConfig, StubReplica  # noqa: E402

SECRET = "bench-secret"
NAME = "edgechat-replica.bench.test"
STEP_S = 0.02


async def trial(interval: float, n: int) -> dict:
    zone = await DnsZone().start("127.0.0.1")
    probe = bind("127.0.0.2", 0)
    port = probe.getsockname()[1]
    probe.close()
    stubs = {}
    for a in ("127.0.0.2", "127.0.0.3"):
        stubs[a] = await StubReplica(StubConfig(replica_id=a, secret=SECRET, step_s=STEP_S)).start(a, port)
    zone.set(NAME, ["127.0.0.2"])
    cfg = ProxyConfig(replicas=[], port=0, tokenizer="bytes", allow_anonymous=True, log_level="warning",
                      pool=PoolConfig(secret=SECRET), discovery=DiscoveryConfig(NAME, port, interval, zone.server))
    proxy = Proxy(cfg, ByteTokenizer(), KeyStore([], salt_secret=SECRET, anonymous=True))
    sock = bind("127.0.0.1", 0)
    server = DrainingServer(uvicorn_config(create_app(proxy), replace(cfg, log_level="warning")), proxy)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    pool = proxy.pool
    try:
        assert await pool.wait_ready(1, timeout=30)
        await asyncio.sleep(interval * (n % 5) / 5)  # the change lands at another phase of the refresh each trial
        zone.set(NAME, ["127.0.0.2", "127.0.0.3"])
        t0 = perf_counter()
        assert await pool.wait_ready(2, timeout=30)
        join = perf_counter() - t0

        url = f"ws://127.0.0.1:{sock.getsockname()[1]}/v1/stream"
        async with await EdgeClient.connect(url) as c:
            reqs = [await c.generate(prompt=f"stream {i}", max_tokens=150) for i in range(10)]
            victim = stubs["127.0.0.3"]
            while len(victim.produced()) < 1 or min(victim.produced().values()) < 10:
                victim.token_event.clear()
                await asyncio.wait_for(victim.token_event.wait(), 10)
            moved_ids = set(victim.produced())
            gaps = {}

            async def follow(r):
                last, worst = perf_counter(), 0.0
                async for _ in r:
                    now = perf_counter()
                    worst, last = max(worst, now - last), now
                gaps[r] = worst

            followers = [asyncio.create_task(follow(r)) for r in reqs]
            await asyncio.sleep(interval * (n % 5) / 5)
            zone.set(NAME, ["127.0.0.2"])
            t1 = perf_counter()
            gone = replica_url("127.0.0.3", port)
            assert await pool.wait_for(lambda: gone not in {x.url for x in pool.conns}, timeout=30)
            detect = perf_counter() - t1
            await asyncio.gather(*followers)
            moved = [r for r in reqs if r.done.failovers]
            return {"join": join, "detect": detect, "moved": len(moved), "expected": len(moved_ids),
                    "gap": max(gaps[r] for r in moved) if moved else float("nan")}
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)
        for s in stubs.values():
            await s.stop()
        await zone.stop()


def ms(xs: list[float], q: str) -> str:
    xs = sorted(xs)
    v = statistics.median(xs) if q == "p50" else xs[-1]
    return f"{v * 1e3:7.0f}"


async def main(intervals: list[float], trials: int) -> None:
    print(f"# bench/discovery.py on {platform.node()} ({platform.processor() or platform.machine()}), "
          f"Python {platform.python_version()}; stub step {STEP_S * 1e3:g} ms")
    print("| interval s | join p50 ms | join max ms | detect p50 ms | detect max ms | moved | gap p50 ms | gap max ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for iv in intervals:
        rs = [await trial(iv, n) for n in range(trials)]
        moved = f"{sum(r['moved'] for r in rs)}/{sum(r['expected'] for r in rs)}"
        print(f"| {iv:g} | {ms([r['join'] for r in rs], 'p50')} | {ms([r['join'] for r in rs], 'max')} | "
              f"{ms([r['detect'] for r in rs], 'p50')} | {ms([r['detect'] for r in rs], 'max')} | {moved} | "
              f"{ms([r['gap'] for r in rs], 'p50')} | {ms([r['gap'] for r in rs], 'max')} |", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--intervals", default="0.5,1,2", help="--dns-interval values, comma-separated (s)")
    ap.add_argument("--trials", type=int, default=5)
    a = ap.parse_args()
    logging.getLogger("edge_proxy").setLevel(logging.ERROR)  # "replica lost (removed)" is the point here
    import uvloop

    uvloop.run(main([float(x) for x in a.intervals.split(",")], a.trials))
