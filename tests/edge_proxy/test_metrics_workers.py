"""The proxy's metrics with worker processes (`--workers 2`, a real `python -m edge_proxy`
over a replica stub): one scrape of either worker gives the whole proxy's figures, the
per-request ones (prometheus_client's multiprocess files) and the per-token ones (the hot
store's) alike; a worker that dies keeps its counts counted; the folder goes at exit."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import httpx
import pytest

from tests.prom import samples
from tests.replica.server import free_port

from conftest import SECRET, stubs, until_line

pytestmark = pytest.mark.anyio
PROMPTS = {"a": ["one", "three", "fifteen"], "b": ["seven", "twenty-two"]}  # per worker
MAX_TOKENS = 5


async def worker_client(port: int, taken: set[int]) -> tuple[httpx.AsyncClient, int]:
    """A client whose one keep-alive connection landed on a worker not in `taken`: (client, that worker's pid)."""
    for _ in range(200):
        h = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=30,
                              limits=httpx.Limits(max_connections=1), headers={"Authorization": "Bearer sk-t"})
        pid = (await h.get("/healthz")).json()["pid"]
        if pid not in taken:
            return h, pid
        await h.aclose()  # the kernel put this connection on a worker we have: try a new one
    raise AssertionError(f"no connection reached a worker other than {taken}")


async def test_one_scrape_of_either_worker_gives_the_whole_proxy(tmp_path):
    async with stubs("a", step_s=0.002) as reps:
        port = free_port()
        env = {**os.environ, "EDGECHAT_REPLICA_SECRET": SECRET, "EDGECHAT_API_KEYS": "sk-t=tenant",
               "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}  # the proxy makes its own folder inside
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "edge_proxy", "--replica", reps[0].url, "--port", str(port), "--tokenizer", "bytes",
            "--workers", "2", stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env=env)
        clients = []
        try:
            await until_line(proc, "ready at", n=2)
            a, pid_a = await worker_client(port, set())
            clients.append(a)
            b, _ = await worker_client(port, {pid_a})
            clients.append(b)
            for h, prompts in zip((a, b), PROMPTS.values()):
                for prompt in prompts:
                    r = await h.post("/v1/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS})
                    assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
            n = sum(len(p) for p in PROMPTS.values())
            want = {'edgechat_proxy_requests_total{outcome="length"}': n,
                    "edgechat_proxy_generation_tokens_total": n * MAX_TOKENS,
                    "edgechat_proxy_prompt_tokens_total": sum(len(p) for ps in PROMPTS.values() for p in ps),
                    "edgechat_proxy_ttft_seconds_count": n, "edgechat_proxy_e2e_seconds_count": n,
                    "edgechat_proxy_inflight": 0, "edgechat_proxy_replicas_ready": 1}
            scrapes = [samples((await h.get("/metrics")).text) for h in (a, b)]
            for m in scrapes:
                assert {k: m[k] for k in want} == want
                assert m["edgechat_proxy_itl_seconds_count"] == m['edgechat_proxy_itl_seconds_bucket{le="+Inf"}'] > 0
            assert scrapes[0]["edgechat_proxy_itl_seconds_count"] == scrapes[1]["edgechat_proxy_itl_seconds_count"]

            os.kill(pid_a, signal.SIGKILL)  # a worker dies: what it counted stays counted
            await a.aclose()
            clients.remove(a)
            m = samples((await b.get("/metrics")).text)
            assert {k: m[k] for k in want} == want
            assert m["edgechat_proxy_itl_seconds_count"] == scrapes[1]["edgechat_proxy_itl_seconds_count"]

            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.communicate(), 20)
            assert list(tmp_path.iterdir()) == []  # the workers' folder went with them
        finally:
            for h in clients:
                await h.aclose()
            if proc.returncode is None:
                proc.kill()
                await proc.communicate()
