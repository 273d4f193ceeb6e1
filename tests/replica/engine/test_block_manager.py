"""Block pool accounting, prefix matching, LRU eviction and KV events."""

from replica.engine.block_manager import BlockManager
from wire.hashing import block_hashes, salt_seed
from wire.protocol import SamplingParams
from replica.engine.sequence import Sequence


def seq(ids, salt=""):
    return Sequence("x", ids, SamplingParams(), seed=0, eos_ids=frozenset(), cache_salt=salt)


def fill(bm, s):
    """Allocate and 'compute' all of s's tokens, registering its full blocks."""
    assert bm.allocate(s, s.num_uncomputed)
    s.num_computed = len(s)
    bm.commit(s)


def test_full_blocks_are_published_with_the_shared_hash_function():
    bm = BlockManager(8, 4)
    s = seq(list(range(10)), salt="t")
    fill(bm, s)
    stored, removed = bm.drain_events()
    assert stored == block_hashes(list(range(10)), 4, "t") and removed == []
    assert bm.drain_events() == ([], [])
    bm.check_invariants()


def test_prefix_hits_share_blocks_and_leave_one_token_to_compute():
    bm = BlockManager(8, 4)
    a = seq(list(range(12)))
    fill(bm, a)
    b = seq(list(range(12)))
    assert bm.match_prefix(b) == 8  # 2 of 3 full blocks: the last token must be computed
    assert b.block_table == a.block_table[:2]
    assert all(bm.ref_count[x] == 2 for x in b.block_table)
    c = seq(list(range(4)) + [99] * 8)
    assert bm.match_prefix(c) == 4
    bm.check_invariants()


def test_freed_cached_blocks_are_evicted_lru_and_reported():
    bm = BlockManager(4, 4)
    a, b = seq(list(range(8))), seq(list(range(100, 108)))
    fill(bm, a)
    fill(bm, b)
    bm.free(a)
    bm.free(b)
    bm.drain_events()
    assert bm.num_free == 4
    # Reusing a's prefix refreshes it; new allocations then evict b's blocks first.
    a2 = seq(list(range(8)) + [7])
    assert bm.match_prefix(a2) == 8
    bm.free(a2)
    c = seq(list(range(200, 208)))
    assert bm.allocate(c, 8)
    _, removed = bm.drain_events()
    assert set(removed) == set(block_hashes(list(range(100, 108)), 4))
    d = seq(list(range(8)) + [1])
    assert bm.match_prefix(d) == 8  # a's blocks survived
    bm.check_invariants()


def test_allocation_fails_cleanly_when_the_pool_is_dry():
    bm = BlockManager(2, 4)
    s = seq(list(range(12)))
    assert not bm.allocate(s, 12)
    assert s.block_table == [] and bm.num_free == 2


def test_the_chains_it_holds_count_conversations_not_blocks():
    """Two conversations under one system prompt are two chains, however long; a next turn that
    extends a conversation's blocks is still one; an eviction takes its chain's tip first."""
    bm = BlockManager(16, 4)
    system = list(range(100, 108))  # two blocks
    a, b = seq(system + [1, 2, 3, 4, 5]), seq(system + [9, 9, 9, 9, 9, 9, 9, 9, 9])
    fill(bm, a)
    assert bm.tips.tips == 1  # the system prompt's blocks, then a's: one chain
    fill(bm, b)
    assert bm.tips.tips == 2  # b branches off the system prompt
    bm.free(a)
    a2 = seq(a.token_ids + [6, 7, 8, 9])  # a's next turn: its prompt extends a's blocks
    bm.match_prefix(a2)
    fill(bm, a2)
    assert bm.tips.tips == 2
    bm.free(a2)
    bm.free(b)
    bm.check_invariants()
    while len(bm._free) > 0:  # take every free block, then evict the LRU ones: a2's tail first
        bm._take()
    bm._take()
    assert bm.tips.tips == 2  # a2's tip went, its parent is the tip now
    bm.check_invariants()


def test_hot_chains_list_the_conversations_no_stream_holds_most_recent_first():
    bm = BlockManager(32, 4)
    system = [1, 2, 3, 4]
    a, b = seq(system + list(range(10, 18))), seq(system + list(range(20, 28)))
    c = seq(list(range(30, 38)), salt="u")  # another tenant's
    running = seq(system + [40, 41, 42, 43])
    for s in (a, c, b):  # finished in this order
        fill(bm, s)
        bm.free(s)
    fill(bm, running)  # its chain moves with its stream: not listed
    seed_u = salt_seed("u")  # its first block's parent: the salt's seed
    assert bm.hot_chains(100) == [(0, b.token_ids), (seed_u, c.token_ids), (0, a.token_ids)]
    # a budget of blocks: a prefix shared with an earlier chain counts once, the last chain is cut to its prefix
    assert bm.hot_chains(4) == [(0, b.token_ids), (seed_u, c.token_ids[:4])]
    assert bm.hot_chains(6) == [(0, b.token_ids), (seed_u, c.token_ids), (0, a.token_ids[:8])]
    assert bm.hot_chains(0) == []
    bm.free(running)  # finished now: the most recent
    assert bm.hot_chains(100)[0] == (0, running.token_ids)
    bm.check_invariants()
