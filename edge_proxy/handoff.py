"""Hand-off: a draining replica's streams move to successors with their KV, nothing recomputed
but the last partial block.

When a replica says it drains (`Load.draining`: replica.api.drain; `pool` hands its streams here
once), for each of its running streams:
  1. a successor is picked as failover places a stream (`Proxy.successor`: the router over the
     ready replicas, which the draining one no longer is);
  2. the successor is asked to pull the stream's KV from the draining replica (`POST
     successor/v1/kv/pull`, the replica secret, at the WebSocket's host and port): the prompt ids
     and the ids generated so far but the last (sampled, never computed). It fetches every full
     block of them it lacks, checked whole, into its prefix cache. Meanwhile the stream goes on
     streaming from the draining replica, so the pull's duration is no gap: it is bounded only by
     the drain's budget (`budget_s` from the moment the proxy sees the drain, BUDGET_S; the replica
     exits about a second after its last stream left, inside its 5 s goal);
  3. the pull is repeated for the blocks that filled meanwhile (the tokens generated while it
     ran: a short, incremental pull), until every full block of the stream's ids is there; a
     repeat starts right after a block fills, so it has a whole block's tokens of time to finish
     before the stream is a block ahead again;
  4. when more than MOVE_TOKENS of the stream's computed ids lie in its partial block and the
     budget leaves time (the stream's own token rate says when the block fills), the hand-off
     waits for that block to fill and pulls it too (one block, a short pull): the successor then
     recomputes only the tokens generated during that pull, not up to a block's worth, in its
     first step, which every stream moved at once shares (on two cores 4 streams' 10 tokens each
     made that step 110 ms, docs/perf.md);
  5. the stream moves right after its next token arrives (`on_tokens`: the longest a client can
     wait is then the successor's time to its first token, not a draining replica's step on top),
     exactly as failover moves one (`Proxy.hand_off`: a resume with the ids so far, aborted on the
     draining replica): the successor's prefix cache serves every full block, so it computes only
     what is past them, and its usage counts the rest as cached tokens.
Besides its streams, the draining replica's hot chains (the conversations it caches that no
stream holds: finished turns whose next turn is to come, shared prompts) move too: the proxy asks
for them as it sees the drain (`POST draining/v1/kv/hot`, up to HOT_BLOCKS blocks, most recently
used first, each listed to one proxy only; the ask holds the replica's exit until the proxy lets
go), waits for its streams' first pulls (the long ones, which bound the streams' gaps), then places
each chain where its next turn would go (`Proxy.chain_home`: the router over the ready replicas,
as for a resumed stream) and has that replica pull it (the same `/v1/kv/pull`, the chain named by
its seed), one chain at a time per successor, within the same budget (no stream waits for them:
they start once the streams' first pulls are done); then it lets go of the hold.
The next turn then finds its conversation cached on the successor instead of recomputing it.
A pull that fails (a refused layout, a source gone) or is still running at the budget's end moves
the stream all the same with what arrived: the successor recomputes what it lacks (exact resume).
The successor bounds its own pull by the same time (`KvPull.timeout_ms`), so a pull given up on
stops there too and frees the source's export. A stream that finishes, fails or loses its replica
during the pull is not moved (failover had it). n > 1 requests move without a pull (their samples'
KV is not one chain). With no other replica ready a stream stays where it is: it finishes there,
or fails over when the replica exits.
"""

from __future__ import annotations

import asyncio
import logging
from time import perf_counter

import httpx

from edge_proxy.routing import Decision
from wire.hashing import block_hashes

log = logging.getLogger("edge_proxy.handoff")

# From the drain seen to the last stream moved and the last hot chain pulled; a pull still running then is given
# up. The replica exits 0.6-1 s after (docs/perf.md: 4.5-4.8 s after SIGTERM with a CPU burner beside, inside its
# 5 s goal). 3 s, with the hot chains given 1 s past it, cut the streams' first pulls at 72-83 of 83 blocks on a
# busy machine (longest gaps 1.3-1.7 s); one bound for both let them finish (160-442 ms), the same exit bound.
BUDGET_S = 4.0
FRAME_BLOCKS = 8  # blocks per export frame: 3 MB of the default model's fp16 KV, as fast as larger frames and
#                   a shorter stall of the draining engine per read (bench/kv_pull.py, docs/perf.md)
MAX_ROUNDS = 5  # pulls per stream: the first, the blocks that filled while the one before ran, the aligning one
MOVE_TOKENS = 3  # computed ids past the full blocks a move leaves to recompute without waiting for the block
HOT_BLOCKS = 128  # blocks of a draining replica's hot chains a proxy places (47 MB of the default model's KV;
#                  --handoff-hot-blocks)
HOLD_SLACK_S = 1.0  # a hold on the draining replica's exit outlasts the hot chains' time by this much (its let-go)


def computed(s) -> int:
    """The stream's computed ids: its prompt and what it generated but the last (sampled)."""
    return len(s.gen.prompt_ids) + len(s.ids) - 1


def full_blocks(s, bs: int) -> int:
    """The stream's full blocks of computed ids."""
    return computed(s) // bs


class Handoff:
    def __init__(self, proxy, budget_s: float = BUDGET_S, frame_blocks: int = FRAME_BLOCKS,
                 transport: httpx.AsyncBaseTransport | None = None, hot_blocks: int = HOT_BLOCKS):
        self.proxy = proxy  # core.Proxy: `successor`, `chain_home`, `hand_off`, its pool (the secret, TLS)
        self.budget_s, self.frame_blocks, self.hot_blocks = budget_s, frame_blocks, hot_blocks
        self.transport = transport  # None: the network (tests hand in an httpx.MockTransport)
        self.tasks: set[asyncio.Task] = set()
        self.awaiting: dict[int, asyncio.Future] = {}  # id(stream) -> what its next token resolves (Proxy.on_tokens)

    def on_tokens(self, s) -> None:
        """`s` got tokens (the proxy calls this while `awaiting` is not empty)."""
        fut = self.awaiting.pop(id(s), None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def drain(self, conn, streams: list) -> None:
        """`conn` drains: hand each of its `streams` and its hot chains on (in the background)."""
        task = asyncio.get_running_loop().create_task(self._drain(conn, streams))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _drain(self, conn, streams: list) -> None:
        pool = self.proxy.pool
        deadline = perf_counter() + self.budget_s
        headers = {"Authorization": f"Bearer {pool.cfg.secret}"} if pool.cfg.secret else None
        async with httpx.AsyncClient(trust_env=False, headers=headers, verify=pool.ssl or True,
                                     timeout=self.budget_s + 1.0, transport=self.transport) as http:
            firsts = [asyncio.get_running_loop().create_future() for _ in streams]  # each stream's first pull done
            await asyncio.gather(self._hot(http, conn, deadline, firsts),
                                 *(self._stream(http, conn, s, deadline, f) for s, f in zip(streams, firsts)))

    async def _stream(self, http: httpx.AsyncClient, conn, s, deadline: float, first: asyncio.Future) -> None:
        try:
            await self._one(http, conn, s, deadline, first)
        finally:
            if not first.done():
                first.set_result(None)

    async def _one(self, http: httpx.AsyncClient, conn, s, deadline: float, first: asyncio.Future) -> None:
        d = self.proxy.successor(s)
        if d is None:
            log.warning("replica %s drains: no other replica ready for %s; it stays", conn.id, s.cid)
            return
        to = next(c for c in self.proxy.pool.conns if c.id == d.replica)
        cached = 0
        if s.samples is None:
            bs = self.proxy.pool.block_size or 1
            t0, aligning = perf_counter(), False
            for rounds in range(1, MAX_ROUNDS + 1):
                t_pull, n_pull = perf_counter(), len(s.ids)
                res = await self._pull(http, conn, to, s.cid, s.gen.prompt_ids + s.ids[:-1],
                                       {"cache_salt": s.gen.cache_salt}, deadline)
                if not first.done():
                    first.set_result(None)
                if res is None:
                    break
                cached = res.get("cached", 0) + res.get("imported", 0)
                block_s = (perf_counter() - t_pull) / max(1, res.get("imported", 0))  # this pull's time a block
                if not res.get("complete") or perf_counter() >= deadline:
                    break
                await self._next_token(s, deadline)  # switch right after one (the wait is no gap: it streams)
                if s.done or s.conn is not conn:
                    return  # finished, failed or failed over meanwhile
                if full_blocks(s, bs) <= cached:  # every full block of the ids so far is there
                    if aligning or computed(s) - cached * bs <= MOVE_TOKENS or \
                            not self._fills_in_time(s, bs, t_pull, n_pull, block_s, deadline):
                        break
                    aligning = True  # pull the partial block once it is full: the move then recomputes a few ids
                # A block filled while the pull ran (or the partial one is to be pulled). Pull again right after
                # the next one fills, not now: the short pull then has a whole block's tokens of time before the
                # stream is a block ahead again (pulling at once, a pull slower than the rest of a part-filled
                # block never catches up).
                await self._block_filled(s, bs, deadline)
                if s.done or s.conn is not conn:
                    return
            log.info("hand-off of %s to %s: %d blocks there after %d pulls in %.3f s, %d ids to recompute", s.cid,
                     to.id, cached, rounds, perf_counter() - t0, computed(s) + 1 - cached * bs)
        self.proxy.hand_off(s, conn, Decision(d.replica, d.reason, cached))

    async def _hot(self, http: httpx.AsyncClient, conn, deadline: float, firsts: list[asyncio.Future]) -> None:
        """Place the draining replica's hot chains and have their successors pull them, once the streams'
        first pulls are done; the hold on its exit is let go at the end."""
        if not self.hot_blocks:
            return
        left = deadline - perf_counter()
        try:
            r = await http.post(conn.base_url + "/v1/kv/hot",
                                json={"max_blocks": self.hot_blocks, "hold_s": left + HOLD_SLACK_S}, timeout=left)
            listing = r.json()
            if r.status_code != 200:
                raise ValueError(f"{r.status_code} {listing.get('error', {}).get('message', '')}")
        except (httpx.HTTPError, ValueError) as e:
            log.warning("replica %s drains: its hot chains stay (listing failed: %s)", conn.id, e)
            return
        hold = listing.get("hold", "")
        try:
            chains = listing.get("chains", [])
            if chains and firsts:
                await asyncio.wait(firsts, timeout=max(0.0, deadline - perf_counter()))
            bs = self.proxy.pool.block_size or 1
            by_home: dict[str, list[dict]] = {}
            for c in chains:
                d = self.proxy.chain_home(block_hashes(c["token_ids"], bs, prev=c["seed"]), len(c["token_ids"]))
                if d is not None:
                    by_home.setdefault(d.replica, []).append(c)
            await asyncio.gather(*(self._pull_chains(http, conn, home, cs, deadline) for home, cs in by_home.items()))
        finally:
            if hold:
                try:
                    await http.delete(f"{conn.base_url}/v1/kv/hot/{hold}", timeout=1.0)
                except httpx.HTTPError:
                    pass  # the replica is gone, or the hold runs out by itself

    async def _pull_chains(self, http: httpx.AsyncClient, conn, home: str, chains: list[dict], deadline: float):
        to = next((c for c in self.proxy.pool.conns if c.id == home), None)
        if to is None:
            return
        t0, moved = perf_counter(), 0
        for c in chains:
            res = await self._pull(http, conn, to, "a hot chain", c["token_ids"], {"seed": c["seed"]}, deadline)
            if res is None:
                break
            moved += res.get("imported", 0)
        self.proxy.metrics.handoff_hot_blocks.inc(by=moved)
        log.info("replica %s drains: %d blocks of %d hot chains pulled by %s in %.3f s", conn.id, moved,
                 len(chains), to.id, perf_counter() - t0)

    async def _pull(self, http: httpx.AsyncClient, conn, to, what: str, ids: list[int], chain: dict,
                    deadline: float) -> dict | None:
        """One pull of the full blocks of `ids` (of the chain `chain` names: its cache salt or its seed),
        bounded by the deadline: its answer, None when it failed."""
        left = deadline - perf_counter()
        if left <= 0:
            return None
        body = {"source": conn.base_url, "token_ids": ids, **chain, "frame_blocks": self.frame_blocks,
                "timeout_ms": int(left * 1e3)}
        try:
            # the successor answers at its own bound (what arrived by then); this one is for a successor that does not
            r = await asyncio.wait_for(http.post(to.base_url + "/v1/kv/pull", json=body), left + 0.5)
            res = r.json()
        except (TimeoutError, httpx.HTTPError, ValueError) as e:
            log.warning("hand-off of %s to %s: pull failed (%s); what it lacks is recomputed", what, to.id,
                        type(e).__name__ if isinstance(e, TimeoutError) else e)
            return None
        if r.status_code != 200:
            log.warning("hand-off of %s to %s: pull answered %d (%s); %d blocks there, the rest recomputed", what,
                        to.id, r.status_code, res.get("error", ""), res.get("cached", 0) + res.get("imported", 0))
        return res

    @staticmethod
    def _fills_in_time(s, bs: int, t0: float, n0: int, block_s: float, deadline: float) -> bool:
        """Whether the stream's partial block fills, is pulled and the stream moves before the deadline, at
        the stream's token rate since `t0` (the last pull's start, when it had n0 ids: the first, long pull
        slows the draining replica's steps, which speed up again after it) and `block_s` for the pull (with
        three tokens' slack)."""
        now = perf_counter()
        per_token = (now - t0) / max(1, len(s.ids) - n0)
        return now + (bs - computed(s) % bs + 3) * per_token + block_s < deadline

    async def _block_filled(self, s, bs: int, deadline: float) -> None:
        """Wait (streaming) until another of the stream's blocks is full, or the budget's end."""
        n = full_blocks(s, bs)
        while full_blocks(s, bs) == n and not s.done and perf_counter() < deadline:
            await self._next_token(s, deadline)

    async def _next_token(self, s, deadline: float) -> None:
        fut = self.awaiting[id(s)] = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(fut, max(0.0, deadline - perf_counter()))
        except TimeoutError:
            pass  # no token within the budget (a stalled stream): move it as it is
        finally:
            self.awaiting.pop(id(s), None)
