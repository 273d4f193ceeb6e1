"""A replica's drain: admit nothing new, serve the running streams and the KV export until the
proxies have handed them on, then exit (bounded).

Started by SIGTERM to the API process (replica.__main__'s server: what Kubernetes sends a pod's
first process) or an operator's `POST /v1/drain` (behind the replica secret). From then on:
  * every Load this replica sends says `draining` (the last one is re-sent at once, to every
    proxy), so the proxies route nothing new here and hand its streams on (edge_proxy.handoff:
    the successor pulls their KV from here over /v1/kv/export, each stream resumes there from its
    next token and is aborted here);
  * a Generate that still arrives is refused `overloaded` (a proxy retries it on another replica);
  * /healthz keeps answering 200 (with "draining": true): a failing probe would make the proxies
    fail the streams over by recompute instead of handing them on;
  * the cached conversations no stream holds (its hot chains) are listed to the proxies that ask
    (`POST /v1/kv/hot`, replica.api.kv_routes), each of which places them as it would their next
    turn and has the replica there pull them; a proxy's ask holds the exit (`Holds`) until it lets
    go (`DELETE /v1/kv/hot/{hold}`) or its hold runs out;
  * once no stream runs here and no hold is left (or after `timeout_s`: streams no proxy moved,
    e.g. no other replica is ready) `on_drained` is called: the server shuts down (its sockets,
    then the engine). An export still running then is served to its end (the server lets its
    requests finish).
A second SIGTERM, or SIGINT, exits at once as before (the proxies resume the streams by recompute).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from time import perf_counter

log = logging.getLogger("replica.api.drain")

DRAIN_TIMEOUT_S = 20.0  # inside Kubernetes' default 30 s grace period, with the shutdown's own 5 s after it
HOLD_GRACE_S = 1.5  # a drain with no stream left waits this long from its start for a proxy's hold: proxies ask
#                     within milliseconds of the drain's Load, so an idle replica's hot chains are not lost to a race


class Holds:
    """Proxies' holds on a draining replica's exit, each taken with its list of hot chains (`take`)
    and let go once that proxy's pulls ended (`release`), or at its own bound."""

    def __init__(self):
        self._until: dict[str, float] = {}  # hold -> when it runs out (perf_counter)
        self._ids = itertools.count(1)
        self._changed = asyncio.Event()
        self.taken = 0  # holds taken in all

    def take(self, hold_s: float) -> str:
        hold = f"h{next(self._ids)}"
        self._until[hold] = perf_counter() + hold_s
        self.taken += 1
        self._changed.set()
        return hold

    def release(self, hold: str) -> bool:
        found = self._until.pop(hold, None) is not None
        self._changed.set()
        return found

    async def first(self, until: float) -> None:
        """Until a hold was taken, or `until`."""
        while not self.taken and perf_counter() < until:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), until - perf_counter())
            except TimeoutError:
                pass

    async def wait(self, deadline: float) -> None:
        """Until no hold is left (each let go or run out), or the deadline."""
        while True:
            now = perf_counter()
            self._until = {h: t for h, t in self._until.items() if t > now}
            if not self._until or now >= deadline:
                return
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(min(self._until.values()), deadline) - now)
            except TimeoutError:
                pass


class Drain:
    def __init__(self, timeout_s: float = DRAIN_TIMEOUT_S, grace_s: float = HOLD_GRACE_S):
        self.timeout_s, self.grace_s = timeout_s, grace_s
        self.holds = Holds()  # the proxies' (replica.api.kv_routes takes and lets go of them)
        self.client: Callable[[], object] | None = None  # the EngineClient's getter (replica.api.app binds it)
        self.on_drained: Callable[[], None] | None = None  # the server's exit (replica.__main__ binds it)
        self.started = False
        self.task: asyncio.Task | None = None

    def start(self) -> bool:
        """Begin draining (on the event loop); False when it already had."""
        if self.started:
            return False
        self.started = True
        client = self.client()
        client.drain()
        log.warning("replica draining: %d streams running; exiting once none is left (at most %g s)",
                    len(client.streams), self.timeout_s)
        self.task = asyncio.get_running_loop().create_task(self._wait(client))
        return True

    async def _wait(self, client) -> None:
        t0 = perf_counter()
        deadline = t0 + self.timeout_s
        try:
            await asyncio.wait_for(client.idle.wait(), self.timeout_s)
            t_idle = perf_counter()
            await self.holds.first(t0 + self.grace_s)  # no stream kept the replica up while the proxies asked
            await self.holds.wait(deadline)
            log.warning("replica drained in %.3f s (streams moved in %.3f s, %d holds on its hot chains)",
                        perf_counter() - t0, t_idle - t0, self.holds.taken)
        except TimeoutError:
            log.warning("replica drain: %d streams still here after %g s; exiting anyway", len(client.streams),
                        self.timeout_s)
        if self.on_drained is not None:
            self.on_drained()
