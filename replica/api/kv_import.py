"""The receiver's half of a KV pull: what it lacks, asked of a source, checked, cached.

`pull` computes the prompt's chained block hashes itself (wire.hashing, from the token ids and
the cache salt, or the chain's seed for a hot chain a source listed), skips the leading blocks its engine already caches (the API process mirrors
the cache from the engine's KvEvents), fetches the rest through a transport
(replica.api.kv_transport) and hands each frame to the engine (`EngineClient.kv_call`, its bytes
copied into a KV slot: replica.kv_slots) only once it is whole:
  * the source's KvSpec equals this replica's (dtype, block size, layers, KV heads, head dim,
    row, model identity, draft layer): else refused (409) before any block moves;
  * a frame starts where the last one ended, its hashes are the receiver's own for those block
    indexes (the source's blocks are these tokens' KV, under this salt), its bytes are
    block_bytes per block and each block's xxh3_64 digest matches.
A frame that fails a check, or a stream that breaks (the source died), ends the pull (502);
the frames already cached stay: each is whole and verified, and a block is found by its chained
hash, so a request reuses the cached prefix and nothing reaches a block past a missing one (with
several frames in flight a later one can land after an earlier one failed: a cached free block
no prefix reaches, evicted like any). The engine caches each frame all or nothing
(replica.engine.kv_transfer), so no block leaks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import asdict, dataclass

from wire import protocol as P
from wire.hashing import salt_seed
from wire.kv_frames import KvEnd, KvExport, KvFrame, KvPull, block_digest, chain_hashes
from replica.api.engine_supervisor import EngineUnavailable
from replica.api.kv_transport import KvTransportError

WRITES_AHEAD = 4  # frames handed to the engine, unanswered, while the next is read (4 KV slots of 3 MB, the
#                  default model: replica.kv_slots)
SETTLE_S = 0.2  # a pull ended early waits this long at most for its writes in flight: inside the 0.5 s the
#                hand-off allows past a pull's bound (edge_proxy.handoff), which 1.0 overran (05:17 run, docs/perf.md)


@dataclass
class PullResult:
    status: int = 200  # of the pull's HTTP answer
    blocks: int = 0  # full blocks of the prompt
    cached: int = 0  # of them cached here already (skipped)
    imported: int = 0  # of them cached here by this pull
    complete: bool = False  # every full block of the prompt is cached here now
    error: str = ""  # why not (a refusal, a check that failed, the source's reason)

    def body(self) -> dict:
        return asdict(self)


def check_frame(frame: KvFrame, hashes: list[int], at: int, block_bytes: int) -> str | None:
    """What is wrong with a frame that should hold blocks `at`.. of a prompt with these hashes."""
    n = len(frame.hashes)
    if frame.start != at:
        return f"a frame starts at block {frame.start}, the next expected is {at}"
    if n == 0 or len(frame.digests) != n or at + n > len(hashes):
        return f"a frame of {n} hashes and {len(frame.digests)} digests at block {at} of {len(hashes)}"
    for i, h in enumerate(frame.hashes):
        if h != hashes[at + i]:
            return f"block {at + i}'s hash is not the chain of these token ids (another prompt or salt)"
    if len(frame.data) != n * block_bytes:
        return f"a frame of {n} blocks holds {len(frame.data)} bytes, not {n * block_bytes}"
    view = memoryview(frame.data)
    for i, d in enumerate(frame.digests):
        if block_digest(view[i * block_bytes: (i + 1) * block_bytes]) != d:
            return f"block {at + i}'s bytes do not match their digest (corrupted on the way)"
    return None


async def pull(client, transport, req: KvPull) -> PullResult:
    """Make this replica cache the full blocks of req.token_ids, fetched from req.source."""
    mine = client.kv_spec
    if mine is None:
        return PullResult(503, error="the engine process is restarting; nothing imported")
    hashes = chain_hashes(req.token_ids, mine.block_size, req.cache_salt, req.seed)
    have = 0
    while have < len(hashes) and hashes[have] in client.cached_blocks:
        have += 1
    res = PullResult(blocks=len(hashes), cached=have)
    if have == len(hashes):
        res.complete = True
        return res

    def fail(status: int, error: str) -> PullResult:
        res.status, res.error = status, error
        return res

    try:
        async with asyncio.timeout(req.timeout_ms / 1e3 if req.timeout_ms else None):
            end = await _fetch(client, transport, req, mine, hashes, have, res)
    except _Refused as e:
        return fail(e.status, e.error)
    except TimeoutError:
        return fail(504, f"the pull's {req.timeout_ms} ms ran out after {res.cached + res.imported - have} of "
                         f"{len(hashes) - have} blocks; those are cached")
    except KvTransportError as e:
        return fail(502, f"{e} (after {res.cached + res.imported - have} of {len(hashes) - have} blocks)")
    except EngineUnavailable as e:
        return fail(503, str(e))
    at = res.cached + res.imported
    if end is None:
        return fail(502, f"the export stream from {req.source} ended without its KvEnd "
                         f"(after {at - have} of {len(hashes) - have} blocks)")
    res.complete = at == len(hashes)
    res.error = "" if res.complete else f"the source sent blocks up to {at}: {end.reason}"
    return res


class _Refused(Exception):
    def __init__(self, status: int, error: str):
        self.status, self.error = status, error


async def _fetch(client, transport, req: KvPull, mine: P.KvSpec, hashes: list[int], have: int,
                 res: PullResult) -> KvEnd | None:
    """Fetch blocks `have`.. of `hashes` into the engine, counted in `res` as each frame is cached;
    the source's KvEnd (None: the stream ended without it). _Refused on a spec or frame that fails.
    Up to WRITES_AHEAD frames are in the engine's hands at once (it caches them in order, each all
    or nothing), so one step boundary caches several instead of one a boundary."""
    at, spec, end = have, None, None
    writes: deque[tuple[int, asyncio.Future]] = deque()  # (first block, the KvBlocks' answer to come), in order

    async def settle() -> None:  # the oldest write's answer, counted
        first, fut = writes.popleft()
        written = await fut
        if written.error:
            _drop(writes)  # the later frames are past a missing block: not counted
            raise _Refused(503, f"this replica's engine cached none of blocks {first}..: {written.error}")
        res.imported += written.stored
        res.cached += written.present

    stream = transport.fetch(req.source, KvExport(token_ids=req.token_ids, cache_salt=req.cache_salt, start=have,
                                                  frame_blocks=req.frame_blocks, seed=req.seed))
    seed = salt_seed(req.cache_salt) if req.seed is None else req.seed
    bs = mine.block_size
    try:
        async with contextlib.aclosing(stream):  # closed at once when the pull ends early: the source's export stops
            async for msg in stream:
                if end is not None:
                    raise _Refused(502, f"{req.source} sent a message after its KvEnd")
                if spec is None:
                    if not isinstance(msg, P.KvSpec):
                        raise _Refused(502, f"the export stream from {req.source} did not open with its KvSpec")
                    problem = mine.mismatch(msg)
                    if problem is not None:
                        raise _Refused(409, f"{problem} (here: this replica; there: {req.source}): refused, "
                                            "nothing imported")
                    spec = msg
                elif isinstance(msg, KvFrame):
                    problem = check_frame(msg, hashes, at, mine.block_bytes)
                    if problem is not None:
                        raise _Refused(502, f"{req.source} sent a bad frame: {problem}")
                    view, per_slot = memoryview(msg.data), client.kv_slots.map.slot_bytes // mine.block_bytes
                    for k in range(0, len(msg.hashes), per_slot):  # a frame larger than a slot: a write a slot
                        n = min(per_slot, len(msg.hashes) - k)
                        blocks = view[k * mine.block_bytes: (k + n) * mine.block_bytes]
                        ids = req.token_ids[at * bs: (at + n) * bs]
                        writes.append((at, await _write(client, blocks, hashes, at, n, ids, seed)))
                        at += n
                        while len(writes) > WRITES_AHEAD:
                            await settle()
                elif isinstance(msg, KvEnd):
                    while writes:
                        await settle()
                    end = msg  # the stream is read to its end (nothing follows): its connection is reused
                else:
                    raise _Refused(502, f"{req.source} sent a second KvSpec")
        while writes:  # the stream ended without its KvEnd: what was sent is counted
            await settle()
    finally:  # ended early (a bad frame, a broken stream, the bound): the writes in flight are counted as they land
        await _settle_rest(writes, res)
    return end


async def _write(client, data: memoryview, hashes: list[int], at: int, n: int, ids: list[int],
                 seed: int) -> asyncio.Future:
    """Hand blocks at..at+n (checked; their bytes `data`) to the engine through a KV slot: the
    future of its KvWritten. The slot is the engine's from the send to its answer, then free."""
    lease = await client.kv_slots.lease()
    try:
        lease.view(len(data))[:] = data
    except BaseException:
        lease.release()
        raise
    fut = asyncio.ensure_future(client.kv_call(P.KvBlocks(id="", hashes=hashes[at: at + n], slot=lease.index,
                                                          prev=hashes[at - 1] if at else seed, ids=ids, start=at),
                                               lease))
    fut.add_done_callback(lambda _: lease.release())  # answered, failed or cancelled (sent or not)
    return fut


async def _settle_rest(writes: deque, res: PullResult) -> None:
    """Count the writes still in flight that the engine answers within SETTLE_S (they are in its
    socket: its next step boundary caches them), in order up to the first that failed; cancel the rest
    (one already sent may land uncounted: a cached block the count misses, never one it claims)."""
    if not writes:
        return
    await asyncio.wait([f for _, f in writes], timeout=SETTLE_S)
    while writes and writes[0][1].done() and not writes[0][1].cancelled() and writes[0][1].exception() is None:
        written = writes.popleft()[1].result()
        if written.error:
            break
        res.imported += written.stored
        res.cached += written.present
    _drop(writes)


def _drop(writes: deque) -> None:
    """Cancel the writes left, their outcomes retrieved (none logged as never seen)."""
    for _, fut in writes:
        if not fut.cancel() and not fut.cancelled():
            fut.exception()
    writes.clear()
