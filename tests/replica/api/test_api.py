"""The replica served for real (`python -m replica` on the default model): the
OpenAI HTTP API, the proxy WebSocket protocol, cancellation and bad input."""

from __future__ import annotations

import asyncio
import os

import httpx
import msgspec
import pytest
from websockets.asyncio.client import connect

from wire import protocol as P
from tests.replica.server import AUTH, replica_server
from tests.replica.ws_client import ReplicaWS, ws_url

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    with replica_server("--kv-memory-gb", "0.25", "--max-num-seqs", "40") as (url, _):
        yield url


def chat(url, messages, **kw):
    body = {"messages": messages, "temperature": 0, "max_tokens": 24, **kw}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def test_golden_greedy_chat(server):
    out = chat(server, CHAT)
    text = out["choices"][0]["message"]["content"]
    assert text == "The capital of France is Paris.", text
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["prompt_tokens"] > 20 and out["usage"]["completion_tokens"] <= 24


def test_second_turn_reuses_the_cached_prefix(server):
    first = chat(server, [{"role": "user", "content": "Name three colors of the rainbow."}])
    reply = first["choices"][0]["message"]["content"]
    turn2 = [{"role": "user", "content": "Name three colors of the rainbow."},
             {"role": "assistant", "content": reply}, {"role": "user", "content": "And two more?"}]
    second = chat(server, turn2)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32


def test_streaming_sse_matches_non_streaming(server):
    whole = chat(server, CHAT)["choices"][0]["message"]["content"]
    parts, usage = [], None
    body = {"messages": CHAT, "temperature": 0, "max_tokens": 24, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=120, headers=AUTH) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = msgspec.json.decode(line[6:])
            if obj.get("usage"):
                usage = obj["usage"]
            for ch in obj["choices"]:
                parts.append(ch["delta"].get("content", ""))
    assert "".join(parts) == whole and usage["completion_tokens"] > 0


def test_completions_models_health_metrics(server):
    r = httpx.post(server + "/v1/completions", json={"prompt": "1, 2, 3, 4,", "max_tokens": 6, "temperature": 0},
                   timeout=120, headers=AUTH)
    assert r.status_code == 200 and r.json()["choices"][0]["text"].strip().startswith("5")
    assert httpx.get(server + "/v1/models", headers=AUTH).json()["data"][0]["id"] == "SmolLM2-135M-Instruct"
    assert httpx.get(server + "/healthz").json()["status"] == "ok"
    assert httpx.get(server + "/health").json()["status"] == "ok"  # the alias routers for vLLM/SGLang probe
    m = httpx.get(server + "/metrics", headers=AUTH).text
    for name in ("edgechat_replica_ttft_seconds_bucket", "edgechat_replica_itl_seconds_count",
                 "edgechat_replica_running", "edgechat_replica_waiting", "edgechat_replica_kv_usage",
                 "edgechat_replica_prefix_hit_tokens_total", "edgechat_replica_cpu_steps_total",
                 "edgechat_replica_cpu_solo_steps_total", "edgechat_replica_step_seconds_bucket"):
        assert name in m


def test_stop_strings(server):
    text = chat(server, CHAT)["choices"][0]["message"]["content"]
    out = chat(server, CHAT, stop=["Paris"])
    assert out["choices"][0]["message"]["content"] == text[: text.index("Paris")]
    assert out["choices"][0]["finish_reason"] == "stop"


async def _ws_streams(server):
    async with connect(ws_url(server), max_size=None, additional_headers=AUTH) as ws:
        c = ReplicaWS(ws)
        prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198]
        sp = lambda seed: P.SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=seed)  # noqa: E731
        alone = {}
        for i in range(32):
            await c.send(P.Generate(id=f"a{i}", prompt_ids=prompt + [28 + i, 2, 198, 1, 520, 9531, 198],
                                    sampling=sp(i)))
            alone.update(await c.collect([f"a{i}"]))
        for i in range(32):
            await c.send(P.Generate(id=f"b{i}", prompt_ids=prompt + [28 + i, 2, 198, 1, 520, 9531, 198],
                                    sampling=sp(i)))
        together = await c.collect([f"b{i}" for i in range(32)])
        return alone, together


def test_32_concurrent_seeded_streams_equal_each_alone(server):
    alone, together = asyncio.run(_ws_streams(server))
    for i in range(32):
        a, b = alone[f"a{i}"], together[f"b{i}"]
        assert isinstance(b[2], P.Finished)
        assert b[0] == a[0] and b[1] == a[1], i
    assert len({t[1] for t in together.values()}) > 16  # distinct seeds give distinct texts


async def _cancel_and_disconnect(server):
    long = P.SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    async with connect(ws_url(server), additional_headers=AUTH) as ws:
        c = ReplicaWS(ws)
        await c.send(P.Generate(id="x", prompt_ids=[1, 2, 3, 4], sampling=long))
        while not any(isinstance(m, P.Tokens) for m in await c.recv()):
            pass
        await c.send(P.Abort(id="x"))
        idle = await c.wait_idle()
        assert idle.running == 0
    # A closed socket aborts its requests too.
    async with connect(ws_url(server), additional_headers=AUTH) as ws:
        c = ReplicaWS(ws)
        for i in range(4):
            await c.send(P.Generate(id=f"y{i}", prompt_ids=[1, 2, 3, 5 + i], sampling=long))
        while not any(isinstance(m, P.Tokens) for m in await c.recv()):
            pass
    # An HTTP client that drops its SSE stream.
    async with httpx.AsyncClient(timeout=60, headers=AUTH) as hc:
        body = {"messages": CHAT, "max_tokens": 400, "ignore_eos": True, "stream": True}
        async with hc.stream("POST", server + "/v1/chat/completions", json=body) as r:
            async for _ in r.aiter_lines():
                break
    async with connect(ws_url(server), additional_headers=AUTH) as ws:
        return await ReplicaWS(ws).wait_idle()


def test_cancel_and_disconnect_free_all_blocks(server):
    ld = asyncio.run(asyncio.wait_for(_cancel_and_disconnect(server), 120))
    assert ld.free_blocks == ld.total_blocks and ld.running == 0


@pytest.mark.parametrize("body, problem", [
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000000}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "frobnicate": 1}', "frobnicate"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', "UTF-8"),
    (b'{"messages": ', "malformed"),
    (b'{"max_tokens": 3}', "messages"),
])
def test_bad_http_input_is_named(server, body, problem):
    r = httpx.post(server + "/v1/chat/completions", content=body,
                   headers={"content-type": "application/json", **AUTH}, timeout=60)
    assert r.status_code == 400
    assert problem.lower() in r.json()["error"]["message"].lower()


def test_prompt_longer_than_context(server):
    r = httpx.post(server + "/v1/completions", json={"prompt": "hello " * 9000, "max_tokens": 4}, timeout=60,
                   headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_long"


async def _bad_frames(server):
    async with connect(ws_url(server), additional_headers=AUTH) as ws:
        c = ReplicaWS(ws)
        errors = []
        await ws.send(b"\x93garbage")
        await ws.send("text frame")
        await c.send(P.Generate(id="neg", prompt_ids=[1, 2], sampling=P.SamplingParams(max_tokens=-1)))
        await c.send(P.Generate(id="big", prompt_ids=[7] * 20000))
        await c.send(P.Generate(id="oov", prompt_ids=[10**6]))
        while len(errors) < 5:
            errors += [m for m in await c.recv() if isinstance(m, P.Error)]
        # ...and the same connection still serves.
        await c.send(P.Generate(id="ok", prompt_ids=[1, 2, 3], sampling=P.SamplingParams(max_tokens=3)))
        res = await c.collect(["ok"])
        return errors, res["ok"][2]


def test_bad_frames_get_errors_and_the_connection_keeps_serving(server):
    errors, fin = asyncio.run(asyncio.wait_for(_bad_frames(server), 60))
    text = " | ".join(e.message for e in errors)
    assert "malformed frame" in text and "binary" in text and "max_tokens" in text and "context" in text
    assert "token ids" in text
    assert isinstance(fin, P.Finished) and fin.usage.completion_tokens == 3


async def _hello(server):
    async with connect(ws_url(server), additional_headers=AUTH) as ws:
        c = ReplicaWS(ws)
        while c.hello is None:
            await c.recv()
        return c.hello


def test_hello_names_the_cores_it_computes_on(server):
    # The proxy groups replicas whose units meet (edge_proxy.routing.compute_groups): two
    # replicas on this machine's cores must name the same ones, whatever their host names.
    hello = asyncio.run(asyncio.wait_for(_hello(server), 60))
    with open("/proc/sys/kernel/random/boot_id") as f:
        machine = f.read().strip()
    assert sorted(hello.compute) == sorted(f"cpu:{machine}:{c}" for c in os.sched_getaffinity(0))
    assert hello.uses == os.cpu_count()  # its engine's threads (no --cpu-threads: every core)
