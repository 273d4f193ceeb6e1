"""API-process side of the engine: spawns the engine process, owns the local
socket, and turns the engine's token ids into per-request text streams.

Each request has a `Stream` whose sink receives protocol messages (Tokens with
text, Finished, Error). Incremental detokenization and stop strings happen here,
not in the engine: when a stop string appears the stream finishes at once and an
Abort goes to the engine, which frees the blocks before its next step.
Imports no torch: the engine runs in its own process.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import msgspec

from wire import protocol as P
from replica.config import EngineConfig
from replica.tokenizer import IncrementalDetokenizer, Tokenizer

Sink = Callable[[object], None]


class Stream:
    """One request as seen by the API process."""

    __slots__ = ("id", "sink", "detok", "num_resumed", "arrival", "last_token", "done", "ttft_s", "num_tokens",
                 "stop_text")

    def __init__(self, id: str, sink: Sink, detok: IncrementalDetokenizer, num_resumed: int):
        self.id, self.sink, self.detok, self.num_resumed = id, sink, detok, num_resumed
        self.stop_text = ""
        self.arrival = time.perf_counter()
        self.last_token = 0.0
        self.ttft_s = 0.0
        self.num_tokens = 0
        self.done = False


class EngineClient:
    def __init__(self, cfg: EngineConfig, tokenizer: Tokenizer, replica_id: str = "replica", metrics=None):
        self.cfg, self.tokenizer, self.replica_id, self.metrics = cfg, tokenizer, replica_id, metrics
        self.streams: dict[str, Stream] = {}
        self.hello: P.Hello | None = None
        self.load: P.Load | None = None
        self.cached_blocks: set[int] = set()  # mirror of the engine's prefix cache, for new routers
        self.subscribers: set[Sink] = set()  # receive Load and KvEvents
        self._codec = P.FrameCodec()
        self._ids = itertools.count()
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
    def new_id(self) -> str:
        return f"r{next(self._ids)}"

    def submit(self, req: P.Generate, sink: Sink) -> Stream:
        """Send a request to the engine; `sink` then receives its messages.
        req.id must be unique among live streams (callers prefix per connection)."""
        detok = IncrementalDetokenizer(self.tokenizer, stop=req.sampling.stop, prefix_ids=req.resume_ids)
        stream = Stream(req.id, sink, detok, len(req.resume_ids))
        self.streams[req.id] = stream
        self._send([req])
        return stream

    def abort(self, req_id: str) -> None:
        """Cancel: the engine frees the request before its next step."""
        stream = self.streams.pop(req_id, None)
        if stream is not None and not stream.done:
            stream.done = True
            self._send([P.Abort(id=req_id)])

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
                stream.stop_text = text
                self._send([P.Abort(id=stream.id)])
            else:
                stream.sink(P.Tokens(id=msg.id, ids=msg.ids, text=text))
        elif isinstance(msg, P.Finished):
            stream = self.streams.get(msg.id)
            if stream is None:
                return
            if stream.detok.stopped:
                msg.text, msg.ids, msg.finish_reason = stream.stop_text, [], P.FINISH_STOP
            else:
                text = self._on_tokens(stream, msg.ids) if msg.ids else ""
                msg.text = text + ("" if stream.detok.stopped else stream.detok.flush())
                if stream.detok.stopped:
                    msg.finish_reason = P.FINISH_STOP
            msg.usage.completion_tokens = min(msg.usage.completion_tokens, stream.num_tokens + stream.num_resumed)
            self._finish(stream, msg)
        elif isinstance(msg, P.Error):
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
