"""Chained block hashes over token ids, shared by the replica's prefix cache and
the proxy's prefix-aware router (imports xxhash only, never torch).

    h_{-1} = salt_seed(tenant cache salt)
    h_i    = xxh3_64(h_{i-1} as 8 little-endian bytes || ids of block i as uint32)

Only full blocks are hashed. The hash is deterministic across processes and
machines (never Python's salted `hash`), so a proxy can predict which blocks a
replica holds from its KV events.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

_xxh3 = xxhash.xxh3_64_intdigest


def salt_seed(salt: str) -> int:
    """The chain's starting value for a tenant; 0 for the shared (unsalted) space."""
    return _xxh3(salt.encode()) if salt else 0


def chain_hash(prev: int, block_ids: Sequence[int]) -> int:
    return _xxh3(prev.to_bytes(8, "little") + array("I", block_ids).tobytes())


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str = "", start: int = 0,
                 prev: int | None = None) -> list[int]:
    """Hashes of the full blocks of `token_ids`, from block index `start` on.

    Pass `prev` (the hash of block `start - 1`) to extend an existing chain.
    """
    h = salt_seed(salt) if prev is None else prev
    out = []
    for b in range(start, len(token_ids) // block_size):
        h = chain_hash(h, token_ids[b * block_size : (b + 1) * block_size])
        out.append(h)
    return out


class ChainTips:
    """How many chains a prefix cache holds: its cached blocks that no cached block extends (the
    tips of the tree the chained hashes make). A conversation is one chain (each turn's prompt
    extends the blocks of the last turn's prompt and reply), so this counts the conversations a
    replica holds, where its block count says only how long they are. Kept as blocks are cached
    (`add`, with the hash it extends: the previous block's, or the salt seed for a first block)
    and dropped (`remove`), in O(1) each; a block dropped from the middle of a chain (an eviction
    out of order) splits it in two."""

    __slots__ = ("parent", "children", "tips")

    def __init__(self):
        self.parent: dict[int, int] = {}  # cached block -> the hash it extends
        self.children: dict[int, int] = {}  # hash -> how many cached blocks extend it
        self.tips = 0

    def add(self, h: int, parent: int) -> None:
        if h in self.parent:
            return
        self.parent[h] = parent
        if not self.children.get(h):
            self.tips += 1
        n = self.children.get(parent, 0)
        if n == 0 and parent in self.parent:
            self.tips -= 1  # its parent is a tip no longer
        self.children[parent] = n + 1

    def remove(self, h: int) -> None:
        parent = self.parent.pop(h, None)
        if parent is None:
            return
        if not self.children.get(h):
            self.tips -= 1
        n = self.children[parent] - 1
        if n:
            self.children[parent] = n
        else:
            del self.children[parent]
            if parent in self.parent:
                self.tips += 1  # nothing extends its parent now

    def clear(self) -> None:
        self.parent.clear()
        self.children.clear()
        self.tips = 0
