"""Failover with exact resume: the client sees one uninterrupted stream."""

import asyncio
from dataclasses import replace

import pytest

from edge_proxy import protocol as pp
from edge_proxy.client import EdgeClient, EdgeError

from conftest import FAST_POOL, proxy_for, stubs

pytestmark = pytest.mark.anyio
HI = [{"role": "user", "content": "tell me a story"}]


async def reference(p, **kw) -> str:
    async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
        text, done = await c.complete(messages=HI, **kw)
        assert done.failovers == 0
        return text


def serving(reps, n_before: dict):
    """The stub that received the request just sent."""
    return next(r for r in reps if len(r.generates) > n_before.get(r.cfg.replica_id, 0))


async def crash_after(reps, c, k: int, **kw):
    """Start a request, crash its replica once `k` tokens were received, return (text, done, victim)."""
    before = {r.cfg.replica_id: len(r.generates) for r in reps}
    req = await c.generate(messages=HI, **kw)
    got = 0
    victim = None
    async for delta in req:
        got += len(delta)
        if victim is None and got >= k:
            victim = serving(reps, before)
            await victim.crash()
    return req.text, req.done, victim


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, seed=1234)],
                         ids=["greedy", "seeded"])
async def test_crash_mid_stream_resumes_exactly(sampling):
    async with stubs("a", "b") as reps, proxy_for(reps) as p:
        want = await reference(p, max_tokens=40, **sampling)
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            text, done, victim = await crash_after(reps, c, 10, max_tokens=40, **sampling)
        assert text == want
        assert done.failovers == 1 and done.replica != victim.cfg.replica_id
        assert done.usage.completion_tokens == 40 and done.finish_reason == "length"
        survivor = next(r for r in reps if r is not victim)
        resumed = survivor.generates[-1]
        assert 10 <= len(resumed.resume_ids) < 40 and resumed.sampling.seed == victim.generates[-1].sampling.seed
        assert p.proxy.metrics.failovers.get("disconnect") == 1
        assert p.proxy.metrics.routing.get("failover") == 1


async def test_unseeded_sampling_resumes_exactly():
    # The proxy fixes a seed at arrival; the resumed replica continues that seed's stream
    # (the stub checks resume_ids against it and errors on any mismatch).
    async with stubs("a", "b") as reps, proxy_for(reps) as p:
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            text, done, victim = await crash_after(reps, c, 5, max_tokens=30, temperature=1.0)
        assert done.failovers == 1 and len(text) == 30


async def test_stalled_replica_is_abandoned():
    async with stubs("a", "b") as reps, proxy_for(reps) as p:
        want = await reference(p, max_tokens=30, temperature=0)
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            before = {r.cfg.replica_id: len(r.generates) for r in reps}
            req = await c.generate(messages=HI, max_tokens=30, temperature=0)
            got = 0
            async for delta in req:
                got += len(delta)
                if got == 5:
                    serving(reps, before).lag = True  # stuck engine: socket up, nothing sent
            assert req.text == want and req.done.failovers == 1
        assert p.proxy.metrics.failovers.get("stall") == 1


async def test_a_frozen_idle_replica_is_dropped_by_keepalive():
    pool = replace(FAST_POOL, ping_interval_s=0.1, ping_timeout_s=0.2, healthz_interval_s=0)
    async with stubs("a", "b") as reps, proxy_for(reps, pool=pool) as p:
        reps[0].freeze()
        assert await p.proxy.pool.wait_for(lambda: [c.id for c in p.proxy.pool.ready()] == ["b"], timeout=5)
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            _, d = await c.complete(prompt="still here?", max_tokens=2)
            assert d.replica == "b"


async def test_healthz_failure_moves_streams_and_stops_routing():
    async with stubs("a", "b") as reps, proxy_for(reps) as p:
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            before = {r.cfg.replica_id: len(r.generates) for r in reps}
            req = await c.generate(messages=HI, max_tokens=60, temperature=0)
            async for _ in req:
                sick = serving(reps, before)
                sick.healthy = False
                break
            text, done = await req.result()
            assert done.failovers == 1 and done.replica != sick.cfg.replica_id and len(text) == 60
            for i in range(4):
                _, d = await c.complete(prompt=f"p{i}", max_tokens=2)
                assert d.replica != sick.cfg.replica_id
        assert p.proxy.metrics.failovers.get("healthz") == 1


async def test_no_replica_left_is_an_error_after_the_wait():
    async with stubs("a") as reps, proxy_for(reps, failover_wait_s=0.3) as p:
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            req = await c.generate(messages=HI, max_tokens=100)
            with pytest.raises(EdgeError) as e:
                async for _ in req:
                    if reps[0].conns:
                        await reps[0].crash()
            assert e.value.code == pp.UNAVAILABLE
        assert not p.proxy.streams


async def test_a_stream_waits_for_its_replica_to_come_back():
    async with stubs("a") as reps, proxy_for(reps, failover_wait_s=10) as p:
        stub = reps[0]
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            want, _ = await c.complete(messages=HI, max_tokens=20, temperature=0)
            req = await c.generate(messages=HI, max_tokens=20, temperature=0)
            restarted = None
            async for _ in req:
                if restarted is None:
                    port = stub.port
                    await stub.crash()
                    restarted = await type(stub)(stub.cfg).start(port=port)
            try:
                assert req.text == want and req.done.failovers == 1
            finally:
                await restarted.stop()


async def test_n_samples_resume_each_exactly_over_openai_sse():
    """n = 3 streamed over SSE; the replica dies mid-stream: each sample resumes with its own
    tokens on the survivor (Generate.sample_ids / sample_resume) and every choice's text is
    its seed's uninterrupted stream."""
    import json

    import httpx

    from stub_replica.server import expected_tokens

    body = {"messages": HI, "n": 3, "seed": 77, "temperature": 0.9, "max_tokens": 30, "stream": True,
            "stream_options": {"include_usage": True}}
    async with stubs("a", "b") as reps, proxy_for(reps) as p:
        texts, finish, got, victim = ["", "", ""], {}, 0, None
        async with httpx.AsyncClient(trust_env=False, headers={"Authorization": "Bearer sk-alice"}) as h:
            async with h.stream("POST", p.http + "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    for ch in chunk["choices"]:
                        texts[ch["index"]] += ch["delta"].get("content") or ""
                        got += len(ch["delta"].get("content") or "")
                        if ch["finish_reason"]:
                            finish[ch["index"]] = ch["finish_reason"]
                    if chunk["choices"] == []:
                        usage = chunk["usage"]
                    if victim is None and got >= 20:
                        victim = next(rep for rep in reps if rep.generates)
                        await victim.crash()
        first = victim.generates[0]
        want = [bytes(expected_tokens(first.prompt_ids, first.sampling, 30, index=i)).decode() for i in range(3)]
        assert texts == want and finish == {0: "length", 1: "length", 2: "length"}
        assert usage["completion_tokens"] == 90
        resumed = next(rep for rep in reps if rep is not victim).generates[-1]
        assert resumed.sample_ids == [0, 1, 2] and all(5 <= len(ids) < 30 for ids in resumed.sample_resume)
        assert resumed.sampling.n == 3 and resumed.sampling.seed == 77


async def test_health_probes_that_failed_before_a_reconnect_do_not_count_after_it():
    """A replica restarted on its port fails /healthz while it is down; once it says Hello
    again those failures are behind it, so one slow probe right after the reconnect does not
    take it (and the streams just moved onto it) away: a CI run's chaos test lost a stream that
    way, blamed on two replicas as a poison pill."""
    pool = replace(FAST_POOL, healthz_failures=3, healthz_interval_s=0)  # probes by hand
    async with stubs("a", "b") as reps, proxy_for(reps, pool=pool) as p:
        conn, port = p.conn("a"), reps[0].port
        hello_before = conn.connected_at
        await reps[0].crash()
        for _ in range(2):  # down: two failed probes, one short of the limit
            await conn.healthz(p.proxy.pool._http)
        assert conn.healthy
        await reps[0].start(port=port)
        assert await p.proxy.pool.wait_for(lambda: conn.connected and conn.connected_at > hello_before, timeout=10)
        reps[0].healthy = False  # one failed probe after the reconnect
        await conn.healthz(p.proxy.pool._http)
        assert conn.connected and conn.healthy
        for _ in range(2):  # ... but three in a row still take it out
            await conn.healthz(p.proxy.pool._http)
        assert not conn.healthy and not conn.connected


async def test_a_replica_removed_on_purpose_does_not_count_against_its_requests():
    """A rolling restart takes replicas out one after another: a request moved off one that
    left discovery and then losing the next to a crash is not a poison pill (a request is failed
    after two replicas *failed* under it); it resumes on a third and ends exactly."""
    async with stubs("a", "b", "c", step_s=0.02) as reps, proxy_for(reps) as p, \
            await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
        req = await c.generate(prompt="rolling", max_tokens=60, temperature=0.0)
        deltas = aiter(req)
        await anext(deltas)  # streaming: it is on a replica
        (first,) = [s for s in p.proxy.streams if s.cid == req.id]
        removed = first.conn.id
        p.proxy.pool.remove(first.conn.url)  # left DNS: its streams move
        while first.conn is None or first.conn.id == removed:
            await anext(deltas)  # tokens keep coming from the next replica
        await next(r for r in reps if r.cfg.replica_id == first.conn.id).crash()  # then that one dies
        text, done = await req.result()
        assert done.failovers == 2 and done.replica not in (removed, "") and len(text) == 60
