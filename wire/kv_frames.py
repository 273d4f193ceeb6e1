"""The replica-to-replica KV channel's contract: request bodies and the export stream (no torch).

A receiver pulls a prefix's blocks from a source (`replica.api.kv_routes`):

    POST /v1/kv/pull    {source, token_ids, cache_salt | seed, frame_blocks, timeout_ms}  (JSON, to the receiver)
    POST /v1/kv/export  KvExport                                        (msgpack, receiver -> source)
        200, application/x-edgechat-kv: length-prefixed msgpack messages
        KvSpec, KvFrame*, KvEnd

and a draining replica's hot chains (the conversations it caches that no stream holds) are listed
by it for a proxy to place, each then pulled like a prompt, named by its seed:

    POST /v1/kv/hot     HotAsk {max_blocks, hold_s}  (JSON, to the source) -> HotList {chains, hold}
    DELETE /v1/kv/hot/{hold}   the proxy is done pulling them: a draining source may exit

Each stream message is `<u32 little-endian length><msgpack>`, at most MAX_MESSAGE_BYTES. A frame
carries up to `frame_blocks` consecutive full blocks of the prompt: their chained hashes
(wire.hashing), an xxh3_64 digest of each block's bytes and the bytes. The receiver checks every
frame whole before any of it reaches its engine: the spec equal to its own, the hashes equal to
those it computes from the token ids itself, each digest over the bytes it got. A stream that
breaks (the source died) loses only the frame in flight; the frames before it are whole blocks.
KvEnd says how many blocks were sent and, when fewer than asked, why.
"""

from __future__ import annotations

import struct
from typing import Annotated, Union

import msgspec
import xxhash

from wire.hashing import block_hashes
from wire.protocol import KvSpec

MEDIA_TYPE = "application/x-edgechat-kv"
MAX_MESSAGE_BYTES = 64 << 20  # a frame of 8 blocks of a 70B model's fp16 KV is ~40 MiB
MAX_FRAME_BYTES = 16 << 20  # what a source puts in one frame (frame_blocks is cut to fit)
MAX_PROMPT_TOKENS = 1 << 20

TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
TokenIds = Annotated[list[TokenId], msgspec.Meta(max_length=MAX_PROMPT_TOKENS)]
FrameBlocks = Annotated[int, msgspec.Meta(ge=1, le=1024)]
# a chain's seed (wire.hashing.salt_seed of its cache salt) in place of the salt: a chain listed by its source
# (POST /v1/kv/hot) is named by its seed, the salt itself never leaves the proxy
Seed = Annotated[int, msgspec.Meta(ge=0)]  # and below 2**64 (`check_seed`: msgspec bounds only what fits an int64)


def check_seed(seed: int | None) -> None:
    if seed is not None and seed >> 64:
        raise ValueError(f"seed {seed} is not a 64-bit chain seed")


def chain_hashes(token_ids, block_size: int, cache_salt: str, seed: int | None) -> list[int]:
    """The chained hashes of a KvExport's or KvPull's blocks: from its seed when it names one, else its salt."""
    return block_hashes(token_ids, block_size, cache_salt, prev=seed)


class KvExport(msgspec.Struct, forbid_unknown_fields=True):
    """Body of POST /v1/kv/export: the full blocks of `token_ids` from block index `start` on."""

    token_ids: TokenIds
    cache_salt: str = ""
    start: Annotated[int, msgspec.Meta(ge=0)] = 0
    frame_blocks: FrameBlocks = 8
    seed: Seed | None = None  # the chain's seed, given in place of cache_salt

    def __post_init__(self):
        check_seed(self.seed)


class KvPull(msgspec.Struct, forbid_unknown_fields=True):
    """Body of POST /v1/kv/pull: fetch from `source` (a replica's base URL) the blocks of
    `token_ids` this replica does not cache yet."""

    source: str
    token_ids: TokenIds
    cache_salt: str = ""
    frame_blocks: FrameBlocks = 8
    # the pull's bound (ms, 0: none): past it the receiver stops fetching and answers 504 with the blocks
    # cached so far (a hand-off that moves the stream then: edge_proxy.handoff), freeing the source's export
    timeout_ms: Annotated[int, msgspec.Meta(ge=0)] = 0
    seed: Seed | None = None  # the chain's seed, given in place of cache_salt (a hot chain: POST /v1/kv/hot)

    def __post_init__(self):
        check_seed(self.seed)


class HotAsk(msgspec.Struct, forbid_unknown_fields=True):
    """Body of POST /v1/kv/hot: up to `max_blocks` blocks of chains, and a hold on the source's
    exit for `hold_s` (a draining replica waits for its holds to be let go, or to run out)."""

    max_blocks: Annotated[int, msgspec.Meta(ge=0, le=4096)] = 128
    hold_s: Annotated[float, msgspec.Meta(ge=0, le=60)] = 0.0


class HotChain(msgspec.Struct):
    seed: Seed  # wire.hashing.salt_seed of the chain's cache salt
    token_ids: list[int]  # its full blocks' ids, from its first block


class HotList(msgspec.Struct):
    chains: list[HotChain] = []  # most recently used first
    hold: str = ""  # names the hold (DELETE /v1/kv/hot/{hold}); "" when none was asked


class KvFrame(msgspec.Struct, tag="kv_frame", array_like=True):
    start: int  # block index (in the prompt) of the first block
    hashes: list[int]
    digests: list[int]  # block_digest of each block's bytes
    data: bytearray  # decoded as a bytearray: it goes on to the engine (wire.protocol.KvBlocks) as it is


class KvEnd(msgspec.Struct, tag="kv_end", array_like=True, omit_defaults=True):
    blocks: int  # blocks sent in all
    reason: str = ""  # why fewer than asked ("" : every one)


StreamMessage = Union[KvSpec, KvFrame, KvEnd]


def block_digest(data) -> int:
    return xxhash.xxh3_64_intdigest(data)


_LEN = struct.Struct("<I")


class StreamCodec:
    """Length-prefixed stream messages: `pack` one, `feed` received bytes for the whole ones."""

    def __init__(self):
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(StreamMessage)
        self._buf = bytearray()

    def pack(self, msg) -> bytearray:
        out = bytearray(4)
        self._enc.encode_into(msg, out, 4)  # after the length, in place: a frame's bytes are copied once here
        _LEN.pack_into(out, 0, len(out) - 4)
        return out

    @property
    def pending(self) -> int:
        """Bytes of a message not yet whole."""
        return len(self._buf)

    def feed(self, data: bytes) -> list:
        """The messages completed by `data`. ValueError on a message over MAX_MESSAGE_BYTES,
        msgspec.DecodeError/ValidationError on one that does not decode."""
        self._buf += data
        out, pos, buf = [], 0, self._buf
        with memoryview(buf) as view:  # decoding copies a frame's bytes out once; the view is gone before the del
            while len(buf) - pos >= 4:
                (n,) = _LEN.unpack_from(buf, pos)
                if n > MAX_MESSAGE_BYTES:
                    raise ValueError(f"a KV stream message of {n} bytes (at most {MAX_MESSAGE_BYTES})")
                if len(buf) - pos - 4 < n:
                    break
                out.append(self._dec.decode(view[pos + 4: pos + 4 + n]))
                pos += 4 + n
        del buf[:pos]
        return out
