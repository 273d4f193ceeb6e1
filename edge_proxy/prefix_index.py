"""What the proxy believes one replica holds in its prefix cache.

Two sources, matched together as one chain of block hashes:

* confirmed: the hashes the replica announced in its KV events (stored minus
  removed). `None` until the first event on the current connection: a replica
  that never sends events leaves the index in approximate mode.
* expected: what the proxy itself knows the replica is about to hold, the moment
  it knows it: the blocks of every prompt it sends there, and, when a
  stream ends, the blocks of that prompt followed by every token id the replica
  streamed back (`expect`, see `reply_hashes`). A chat's next turn is routed
  before (or without) any KV event for them. A stored event confirms an expected
  block, a removed event drops it from both sets.

A finished stream also leaves its mark (`expect_reply`): the blocks its reply
filled, and where the ids the replica computed for it end (their last full block
and the ids past it, less than a block: all of a short reply may be there). A
prompt whose match runs through such a reply block, or that goes on past such an
end with exactly those ids, is a later turn of a conversation whose previous turn
ran there (`history`), not a prompt that merely shares a system prompt with
others. Marks go with their block when the replica removes it. They are this
process's own (only the proxy that ran a turn has them), so the proxy's routing no
longer reads them: a later turn's home comes from the KV events every proxy receives
(`routing.mark_home`); `bench/routing_sim.py` still replays them.

In precise mode an expected block counts for `expect_s` after it was last
expected (the longest a prompt waits in a busy replica's queue before its
prefill stores it); one the replica never stores (an aborted request) ages out.
In approximate mode the expected set is all there is: an LRU bounded by
`capacity` blocks, never aged.

Chained hashes make a prefix match a scan from block 0 until the first miss, so a
reply that the chat template re-renders into other ids than the replica generated
matches exactly as far as the replica's cache does: up to the block where they
part (`Proxy` counts and logs such replies).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from wire import protocol as P
from wire.hashing import block_hashes


def reply_hashes(prompt_ids: Sequence[int], prompt_hashes: list[int], out_ids: Sequence[int], block_size: int,
                 salt: str) -> list[int]:
    """The hashes of the full blocks a replica caches for a finished stream past the
    prompt's own: prompt + generated ids, less the last id (sampled, never computed)."""
    if len(out_ids) < 2:
        return []
    ids = list(prompt_ids) + list(out_ids[:-1])
    start = len(prompt_hashes)
    return block_hashes(ids, block_size, salt, start, prompt_hashes[-1] if start else None)


ENDS_PER_BLOCK = 4  # the streams whose computed ids end past one block that are remembered (the latest)


class BlockIndex:
    __slots__ = ("confirmed", "expected", "replies", "ends", "capacity", "expect_s")

    def __init__(self, capacity: int = 1 << 16, expect_s: float = 10.0):
        self.confirmed: set[int] | None = None  # None -> no KV events yet: approximate mode
        self.expected: OrderedDict[int, float] = OrderedDict()  # hash -> when last expected (LRU order)
        self.replies: OrderedDict[int, None] = OrderedDict()  # blocks finished streams' replies filled (LRU)
        self.ends: OrderedDict[int, tuple[tuple[int, ...], ...]] = OrderedDict()  # last full block -> ids past it
        self.capacity = capacity
        self.expect_s = expect_s

    def __len__(self) -> int:
        """Blocks it is believed to hold (confirmed, or expected and not yet confirmed)."""
        return len(self.confirmed or ()) + len(self.expected)

    @property
    def precise(self) -> bool:
        return self.confirmed is not None

    def reset(self) -> None:
        """A new connection: the replica may have restarted; nothing is known."""
        self.confirmed = None
        self.expected.clear()
        self.replies.clear()
        self.ends.clear()

    def apply(self, ev: P.KvEvents) -> None:
        if self.confirmed is None or ev.cleared:
            self.confirmed = set()
        exp, rep, ends = self.expected, self.replies, self.ends
        if ev.cleared:
            rep.clear()
            ends.clear()
        for x in ev.removed:
            self.confirmed.discard(x)
            exp.pop(x, None)
            rep.pop(x, None)
            ends.pop(x, None)
        for x in ev.stored:
            self.confirmed.add(x)
            exp.pop(x, None)

    def expect(self, hashes: list[int], now: float) -> None:
        """These blocks are (or are about to be) in the replica's cache: a prompt sent
        there, or a finished stream's prompt + generated ids (`expect_reply`)."""
        conf, exp = self.confirmed, self.expected
        for x in hashes:
            if conf is not None and x in conf:
                continue
            exp[x] = now
            exp.move_to_end(x)
        while len(exp) > self.capacity:
            exp.popitem(last=False)

    def expect_reply(self, prompt_ids: Sequence[int], prompt_hashes: list[int], out_ids: Sequence[int],
                     block_size: int, salt: str, now: float) -> None:
        """A stream ended here: the replica holds its prompt + generated ids, less the last
        id (sampled, never computed). Expects the blocks the reply filled and marks them,
        and where those ids end, as this replica's conversation (`history`)."""
        filled = reply_hashes(prompt_ids, prompt_hashes, out_ids, block_size, salt)
        self.expect(filled, now)
        rep, ends = self.replies, self.ends
        for x in filled:
            rep[x] = None
            rep.move_to_end(x)
        n_prompt = len(prompt_ids)
        m = (n_prompt + len(out_ids) - 1) // block_size  # full blocks of the computed ids
        if m:
            last = filled[-1] if filled else prompt_hashes[m - 1]
            a = m * block_size  # the computed ids past the last full block, without copying the rest
            tail = tuple(prompt_ids[a:]) + tuple(out_ids[max(a - n_prompt, 0):len(out_ids) - 1])
            ends[last] = (tail,) + tuple(t for t in ends.pop(last, ()) if t != tail)[: ENDS_PER_BLOCK - 1]
        for d in (rep, ends):
            while len(d) > self.capacity:
                d.popitem(last=False)

    def history(self, hashes: list[int], n: int, ids: Sequence[int], block_size: int) -> bool:
        """Is the prompt (`ids`, its block `hashes`, `n` of them matched here) a later turn
        of a conversation whose previous turn ran here: does its match run through a
        block a reply filled, or end where a finished stream's ids end, the prompt going
        on with the very ids past that block the replica computed?"""
        if not n:
            return False
        tails = self.ends.get(hashes[n - 1])
        a = n * block_size
        if tails is not None and any(tuple(ids[a:a + len(t)]) == t for t in tails):
            return True
        rep = self.replies  # (a reply the chat template rendered back into other ids ends the match early)
        return any(hashes[i] in rep for i in range(n - 1, -1, -1))

    def match(self, hashes: list[int], now: float) -> int:
        """Number of leading blocks of `hashes` this replica is believed to hold."""
        conf, exp = self.confirmed, self.expected
        n = 0
        if conf is None:
            for x in hashes:
                if x not in exp:
                    break
                n += 1
            return n
        horizon = now - self.expect_s
        for x in hashes:
            if x not in conf:
                t = exp.get(x)
                if t is None or t < horizon:
                    break
            n += 1
        return n
