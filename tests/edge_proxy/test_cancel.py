"""Cancellation: a client cancel, a closed WebSocket or an aborted HTTP request reach
the replica as Abort within one engine step: after the client acts, the replica
produces at most one more token for the request (the step already under way)."""

import asyncio

import httpx
import pytest

from edge_proxy.client import EdgeClient

from conftest import proxy_for, stubs, want

pytestmark = pytest.mark.anyio
STEP = 0.05
HI = [{"role": "user", "content": "count to a thousand"}]
AUTH = {"Authorization": "Bearer sk-alice"}


async def steps_after(stub, before: dict[str, int]) -> int:
    """Tokens the stub produced for the aborted request after `before` was taken."""
    await asyncio.wait_for(stub.abort_event.wait(), 5)
    (rid, produced), = stub.aborts
    assert rid == stub.generates[-1].id
    return produced - before[rid]


async def test_client_cancel():
    async with stubs("a", step_s=STEP) as reps, proxy_for(reps) as p:
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            req = await c.generate(messages=HI, max_tokens=1000)
            async for _ in req:
                before = reps[0].produced()
                await req.cancel()
                break
            text, done = await req.result()
            assert done.finish_reason == "abort" and 1 <= done.usage.completion_tokens <= 2
            assert await steps_after(reps[0], before) <= 1
        assert not p.proxy.streams and not p.proxy.pool.conns[0].streams


async def test_cancel_before_the_first_token():
    async with stubs("a", step_s=STEP) as reps, proxy_for(reps) as p:
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            req = await c.generate(messages=HI, max_tokens=1000)
            await req.cancel()
            _, done = await req.result()
            assert done.finish_reason == "abort"
        assert not p.proxy.streams


async def test_websocket_close_aborts():
    async with stubs("a", step_s=STEP) as reps, proxy_for(reps) as p:
        c = await EdgeClient.connect(p.ws_url, api_key="sk-alice")
        req = await c.generate(messages=HI, max_tokens=1000)
        async for _ in req:
            break
        before = reps[0].produced()
        c.ws.transport.abort()  # the client vanishes without a closing handshake
        assert await steps_after(reps[0], before) <= 1
        await c.close()
        assert p.proxy.metrics.requests.get("disconnect") == 1


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "non-streaming"])
async def test_http_disconnect_aborts(stream):
    async with stubs("a", step_s=STEP) as reps, proxy_for(reps) as p:
        body = {"messages": HI, "max_tokens": 1000, "stream": stream}
        async with httpx.AsyncClient(trust_env=False, headers=AUTH) as h:
            if stream:
                async with h.stream("POST", p.http + "/v1/chat/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if '"content":"' in line and '"content":""' not in line:
                            break
                    before = reps[0].produced()
            else:
                task = asyncio.create_task(h.post(p.http + "/v1/chat/completions", json=body))
                await asyncio.wait_for(reps[0].token_event.wait(), 5)
                before = reps[0].produced()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
        assert await steps_after(reps[0], before) <= 1


def _runs(frames: list[dict], rid: str) -> list[tuple[str, dict]]:
    """The requests that used id `rid` on a socket, in order: (their text, their final frame)."""
    runs, text = [], ""
    for f in frames:
        if f.get("id") != rid:
            continue
        if f["type"] == "delta":
            text += f["text"]
        else:
            runs.append((text, f))
            text = ""
    return runs if not text else runs + [(text, None)]


@pytest.mark.parametrize("cancel_after_tokens", [0, 3], ids=["while-admitting", "while-streaming"])
async def test_generate_cancel_generate_with_one_id_never_mixes(cancel_after_tokens):
    """Issue 11, item 3: `generate a`, `cancel a`, `generate a` on one socket gives two
    requests whose frames never mix, the cancelled one stops on the replica (Abort),
    and nothing stays in flight."""
    from rawclient import RawClient, generate

    async with stubs("a", step_s=0.01) as reps, proxy_for(reps) as p:
        async with await RawClient.connect(p.ws_url) as c:
            for _ in range(5):
                before = len(c.frames)
                await c.send(generate("a", prompt="first", max_tokens=40))
                if cancel_after_tokens:
                    await c.until(lambda: len(c.deltas.get("a", [])) >= cancel_after_tokens)
                await c.send({"type": "cancel", "id": "a"})
                await c.send(generate("a", prompt="second", max_tokens=40))
                await c.until(lambda: sum(f.get("id") == "a" and f["type"] != "delta" for f in c.frames[before:]) == 2)
                (t1, end1), (t2, end2) = _runs(c.frames[before:], "a")
                assert end1["type"] == "done" and end1["finish_reason"] == "abort"
                assert want("first", 40).startswith(t1) and len(t1) <= cancel_after_tokens + 2
                assert end2["finish_reason"] == "length" and t2 == want("second", 40)
        assert not p.proxy.streams and not p.proxy.pool.conns[0].streams
        await reps[0].until_idle()
        first = [g.id for g in reps[0].generates if bytes(g.prompt_ids) == b"first"]
        assert {rid for rid, _ in reps[0].aborts} == set(first)  # every first request that reached it was aborted


async def test_ids_are_unique_among_open_requests_and_a_closed_socket_leaves_nothing():
    from rawclient import RawClient, generate

    async with stubs("a", step_s=0.01) as reps, proxy_for(reps) as p:
        async with await RawClient.connect(p.ws_url) as c:
            await c.send(generate("dup", max_tokens=30))
            await c.send(generate("dup", prompt="other", max_tokens=30))
            await c.until(lambda: "dup" in c.ended and c.ended["dup"]["type"] == "error")
            assert c.ended["dup"]["code"] == "bad_request" and "already in flight" in c.ended["dup"]["message"]
            await c.until(lambda: c.endings.get("dup") == 2)  # the first one runs to its end, alone
            assert c.ended["dup"]["finish_reason"] == "length" and len(c.text("dup")) == 30
            for i in range(20):  # some streaming, some still being admitted when the socket goes
                await c.send(generate(f"r{i}", max_tokens=1000))
            await c.until(lambda: len(c.deltas) > 5)
            c.ws.transport.abort()
        await reps[0].until_idle()  # every request the socket had open was aborted on the replica
        assert not p.proxy.streams
        async with httpx.AsyncClient(trust_env=False) as h:
            assert (await h.get(p.http + "/healthz")).json()["inflight"] == 0
        assert not p.proxy.pool.conns[0].streams and p.proxy.pool.conns[0].own_inflight == 0
