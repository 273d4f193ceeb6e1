"""Timed clients: every frame is stamped where it is read, before anything else runs.

`WsConn` speaks the public protocol (edge_proxy.protocol) over one WebSocket with
many requests in flight; `HttpConn` streams OpenAI chat completions (SSE) over a
pooled httpx client. Both return `Call`s: the send time, each delta's arrival
time and token count, the final `done` (usage, region, replica) or error code, and
cancellation bookkeeping.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from time import perf_counter

import httpx
import msgspec
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from edge_proxy import protocol as pp


class Call:
    __slots__ = ("id", "t_send", "arrivals", "tokens", "text", "done", "error", "finished", "t_end", "t_cancel",
                 "tokens_at_cancel", "_want", "_conn", "region")

    def __init__(self, cid: str, conn):
        self.id, self._conn = cid, conn
        self.t_send = 0.0
        self.arrivals: list[tuple[float, int]] = []  # (perf_counter, tokens in the frame)
        self.tokens = 0
        self.text = ""
        self.done: pp.Done | None = None
        self.error: str | None = None  # error code
        self.finished = asyncio.Event()
        self.t_end = 0.0
        self.t_cancel = 0.0  # when the driver sent cancel (0: never)
        self.tokens_at_cancel = 0
        self._want: tuple[int, asyncio.Future] | None = None
        self.region = ""

    def on_delta(self, now: float, text: str, ntok: int) -> None:
        self.arrivals.append((now, ntok))
        self.tokens += ntok
        self.text += text
        w = self._want
        if w is not None and self.tokens >= w[0] and not w[1].done():
            w[1].set_result(None)

    def on_end(self, now: float, done: pp.Done | None = None, error: str | None = None) -> None:
        if self.finished.is_set():
            return
        self.t_end, self.done, self.error = now, done, error
        if done is not None:
            self.region = done.region
        self.finished.set()
        w = self._want
        if w is not None and not w[1].done():
            w[1].set_result(None)

    async def tokens_or_end(self, n: int) -> None:
        """Until `n` tokens arrived or the request ended."""
        if self.tokens >= n or self.finished.is_set():
            return
        fut = asyncio.get_running_loop().create_future()
        self._want = (n, fut)
        await fut

    def mark_cancelled(self) -> None:
        self.t_cancel = perf_counter()
        self.tokens_at_cancel = self.tokens

    async def cancel(self) -> None:
        if self.finished.is_set() or self.t_cancel:
            return
        self.mark_cancelled()
        await self._conn.cancel(self)

    @property
    def tokens_after_cancel(self) -> int:
        return self.tokens - self.tokens_at_cancel if self.t_cancel else 0


class WsConn:
    """One public-protocol WebSocket; `request` sends a generate and returns its Call."""

    def __init__(self, ws):
        self.ws = ws
        self.enc = msgspec.json.Encoder()
        self.dec = pp.ServerCodec()
        self.calls: dict[str, Call] = {}
        self._ids = itertools.count(1)
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def open(cls, url: str, api_key: str | None = None) -> WsConn:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        ws = await connect(url, additional_headers=headers, compression=None, proxy=None, open_timeout=10,
                           max_size=1 << 24, ping_interval=None)
        return cls(ws)

    async def close(self) -> None:
        await self.ws.close()
        await asyncio.gather(self._reader, return_exceptions=True)

    async def request(self, messages: list[dict] | None = None, prompt: str | None = None, *,
                      session: str | None = None, deadline_ms: float = 0.0, replaces: str | None = None,
                      **sampling) -> Call:
        cid = f"q{next(self._ids)}"
        call = self.calls[cid] = Call(cid, self)
        msgs = [pp.ChatMessage(m["role"], m["content"]) for m in messages] if messages is not None else None
        frame = self.enc.encode(pp.Generate(cid, msgs, prompt, session, pp.Sampling(**sampling), None, deadline_ms,
                                            replaces=replaces))
        call.t_send = perf_counter()
        await self.ws.send(frame.decode())
        return call

    async def cancel(self, call: Call) -> None:
        await self.ws.send(self.enc.encode(pp.Cancel(call.id)).decode())

    async def _read(self) -> None:
        decode, calls = self.dec.decode, self.calls
        try:
            async for data in self.ws:
                now = perf_counter()
                m = decode(data)
                c = calls.get(m.id) if m.id is not None else None
                if c is None:
                    continue
                t = type(m)
                if t is pp.Delta:
                    c.on_delta(now, m.text, m.tokens)
                elif t is pp.Done:
                    del calls[m.id]
                    c.on_end(now, done=m)
                else:
                    del calls[m.id]
                    c.on_end(now, error=m.code)
        except ConnectionClosed:
            pass
        finally:
            now = perf_counter()
            for c in self.calls.values():
                c.on_end(now, error="disconnected")
            self.calls.clear()


class HttpConn:
    """OpenAI chat completions over HTTP with SSE; cancel = close the response."""

    def __init__(self, base_url: str, api_key: str | None = None):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, trust_env=False,
                                      timeout=httpx.Timeout(120.0, connect=10.0),
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self._ids = itertools.count(1)
        self._tasks: dict[Call, asyncio.Task] = {}

    async def close(self) -> None:
        for t in self._tasks.values():
            t.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        await self.http.aclose()

    async def request(self, messages: list[dict] | None = None, prompt: str | None = None, *,
                      session: str | None = None, deadline_ms: float = 0.0, **sampling) -> Call:
        call = Call(f"h{next(self._ids)}", self)
        body = {"stream": True, "stream_options": {"include_usage": True}, **sampling}
        if messages is not None:
            path, body["messages"] = "/v1/chat/completions", messages
        else:
            path, body["prompt"] = "/v1/completions", prompt
        if session is not None:
            body["session"] = session
        if deadline_ms:
            body["deadline_ms"] = deadline_ms
        call.t_send = perf_counter()
        t = asyncio.get_running_loop().create_task(self._run(call, path, body))
        self._tasks[call] = t
        t.add_done_callback(lambda _: self._tasks.pop(call, None))
        return call

    async def cancel(self, call: Call) -> None:
        t = self._tasks.get(call)
        if t is not None:
            t.cancel()

    async def _run(self, call: Call, path: str, body: dict) -> None:
        try:
            async with self.http.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    err = json.loads(await r.aread() or b"{}").get("error", {})
                    call.on_end(perf_counter(), error=err.get("code") or f"http_{r.status_code}")
                    return
                usage, ext, finish = {}, {}, "stop"
                async for line in r.aiter_lines():
                    now = perf_counter()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    for ch in ev.get("choices") or ():
                        text = (ch.get("delta") or {}).get("content") or ch.get("text") or ""
                        if text:
                            call.on_delta(now, text, 1)
                        finish = ch.get("finish_reason") or finish
                    usage = ev.get("usage") or usage
                    ext = ev.get("edgechat") or ext
                details = usage.get("prompt_tokens_details") or {}
                done = pp.Done(call.id, finish, pp.Usage(usage.get("prompt_tokens", 0),
                                                         usage.get("completion_tokens", call.tokens),
                                                         details.get("cached_tokens", 0)),
                               pp.Timing(), ext.get("region", ""), ext.get("replica", ""))
                call.on_end(perf_counter(), done=done)
        except asyncio.CancelledError:  # cancelled by the driver: the proxy sees the disconnect
            call.on_end(perf_counter(), done=pp.Done(call.id, "abort", pp.Usage(), pp.Timing(), "", ""))
        except httpx.HTTPError as e:
            call.on_end(perf_counter(), error=type(e).__name__)
