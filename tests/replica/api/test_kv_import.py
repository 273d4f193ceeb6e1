"""The receiver's checks of a KV pull (replica.api.kv_import), socket-free: a source stream made by
hand, an engine that records what reaches it. A frame reaches the engine only whole and verified;
the first bad one ends the pull with a message naming it."""

from __future__ import annotations

import asyncio

import msgspec

from wire import protocol as P
from wire.hashing import block_hashes
from wire.kv_frames import KvEnd, KvFrame, KvPull, StreamCodec, block_digest
from replica.api import kv_import
from replica.api.kv_transport import KvTransportError
from tests.replica.slot_engines import engine_holds, mapped_slots

BS, BB = 4, 8  # block size, bytes a block
SPEC = P.KvSpec(model="m:1", dtype="float16", block_size=BS, num_layers=1, num_kv_heads=1, head_dim=2, row=2,
                block_bytes=BB)
IDS = list(range(1, 18))  # 4 full blocks
HASHES = block_hashes(IDS, BS)


class Engine:
    """EngineClient's part a pull uses: its spec, its cache mirror, its KV slots, kv_call (the bytes each
    write's slot holds recorded)."""

    def __init__(self, cached=(), slot_blocks: int = 8):
        self.kv_spec, self.cached_blocks, self.written = SPEC, set(cached), []
        self.named: list[tuple[int, int, list[int]]] = []  # each write's (prev, start, ids)
        self.bytes: list[bytes] = []
        self.kv_slots = mapped_slots(BB, count=4, slot_blocks=slot_blocks)

    async def kv_call(self, msg, lease=None):
        with engine_holds(lease):
            return self.take(msg)

    def take(self, msg) -> P.KvWritten:
        self.written.append(list(msg.hashes))
        self.named.append((msg.prev, msg.start, list(msg.ids)))
        self.bytes.append(bytes(self.kv_slots.map.view(msg.slot, len(msg.hashes) * BB)))
        return P.KvWritten(id="", stored=len(msg.hashes))


def frame(start: int, n: int, *, hashes=None, data=None) -> KvFrame:
    data = data if data is not None else bytearray(bytes([start + i for i in range(n) for _ in range(BB)]))
    return KvFrame(start=start, hashes=hashes or HASHES[start: start + n],
                   digests=[block_digest(data[i * BB: (i + 1) * BB]) for i in range(n)], data=data)


class Transport:
    def __init__(self, *msgs, error: str = ""):
        self.msgs, self.error, self.asked = msgs, error, None

    async def fetch(self, source, req):
        self.asked = req
        for m in self.msgs:
            yield m
        if self.error:
            raise KvTransportError(self.error)


def pull(engine, transport, **kw):
    return asyncio.run(kv_import.pull(engine, transport, KvPull(source="http://src", token_ids=IDS, **kw)))


def test_whole_frames_are_cached_and_only_the_missing_blocks_asked():
    e = Engine(cached=HASHES[:1])
    t = Transport(SPEC, frame(1, 2), frame(3, 1), KvEnd(blocks=3))
    res = pull(e, t, frame_blocks=2)
    assert (res.status, res.complete, res.cached, res.imported, res.blocks) == (200, True, 1, 3, 4)
    assert t.asked.start == 1 and e.written == [HASHES[1:3], HASHES[3:4]]
    assert b"".join(e.bytes) == bytes(frame(1, 2).data + frame(3, 1).data)  # what the engine found in the slots
    assert e.kv_slots.free == 4  # each write's slot lent again once the engine answered


def test_a_frame_larger_than_a_slot_goes_in_a_write_a_slot():
    e = Engine(slot_blocks=3)
    res = pull(e, Transport(SPEC, frame(0, 4), KvEnd(blocks=4)))
    assert res.complete and res.imported == 4 and e.written == [HASHES[:3], HASHES[3:]]
    assert e.named == [(0, 0, IDS[:12]), (HASHES[2], 3, IDS[12:16])] and b"".join(e.bytes) == bytes(frame(0, 4).data)


def test_each_write_names_its_blocks_ids_and_where_they_sit_in_the_chain():
    e = Engine()
    res = pull(e, Transport(SPEC, frame(0, 2), frame(2, 2), KvEnd(blocks=4)), frame_blocks=2)
    assert res.complete and e.named == [(0, 0, IDS[:8]), (HASHES[1], 2, IDS[8:16])]


def test_a_chain_named_by_its_seed_is_checked_against_the_hashes_from_that_seed():
    seed = 0xDEADBEEF12345678  # a salt's seed (a hot chain's source lists it so, never the salt)
    chained = block_hashes(IDS, BS, prev=seed)
    e = Engine()
    t = Transport(SPEC, frame(0, 4, hashes=chained), KvEnd(blocks=4))
    res = pull(e, t, seed=seed)
    assert res.complete and res.imported == 4 and t.asked.seed == seed
    assert e.written == [chained] and e.named[0][:2] == (seed, 0)
    unsalted = pull(Engine(), Transport(SPEC, frame(0, 4), KvEnd(blocks=4)), seed=seed)
    assert unsalted.status == 502 and "another prompt or salt" in unsalted.error


def test_each_bad_frame_is_refused_before_the_engine_sees_it():
    bad_digest = frame(0, 2)
    bad_digest.data[3] ^= 1
    cases = {
        "digest": bad_digest,
        "another prompt or salt": frame(0, 2, hashes=block_hashes(IDS, BS, salt="other")[:2]),
        "next expected is 0": frame(1, 1),
        "holds 15 bytes": frame(0, 2, data=bytearray(15)),
    }
    for needle, bad in cases.items():
        e = Engine()
        res = pull(e, Transport(SPEC, bad, KvEnd(blocks=2)))
        assert res.status == 502 and needle in res.error and res.imported == 0 and e.written == [], needle


def test_a_mismatch_is_refused_with_every_difference_named():
    e = Engine()
    res = pull(e, Transport(msgspec.structs.replace(SPEC, dtype="int8", row=6, block_bytes=24), frame(0, 1)))
    assert res.status == 409 and e.written == []
    assert "dtype 'float16' here, 'int8' there" in res.error and "row 2 here, 6 there" in res.error


def test_a_broken_stream_keeps_the_whole_frames_before_it():
    e = Engine()
    res = pull(e, Transport(SPEC, frame(0, 2), error="the export stream from http://src broke: ReadError"))
    assert res.status == 502 and "broke" in res.error and res.imported == 2 and not res.complete
    e = Engine()
    res = pull(e, Transport(SPEC, frame(0, 2)))  # ended between frames, without its KvEnd
    assert res.status == 502 and "without its KvEnd" in res.error and res.imported == 2


def test_a_source_that_had_fewer_blocks_says_why():
    res = pull(Engine(), Transport(SPEC, frame(0, 1), KvEnd(blocks=1, reason="block 1 is not cached here")))
    assert res.status == 200 and not res.complete and "block 1 is not cached" in res.error


class StalledTransport:
    """A source that sends its spec and one frame, then nothing (a source too slow for the pull's bound)."""

    def __init__(self):
        self.closed = False

    async def fetch(self, source, req):
        try:
            yield SPEC
            yield frame(0, 2)
            await asyncio.Event().wait()  # never set: the source sends nothing more
        finally:
            self.closed = True


def test_a_pull_past_its_timeout_answers_504_with_the_blocks_cached_and_stops_fetching():
    e, t = Engine(), StalledTransport()
    res = pull(e, t, timeout_ms=50)
    assert res.status == 504 and "50 ms ran out after 2 of 4 blocks" in res.error
    assert (res.imported, res.complete, e.written) == (2, False, [HASHES[:2]])
    assert t.closed  # the export stream was closed at the bound (the source's export ends), not left to the GC


def test_the_stream_codec_returns_only_whole_messages():
    codec = StreamCodec()
    wire = codec.pack(SPEC) + codec.pack(frame(0, 2)) + codec.pack(KvEnd(blocks=2))
    got = []
    for i in range(0, len(wire), 7):
        got += codec.feed(wire[i: i + 7])
    assert [type(m) for m in got] == [P.KvSpec, KvFrame, KvEnd] and got[1] == frame(0, 2) and codec.pending == 0
    assert codec.feed(wire[:10]) == [] and codec.pending == 10


class SlowEngine(Engine):
    """An engine that answers each KvBlocks only when the test says so (its step boundary)."""

    def __init__(self):
        super().__init__()
        self.pending: list[asyncio.Future] = []
        self.asked = asyncio.Event()

    async def kv_call(self, msg, lease=None):
        with engine_holds(lease):
            self.written.append(list(msg.hashes))
            fut = asyncio.get_running_loop().create_future()
            self.pending.append(fut)
            self.asked.set()
            await fut
            return P.KvWritten(id="", stored=len(msg.hashes))


def test_several_frames_are_in_the_engine_at_once_and_counted_in_order():
    async def go():
        e = SlowEngine()
        t = Transport(SPEC, *(frame(i, 1) for i in range(4)), KvEnd(blocks=4))
        task = asyncio.ensure_future(kv_import.pull(e, t, KvPull(source="http://src", token_ids=IDS, frame_blocks=1)))
        while len(e.pending) < min(4, kv_import.WRITES_AHEAD):  # every frame asked before the first is answered
            e.asked.clear()
            await asyncio.wait_for(e.asked.wait(), 5)
        assert not task.done() and not any(f.done() for f in e.pending)
        while not task.done():  # one boundary answers whatever is pending
            for f in e.pending:
                if not f.done():
                    f.set_result(None)
            await asyncio.sleep(0)
        return e, task.result()

    e, res = asyncio.run(go())
    assert (res.status, res.complete, res.imported) == (200, True, 4) and e.written == [[h] for h in HASHES]


class FailingEngine(Engine):
    """Caches blocks until `fail_at` (a frame's first block), which it refuses (no room)."""

    def __init__(self, fail_at: int):
        super().__init__()
        self.fail_at = fail_at

    async def kv_call(self, msg, lease=None):
        with engine_holds(lease):
            self.written.append(list(msg.hashes))
            await asyncio.sleep(0)  # answered a loop turn later: the next frame is already in flight
            if msg.hashes[0] == HASHES[self.fail_at]:
                return P.KvWritten(id="", error="no room")
            return P.KvWritten(id="", stored=len(msg.hashes))


def test_a_refused_write_counts_the_frames_before_it_only():
    res = pull(FailingEngine(1), Transport(SPEC, *(frame(i, 1) for i in range(4)), KvEnd(blocks=4)), frame_blocks=1)
    assert res.status == 503 and "blocks 1.." in res.error and "no room" in res.error
    assert (res.imported, res.complete) == (1, False)


def test_a_seed_is_a_64_bit_chain_seed():
    body = b'{"source": "http://src", "token_ids": [1], "seed": %d}'
    assert msgspec.json.decode(body % (2**64 - 1), type=KvPull).seed == 2**64 - 1
    for bad in (2**64, -1):
        try:
            msgspec.json.decode(body % bad, type=KvPull)
        except msgspec.ValidationError as e:
            assert "seed" in str(e)
        else:
            raise AssertionError(f"seed {bad} decoded")
