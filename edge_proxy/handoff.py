"""Hand-off: a draining replica's streams move to successors with their KV, nothing recomputed.

When a replica says it drains (`Load.draining`: replica.api.drain; `pool` hands its streams here
once), for each of its running streams:
  1. a successor is picked as failover places a stream (`Proxy.successor`: the router over the
     ready replicas, which the draining one no longer is);
  2. the successor is asked to pull the stream's KV from the draining replica (`POST
     successor/v1/kv/pull`, the replica secret, at the WebSocket's host and port): the prompt ids
     and the ids generated so far but the last (sampled, never computed). It fetches every full
     block of them it lacks, checked whole, into its prefix cache. Meanwhile the stream goes on
     streaming from the draining replica, so the client sees no gap for it;
  3. the stream moves exactly as failover moves one (`Proxy.hand_off`: a resume with the ids so
     far, aborted on the draining replica): the successor's prefix cache serves every full block
     it pulled, so it computes only the last partial block and the tokens that came during the
     pull, and its usage counts the rest as cached tokens.
A pull that fails (a refused layout, a source gone) or takes longer than `PULL_TIMEOUT_S` moves
the stream all the same: the successor recomputes what it lacks (today's exact resume). A stream
that finishes, fails or loses its replica during the pull is not moved (failover had it).
n > 1 requests move without a pull (their samples' KV is not one chain). With no other replica
ready a stream stays where it is: it finishes there, or fails over when the replica exits.
"""

from __future__ import annotations

import asyncio
import logging
from time import perf_counter

import httpx

from edge_proxy.routing import Decision

log = logging.getLogger("edge_proxy.handoff")

PULL_TIMEOUT_S = 2.0  # a pull's whole time, request to answer; past it the stream is resumed by recompute
FRAME_BLOCKS = 32  # blocks per export frame (the source caps a frame at 16 MiB)


class Handoff:
    def __init__(self, proxy, timeout_s: float = PULL_TIMEOUT_S, frame_blocks: int = FRAME_BLOCKS,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.proxy = proxy  # core.Proxy: `successor`, `hand_off`, its pool (the secret, TLS)
        self.timeout_s, self.frame_blocks = timeout_s, frame_blocks
        self.transport = transport  # None: the network (tests hand in an httpx.MockTransport)
        self.tasks: set[asyncio.Task] = set()

    def drain(self, conn, streams: list) -> None:
        """`conn` drains: hand each of its `streams` on (in the background)."""
        if not streams:
            return
        task = asyncio.get_running_loop().create_task(self._drain(conn, streams))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _drain(self, conn, streams: list) -> None:
        pool = self.proxy.pool
        headers = {"Authorization": f"Bearer {pool.cfg.secret}"} if pool.cfg.secret else None
        async with httpx.AsyncClient(trust_env=False, headers=headers, verify=pool.ssl or True,
                                     timeout=self.timeout_s, transport=self.transport) as http:
            await asyncio.gather(*(self._one(http, conn, s) for s in streams))

    async def _one(self, http: httpx.AsyncClient, conn, s) -> None:
        d = self.proxy.successor(s)
        if d is None:
            log.warning("replica %s drains: no other replica ready for %s; it stays", conn.id, s.cid)
            return
        to = next(c for c in self.proxy.pool.conns if c.id == d.replica)
        cached = 0
        if s.samples is None:
            t0 = perf_counter()
            body = {"source": conn.base_url, "token_ids": s.gen.prompt_ids + s.ids[:-1],
                    "cache_salt": s.gen.cache_salt, "frame_blocks": self.frame_blocks}
            try:
                r = await asyncio.wait_for(http.post(to.base_url + "/v1/kv/pull", json=body), self.timeout_s)
                res = r.json()
                cached = res.get("cached", 0) + res.get("imported", 0)
                if r.status_code != 200:
                    log.warning("hand-off of %s to %s: pull answered %d (%s); %d blocks there, the rest recomputed",
                                s.cid, to.id, r.status_code, res.get("error", ""), cached)
                else:
                    log.info("hand-off of %s to %s: %d of %d blocks there (%d pulled) in %.3f s", s.cid, to.id,
                             cached, res.get("blocks", 0), res.get("imported", 0), perf_counter() - t0)
            except (TimeoutError, httpx.HTTPError, ValueError) as e:
                log.warning("hand-off of %s to %s: pull failed (%s); resumed by recompute", s.cid, to.id,
                            type(e).__name__ if isinstance(e, TimeoutError) else e)
        self.proxy.hand_off(s, conn, Decision(d.replica, d.reason, cached))
