"""examples/autocomplete.py against a proxy over a real default-model replica: 20 keystrokes
50 ms apart, each a request replacing the previous one. At no moment does the replica run
more than one of them (its running count, reported after every step that admits, aborts or
finishes a request), the last keystroke's suggestion arrives, and every request that
reached the replica's engine found the shared full blocks of the previous prompt the engine
computed in its prefix cache. A request's done reports its cache hit once its first token
came (every completed one, and replaced ones that got that far); the first keystroke's
request meets an idle engine, so its prompt is always computed. On a loaded CPU a step
takes about as long as a keystroke interval, so most keystrokes are replaced before
their first token (some while still queued behind a step, costing the engine nothing)."""

from __future__ import annotations

import asyncio

import pytest

from edge_proxy.client import EdgeClient
from examples.autocomplete import SAMPLE, Autocomplete, type_text
from replica.tokenizer import Tokenizer
from tests.edge_proxy.live import proxy
from tests.examples.running import ReplicaRunning

pytestmark = [pytest.mark.anyio, pytest.mark.slow, pytest.mark.timeout(300)]
BLOCK = 16


def common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


async def test_twenty_keystrokes_one_request_at_a_time(default_replica):
    start = SAMPLE.index("for _ in")
    with proxy([default_replica], "--allow-anonymous") as (port, _):
        async with await EdgeClient.connect(f"ws://127.0.0.1:{port}/v1/stream") as c, \
                ReplicaRunning(default_replica) as running:
            ac = Autocomplete(c, debounce_ms=10, max_tokens=16)
            assert await type_text(ac, SAMPLE, start, 20, 0.05) == start + 20
            await asyncio.wait_for(ac.settle(), 60)
            samples = running.since(0)

    reqs = ac.requests
    assert len(reqs) == 20 and [p for _, _, p in reqs] == [SAMPLE[:start + k] for k in range(1, 21)]
    assert samples and max(samples) <= 1 and 1 in samples  # never two at once on the replica
    last = reqs[-1][0]
    assert last.done.finish_reason in ("stop", "length") and ac.suggestions[-1].prefix == SAMPLE[:start + 20]
    assert "\n" not in ac.suggestions[-1].text and last.done.usage.completion_tokens <= 16
    assert all(r.done.finish_reason == "abort" for r, _, _ in reqs[:-1] if r.done.usage.completion_tokens == 0)

    tok = Tokenizer.from_spec("default")
    ids = [list(tok.encode(p)) for _, _, p in reqs]
    computed = [0] + [k for k in range(1, 20) if reqs[k][0].tokens]  # prefills known to have run
    assert computed[-1] == 19
    for j, k in zip(computed, computed[1:]):  # each against the latest earlier prompt known computed
        want = common(ids[j], ids[k]) // BLOCK * BLOCK
        assert want >= BLOCK and reqs[k][0].done.usage.cached_tokens >= want, (j, k, reqs[k][0].done.usage)
    print(f"{len(computed) - 1} of 19 keystroke requests got a first token before the next keystroke")
