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
  * once no stream runs here (or after `timeout_s`: streams no proxy moved, e.g. no other replica
    is ready) `on_drained` is called: the server shuts down (its sockets, then the engine).
A second SIGTERM, or SIGINT, exits at once as before (the proxies resume the streams by recompute).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from time import perf_counter

log = logging.getLogger("replica.api.drain")

DRAIN_TIMEOUT_S = 20.0  # inside Kubernetes' default 30 s grace period, with the shutdown's own 5 s after it


class Drain:
    def __init__(self, timeout_s: float = DRAIN_TIMEOUT_S):
        self.timeout_s = timeout_s
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
        try:
            await asyncio.wait_for(client.idle.wait(), self.timeout_s)
            log.warning("replica drained in %.3f s", perf_counter() - t0)
        except TimeoutError:
            log.warning("replica drain: %d streams still here after %g s; exiting anyway", len(client.streams),
                        self.timeout_s)
        if self.on_drained is not None:
            self.on_drained()
