"""Keep a launched topology running: a replica or proxy process that exits is restarted.

`python -m regions up` (and so `make run`) stops only on SIGINT/SIGTERM. Until
then each watched component is restarted when its process exits, whatever the
exit code: what is left of its process group (an engine, tensor-parallel
workers) is killed, then after a backoff that doubles from `backoff_min_s` to
`backoff_max_s` (starting over once a process has stayed up for `stable_s`) the
same command starts again on the same port, and a line says when it is ready
again. Meanwhile the proxies do what they do with any lost replica: streams move
to another replica of the region (exact resume), and a region with no replica
ready forwards new requests to its nearest peer region.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from time import perf_counter


class Supervisor:
    def __init__(self, respawn: Callable[[object], Awaitable[None]], wait_ready: Callable[[object], Awaitable[None]],
                 kill_group: Callable[[object], None], say: Callable[[str], None], *, backoff_min_s: float = 0.5,
                 backoff_max_s: float = 30.0, stable_s: float = 60.0):
        """respawn(c) starts c's command again; wait_ready(c) returns once it serves (raising
        if it exits first); kill_group(c) kills what is left of c's process group."""
        self._respawn, self._wait_ready, self._kill_group, self._say = respawn, wait_ready, kill_group, say
        self.backoff_min_s, self.backoff_max_s, self.stable_s = backoff_min_s, backoff_max_s, stable_s
        self._keepers: dict[int, asyncio.Task] = {}  # id(component) -> its keeper
        self.restarts: dict[str, int] = {}  # component name -> restarts so far

    def watch(self, c) -> None:
        if id(c) not in self._keepers:
            self._keepers[id(c)] = asyncio.get_running_loop().create_task(self._keep(c))

    async def release(self, comps) -> None:
        """Stop watching (the launcher is about to stop these on purpose)."""
        tasks = [t for t in (self._keepers.pop(id(c), None) for c in comps) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _keep(self, c) -> None:
        backoff = self.backoff_min_s
        while True:
            up = perf_counter()
            code = await c.proc.wait()
            self._kill_group(c)
            if perf_counter() - up > self.stable_s:
                backoff = self.backoff_min_s
            self._say(f"{c.kind} {c.name} exited with code {code}; restarting it in {backoff:g} s")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.backoff_max_s)
            t0 = perf_counter()
            await self._respawn(c)
            self.restarts[c.name] = self.restarts.get(c.name, 0) + 1
            try:
                await self._wait_ready(c)
            except RuntimeError as e:  # the launcher's LaunchError: it died or hung while starting
                self._say(f"{c.kind} {c.name} did not come back: {str(e).splitlines()[0]}")
                self._kill_group(c)  # the next turn restarts it
                continue
            self._say(f"{c.kind} {c.name} restarted: ready in {perf_counter() - t0:.1f} s (pid {c.proc.pid}, "
                      f"restart {self.restarts[c.name]})")
