"""A region in the test's event loop: replica stubs and a proxy (uvicorn) on free ports."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, replace

from edge_proxy.app import create_app
from edge_proxy.auth import KeyStore
from edge_proxy.config import ProxyConfig
from edge_proxy.core import Proxy
from edge_proxy.pool import PoolConfig
from edge_proxy.prompt import ByteTokenizer
from edge_proxy.server import DrainingServer, bind, uvicorn_config
from stub_replica.server import StubConfig, StubReplica

SECRET = "test-secret"
POOL = PoolConfig(secret=SECRET, ping_interval_s=0.5, ping_timeout_s=1.0, stall_timeout_s=1.0,
                  healthz_interval_s=0.1, healthz_failures=2, backoff_min_s=0.02, backoff_max_s=0.2)


@dataclass
class Region:
    proxy: Proxy
    port: int
    stubs: list[StubReplica]

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/stream"


@contextlib.asynccontextmanager
async def region(name: str, n_stubs: int = 1, step_s: float = 0.005, router=None, **proxy_kw):
    stubs = [await StubReplica(StubConfig(replica_id=f"{name}-{i}", secret=SECRET, step_s=step_s)).start()
             for i in range(n_stubs)]
    cfg = ProxyConfig(replicas=[s.url for s in stubs], port=0, region=name, tokenizer="bytes", pool=POOL,
                      allow_anonymous=True, **proxy_kw)
    proxy = Proxy(cfg, ByteTokenizer(), KeyStore([], salt_secret=SECRET, anonymous=True))
    if router is not None:
        proxy.router = router
    sock = bind("127.0.0.1", 0)
    server = DrainingServer(uvicorn_config(create_app(proxy), replace(cfg, log_level="warning")), proxy)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    try:
        assert await proxy.pool.wait_ready(n_stubs, timeout=10), "stubs did not become ready"
        yield Region(proxy, sock.getsockname()[1], stubs)
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 15)
        for s in stubs:
            await s.stop()
