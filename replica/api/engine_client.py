"""API-process side of the engine: checks each request (`replica.validation`),
sends it to the engine process (spawned and restarted by `EngineSupervisor`), and
turns the engine's token ids into per-request text streams.

Each request has an `EngineStream` whose sink receives protocol messages (Tokens with
text, Finished, Error). Incremental detokenization and stop strings happen here,
not in the engine: when a stop string appears the stream finishes at once and an
Abort goes to the engine, which frees the blocks before its next step.

A request with n > 1 samples (`SampleGroup`) goes to the engine as one request per
sample, `<id>#<i>`, seeded `sample_seed(seed, i)`; samples after the first name it
in `fork_of`, so the engine computes the prompt once and shares its blocks
(replica.engine.forks). Their messages come back under the request's id with `index = i`;
the first error ends them all.

If the engine process dies, every stream in flight gets `Error(internal)` (the
proxy resumes it on another replica) and new requests get `Error(overloaded)`
until the restarted engine says Hello. Imports no torch: the engine runs in its
own process.

Load: what the engine reports, plus the requests sent to it and not yet taken
(`replica.api.queued_load`), published to every subscriber (each connected proxy) the loop
turn a request is accepted, so every proxy sees a placement one network hop later, not
after the engine's next step.

KV transfer (`kv_call`): a KvRead, KvBlocks or KvHot goes to the engine and its answer comes back
to the awaiting caller (replica.api.kv_routes); `kv_spec` is the engine's pool as blocks travel;
the blocks' bytes cross in `kv_slots` (replica.kv_slots), named by the commands.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from wire import protocol as P
from replica.config import EngineConfig
from wire.hashing import chain_hash, salt_seed
from replica.api.queued_load import QueuedLoad
from replica.api.engine_supervisor import EngineSupervisor, EngineUnavailable
from replica.kv_slots import Lease, Slots
from replica.tokenizer import IncrementalDetokenizer, Tokenizer
from replica.validation import check_generate

Sink = Callable[[object], None]


class EngineStream:
    """One engine request as seen by the API process: its sink, detokenizer and stop state."""

    __slots__ = ("id", "sink", "detok", "num_resumed", "arrival", "last_token", "done", "ttft_s", "num_tokens",
                 "stop_text", "stop_ids", "stop_logprobs")

    def __init__(self, id: str, sink: Sink, detok: IncrementalDetokenizer, num_resumed: int):
        self.id, self.sink, self.detok, self.num_resumed = id, sink, detok, num_resumed
        self.stop_text = ""
        self.stop_ids: list[int] = []  # the tokens (and logprobs) of the message that hit a stop string
        self.stop_logprobs: list = []
        self.arrival = time.perf_counter()
        self.last_token = 0.0
        self.ttft_s = 0.0
        self.num_tokens = 0
        self.done = False


@dataclass
class SampleGroup:
    """The samples of one n > 1 request still running (engine ids `<id>#<i>`)."""

    id: str
    sink: Sink
    running: dict[str, int] = field(default_factory=dict)  # engine id -> sample index


class EngineClient:
    def __init__(self, cfg: EngineConfig, tokenizer: Tokenizer, replica_id: str = "replica", metrics=None,
                 **supervision):
        """`supervision`: EngineSupervisor's restart and stall settings."""
        self.cfg, self.tokenizer, self.replica_id, self.metrics = cfg, tokenizer, replica_id, metrics
        self.streams: dict[str, EngineStream] = {}
        self.aborting: set[str] = set()  # aborted, their engine Finished (usage, for /metrics) still to come
        self.groups: dict[str, SampleGroup] = {}
        self.load: P.Load | None = None  # the Load published last (the engine's, with the requests it has not taken)
        self.queued = QueuedLoad()
        self._load_due = False  # a publish of the Load is scheduled for the end of this loop turn
        self.cached_blocks: set[int] = set()  # mirror of the engine's prefix cache, for new routers
        self.subscribers: set[Sink] = set()  # receive Load and KvEvents
        self.lost_listeners: set[Callable[[], None]] = set()  # called once the streams got their errors
        self.kv_spec: P.KvSpec | None = None  # the engine's KV pool, as blocks travel (replica.api.kv_routes)
        self.draining = False  # admit nothing new; every Load says so (replica.api.drain)
        self.idle = asyncio.Event()  # set once draining and no stream is left
        self._kv_calls: dict[str, asyncio.Future] = {}  # KvRead / KvBlocks sent, by id: their answers to come
        self._leases: dict[str, Lease] = {}  # the KV slots of the commands the engine has not answered, by id
        self._kv_ids = itertools.count()
        self._codec = P.FrameCodec()
        self.engine = EngineSupervisor(cfg, replica_id, self._dispatch, self._engine_lost, **supervision)

    @property
    def ready(self) -> asyncio.Event:
        return self.engine.ready

    @property
    def hello(self) -> P.Hello | None:
        return self.engine.hello

    # -- lifecycle -------------------------------------------------------------------
    async def start(self, timeout: float = 600.0) -> None:
        await self.engine.start(timeout)

    async def stop(self) -> None:
        await self.engine.stop()

    # -- requests --------------------------------------------------------------------
    def submit(self, req: P.Generate, sink: Sink) -> None:
        """Check the request and send it to the engine; `sink` then receives its messages (a
        rejection included: submit never raises). req.id must be unique among every request
        ever sent (callers number them per connection), so late messages of one never reach another."""
        hello = self.engine.hello
        problem = check_generate(req, hello.max_model_len if hello else P.INT32_MAX)
        if problem is None and not self.engine.ready.is_set():
            problem = P.OVERLOADED, "the engine process is restarting; retry on another replica or shortly"
        if problem is None and self.draining:
            problem = P.OVERLOADED, "the replica is draining (shutting down); retry on another replica"
        if problem is not None:
            sink(P.Error(code=problem[0], message=problem[1], id=req.id))
            return
        if req.sampling.n == 1 and not req.sample_ids:
            self._open(req, sink)
            self._send([req])
            self._queued([self._uncached(req)], req.new_chain)
            return
        group = self.groups[req.id] = SampleGroup(req.id, sink)
        sp, subs = req.sampling, []
        for k, (i, resume) in enumerate(req.samples()):
            sub = msgspec.structs.replace(
                req, id=f"{req.id}#{i}", resume_ids=list(resume), sample_ids=[], sample_resume=[],
                fork_of="" if k == 0 else subs[0].id,
                sampling=msgspec.structs.replace(sp, n=1, seed=None if sp.seed is None else P.sample_seed(sp.seed, i),
                                                 prompt_logprobs=sp.prompt_logprobs if k == 0 else None))
            group.running[sub.id] = i
            self._open(sub, self._sample_sink(group, i))
            subs.append(sub)
        self._send(subs)
        self._queued([self._uncached(req)] + [0] * (len(subs) - 1), req.new_chain)  # the forks share its prompt

    def _uncached(self, req: P.Generate) -> int:
        """The prompt tokens the engine will compute for `req`, by the mirror of its prefix cache."""
        ids = req.prompt_ids + req.resume_ids if req.resume_ids else req.prompt_ids
        bs = self.engine.hello.block_size
        h, hit = salt_seed(req.cache_salt), 0
        while hit + bs <= len(ids):
            h = chain_hash(h, ids[hit:hit + bs])
            if h not in self.cached_blocks:
                break
            hit += bs
        return len(ids) - hit

    def _queued(self, uncached: list[int], new_chain: bool = False) -> None:
        """Generates sent to the engine (of one request: `new_chain`, it starts a conversation): publish
        the Load with them at the end of this loop turn (once for every request accepted in it)."""
        for i, u in enumerate(uncached):
            self.queued.sent_one(u, new_chain and i == 0)
        if not self._load_due:
            self._load_due = True
            asyncio.get_running_loop().call_soon(self._publish_load)

    def _publish_load(self) -> None:
        self._load_due = False
        ld = self.queued.current(self.draining)
        if ld is not None:
            self.load = ld
            self._publish(ld)

    def _open(self, req: P.Generate, sink: Sink) -> None:
        sp = req.sampling
        detok = IncrementalDetokenizer(self.tokenizer, stop=sp.stop, prefix_ids=req.resume_ids,
                                       include_stop=sp.include_stop_str_in_output)
        self.streams[req.id] = EngineStream(req.id, sink, detok, len(req.resume_ids))

    def _sample_sink(self, group: SampleGroup, index: int) -> Sink:
        def sink(msg) -> None:
            if group.id not in self.groups:
                return  # the group already ended (an error)
            sub_id, msg.id = msg.id, group.id
            if isinstance(msg, P.Error):
                self.abort(group.id)
                group.sink(msg)
                return
            msg.index = index
            if isinstance(msg, P.Finished):
                del group.running[sub_id]
                if not group.running:
                    del self.groups[group.id]
            group.sink(msg)
        return sink

    def running(self, req_id: str) -> bool:
        """Whether any of the request's samples is still running."""
        return req_id in self.streams or req_id in self.groups

    def abort(self, req_id: str) -> None:
        """Cancel: the engine frees the request (every sample) before its next step."""
        group = self.groups.pop(req_id, None)
        ids = list(group.running) if group is not None else [req_id]
        aborts = []
        for rid in ids:
            stream = self.streams.pop(rid, None)
            if stream is not None and not stream.done:
                stream.done = True
                aborts.append(P.Abort(id=rid))
                self.aborting.add(rid)
        if aborts:
            self._send(aborts)
        self._check_idle()

    def drain(self) -> None:
        """Admit nothing new from now on, and say so in every Load (this one re-sent at once)."""
        self.draining = True
        self.load = self.queued.current(True) or P.Load(0, 0, 0, 0, draining=True)
        self._publish(self.load)
        self._check_idle()

    def _check_idle(self) -> None:
        if self.draining and not self.streams:
            self.idle.set()

    def _send(self, msgs: list) -> None:
        try:
            self.engine.send(self._codec.pack(msgs))
        except EngineUnavailable:
            pass  # every stream in flight was failed when the engine was lost; aborts have nothing left to stop

    @property
    def kv_slots(self) -> Slots:
        return self.engine.slots

    async def kv_call(self, msg: P.KvRead | P.KvBlocks | P.KvHot,
                      lease: Lease | None = None) -> P.KvBlocks | P.KvWritten | P.KvChains:
        """Send a KV transfer command to the engine (msg.id is set here) and await its answer.
        `lease`: the KV slot the command names (replica.kv_slots): the engine's until it answers
        (or is gone), whether or not the caller still awaits the answer then.
        EngineUnavailable when the engine is restarting or is lost before it answers."""
        msg.id = f"kv/{next(self._kv_ids)}"
        fut = self._kv_calls[msg.id] = asyncio.get_running_loop().create_future()
        try:
            self.engine.send(self._codec.pack([msg]))
            if lease is not None:
                lease.sent()
                self._leases[msg.id] = lease
            return await fut
        finally:
            self._kv_calls.pop(msg.id, None)

    def _engine_lost(self, code: int | None) -> None:
        """The engine died: every stream in flight gets a typed error (the proxy moves it to
        another replica), and the prefix cache is gone."""
        self.load = None
        self.queued.reset()
        self.kv_spec = None
        for fut in self._kv_calls.values():
            if not fut.done():
                fut.set_exception(EngineUnavailable(f"the engine process exited (code {code}) during a KV transfer"))
        for lease in self._leases.values():  # the process is gone: nothing writes their slots any more
            lease.answered()
        self._leases.clear()
        self.cached_blocks.clear()
        if self.metrics is not None:
            self.metrics.engine_restarts.inc()
        for stream in list(self.streams.values()):
            if not stream.done:
                self._finish(stream, P.Error(code=P.INTERNAL, id=stream.id,
                                             message=f"the replica's engine process exited (code {code}) while "
                                                     "serving this request; it is restarting"))
        self._publish(P.KvEvents(cleared=True))
        for fn in list(self.lost_listeners):
            fn()

    # -- engine -> streams -----------------------------------------------------------
    def _dispatch(self, msg) -> None:
        if isinstance(msg, P.Tokens):
            stream = self.streams.get(msg.id)
            if stream is None or stream.detok.stopped:
                return
            text = self._on_tokens(stream, msg.ids)
            if stream.detok.stopped:
                # A stop string: the text ends here. Ask the engine to drop the request;
                # its Finished (with exact usage) closes the stream.
                stream.stop_text, stream.stop_ids, stream.stop_logprobs = text, msg.ids, msg.logprobs
                self._send([P.Abort(id=stream.id)])
            else:
                msg.text = text
                stream.sink(msg)
        elif isinstance(msg, P.Finished):
            stream = self.streams.get(msg.id)
            if stream is None:
                if msg.id in self.aborting:  # a cancel's work (its prefill, its cache hit) counts too
                    self.aborting.discard(msg.id)
                    self._count_finish(msg)
                return
            if stream.detok.stopped:
                msg.text, msg.ids, msg.logprobs, msg.finish_reason = (stream.stop_text, stream.stop_ids,
                                                                      stream.stop_logprobs, P.FINISH_STOP)
            else:
                text = self._on_tokens(stream, msg.ids) if msg.ids else ""
                msg.text = text + ("" if stream.detok.stopped else stream.detok.flush())
                if stream.detok.stopped:
                    msg.finish_reason = P.FINISH_STOP
            msg.usage.completion_tokens = min(msg.usage.completion_tokens, stream.num_tokens + stream.num_resumed)
            self._finish(stream, msg)
        elif isinstance(msg, P.Error):
            self.aborting.discard(msg.id)
            stream = self.streams.get(msg.id) if msg.id else None
            if stream is not None:
                self._finish(stream, msg)
        elif isinstance(msg, P.Hello):  # a (re)started engine: it has taken nothing yet
            self.queued.reset()
        elif isinstance(msg, P.Load):
            self.queued.from_engine(msg)
            self.load = self.queued.current(self.draining)
            self._publish(self.load)
        elif isinstance(msg, P.KvEvents):
            self.cached_blocks.difference_update(msg.removed)
            self.cached_blocks.update(msg.stored)
            self._publish(msg)
        elif isinstance(msg, (P.KvBlocks, P.KvWritten, P.KvChains)):
            lease = self._leases.pop(msg.id, None)
            if lease is not None:
                lease.answered()
            fut = self._kv_calls.get(msg.id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, P.KvSpec):
            self.kv_spec = msg

    def _on_tokens(self, stream: EngineStream, ids: list[int]) -> str:
        now = time.perf_counter()
        if stream.num_tokens == 0:
            stream.ttft_s = now - stream.arrival
            if self.metrics is not None:
                self.metrics.ttft.observe(stream.ttft_s)
        elif self.metrics is not None:
            self.metrics.itl.observe(now - stream.last_token)
        stream.last_token = now
        stream.num_tokens += len(ids)
        return stream.detok.add(ids)

    def _finish(self, stream: EngineStream, msg) -> None:
        self.streams.pop(stream.id, None)
        stream.done = True
        stream.sink(msg)
        self._count_finish(msg)
        self._check_idle()

    def _count_finish(self, msg) -> None:
        if self.metrics is not None and isinstance(msg, P.Finished):
            self.metrics.requests.inc(msg.finish_reason)
            self.metrics.prompt_tokens.inc(by=msg.usage.prompt_tokens)
            self.metrics.cached_tokens.inc(by=msg.usage.cached_tokens)
            self.metrics.generation_tokens.inc(by=msg.usage.completion_tokens)

    def _publish(self, msg) -> None:
        for sink in list(self.subscribers):
            sink(msg)
