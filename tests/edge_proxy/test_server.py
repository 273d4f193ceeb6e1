"""The CLI as a real process: graceful SIGTERM drain, and workers sharing a port."""

import asyncio
import os
import signal
import sys

import httpx
import pytest

from edge_proxy.client import EdgeClient
from tests.replica.server import free_port

from conftest import SECRET, stubs, until_line

pytestmark = pytest.mark.anyio


async def start_proxy(replicas, port: int, *extra: str):
    env = {**os.environ, "EDGECHAT_REPLICA_SECRET": SECRET, "EDGECHAT_API_KEYS": "sk-t=tenant"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "edge_proxy", *[a for r in replicas for a in ("--replica", r.url)],
        "--port", str(port), "--tokenizer", "bytes", "--healthz-interval", "0.2", *extra,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env=env)
    return proc


async def test_sigterm_drains_open_streams_then_exits():
    async with stubs("a", step_s=0.01) as reps:
        port = free_port()
        proc = await start_proxy(reps, port)
        try:
            await until_line(proc, "ready at")
            async with await EdgeClient.connect(f"ws://127.0.0.1:{port}/v1/stream", api_key="sk-t") as c:
                req = await c.generate(prompt="drain me", max_tokens=100, temperature=0)
                async for _ in req:
                    break
                proc.send_signal(signal.SIGTERM)
                await until_line(proc, "draining")
                with pytest.raises(OSError):  # no longer accepting
                    await asyncio.open_connection("127.0.0.1", port)
                assert req.done is None  # ... while the open stream goes on
                text, done = await req.result()
                assert done.finish_reason == "length" and len(text) == 100
            await asyncio.wait_for(proc.communicate(), 20)  # reads stderr to EOF, then reaps
            assert proc.returncode == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.communicate()


async def test_workers_share_the_port():
    async with stubs("a") as reps:
        port = free_port()
        proc = await start_proxy(reps, port, "--workers", "2")
        try:
            await until_line(proc, "ready at", n=2)
            pids = set()
            for _ in range(64):
                async with httpx.AsyncClient(trust_env=False) as h:  # a new connection each time
                    pids.add((await h.get(f"http://127.0.0.1:{port}/healthz")).json()["pid"])
                if len(pids) == 2:
                    break
            assert len(pids) == 2 and proc.pid not in pids
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.communicate(), 20)  # reads stderr to EOF, then reaps
            assert proc.returncode == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.communicate()


async def test_streams_cut_at_the_drain_timeout_get_an_error_before_the_close():
    from edge_proxy.client import EdgeError

    async with stubs("a", step_s=0.01) as reps:
        port = free_port()
        proc = await start_proxy(reps, port, "--drain-timeout", "0.3")
        try:
            await until_line(proc, "ready at")
            # reconnect=False: the frames this proxy sends, not the resume a reconnecting client would do
            async with await EdgeClient.connect(f"ws://127.0.0.1:{port}/v1/stream", api_key="sk-t",
                                                reconnect=False) as c:
                reqs = [await c.generate(prompt=f"long {i}", max_tokens=2000, temperature=0) for i in range(3)]
                for req in reqs:  # all three admitted and streaming (one still being admitted is refused instead)
                    async for _ in req:
                        break
                proc.send_signal(signal.SIGTERM)
                for req in reqs:
                    with pytest.raises(EdgeError) as e:
                        await req.result()
                    assert e.value.code == "shutting_down" and "drain timeout" in e.value.message
            await asyncio.wait_for(proc.communicate(), 20)
            assert proc.returncode == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.communicate()
        await reps[0].until_idle()  # and the replica's work stopped
