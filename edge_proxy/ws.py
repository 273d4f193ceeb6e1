"""The public WebSocket endpoint: one `ClientConnection` per client socket.

Reading: each `generate` starts a task (tokenizing may take a thread), each
`cancel` aborts at once. Writing: the replica reader never awaits a client.
It appends to this connection's outbox (one entry per stream, merging text and
token counts) and wakes the writer task, which sends one frame per entry. While
a send is blocked on a slow client (the transport's 64 KiB high-water mark),
new tokens merge into the waiting entries, so a slow client gets fewer, larger
frames and the memory it can pin is bounded by `max_pending_bytes` of undelivered
frames (text, ids, done and error frames alike), past which the connection is
closed with `too_slow` (1008). A connection holds at most `max_open_per_connection`
requests and may cancel `cancel_rate_per_s` times a second (burst twice that).

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

Handshake checks, in order: Origin (the page's own origin, or the `--allowed-origin`
list; 403), subprotocols (an offer must include `edgechat.v1`; 400), failed-auth throttle of the source address (429),
API key from `Authorization: Bearer` or the subprotocol `bearer.<key>` (401),
draining (503).

`StreamEndpoint` is a plain ASGI callable mounted in front of Starlette (see
`app.py`); Starlette's `WebSocket` does the handshake only.

Frames: under uvicorn's sans-I/O websockets protocol (what `server.py` runs) the
connection writes its frames itself, straight into the socket's transport
(`wire.ws_frames`: why, and why it is safe). Deltas that arrive in one event-loop
turn are flushed together at its end, one write per client (`Flusher`), without
waking any task; only a client whose
transport is over its high-water mark gets the writer task, which waits for the
transport to drain while new tokens merge into the pending entries. With any
other ASGI server the writer task sends through ASGI `send`.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit

import msgspec
from starlette.responses import JSONResponse
from starlette.websockets import WebSocket

from edge_proxy import protocol as pp
from edge_proxy.auth import TokenBucket, bearer
from edge_proxy.core import SubmitRequest
from edge_proxy.limits import check_frame_size, check_message_count, check_open_requests
from edge_proxy.peering import FORWARDED_HEADER
from edge_proxy.prompt import plan_prompt_ids
from edge_proxy.structured import ToolSink, messages, structured
from wire.ws_frames import direct_protocol, gone, text_frame
from wire.openai import Fim, OpenAIError

log = logging.getLogger("edge_proxy.ws")

SUBPROTOCOL = "edgechat.v1"
KEY_SUBPROTOCOL_PREFIX = "bearer."


class Flusher:
    """Writes the pending frames of every client touched in this event-loop turn, once, at its end."""

    __slots__ = ("dirty", "scheduled")

    def __init__(self):
        self.dirty: list[ClientConnection] = []
        self.scheduled = False

    def mark(self, conn: ClientConnection) -> None:
        self.dirty.append(conn)
        if not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        dirty, self.dirty, self.scheduled = self.dirty, [], False
        for conn in dirty:
            conn._dirty = False
            conn._flush_direct()


_DEFAULT_PORTS = {"http": 80, "ws": 80, "https": 443, "wss": 443}


def same_origin(origin: str, host: str | None, scheme: str) -> bool:
    """Does `origin` (scheme://host[:port]) name the server the request came to (its Host header,
    over `scheme`: ws/http or wss/https)? A page the proxy serves itself connects from there."""
    try:
        o = urlsplit(origin)
        port = o.port or _DEFAULT_PORTS.get(o.scheme)
        h = urlsplit(f"//{host}") if host else None
        hport = (h.port if h is not None else None) or _DEFAULT_PORTS.get(scheme)
    except ValueError:
        return False
    secure = scheme in ("https", "wss")
    return (h is not None and o.hostname is not None and o.scheme == ("https" if secure else "http")
            and o.hostname == h.hostname and port == hport)


def origin_allowed(origin: str | None, allowed: tuple[str, ...], host: str | None = None,
                   scheme: str = "ws") -> bool:
    """Non-browser clients send no Origin; browsers must come from the server's own origin
    (its page at `/`) or one on the allowlist."""
    return origin is None or "*" in allowed or origin in allowed or same_origin(origin, host, scheme)


def _deny(status: int, code: str, message: str, retry_after_s: float | None = None) -> JSONResponse:
    body = {"type": "error", "code": code, "message": message}
    headers = None
    if retry_after_s:
        body["retry_after_s"] = retry_after_s
        headers = {"Retry-After": str(max(1, round(retry_after_s)))}
    return JSONResponse(body, status_code=status, headers=headers)


_DENY_STATUS = {pp.UNAUTHORIZED: 401, pp.RATE_LIMITED: 429}

# Accounting of the outbox (`max_pending_bytes`): a frame's text plus this much for
# its JSON around it; done and error frames are counted at their usual size.
FRAME_OVERHEAD = 48
DONE_BYTES = 320
IDS_BYTES = 7  # a token id in a delta's `ids` (resumable requests)


class StreamEndpoint:
    """ASGI app for the public WebSocket (`/v1/stream`)."""

    def __init__(self, proxy):
        self.proxy = proxy
        self.flusher = Flusher()

    async def __call__(self, scope, receive, send) -> None:
        proxy, ws = self.proxy, WebSocket(scope, receive, send)
        if not origin_allowed(ws.headers.get("origin"), proxy.cfg.allowed_origins, ws.headers.get("host"),
                              scope.get("scheme", "ws")):
            await ws.send_denial_response(_deny(403, pp.FORBIDDEN, "origin not allowed"))
            return
        offered = [p.strip() for h in ws.headers.getlist("sec-websocket-protocol") for p in h.split(",")]
        offered = [p for p in offered if p]
        if offered and SUBPROTOCOL not in offered:  # we could select none: browsers fail such a handshake
            await ws.send_denial_response(_deny(400, pp.BAD_REQUEST, f"offer the subprotocol {SUBPROTOCOL!r}"))
            return
        token = bearer(ws.headers.get("authorization"))
        if token is None:
            token = next((p[len(KEY_SUBPROTOCOL_PREFIX):] for p in offered if p.startswith(KEY_SUBPROTOCOL_PREFIX)),
                         None)
        client = scope.get("client")
        try:
            key = proxy.authenticate(token, client[0] if client else None)
        except pp.ProtocolError as e:
            await ws.send_denial_response(_deny(_DENY_STATUS[e.code], e.code, e.message, e.retry_after_s))
            return
        if proxy.draining:
            await ws.send_denial_response(_deny(503, pp.SHUTTING_DOWN, "the proxy is draining"))
            return
        await ws.accept(subprotocol=SUBPROTOCOL if offered else None)
        await ClientConnection(receive, send, proxy, key, ws.headers.get(FORWARDED_HEADER), self.flusher).run()


class ClientConnection:
    """Sink (`sinks.DeltaSink`) for the requests of one client socket, and its reader."""

    def __init__(self, receive, send, proxy, key, forwarded_by: str | None = None, flusher: Flusher | None = None):
        self.receive, self.send = receive, send  # raw ASGI
        self._proto = direct_protocol(send) if flusher is not None else None  # frames straight to its transport
        self._flusher = flusher
        self._dirty = False  # queued on the flusher for this loop turn
        self.proxy = proxy
        self.key = key
        self.forwarded_by = forwarded_by  # a peer region's proxy: its requests are never forwarded again
        self.codec = pp.ClientCodec()
        cfg = proxy.cfg
        self.max_open = cfg.max_open_per_connection
        self._cancels = TokenBucket(cfg.cancel_rate_per_s, 2 * cfg.cancel_rate_per_s)
        # Client id -> its Stream (or Forwarded), or the SubmitRequest still being admitted.
        self.active: dict[str, object] = {}
        self._pending: dict = {}  # Stream -> [text, tokens, merged, final, index of its first id in stream.ids]
        self._with_ids: set = set()  # streams whose deltas carry their token ids (`resumable`)
        self._loose: list = []  # frames of no stream: errors, done/abort of requests cancelled while admitted
        self._pending_bytes = 0  # what the two hold, in frame bytes (approximately)
        self._waiter: asyncio.Future | None = None  # the writer, when idle
        self._closing = False
        self._tasks: set[asyncio.Task] = set()

    # -- sink (called by streams, hot path) --------------------------------------

    def delta(self, s, text: str, ntok: int) -> None:
        if self._closing:
            return
        ids = self._with_ids and s in self._with_ids  # a resumable stream: its frames carry their ids
        e = self._pending.get(s)
        if e is None:
            self._pending[s] = [text, ntok, 1, None, len(s.ids) - ntok if ids else 0]
            self._pending_bytes += len(text) + len(s.cid) + FRAME_OVERHEAD
        else:
            e[0] += text
            e[1] += ntok
            e[2] += 1
            self._pending_bytes += len(text)
        if ids:
            self._pending_bytes += IDS_BYTES * ntok
        if self._pending_bytes > self.proxy.cfg.max_pending_bytes:
            self._too_slow()
        if self._waiter is not None:
            self._wake()

    def finish(self, s, msg) -> None:
        if self.active.get(s.cid) is s:
            del self.active[s.cid]
        if self._closing:
            return
        e = self._pending.get(s)
        if e is None:
            self._pending[s] = ["", 0, 0, msg, 0]
        else:
            e[3] = msg
        self._count(msg)
        self._wake()

    def _answer(self, msg) -> None:
        """A frame of no stream (an error, or the done of a request cancelled while admitted)."""
        if self._closing:
            return
        self._loose.append(msg)
        self._count(msg)
        self._wake()

    def _error(self, cid: str | None, e: pp.ProtocolError) -> None:
        self._answer(pp.Error(e.code, e.message, cid, e.retry_after_s))

    def _count(self, msg) -> None:
        if type(msg) is pp.Error:
            self._pending_bytes += len(msg.message) + len(msg.id or "") + FRAME_OVERHEAD
        else:
            self._pending_bytes += DONE_BYTES + len(msg.id)
        if self._pending_bytes > self.proxy.cfg.max_pending_bytes:
            self._too_slow()

    def _wake(self) -> None:
        if self._proto is not None and self._proto.writable.is_set():
            if not self._dirty:
                self._dirty = True
                self._flusher.mark(self)
            return
        w = self._waiter
        if w is not None:
            self._waiter = None
            w.set_result(None)

    def _delta(self, s, text: str, ntok: int, first: int) -> pp.Delta:
        if self._with_ids and s in self._with_ids:
            return pp.Delta(s.cid, text, ntok, s.ids[first:first + ntok])
        return pp.Delta(s.cid, text, ntok)

    def _take(self) -> tuple[list, dict]:
        loose, self._loose = self._loose, []
        batch, self._pending = self._pending, {}
        self._pending_bytes = 0
        return loose, batch

    def _take_frames(self) -> bytes:
        """Everything pending, as consecutive WebSocket frames."""
        enc, frames = self.codec.encode, []
        loose, batch = self._take()
        for msg in loose:
            frames.append(text_frame(enc(msg)))
        coalesced = 0
        for s, (text, ntok, merged, final, first) in batch.items():
            if merged:
                frames.append(text_frame(enc(self._delta(s, text, ntok, first))))
                coalesced += merged > 1
            if final is not None:
                frames.append(text_frame(enc(final)))
                self._with_ids.discard(s)
        if coalesced:
            self.proxy.metrics.coalesced.inc(by=coalesced)
        return b"".join(frames)

    def _flush_direct(self) -> None:
        """End of a loop turn: write what is pending, unless the transport is full (then the writer waits)."""
        proto = self._proto
        if self._closing or gone(proto):
            return
        if not proto.writable.is_set():
            self._wake()
            return
        if self._pending or self._loose:
            proto.transport.write(self._take_frames())

    # -- writer ----------------------------------------------------------------

    async def _write_loop(self) -> None:
        if self._proto is not None:
            return await self._write_loop_direct()
        send, enc = self.send, self.codec.encode
        coalesced = self.proxy.metrics.coalesced
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending and not self._loose:
                self._waiter = loop.create_future()
                await self._waiter
            loose, batch = self._take()
            for msg in loose:
                await send({"type": "websocket.send", "text": enc(msg).decode()})
            for s, (text, ntok, merged, final, first) in batch.items():
                if merged:
                    await send({"type": "websocket.send", "text": enc(self._delta(s, text, ntok, first)).decode()})
                    if merged > 1:
                        coalesced.inc()
                if final is not None:
                    await send({"type": "websocket.send", "text": enc(final).decode()})
                    self._with_ids.discard(s)

    async def _write_loop_direct(self) -> None:
        """Only for a client whose transport is full: wait until it drains, then flush."""
        proto, loop = self._proto, asyncio.get_running_loop()
        while True:
            self._waiter = loop.create_future()
            await self._waiter
            await proto.writable.wait()
            self._flush_direct()

    def _too_slow(self) -> None:
        if self._closing:
            return
        log.warning("closing a client %d KiB behind", self._pending_bytes >> 10)
        self._closing = True
        self._pending.clear()
        self._loose.clear()
        self._pending_bytes = 0
        self._cancel_all()
        t = asyncio.get_running_loop().create_task(
            self.send({"type": "websocket.close", "code": 1008, "reason": pp.TOO_SLOW}))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # -- reader ----------------------------------------------------------------

    async def run(self) -> None:
        writer = asyncio.create_task(self._write_loop())
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
            writer.cancel()
            for t in list(self._tasks):
                t.cancel()

    def _generate(self, m: pp.Generate) -> None:
        try:
            self._check(m)
        except pp.ProtocolError as e:
            self._error(m.id, e)
            return
        sampling, tools, sink = m.sampling, None, self
        if m.response_format is not None or m.structured_outputs is not None or m.tools:  # edge_proxy.structured
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

    async def _start(self, req: SubmitRequest, sink=None) -> None:
        try:
            if isinstance(req.prompt, Fim):
                req.ids, req.sampling = await self._fim(req.prompt, req.sampling)
            s = await self.proxy.submit(self.key, req, sink or self)
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
        elif s.done:  # answered already (finish came before the stream was registered here)
            del self.active[req.cid]
        else:
            self.active[req.cid] = s
            if req.resumable:
                self._with_ids.add(s)

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
