"""The source's half of a KV export (replica.api.kv_routes.KvRoutes._stream), socket-free: an
engine that answers KvReads when the test lets it. The export keeps READ_AHEAD reads asked of the
engine (the next frame is read while one is sent), sends the frames in order, and ends at the
first block not cached, with no read left behind."""

from __future__ import annotations

import asyncio

from wire import protocol as P
from wire.kv_frames import KvEnd, KvFrame, StreamCodec
from replica.api.kv_routes import READ_AHEAD, KvRoutes
from tests.replica.slot_engines import engine_holds, mapped_slots

BB = 8  # bytes a block
SPEC = P.KvSpec(model="m:1", dtype="float16", block_size=4, num_layers=1, num_kv_heads=1, head_dim=2, row=2,
                block_bytes=BB)


class Engine:
    """EngineClient.kv_call for KvRead: blocks cached are `cached` (a prefix of the hashes asked); block h's
    bytes, all h + 1, copied into the slot the read names."""

    def __init__(self, cached: int):
        self.cached, self.asked, self.in_flight, self.most, self.answered = cached, [], 0, 0, 0
        self.kv_slots = mapped_slots(BB, count=8, slot_blocks=3)

    async def kv_call(self, msg: P.KvRead, lease=None) -> P.KvBlocks:
        self.asked.append(msg.hashes)
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            with engine_holds(lease):
                await asyncio.sleep(0)  # answered a loop turn later, as the engine answers between its steps
                have = [h for h in msg.hashes if h < self.cached]
                self.kv_slots.map.view(msg.slot, len(have) * BB)[:] = bytes(h + 1 for h in have for _ in range(BB))
                self.answered += 1
                return P.KvBlocks(id=msg.id, hashes=have, slot=msg.slot)
        finally:
            self.in_flight -= 1


async def export(engine: Engine, blocks: int, per_frame: int) -> tuple[list, int]:
    """The export's messages, and the reads in flight a few loop turns after it ended."""
    codec, out = StreamCodec(), []
    async for chunk in KvRoutes._stream(engine, SPEC, list(range(blocks)), 0, per_frame):
        out += codec.feed(bytes(chunk))
    for _ in range(3):
        await asyncio.sleep(0)  # a read left running would answer meanwhile
    return out, engine.in_flight


def test_frames_come_in_order_with_reads_asked_ahead():
    e = Engine(cached=10)
    msgs, _ = asyncio.run(export(e, 10, 3))
    frames = [m for m in msgs if isinstance(m, KvFrame)]
    assert msgs[0] == SPEC and [f.start for f in frames] == [0, 3, 6, 9] and msgs[-1] == KvEnd(blocks=10)
    assert e.most == READ_AHEAD == 2 and e.asked == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert b"".join(f.data for f in frames) == bytes(h + 1 for h in range(10) for _ in range(BB))  # out of the slots
    assert e.kv_slots.free == 8  # each slot lent again as its frame was packed


def test_the_first_block_not_cached_ends_it_and_no_read_is_left_behind():
    e = Engine(cached=4)
    msgs, left = asyncio.run(export(e, 10, 3))
    assert [m.start for m in msgs if isinstance(m, KvFrame)] == [0, 3]
    assert msgs[-1].blocks == 4 and "block 4 is not cached here" in msgs[-1].reason
    assert e.answered == READ_AHEAD and left == 0  # those asked with the short one; the next cancelled, not left to run
    assert e.kv_slots.free == 8
