"""The engine's side of moving KV between replicas: its pool's spec, blocks read out, blocks cached in.

The engine owns the pool, so the API process asks it (wire.protocol KvRead, KvBlocks) and moves
the bytes over the network itself (replica.api.kv_routes). Both commands run between steps, in
the engine's one thread, so no step sees a block half read or half written; every command taken
at a boundary is answered before the next step (replica.engine.process), and an API process keeps
several in flight (READ_AHEAD reads an export, WRITES_AHEAD writes a pull), so one boundary
serves several frames: the copies are 1-3 ms a 3 MB frame, the wait for a boundary was the cost.

Invariants:
  * A block is exported only while cached under its chained hash (a full block of computed,
    verified tokens); its bytes are the pool's (KvSpec: layers x {k, v} x block_size x kv heads
    x row, then the draft head's layer), never converted.
  * An import is all or nothing per KvBlocks: blocks are reserved (private), written, then
    registered as cached free blocks (ref count 0, LRU) with a stored KV event each; on any
    failure they go back to the free list and nothing was registered. The API process checks
    the bytes (digests, the hash chain from the token ids, the spec) before it sends them.
  * Tensor parallelism: each rank holds a shard of the KV heads, so a block is not one buffer
    here: refused (a later transfer sends each rank's shard beside its peer's).

The bytes' path on CPU: pool -> a KV slot shared with the API process (replica.kv_slots;
Runner.read_blocks: a block's strided views copied straight in) -> the API process's export
frame -> TCP, and the reverse on the receiver: its frame checked, copied into a slot, from
there into blocks it reserved. The socket to the API process carries the slot's index only. On
CUDA a frame's blocks are gathered on the device and cross to the host once, through a pinned
staging buffer (replica.model.kv_staging); with an RDMA library (replica.api.kv_transport
names NIXL) that buffer is registered once, KvRead answers with its descriptors instead of
bytes and the receiver's NIC reads it, with these commands, checks and registration unchanged.
"""

from __future__ import annotations

import os

import msgspec
import xxhash

from wire import protocol as P
from replica.kv_slots import SlotMap, geometry

DTYPE_NAMES = {"torch.float16": "float16", "torch.bfloat16": "bfloat16", "torch.float32": "float32",
               "torch.int8": "int8"}


def model_identity(engine) -> str:
    """Name and digest of what shapes the KV's values: the model's config and the numerics of its
    weights (file name, quantization, dtype; the seed of random weights). Two replicas serving
    the same checkpoint the same way agree; a different checkpoint of one shape does not,
    through the digest of its embedding table's first rows."""
    cfg, mc = engine.cfg, engine.model_cfg
    h = xxhash.xxh3_64()
    h.update(msgspec.json.encode([mc, os.path.basename(cfg.model.rstrip("/")), cfg.quantization, cfg.dtype,
                                  cfg.seed if cfg.random_weights else None]))
    emb = engine.runner.model.embed_tokens.weight.detach()[:8].float().cpu().contiguous()
    h.update(emb.numpy().tobytes())
    return f"{mc.name}:{h.hexdigest()}"


def kv_spec(engine) -> P.KvSpec:
    runner = engine.runner
    L, _, _, bs, hkv, row = runner.kv_cache.shape
    draft = ""
    if runner.draft_kv is not None:
        _, _, _, dh, dd = runner.draft_kv.shape
        draft = f"{DTYPE_NAMES[str(runner.draft_kv.dtype)]}:{dh}:{dd}"
    return P.KvSpec(model=model_identity(engine), dtype=DTYPE_NAMES[str(runner.kv_cache.dtype)], block_size=bs,
                    num_layers=L, num_kv_heads=hkv, head_dim=engine.model_cfg.head_dim, row=row,
                    block_bytes=runner.block_nbytes(), draft=draft, tp=runner.tp.world)


class KvTransfer:
    """The engine process's KvRead, KvBlocks and KvHot commands over one engine."""

    def __init__(self, engine, slots_fd: int):
        self.engine = engine
        self.spec = kv_spec(engine)
        # the segment shared with the API process, sized here for this pool's blocks (replica.kv_slots)
        self.slots = SlotMap(slots_fd, *geometry(self.spec.block_bytes), size_it=True)

    def _slot(self, slot: int, blocks: int) -> memoryview | str:
        """Slot `slot`'s first `blocks` blocks' bytes, or what is wrong with the command."""
        per = self.spec.block_bytes
        try:
            return self.slots.view(slot, blocks * per)
        except ValueError:  # SlotMap.view checks the slot and the size
            return f"{blocks} blocks in KV slot {slot}: {self.slots.count} slots of {self.slots.slot_bytes // per} blocks"

    def _refusal(self) -> str:
        if self.engine.runner.tp.world > 1:
            return "KV transfer needs tp=1 (each rank holds a shard of the KV heads)"
        return ""

    def read(self, msg: P.KvRead) -> P.KvBlocks:
        """The bytes of the cached prefix of msg.hashes (up to the first one not cached)."""
        if err := self._refusal():
            return P.KvBlocks(id=msg.id, error=err)
        blocks = self.engine.blocks.cached(msg.hashes)
        view = self._slot(msg.slot, len(blocks))
        if isinstance(view, str):
            return P.KvBlocks(id=msg.id, error=view)
        self.engine.runner.read_blocks(blocks, view)
        return P.KvBlocks(id=msg.id, hashes=msg.hashes[: len(blocks)], slot=msg.slot)

    def write(self, msg: P.KvBlocks) -> P.KvWritten:
        """Cache msg's blocks (checked by the API process) under their hashes; skip those cached."""
        if err := self._refusal():
            return P.KvWritten(id=msg.id, error=err)
        per = self.spec.block_bytes
        slot = self._slot(msg.slot, len(msg.hashes))
        if isinstance(slot, str):
            return P.KvWritten(id=msg.id, error=slot)
        bs = self.spec.block_size
        if len(msg.ids) != len(msg.hashes) * bs:
            return P.KvWritten(id=msg.id, error=f"{len(msg.ids)} token ids for {len(msg.hashes)} blocks of {bs}")
        bm = self.engine.blocks
        present = [bm.cached([h]) for h in msg.hashes]  # [block] or []
        new = [i for i, p in enumerate(present) if not p]
        reserved = bm.reserve(len(new), keep=[p[0] for p in present if p])
        if reserved is None:
            return P.KvWritten(id=msg.id, present=len(msg.hashes) - len(new),
                               error=f"no room: {len(new)} blocks wanted, {bm.num_free} free (the rest are in use)")
        if len(new) < len(msg.hashes):  # only the new blocks' bytes (a copy of them; rare: a prefix the pull skips)
            slot = bytearray().join(slot[i * per: (i + 1) * per] for i in new)
        try:
            self.engine.runner.write_blocks(reserved, slot)
        except BaseException:
            bm.release(reserved)
            raise
        bm.cache_imported(reserved, [msg.hashes[i] for i in new], [msg.hashes[i - 1] if i else msg.prev for i in new],
                          [msg.ids[i * bs: (i + 1) * bs] for i in new], [msg.start + i for i in new])
        return P.KvWritten(id=msg.id, stored=len(new), present=len(msg.hashes) - len(new))

    def hot(self, msg: P.KvHot) -> P.KvChains:
        """The cached conversations no running stream holds (BlockManager.hot_chains)."""
        chains = self.engine.blocks.hot_chains(msg.max_blocks)
        return P.KvChains(id=msg.id, chains=[P.KvChain(seed, ids) for seed, ids in chains])
