"""A public-protocol client for hostile tests: sends any text (valid or not) and sorts
every answer by request id, keeping frames the reference client would reject."""

from __future__ import annotations

import asyncio
import json
import time

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed


class RawClient:
    def __init__(self, ws, timed: bool = False):
        self.ws = ws
        self.arrivals: dict[str, list[float]] | None = {} if timed else None  # id -> arrival time of each delta
        self.frames: list[dict] = []
        self.deltas: dict[str, list[dict]] = {}  # id -> its delta frames
        self.ended: dict[str, dict] = {}  # id -> its done or error frame (the last one)
        self.endings: dict[str, int] = {}  # id -> how many done/error frames it got
        self.conn_errors: list[dict] = []  # errors without an id
        self.changed = asyncio.Event()
        self.closed: ConnectionClosed | None = None
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def connect(cls, url: str, key: str = "sk-alice", timed: bool = False, **kw) -> RawClient:
        ws = await connect(url, additional_headers={"Authorization": f"Bearer {key}"}, compression=None, proxy=None,
                           max_size=None, **kw)
        return cls(ws, timed)

    async def send(self, msg: dict | str) -> None:
        await self.ws.send(msg if isinstance(msg, str) else json.dumps(msg))

    async def _read(self) -> None:
        try:
            async for data in self.ws:
                f = json.loads(data)
                self.frames.append(f)
                rid = f.get("id")
                if f["type"] == "delta":
                    self.deltas.setdefault(rid, []).append(f)
                    if self.arrivals is not None:
                        self.arrivals.setdefault(rid, []).append(time.perf_counter())
                elif rid is None:
                    self.conn_errors.append(f)
                else:
                    self.ended[rid] = f
                    self.endings[rid] = self.endings.get(rid, 0) + 1
                self.changed.set()
        except ConnectionClosed as e:
            self.closed = e
            self.changed.set()

    def text(self, rid: str) -> str:
        return "".join(d["text"] for d in self.deltas.get(rid, []))

    async def until(self, pred, timeout: float = 10.0) -> None:
        async with asyncio.timeout(timeout):
            while not pred():
                self.changed.clear()
                await self.changed.wait()

    async def close(self) -> None:
        await self.ws.close()
        await asyncio.gather(self._reader, return_exceptions=True)

    async def __aenter__(self) -> RawClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def generate(rid: str, prompt: str = "hello", max_tokens: int = 8, **kw) -> dict:
    return {"type": "generate", "id": rid, "prompt": prompt, "sampling": {"max_tokens": max_tokens, "temperature": 0,
                                                                           **kw.pop("sampling", {})}, **kw}
