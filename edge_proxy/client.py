"""Reference Python client for the public WebSocket protocol.

    async with await EdgeClient.connect("ws://127.0.0.1:8000/v1/stream", api_key="sk-...") as c:
        req = await c.generate(messages=[{"role": "user", "content": "Hi"}], session="s1", max_tokens=64)
        async for text in req:          # deltas as they arrive
            print(text, end="", flush=True)
        print(req.done.usage, req.done.timing)

With several regions, `EdgeClient.connect_nearest({"eu": "http://...", "us": "http://..."})`
picks the nearest healthy one by /healthz round trip and falls over in RTT order.

Many requests may be in flight on one client; `req.cancel()` aborts one. A
request that ends in an error raises `EdgeError` (code, message, retry_after_s)
from the iteration (or from `result()`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import msgspec
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from edge_proxy import protocol as pp


class EdgeError(Exception):
    def __init__(self, code: str, message: str, retry_after_s: float | None = None):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.retry_after_s = code, message, retry_after_s


class Request:
    """One generate request: iterate for text deltas; `done` once finished."""

    def __init__(self, client: EdgeClient, rid: str):
        self.client, self.id = client, rid
        self.q: asyncio.Queue = asyncio.Queue()
        self.text = ""  # everything received so far
        self.tokens = 0
        self.frames = 0
        self.done: pp.Done | None = None
        self.error: EdgeError | None = None

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

    async def result(self) -> tuple[str, pp.Done]:
        async for _ in self:
            pass
        return self.text, self.done

    async def cancel(self) -> None:
        await self.client._send(pp.Cancel(self.id))


class EdgeClient:
    def __init__(self, ws):
        self.ws = ws
        self.codec = pp.ServerCodec()
        self.requests: dict[str, Request] = {}
        self.errors: list[EdgeError] = []  # errors about the connection, not one request
        self._ids = itertools.count(1)
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def connect(cls, url: str, api_key: str | None = None, origin: str | None = None,
                      **kw) -> EdgeClient:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        ws = await connect(url, additional_headers=headers, origin=origin, compression=None, proxy=None, **kw)
        return cls(ws)

    @classmethod
    async def connect_nearest(cls, regions: dict[str, str], api_key: str | None = None, **kw):
        """Connect to the nearest healthy region: probe each region's `/healthz` RTT (`regions`
        maps names to http(s) base URLs), then try them in RTT order. Returns (client, Probe)."""
        from websockets.exceptions import InvalidHandshake

        from regions.select import NoRegionAvailable, probe_regions, rank, ws_url  # httpx: only when asked

        probes = await probe_regions(regions, kw.pop("samples", 3))
        failures = []
        for p in rank(probes):
            try:
                return await cls.connect(ws_url(p.url), api_key=api_key, **kw), p
            except (OSError, TimeoutError, InvalidHandshake) as e:  # down since the probe, or refused (e.g. 503)
                failures.append(f"{p.region}: {e}")
        raise NoRegionAvailable(probes, failures)

    async def __aenter__(self) -> EdgeClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.ws.close()
        await asyncio.gather(self._reader, return_exceptions=True)

    async def _send(self, msg) -> None:
        await self.ws.send(self.codec.encode(msg).decode())

    async def generate(self, messages: list[dict] | None = None, prompt: str | None = None, *, id: str | None = None,
                       session: str | None = None, priority: str | None = None, deadline_ms: float = 0.0,
                       traceparent: str | None = None, tenant: str | None = None, response_format: dict | None = None,
                       structured_outputs: dict | None = None, tools: list | None = None, tool_choice=None,
                       parallel_tool_calls: bool | None = None, **sampling) -> Request:
        """Start a request; messages may hold tool calls and results, tools and
        response_format mean what they mean in the OpenAI API (done.tool_calls)."""
        rid = id or f"r{next(self._ids)}"
        req = self.requests[rid] = Request(self, rid)
        msgs = msgspec.convert(messages, list[pp.ChatMessage]) if messages is not None else None
        so = msgspec.convert(structured_outputs, pp.StructuredOutputs) if structured_outputs is not None else None
        await self._send(pp.Generate(rid, msgs, prompt, session, pp.Sampling(**sampling), priority, deadline_ms,
                                     traceparent, tenant, response_format, so, tools, tool_choice,
                                     parallel_tool_calls))
        return req

    async def complete(self, *args, **kw) -> tuple[str, pp.Done]:
        return await (await self.generate(*args, **kw)).result()

    async def _read(self) -> None:
        try:
            async for data in self.ws:
                m = self.codec.decode(data)
                req = self.requests.get(m.id) if m.id is not None else None
                if req is None:
                    if type(m) is pp.Error:
                        self.errors.append(EdgeError(m.code, m.message, m.retry_after_s))
                    continue
                if type(m) is pp.Delta:
                    req.text += m.text
                    req.tokens += m.tokens
                    req.frames += 1
                elif type(m) is pp.Done:
                    req.done = m
                    del self.requests[m.id]
                else:
                    req.error = EdgeError(m.code, m.message, m.retry_after_s)
                    del self.requests[m.id]
                req.q.put_nowait(m)
        except ConnectionClosed:
            pass
        finally:
            for req in self.requests.values():
                req.error = EdgeError("disconnected", "the connection closed")
                req.q.put_nowait(pp.Error("disconnected", "the connection closed", req.id))
            self.requests.clear()
