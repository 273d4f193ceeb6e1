"""Chaos on real replicas (default model) behind a proxy: a replica frozen with SIGSTOP
mid-stream, and a replica whose engine process is SIGKILLed mid-stream (its API process
fails the stream with a typed error and restarts the engine), twice each, alternating
victims. Every stream ends with exactly the uninterrupted run's text, on the other
replica; the frozen replica is thawed and the restarted engine serves again.
(SIGKILL of a whole replica: test_real_replicas.py.)"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from edge_proxy.client import EdgeClient
from tests.edge_proxy.two_replicas import stack
from tests.replica.server import engine_pid

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
STORY = [{"role": "user", "content": "Write a long story about a brave little dragon."}]


def wait_replica_healthy(url: str, timeout: float = 240.0) -> None:
    t0 = time.monotonic()
    while httpx.get(url + "/healthz").status_code != 200:
        assert time.monotonic() - t0 < timeout, f"{url} did not come back"
        time.sleep(0.1)


def serving(reps) -> str:
    """The replica whose load report shows a request running (reports come every 0.5 s)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10:
        busy = [rid for rid, (rurl, _) in reps.items() if httpx.get(rurl + "/healthz").json().get("running")]
        if len(busy) == 1:
            return busy[0]
        time.sleep(0.02)
    raise AssertionError("no single replica reports the request running")


def engine_restarts(url: str) -> float:
    text = httpx.get(url + "/metrics", headers={"Authorization": "Bearer e2e-secret"}).text
    return float(next(ln for ln in text.splitlines() if ln.startswith("edgechat_replica_engine_restarts_total "))
                 .split()[1])


async def interrupted(url: str, reps, whole: str, how: str) -> tuple[str, object, str]:
    """The story again, its replica hit after 8 deltas; (text, done, victim id)."""
    async with await EdgeClient.connect(url) as c:
        req = await c.generate(messages=STORY, max_tokens=48, temperature=0)
        seen, victim = 0, None
        async for _ in req:
            seen += 1
            if seen == 8:
                victim = serving(reps)
                pid = reps[victim][1].pid
                if how == "freeze":
                    os.killpg(pid, signal.SIGSTOP)
                else:
                    os.kill(engine_pid(pid), signal.SIGKILL)
        return req.text, req.done, victim


def test_frozen_replicas_and_killed_engines_lose_nothing():
    with stack() as (url, reps):
        async def reference():
            async with await EdgeClient.connect(url) as c:
                return await c.complete(messages=STORY, max_tokens=48, temperature=0)
        whole, _ = asyncio.run(reference())
        engine_kills = {rid: 0 for rid in reps}
        for how in ("freeze", "engine", "freeze", "engine"):
            text, done, victim = asyncio.run(asyncio.wait_for(interrupted(url, reps, whole, how), 240))
            assert victim is not None and text == whole, how
            assert done.failovers == 1 and done.replica != victim, (how, done)
            rurl, proc = reps[victim]
            if how == "freeze":
                os.killpg(proc.pid, signal.SIGCONT)
            else:
                engine_kills[victim] += 1
            wait_replica_healthy(rurl)
            assert proc.poll() is None
        assert {rid: engine_restarts(r) for rid, (r, _) in reps.items()} == engine_kills
