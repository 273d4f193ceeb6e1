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


class BlockIndex:
    __slots__ = ("confirmed", "expected", "capacity", "expect_s")

    def __init__(self, capacity: int = 1 << 16, expect_s: float = 10.0):
        self.confirmed: set[int] | None = None  # None -> no KV events yet: approximate mode
        self.expected: OrderedDict[int, float] = OrderedDict()  # hash -> when last expected (LRU order)
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

    def apply(self, ev: P.KvEvents) -> None:
        if self.confirmed is None or ev.cleared:
            self.confirmed = set()
        exp = self.expected
        for x in ev.removed:
            self.confirmed.discard(x)
            exp.pop(x, None)
        for x in ev.stored:
            self.confirmed.add(x)
            exp.pop(x, None)

    def expect(self, hashes: list[int], now: float) -> None:
        """These blocks are (or are about to be) in the replica's cache: a prompt sent
        there, or a finished stream's prompt + generated ids (`reply_hashes`)."""
        conf, exp = self.confirmed, self.expected
        for x in hashes:
            if conf is not None and x in conf:
                continue
            exp[x] = now
            exp.move_to_end(x)
        while len(exp) > self.capacity:
            exp.popitem(last=False)

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
