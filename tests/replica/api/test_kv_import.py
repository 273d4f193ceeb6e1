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

BS, BB = 4, 8  # block size, bytes a block
SPEC = P.KvSpec(model="m:1", dtype="float16", block_size=BS, num_layers=1, num_kv_heads=1, head_dim=2, row=2,
                block_bytes=BB)
IDS = list(range(1, 18))  # 4 full blocks
HASHES = block_hashes(IDS, BS)


class Engine:
    """EngineClient's part a pull uses: its spec, its cache mirror, kv_call."""

    def __init__(self, cached=()):
        self.kv_spec, self.cached_blocks, self.written = SPEC, set(cached), []

    async def kv_call(self, msg):
        self.written.append(list(msg.hashes))
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
