"""Pods behind a headless Service, on loopback: a real DNS server (`regions.dns_zone`) and
replica stubs at 127.0.0.N on one port, started and stopped like pods."""

from __future__ import annotations

import asyncio
import contextlib

from edge_proxy.discovery import DiscoveryConfig, DnsDiscovery
from regions.dns_zone import DnsZone
from stub_replica.server import StubConfig, StubReplica
from tests.replica.server import free_port

from conftest import SECRET

NAME = "edgechat-replica.edgechat.test"
INTERVAL = 0.25  # the proxies' --dns-interval in these tests


@contextlib.asynccontextmanager
async def zone():
    z = await DnsZone().start("127.0.0.1")
    try:
        yield z
    finally:
        await z.stop()


class Pods:
    """Stub replicas at 127.0.0.N:port, started and stopped like pods."""

    def __init__(self, port: int, step_s: float = 0.01):
        self.port, self.step_s = port, step_s
        self.live: dict[str, StubReplica] = {}  # address -> stub

    async def start(self, address: str, rid: str) -> StubReplica:
        stub = StubReplica(StubConfig(replica_id=rid, secret=SECRET, step_s=self.step_s))
        self.live[address] = await stub.start(address, self.port)
        return stub

    async def stop(self, address: str) -> None:
        await self.live.pop(address).stop()

    async def close(self) -> None:
        for a in list(self.live):
            await self.stop(a)


@contextlib.asynccontextmanager
async def pods(step_s: float = 0.01):
    p = Pods(free_port("127.0.0.2"), step_s)
    try:
        yield p
    finally:
        await p.close()


def discovery(z: DnsZone, port: int, name: str = NAME) -> DiscoveryConfig:
    return DiscoveryConfig(name, port, INTERVAL, z.server)


async def refreshes(d: DnsDiscovery, n: int = 1) -> None:
    """Wait for `n` more refreshes to complete."""
    for _ in range(n):
        d.refreshed.clear()
        await asyncio.wait_for(d.refreshed.wait(), 10)
