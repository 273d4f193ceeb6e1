"""replica.api.frame_split finds a frame's messages without recursion: the same boundaries
msgspec finds, on seeded random msgpack of every type; truncation is an error; a
message nested 100,000 levels deep does not hide its neighbours."""

import random

import msgspec
import pytest

from replica.api.frame_split import split_frame


def value(rng: random.Random, depth: int = 0):
    kinds = [lambda: None, lambda: rng.random() < 0.5, lambda: rng.random() * 1e300,
             lambda: rng.randrange(-2**63, 2**64), lambda: "s" * rng.choice([0, 5, 31, 32, 255, 256, 70_000]),
             lambda: b"b" * rng.choice([0, 255, 256, 70_000]),
             lambda: msgspec.msgpack.Ext(3, b"x" * rng.choice([1, 2, 4, 8, 16, 3, 300, 70_000])),
             lambda: [value(rng, depth + 1) for _ in range(rng.choice([0, 3, 15, 16, 40]))],
             lambda: {str(i): value(rng, depth + 1) for i in range(rng.choice([0, 3, 15, 16, 20]))}]
    return kinds[rng.randrange(len(kinds) if depth < 3 else len(kinds) - 2)]()


@pytest.mark.parametrize("seed", range(4))
def test_boundaries_match_msgspec(seed):
    rng = random.Random(seed)
    for _ in range(50):
        msgs = [value(rng) for _ in range(rng.choice([0, 1, 15, 16, 40]))]
        data = msgspec.msgpack.encode(msgs)
        assert [msgspec.msgpack.decode(p) for p in split_frame(data)] == msgs
        for cut in {1, len(data) // 2, len(data) - 1}:
            if 0 < cut < len(data):
                with pytest.raises(ValueError):
                    split_frame(data[:cut])


def test_a_deep_message_keeps_its_neighbours():
    deep = b"\x93\xa8generate\xa4deep" + b"\x91" * 100_000 + b"\x90"
    frame = b"\x93" + msgspec.msgpack.encode(["abort", "a"]) + deep + msgspec.msgpack.encode(["abort", "b"])
    with pytest.raises(RecursionError):
        msgspec.msgpack.Decoder(list[msgspec.Raw]).decode(frame)  # why this module exists
    parts = split_frame(frame)
    assert msgspec.msgpack.decode(parts[0]) == ["abort", "a"] and msgspec.msgpack.decode(parts[2]) == ["abort", "b"]


@pytest.mark.parametrize("data", [b"", b"\x01", b"\x81\xa1a\x01", b"\x91\xc1", b"\x91\x01\x02", b"\xdc\x00"])
def test_not_a_frame(data):
    with pytest.raises(ValueError):
        split_frame(data)
