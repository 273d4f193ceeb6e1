"""Hostile input and faults on a real replica (`python -m replica`, default model):
the query of death and its cousins are rejected at the door, a bad message fails its
own request only, reused and cancelled ids leave no work behind, every endpoint
but /healthz needs the secret, and a killed engine process is restarted."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import msgspec
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from wire import protocol as P
from tests.replica.server import AUTH, engine_pid, idle_within, replica_server, scrape
from tests.replica.ws_client import ReplicaWS, ws_url

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 28, 2, 198, 1, 520, 9531, 198]
SEEDED = P.SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=42)
LONG = P.SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def replica():
    with replica_server("--kv-memory-gb", "0.25", "--max-num-seqs", "16") as (url, proc):
        yield url, proc


def ws(url):
    return connect(ws_url(url), max_size=None, additional_headers=AUTH)


async def first_tokens(c: ReplicaWS, rid: str) -> None:
    while not any(isinstance(m, P.Tokens) and m.id == rid for m in await c.recv()):
        pass


def reference(url) -> list[int]:
    async def run():
        async with ws(url) as sock:
            c = ReplicaWS(sock)
            await c.send(P.Generate(id="ref", prompt_ids=PROMPT, sampling=SEEDED))
            return (await c.collect(["ref"]))["ref"][0]
    return asyncio.run(run())


# -- the query of death and its cousins ----------------------------------------------------------

POISON_SAMPLING = [
    dict(top_k=2**31), dict(top_k=2**63), dict(top_k=2**64 - 1), dict(seed=2**64 - 1), dict(seed=-1),
    dict(stop_token_ids=[2**64 - 1]), dict(stop_token_ids=[-1]), dict(temperature=float("nan")),
    dict(temperature=float("inf")), dict(top_p=float("nan")), dict(max_tokens=2**63 - 1),
]


async def _poison_frames(url):
    async with ws(url) as sock:
        c = ReplicaWS(sock)
        msgs = [P.Generate(id="bystander", prompt_ids=PROMPT, sampling=SEEDED)]
        for i, kw in enumerate(POISON_SAMPLING):
            sp = P.SamplingParams(max_tokens=8, temperature=0.7, seed=1)
            for k, v in kw.items():
                setattr(sp, k, v)
            msgs.append(P.Generate(id=f"p{i}", prompt_ids=PROMPT, sampling=sp))
        msgs += [P.Generate(id="neg-resume", prompt_ids=PROMPT, resume_ids=[-1]),
                 P.Generate(id="big-resume", prompt_ids=PROMPT, resume_ids=[2**64 - 1]),
                 P.Generate(id="oov", prompt_ids=[2**31 - 1]), P.Generate(id="neg", prompt_ids=[1, -5]),
                 P.Generate(id="deadline", prompt_ids=PROMPT, deadline_ms=float("nan")),
                 P.Generate(id="salt", prompt_ids=PROMPT, cache_salt="s" * 10_000),
                 P.Generate(id="", prompt_ids=PROMPT), P.Generate(id="x" * 100_000, prompt_ids=PROMPT)]
        await c.send(*msgs)
        out = await c.collect(["bystander"] + [m.id for m in msgs[1:] if 0 < len(m.id) < 300])
        return out


def test_query_of_death_and_cousins_are_rejected_and_bystanders_finish(replica):
    url, proc = replica
    want = reference(url)
    out = asyncio.run(asyncio.wait_for(_poison_frames(url), 120))
    tokens, _, fin = out.pop("bystander")
    assert isinstance(fin, P.Finished) and tokens == want
    for rid, (_, _, final) in out.items():
        assert isinstance(final, P.Error) and final.code in (P.BAD_REQUEST, P.PROMPT_TOO_LONG), (rid, final)
    assert httpx.get(url + "/healthz").status_code == 200 and proc.poll() is None
    assert scrape(url)["edgechat_replica_engine_restarts_total"] == 0


@pytest.mark.parametrize("body, problem", [
    ({"prompt": "hi", "top_k": 2**31}, "top_k"),
    ({"prompt": "hi", "top_k": 2**70}, "top_k"),
    ({"prompt": [2**64], "max_tokens": 3}, "token ids"),
    ({"prompt": [-1], "max_tokens": 3}, "token ids"),
    ({"prompt": [10**6], "max_tokens": 3}, "token ids"),
    ({"prompt": "hi", "stop_token_ids": [2**64]}, "stop_token_ids"),
    ({"prompt": "hi", "seed": 2**64 - 1}, "seed"),
])
def test_http_out_of_range_integers_are_400s(replica, body, problem):
    url, _ = replica
    r = httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400 and problem in r.json()["error"]["message"], r.text
    assert httpx.get(url + "/healthz").status_code == 200


async def _bad_message_among_good(url):
    """One frame: a valid request, a message that does not decode, a deeply nested one, and
    a second valid request. Only the bad ones fail; the socket keeps serving."""
    async with ws(url) as sock:
        c = ReplicaWS(sock)
        enc = msgspec.msgpack.encode
        good = lambda rid: enc(P.Generate(id=rid, prompt_ids=PROMPT, sampling=SEEDED))  # noqa: E731
        bad = enc(["generate", "bad", PROMPT, [4, "hot"]])  # temperature of the wrong type
        deep = b"\x93\xa8generate\xa4deep" + b"\x91" * 100_000 + b"\x90"
        unknown = enc(["frobnicate", "u"])
        await sock.send(b"\x95" + good("g1") + bad + deep + unknown + good("g2"))
        out = await c.collect(["g1", "g2", "bad"])
        await c.send(P.Generate(id="after", prompt_ids=PROMPT, sampling=SEEDED))
        out.update(await c.collect(["after"]))
        return out


def test_a_bad_message_fails_its_request_only(replica):
    url, _ = replica
    want = reference(url)
    out = asyncio.run(asyncio.wait_for(_bad_message_among_good(url), 120))
    assert isinstance(out["bad"][2], P.Error) and "malformed message" in out["bad"][2].message
    for rid in ("g1", "g2", "after"):
        assert isinstance(out[rid][2], P.Finished) and out[rid][0] == want, rid


# -- cancel, id reuse: no zombie work ----------------------------------------------------------------

async def _reuse(url):
    async with ws(url) as sock:
        c = ReplicaWS(sock)
        await c.send(P.Generate(id="a", prompt_ids=PROMPT, sampling=LONG))
        await first_tokens(c, "a")
        await c.send(P.Abort(id="a"), P.Generate(id="a", prompt_ids=PROMPT, sampling=SEEDED))  # one frame
        a = (await c.collect(["a"]))["a"]
        await c.send(P.Generate(id="b", prompt_ids=PROMPT, sampling=LONG))
        await first_tokens(c, "b")
        await c.send(P.Abort(id="b"))
        await c.send(P.Abort(id="b"), P.Abort(id="never-sent"))
        await c.send(P.Generate(id="b", prompt_ids=PROMPT, sampling=SEEDED))
        b = (await c.collect(["b"]))["b"]
        await c.send(P.Generate(id="c", prompt_ids=PROMPT, sampling=LONG), P.Abort(id="c"),
                     P.Generate(id="c", prompt_ids=PROMPT, sampling=SEEDED))
        cc = (await c.collect(["c"]))["c"]
        # The last one is cancelled mid-stream: the client's abort is the end of it.
        await c.send(P.Generate(id="d", prompt_ids=PROMPT, sampling=LONG))
        await first_tokens(c, "d")
        await c.send(P.Abort(id="d"))
        return a, b, cc


def test_reused_ids_never_mix_and_cancelled_work_stops_within_a_step(replica):
    url, _ = replica
    want = reference(url)
    a, b, c = asyncio.run(asyncio.wait_for(_reuse(url), 120))
    for tokens, _, fin in (a, b, c):
        assert isinstance(fin, P.Finished) and tokens == want and fin.usage.completion_tokens == len(want)
    step_s = max(scrape(url)["edgechat_replica_step_ms"] / 1e3, 0.05)
    elapsed = idle_within(url, 2.0)
    assert elapsed < 2.0, f"{elapsed:.3f} s to idle (step {step_s * 1e3:.0f} ms)"


async def _disconnect_with_work(url, n: int):
    async with ws(url) as sock:
        c = ReplicaWS(sock)
        await c.send(*[P.Generate(id=f"z{i}", prompt_ids=PROMPT + [i], sampling=LONG) for i in range(n)])
        await first_tokens(c, "z0")


def test_a_closed_socket_leaves_no_work(replica):
    url, _ = replica
    asyncio.run(asyncio.wait_for(_disconnect_with_work(url, 8), 120))
    idle_within(url, 2.0)


# -- the secret ---------------------------------------------------------------------------------------

def test_every_endpoint_but_healthz_needs_the_secret(replica):
    url, _ = replica
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "cache_salt": "tenant-x"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": AUTH["Authorization"][7:]}):
        assert httpx.post(url + "/v1/chat/completions", json=body, headers=headers).status_code == 401
        assert httpx.post(url + "/v1/completions", json={"prompt": "hi"}, headers=headers).status_code == 401
        assert httpx.get(url + "/v1/models", headers=headers).status_code == 401
        assert httpx.get(url + "/metrics", headers=headers).status_code == 401

        async def ws_refused():
            with pytest.raises(InvalidStatus):
                async with connect(ws_url(url), additional_headers=headers):
                    pass
        asyncio.run(ws_refused())
    assert httpx.get(url + "/healthz").status_code == 200
    assert httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60).status_code == 200


# -- the engine process dies: restarted (keep last: it restarts this module's replica) ---------------

async def _kill_engine(url, api_pid):
    async with ws(url) as sock:
        c = ReplicaWS(sock)
        await c.send(P.Generate(id="victim", prompt_ids=PROMPT, sampling=LONG))
        await first_tokens(c, "victim")
        old = engine_pid(api_pid)
        os.kill(old, signal.SIGKILL)
        errors = []
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                errors += [m for m in await c.recv() if isinstance(m, P.Error)]
        return old, errors, closed.value.rcvd.code


def test_a_killed_engine_fails_its_streams_typed_and_comes_back(replica):
    url, proc = replica
    old, errors, close_code = asyncio.run(asyncio.wait_for(_kill_engine(url, proc.pid), 60))
    assert [(e.id, e.code) for e in errors] == [("victim", P.INTERNAL)] and "engine process exited" in errors[0].message
    assert close_code == 1013  # "try again later": the proxy counts the replica out until it is back
    saw_503, t0 = False, time.perf_counter()
    while (r := httpx.get(url + "/healthz")).status_code != 200:
        saw_503 |= r.status_code == 503
        assert time.perf_counter() - t0 < 180, "engine did not come back"
        time.sleep(0.05)
    assert saw_503 and engine_pid(proc.pid) != old and proc.poll() is None
    assert reference(url)  # serving again
    assert scrape(url)["edgechat_replica_engine_restarts_total"] == 1
