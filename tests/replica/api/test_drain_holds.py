"""A draining replica's exit waits for the proxies' holds (replica.api.drain.Holds), socket-free:
a hold let go or run out ends the wait, the deadline bounds it, and `first` waits for a hold to
be taken (an idle replica's drain gives the proxies that long to ask for its hot chains)."""

from __future__ import annotations

import asyncio
from time import perf_counter

import pytest

from replica.api.drain import Holds

pytestmark = pytest.mark.anyio


async def test_the_wait_ends_when_every_hold_is_let_go():
    holds = Holds()
    a, b = holds.take(30), holds.take(30)
    assert a != b and holds.taken == 2
    waiting = asyncio.ensure_future(holds.wait(perf_counter() + 30))
    await asyncio.sleep(0)
    assert holds.release(a) and not waiting.done()
    await asyncio.sleep(0)
    assert not waiting.done()  # b still holds
    assert holds.release(b)
    await asyncio.wait_for(waiting, 5)
    assert not holds.release(b)  # let go already


async def test_a_hold_runs_out_and_the_deadline_bounds_the_wait():
    holds = Holds()
    holds.take(0.05)
    t0 = perf_counter()
    await asyncio.wait_for(holds.wait(t0 + 30), 5)
    assert perf_counter() - t0 >= 0.05
    holds.take(30)
    t0 = perf_counter()
    await asyncio.wait_for(holds.wait(t0 + 0.05), 5)  # the drain's own bound
    assert perf_counter() - t0 >= 0.05


async def test_first_waits_for_a_hold_to_be_taken_or_its_bound():
    holds = Holds()
    t0 = perf_counter()
    await holds.first(t0 + 0.05)
    assert perf_counter() - t0 >= 0.05 and holds.taken == 0
    asking = asyncio.ensure_future(holds.first(perf_counter() + 30))
    await asyncio.sleep(0)
    holds.take(1)
    await asyncio.wait_for(asking, 5)
