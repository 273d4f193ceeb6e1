"""Reference Python client for the public WebSocket protocol: reconnects, resumes exactly.

    async with await EdgeClient.connect("ws://127.0.0.1:8000/v1/stream", api_key="sk-...") as c:
        req = await c.generate(messages=[{"role": "user", "content": "Hi"}], session="s1", max_tokens=64)
        async for text in req:          # deltas as they arrive
            print(text, end="", flush=True)
        print(req.done.usage, req.done.timing)

With several regions, `EdgeClient.connect_nearest({"eu": "http://...", "us": "http://..."})`
picks the nearest healthy one by /healthz round trip and falls over in RTT order.

Reconnect and exact resume: when the connection closes (a proxy draining closes
with 1012, a crash or a network cut with 1006) or a request is refused or cut with
`shutting_down`, the client reconnects with capped exponential backoff and full
jitter (`Backoff`), re-picking the nearest region each time when it was made by
`connect_nearest`, and sends every open request again with `resume` = the token
ids it already received. Requests therefore go out `resumable` (their deltas
carry ids) with a seed (the client draws one when none is given), so a resumed
stream continues exactly where it stopped: its text equals an uninterrupted
run's, no token missing or repeated. `generate()` during a reconnect queues the
request until the new connection is up. After `Backoff.timeout_s` without one,
or on a refusal that retrying cannot cure (unauthorized, forbidden), open
requests fail with `EdgeError`.

Errors are `EdgeError(code, message, retry_after_s)` with the protocol's stable
codes (raised from the iteration, `result()`, and from `connect` with the
handshake refusal's code, or `unavailable` when nothing answered), never a
transport exception. Many requests may be in flight; `req.cancel()` aborts one,
`generate(..., replaces=req)` aborts it and starts another in one step.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from edge_proxy import protocol as pp

DISCONNECTED = "disconnected"  # client-side code: the connection went and the client does not (or could not) resume
RESUMED_CODES = frozenset({pp.SHUTTING_DOWN})  # a request refused or cut with these is resumed on a new connection
FINAL_CODES = frozenset({pp.UNAUTHORIZED, pp.FORBIDDEN, pp.BAD_REQUEST})  # refusals a reconnect does not cure


class EdgeError(Exception):
    """A request or connection the service refused or lost; `code` is a stable code of
    `edge_proxy.protocol` (or `disconnected`)."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.retry_after_s = code, message, retry_after_s


@dataclass(frozen=True)
class Backoff:
    """Reconnect delays: attempt k waits uniform(0, min(max_s, initial_s * 2**k)) ("full jitter",
    so clients cut off together do not come back together); give up after `timeout_s`."""

    initial_s: float = 0.1
    max_s: float = 2.0
    timeout_s: float = 30.0
    max_resumes: int = 8  # per request: a request that keeps losing its connection fails after this many

    def delay(self, attempt: int, rng: random.Random) -> float:
        return rng.uniform(0.0, min(self.max_s, self.initial_s * 2 ** min(attempt, 30)))


class Request:
    """One generate request: iterate for text deltas; `done` once finished."""

    def __init__(self, client: EdgeClient, rid: str, gen: pp.Generate):
        self.client, self.id, self.gen = client, rid, gen
        self.q: asyncio.Queue = asyncio.Queue()
        self.text = ""  # everything received so far
        self.tokens = 0
        self.ids: list[int] = []  # token ids received (resumable requests)
        self.frames = 0
        self.resumes = 0  # times it was sent again on a new connection
        self.done: pp.Done | None = None
        self.error: EdgeError | None = None
        self.conn: _Conn | None = None  # the connection it runs on; None while waiting for one
        self.predecessor: Request | None = None  # the open request of the same id it replaced

    def __aiter__(self) -> AsyncIterator[str]:
        return self._iter()

    async def _iter(self):
        while True:
            m = await self.q.get()
            if type(m) is pp.Delta:
                yield m.text
            elif type(m) is pp.Done:
                return
            else:
                raise self.error

    @property
    def finished(self) -> bool:
        return self.done is not None or self.error is not None

    async def result(self) -> tuple[str, pp.Done]:
        async for _ in self:
            pass
        return self.text, self.done

    async def cancel(self) -> None:
        """Abort; the request ends with done (`abort`)."""
        if self.finished:
            return
        if self.conn is None:  # waiting for a connection: nothing runs anywhere
            self.client._end(self, pp.Done(self.id, "abort", pp.Usage(), pp.Timing(), "", ""))
            return
        await self.client._send(self.conn, pp.Cancel(self.id))

    # -- frames (from the client's reader) ----------------------------------------

    def _on_delta(self, m: pp.Delta) -> None:
        self.text += m.text
        self.tokens += m.tokens
        if m.ids:
            self.ids += m.ids
        self.frames += 1
        self.q.put_nowait(m)


class _Conn:
    """One WebSocket and its reader task."""

    __slots__ = ("ws", "reader", "retired")

    def __init__(self, ws):
        self.ws = ws
        self.reader: asyncio.Task | None = None
        self.retired = False  # the proxy behind it drains: no new requests go there


class EdgeClient:
    """`connect`/`connect_nearest` make a client that reconnects; `EdgeClient(ws)` wraps one
    open connection and ends its requests with `disconnected` when it closes."""

    def __init__(self, ws=None, *, dial=None, backoff: Backoff | None = None, rng: random.Random | None = None):
        self.codec = pp.ServerCodec()
        self.requests: dict[str, Request] = {}
        self.errors: list[EdgeError] = []  # errors about the connection, not one request
        self.backoff = backoff or Backoff()
        self.reconnects = 0  # connections made after the first
        self.region = ""  # connect_nearest: the region of the current connection
        self._dial = dial  # async () -> ws: how to (re)connect; None: no reconnect
        self._rng = rng or random.Random()
        self._ids = itertools.count(1)
        self._conn: _Conn | None = None  # where new requests go
        self._conns: set[_Conn] = set()  # every open connection (retired ones finish their requests)
        self._chosen: list = []  # connect_nearest: the probe of each connection made
        self._closed = False
        self._reconnector: asyncio.Task | None = None
        if ws is not None:
            self._adopt(ws)

    # -- connecting -------------------------------------------------------------

    @classmethod
    async def connect(cls, url: str, api_key: str | None = None, origin: str | None = None, *,
                      reconnect: bool = True, backoff: Backoff | None = None, **kw) -> EdgeClient:
        """Open `url` (ws:// or wss://; `ssl=` an SSLContext for a private CA). Raises EdgeError."""

        async def dial():
            return await open_ws(url, api_key, origin, **kw)

        return cls(await dial(), dial=dial if reconnect else None, backoff=backoff)

    @classmethod
    async def connect_nearest(cls, regions: dict[str, str], api_key: str | None = None, *, samples: int = 3,
                              reconnect: bool = True, backoff: Backoff | None = None, **kw):
        """Connect to the nearest healthy region: probe each region's `/healthz` RTT (`regions`
        maps names to http(s) base URLs), then try them in RTT order; every reconnect probes
        again. Returns (client, Probe); raises `edge_proxy.select.NoRegionAvailable` (a
        ConnectionError naming each region's failure) when none accepts the first connection."""
        from edge_proxy.select import NoRegionAvailable, probe_regions, rank, ws_url  # httpx: only when asked

        chosen = []

        async def dial():
            probes = await probe_regions(regions, samples)
            failures = []
            for p in rank(probes):
                try:
                    ws = await open_ws(ws_url(p.url), api_key, **kw)
                except EdgeError as e:  # down since the probe, or refused (e.g. 503)
                    failures.append(f"{p.region}: {e}")
                    continue
                chosen.append(p)
                return ws
            raise NoRegionAvailable(probes, failures)

        client = cls(dial=dial if reconnect else None, backoff=backoff)
        client._chosen = chosen
        client._adopt(await dial())
        return client, chosen[-1]

    def _adopt(self, ws) -> None:
        conn = self._conn = _Conn(ws)
        self._conns.add(conn)
        conn.reader = asyncio.get_running_loop().create_task(self._read(conn))
        if self._chosen:
            self.region = self._chosen[-1].region

    @property
    def ws(self):
        """The current connection's WebSocket (None while reconnecting)."""
        return self._conn.ws if self._conn is not None else None

    @property
    def closed(self) -> bool:
        """No connection, and none coming (closed, or a client that does not reconnect)."""
        return self._closed or (self._conn is None and self._dial is None)

    async def __aenter__(self) -> EdgeClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        self._closed = True
        if self._reconnector is not None:
            self._reconnector.cancel()
        conns = list(self._conns)
        for c in conns:
            await c.ws.close()
        await asyncio.gather(*(c.reader for c in conns), return_exceptions=True)
        self._fail_waiting(EdgeError(DISCONNECTED, "the client was closed"))

    # -- requests ---------------------------------------------------------------

    async def generate(self, messages: list[dict] | None = None, prompt: str | None = None, *, id: str | None = None,
                       session: str | None = None, priority: str | None = None, deadline_ms: float = 0.0,
                       traceparent: str | None = None, tenant: str | None = None, response_format: dict | None = None,
                       structured_outputs: dict | None = None, tools: list | None = None, tool_choice=None,
                       parallel_tool_calls: bool | None = None, prefix: str | None = None, suffix: str | None = None,
                       replaces: Request | str | None = None, resumable: bool = False, resume: list[int] | None = None,
                       **sampling) -> Request:
        """Send a generate (see docs/protocol.md for the fields; `sampling` holds max_tokens,
        temperature, seed, stop, ...). Messages may hold tool calls and results; tools and
        response_format mean what they mean in the OpenAI API (done.tool_calls). `replaces` (a
        Request or its id) aborts that request in the same step. A reconnecting client sends
        every request `resumable` with a seed (not with tools: their deltas hold content only)."""
        rid = id or f"r{next(self._ids)}"
        old_id = replaces.id if isinstance(replaces, Request) else replaces
        if rid in self.requests and rid != old_id:
            raise EdgeError(pp.BAD_REQUEST, f"request id {rid!r} is already in flight")
        if self._dial is not None and not tools:
            resumable = True
            if sampling.get("seed") is None:
                sampling["seed"] = secrets.randbits(63)  # the proxy's would be lost with the connection
        msgs = msgspec.convert(messages, list[pp.ChatMessage]) if messages is not None else None
        so = msgspec.convert(structured_outputs, pp.StructuredOutputs) if structured_outputs is not None else None
        gen = pp.Generate(rid, msgs, prompt, session, pp.Sampling(**sampling), priority, deadline_ms, traceparent,
                          tenant, response_format, so, tools, tool_choice, parallel_tool_calls, prefix=prefix,
                          suffix=suffix, resumable=resumable, resume=resume)
        old = self.requests.get(old_id) if old_id is not None else None
        req = Request(self, rid, gen)
        if resume:
            req.ids = list(resume)
        conn = self._conn
        if old is not None and not old.finished and (old.conn is not conn or conn is None):
            await old.cancel()  # not on this connection: cancel it where it is (or locally)
            old = None
        if old is not None and rid == old_id:
            req.predecessor = old  # the proxy answers the old one's done before any frame of the new
        self.requests[rid] = req
        if conn is None:
            if self._dial is None or self._closed:
                self._end(req, pp.Error(DISCONNECTED, "the connection is closed", rid))
            self._ensure_reconnect()
            return req
        req.conn = conn
        await self._send(conn, msgspec.structs.replace(gen, replaces=old_id if old is not None else None))
        return req

    async def complete(self, *args, **kw) -> tuple[str, pp.Done]:
        return await (await self.generate(*args, **kw)).result()

    async def _send(self, conn: _Conn, msg) -> None:
        try:
            await conn.ws.send(self.codec.encode(msg).decode())
        except ConnectionClosed:
            pass  # the reader sees the close and resumes (or fails) what ran on it

    def _end(self, req: Request, m) -> None:
        if self.requests.get(req.id) is req:
            del self.requests[req.id]
        if type(m) is pp.Done:
            req.done = m
        else:
            req.error = EdgeError(m.code, m.message, m.retry_after_s)
        req.conn = None
        req.q.put_nowait(m)

    # -- reading ----------------------------------------------------------------

    async def _read(self, conn: _Conn) -> None:
        decode = self.codec.decode
        try:
            async for data in conn.ws:
                m = decode(data)
                req = self.requests.get(m.id) if m.id is not None else None
                if req is not None and req.predecessor is not None:
                    if not req.predecessor.finished:
                        req = req.predecessor  # frames of the replaced request come first
                    else:
                        req.predecessor = None
                if req is None or req.conn is not conn:
                    if type(m) is pp.Error and m.id is None:
                        self.errors.append(EdgeError(m.code, m.message, m.retry_after_s))
                    continue
                t = type(m)
                if t is pp.Delta:
                    req._on_delta(m)
                elif t is pp.Done:
                    self._end(req, m)
                elif m.code in RESUMED_CODES and self._dial is not None and not self._closed:
                    req.conn = None  # the proxy drains: resume it on the next connection
                    self._retire(conn)
                else:
                    self._end(req, m)
        except ConnectionClosed:
            pass
        finally:
            self._on_close(conn)

    def _retire(self, conn: _Conn) -> None:
        """No new request goes to `conn` (its proxy drains); its open ones finish there."""
        conn.retired = True
        if self._conn is conn:
            self._conn = None
        self._ensure_reconnect()

    def _on_close(self, conn: _Conn) -> None:
        self._conns.discard(conn)
        if self._conn is conn:
            self._conn = None
        lost = [r for r in self.requests.values() if r.conn is conn]
        for r in lost:
            r.conn = None
        if self._dial is None or self._closed:
            self._fail_waiting(EdgeError(DISCONNECTED, "the connection closed"))
        elif any(r.conn is None for r in self.requests.values()):
            self._ensure_reconnect()
        elif not conn.retired and not self._closed:
            self._ensure_reconnect()  # idle: reconnect now, so the next generate does not wait

    def _fail_waiting(self, err: EdgeError) -> None:
        for r in [r for r in self.requests.values() if r.conn is None]:
            self._end(r, pp.Error(err.code, err.message, r.id, err.retry_after_s))

    # -- reconnecting -----------------------------------------------------------

    def _ensure_reconnect(self) -> None:
        if self._dial is None or self._closed or self._conn is not None:
            return
        if self._reconnector is None or self._reconnector.done():
            self._reconnector = asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        b = self.backoff
        give_up = time.monotonic() + b.timeout_s
        attempt = 0
        while not self._closed:
            await asyncio.sleep(b.delay(attempt, self._rng))
            attempt += 1
            try:
                ws = await self._dial()
            except (EdgeError, ConnectionError) as e:
                code = getattr(e, "code", pp.UNAVAILABLE)
                if code in FINAL_CODES or time.monotonic() >= give_up:
                    self._fail_waiting(EdgeError(code, f"could not reconnect: {e}"))
                    return
                continue
            if self._closed:
                await ws.close()
                return
            self.reconnects += 1
            self._adopt(ws)
            await self._resend(self._conn)
            return

    async def _resend(self, conn: _Conn) -> None:
        """Every request waiting for a connection, sent again from the ids it has."""
        for req in [r for r in self.requests.values() if r.conn is None]:
            if req.resumes >= self.backoff.max_resumes:
                self._end(req, pp.Error(DISCONNECTED, f"lost its connection {req.resumes + 1} times", req.id))
                continue
            req.resumes += 1
            req.predecessor = None
            req.conn = conn
            await self._send(conn, msgspec.structs.replace(req.gen, replaces=None, resume=req.ids or None))


async def open_ws(url: str, api_key: str | None = None, origin: str | None = None, **kw):
    """A public-protocol WebSocket to `url`; refusals and failures as `EdgeError`."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    kw.setdefault("open_timeout", 10)
    try:
        return await ws_connect(url, additional_headers=headers, origin=origin, compression=None, proxy=None, **kw)
    except InvalidStatus as e:
        r = e.response
        try:
            body = json.loads(r.body or b"{}")
        except ValueError:
            body = None
        body = body if isinstance(body, dict) else {}
        code = body.get("code")
        retry = r.headers.get("Retry-After")
        raise EdgeError(code or pp.UNAVAILABLE, body.get("message") or f"handshake answered HTTP {r.status_code}",
                        float(retry) if retry and retry.isdigit() else None) from None
    except (OSError, TimeoutError, InvalidHandshake) as e:
        raise EdgeError(pp.UNAVAILABLE, f"cannot connect to {url}: {e or type(e).__name__}") from None
