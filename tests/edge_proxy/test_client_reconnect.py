"""The reference client (`edge_proxy/client.py`) against real proxies over a real default-model
replica: the proxy is SIGKILLed mid-stream and restarted on its port, or SIGTERMed (drain cut
short) with a second region's proxy beside it. Every open stream is resumed on the new
connection from the ids it had, and ends with text identical to an uninterrupted run of the
same requests (same seeds); the nearest region is picked again on reconnect; generate() after
a drain works; a client that cannot reconnect fails with a typed EdgeError."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from edge_proxy import protocol as pp
from edge_proxy.client import Backoff, EdgeClient, EdgeError
from tests.edge_proxy.live import start_proxy
from tests.replica.server import free_port, stop_group

pytestmark = [pytest.mark.anyio, pytest.mark.slow, pytest.mark.timeout(300)]
PROMPTS = ["Tell me about the moon.", "List some fruits.", "Why is the sky blue?"]
FAST = Backoff(initial_s=0.05, max_s=0.5, timeout_s=60.0)
# No stream may end (EOS) before the cut: each runs to max_tokens, far longer than the drain.
GEN = {"max_tokens": 64, "temperature": 0.8, "ignore_eos": True}


async def proxy_on(port: int, replica: str, *args: str, env: dict | None = None):
    return await asyncio.to_thread(lambda: start_proxy(port, [replica], *args, env=env))


async def start_streams(c: EdgeClient, n_tokens: int = 3):
    reqs = [await c.generate(messages=[{"role": "user", "content": p}], **GEN)
            for p in PROMPTS]
    while min(r.tokens for r in reqs) < n_tokens:  # every stream is under way
        gets = [asyncio.ensure_future(r.q.get()) for r in reqs if r.tokens < n_tokens]
        done, pending = await asyncio.wait(gets, return_when=asyncio.FIRST_COMPLETED, timeout=30)
        for t in pending:
            t.cancel()  # (a cancelled get takes nothing off the queue)
        assert done, "no stream made progress in 30 s"
        assert all(type(t.result()) is pp.Delta for t in done)
    return reqs


async def reference(url: str, reqs) -> list[str]:
    """The same requests, same seeds, run uninterrupted."""
    async with await EdgeClient.connect(url, reconnect=False) as c:
        out = []
        for p, r in zip(PROMPTS, reqs):
            text, _ = await c.complete(messages=[{"role": "user", "content": p}], **GEN, seed=r.gen.sampling.seed)
            out.append(text)
        return out


async def finish(reqs) -> list[str]:
    return [(await r.result())[0] for r in reqs]


async def test_sigkill_and_restart_resumes_exactly(default_replica):
    port = free_port()
    url = f"ws://127.0.0.1:{port}/v1/stream"
    proc = await proxy_on(port, default_replica, "--allow-anonymous")
    try:
        async with await EdgeClient.connect(url, backoff=FAST) as c:
            reqs = await start_streams(c)
            os.killpg(proc.pid, signal.SIGKILL)
            await asyncio.to_thread(proc.wait)
            had = [r.tokens for r in reqs]
            proc = await proxy_on(port, default_replica, "--allow-anonymous")
            texts = await asyncio.wait_for(finish(reqs), 120)
            assert c.reconnects == 1 and all(r.resumes == 1 for r in reqs)
            assert all(r.done.usage.completion_tokens == len(r.ids) > h for r, h in zip(reqs, had))
            # the client goes on (ignore_eos: a sampled answer may end within 4 tokens, as one did in a CI run)
            after = await c.complete(prompt="The capital of France is", max_tokens=4, ignore_eos=True)
            assert after[1].finish_reason == "length"
        assert texts == await reference(url, reqs)
    finally:
        stop_group(proc, timeout=10)


async def test_sigterm_moves_to_the_next_region_and_resumes_exactly(default_replica):
    ports = {"a": free_port(), "b": free_port()}
    procs = {r: await proxy_on(p, default_replica, "--allow-anonymous", "--region", r, "--drain-timeout", "0.1")
             for r, p in ports.items()}
    try:
        regions = {r: f"http://127.0.0.1:{p}" for r, p in ports.items()}
        c, probe = await EdgeClient.connect_nearest(regions, backoff=FAST)
        async with c:
            first = probe.region
            other = "b" if first == "a" else "a"
            reqs = await start_streams(c)
            os.killpg(procs[first].pid, signal.SIGTERM)  # drains for 0.1 s, cuts the rest (shutting_down), exits
            texts = await asyncio.wait_for(finish(reqs), 120)
            await asyncio.to_thread(procs[first].wait, 30)
            assert c.region == other and c.reconnects == 1
            assert all(r.done.region == other and r.resumes == 1 for r in reqs)
            _, done = await c.complete(prompt="One, two,", max_tokens=3)  # after the drain: no transport error
            assert done.region == other
        assert texts == await reference(f"ws://127.0.0.1:{ports[other]}/v1/stream", reqs)
    finally:
        for p in procs.values():
            stop_group(p, timeout=10)


async def test_typed_errors_when_nothing_answers(default_replica):
    port = free_port()
    with pytest.raises(EdgeError) as e:
        await EdgeClient.connect(f"ws://127.0.0.1:{port}/v1/stream")
    assert e.value.code == "unavailable"
    proc = await proxy_on(port, default_replica, env={"EDGECHAT_API_KEYS": "sk-x=t"})  # keys required, none given
    try:
        with pytest.raises(EdgeError) as e:
            await EdgeClient.connect(f"ws://127.0.0.1:{port}/v1/stream")
        assert e.value.code == "unauthorized"
    finally:
        stop_group(proc, timeout=10)
    proc = await proxy_on(port, default_replica, "--allow-anonymous")
    try:
        c = await EdgeClient.connect(f"ws://127.0.0.1:{port}/v1/stream",
                                     backoff=Backoff(initial_s=0.05, max_s=0.1, timeout_s=1.0))
        req = await c.generate(prompt="Once upon a time", max_tokens=2000, temperature=0.8)
        await req.q.get()
        os.killpg(proc.pid, signal.SIGKILL)  # and nothing comes back
        with pytest.raises(EdgeError) as e:
            await asyncio.wait_for(req.result(), 30)
        assert e.value.code == "unavailable" and "could not reconnect" in e.value.message
        await c.close()
    finally:
        stop_group(proc, timeout=10)
