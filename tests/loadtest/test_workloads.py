"""Workloads: prompt files load, mixes parse, sessions are repeatable per seed and do what they say."""

import asyncio
import random

import pytest

from loadtest import workloads as W

pytestmark = pytest.mark.anyio


class FakeCall:
    def __init__(self, kw):
        self.kw, self.text, self.error, self.t_cancel = kw, "ok", None, 0.0
        self.cancelled = False

    async def cancel(self):
        self.cancelled = True
        self.t_cancel = 1.0


class FakeUser:
    """Records what a workload asks for; answers at once."""

    def __init__(self, budget=100):
        self.calls, self.thinks, self.budget = [], [], budget

    async def think(self, s):
        self.thinks.append(s)
        return True

    async def start(self, replaces=None, **kw):
        if self.budget == 0:
            return None
        self.budget -= 1
        if replaces is not None:
            kw["replaces"] = self.calls.index(replaces)  # comparable across runs
        c = FakeCall(kw)
        self.calls.append(c)
        return c

    async def request(self, cancel_after_tokens=None, **kw):
        c = await self.start(**kw)
        if c is not None and cancel_after_tokens is not None:
            await c.cancel()
        return c

    async def supersede(self, c):
        await c.cancel()

    async def finish(self, c):
        pass


def test_corpus_and_mix():
    c = W.load_corpus()
    assert len(c.system_prompts) >= 3 and all(len(p.split()) > 150 for p in c.system_prompts)
    assert len(c.snippets) >= 3 and len(c.words) > 500
    assert W.parse_mix("chat,voice") == {"chat": 0.5, "voice": 0.5}
    assert W.parse_mix("chat=3, random=1") == {"chat": 0.75, "random": 0.25}
    for bad in ("", "chat=0", "nope", "chat=x"):
        with pytest.raises(ValueError):
            W.parse_mix(bad)


async def run(name, seed, knobs=None):
    u = FakeUser()
    await W.WORKLOADS[name](u, random.Random(seed), W.load_corpus(), knobs or W.Knobs())
    return u


@pytest.mark.parametrize("name", list(W.WORKLOADS))
async def test_sessions_are_repeatable(name):
    a, b, c = await run(name, 1), await run(name, 1), await run(name, 2)
    assert [x.kw for x in a.calls] == [x.kw for x in b.calls] and a.thinks == b.thinks
    assert [x.kw for x in a.calls] != [x.kw for x in c.calls]


async def test_chat_history_grows():
    u = await run("chat", 3)
    lens = [len(c.kw["messages"]) for c in u.calls]
    assert len(lens) >= 2 and lens == sorted(lens) and lens[1] == lens[0] + 2
    assert u.calls[1].kw["messages"][2]["role"] == "assistant"


async def test_shared_prefix_uses_a_shared_system_prompt():
    systems = {(await run("shared-prefix", s)).calls[0].kw["messages"][0]["content"] for s in range(20)}
    assert 1 < len(systems) <= len(W.load_corpus().system_prompts)


async def test_autocomplete_replaces_the_previous_keystroke():
    u = await run("autocomplete", 5)
    assert len(u.calls) >= 6
    assert all(c.kw["max_tokens"] <= 16 and c.kw["deadline_ms"] > 0 and c.kw["stop"] == ["\n"] for c in u.calls)
    prompts = [c.kw["prompt"] for c in u.calls]
    assert all(len(b) >= len(a) for a, b in zip(prompts, prompts[1:]) if b.startswith(a[:10]))
    replaced = [c.kw["replaces"] for c in u.calls if "replaces" in c.kw]
    assert len(replaced) >= len(u.calls) - 4  # all but each burst's first
    assert all(u.calls[i + 1].kw.get("replaces") == i for i in replaced)  # always the keystroke before


async def test_voice_barge_in_and_nonce():
    u = await run("voice", 0, W.Knobs(voice_barge_in=1.0, nonce="run-7"))
    assert all(c.cancelled for c in u.calls)
    assert all(c.kw["messages"][0]["content"].startswith("[run-7]") for c in u.calls)
    u = await run("voice", 0, W.Knobs(voice_barge_in=0.0))
    assert not any(c.cancelled for c in u.calls)


async def test_random_lengths_within_bounds():
    for s in range(10):
        u = await run("random", s, W.Knobs(input_words=(5, 9), output_tokens=(3, 4)))
        (c,) = u.calls
        assert 5 <= len(c.kw["messages"][0]["content"].split()) <= 9 and 3 <= c.kw["max_tokens"] <= 4


async def test_no_budget_ends_a_session():
    u = FakeUser(budget=0)
    await W.chat(u, random.Random(0), W.load_corpus(), W.Knobs())
    assert u.calls == []
    await asyncio.sleep(0)
