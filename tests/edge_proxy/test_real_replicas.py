"""End to end on the default model: a proxy in front of two real replicas.

A conversation's second turn goes to the replica that holds its prefix (cached
tokens > 0), and a replica killed mid-stream is replaced without the client
seeing a duplicated or missing token: the text equals the uninterrupted run's, with
seeded sampling and penalties on.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from edge_proxy.client import EdgeClient
from tests.edge_proxy.two_replicas import stack

pytestmark = pytest.mark.timeout(400)
QUESTIONS = ["What is the capital of France?", "Name a planet in the solar system.", "What color is the sky?"]


async def conversations(url: str):
    """Turn 1 and turn 2 of three conversations; returns [(done1, done2)]."""
    out = []
    async with await EdgeClient.connect(url) as c:
        for q in QUESTIONS:
            turn1 = [{"role": "user", "content": q}]
            text, d1 = await c.complete(messages=turn1, max_tokens=24, temperature=0)
            turn2 = turn1 + [{"role": "assistant", "content": text}, {"role": "user", "content": "Why?"}]
            _, d2 = await c.complete(messages=turn2, max_tokens=8, temperature=0)
            out.append((d1, d2))
    return out


async def failover(url: str, reps, sampling: dict):
    """The uninterrupted text, then the same request with its replica killed mid-stream."""
    story = [{"role": "user", "content": "Write a long story about a brave little dragon."}]
    async with await EdgeClient.connect(url) as c:
        whole, done = await c.complete(messages=story, max_tokens=48, **sampling)
        req = await c.generate(messages=story, max_tokens=48, **sampling)
        seen = 0
        async for _ in req:
            seen += 1
            if seen == 8:  # mid-stream: kill the replica that served (and holds) this prompt
                os.killpg(reps[done.replica][1].pid, signal.SIGKILL)
        return whole, done, req.text, req.done


def test_prefix_routing_and_exact_failover_on_real_replicas():
    with stack() as (url, reps):
        for d1, d2 in asyncio.run(conversations(url)):
            assert d2.replica == d1.replica, "second turn left the replica holding its prefix"
            assert d2.usage.cached_tokens > 0
        # seeded sampling with penalties: the resumed replica counts the tokens so far (resume_ids)
        sampling = {"temperature": 0.7, "seed": 11, "presence_penalty": 0.5, "repetition_penalty": 1.1}
        whole, done, text, after = asyncio.run(failover(url, reps, sampling))
        assert done.usage.completion_tokens == 48 or done.finish_reason == "stop"
        assert after.failovers >= 1 and after.replica != done.replica
        assert text == whole
