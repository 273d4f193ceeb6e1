"""examples/voice_agent.py against a proxy over a real default-model replica: a reply is
spoken sentence by sentence; the user barges in mid-reply. The old request's work on the
replica stops within one engine step (the replica's running count, reported after every
step that admits, aborts or finishes a request, never shows both), the new reply's first
token arrives, and the words that were spoken are in the next prompt and served from the
replica's prefix cache."""

from __future__ import annotations

import asyncio
from time import perf_counter

import pytest

from edge_proxy.client import EdgeClient
from examples.voice_agent import VoiceAgent, split_sentences
from replica.tokenizer import Tokenizer
from tests.edge_proxy.live import proxy
from tests.examples.running import ReplicaRunning

pytestmark = [pytest.mark.anyio, pytest.mark.slow, pytest.mark.timeout(300)]
BLOCK = 16  # the replica's default block size


def test_sentences_split_where_speech_can_pause():
    assert split_sentences("Hi there. How are") == (["Hi there."], " How are")
    assert split_sentences("One! Two? Three.\nFour 3.5 ") == (["One!", " Two?", " Three.", "\n"], "Four 3.5 ")


def full_blocks(n: int) -> int:
    return n // BLOCK * BLOCK


def common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


async def test_barge_in_replaces_the_turn_and_keeps_what_was_spoken(default_replica):
    with proxy([default_replica], "--allow-anonymous") as (port, _):
        async with await EdgeClient.connect(f"ws://127.0.0.1:{port}/v1/stream") as c, \
                ReplicaRunning(default_replica) as running:
            agent = VoiceAgent(c, "You are a storyteller. Tell long, detailed stories.", words_per_s=40.0,
                               max_tokens=300, temperature=0.0)
            first = await agent.say("Tell me a long story about a brave knight who guards a castle.")
            await asyncio.wait_for(first.speaker.until_words(24), 60)
            assert not first.request.finished and first.time_to_first_sentence_ms > 0
            assert len(first.sentences) >= 1
            asked = list(agent.history)
            assert running.since(0) and running.since(0)[-1] == 1
            t_barge = perf_counter()
            second = await agent.barge_in("Stop. Tell me about a dragon instead.")
            await asyncio.wait_for(second.first_token.wait(), 60)
            at_first = await running.read()
            await asyncio.wait_for(agent.wait(), 120)

        _, done_old = await first.request.result()
        assert done_old.finish_reason == "abort"
        # The replica never ran both: the Abort was applied before the step that admitted the new turn.
        assert max(running.since(t_barge)) <= 1 and at_first <= 1
        assert second.barge_in_to_first_token_ms > 0 and second.request.done.finish_reason in ("stop", "length")

        spoken = agent.history[2]["content"]
        assert agent.history[:2] == asked and agent.history[3]["content"].startswith("Stop.")
        assert agent.history[2]["role"] == "assistant" and spoken and first.request.text.startswith(spoken)
        assert len(spoken) < len(first.request.text)  # only what was said, not all that was generated

        tok = Tokenizer.from_spec("default")
        old_prompt = list(tok.encode_chat(asked))
        held = old_prompt + first.request.ids[:-1]  # the KV the replica computed for the old turn
        new_prompt = list(tok.encode_chat(agent.history[:4]))
        shared = common(held, new_prompt)
        assert full_blocks(shared) > full_blocks(len(old_prompt))  # the spoken words fill blocks of their own
        assert second.request.done.usage.cached_tokens >= full_blocks(shared)
