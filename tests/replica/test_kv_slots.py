"""The KV slots a replica's API process shares with its engine (replica.kv_slots): the segment's
geometry, one segment seen by two maps, and the lending rule that keeps a slot's bytes whole (free
only once its holder let go and the engine answered the command naming it)."""

from __future__ import annotations

import asyncio
import os

from replica.kv_slots import MAX_SEGMENT_BYTES, MAX_SLOTS, SLOT_BLOCKS, SlotMap, geometry
from tests.replica.slot_engines import mapped_slots


def test_a_slot_holds_an_export_frame_and_the_segment_stays_bounded():
    assert geometry(368_640) == (MAX_SLOTS, SLOT_BLOCKS * 368_640)  # the default model's fp16 blocks: 47 MB
    assert geometry(2 << 20) == (MAX_SLOTS, SLOT_BLOCKS * (2 << 20))  # the 8B shape's: 256 MB
    assert geometry(100 << 20) == (2, MAX_SEGMENT_BYTES // 2)  # blocks too large for 8 a slot: two slots of 2
    assert geometry(300 << 20) == (2, 300 << 20)  # and never less than a block a slot


def test_what_one_map_writes_the_other_reads():
    slots = mapped_slots(block_bytes=16, count=3, slot_blocks=2)
    other = SlotMap(slots.fd, 3, 32)  # the engine's map of the same fd
    other.view(2, 32)[:] = bytes(range(32))
    assert slots.map.view(2, 32) == bytes(range(32)) and slots.map.view(1, 32) == bytes(32)
    for bad in ((3, 1), (0, 33), (-1, 1)):
        try:
            slots.map.view(*bad)
        except ValueError as e:
            assert "slot" in str(e)
        else:
            raise AssertionError(f"view {bad} given")


def test_a_segment_smaller_than_its_geometry_is_refused():
    slots = mapped_slots(block_bytes=16, count=2, slot_blocks=1)
    try:
        SlotMap(os.dup(slots.fd), 4, 16)
    except ValueError as e:
        assert "4 slots of 16 wanted" in str(e)
    else:
        raise AssertionError("mapped past the segment's end")


def test_a_slot_given_up_on_stays_the_engines_until_it_answers():
    async def go():
        slots = mapped_slots(block_bytes=8, count=1, slot_blocks=1)
        first = await slots.lease()
        first.sent()  # a KvRead naming it went to the engine
        first.release()  # its export was cancelled: the caller lets go before the answer
        waiting = asyncio.ensure_future(slots.lease())
        await asyncio.sleep(0)
        assert not waiting.done() and slots.free == 0  # the engine may still copy into it
        first.answered()
        second = await asyncio.wait_for(waiting, 5)
        assert second.index == 0
        second.answered()  # an answer alone does not free it: its holder still reads it
        assert slots.free == 0
        second.release()
        assert slots.free == 1

    asyncio.run(go())


def test_waiters_are_served_in_order_and_a_cancelled_one_passes_its_slot_on():
    async def go():
        slots = mapped_slots(block_bytes=8, count=1, slot_blocks=1)
        held = await slots.lease()
        a, b, c = (asyncio.ensure_future(slots.lease()) for _ in range(3))
        await asyncio.sleep(0)
        held.release()  # handed to a
        a.cancel()  # cancelled with the slot in hand: b gets it
        await asyncio.sleep(0)
        assert a.cancelled() and (await asyncio.wait_for(b, 5)).index == 0 and not c.done()
        b.result().release()
        (await asyncio.wait_for(c, 5)).release()
        assert slots.free == 1

    asyncio.run(go())
