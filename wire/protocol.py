"""Internal wire protocol: proxy <-> replica API <-> engine process.

msgspec Structs in one tagged union, encoded as msgpack. Every frame is a msgpack
*array of messages* (`list[Message]`), so a sender can coalesce the tokens of many
requests from one engine step into one frame. Hot structs are `array_like` and
`omit_defaults`; new fields must get defaults so old peers keep decoding.

Imports msgspec only: the proxy imports this module and must not pull in torch.

Evolution: structs are arrays, and msgspec writes every field (defaults too), so a
field is only ever appended, with a default. A new peer decodes an old one's
messages; an old proxy ignores the trailing fields of a new replica's Tokens and
Finished; an old replica refuses a new proxy's SamplingParams (it forbids unknown
fields rather than ignore a parameter it cannot honour): upgrade replicas first.

Directions:
  proxy -> replica   Generate, Abort
  replica -> proxy   Hello (once, on connect), Tokens, Finished, Error, Load, KvEvents
  API <-> engine     KvSpec (engine, after Hello), KvRead -> KvBlocks, KvBlocks -> KvWritten, KvHot -> KvChains
                     (KV transfer)
The replica's API process speaks the same messages to its engine process over a
local socket (length-prefixed frames, see `FrameCodec`).

The proxy authenticates its WebSocket with `Authorization: Bearer <secret>`;
a replica started with a secret refuses any other peer (close code 4401).
"""

from __future__ import annotations

import struct
from typing import Union

import msgspec

PROTOCOL_VERSION = 3  # 2: n, logprobs, penalties, logit bias, min_p, min_tokens (issue 12); 3: grammar (issue 17)

# Stable error codes (also used by the public protocol).
BAD_REQUEST = "bad_request"
PROMPT_TOO_LONG = "prompt_too_long"
OVERLOADED = "overloaded"
UNAUTHORIZED = "unauthorized"
NOT_FOUND = "not_found"
INTERNAL = "internal"  # the replica failed while serving it (e.g. its engine died): try another replica
ENGINE_FAULT = "engine_fault"  # this request made the engine fail (contained): never retry it elsewhere

INT32_MAX = 2**31 - 1  # token ids and top_k become int32 tensors

# Priority classes: lower runs first.
INTERACTIVE = 0
BATCH = 1

# Finish reasons.
FINISH_STOP = "stop"  # EOS, stop token id or stop string
FINISH_LENGTH = "length"  # max_tokens or context length reached
FINISH_ABORT = "abort"  # cancelled by the client / proxy
FINISH_ERROR = "error"

DEFAULT_MAX_TOKENS = 256  # the one default for every front door (WS, OpenAI HTTP, /infill)
MAX_N = 16  # parallel samples per request
MAX_LOGPROBS = 20  # top alternatives per token
MAX_LOGIT_BIAS = 1024  # entries
MAX_STOP_TOKEN_IDS = 64
MAX_GRAMMAR_CHARS = 1 << 18  # an llguidance grammar (JSON schemas and tool definitions inlined)
_MASK63 = (1 << 63) - 1


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of an n > 1 request: sample 0 keeps the request's
    seed, the others get a splitmix64 mix of (seed, index). A pure function, so a
    sample resumed elsewhere continues exactly."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK63


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, forbid_unknown_fields=True):
    """How to draw tokens. The engine applies, per step and sequence: logit_bias,
    repetition penalty (prompt + output), frequency/presence penalties (output, resumed
    tokens included), EOS/stop ids masked before min_tokens, then min_p, top-k, top-p
    and temperature in the sampler. Logprobs are the model's raw log-softmax."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 -> off
    seed: int | None = None  # randomness is a function of (seed, position) only
    stop: list[str] = []  # stop strings (checked after detokenization)
    stop_token_ids: list[int] = []  # in addition to the model's EOS ids
    ignore_eos: bool = False
    # -- protocol version 2 -----------------------------------------------------------
    n: int = 1  # parallel samples sharing the prompt's prefill (sample i seeded by sample_seed)
    presence_penalty: float = 0.0  # logit -= presence * (count > 0), over output tokens
    frequency_penalty: float = 0.0  # logit -= frequency * count, over output tokens
    repetition_penalty: float = 1.0  # prompt + output tokens: logit / r if > 0 else logit * r
    min_p: float = 0.0  # drop tokens with p < min_p * p_max
    logit_bias: dict[int, float] = {}  # token id -> added to its logit
    min_tokens: int = 0  # EOS and stop_token_ids masked until this many tokens
    logprobs: int | None = None  # None: off; k: the sampled token's logprob and the top k
    prompt_logprobs: int | None = None  # echo: logprobs of the prompt tokens (and their top k)
    include_stop_str_in_output: bool = False
    # -- protocol version 3 -----------------------------------------------------------
    grammar: str = ""  # structured output: an llguidance grammar every token must follow (wire.structured)

    def processed(self) -> bool:
        """Whether the logits are changed before sampling (the engine's per-token processing)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.min_p or self.logit_bias or self.min_tokens)

    def validate(self, max_tokens_limit: int, vocab_size: int = 1 << 31) -> str | None:
        """Return a message naming the problem (it starts with the field's name), or None
        when the params are valid. Written so NaN fails every range check."""
        if not 1 <= self.max_tokens <= max_tokens_limit:
            return f"max_tokens must be in [1, {max_tokens_limit}], got {self.max_tokens}"
        if not 0.0 <= self.temperature <= 100.0:
            return f"temperature must be in [0, 100], got {self.temperature}"
        if not 0.0 < self.top_p <= 1.0:
            return f"top_p must be in (0, 1], got {self.top_p}"
        if not 0 <= self.top_k <= INT32_MAX:
            return f"top_k must be in [0, {INT32_MAX}] (0: off), got {self.top_k}"
        if self.seed is not None and not 0 <= self.seed < 2**63:
            return f"seed must be in [0, 2**63), got {self.seed}"
        if len(self.stop) > 16 or any(not s or len(s) > 256 for s in self.stop):
            return "stop takes at most 16 non-empty strings of at most 256 characters"
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            return f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} token ids in [0, {vocab_size})"
        if not 1 <= self.n <= MAX_N:
            return f"n must be in [1, {MAX_N}], got {self.n}"
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                return f"{name} must be in [-2, 2], got {getattr(self, name)}"
        if not 0.0 < self.repetition_penalty <= 10.0:
            return f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}"
        if not 0.0 <= self.min_p <= 1.0:
            return f"min_p must be in [0, 1], got {self.min_p}"
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            return f"logit_bias takes at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}"
        for t, b in self.logit_bias.items():
            if not 0 <= t < vocab_size:
                return f"logit_bias token ids must be in [0, {vocab_size}), got {t}"
            if not -100.0 <= b <= 100.0:
                return f"logit_bias values must be in [-100, 100], got {b}"
        if not 0 <= self.min_tokens <= self.max_tokens:
            return f"min_tokens must be in [0, max_tokens], got {self.min_tokens}"
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                return f"{name} must be in [0, {MAX_LOGPROBS}], got {k}"
        if len(self.grammar) > MAX_GRAMMAR_CHARS:
            return f"grammar takes at most {MAX_GRAMMAR_CHARS} characters, got {len(self.grammar)}"
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
    # n > 1 resumed after failover: the samples still to run and their tokens so far
    # (aligned); [] -> samples 0..n-1 from the start (resume_ids is sample 0's, n == 1)
    sample_ids: list[int] = []
    sample_resume: list[list[int]] = []
    fork_of: str = ""  # API process -> engine: a sample that shares this request's prompt prefill (replica.engine.forks)
    # it starts a conversation (the proxy: no earlier reply, a prompt the replica does not hold whole): the replica
    # counts it in Load.chains from the moment it has it, before its blocks are cached (edge_proxy.routing, rule 3)
    new_chain: bool = False

    def samples(self) -> list[tuple[int, list[int]]]:
        """(sample index, tokens already generated) for every sample to run."""
        if self.sample_ids:
            return list(zip(self.sample_ids, self.sample_resume))
        return [(0, self.resume_ids)] + [(i, []) for i in range(1, self.sampling.n)]


class Abort(msgspec.Struct, tag="abort", array_like=True):
    id: str


class TokenLogprob(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One token's log-probability under the model (raw log-softmax) and the top alternatives."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class Tokens(msgspec.Struct, tag="tokens", array_like=True, omit_defaults=True):
    id: str
    ids: list[int]
    text: str = ""  # filled by the replica API process (incremental detokenization)
    index: int = 0  # which of the request's n samples
    logprobs: list[TokenLogprob] = []  # aligned with ids when sampling.logprobs is set
    prompt_logprobs: list[TokenLogprob] = []  # prompt tokens 1.. (sampling.prompt_logprobs; first message only)
    cached_tokens: int = 0  # first message only: prompt tokens served from the prefix cache (known before a cancel)


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
    index: int = 0  # which of the request's n samples (each sample finishes once)
    logprobs: list[TokenLogprob] = []  # aligned with ids
    prompt_logprobs: list[TokenLogprob] = []  # when no Tokens came before (a one-token answer)


class Error(msgspec.Struct, tag="error", array_like=True, omit_defaults=True):
    code: str
    message: str
    id: str | None = None


# Engine step times, seconds: the bounds of Load.step_counts (dense around the 50 ms a token that streams' tails
# are held to).
STEP_BUCKETS_S = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0)


class Load(msgspec.Struct, tag="load", array_like=True, omit_defaults=True):
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    step_ms: float = 0.0  # recent mean engine step time
    waiting_tokens: int = 0  # prompt tokens still to prefill
    tokens_per_s: float = 0.0  # measured prefill rate (prompt tokens a second); 0: not measured yet
    max_running: int = 0  # requests run at once (max_num_seqs); 0: not reported
    # The C++ CPU step's thread pool since the engine started: steps, and those run on the calling thread alone
    # because the helpers' cores were busy elsewhere (kernels/csrc/include/edgechat/pool.h). 0 elsewhere.
    cpu_steps: int = 0
    cpu_solo_steps: int = 0
    # every engine step since start: how many took at most each STEP_BUCKETS_S bound (not cumulative; the last
    # count is those over the largest), and their seconds in all
    step_counts: list[int] = []
    step_seconds: float = 0.0
    # the replica drains (SIGTERM, POST /v1/drain): it admits nothing new and serves its running streams and
    # its KV export until the proxy has handed them on (edge_proxy.handoff); set by its API process
    draining: bool = False
    # Generates the engine process has taken off its socket since it started (the API process adds those
    # sent and not yet taken to waiting, replica.api.queued_load); proxies read waiting, not this
    taken: int = 0
    # the proxy request id of the last Generate the replica had received on the connection this Load goes out on
    # when it built the Load (set per connection by its API process): running and waiting count that one and every
    # one that proxy sent before it, none it sent after (edge_proxy.pool); "": none yet, or a replica that says none
    seen_id: str = ""
    # the chains its prefix cache holds (wire.hashing.ChainTips: cached blocks no cached block extends), which
    # is how many conversations it holds, and the new ones it has (Generate.new_chain) whose blocks are not cached
    # yet; the proxies place new conversations where fewer are; -1: not reported
    chains: int = -1


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
    compute: list[str] = []  # the units it computes on (cores of one kernel, GPU UUIDs): replicas whose sets meet share them
    uses: int = 0  # how many of them it computes on at once (its engine's CPU threads); 0: all
    # prefill/decode disaggregation (edge_proxy.disagg): "prefill" (computes prompts into its prefix cache for
    # others to pull, streams nothing), "decode" (streams; cold prompts prefilled elsewhere), "both" ("": today's)
    role: str = ""
    # engine -> API only: the shared segment KV frames cross in (replica.kv_slots): its slots and their bytes
    kv_slots: int = 0
    kv_slot_bytes: int = 0


ROLES = ("both", "prefill", "decode")


# -- KV export and import between replicas (replica.engine.kv_transfer, replica.api.kv_routes, wire.kv_frames) ---------


class KvSpec(msgspec.Struct, tag="kv_spec", array_like=True, omit_defaults=True):
    """What one block of a replica's KV pool holds, byte for byte. Engine -> API process once,
    after Hello; the first message of an export stream. Blocks move between replicas only
    when the two specs are equal (`mismatch`): nothing is ever converted."""

    model: str  # identity of the weights the KV came from: name and a digest of config and numerics
    dtype: str  # the pool's dtype ("float16"; "int8": D codes and a 4-byte scale per row)
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    row: int  # elements per (token, kv head): head_dim, or head_dim + 4 in int8
    block_bytes: int  # one block as it travels: every layer's k and v (L, 2, bs, Hkv, row), then the draft layer's
    draft: str = ""  # the EAGLE-3 head's KV layer ("dtype:Hkv:D"), "" without one
    tp: int = 1

    def mismatch(self, theirs: "KvSpec") -> str | None:
        """A message naming every field that differs (this replica's value first), or None."""
        diff = [f"{f} {getattr(self, f)!r} here, {getattr(theirs, f)!r} there" for f in self.__struct_fields__
                if getattr(self, f) != getattr(theirs, f)]
        return "KV layout mismatch: " + "; ".join(diff) if diff else None


class KvRead(msgspec.Struct, tag="kv_read", array_like=True):
    """API -> engine: copy the bytes of the blocks cached under `hashes`, in order, up to the first
    one not cached, into KV slot `slot` (replica.kv_slots); answered by a KvBlocks with the same id."""

    id: str
    hashes: list[int]
    slot: int


class KvBlocks(msgspec.Struct, tag="kv_blocks", array_like=True, omit_defaults=True):
    """Blocks' bytes, KvSpec.block_bytes each, in the order of `hashes`, in KV slot `slot`
    (replica.kv_slots: the bytes never cross the socket). Engine -> API: the answer to a KvRead
    (hashes: those found). API -> engine: cache them (checked whole by the API process first),
    answered by a KvWritten with the same id."""

    id: str
    hashes: list[int] = []
    slot: int = -1
    error: str = ""
    prev: int = 0  # API -> engine: the hash the first of `hashes` extends (a chain's first block: its salt seed)
    # API -> engine: the blocks' token ids (block_size each, in order) and the first one's index in its chain:
    # kept with the blocks, so this replica can list them as a hot chain in turn (KvHot)
    ids: list[int] = []
    start: int = 0


class KvWritten(msgspec.Struct, tag="kv_written", array_like=True, omit_defaults=True):
    """Engine -> API: a KvBlocks was cached (stored new blocks; present: hashes already cached),
    or not at all (error)."""

    id: str
    stored: int = 0
    present: int = 0
    error: str = ""


class KvHot(msgspec.Struct, tag="kv_hot", array_like=True):
    """API -> engine: the cached conversations no running stream holds, most recently used first,
    up to `max_blocks` blocks (a prefix they share counted once); answered by a KvChains."""

    id: str
    max_blocks: int


class KvChain(msgspec.Struct, array_like=True):
    """One cached chain from its first block: the seed its hashes start from (the salt's,
    wire.hashing.salt_seed) and the token ids of its full blocks."""

    seed: int
    token_ids: list[int]


class KvChains(msgspec.Struct, tag="kv_chains", array_like=True, omit_defaults=True):
    id: str
    chains: list[KvChain] = []


Message = Union[Generate, Abort, Tokens, Finished, Error, Load, KvEvents, Hello, KvSpec, KvRead, KvBlocks, KvWritten,
                KvHot, KvChains]
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
