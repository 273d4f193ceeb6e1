"""Seeded fuzz of the OpenAI HTTP front door (issue 11 asks one per protocol): thousands
of mutated valid bodies (wrong types, 2**31 / 2**63 / 2**64 / -1, NaN / Infinity,
huge strings, deep nesting, unknown fields, dropped fields) against a proxy over
replica stubs. Every one is answered within a bound with a complete result (JSON,
or SSE ending in [DONE]) or a typed 4xx in OpenAI's error shape, never a 5xx; the
proxy and the replicas stay up, and WebSocket streams running alongside (the
bystanders) are token-exact."""

from __future__ import annotations

import asyncio
import copy
import json
import random

import httpx
import pytest

from edge_proxy.client import EdgeClient
from stub_replica.server import expected_tokens
from wire import protocol as rp

from conftest import KEYS, proxy_for, stubs
from jsonpaths import paths, set_at

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]
SEED, BODIES, CONCURRENCY, BOUND_S = 1212, 3000, 24, 10.0
MSG = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]
BASES = [
    ("/v1/chat/completions", {"model": "stub", "messages": MSG, "max_tokens": 3, "temperature": 0}),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 2, "stream": True, "n": 2, "seed": 5,
                              "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hey"}]}],
                              "max_completion_tokens": 3, "presence_penalty": 0.5, "frequency_penalty": 0.5,
                              "logit_bias": {"97": 3.0}, "stop": ["zz"], "top_p": 0.9, "user": "u1"}),
    ("/v1/completions", {"prompt": "once upon", "max_tokens": 3, "echo": True, "logprobs": 1}),
    ("/v1/completions", {"prompt": ["ab", "cd"], "max_tokens": 2, "n": 2, "stream": True, "temperature": 0.5}),
    ("/v1/completions", {"prompt": [[104, 105], [106]], "max_tokens": 2, "min_tokens": 1, "ignore_eos": True,
                         "stop_token_ids": [0], "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1}),
    ("/infill", {"input_prefix": "def f(", "input_suffix": ")", "n_predict": 3}),
]
EXTREMES = [2**31, 2**63, 2**64, -1, 0, -(2**63) - 1, 1.5, "x", "", True, None, [], {}, [[]], {"a": {"b": [1]}},
            "a" * 70000, "\ud7ff" * 3000]
RAW = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "[" * 6000 + "]" * 6000, "01", "tru", '"\\ud800"']


BOUNDING = {"max_tokens", "max_completion_tokens", "n_predict"}  # never dropped nor nulled: the default is long


def mutate(rng: random.Random, body: dict) -> bytes:
    """None to three mutations (an unmutated body keeps valid traffic flowing);
    RAW values are spliced into the JSON text."""
    body = copy.deepcopy(body)
    raw = None
    for _ in range(rng.choice([0, 1, 1, 1, 2, 2, 3])):
        where = [p for p in paths(body) if p and p[-1] not in BOUNDING]
        kind = rng.random()
        if kind < 0.1:
            body[rng.choice(["frobnicate", "tools", "response_format", "functions", "suffix", "audio", "best_of",
                             "guided_json", "grammar"])] = copy.deepcopy(rng.choice(EXTREMES[:9] + [{"type": "json_object"}]))
        elif kind < 0.2 and where:
            path = rng.choice(where)
            target = body
            for p in path[:-1]:
                target = target[p]
            del target[path[-1]]
        elif kind < 0.35 and where:
            raw = (rng.choice(where), rng.choice(RAW))
            set_at(body, raw[0], "\x00RAW\x00")
        elif where:
            set_at(body, rng.choice(where), copy.deepcopy(rng.choice(EXTREMES)))
        bounded = [k for k in BOUNDING if k in body]
        if bounded and rng.random() < 0.15:  # the bounding fields get the extremes too, but never null
            body[bounded[0]] = rng.choice([e for e in EXTREMES if e is not None])
    text = json.dumps(body)
    if raw is not None:
        text = text.replace('"\\u0000RAW\\u0000"', raw[1], 1)
    return text.encode()


def check_answer(status: int, ctype: str, data: bytes) -> str:
    if status == 200:
        if ctype.startswith("text/event-stream"):
            events = [b for b in data.decode().split("\n\n") if b]
            assert all(e.startswith("data: ") for e in events)
            if events and events[-1] != "data: [DONE]":  # /infill: the last event says stop
                assert json.loads(events[-1][6:])["stop"] is True
            for e in events:
                if e != "data: [DONE]":
                    assert "error" not in json.loads(e[6:]), e
            return "stream"
        json.loads(data)
        return "json"
    assert 400 <= status < 500, (status, data[:300])
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == ("rate_limit_error" if status == 429 else "invalid_request_error"), err
    return str(status)


async def bystander(url: str, i: int, rounds: int) -> int:
    """Seeded streams that must stay token-exact while the fuzz runs."""
    done = 0
    async with await EdgeClient.connect(url, api_key="sk-bob") as c:
        for r in range(rounds):
            prompt = f"bystander {i} round {r}"
            text, d = await c.complete(prompt=prompt, max_tokens=12, seed=100 + i, temperature=0.9)
            sp = rp.SamplingParams(max_tokens=12, temperature=0.9, seed=100 + i)
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
