"""API-process side of the engine: spawns the engine process, owns the local
socket, and turns the engine's token ids into per-request text streams.

Each request has a `Stream` whose sink receives protocol messages (Tokens with
text, Finished, Error). Incremental detokenization and stop strings happen here,
not in the engine: when a stop string appears the stream finishes at once and an
Abort goes to the engine, which frees the blocks before its next step.

A request with n > 1 samples (`SampleGroup`) goes to the engine as one request per
sample, `<id>#<i>`, seeded `sample_seed(seed, i)`; samples after the first name it
in `fork_of`, so the engine computes the prompt once and shares its blocks
(replica.forks). Their messages come back under the request's id with `index = i`;
the first error ends them all.
Imports no torch: the engine runs in its own process.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from wire import protocol as P
from replica.config import EngineConfig
from replica.tokenizer import IncrementalDetokenizer, Tokenizer

Sink = Callable[[object], None]


class Stream:
    """One request as seen by the API process."""

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
    def __init__(self, cfg: EngineConfig, tokenizer: Tokenizer, replica_id: str = "replica", metrics=None):
        self.cfg, self.tokenizer, self.replica_id, self.metrics = cfg, tokenizer, replica_id, metrics
        self.streams: dict[str, Stream] = {}
        self.aborting: set[str] = set()  # aborted, their engine Finished (usage, for /metrics) still to come
        self.groups: dict[str, SampleGroup] = {}
        self.hello: P.Hello | None = None
        self.load: P.Load | None = None
        self.cached_blocks: set[int] = set()  # mirror of the engine's prefix cache, for new routers
        self.subscribers: set[Sink] = set()  # receive Load and KvEvents
        self._codec = P.FrameCodec()
        self._proc: subprocess.Popen | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._tmpdir = tempfile.TemporaryDirectory(prefix="edgechat-")
        self.ready = asyncio.Event()
        self.dead = False

    # -- lifecycle -------------------------------------------------------------------
    async def start(self, timeout: float = 600.0) -> None:
        path = os.path.join(self._tmpdir.name, "engine.sock")
        connected: asyncio.Future = asyncio.get_running_loop().create_future()

        def on_connect(reader, writer):
            if not connected.done():
                connected.set_result((reader, writer))

        server = await asyncio.start_unix_server(on_connect, path=path)
        self._proc = subprocess.Popen([sys.executable, "-m", "replica.engine_process", "--socket", path,
                                       "--config", msgspec.json.encode(self.cfg).decode(),
                                       "--replica-id", self.replica_id])
        exited = asyncio.ensure_future(asyncio.to_thread(self._proc.wait))
        try:
            done, _ = await asyncio.wait([connected, exited], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if connected not in done:
                raise RuntimeError(f"engine process failed to start (exit code {self._proc.poll()})")
            reader, self._writer = connected.result()
        finally:
            server.close()
        self._reader_task = asyncio.create_task(self._read_loop(reader, exited))
        await asyncio.wait([asyncio.ensure_future(self.ready.wait()), self._reader_task], timeout=timeout,
                           return_when=asyncio.FIRST_COMPLETED)
        if not self.ready.is_set():
            raise RuntimeError("engine process closed before it was ready")

    async def stop(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                await asyncio.wait_for(asyncio.to_thread(self._proc.wait), 10)
            except TimeoutError:
                self._proc.kill()
        if self._reader_task is not None:
            self._reader_task.cancel()
        self._tmpdir.cleanup()

    # -- requests --------------------------------------------------------------------
    def submit(self, req: P.Generate, sink: Sink) -> None:
        """Send a request to the engine; `sink` then receives its messages.
        req.id must be unique among live requests (callers prefix per connection)."""
        if req.sampling.n == 1 and not req.sample_ids:
            self._open(req, sink)
            self._send([req])
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

    def _open(self, req: P.Generate, sink: Sink) -> None:
        sp = req.sampling
        detok = IncrementalDetokenizer(self.tokenizer, stop=sp.stop, prefix_ids=req.resume_ids,
                                       include_stop=sp.include_stop_str_in_output)
        self.streams[req.id] = Stream(req.id, sink, detok, len(req.resume_ids))

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

    def _send(self, msgs: list) -> None:
        if self.dead or self._writer is None:
            raise ConnectionError("engine process is not running")
        self._writer.write(self._codec.pack(msgs))

    # -- engine -> streams -----------------------------------------------------------
    async def _read_loop(self, reader: asyncio.StreamReader, exited) -> None:
        try:
            while data := await reader.read(1 << 20):
                for msg in self._codec.feed(data):
                    self._dispatch(msg)
        finally:
            self.dead = True
            for stream in list(self.streams.values()):
                self._finish(stream, P.Error(code=P.INTERNAL, message="engine process exited", id=stream.id))

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
        elif isinstance(msg, P.Load):
            self.load = msg
            self._publish(msg)
        elif isinstance(msg, P.KvEvents):
            self.cached_blocks.difference_update(msg.removed)
            self.cached_blocks.update(msg.stored)
            self._publish(msg)
        elif isinstance(msg, P.Hello):
            self.hello = msg
            self.ready.set()

    def _on_tokens(self, stream: Stream, ids: list[int]) -> str:
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

    def _finish(self, stream: Stream, msg) -> None:
        self.streams.pop(stream.id, None)
        stream.done = True
        stream.sink(msg)
        self._count_finish(msg)

    def _count_finish(self, msg) -> None:
        if self.metrics is not None and isinstance(msg, P.Finished):
            self.metrics.requests.inc(msg.finish_reason)
            self.metrics.prompt_tokens.inc(by=msg.usage.prompt_tokens)
            self.metrics.cached_tokens.inc(by=msg.usage.cached_tokens)
            self.metrics.generation_tokens.inc(by=msg.usage.completion_tokens)

    def _publish(self, msg) -> None:
        for sink in list(self.subscribers):
            sink(msg)
