"""Cancellation: a client cancel, a closed WebSocket or an aborted HTTP request reach
the replica as Abort within one engine step: after the client acts, the replica
produces at most one more token for the request (the step already under way)."""

import asyncio

import httpx
import pytest

from edge_proxy.client import EdgeClient

from conftest import proxy_for, stubs

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
