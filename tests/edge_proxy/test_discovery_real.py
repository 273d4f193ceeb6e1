"""Discovery on the default model: two real replicas behind SRV records (the proxy a separate
process with `--replicas-dns`); the replica serving a stream leaves DNS mid-stream, its process
still running: a planned removal, so the stream moves to the other replica with its KV (pulled from
the one leaving, which still serves it: edge_proxy.pool, edge_proxy.handoff), the client's text
equals the uninterrupted run's, and the successor, which never saw the prompt, serves from cache
every full block of what was computed before the move."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys

import httpx
import pytest

from edge_proxy.client import EdgeClient
from regions.dns_zone import DnsZone
from tests.replica.server import free_port, replica_server

pytestmark = [pytest.mark.anyio, pytest.mark.slow, pytest.mark.timeout(400)]
SECRET = {"EDGECHAT_REPLICA_SECRET": "dns-e2e-secret"}
BLOCK = 16  # the replicas' KV block size
SRV = "_ws._tcp.edgechat-replica.e2e.test"
STORY = [{"role": "user", "content": "Write a long story about a brave little dragon."}]
# Long enough that the stream outlives a DNS re-resolution (0.1 s) on an engine at ~5 ms a token.
GEN = {"max_tokens": 256, "temperature": 0, "ignore_eos": True}


def listing(ports: dict[str, int]) -> list[tuple[str, int]]:
    return [(f"{rid.lower()}.e2e.test", port) for rid, port in sorted(ports.items())]


async def serving(http: httpx.AsyncClient, metrics_url: str) -> str:
    """The replica with a request in flight, from the proxy's per-replica load gauge."""
    text = (await http.get(metrics_url)).text
    busy = [rid for rid, v in re.findall(r'edgechat_proxy_replica_load\{replica="([^"]+)"\} (\S+)', text)
            if float(v) >= 1]
    assert len(busy) == 1, text
    return busy[0]


async def test_a_real_replica_leaving_dns_mid_stream_moves_with_its_kv():
    with contextlib.ExitStack() as es:
        ports, procs = {}, {}
        for rid in ("A", "B"):
            url, procs[rid] = es.enter_context(replica_server("--replica-id", rid, "--kv-memory-gb", "0.25",
                                                              env=SECRET))
            ports[rid] = int(url.rsplit(":", 1)[1])
        zone = await DnsZone().start("127.0.0.1")
        for rid in ports:
            zone.set(f"{rid.lower()}.e2e.test", ["127.0.0.1"])
        zone.set_srv(SRV, listing(ports))
        port = free_port()
        proxy = subprocess.Popen([sys.executable, "-m", "edge_proxy", "--port", str(port), "--allow-anonymous",
                                  "--replicas-dns", SRV, "--dns-server", zone.server, "--dns-interval", "0.1",
                                  "--log-level", "warning"], env={**os.environ, **SECRET}, start_new_session=True)
        try:
            async with httpx.AsyncClient(trust_env=False, timeout=5) as http:
                for _ in range(600):  # the proxy process resolving and connecting both
                    with contextlib.suppress(httpx.HTTPError):
                        r = await http.get(f"http://127.0.0.1:{port}/healthz")
                        if r.status_code == 200 and r.json()["replicas_ready"] == 2:
                            break
                    await asyncio.sleep(0.1)
                else:
                    raise AssertionError("the proxy never had both replicas")
                async with await EdgeClient.connect(f"ws://127.0.0.1:{port}/v1/stream") as c:
                    whole, _ = await c.complete(messages=STORY, **GEN)
                    req = await c.generate(messages=STORY, **GEN)
                    seen, leaving, at = 0, None, 0
                    async for _ in req:
                        seen += 1
                        if seen == 16:  # past the prompt's last block (40 tokens): a generated block computed
                            leaving = await serving(http, f"http://127.0.0.1:{port}/metrics")
                            zone.set_srv(SRV, listing({k: v for k, v in ports.items() if k != leaving}))
                            at = req.tokens
                    metrics = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
            assert req.text == whole
            assert req.done.failovers == 1 and req.done.replica not in (leaving, None)
            assert 'edgechat_proxy_failovers_total{cause="drain"} 1.0' in metrics  # handed on, not cut
            before = (req.done.usage.prompt_tokens + at - 1) // BLOCK * BLOCK  # computed before it left
            assert before > req.done.usage.prompt_tokens // BLOCK * BLOCK
            assert req.done.usage.cached_tokens >= before, (req.done.usage.cached_tokens, before)
            assert procs[leaving].poll() is None  # it left the Service, it did not die
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proxy.pid, signal.SIGTERM)
            proxy.wait(30)
            await zone.stop()
