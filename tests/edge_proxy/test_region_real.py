"""One region, two proxies, two real replicas (default model): a conversation whose turns
alternate between the proxies finds its cache on every later turn, with and without a
session id, although neither proxy saw the turn before it (issue 44)."""

from __future__ import annotations

import asyncio

import pytest

from edge_proxy.client import EdgeClient
from tests.edge_proxy.two_replicas import region

pytestmark = pytest.mark.timeout(400)
QUESTIONS = ["What is the capital of France?", "Name a planet in the solar system.", "What color is the sky?",
             "Who wrote Hamlet?"]
FOLLOWUPS = ["Why?", "Tell me more.", "Are you sure?"]


async def conversations(urls: list[str]) -> list[list]:
    """Four conversations of four turns, turn n of conversation k through proxy (k + n) mod 2;
    the even ones with a session id. Returns each conversation's Done messages."""
    clients = [await EdgeClient.connect(u) for u in urls]
    try:
        async def one(k: int, q: str) -> list:
            msgs, out = [{"role": "user", "content": q}], []
            for n in range(4):
                c = clients[(k + n) % 2]
                text, d = await c.complete(messages=msgs, max_tokens=16, temperature=0,
                                           session=f"conv-{k}" if k % 2 == 0 else None)
                out.append(d)
                msgs = msgs + [{"role": "assistant", "content": text},
                               {"role": "user", "content": FOLLOWUPS[n % len(FOLLOWUPS)]}]
            return out

        return await asyncio.gather(*(one(k, q) for k, q in enumerate(QUESTIONS)))
    finally:
        for c in clients:
            await c.close()


def test_turns_through_two_proxies_are_cached_on_real_replicas():
    with region(2) as (urls, _):
        for k, dones in enumerate(asyncio.run(conversations(urls))):
            assert len({d.replica for d in dones}) == 1, (k, [d.replica for d in dones])
            for d in dones[1:]:
                assert d.usage.cached_tokens >= 16, (k, [d.usage.cached_tokens for d in dones])
