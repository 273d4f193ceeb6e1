"""Public wire protocol: clients <-> edge proxy over WebSocket (JSON text frames).

Every frame is one JSON object with a `type` tag. Many requests may be in flight
on one connection; each carries a client-chosen `id` (unique among that
connection's open requests).

  client -> proxy   generate, cancel
  proxy  -> client  delta (text + token count), done (finish, usage, timing), error

Structured output and tools (edge_proxy.ws_structured): a generate may carry
`response_format`, vLLM's `structured_outputs`, `tools`, `tool_choice` and
`parallel_tool_calls` as the OpenAI API takes them; messages may carry assistant
`tool_calls` and `tool` results; `done` then carries the calls made in `tool_calls`.

A slow client gets the deltas of one request merged into fewer, larger frames
(`tokens` counts every token merged into the frame); nothing is ever dropped.

A generate may replace an open request in one step (`replaces`: the old one is
aborted and answered done/abort, the new one goes to the replica that held it),
fill in the middle (`prefix` + `suffix`, for models with FIM tokens), ask for
the token ids in its deltas (`resumable`), and continue a request from the ids
a client already received (`resume`, e.g. after a reconnect: the same prompt,
sampling and seed continue exactly, as in a failover).
See docs/protocol.md for examples, codes and limits.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec
from msgspec import Meta

from wire import protocol as P
from wire.structured import StructuredOutputs
from wire.tools import MAX_TOOLS, ToolCall

# Stable error codes. The first six are shared with the internal protocol.
BAD_REQUEST = P.BAD_REQUEST  # malformed frame or field; fix the request
PROMPT_TOO_LONG = P.PROMPT_TOO_LONG  # prompt + max_tokens exceed the model's context or the proxy's limit
OVERLOADED = P.OVERLOADED  # cannot start within its deadline; retry after `retry_after_s`
UNAUTHORIZED = P.UNAUTHORIZED  # missing or unknown API key
NOT_FOUND = P.NOT_FOUND  # unknown request id (cancel) or route
INTERNAL = P.INTERNAL
FORBIDDEN = "forbidden"  # e.g. an origin not allowed, a tenant a key may not act for
RATE_LIMITED = "rate_limited"  # the key's token bucket is empty; retry after `retry_after_s`
UNAVAILABLE = "unavailable"  # no healthy replica (even after failover)
SHUTTING_DOWN = "shutting_down"  # the proxy is draining; reconnect (to another proxy)
TOO_LARGE = "too_large"  # frame or body over the size limit
TOO_SLOW = "too_slow"  # the client fell too far behind; connection closed
TOO_MANY_CONNECTIONS = "too_many_connections"  # connection cap of the proxy or of the source address (HTTP 503)

# Wire bounds, enforced while decoding (before anything is queued). Integers fit the
# types they become downstream: token ids and top_k are int32 on the replica's
# device, seeds are 63-bit; floats are finite (JSON has no NaN, and 1e999 is out of
# range); every list and string is bounded, so a frame costs at most what it says.
MAX_ID_CHARS = 128  # request ids, tenants: echoed in every frame of the request, never longer
MAX_SESSION_CHARS = 256
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 16, 256, P.MAX_STOP_TOKEN_IDS
MAX_DEADLINE_MS = 3_600_000.0
MAX_RESUME_IDS = 1 << 16  # ids a `resume` may carry (it must also stay below the request's max_tokens)
INT32_MAX, SEED_MAX = 2**31 - 1, 2**63 - 1

RequestId = Annotated[str, Meta(min_length=1, max_length=MAX_ID_CHARS)]
TokenId = Annotated[int, Meta(ge=0, le=INT32_MAX)]

PRIORITIES = {"interactive": P.INTERACTIVE, "batch": P.BATCH}


class Sampling(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The sampling a client may ask for here (wire.protocol.SamplingParams has the meanings;
    n and logprobs are the OpenAI HTTP API's: a delta carries text, not tokens). Bounded while
    decoding; `SamplingParams.validate` checks the ranges again for both front ends."""

    max_tokens: Annotated[int, Meta(ge=1, le=INT32_MAX)] = P.DEFAULT_MAX_TOKENS  # <= the proxy's max_tokens_limit
    temperature: Annotated[float, Meta(ge=0.0, le=100.0)] = 1.0  # 0 -> greedy
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=0, le=INT32_MAX)] = 0  # 0 -> off
    seed: Annotated[int, Meta(ge=0, le=SEED_MAX)] | None = None  # assigned when absent, so failover stays exact
    stop: Annotated[list[Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]],
                    Meta(max_length=MAX_STOP_STRINGS)] = []
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] = []
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] = 1.0
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    logit_bias: Annotated[dict[TokenId, Annotated[float, Meta(ge=-100.0, le=100.0)]],
                          Meta(max_length=P.MAX_LOGIT_BIAS)] = {}
    min_tokens: Annotated[int, Meta(ge=0, le=INT32_MAX)] = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False

    def params(self) -> P.SamplingParams:
        return P.SamplingParams(**msgspec.structs.asdict(self))


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, gc=False):
    # gc=False: decoded strings and calls cannot form a cycle, and a frame of 30,000 messages
    # must not set off the cyclic collector (a full collection stalls every stream for tens of ms).
    role: str  # system | user | assistant | tool; length and count bounded by `edge_proxy.limits` (configurable)
    content: str = ""
    tool_calls: Annotated[list[ToolCall], Meta(max_length=MAX_TOOLS)] | None = None  # assistant: the calls it made
    tool_call_id: Annotated[str, Meta(max_length=256)] | None = None  # tool: the call this message answers


class Generate(msgspec.Struct, tag="generate", forbid_unknown_fields=True, omit_defaults=True):
    id: RequestId
    messages: list[ChatMessage] | None = None  # a conversation (rendered with the chat template) ...
    prompt: str | None = None  # ... or a raw prompt, or `prefix` (below); exactly one of the three
    session: Annotated[str, Meta(min_length=1, max_length=MAX_SESSION_CHARS)] | None = None  # sticky session
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    priority: Literal["interactive", "batch"] | None = None  # never above the API key's tier
    deadline_ms: Annotated[float, Meta(ge=0.0, le=MAX_DEADLINE_MS)] = 0.0  # 0 -> none; else `overloaded` at once
    traceparent: Annotated[str, Meta(max_length=256)] | None = None  # W3C trace context to continue
    tenant: RequestId | None = None  # peer keys only: the tenant a forwarded request runs for
    response_format: dict | None = None  # OpenAI's: json_object, json_schema (wire.structured)
    structured_outputs: StructuredOutputs | None = None  # vLLM's: json, regex, choice, grammar, json_object
    tools: Annotated[list, Meta(max_length=MAX_TOOLS)] | None = None  # OpenAI's function tools (wire.tools)
    tool_choice: str | dict | None = None  # "auto" | "none" | "required" | {"type": "function", "function": {...}}
    parallel_tool_calls: bool | None = None
    prefix: str | None = None  # fill-in-the-middle: the text before the cursor (models with FIM tokens) ...
    suffix: str | None = None  # ... and after it ("" when absent)
    replaces: RequestId | None = None  # an open request of this connection to abort in the same step (may be `id`)
    resumable: bool = False  # deltas carry the token ids (`Delta.ids`), what `resume` needs after a reconnect
    resume: Annotated[list[TokenId], Meta(max_length=MAX_RESUME_IDS)] | None = None  # ids already received


class Cancel(msgspec.Struct, tag="cancel", forbid_unknown_fields=True):
    id: RequestId


class Delta(msgspec.Struct, tag="delta", omit_defaults=True):
    id: str
    text: str
    tokens: int  # tokens in this frame (more than one when merged for a slow client)
    ids: list[int] | None = None  # the frame's token ids, for requests sent with `resumable`


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
    tool_calls: list[ToolCall] | msgspec.UnsetType = msgspec.UNSET  # the calls made (a request with tools)


class Error(msgspec.Struct, tag="error", omit_defaults=True):
    code: str
    message: str
    id: str | None = None  # None: about the connection, not one request
    retry_after_s: float | None = None


ClientMessage = Union[Generate, Cancel]
ServerMessage = Union[Delta, Done, Error]


MAX_MESSAGE_CHARS = 300  # error messages may quote a client's value: never echo more than this


def _bounded(message: str) -> str:
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    half = MAX_MESSAGE_CHARS // 2 - 2
    return f"{message[:half]}...{message[-half:]}"


class ProtocolError(Exception):
    """A request the proxy refuses; `code` is one of the stable codes above. The message
    is cut to `MAX_MESSAGE_CHARS` (it may quote what the client sent)."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None):
        message = _bounded(message)
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


class _Envelope(msgspec.Struct):
    """Just the id of a frame that failed to decode, so its error can name it."""

    id: RequestId | None = None


class FrameError(ProtocolError):
    """A client frame that failed to decode; `id` is its request id when it had a usable one."""

    def __init__(self, message: str, id: str | None):
        super().__init__(BAD_REQUEST, message)
        self.id = id


class ClientCodec:
    """Proxy side: decode client frames, encode server frames (one per connection or shared)."""

    __slots__ = ("_dec", "_enc", "_env")

    def __init__(self):
        self._dec = msgspec.json.Decoder(ClientMessage)
        self._enc = msgspec.json.Encoder()
        self._env = msgspec.json.Decoder(_Envelope)

    def decode(self, data: str | bytes) -> Generate | Cancel:
        """Raises `FrameError` (bad_request, with the frame's id when it had a valid one)."""
        try:
            return self._dec.decode(data)
        except msgspec.ValidationError as e:
            raise FrameError(f"invalid message: {e}", self._id_of(data)) from None
        except msgspec.DecodeError as e:
            raise FrameError(f"malformed JSON: {e}", None) from None
        except RecursionError:
            raise FrameError("malformed JSON: nested too deeply", None) from None

    def _id_of(self, data: str | bytes) -> str | None:
        try:
            return self._env.decode(data).id
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            return None  # no id, or one that is not a valid id (never echoed)

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
