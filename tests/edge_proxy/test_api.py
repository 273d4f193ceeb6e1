"""Public WebSocket protocol and the OpenAI-compatible HTTP API, against replica stubs."""

import asyncio
import json

import httpx
import pytest
from websockets.asyncio.client import connect

from edge_proxy import protocol as pp
from edge_proxy.client import EdgeClient, EdgeError
from stub_replica.server import expected_tokens
from wire import protocol as P

from conftest import proxy_for, stubs

pytestmark = pytest.mark.anyio
AUTH = {"Authorization": "Bearer sk-alice"}
HI = [{"role": "user", "content": "hello there"}]


def stub_text(g: P.Generate, n: int) -> str:
    return bytes(expected_tokens(g.prompt_ids, g.sampling, n)).decode()


async def test_many_requests_in_flight_on_one_connection():
    async with stubs("a", "b") as reps, proxy_for(reps) as p:
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            reqs = [await c.generate(messages=[{"role": "user", "content": f"q{i}"}], max_tokens=8 + i, seed=i)
                    for i in range(12)]
            results = await asyncio.gather(*(r.result() for r in reqs))
        gens = {tuple(g.prompt_ids): g for r in reps for g in r.generates}
        for i, (text, done) in enumerate(results):
            assert done.finish_reason == "length" and done.usage.completion_tokens == 8 + i
            assert done.replica in ("a", "b") and done.region == "local" and done.timing.ttft_ms > 0
            assert len(text) == 8 + i
        # The text is exactly the replica's stream, and seeds reached the replica unchanged.
        assert {g.sampling.seed for g in gens.values()} == set(range(12))
        for g in gens.values():
            assert any(t == stub_text(g, g.sampling.max_tokens) for t, _ in results)


async def test_unseeded_requests_get_a_seed_and_greedy_is_deterministic():
    async with stubs("a") as reps, proxy_for(reps) as p:
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            t1, _ = await c.complete(messages=HI, max_tokens=10, temperature=0)
            t2, _ = await c.complete(messages=HI, max_tokens=10, temperature=0)
            await c.complete(messages=HI, max_tokens=4, temperature=0.8)
        assert t1 == t2
        assert all(g.sampling.seed is not None for g in reps[0].generates)


async def test_protocol_errors_are_answered_not_fatal():
    async with stubs("a") as reps, proxy_for(reps, max_tokens_limit=100) as p:
        async with connect(p.ws_url, additional_headers=AUTH, proxy=None) as ws:
            await ws.send("{not json")
            err = json.loads(await ws.recv())
            assert err["type"] == "error" and err["code"] == "bad_request" and "id" not in err
            await ws.send(json.dumps({"type": "generate", "id": "x", "prompt": "hi", "sampling": {"max_tokens": 1000}}))
            err = json.loads(await ws.recv())
            assert (err["id"], err["code"]) == ("x", "bad_request") and "max_tokens" in err["message"]
            await ws.send(json.dumps({"type": "generate", "id": "y", "prompt": "hi", "messages": HI}))
            assert json.loads(await ws.recv())["code"] == "bad_request"
            await ws.send(json.dumps({"type": "cancel", "id": "nope"}))
            assert json.loads(await ws.recv())["code"] == "not_found"
            await ws.send(json.dumps({"type": "generate", "id": "z", "prompt": "hi", "sampling": {"max_tokens": 2}}))
            frames = [json.loads(await ws.recv()) for _ in range(3)]
            assert [f["type"] for f in frames] == ["delta", "delta", "done"]


async def test_prompt_too_long():
    async with stubs("a", max_model_len=256) as reps, proxy_for(reps) as p:
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            with pytest.raises(EdgeError) as e:
                await c.complete(prompt="x" * 250, max_tokens=10)
            assert e.value.code == pp.PROMPT_TOO_LONG and "256" in e.value.message
    async with stubs("a") as reps, proxy_for(reps, max_prompt_tokens=50) as p:
        async with httpx.AsyncClient(trust_env=False, headers=AUTH) as h:
            r = await h.post(p.http + "/v1/completions", json={"prompt": "x" * 60, "max_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["code"] == pp.PROMPT_TOO_LONG


async def test_openai_chat_and_completions():
    async with stubs("a") as reps, proxy_for(reps) as p:
        async with httpx.AsyncClient(trust_env=False, headers=AUTH) as h:
            r = await h.post(p.http + "/v1/chat/completions",
                             json={"model": "stub", "messages": HI, "max_tokens": 6, "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["object"] == "chat.completion" and body["model"] == "stub"
            text = body["choices"][0]["message"]["content"]
            assert text == stub_text(reps[0].generates[-1], 6)
            assert body["choices"][0]["finish_reason"] == "length"
            assert body["usage"]["completion_tokens"] == 6 and body["edgechat"]["replica"] == "a"

            chunks = []
            async with h.stream("POST", p.http + "/v1/chat/completions",
                                json={"messages": HI, "max_tokens": 6, "temperature": 0, "stream": True,
                                      "stream_options": {"include_usage": True}}) as r:
                assert r.headers["content-type"].startswith("text/event-stream")
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        chunks.append(line[6:])
            assert chunks[-1] == "[DONE]"
            objs = [json.loads(c) for c in chunks[:-1]]
            assert objs[0]["choices"][0]["delta"]["role"] == "assistant"
            streamed = "".join(o["choices"][0]["delta"].get("content", "") for o in objs if o["choices"])
            assert streamed == text  # same prompt, greedy
            assert objs[-2]["choices"][0]["finish_reason"] == "length"
            assert objs[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # second time: cached

            r = await h.post(p.http + "/v1/completions", json={"prompt": "once upon", "max_tokens": 3, "seed": 7})
            assert r.json()["object"] == "text_completion" and len(r.json()["choices"][0]["text"]) == 3
            r = await h.post(p.http + "/v1/completions", json={"prompt": [104, 105], "max_tokens": 2})
            assert r.status_code == 200 and reps[0].generates[-1].prompt_ids == [104, 105]

            r = await h.get(p.http + "/v1/models")
            assert [m["id"] for m in r.json()["data"]] == ["stub"]
            r = await h.post(p.http + "/v1/chat/completions", json={"model": "gpt-9", "messages": HI})
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
            r = await h.post(p.http + "/v1/chat/completions", json={"messages": "nope"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request"
            r = await h.post(p.http + "/v1/chat/completions", json={"messages": HI, "n": 2, "max_tokens": 4, "seed": 3})
            g = reps[0].generates[-1]
            assert r.status_code == 200 and [c["message"]["content"] for c in r.json()["choices"]] == [
                bytes(expected_tokens(g.prompt_ids, g.sampling, 4, index=i)).decode() for i in (0, 1)]
            r = await h.get(p.http + "/healthz")
            assert r.status_code == 200 and r.json()["replicas_ready"] == 1


async def test_healthz_without_replicas():
    async with stubs("a") as reps:
        await reps[0].stop()
        async with proxy_for(reps, wait_ready=0) as p:
            async with httpx.AsyncClient(trust_env=False, headers=AUTH) as h:
                r = await h.get(p.http + "/healthz")
                assert r.status_code == 503 and r.json()["status"] == "no_replica"
                r = await h.post(p.http + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert r.status_code == 503 and r.json()["error"]["code"] == pp.UNAVAILABLE
                assert r.headers["retry-after"] == "1"
