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
