"""A real replica publishes its Load to every connected proxy the loop turn it accepts a
request (replica.api.queued_load), not after the engine's next step: a second proxy
connection sees the request waiting, with its uncached prompt tokens, before the first
connection sees any token of it; once served, nothing is left counted."""

from __future__ import annotations

import asyncio

import pytest
from websockets.asyncio.client import connect

from wire import protocol as P
from tests.replica.server import AUTH, replica_server
from tests.replica.ws_client import ReplicaWS, ws_url

pytestmark = pytest.mark.timeout(300)
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 28, 2, 198, 1, 520, 9531, 198]
SAMPLING = P.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


async def first_busy_load(c: ReplicaWS) -> P.Load:
    while True:
        for m in await c.recv():
            if isinstance(m, P.Load) and m.running + m.waiting > 0:
                return m


async def submit_seen_by_another(url: str, req_id: str) -> tuple[P.Load, list[str], P.Load]:
    """(the other connection's first Load counting the request, the first connection's message
    kinds until the request finished, the other's Load once idle again)."""
    async with connect(ws_url(url), max_size=None, additional_headers=AUTH) as a_ws, \
            connect(ws_url(url), max_size=None, additional_headers=AUTH) as b_ws:
        a, b = ReplicaWS(a_ws), ReplicaWS(b_ws)
        await asyncio.gather(a.wait_idle(), b.wait_idle())
        await a.send(P.Generate(req_id, PROMPT, SAMPLING))
        seen = await first_busy_load(b)
        kinds = []
        while "Finished" not in kinds:
            kinds += [type(m).__name__ for m in await a.recv() if not isinstance(m, P.KvEvents)]
        return seen, kinds, await b.wait_idle()


def test_a_second_connection_sees_a_request_waiting_before_its_first_token():
    with replica_server("--kv-memory-gb", "0.25") as (url, _):
        cold, kinds, idle = asyncio.run(submit_seen_by_another(url, "cold"))
        warm, _, _ = asyncio.run(submit_seen_by_another(url, "warm"))
    # the engine itself never reports a lone request waiting on an idle replica: it admits it in the step
    # it reads it, and reports after that step (running 1)
    assert (cold.running, cold.waiting, cold.waiting_tokens) == (0, 1, len(PROMPT))
    assert kinds.index("Load") < kinds.index("Tokens")  # the first connection too, before its token
    assert (idle.running, idle.waiting, idle.waiting_tokens) == (0, 0, 0)
    # the prompt's full block is cached now (the API process's mirror of the prefix cache): only the rest
    assert (warm.running, warm.waiting, warm.waiting_tokens) == (0, 1, len(PROMPT) - 16)
