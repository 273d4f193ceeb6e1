"""Real servers on free loopback ports: replica stubs and the proxy (uvicorn) in the test's loop;
helpers the proxy tests share (a stub's expected text, a proxy process's log lines), and the
`openai` SDK clients of a module's real stack (`sdk`)."""

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
from stub_replica.server import StubConfig, StubReplica, expected_tokens
from wire import protocol as P

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


def want(prompt: str, n: int) -> str:
    """The stub's greedy text for a raw prompt under the byte tokenizer."""
    return "".join(map(chr, expected_tokens(list(prompt.encode()), P.SamplingParams(temperature=0.0), n)))


async def until_load(conn, pred) -> None:
    """Wait for a Load report from `conn` satisfying `pred(load)`."""
    while conn.load is None or not pred(conn.load):
        conn.load_event.clear()
        await asyncio.wait_for(conn.load_event.wait(), 5)


async def until_line(proc, needle: str, n: int = 1) -> None:
    """Read a proxy process's stderr (an asyncio subprocess) until `n` lines containing `needle` went by."""
    seen = 0
    while seen < n:
        line = await asyncio.wait_for(proc.stderr.readline(), 20)
        assert line, f"proxy exited before logging {needle!r}"
        seen += needle in line.decode()


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


@contextlib.asynccontextmanager
async def two_proxies(replicas: list[StubReplica], **kw):
    """Two proxies of one region over the same replicas (`proxy_for` twice, the same config)."""
    async with proxy_for(replicas, **kw) as p1, proxy_for(replicas, **kw) as p2:
        yield p1, p2


# -- the official `openai` SDK over a module's real stack (test_openai_sdk, test_structured_sdk) --
@pytest.fixture(scope="module")
def sdk_keys() -> dict:
    """The api key of `sdk` clients by stack key; "EMPTY" for any other (a module overrides it)."""
    return {}


@pytest.fixture(scope="module")
def sdk(stack, sdk_keys):
    """sdk(where): one `openai` client of stack[where] (the module's `stack` fixture: base
    URLs by key) for the module, as a user sets it up; closed after the module."""
    import openai

    made: dict[str, openai.OpenAI] = {}

    def client(where: str) -> openai.OpenAI:
        if where not in made:
            made[where] = openai.OpenAI(base_url=stack[where] + "/v1", api_key=sdk_keys.get(where, "EMPTY"),
                                        max_retries=0, timeout=120)
        return made[where]
    yield client
    for c in made.values():
        c.close()
