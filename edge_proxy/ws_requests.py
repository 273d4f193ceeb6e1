"""What a public WebSocket client asks for: one `ClientConnection` per accepted socket
(`ws_handshake.StreamEndpoint` accepts it), reading its frames and answering them.

Reading: each `generate` starts a task (tokenizing may take a thread), each
`cancel` ends its request at once (`core.Proxy.cancel`). A connection holds at most
`max_open_per_connection` requests and may cancel `cancel_rate_per_s` times a second
(burst twice that); frames, prompts and open requests are bounded by `limits`.

Writing: the connection is its requests' sink (`sinks.DeltaSink`). The replica reader
never awaits a client: a delta or an end goes into the connection's `ws_outbox.ClientOutbox`
and wakes its `wire.ws_writer.FrameWriter`, which writes what the turn queued straight
into uvicorn's transport (one write per client per event-loop turn) or, with another
server, through ASGI send. A client whose outbox holds more than `max_pending_bytes`
(text, ids, done and error frames alike) is closed with `too_slow` (1008).

Ids: a request is known by the object admitting it, never by its id alone, so a
`generate a`, `cancel a`, `generate a` sequence gives two requests whose frames
never mix, whatever the order admission finishes in; every error about a frame
carries that frame's id when it had a valid one (ids are at most 128 characters,
never echoed beyond that).

Replace, resume, FIM: a `generate` naming `replaces` aborts that open request
at once (answered done/abort, counted as a cancel) and is placed on the replica
the old one ran on, whose cache holds its prefix; `resume` carries the ids a
client already has (from the `ids` of its deltas, asked for with `resumable`);
`prefix` + `suffix` is tokenized here in the model's FIM layout (refused with
`bad_request` where the tokenizer has no FIM tokens).
"""

from __future__ import annotations

import asyncio
import logging

import msgspec

from edge_proxy import protocol as pp
from edge_proxy.auth import TokenBucket
from edge_proxy.core import SubmitRequest
from edge_proxy.limits import check_frame_size, check_message_count, check_open_requests
from edge_proxy.prompt import plan_prompt_ids
from edge_proxy.sinks import Served
from edge_proxy.ws_outbox import ClientOutbox
from edge_proxy.ws_structured import ToolSink, messages, structured
from wire.openai import Fim, OpenAIError
from wire.ws_frames import TEXT
from wire.ws_writer import FrameWriter, TurnFlusher

log = logging.getLogger("edge_proxy.ws")


class ClientConnection:
    """The requests of one client socket: its reader, and the sink of its requests."""

    def __init__(self, receive, send, proxy, key, forwarded_by: str | None = None,
                 flusher: TurnFlusher | None = None):
        self.receive = receive  # raw ASGI (`send` is the writer's)
        self.proxy = proxy
        self.key = key
        self.forwarded_by = forwarded_by  # a peer region's proxy: its requests are never forwarded again
        self.codec = pp.ClientCodec()
        cfg = proxy.cfg
        self.max_open = cfg.max_open_per_connection
        self.max_pending = cfg.max_pending_bytes
        self._cancels = TokenBucket(cfg.cancel_rate_per_s, 2 * cfg.cancel_rate_per_s)
        # Client id -> its request (ProxiedRequest or Forwarded), or the SubmitRequest still being admitted.
        self.active: dict[str, object] = {}
        self.out = ClientOutbox(self.codec, proxy.metrics.coalesced)
        self.writer = FrameWriter(send, self.out, TEXT, flusher)
        self._closing = False
        self._tasks: set[asyncio.Task] = set()

    # -- sink (called by the proxy for its requests; hot path) ------------------

    def delta(self, s: Served, text: str, ntok: int) -> None:
        if self._closing:
            return
        self.out.delta(s, text, ntok)
        if self.out.pending_bytes > self.max_pending:
            self._too_slow()
        else:
            self.writer.wake()

    def finish(self, s: Served, msg: pp.Done | pp.Error) -> None:
        if self.active.get(s.cid) is s:
            del self.active[s.cid]
        if self._closing:
            return
        self.out.final(s, msg)
        self._queued()

    def _answer(self, msg: pp.Done | pp.Error) -> None:
        """A frame of no request (an error, or the done of a request cancelled while admitted)."""
        if self._closing:
            return
        self.out.answer(msg)
        self._queued()

    def _error(self, cid: str | None, e: pp.ProtocolError) -> None:
        self._answer(pp.Error(e.code, e.message, cid, e.retry_after_s))

    def _queued(self) -> None:
        if self.out.pending_bytes > self.max_pending:
            self._too_slow()
        else:
            self.writer.wake()

    def _too_slow(self) -> None:
        log.warning("closing a client %d KiB behind", self.out.pending_bytes >> 10)
        self._closing = True
        self._cancel_all()
        self.writer.close(1008, pp.TOO_SLOW)  # drops what it holds

    # -- reader ----------------------------------------------------------------

    async def run(self) -> None:
        max_bytes = self.proxy.cfg.max_frame_bytes
        try:
            while True:
                msg = await self.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                data = msg.get("text")
                if data is None:
                    data = msg.get("bytes") or b""
                try:
                    check_frame_size(len(data), max_bytes)  # (bytes or characters)
                except pp.ProtocolError as e:
                    self._error(None, e)
                    continue
                try:
                    m = self.codec.decode(data)
                except pp.FrameError as e:
                    self._error(e.id, e)
                    continue
                if type(m) is pp.Cancel:
                    self._cancel(m.id)
                else:
                    self._generate(m)
        finally:
            self._closing = True
            self._cancel_all()
            self.writer.stop()
            for t in list(self._tasks):
                t.cancel()

    def _generate(self, m: pp.Generate) -> None:
        try:
            self._check(m)
        except pp.ProtocolError as e:
            self._error(m.id, e)
            return
        sampling, tools, sink = m.sampling, None, self
        if m.response_format is not None or m.structured_outputs is not None or m.tools:  # ws_structured
            try:
                sampling, tools = structured(m, self.proxy.tokenizer)
            except pp.ProtocolError as e:
                self._error(m.id, e)
                return
            if tools is not None and tools.shown:
                sink = ToolSink(self, self.proxy.tokenizer, tools)
        prefer = None
        if m.replaces is not None:
            wait = self._cancels.take()  # a replace cancels: the same budget
            if wait > 0:
                self._error(m.id, pp.ProtocolError(pp.RATE_LIMITED, "too many cancels (replaces) on this connection",
                                                   round(max(wait, 0.001), 3)))
                return
            prefer = self._replace(m.replaces)
        prompt = Fim(m.prefix, m.suffix or "") if m.prefix is not None else m.prompt
        req = SubmitRequest(m.id, messages(m), prompt, m.session, sampling, m.priority, m.deadline_ms,
                            m.traceparent, self.forwarded_by, m.tenant, tools=tools, resume=m.resume,
                            resumable=m.resumable, prefer=prefer)
        self.active[m.id] = req
        t = asyncio.get_running_loop().create_task(self._start(req, sink))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _check(self, m: pp.Generate) -> None:
        """Raises what refuses a generate before any work (and before it replaces anything)."""
        if m.id in self.active and m.id != m.replaces:
            raise pp.ProtocolError(pp.BAD_REQUEST, f"request id {m.id!r} is already in flight")
        check_open_requests(len(self.active) - (m.replaces in self.active), self.max_open)
        if (m.messages is not None) + (m.prompt is not None) + (m.prefix is not None) != 1:
            raise pp.ProtocolError(pp.BAD_REQUEST, "give exactly one of messages, prompt and prefix (+ suffix)")
        if m.suffix is not None and m.prefix is None:
            raise pp.ProtocolError(pp.BAD_REQUEST, "suffix goes with prefix (fill-in-the-middle)")
        if m.prefix is not None and getattr(self.proxy.tokenizer, "fim", None) is None:
            raise pp.ProtocolError(pp.BAD_REQUEST, "fill-in-the-middle (prefix, suffix) needs a model whose "
                                                   "tokenizer has FIM tokens; this model's has none: send a prompt")
        if m.messages is not None:  # counted before `messages(m)` converts them (the rest: core.Proxy.submit)
            check_message_count(len(m.messages), self.proxy.cfg.limits)
        if m.resumable and m.tools:
            raise pp.ProtocolError(pp.BAD_REQUEST, "resumable does not go with tools (deltas then carry the "
                                                   "content only, not every token)")
        if m.resume is not None:
            sp = m.sampling
            if len(m.resume) > sp.max_tokens:
                raise pp.ProtocolError(pp.BAD_REQUEST, f"resume has {len(m.resume)} ids, over max_tokens "
                                                       f"({sp.max_tokens})")
            if sp.seed is None and sp.temperature > 0:
                raise pp.ProtocolError(pp.BAD_REQUEST, "resume with temperature > 0 needs the request's "
                                                       "sampling.seed (set one when sending it first)")

    def _replace(self, cid: str) -> str | None:
        """Abort open request `cid` (answered done/abort) for a generate that replaces it; the
        replica it ran on, if it had one. An id no longer open is nothing to replace (it ended)."""
        s = self.active.pop(cid, None)
        if s is None:
            return None
        if type(s) is SubmitRequest:  # still being admitted: `_start` drops it
            self._answer(pp.Done(cid, "abort", pp.Usage(), pp.Timing(), self.proxy.cfg.region, ""))
            return None
        conn = getattr(s, "conn", None)  # on a replica (a request forwarded to a peer has none)
        self.proxy.cancel(s, notify=True)
        return conn.id if conn is not None else None

    async def _start(self, req: SubmitRequest, sink) -> None:
        try:
            if isinstance(req.prompt, Fim):
                req.ids, req.sampling = await self._fim(req.prompt, req.sampling)
            s = await self.proxy.submit(self.key, req, sink)
        except pp.ProtocolError as e:
            if self.active.get(req.cid) is req:
                del self.active[req.cid]
                self._error(req.cid, e)
            return
        except Exception:  # a bug: answer this request, keep the connection and everyone else's
            log.exception("request %r failed while being admitted", req.cid)
            if self.active.get(req.cid) is req:
                del self.active[req.cid]
                self._error(req.cid, pp.ProtocolError(pp.INTERNAL, "the proxy failed to admit this request"))
            return
        if self.active.get(req.cid) is not req or self._closing:  # cancelled or disconnected while admitting
            self.proxy.cancel(s, notify=False)
        elif s.done:  # answered already (finish came before the request was registered here)
            del self.active[req.cid]
        else:
            self.active[req.cid] = s
            if req.resumable:
                self.out.with_ids.add(s)

    async def _fim(self, fim: Fim, sampling: pp.Sampling) -> tuple[list[int], pp.Sampling]:
        """A fill-in-the-middle prompt's ids in the model's layout, and its sampling with the
        convention's end-of-infill token as a stop id (where it has one)."""
        proxy = self.proxy
        try:
            ids = await plan_prompt_ids(proxy.tokenizers, proxy.cfg.limits, fim)
        except OpenAIError as e:
            raise pp.ProtocolError(pp.BAD_REQUEST, e.message) from None
        end = proxy.tokenizer.fim.end
        if end is not None and end not in sampling.stop_token_ids:
            sampling = msgspec.structs.replace(sampling, stop_token_ids=[*sampling.stop_token_ids, end])
        return ids, sampling

    def _cancel(self, cid: str) -> None:
        wait = self._cancels.take()
        if wait > 0:
            self._error(cid, pp.ProtocolError(pp.RATE_LIMITED, "too many cancels on this connection",
                                              round(max(wait, 0.001), 3)))
            return
        s = self.active.pop(cid, None)
        if s is None:
            self._error(cid, pp.ProtocolError(pp.NOT_FOUND, f"no request {cid!r} in flight"))
        elif type(s) is SubmitRequest:  # still being admitted: `_start` drops it; answer now
            self._answer(pp.Done(cid, "abort", pp.Usage(), pp.Timing(), self.proxy.cfg.region, ""))
        else:
            self.proxy.cancel(s, notify=True)

    def _cancel_all(self) -> None:
        active, self.active = self.active, {}
        for s in active.values():
            if type(s) is not SubmitRequest:
                self.proxy.cancel(s, notify=False)
