"""Public wire protocol: clients <-> edge proxy over WebSocket (JSON text frames).

Every frame is one JSON object with a `type` tag. Many requests may be in flight
on one connection; each carries a client-chosen `id` (unique among that
connection's open requests).

  client -> proxy   generate, cancel
  proxy  -> client  delta (text + token count), done (finish, usage, timing), error

A slow client gets the deltas of one request merged into fewer, larger frames
(`tokens` counts every token merged into the frame); nothing is ever dropped.
See docs/protocol.md for examples, codes and limits.
"""

from __future__ import annotations

from typing import Union

import msgspec

from wire import protocol as rp

# Stable error codes. The first six are shared with the internal protocol.
BAD_REQUEST = rp.BAD_REQUEST  # malformed frame or field; fix the request
PROMPT_TOO_LONG = rp.PROMPT_TOO_LONG  # prompt + max_tokens exceed the model's context or the proxy's limit
OVERLOADED = rp.OVERLOADED  # cannot start within its deadline; retry after `retry_after_s`
UNAUTHORIZED = rp.UNAUTHORIZED  # missing or unknown API key
NOT_FOUND = rp.NOT_FOUND  # unknown request id (cancel) or route
INTERNAL = rp.INTERNAL
FORBIDDEN = "forbidden"  # e.g. a session created by another API key
RATE_LIMITED = "rate_limited"  # the key's token bucket is empty; retry after `retry_after_s`
UNAVAILABLE = "unavailable"  # no healthy replica (even after failover)
SHUTTING_DOWN = "shutting_down"  # the proxy is draining; reconnect (to another proxy)
TOO_LARGE = "too_large"  # frame or body over the size limit
TOO_SLOW = "too_slow"  # the client fell too far behind; connection closed

PRIORITIES = {"interactive": rp.INTERACTIVE, "batch": rp.BATCH}


class Sampling(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The sampling a client may ask for here (wire.protocol.SamplingParams has the meanings;
    n and logprobs are the OpenAI HTTP API's: a delta carries text, not tokens)."""

    max_tokens: int = rp.DEFAULT_MAX_TOKENS
    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 -> off
    seed: int | None = None  # the proxy assigns one when absent, so failover stays exact
    stop: list[str] = []
    stop_token_ids: list[int] = []
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] = {}
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False

    def params(self) -> rp.SamplingParams:
        return rp.SamplingParams(**msgspec.structs.asdict(self))


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str


class Generate(msgspec.Struct, tag="generate", forbid_unknown_fields=True, omit_defaults=True):
    id: str
    messages: list[ChatMessage] | None = None  # a conversation (rendered with the chat template) ...
    prompt: str | None = None  # ... or a raw prompt; exactly one of the two
    session: str | None = None  # sticky session: later turns go to the replica holding the prefix
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    priority: str | None = None  # "interactive" | "batch"; never above the API key's tier
    deadline_ms: float = 0.0  # 0 -> none; reject with `overloaded` when the first token cannot come in time
    traceparent: str | None = None  # W3C trace context to continue
    tenant: str | None = None  # peer keys only: the tenant a forwarded request runs for


class Cancel(msgspec.Struct, tag="cancel", forbid_unknown_fields=True):
    id: str


class Delta(msgspec.Struct, tag="delta"):
    id: str
    text: str
    tokens: int  # tokens in this frame (more than one when merged for a slow client)


class Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the replica's prefix cache
    accepted_draft_tokens: int = 0  # speculative tokens accepted by the replica


class Timing(msgspec.Struct):
    ttft_ms: float = 0.0  # proxy arrival -> first delta handed to the socket
    total_ms: float = 0.0
    replica_ttft_ms: float = 0.0  # as reported by the last replica (its own queue + prefill)


class Done(msgspec.Struct, tag="done"):
    id: str
    finish_reason: str  # stop | length | abort | error
    usage: Usage
    timing: Timing
    region: str
    replica: str  # replica that produced the last token
    failovers: int = 0  # times the stream moved to another replica
    forwarded_from: str = ""  # region whose proxy forwarded the request here (it had no replica ready); "" if none


class Error(msgspec.Struct, tag="error", omit_defaults=True):
    code: str
    message: str
    id: str | None = None  # None: about the connection, not one request
    retry_after_s: float | None = None


ClientMessage = Union[Generate, Cancel]
ServerMessage = Union[Delta, Done, Error]


class ProtocolError(Exception):
    """A request the proxy refuses; `code` is one of the stable codes above."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


class ClientCodec:
    """Proxy side: decode client frames, encode server frames (one per connection or shared)."""

    __slots__ = ("_dec", "_enc")

    def __init__(self):
        self._dec = msgspec.json.Decoder(ClientMessage)
        self._enc = msgspec.json.Encoder()

    def decode(self, data: str | bytes) -> Generate | Cancel:
        try:
            return self._dec.decode(data)
        except msgspec.ValidationError as e:
            raise ProtocolError(BAD_REQUEST, f"invalid message: {e}") from None
        except msgspec.DecodeError as e:
            raise ProtocolError(BAD_REQUEST, f"malformed JSON: {e}") from None

    def encode(self, msg: Delta | Done | Error) -> bytes:
        return self._enc.encode(msg)


class ServerCodec:
    """Client side: encode client frames, decode server frames."""

    __slots__ = ("_dec", "_enc")

    def __init__(self):
        self._dec = msgspec.json.Decoder(ServerMessage)
        self._enc = msgspec.json.Encoder()

    def decode(self, data: str | bytes) -> Delta | Done | Error:
        return self._dec.decode(data)

    def encode(self, msg: Generate | Cancel) -> bytes:
        return self._enc.encode(msg)
