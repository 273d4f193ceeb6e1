"""Real servers on free loopback ports: replica stubs and the proxy (uvicorn) in the test's loop."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, replace

import pytest
import uvicorn

from edge_proxy.app import create_app
from edge_proxy.auth import KeyStore
from edge_proxy.config import ProxyConfig
from edge_proxy.core import Proxy
from edge_proxy.pool import PoolConfig
from edge_proxy.prompt import ByteTokenizer
from edge_proxy.server import DrainingServer, bind, uvicorn_config
from stub_replica.server import StubConfig, StubReplica

SECRET = "replica-secret"
KEYS = [
    {"key": "sk-alice", "tenant": "alice"},
    {"key": "sk-bob", "tenant": "bob"},
    {"key": "sk-batch", "tenant": "crunch", "tier": "batch"},
    {"key": "sk-slow", "tenant": "slowpoke", "rate_per_s": 1, "burst": 2},
    {"key": "sk-peer", "tenant": "eu-proxy", "tier": "peer"},  # what other regions' proxies present
]
FAST_POOL = PoolConfig(secret=SECRET, ping_interval_s=0.5, ping_timeout_s=1.0, stall_timeout_s=1.0,
                       healthz_interval_s=0.1, healthz_failures=3, backoff_min_s=0.02, backoff_max_s=0.2)


@pytest.fixture
def anyio_backend():
    return "asyncio", {"use_uvloop": True}


@contextlib.asynccontextmanager
async def stubs(*ids: str, **kw):
    """Replica stubs on free ports, sharing the proxy's secret unless told otherwise."""
    kw.setdefault("secret", SECRET)
    started = [await StubReplica(StubConfig(replica_id=i, **kw)).start() for i in ids]
    try:
        yield started
    finally:
        for s in started:
            await s.stop()


async def until_load(conn, pred) -> None:
    """Wait for a Load report from `conn` satisfying `pred(load)`."""
    while conn.load is None or not pred(conn.load):
        conn.load_event.clear()
        await asyncio.wait_for(conn.load_event.wait(), 5)


@dataclass
class Running:
    proxy: Proxy
    port: int
    server: DrainingServer

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/stream"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def conn(self, replica_id: str):
        return next(c for c in self.proxy.pool.conns if c.id == replica_id)


@contextlib.asynccontextmanager
async def proxy_for(replicas: list[StubReplica], wait_ready: int | None = None, keys=KEYS, tracer=None,
                    tokenizer=None, **kw):
    """The proxy app under uvicorn on a pre-bound (already listening) socket (byte tokenizer unless given one)."""
    pool = kw.pop("pool", FAST_POOL)
    cfg = ProxyConfig(replicas=[r.url for r in replicas], port=0, tokenizer="bytes", pool=pool, **kw)
    proxy = Proxy(cfg, tokenizer or ByteTokenizer(), KeyStore(keys, salt_secret=SECRET, anonymous=cfg.allow_anonymous),
                  tracer=tracer)
    sock = bind("127.0.0.1", 0)
    ucfg = uvicorn_config(create_app(proxy), replace(cfg, log_level="warning"))
    server = DrainingServer(ucfg, proxy)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    try:
        n = len(replicas) if wait_ready is None else wait_ready
        if n:
            assert await proxy.pool.wait_ready(n, timeout=10), "replicas did not become ready"
        yield Running(proxy, sock.getsockname()[1], server)
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 15)
