"""A real replica on the default model started with an EAGLE-3 head in the published layout
(`python -m replica --speculative eagle3 --spec-head DIR`, speculative/published.py): its greedy
answer is the plain replica's (`--speculative off`) token for token, and the head drafted.

The head's draft vocabulary is one target token -- the one the plain answer repeats most --
so whatever its weights, it drafts that token at every step and each repeat after the first
token is an accepted draft: the usage's accepted draft tokens say the head drafted through the
served path. (Under `auto` this CPU's measured policy may keep speculation off; the test asks
for eagle3 and the taper explicitly.)"""

from __future__ import annotations

import asyncio
import collections

import torch
from websockets.asyncio.client import connect

from replica.hf_checkpoint import model_config
from tests.replica.server import AUTH, replica_server
from tests.replica.ws_client import ReplicaWS, ws_url
from tests.speculative.published_heads import own_head, write_published
from wire import protocol as P

CHAT = "List five fruits, one per line, each with its colour."
MAX_TOKENS = 40


async def _answer(url: str, prompt: list[int]) -> tuple[list[int], P.Finished]:
    async with connect(ws_url(url), max_size=None, additional_headers=AUTH) as ws:
        c = ReplicaWS(ws)
        await c.send(P.Generate(id="q", prompt_ids=prompt, sampling=P.SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)))
        ids, _, final = (await c.collect(["q"]))["q"]
        return ids, final


def answer(url: str, prompt: list[int]) -> tuple[list[int], P.Finished]:
    return asyncio.run(asyncio.wait_for(_answer(url, prompt), 120))


def test_a_replica_serves_a_published_head_and_answers_as_plain_decoding(tmp_path):
    from replica.tokenizer import Tokenizer

    prompt = Tokenizer.from_spec("default").encode_chat([{"role": "user", "content": CHAT}])
    with replica_server("--kv-memory-gb", "0.25", "--speculative", "off") as (url, _):
        plain, _ = answer(url, prompt)
    assert len(plain) == MAX_TOKENS
    token, repeats = collections.Counter(plain[1:]).most_common(1)[0]
    assert repeats >= 3, "the prompt's answer should repeat a token (newlines, commas)"

    target = model_config("default")
    head = own_head(target, torch.zeros(target.vocab_size, target.hidden_size), torch.tensor([token]))
    folder = write_published(head, target, tmp_path / "head")
    with replica_server("--kv-memory-gb", "0.25", "--speculative", "eagle3", "--spec-head", str(folder),
                        "--spec-policy", "taper") as (url, _):
        spec, final = answer(url, prompt)
    assert spec == plain
    assert 0 < final.usage.accepted_draft_tokens <= repeats
