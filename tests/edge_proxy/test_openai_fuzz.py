"""Seeded fuzz of the OpenAI HTTP front door (issue 11 asks one per protocol): thousands
of mutated valid bodies (wrong types, 2**31 / 2**63 / 2**64 / -1, NaN / Infinity,
huge strings, deep nesting, unknown fields, dropped fields) against a proxy over
replica stubs. Every one is answered within a bound with a complete result (JSON,
or SSE ending in [DONE]) or a typed 4xx in OpenAI's error shape, never a 5xx; the
proxy and the replicas stay up, and WebSocket streams running alongside (the
bystanders) are token-exact."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from edge_proxy.client import EdgeClient
from stub_replica.server import expected_tokens
from tests.edge_proxy.openai_bodies import BASES, MSG, check_answer, mutate
from wire import protocol as P

from conftest import KEYS, proxy_for, stubs

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]
SEED, BODIES, CONCURRENCY, BOUND_S = 1212, 3000, 24, 10.0


async def bystander(url: str, i: int, rounds: int) -> int:
    """Seeded streams that must stay token-exact while the fuzz runs."""
    done = 0
    async with await EdgeClient.connect(url, api_key="sk-bob") as c:
        for r in range(rounds):
            prompt = f"bystander {i} round {r}"
            text, d = await c.complete(prompt=prompt, max_tokens=12, seed=100 + i, temperature=0.9)
            sp = P.SamplingParams(max_tokens=12, temperature=0.9, seed=100 + i)
            assert text == bytes(expected_tokens(list(prompt.encode()), sp, 12)).decode() and d.finish_reason == "length"
            done += 1
    return done


async def test_fuzzed_bodies_get_results_or_typed_4xx_and_bystanders_stay_exact():
    rng = random.Random(SEED)
    bodies = [(path, mutate(rng, base)) for path, base in (rng.choice(BASES) for _ in range(BODIES))]
    outcomes: dict[str, int] = {}
    keys = KEYS + [{"key": "sk-fuzz", "tenant": "fuzz", "rate_per_s": 1e6, "burst": 1e6}]
    async with stubs("a", "b", step_s=0.002) as reps, proxy_for(reps, keys=keys) as p:
        async with httpx.AsyncClient(trust_env=False, headers={"Authorization": "Bearer sk-fuzz"},
                                     timeout=BOUND_S) as h:
            queue = list(enumerate(bodies))

            async def worker():
                while queue:
                    i, (path, body) = queue.pop()
                    try:
                        r = await h.post(p.http + path, content=body, headers={"content-type": "application/json"})
                    except httpx.TimeoutException:
                        raise AssertionError(f"body {i} not answered within {BOUND_S} s: {body[:300]!r}") from None
                    try:
                        kind = check_answer(r.status_code, r.headers.get("content-type", ""), r.content)
                    except (AssertionError, ValueError) as e:
                        raise AssertionError(f"body {i} {path} {body[:300]!r}: {e}") from None
                    outcomes[kind] = outcomes.get(kind, 0) + 1

            by = [asyncio.ensure_future(bystander(p.ws_url, i, 6)) for i in range(4)]
            await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
            assert await asyncio.gather(*by) == [6] * 4
            assert (await h.get(p.http + "/healthz")).status_code == 200
            r = await h.post(p.http + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 2})
            assert r.status_code == 200
        assert not p.proxy.streams and all(not c.streams for c in p.proxy.pool.conns)
        assert all(len(r.conns) == 1 for r in reps)  # the replicas' connections never dropped
    assert sum(outcomes.values()) == BODIES
    assert outcomes.get("json", 0) + outcomes.get("stream", 0) > BODIES // 10 and outcomes.get("400", 0) > BODIES // 3
