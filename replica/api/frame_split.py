"""Split a msgpack frame (an array of messages) into its messages without recursion.

msgspec parses nested values recursively, so one message nested a few thousand
levels deep makes decoding the whole frame fail with RecursionError, and with it
every other message of the frame. This walks the encoding iteratively instead,
counting the values still to skip, so each message can be decoded, and fail, on
its own. Only used when the fast path (`msgspec.Raw` per message) fails that way.
"""

from __future__ import annotations

import struct

_U16, _U32 = struct.Struct(">H"), struct.Struct(">I")
# Fixed payload sizes after the type byte (nil, bool, numbers, fixext: 1 type byte + data).
_FIXED = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2,
          0xD2: 4, 0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}
# Length-prefixed payloads: (bytes of the length, extra bytes before the payload: ext's type).
_SIZED = {0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0), 0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1), 0xD9: (1, 0),
          0xDA: (2, 0), 0xDB: (4, 0)}
_CONTAINERS = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}  # (bytes of the count, values per item)


def _uint(data, pos: int, size: int) -> int:
    if size == 1:
        return data[pos]
    return (_U16 if size == 2 else _U32).unpack_from(data, pos)[0]


def _skip(data, pos: int) -> int:
    """The position just past the value starting at `pos`."""
    pending = 1
    end = len(data)
    while pending:
        if pos >= end:
            raise ValueError("truncated msgpack value")
        b = data[pos]
        pos += 1
        pending -= 1
        if b <= 0x7F or b >= 0xE0:
            continue
        if b <= 0x8F:
            pending += 2 * (b & 0x0F)
        elif b <= 0x9F:
            pending += b & 0x0F
        elif b <= 0xBF:
            pos += b & 0x1F
        elif b in _FIXED:
            pos += _FIXED[b]
        elif b in _SIZED:
            size, extra = _SIZED[b]
            pos += size + extra + _uint(data, pos, size)
        elif b in _CONTAINERS:
            size, per = _CONTAINERS[b]
            pending += per * _uint(data, pos, size)
            pos += size
        else:
            raise ValueError(f"invalid msgpack type byte 0x{b:02x}")
    if pos > end:
        raise ValueError("truncated msgpack value")
    return pos


def split_frame(data) -> list[memoryview]:
    """The encoded messages of a frame (a msgpack array), or the encoded fields of one
    message (an array too); ValueError if `data` is not one array."""
    data = view = memoryview(data).cast("B")  # bytes, msgspec.Raw, memoryview alike
    if not len(data):
        raise ValueError("empty frame")
    b = data[0]
    if 0x90 <= b <= 0x9F:
        n, pos = b & 0x0F, 1
    elif b in (0xDC, 0xDD) and len(data) >= (3 if b == 0xDC else 5):
        size = 2 if b == 0xDC else 4
        n, pos = _uint(data, 1, size), 1 + size
    else:
        raise ValueError("a frame must be a msgpack array of messages")
    out = []
    try:
        for _ in range(n):
            nxt = _skip(data, pos)
            out.append(view[pos:nxt])
            pos = nxt
    except (IndexError, struct.error) as e:  # a length or count cut off by the end of the frame
        raise ValueError("truncated msgpack value") from e
    if pos != len(data):
        raise ValueError("trailing bytes after the frame's messages")
    return out
