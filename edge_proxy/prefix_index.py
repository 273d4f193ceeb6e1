"""What the proxy believes one replica holds in its prefix cache.

Precise mode: the set of chained block hashes the replica announced in its KV
events (stored minus removed). Approximate mode, while a replica has sent no
events on its current connection: the proxy's own routing history, i.e. the
blocks of the prompts it sent there, kept as an LRU bounded by the replica's block
count. In precise mode the history still covers the short gap between routing a
prompt and the replica's events for it (`pending_s`), so two requests with the
same new prefix arriving back to back land together.

Chained hashes make a prefix match a scan from block 0 until the first miss.
"""

from __future__ import annotations

from collections import OrderedDict

from wire.protocol import KvEvents


class BlockIndex:
    __slots__ = ("blocks", "history", "capacity", "pending_s")

    def __init__(self, capacity: int = 1 << 16, pending_s: float = 2.0):
        self.blocks: set[int] | None = None  # None -> no KV events yet: approximate mode
        self.history: OrderedDict[int, float] = OrderedDict()  # hash -> time routed
        self.capacity = capacity
        self.pending_s = pending_s

    @property
    def precise(self) -> bool:
        return self.blocks is not None

    def reset(self) -> None:
        """A new connection: the replica may have restarted; fall back to history."""
        self.blocks = None
        self.history.clear()

    def apply(self, ev: KvEvents) -> None:
        if self.blocks is None or ev.cleared:
            self.blocks = set()
        self.blocks.difference_update(ev.removed)
        self.blocks.update(ev.stored)

    def routed(self, hashes: list[int], now: float) -> None:
        """Record that a prompt with these block hashes was sent to this replica."""
        h = self.history
        for x in hashes:
            h[x] = now
            h.move_to_end(x)
        while len(h) > self.capacity:
            h.popitem(last=False)

    def match(self, hashes: list[int], now: float) -> int:
        """Number of leading blocks of `hashes` this replica is believed to hold."""
        blocks, hist = self.blocks, self.history
        n = 0
        if blocks is not None:
            for x in hashes:
                if x in blocks:
                    n += 1
                    continue
                t = hist.get(x)
                if t is None or now - t > self.pending_s:
                    break
                n += 1
        else:
            for x in hashes:
                if x not in hist:
                    break
                n += 1
        return n
