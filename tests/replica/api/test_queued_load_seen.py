"""A real replica's Load names, on each proxy connection, the last Generate it had received from
that proxy (`Load.seen_id`): what its running and waiting count of that proxy's requests
(edge_proxy.pool.ReplicaConn._counted). One Load goes to every connection; each gets its own."""

from __future__ import annotations

import asyncio

import pytest
from websockets.asyncio.client import connect

from wire import protocol as P
from tests.replica.server import AUTH, replica_server
from tests.replica.ws_client import ReplicaWS, ws_url

pytestmark = pytest.mark.timeout(300)
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 28, 2, 198, 1, 520, 9531, 198]
SAMPLING = P.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)  # x and y run on while z comes


async def busy_loads(c: ReplicaWS, n: int) -> list[P.Load]:
    """Its Loads until the first that counts `n` requests (the first one accepted counts them)."""
    out = []
    while not out or out[-1].running + out[-1].waiting < n:
        out += [m for m in await c.recv() if isinstance(m, P.Load)]
    return out


async def loads_seen(url: str) -> tuple[list[P.Load], list[P.Load], P.Load, P.Load]:
    async with connect(ws_url(url), max_size=None, additional_headers=AUTH) as a_ws, \
            connect(ws_url(url), max_size=None, additional_headers=AUTH) as b_ws:
        a, b = ReplicaWS(a_ws), ReplicaWS(b_ws)
        await asyncio.gather(a.wait_idle(), b.wait_idle())
        await a.send(P.Generate("x", PROMPT, SAMPLING), P.Generate("y", PROMPT[::-1], SAMPLING))
        a_loads, b_loads = await asyncio.gather(busy_loads(a, 2), busy_loads(b, 2))
        await b.send(P.Generate("z", PROMPT[1:], SAMPLING))
        a_then, b_then = await asyncio.gather(busy_loads(a, 3), busy_loads(b, 3))
        await asyncio.gather(a.collect(["x", "y"]), b.collect(["z"]))
        return a_loads, b_loads, a_then[-1], b_then[-1]


def test_each_connection_is_told_the_last_of_its_own_requests_counted():
    with replica_server("--kv-memory-gb", "0.25") as (url, _):
        a_loads, b_loads, a_then, b_then = asyncio.run(loads_seen(url))
    # the Load that counts both of a's names the later; every Load before it counted fewer, named less
    assert a_loads[-1].seen_id == "y" and all(ld.seen_id in ("", "x") for ld in a_loads[:-1])
    assert {ld.seen_id for ld in b_loads} == {""}  # the same Loads, to a connection that sent nothing
    assert (a_then.seen_id, b_then.seen_id) == ("y", "z")
