"""Issue 11: a seeded fuzz test of the public WebSocket protocol and 1,000 random client
disconnects, against a real proxy over stub replicas. Reproduce a run with
`EDGECHAT_FUZZ_SEED=<seed> pytest tests/edge_proxy/test_fuzz.py`."""

import asyncio
import copy
import json
import os
import random
import time

import httpx
import pytest

from stub_replica.server import expected_tokens
from wire import protocol as P

from conftest import KEYS, proxy_for, stubs
from jsonpaths import paths, set_at
from rawclient import RawClient, generate

pytestmark = pytest.mark.anyio
SEED = int(os.environ.get("EDGECHAT_FUZZ_SEED", "11"))
LOAD_KEYS = KEYS + [{"key": "sk-load", "tenant": "load", "rate_per_s": 100_000, "burst": 100_000}]
N_FUZZ = 3000
ANSWER_BOUND_S = 10.0

BOUNDARY = [2**31, 2**31 - 1, 2**63, 2**63 - 1, 2**64, -1, 0, -(2**63) - 1, 10**30]
WRONG = [None, True, "1", "", [], {}, [1, "x"], {"a": 1}, 1.5, -0.0]
RAW_NUMBERS = ["1e999", "-1e999", "1e-400", "123456789012345678901234567890", "-0"]  # JSON text, not Python


def valid(rng: random.Random, rid: str) -> dict:
    """A valid client frame (mostly generate, sometimes cancel of an unknown id)."""
    if rng.random() < 0.1:
        return {"type": "cancel", "id": rid}
    g = {"type": "generate", "id": rid,
         "sampling": {"max_tokens": rng.randint(1, 8), "temperature": rng.choice([0, 0.7, 1.0]),
                      "top_p": rng.choice([1.0, 0.9]), "top_k": rng.choice([0, 40]),
                      "seed": rng.randrange(2**63), "stop": rng.choice([[], ["zz"]]),
                      "stop_token_ids": rng.choice([[], [1, 2]])}}
    if rng.random() < 0.5:
        g["prompt"] = "fuzz " + rid
    else:
        g["messages"] = [{"role": "user", "content": "fuzz " + rid}]
    if rng.random() < 0.3:
        g["session"] = f"s{rng.randrange(50)}"
    if rng.random() < 0.2:
        g["priority"] = rng.choice(["interactive", "batch"])
    if rng.random() < 0.2:
        g["deadline_ms"] = rng.choice([0, 50, 5000])
    return g


def mutate(rng: random.Random, frame: dict) -> str:
    """One mutation of a valid frame, as JSON text. The id itself is mutated only into
    values that are not valid ids (so every answer can be accounted for)."""
    f = copy.deepcopy(frame)
    where = [p for p in paths(f) if p and p != ("type",)]
    op = rng.randrange(10)
    path = rng.choice(where)
    if op == 0:
        set_at(f, path, rng.choice(BOUNDARY))
    elif op == 1:
        set_at(f, path, rng.choice(WRONG) if path != ("id",) else rng.choice([None, 7, [], "", "i" * 129]))
    elif op == 2:
        set_at(f, path, "y" * rng.choice([257, 10_000, 200_000]))
    elif op == 3:
        marker = "\u0000NUM\u0000"
        set_at(f, path, marker)
        return json.dumps(f).replace(json.dumps(marker), rng.choice(RAW_NUMBERS))
    elif op == 4:
        depth = rng.choice([50, 500, 5000])
        marker = "\u0000DEEP\u0000"
        set_at(f, path, marker)
        return json.dumps(f).replace(json.dumps(marker), "[" * depth + "]" * depth)
    elif op == 5:
        f[rng.choice(["bogus", "Id", "sampling_", "__proto__"])] = rng.choice(WRONG + BOUNDARY)
    elif op == 6 and len(path) > 1:  # drop a field
        parent = f
        for k in path[:-1]:
            parent = parent[k]
        if isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent.pop(path[-1])
    elif op == 7:
        f["type"] = rng.choice(["generate", "cancel", "delta", "GENERATE", 1])
    elif op == 8:
        return json.dumps(f)[: rng.randrange(1, 40)]  # truncated: no id can be read
    else:
        set_at(f, path, [rng.choice(BOUNDARY + WRONG) for _ in range(rng.randrange(1, 70))])
    return json.dumps(f)


async def test_fuzz_public_websocket_protocol():
    """3,000 mutated frames from 4 sockets: every frame gets exactly one answer (a done or
    a typed error under its id, or an id-less error when it had no valid id) within the
    bound, bystander streams complete token-exact, and nothing stays in flight."""
    rng = random.Random(SEED)
    async with stubs("a", "b", step_s=0.002) as reps, \
            proxy_for(reps, keys=LOAD_KEYS, max_tokens_limit=64) as p:
        fuzzers = [await RawClient.connect(p.ws_url, key="sk-load") for _ in range(4)]
        sent_at: dict[str, float] = {}
        frames_sent = [0] * 4

        async def bystander():
            texts = []
            async with await RawClient.connect(p.ws_url, key="sk-load") as c:
                for i in range(15):
                    rid = f"by{i}"
                    await c.send(generate(rid, prompt=f"bystander {i}", max_tokens=60))
                    await c.until(lambda: rid in c.ended, timeout=ANSWER_BOUND_S)
                    assert c.ended[rid]["type"] == "done", c.ended[rid]
                    texts.append(c.text(rid))
            want = ["".join(map(chr, expected_tokens(list(f"bystander {i}".encode()),
                                                     P.SamplingParams(temperature=0.0), 60))) for i in range(15)]
            assert texts == want

        by = asyncio.create_task(bystander())
        for i in range(N_FUZZ):
            k = i % 4
            rid = f"f{i}"
            base = valid(rng, rid)
            text = mutate(rng, base) if rng.random() < 0.8 else json.dumps(base)
            sent_at[rid] = time.perf_counter()
            await fuzzers[k].send(text)
            frames_sent[k] += 1
            if i % 100 == 99:  # keep the backlog bounded: wait for this batch's answers
                await asyncio.gather(*(c.until(lambda c=c, n=frames_sent[j]: answers(c) == n,
                                               timeout=ANSWER_BOUND_S) for j, c in enumerate(fuzzers)))
        await asyncio.gather(*(c.until(lambda c=c, n=frames_sent[j]: answers(c) == n, timeout=ANSWER_BOUND_S)
                               for j, c in enumerate(fuzzers)))
        await by
        for c in fuzzers:
            assert all(n == 1 for n in c.endings.values()), [(r, n, c.ended[r]) for r, n in c.endings.items() if n != 1][:3]
            for rid, f in c.ended.items():
                assert f["type"] == "done" or f["code"] in {"bad_request", "not_found", "prompt_too_long",
                                                           "overloaded", "forbidden"}, f
            assert all(len(f.get("message", "")) < 600 for f in c.frames), [f for f in c.frames if len(f.get("message", "")) >= 600][:2]
            assert c.closed is None  # the proxy never closed a fuzzing socket
        done = sum(f["type"] == "done" for c in fuzzers for f in c.ended.values())
        errors = sum(len(c.ended) + len(c.conn_errors) for c in fuzzers) - done
        print(f"seed {SEED}: {N_FUZZ} frames -> {done} done, {errors} errors")
        assert done > 300 and errors > 1500  # both paths exercised
        for c in fuzzers:
            await c.close()
        for r in reps:
            await r.until_idle()
        assert not p.proxy.streams and all(c.own_inflight == 0 for c in p.proxy.pool.conns)
        async with httpx.AsyncClient(trust_env=False) as h:
            r = await h.get(p.http + "/healthz")
            assert r.status_code == 200 and r.json()["inflight"] == 0


def answers(c: RawClient) -> int:
    return sum(c.endings.values()) + len(c.conn_errors)


async def test_a_thousand_random_disconnects_leave_no_zombie():
    """1,000 clients that vanish at random moments (before, during and after admission,
    mid-stream; closing cleanly or resetting): afterwards the proxy has nothing in flight
    and the stubs run nothing."""
    rng = random.Random(SEED + 1)
    async with stubs("a", "b", step_s=0.005) as reps, proxy_for(reps, keys=LOAD_KEYS) as p:
        got_tokens = 0

        async def one(i: int):
            nonlocal got_tokens
            c = await RawClient.connect(p.ws_url, key="sk-load")
            for j in range(rng.randint(1, 3)):
                await c.send(generate(f"d{j}", prompt=f"client {i} {j}", max_tokens=rng.randint(5, 400)))
            mode = rng.randrange(3)
            if mode == 1:  # after some tokens
                want = rng.randint(1, 5)
                try:
                    await c.until(lambda: sum(map(len, c.deltas.values())) >= want or c.ended, timeout=5)
                except TimeoutError:
                    pass
            elif mode == 2:
                await asyncio.sleep(rng.random() * 0.02)
            got_tokens += sum(map(len, c.deltas.values()))
            if rng.random() < 0.5:
                c.ws.transport.abort()  # reset, no closing handshake
            await c.close()

        for wave in range(20):
            await asyncio.gather(*(one(wave * 50 + i) for i in range(50)))
        for r in reps:
            await r.until_idle()
        assert not p.proxy.streams and all(c.own_inflight == 0 and not c.streams for c in p.proxy.pool.conns)
        assert got_tokens > 500  # many were mid-stream when they went
        aborted = sum(len(r.aborts) for r in reps)
        assert aborted > 300, aborted  # the work of the vanished clients was stopped, not run to its end
        async with httpx.AsyncClient(trust_env=False) as h:
            assert (await h.get(p.http + "/healthz")).json()["inflight"] == 0
