"""Paged KV blocks with a prefix cache.

One preallocated pool of `num_blocks` blocks of `block_size` token slots. Each
sequence owns a block table (list of block ids). A *full* block is registered
under its chained hash (wire.hashing), so a later request whose prefix hashes
the same reuses it instead of recomputing it.

Invariants:
  * ref_count[b] = number of block tables holding b.
  * A block with ref_count 0 is either in `_free` (holds nothing reusable) or in
    `_evictable` (holds a registered hash, LRU order: oldest first).
  * `_hash_to_block[h] == b` iff `_block_hash[b] == h` (one block per hash).
Every hash registered or dropped is recorded for the KV event stream, and in `tips` (the
chains, i.e. conversations, cached: what a Load reports for routing new ones).
A block imported from another replica (replica.engine.kv_transfer) is reserved like a fresh
block, written, and only then registered, as a cached free block: no table sees it half written.
A registered block keeps its token ids and its index in its chain, so the cached conversations
can be listed by their ids (`hot_chains`: what a draining replica hands on besides its streams).
"""

from __future__ import annotations

from collections import OrderedDict

from wire.hashing import ChainTips, chain_hash, salt_seed
from replica.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_count = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        self._hash_to_block: dict[int, int] = {}
        self._block_ids: list[list[int] | None] = [None] * num_blocks  # a registered block's token ids
        self._block_pos: list[int] = [0] * num_blocks  # and its index in its chain (0: the chain's first)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # stack, pops block 0 first
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.stored: list[int] = []  # KV events since the last drain
        self.removed: list[int] = []
        self.tips = ChainTips()  # the registered hashes' tree: how many chains (conversations) it holds

    # -- capacity ---------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    # -- allocation -------------------------------------------------------------
    def _take(self) -> int:
        if self._free:
            b = self._free.pop()
        else:
            b, _ = self._evictable.popitem(last=False)  # least recently used
            h = self._block_hash[b]
            self._block_hash[b] = None
            self._block_ids[b] = None
            del self._hash_to_block[h]
            self.removed.append(h)
            self.tips.remove(h)
        assert self.ref_count[b] == 0
        self.ref_count[b] = 1
        return b

    def _ref(self, b: int) -> None:
        if self.ref_count[b] == 0:
            self._evictable.pop(b)
        self.ref_count[b] += 1

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks for the longest cached prefix of a new sequence.

        At least one token is always left to compute (its logits are needed), so
        at most (len - 1) // block_size blocks are reused. Returns tokens reused.
        """
        assert not seq.block_table and seq.num_computed == 0
        if seq.sampling.prompt_logprobs is not None:
            return 0  # it needs the logits of every prompt position: nothing cached has them
        h = salt_seed(seq.cache_salt)
        bs = self.block_size
        for i in range((len(seq) - 1) // bs):
            h = chain_hash(h, seq.token_ids[i * bs : (i + 1) * bs])
            b = self._hash_to_block.get(h)
            if b is None:
                break
            self._ref(b)
            seq.block_table.append(b)
            seq.block_hashes.append(h)
        seq.num_computed = len(seq.block_table) * bs
        return seq.num_computed

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow seq's block table to hold num_computed + num_new_tokens tokens."""
        n = self.blocks_needed(seq, num_new_tokens)
        if n > self.num_free:
            return False
        for _ in range(n):
            seq.block_table.append(self._take())
        return True

    def truncate(self, seq: Sequence, length: int) -> None:
        """Give back the blocks wholly past position length - 1: the slots a
        speculative step reserved for drafts that were rejected. They hold no
        registered hash (only blocks full of computed, i.e. verified, tokens are
        registered), so they go straight to the free list."""
        assert length >= seq.num_computed, "truncate keeps every computed token"
        keep = -(-length // self.block_size)
        while len(seq.block_table) > keep:
            b = seq.block_table.pop()
            assert self.ref_count[b] == 1 and self._block_hash[b] is None, "draft blocks are private and unhashed"
            self.ref_count[b] = 0
            self._free.append(b)

    def commit(self, seq: Sequence) -> None:
        """Register the blocks that became full with computed tokens under their hashes."""
        bs = self.block_size
        full = seq.num_computed // bs
        h = seq.block_hashes[-1] if seq.block_hashes else salt_seed(seq.cache_salt)
        for i in range(len(seq.block_hashes), full):
            ids = seq.token_ids[i * bs : (i + 1) * bs]
            prev, h = h, chain_hash(h, ids)
            seq.block_hashes.append(h)
            b = seq.block_table[i]
            if h not in self._hash_to_block and self._block_hash[b] is None:
                self._register(b, h, prev, ids, i)

    def _register(self, b: int, h: int, prev: int, ids: list[int], pos: int) -> None:
        self._hash_to_block[h] = b
        self._block_hash[b] = h
        self._block_ids[b], self._block_pos[b] = ids, pos
        self.stored.append(h)
        self.tips.add(h, prev)

    def free(self, seq: Sequence) -> None:
        """Drop seq's references. Tail blocks go first in LRU order, so shared
        prefixes (the most reusable part) are the last to be evicted."""
        for b in reversed(seq.block_table):
            self.ref_count[b] -= 1
            assert self.ref_count[b] >= 0
            if self.ref_count[b] == 0:
                if self._block_hash[b] is None:
                    self._free.append(b)
                else:
                    self._evictable[b] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed = 0

    # -- KV import and export (replica.engine.kv_transfer) ---------------------------------
    def cached(self, hashes: list[int]) -> list[int]:
        """The blocks cached under `hashes`, up to the first hash not cached."""
        out = []
        for h in hashes:
            b = self._hash_to_block.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def reserve(self, n: int, keep: list[int] = ()) -> list[int] | None:
        """n blocks held privately (ref count 1, no hash, like a sequence's fresh blocks) for an
        import to write into, or None when fewer than n are free. The cached blocks in `keep` are
        made the most recently used first, so taking n does not evict them when others can go."""
        if n > self.num_free:
            return None
        for b in keep:
            if b in self._evictable:
                self._evictable.move_to_end(b)
        return [self._take() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        """Give back reserved blocks unused (their import failed)."""
        for b in blocks:
            assert self.ref_count[b] == 1 and self._block_hash[b] is None
            self.ref_count[b] = 0
            self._free.append(b)

    def cache_imported(self, blocks: list[int], hashes: list[int], parents: list[int], ids: list[list[int]],
                       positions: list[int]) -> None:
        """Reserved blocks whose KV is written and checked become cached free blocks under their
        hashes (ref count 0, the most recently used end of the LRU), each a stored event; `parents`:
        the hash each extends, `ids` its token ids, `positions` its index in its chain. A hash cached
        meanwhile keeps its block; the reserved one goes back free."""
        for b, h, prev, block_ids, pos in zip(blocks, hashes, parents, ids, positions, strict=True):
            assert self.ref_count[b] == 1 and self._block_hash[b] is None
            self.ref_count[b] = 0
            if h in self._hash_to_block:
                self._free.append(b)
                continue
            self._register(b, h, prev, block_ids, pos)
            self._evictable[b] = None

    def hot_chains(self, max_blocks: int) -> list[tuple[int, list[int]]]:
        """The cached conversations no block table holds, most recently used first, as (seed, token
        ids of the chain's full blocks from its first): each tip among the free cached blocks (a
        running sequence's chain moves with its stream), up to `max_blocks` blocks where a prefix
        shared with an earlier chain counts once; the last chain taken is cut to what fits (its
        prefix, the part most likely shared). A chain broken by an eviction out of order (its first
        block gone) is left out: no request reaches past the break."""
        out: list[tuple[int, list[int]]] = []
        taken: set[int] = set()
        for tip in reversed(self._evictable):  # most recently used first (a freed sequence's tip before its prefix)
            if len(taken) >= max_blocks:
                break
            if self.tips.children.get(self._block_hash[tip]):
                continue  # a cached block extends it: not a tip
            chain = [tip]
            while self._block_pos[chain[-1]] > 0:
                b = self._hash_to_block.get(self.tips.parent[self._block_hash[chain[-1]]])
                if b is None:
                    break
                chain.append(b)
            if self._block_pos[chain[-1]] > 0:
                continue  # broken
            chain.reverse()  # from its first block
            keep, new = 0, 0
            for b in chain:
                new += b not in taken
                if len(taken) + new > max_blocks:
                    break
                keep += 1
            if keep == 0:
                break  # its first block is new and none fits
            taken.update(chain[:keep])
            seed = self.tips.parent[self._block_hash[chain[0]]]
            out.append((seed, [t for b in chain[:keep] for t in self._block_ids[b]]))
        return out

    def drain_events(self) -> tuple[list[int], list[int]]:
        stored, removed = self.stored, self.removed
        self.stored, self.removed = [], []
        return stored, removed

    def check_invariants(self) -> None:
        """Test helper: the accounting above holds."""
        assert len(self._free) + len(self._evictable) + sum(1 for r in self.ref_count if r > 0) == self.num_blocks
        for b in self._evictable:
            assert self.ref_count[b] == 0 and self._block_hash[b] is not None
        for h, b in self._hash_to_block.items():
            assert self._block_hash[b] == h
            assert self._block_ids[b] is not None and len(self._block_ids[b]) == self.block_size
        assert self.tips.parent.keys() == self._hash_to_block.keys()
