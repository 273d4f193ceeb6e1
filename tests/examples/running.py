"""The replica's own count of running requests (`edgechat_replica_running` on its /metrics),
sampled in the background while a test drives a client. The engine reports its load after
every step that admits, aborts or finishes a request, so no sample is a report behind."""

from __future__ import annotations

import asyncio
import re
from time import perf_counter

import httpx

from tests.replica.server import AUTH

_RUNNING = re.compile(r"^edgechat_replica_running (\S+)$", re.M)


class ReplicaRunning:
    def __init__(self, replica_url: str, period_s: float = 0.005):
        self.url, self.period_s = replica_url + "/metrics", period_s
        self.samples: list[tuple[float, int]] = []  # (perf_counter, running)
        self._http: httpx.AsyncClient | None = None
        self._task: asyncio.Task | None = None

    async def read(self) -> int:
        r = await self._http.get(self.url)
        return int(float(_RUNNING.search(r.text).group(1)))

    async def counter(self, name: str) -> float:
        """A counter of the replica's /metrics (`name` with its labels, as printed)."""
        r = await self._http.get(self.url)
        for line in r.text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        return 0.0

    async def _loop(self) -> None:
        while True:
            self.samples.append((perf_counter(), await self.read()))
            await asyncio.sleep(self.period_s)

    def since(self, t: float) -> list[int]:
        return [n for at, n in self.samples if at >= t]

    async def __aenter__(self) -> ReplicaRunning:
        self._http = httpx.AsyncClient(trust_env=False, timeout=10, headers=AUTH)  # /metrics takes the secret
        self._task = asyncio.get_running_loop().create_task(self._loop())
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self._http.aclose()
