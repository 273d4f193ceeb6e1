"""Internal wire protocol: proxy <-> replica API <-> engine process.

msgspec Structs in one tagged union, encoded as msgpack. Every frame is a msgpack
*array of messages* (`list[Message]`), so a sender can coalesce the tokens of many
requests from one engine step into one frame. Hot structs are `array_like` and
`omit_defaults`; new fields must get defaults so old peers keep decoding.

Imports msgspec only: the proxy imports this module and must not pull in torch.

Directions:
  proxy -> replica   Generate, Abort
  replica -> proxy   Hello (once, on connect), Tokens, Finished, Error, Load, KvEvents
The replica's API process speaks the same messages to its engine process over a
local socket (length-prefixed frames, see `FrameCodec`).

The proxy authenticates its WebSocket with `Authorization: Bearer <secret>`;
a replica started with a secret refuses any other peer (close code 4401).
"""

from __future__ import annotations

import struct
from typing import Union

import msgspec

PROTOCOL_VERSION = 1

# Stable error codes (also used by the public protocol).
BAD_REQUEST = "bad_request"
PROMPT_TOO_LONG = "prompt_too_long"
OVERLOADED = "overloaded"
UNAUTHORIZED = "unauthorized"
NOT_FOUND = "not_found"
INTERNAL = "internal"

# Priority classes: lower runs first.
INTERACTIVE = 0
BATCH = 1

# Finish reasons.
FINISH_STOP = "stop"  # EOS, stop token id or stop string
FINISH_LENGTH = "length"  # max_tokens or context length reached
FINISH_ABORT = "abort"  # cancelled by the client / proxy
FINISH_ERROR = "error"


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, forbid_unknown_fields=True):
    max_tokens: int = 256
    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 -> off
    seed: int | None = None  # randomness is a function of (seed, position) only
    stop: list[str] = []  # stop strings (checked after detokenization)
    stop_token_ids: list[int] = []  # in addition to the model's EOS ids
    ignore_eos: bool = False

    def validate(self, max_tokens_limit: int) -> str | None:
        """Return a message naming the problem, or None when the params are valid."""
        if self.max_tokens < 1:
            return f"max_tokens must be >= 1, got {self.max_tokens}"
        if self.max_tokens > max_tokens_limit:
            return f"max_tokens must be <= {max_tokens_limit}, got {self.max_tokens}"
        if not 0.0 <= self.temperature <= 100.0:
            return f"temperature must be in [0, 100], got {self.temperature}"
        if not 0.0 < self.top_p <= 1.0:
            return f"top_p must be in (0, 1], got {self.top_p}"
        if self.top_k < 0:
            return f"top_k must be >= 0, got {self.top_k}"
        if self.seed is not None and not 0 <= self.seed < 2**63:
            return f"seed must be in [0, 2**63), got {self.seed}"
        if len(self.stop) > 16 or any(not s or len(s) > 256 for s in self.stop):
            return "stop takes at most 16 non-empty strings of at most 256 characters"
        return None


class Generate(msgspec.Struct, tag="generate", array_like=True, omit_defaults=True):
    id: str
    prompt_ids: list[int]
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    cache_salt: str = ""  # tenant salt for block hashes: prefixes never shared across tenants
    priority: int = INTERACTIVE
    deadline_ms: float = 0.0  # 0 -> none; relative to arrival, for admission
    resume_ids: list[int] = []  # tokens already generated elsewhere (exact failover resume)
    traceparent: str = ""  # W3C trace context


class Abort(msgspec.Struct, tag="abort", array_like=True):
    id: str


class Tokens(msgspec.Struct, tag="tokens", array_like=True, omit_defaults=True):
    id: str
    ids: list[int]
    text: str = ""  # filled by the replica API process (incremental detokenization)


class Usage(msgspec.Struct, array_like=True, omit_defaults=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    accepted_draft_tokens: int = 0


class Finished(msgspec.Struct, tag="finished", array_like=True, omit_defaults=True):
    id: str
    finish_reason: str
    usage: Usage = msgspec.field(default_factory=Usage)
    ttft_ms: float = 0.0  # engine arrival -> first token
    ids: list[int] = []  # last tokens, when sent in the same step as the finish
    text: str = ""


class Error(msgspec.Struct, tag="error", array_like=True, omit_defaults=True):
    code: str
    message: str
    id: str | None = None


class Load(msgspec.Struct, tag="load", array_like=True, omit_defaults=True):
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    step_ms: float = 0.0  # recent mean engine step time
    waiting_tokens: int = 0  # prompt tokens still to prefill
    tokens_per_s: float = 0.0


class KvEvents(msgspec.Struct, tag="kv", array_like=True, omit_defaults=True):
    stored: list[int] = []  # chained block hashes now cached
    removed: list[int] = []  # block hashes evicted
    cleared: bool = False  # everything before this event is gone (replica restart)


class Hello(msgspec.Struct, tag="hello", array_like=True, omit_defaults=True):
    replica_id: str
    model: str
    block_size: int
    max_model_len: int
    version: int = PROTOCOL_VERSION
    tokenizer: str = ""  # Tokenizer.fingerprint: the proxy routes token ids only to replicas that match it


Message = Union[Generate, Abort, Tokens, Finished, Error, Load, KvEvents, Hello]
Frame = list[Message]


class Codec:
    """One reused Encoder/Decoder pair for frames (lists of messages)."""

    __slots__ = ("_enc", "_dec")

    def __init__(self):
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(Frame)

    def encode(self, msgs: list) -> bytes:
        return self._enc.encode(msgs)

    def decode(self, data: bytes) -> list:
        return self._dec.decode(data)


_LEN = struct.Struct("<I")


class FrameCodec(Codec):
    """Length-prefixed frames for stream sockets (API process <-> engine process)."""

    __slots__ = ("_buf",)

    def __init__(self):
        super().__init__()
        self._buf = bytearray()

    def pack(self, msgs: list) -> bytes:
        body = self._enc.encode(msgs)
        return _LEN.pack(len(body)) + body

    def feed(self, data: bytes) -> list:
        """Add received bytes; return the messages of every complete frame."""
        self._buf += data
        out: list = []
        buf = self._buf
        pos = 0
        with memoryview(buf) as view:
            while len(buf) - pos >= 4:
                (n,) = _LEN.unpack_from(buf, pos)
                if len(buf) - pos - 4 < n:
                    break
                out.extend(self._dec.decode(view[pos + 4 : pos + 4 + n]))
                pos += 4 + n
        if pos:
            del buf[:pos]
        return out
