"""Client-side region choice: probe each region's `/healthz`, pick the nearest healthy
one, fail over in RTT order.

`rank` is pure (tests drive it with made-up probes); `probe_regions` does the
HTTP; `EdgeClient.connect_nearest` (edge_proxy/client.py) opens a connection to the
first region that accepts.
A region's RTT is the median of `samples` GETs on one keep-alive connection,
after one warm-up GET that pays the TCP handshake (so a 2-RTT first request
does not count). A region is healthy when every sample answered 200.

    regions = {"eu": "http://127.0.0.1:8400", "us": "http://127.0.0.1:8401"}
    client, probe = await EdgeClient.connect_nearest(regions, api_key="sk-...")
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import dataclass
from time import perf_counter

import httpx


@dataclass(frozen=True)
class Probe:
    region: str
    url: str  # http(s) base URL of the region's proxy (or the relay in front of it)
    rtt_ms: float  # median /healthz round trip; inf when unreachable
    healthy: bool
    detail: str = ""  # why unhealthy


def rank(probes: list[Probe]) -> list[Probe]:
    """Healthy regions, nearest first (ties by name, so the order is stable)."""
    return sorted((p for p in probes if p.healthy), key=lambda p: (p.rtt_ms, p.region))


async def probe_one(client: httpx.AsyncClient, region: str, url: str, samples: int = 3) -> Probe:
    base = url.rstrip("/")
    try:
        r = await client.get(base + "/healthz")  # warm-up: connection set-up
        if r.status_code != 200:
            return Probe(region, url, float("inf"), False, f"/healthz answered {r.status_code}")
        rtts = []
        for _ in range(samples):
            t0 = perf_counter()
            r = await client.get(base + "/healthz")
            rtts.append((perf_counter() - t0) * 1e3)
            if r.status_code != 200:
                return Probe(region, url, float("inf"), False, f"/healthz answered {r.status_code}")
    except httpx.HTTPError as e:
        return Probe(region, url, float("inf"), False, f"{type(e).__name__}: {e}")
    return Probe(region, url, statistics.median(rtts), True)


async def probe_regions(regions: dict[str, str], samples: int = 3, timeout_s: float = 2.0) -> list[Probe]:
    """Probe every region concurrently, each on its own connection."""
    async def one(name: str, url: str) -> Probe:
        async with httpx.AsyncClient(trust_env=False, timeout=timeout_s) as c:
            return await probe_one(c, name, url, samples)

    return list(await asyncio.gather(*(one(n, u) for n, u in regions.items())))


def ws_url(http_url: str, path: str = "/v1/stream") -> str:
    base = http_url.rstrip("/")
    if base.startswith("https://"):
        return "wss://" + base[len("https://"):] + path
    if base.startswith("http://"):
        return "ws://" + base[len("http://"):] + path
    raise ValueError(f"region URL must be http:// or https://, got {http_url!r}")


class NoRegionAvailable(ConnectionError):
    def __init__(self, probes: list[Probe], failures: list[str]):
        detail = "; ".join([f"{p.region}: {p.detail}" for p in probes if not p.healthy] + failures)
        super().__init__(f"no region reachable ({detail or 'none configured'})")
        self.probes = probes
