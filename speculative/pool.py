"""The paged KV pool of the standalone speculative loop (speculative.decode).

One tensor for the target, (layers, {k, v}, blocks, block_size, Hkv, D), a free
list of blocks and a block table per sequence. Position p of a sequence lives at
slot table[p // block_size] * block_size + p % block_size in the target pool and
in the head's one-layer pool alike (speculative.drafting.Drafter), so one table
serves both. Inside the replica the engine's BlockManager plays this role.

Speculation reserves slots past the sequence for the draft tree (`reserve`),
copies the accepted drafts' KV down to their final positions (`move`) and gives
back the blocks the rejected drafts used (`truncate`).
"""

from __future__ import annotations

import torch


class PoolExhausted(RuntimeError):
    """No free block is left: give the pool more blocks or run fewer/shorter sequences."""


class KVPool:
    def __init__(self, num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        assert block_size > 0 and block_size & (block_size - 1) == 0, "block_size must be a power of two"
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_cache = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype,
                                    device=device)
        self.free_blocks = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.tables: dict[int, list[int]] = {}

    @property
    def device(self) -> torch.device:
        return self.kv_cache.device

    def reserve(self, sid: int, length: int) -> None:
        """Blocks for positions [0, length) of sequence sid."""
        table = self.tables.setdefault(sid, [])
        need = -(-length // self.block_size) - len(table)
        if need > len(self.free_blocks):
            raise PoolExhausted(f"sequence {sid} needs {need} more KV blocks, {len(self.free_blocks)} are free "
                                f"(pool of {self.num_blocks} x {self.block_size} tokens)")
        for _ in range(need):
            table.append(self.free_blocks.pop())

    def truncate(self, sid: int, length: int) -> None:
        """Release the blocks wholly past position length - 1 (rejected drafts' slots)."""
        table = self.tables[sid]
        keep = -(-length // self.block_size)
        while len(table) > keep:
            self.free_blocks.append(table.pop())

    def free(self, sid: int) -> None:
        self.free_blocks.extend(reversed(self.tables.pop(sid, [])))

    def slots(self, sid: int, positions) -> list[int]:
        table, bs = self.tables[sid], self.block_size
        return [table[p // bs] * bs + p % bs for p in positions]

    def block_tables(self, sids) -> torch.Tensor:
        """(B, max_blocks) int32, rows padded with block 0 (never read past a length)."""
        width = max(len(self.tables[s]) for s in sids)
        rows = [self.tables[s] + [0] * (width - len(self.tables[s])) for s in sids]
        return torch.tensor(rows, dtype=torch.int32, device=self.device)

    def move(self, sid: int, moves: list[tuple[int, int]]) -> None:
        """Copy the KV of position src to position dst in every layer, for (src, dst) in moves.
        Sources are read before any destination is written, so overlapping moves are safe."""
        if not moves:
            return
        src = torch.tensor(self.slots(sid, [m[0] for m in moves]), device=self.device)
        dst = torch.tensor(self.slots(sid, [m[1] for m in moves]), device=self.device)
        flat = self.kv_cache.flatten(2, 3)  # (L, 2, slots, Hkv, D), a view
        flat[:, :, dst] = flat[:, :, src]
