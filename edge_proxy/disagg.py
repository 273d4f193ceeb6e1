"""Prefill/decode disaggregation (opt-in): a cold prompt is computed on a prefill replica, its
KV pulled by the decode replica the router chose, and the stream starts there.

Roles come from the replicas (`Hello.role`, `python -m replica --role`; a topology's replicas
say theirs: regions.topology), so every proxy of a region sees them alike. A prefill-role
replica never takes a stream (`pool.ready()` leaves it out); a "both" replica serves as today.

For a new request placed (router, then admission) on a decode-role replica D (`take`):
  * D's cache already holds all but fewer than `min_blocks` of the prompt's usable full blocks, or
    no prefill replica is ready, or the request asks for prompt logprobs or resumes a client's
    tokens (`SubmitRequest.resume`: D computes them with the prompt): served on D as today
    (colocated). `min_blocks` is the proxy's --disagg-min-blocks, MIN_BLOCKS = 4 by default (64 tokens
    at the default block size; on a GPU, where a prefill row costs far less than here, raise it): below it the hand-off's
    fixed cost, two HTTP calls (prefill, pull) and the pull's export stream (docs/perf.md,
    "Prefill/decode disaggregation"), is of the order of computing those tokens on a CPU.
  * else a prefill replica P is chosen, the least work away: the prompt tokens P lacks (its KV
    events, as routing reads them) plus the prefills this proxy has in flight there and P's
    reported queue. The prompt is POSTed to P's /v1/prefill (replica.api.prefill:
    computed into its prefix cache; P is sent the whole prompt, so each row is computed as D would
    compute it: the same bytes), then D is asked to pull the full blocks it can use (`POST
    D/v1/kv/pull`, the replica secret, source P: replica.api.kv_import), and the stream starts on D
    (`Proxy.prefilled`) with the blocks D now holds: D computes only the last block (partial, or the
    whole last one when the prompt ends on a block boundary: its last token must be computed).
The client sees one ordinary stream: its TTFT counts from the request, hand-off included.
Counted in edgechat_proxy_disagg_total{outcome} and edgechat_proxy_disagg_blocks_total.

Failures fall back to colocated serving on D, exactly (the same Generate; D computes what it
lacks): P refusing or unreachable, past PREFILL_TIMEOUT_S, a pull answering an error or past
PULL_TIMEOUT_S (blocks it cached stay and are used). A request cancelled meanwhile never
starts; one whose D went away meanwhile is placed again, colocated.
"""

from __future__ import annotations

import asyncio
import logging
from time import perf_counter

import httpx

from edge_proxy.routing import Decision

log = logging.getLogger("edge_proxy.disagg")

MIN_BLOCKS = 4  # uncached full blocks on the decode replica from which a prompt is prefilled elsewhere
# P's /v1/prefill, request to answer: a 4k prompt took 17-20 s on one thread of this CPU (docs/perf.md); a P
# that dies or restarts its engine answers at once (a broken connection, a 503), so this bounds a stuck one only
PREFILL_TIMEOUT_S = 120.0
PULL_TIMEOUT_S = 10.0  # D's pull from P, request to answer (a 4k prompt's 94 MB took 0.6-0.9 s here)
FRAME_BLOCKS = 32  # blocks per export frame (as edge_proxy.handoff)


def usable_blocks(prompt_tokens: int, block_size: int) -> int:
    """The full blocks of a prompt a replica's cache can serve: its last token is always computed (it
    samples the first token), so a prompt of whole blocks reuses all but its last (block_manager.match_prefix)."""
    return (prompt_tokens - 1) // block_size


class Disagg:
    def __init__(self, proxy, min_blocks: int = MIN_BLOCKS, transport: httpx.AsyncBaseTransport | None = None):
        self.proxy = proxy  # core.Proxy: its pool (roles, the secret, TLS), metrics and `prefilled`
        self.min_blocks = min_blocks
        self.transport = transport
        self.pending: dict[str, int] = {}  # prefill replica id -> prompt tokens this proxy awaits there
        self.tasks: set[asyncio.Task] = set()
        self._http: httpx.AsyncClient | None = None

    def prefill_replica(self, s, conn, d: Decision):
        """The prefill replica for stream `s` routed to `conn` (`d`), or None to serve it colocated."""
        if conn.role != "decode" or s.gen.sampling.prompt_logprobs is not None or s.ids:
            return None  # (s.ids: a client's resume; its ids are computed as prompt rows on D, not on P)
        full = usable_blocks(len(s.gen.prompt_ids), self.proxy.pool.block_size)
        if full - d.cached_blocks < self.min_blocks:
            return None
        prefills = self.proxy.pool.prefill_ready()
        if not prefills:
            return None
        now = perf_counter()

        def work(c) -> int:  # prompt tokens ahead of this one there, its own uncached ones included
            queued = c.load.waiting_tokens if c.load is not None else 0
            lacks = (full - c.index.match(s.hashes, now)) * self.proxy.pool.block_size
            return lacks + self.pending.get(c.id, 0) + queued

        return min(prefills, key=work)

    def take(self, s, conn, d: Decision, deadline_ms: float) -> bool:
        """Start `s`'s disaggregated prefill (True), or leave it to be attached colocated (False)."""
        p = self.prefill_replica(s, conn, d)
        if p is None:
            return False
        task = asyncio.get_running_loop().create_task(self._run(s, p, conn, d, deadline_ms))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return True

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            pool = self.proxy.pool
            headers = {"Authorization": f"Bearer {pool.cfg.secret}"} if pool.cfg.secret else None
            self._http = httpx.AsyncClient(trust_env=False, headers=headers, verify=pool.ssl or True, timeout=None,
                                           transport=self.transport)
        return self._http

    async def close(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def _run(self, s, p, conn, d: Decision, deadline_ms: float) -> None:
        bs = self.proxy.pool.block_size
        # P computes the whole prompt, as D would itself: a row's numerics depend on what the row is (prompt
        # rows that only leave KV run on int8 activations from INT8_PROMPT_TOKENS on, the last row samples:
        # replica.config), so blocks computed from a shorter prompt would not be D's own bytes.
        ids = s.gen.prompt_ids[: usable_blocks(len(s.gen.prompt_ids), bs) * bs]  # what D pulls: it computes the rest
        body = {"token_ids": ids, "cache_salt": s.gen.cache_salt}
        http, cached, why = self._client(), d.cached_blocks, ""
        t0 = perf_counter()
        t1 = t0
        self.pending[p.id] = self.pending.get(p.id, 0) + len(ids)
        try:
            r = await asyncio.wait_for(http.post(p.base_url + "/v1/prefill", json={
                "token_ids": s.gen.prompt_ids, "cache_salt": s.gen.cache_salt}), PREFILL_TIMEOUT_S)
            t1 = perf_counter()
            if r.status_code != 200:
                why = f"prefill on {p.id} answered {r.status_code}: {r.text[:200]}"
            elif not s.done:
                r = await asyncio.wait_for(http.post(conn.base_url + "/v1/kv/pull", json={
                    "source": p.base_url, "frame_blocks": FRAME_BLOCKS, **body}), PULL_TIMEOUT_S)
                res = r.json()
                cached = max(cached, res.get("cached", 0) + res.get("imported", 0))
                self.proxy.metrics.disagg_blocks.inc(by=res.get("imported", 0))
                if r.status_code != 200 or not res.get("complete"):
                    why = f"pull from {p.id} answered {r.status_code} ({res.get('error', '')})"
        except TimeoutError:
            why = f"{'prefill on ' + p.id if t1 == t0 else 'pull from ' + p.id} took too long"
        except (httpx.HTTPError, ValueError) as e:  # unreachable, broken, or an answer that is not JSON
            why = f"{'prefill on ' + p.id if t1 == t0 else 'pull from ' + p.id} failed: {type(e).__name__}: {e}"
        finally:
            left = self.pending[p.id] - len(ids)
            if left:
                self.pending[p.id] = left
            else:
                del self.pending[p.id]
        t2 = perf_counter()
        self.proxy.metrics.disagg.inc("fallback" if why else "pulled")
        if why:
            log.warning("disaggregated prefill of %s: %s; %d of %d blocks on %s, the rest computed there", s.cid, why,
                        cached, len(ids) // bs, conn.id)
        s.span.add_event("disagg", {"prefill": p.id, "blocks": len(ids) // bs, "cached_blocks": cached,
                                    "prefill_ms": (t1 - t0) * 1e3, "pull_ms": (t2 - t1) * 1e3, "error": why})
        self.proxy.prefilled(s, conn, Decision(d.replica, d.reason, cached), deadline_ms)
