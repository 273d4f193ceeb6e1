"""`regions up` supervises (stub topology): replicas that die are restarted with backoff while
the proxies fail their streams over; a region left with no replica forwards to its peer; the
restarted replicas take traffic again; the stack stops only on a signal."""

import asyncio
import io
import os
import re
import signal

import httpx
import pytest

from edge_proxy.client import EdgeClient
from regions.launch import Stack
from edge_proxy.select import ws_url
from regions.topology import parse

from tests.regions.ports import free_block, stub_topology
from tests.regions.processes import alive, cli_up

pytestmark = pytest.mark.anyio
HI = [{"role": "user", "content": "tell me a long story"}]


async def replicas_ready(url: str, n: int, timeout: float = 30.0) -> None:
    async with httpx.AsyncClient(trust_env=False) as h:
        for _ in range(int(timeout / 0.05)):  # another process's state: poll its /healthz
            r = await h.get(url + "/healthz")
            if r.json().get("replicas_ready") == n:
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"{url} never had {n} replicas ready")


async def test_a_region_losing_both_replicas_forwards_then_takes_traffic_back(tmp_path):
    topo = parse(stub_topology(free_block(12)), "stub.toml")
    out = io.StringIO()
    stack = Stack(topo, log_dir=tmp_path, out=out, relays=False)
    await stack.start()
    try:
        sup = stack.supervise(backoff_min_s=2.0)  # a window long enough to see the forwarding
        eu = ws_url(stack.proxy_url("eu"))
        async with await EdgeClient.connect(eu) as c:
            want, first = await c.complete(messages=HI, max_tokens=150, temperature=0)
            assert first.region == "eu"
            req = await c.generate(messages=HI, max_tokens=150, temperature=0)
            async for _ in req:  # in flight on an eu replica: both die now
                victims = [r for r in stack.replicas if r.region == "eu"]
                old = [r.proc.pid for r in victims]
                for r in victims:
                    os.killpg(r.proc.pid, signal.SIGKILL)
                break
            await replicas_ready(stack.proxy_url("eu"), 0)
            _, forwarded = await c.complete(messages=[{"role": "user", "content": "hi"}], max_tokens=4)
            assert forwarded.region == "us" and forwarded.forwarded_from == "eu"
            text, done = await req.result()  # parked, then resumed on a restarted eu replica
            assert text == want and done.failovers == 1 and done.region == "eu"
            await replicas_ready(stack.proxy_url("eu"), 2)
            assert [r.proc.pid for r in victims] != old and all(r.proc.returncode is None for r in victims)
            together = await asyncio.gather(*(c.complete(prompt=f"{i} " * 20, max_tokens=20) for i in range(8)))
            assert {d.replica for _, d in together} == {"eu-0", "eu-1"}  # both back in rotation
        assert sup.restarts == {"eu-0": 1, "eu-1": 1}
        lines = out.getvalue()
        assert "replica eu-0 exited with code -9; restarting it in 2 s" in lines
        assert re.search(r"replica eu-1 restarted: ready in [\d.]+ s \(pid \d+, restart 1\)", lines)
        pids = [c.proc.pid for c in stack.replicas + stack.proxies]
    finally:
        await stack.stop()
    assert not any(alive(p) for p in pids)


def test_cli_restarts_a_dead_replica_and_stops_only_on_a_signal(tmp_path):
    with cli_up(tmp_path) as (proc, _, pids):
        os.killpg(pids[0], signal.SIGKILL)  # a replica crashes
        lines = []
        for line in proc.stdout:
            lines.append(line.rstrip())
            if "restarted: ready" in line:
                break
        assert any("exited with code -9; restarting" in ln for ln in lines), lines
        new_pid = int(re.search(r"\(pid (\d+)", lines[-1]).group(1))
        assert proc.poll() is None and alive(new_pid)
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0 and "regions: stopped" in rest
        assert not any(alive(p) for p in pids[1:] + [new_pid])
