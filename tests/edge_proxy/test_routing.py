"""Routing policies on synthetic replica states: no sockets."""

from collections import Counter

from edge_proxy.prefix_index import BlockIndex
from edge_proxy.routing import (FAILOVER, LOAD, PREFIX, STICKY, Candidate, Router, RouterConfig, effective_load,
                                is_imbalanced, load_bound, pick_prefix, pick_sticky, rendezvous_order)
from wire.hashing import block_hashes
from wire.protocol import KvEvents

IDS = [f"r{i}" for i in range(5)]
CFG = RouterConfig()


def idle(ids=IDS):
    return [Candidate(i, 0.0) for i in ids]


def test_rendezvous_is_deterministic_and_spreads():
    first = Counter(rendezvous_order(f"s{k}", IDS)[0] for k in range(5000))
    assert set(first) == set(IDS)
    assert min(first.values()) > 800  # ~1000 each
    assert rendezvous_order("s42", IDS) == rendezvous_order("s42", list(reversed(IDS)))


def test_losing_a_replica_moves_only_its_sessions():
    before = {k: pick_sticky(f"s{k}", None, idle(), CFG).id for k in range(2000)}
    after = {k: pick_sticky(f"s{k}", None, idle(IDS[1:]), CFG).id for k in range(2000)}
    moved = {k for k in before if before[k] != after[k]}
    assert moved == {k for k in before if before[k] == "r0"}


def test_sticky_stays_put_until_over_the_bound():
    cands = [Candidate("r0", 10.0), Candidate("r1", 8.0), Candidate("r2", 9.0)]
    bound = load_bound(27.0, 3, CFG)  # ceil(1.25 * 28 / 3) + 4 = 16
    assert bound == 16
    assert pick_sticky("s", "r0", cands, CFG).id == "r0"  # current, under the bound: stays
    cands[0].load = 20.0  # bound is now ceil(1.25 * 38 / 3) + 4 = 20 < 21
    d = pick_sticky("s", "r0", cands, CFG)
    assert d.id != "r0"  # over the bound: moves to its next rendezvous choice under the bound
    assert d.id == next(r for r in rendezvous_order("s", ["r0", "r1", "r2"]) if r != "r0")


def test_sticky_moves_off_an_unhealthy_replica():
    # Unhealthy replicas are not candidates; the session goes to its next rendezvous choice.
    order = rendezvous_order("sess", IDS)
    d = Router().route(idle([r for r in IDS if r != order[0]]), 100, 16, session_key="sess", session_current=order[0])
    assert (d.replica, d.reason) == (order[1], STICKY)


def test_small_imbalance_never_moves_a_session():
    cands = [Candidate("r0", 3.0), Candidate("r1", 0.0)]
    assert pick_sticky("s", "r0", cands, CFG).id == "r0"


def test_prefix_prefers_cached_blocks():
    cands = [Candidate("r0", 1.0, 0), Candidate("r1", 1.0, 30), Candidate("r2", 1.0, 10)]
    d = pick_prefix(prompt_tokens=512, block_size=16, cands=cands, cfg=CFG)
    assert (d.replica, d.reason, d.cached_blocks) == ("r1", PREFIX, 30)


def test_prefix_weighed_against_load():
    # r1 saves 160 prefill tokens but has one more outstanding request (256 token-equivalents).
    cands = [Candidate("r0", 0.0, 0), Candidate("r1", 1.0, 10)]
    assert pick_prefix(512, 16, cands, CFG).replica == "r0"
    cands[1].cached_blocks = 31  # now it saves 496 tokens
    assert pick_prefix(512, 16, cands, CFG).replica == "r1"


def test_imbalance_overrides_the_cache():
    cands = [Candidate("r0", 40.0, 30), Candidate("r1", 2.0, 0)]
    assert is_imbalanced(cands, CFG)
    d = pick_prefix(512, 16, cands, CFG)
    assert (d.replica, d.reason) == ("r1", LOAD)
    assert not is_imbalanced([Candidate("r0", 20.0), Candidate("r1", 14.0)], CFG)  # abs diff 6 <= 16


def test_no_cache_anywhere_is_a_load_decision():
    d = pick_prefix(100, 16, [Candidate("r0", 3.0), Candidate("r1", 1.0)], CFG)
    assert (d.replica, d.reason) == ("r1", LOAD)


def test_failover_is_prefix_aware_and_labelled():
    d = Router().route([Candidate("r1", 0.0, 0), Candidate("r2", 0.0, 5)], 200, 16, session_key="s", failover=True)
    assert (d.replica, d.reason) == ("r2", FAILOVER)
    assert Router().route([], 10, 16) is None


def test_effective_load_counts_requests_since_the_report():
    assert effective_load(reported=10, own_now=5, own_at_report=3) == 12.0  # 2 sent since
    assert effective_load(reported=0, own_now=4, own_at_report=4) == 4.0  # never below our own


def test_block_index_precise_from_kv_events():
    ids = list(range(100))
    h = block_hashes(ids, 16, "salt")
    idx = BlockIndex()
    assert not idx.precise
    idx.apply(KvEvents(stored=h[:4]))
    assert idx.precise and idx.match(h, now=0.0) == 4
    idx.apply(KvEvents(removed=[h[1]]))
    assert idx.match(h, now=0.0) == 1  # chained: a hole ends the prefix
    idx.apply(KvEvents(stored=h[:2], cleared=True))
    assert idx.match(h, now=0.0) == 2
    assert idx.match(block_hashes(ids, 16, "other tenant"), now=0.0) == 0


def test_block_index_approximate_from_history_then_pending_window():
    h = block_hashes(list(range(64)), 16)
    idx = BlockIndex(capacity=3, pending_s=2.0)
    idx.routed(h, now=0.0)
    assert idx.match(h, now=100.0) == 0  # capacity 3: block 0 was evicted first
    idx = BlockIndex(capacity=100, pending_s=2.0)
    idx.routed(h, now=0.0)
    assert idx.match(h, now=100.0) == 4  # approximate mode: history, no expiry
    idx.apply(KvEvents(stored=h[:1]))  # precise now: history only covers the pending window
    assert idx.match(h, now=1.0) == 4
    assert idx.match(h, now=3.0) == 1
