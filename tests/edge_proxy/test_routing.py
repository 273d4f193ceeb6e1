"""Routing policies on synthetic replica states: no sockets."""

import dataclasses
from collections import Counter

from edge_proxy.prefix_index import BlockIndex, reply_hashes
from edge_proxy.routing import (FAILOVER, LOAD, PREFIX, SPILL, STICKY, Candidate, Decision, Router, RouterConfig,
                                compute_groups, effective_load, later_turn, load_bound, mark_home, pick_prefix,
                                pick_sticky, rendezvous_order, valve_pick)
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


def test_a_session_moves_off_an_unhealthy_replica():
    # Unhealthy replicas are not candidates; on idle replicas the session key's rendezvous
    # order breaks the tie, so every proxy worker moves it to the same place.
    order = rendezvous_order("sess", IDS)
    d = Router().route(idle([r for r in IDS if r != order[0]]), 100, 16, session_key="sess", session_current=order[0])
    assert (d.replica, d.reason) == (order[1], LOAD)
    d = Router().route(idle(), 100, 16, session_key="sess", session_current=order[2])
    assert (d.replica, d.reason) == (order[2], STICKY)  # its replica is kept while under the bound


def test_small_imbalance_never_moves_a_session():
    cands = [Candidate("r0", 3.0), Candidate("r1", 0.0)]
    assert pick_sticky("s", "r0", cands, CFG).id == "r0"


def test_prefix_prefers_cached_blocks():
    cands = [Candidate("r0", 1.0, 0), Candidate("r1", 1.0, 30), Candidate("r2", 1.0, 10)]
    d = pick_prefix(prompt_tokens=512, block_size=16, cands=cands, cfg=CFG)
    assert (d.replica, d.reason, d.cached_blocks) == ("r1", PREFIX, 30)


def test_imbalance_overrides_the_cache():
    cands = [Candidate("r0", 40.0, 30), Candidate("r1", 2.0, 0)]
    assert valve_pick(cands, CFG, "k").id == "r1"
    d = pick_prefix(512, 16, cands, CFG)
    assert (d.replica, d.reason) == ("r1", LOAD)
    assert valve_pick([Candidate("r0", 20.0), Candidate("r1", 14.0)], CFG, "k") is None  # 20 <= 1.5 x 14
    assert valve_pick([Candidate("r0", 4.0), Candidate("r1", 0.0)], CFG, "k") is None  # 4 - 0 <= 4


def test_compute_groups_join_replicas_whose_units_meet():
    groups = compute_groups({"a": ["cpu:m1:0", "cpu:m1:1"], "b": ["gpu:X"], "c": ["cpu:m1:1", "cpu:m1:2"],
                             "d": ["cpu:m1:2"], "e": [], "f": ["gpu:Y", "gpu:X"]}, {"a": 1, "c": 4})
    assert {r: g for r, (g, _) in groups.items()} == {"a": "a", "b": "b", "c": "a", "d": "a", "e": "e", "f": "b"}
    # shares: a uses 1 of the group's 3 cores, c both of its own (4 asked, 2 named), d its one;
    # b one of the two GPUs its group has, f both; e computes alone.
    assert {r: s for r, (_, s) in groups.items()} == {"a": 1 / 3, "b": 0.5, "c": 2 / 3, "d": 1 / 3, "e": 1.0,
                                                      "f": 1.0}


def test_the_valve_weighs_compute_groups_not_replicas():
    # Two replicas on one GPU, 3 requests each, and one alone with 1: the GPU shared by
    # six requests is the loaded one (6 - 1 > 4): the lone replica takes the request.
    shared = [Candidate("a", 3.0, 30, group="g"), Candidate("b", 3.0, 30, group="g")]
    d = pick_prefix(512, 16, shared + [Candidate("c", 1.0)], CFG)
    assert (d.replica, d.reason) == ("c", LOAD)
    # One machine's cores under all three: no replica has compute the others lack, so no
    # valve (bounded load and the spill price still apply: the next test).
    one = [Candidate("a", 9.0, 30, group="m"), Candidate("b", 0.0, group="m"), Candidate("c", 0.0, group="m")]
    assert valve_pick(one, CFG, "k") is None


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


def test_block_index_expected_blocks_age_out_unless_confirmed():
    h = block_hashes(list(range(64)), 16)
    idx = BlockIndex(capacity=3, expect_s=2.0)
    idx.expect(h, now=0.0)
    assert idx.match(h, now=100.0) == 0  # capacity 3: block 0 was dropped first
    idx = BlockIndex(capacity=100, expect_s=2.0)
    idx.expect(h, now=0.0)
    assert idx.match(h, now=100.0) == 4  # approximate mode (no KV events ever): never aged
    idx.apply(KvEvents(stored=h[:1]))  # precise now: expectations count for expect_s
    assert idx.match(h, now=1.0) == 4
    assert idx.match(h, now=3.0) == 1  # blocks 1-3 were never stored (say, the request was aborted)
    idx.expect(h, now=3.0)
    idx.apply(KvEvents(stored=h[1:3]))  # confirmed: no longer aging
    idx.apply(KvEvents(removed=[h[3]]))  # evicted: gone from both sets
    assert idx.match(h, now=3.5) == 3 and idx.match(h, now=1000.0) == 3
    idx.reset()  # a new connection: nothing known
    assert not idx.precise and idx.match(h, now=1000.0) == 0


# -- a chat's next turn, bounded load (synthetic replica states) ----------------------------------

EOS, NL = 2, 10


def chat_turn(history: list[int], user: list[int]) -> list[int]:
    """A ChatML-like rendering: history, the user's turn, the assistant's header."""
    return history + [1, 300] + user + [EOS, NL] + [1, 301, NL]


class Replicas:
    """Per-replica prefix indexes fed the way the proxy feeds them, plus loads."""

    def __init__(self, ids=("a", "b", "c")):
        self.index = {r: BlockIndex() for r in ids}
        self.load = dict.fromkeys(ids, 0.0)
        for idx in self.index.values():
            idx.apply(KvEvents(cleared=True))  # connected: precise mode, nothing cached

    def cands(self, prompt, now=0.0):  # as Proxy._candidates builds them
        hashes, out = block_hashes(prompt, 16), []
        for r, idx in self.index.items():
            n = idx.match(hashes, now)
            out.append(Candidate(r, self.load[r], n, held_blocks=len(idx), history=idx.history(hashes, n, prompt, 16)))
        return out

    def route(self, prompt, now=0.0, router=None, **kw):
        h = block_hashes(prompt, 16)
        d = (router or Router()).route(self.cands(prompt, now), len(prompt), 16, key=str(h[0]), **kw)
        self.index[d.replica].expect(h, now)  # Proxy._attach
        return d, h


def test_second_turn_routed_before_its_kv_events_arrive():
    reps = Replicas()
    system = list(range(1000, 1100))
    turn1 = chat_turn([1, 299] + system + [EOS, NL], [7] * 10)
    d1, h1 = reps.route(turn1)
    reply = list(range(2000, 2040)) + [EOS]  # what the replica streamed back
    # The stream ended (Proxy._release): prompt + reply are expected there; no KV event yet.
    reps.index[d1.replica].expect(reply_hashes(turn1, h1, reply, 16, ""), now=0.5)
    turn2 = chat_turn(turn1 + reply + [NL], [8] * 6)
    held = len(turn1) + len(reply) - 1  # all but the last reply id were computed
    d2, h2 = reps.route(turn2, now=0.6)
    assert (d2.replica, d2.reason, d2.cached_blocks) == (d1.replica, PREFIX, held // 16)
    # Without the reply the match would have stopped at the prompt's own blocks.
    assert BlockIndex.match(_only_prompt(h1), h2, 0.6) == len(turn1) // 16 < held // 16
    # The KV events come later and confirm it; an eviction shortens the match.
    idx = reps.index[d1.replica]
    idx.apply(KvEvents(stored=h2[: held // 16]))
    assert idx.match(h2, now=1000.0) == held // 16
    idx.apply(KvEvents(removed=[h2[3]]))
    assert idx.match(h2, now=1000.0) == 3


def _only_prompt(hashes):
    idx = BlockIndex()
    idx.expect(hashes, 0.0)
    return idx


def test_a_retokenized_reply_routes_on_the_longest_true_match():
    reps = Replicas()
    turn1 = chat_turn([1, 299] + list(range(1000, 1090)) + [EOS, NL], [7] * 12)
    d1, h1 = reps.route(turn1)
    reply = list(range(2000, 2060)) + [EOS]
    reps.index[d1.replica].expect(reply_hashes(turn1, h1, reply, 16, ""), now=0.5)
    # The template renders the reply's text back into other ids from reply token 21 on
    # (the model had sampled a non-canonical split): the replica holds the generated ones.
    rerendered = reply[:21] + [5000, 5001] + reply[23:]
    turn2 = chat_turn(turn1 + rerendered + [NL], [8] * 6)
    true_match = (len(turn1) + 21) // 16  # full blocks before the first differing id
    assert true_match < (len(turn1) + len(reply) - 1) // 16
    d2, _ = reps.route(turn2, now=0.6)
    assert (d2.replica, d2.cached_blocks) == (d1.replica, true_match)


def test_new_conversations_spread_and_stay():
    reps = Replicas()
    placed = {}
    for k in range(6):  # six conversations start together
        d, _ = reps.route(chat_turn([1, 299, 50 + k] + [60 + k] * 90, [7] * 5))
        placed[k] = d.replica
        reps.load[d.replica] += 1
    assert Counter(placed.values()) == {"a": 2, "b": 2, "c": 2}
    for k in range(6):  # their second turns (all six still streaming): each finds its own replica
        d, _ = reps.route(chat_turn([1, 299, 50 + k] + [60 + k] * 90, [7] * 5) + [9] * 20)
        assert d.replica == placed[k] and d.reason == PREFIX


def test_a_new_conversation_among_equally_busy_replicas_goes_where_fewer_are():
    """b serves three conversations, a and c two; this instant each has one request in
    flight (b's other two are between turns). A new conversation goes to a or c, the
    ones holding fewer blocks, whatever its key's rendezvous draw says."""
    reps = Replicas()
    for r, convs in (("a", 2), ("b", 3), ("c", 2)):
        for k in range(convs):
            reps.index[r].expect(block_hashes(chat_turn([1, 299, ord(r), k] + [40 + k] * 90, [7] * 5), 16), 0.0)
    reps.load.update(a=1.0, b=1.0, c=1.0)
    drawn = set()
    for k in range(12):
        prompt = chat_turn([1, 299, 500 + k] + [80 + k] * 90, [7] * 5)
        drawn.add(rendezvous_order(str(block_hashes(prompt, 16)[0]), ["a", "b", "c"])[0])
        cands = reps.cands(prompt)
        d = pick_prefix(len(prompt), 16, cands, CFG, key=str(block_hashes(prompt, 16)[0]))
        assert d.replica in ("a", "c") and d.reason == LOAD
    assert "b" in drawn  # the rendezvous draw alone would have sent some of them to b


def test_bounded_load_spill_keeps_the_cache_where_it_can():
    # One long system prompt (20 blocks), held by a and b but not by c.
    reps = Replicas()
    system = [1, 299] + list(range(1000, 1318)) + [EOS, NL]
    hs = block_hashes(system, 16)
    for r in ("a", "b"):
        reps.index[r].apply(KvEvents(stored=hs))
    user = lambda k: chat_turn(system, [k] * 8)  # noqa: E731
    # b is at its bound (ceil(1.1 x 6 / 3) = 3 < 3 + 1); a can prefill it as cheaply: a, not the idle c.
    reps.load.update(a=2.0, b=3.0, c=0.0)
    d, _ = reps.route(user(7))
    assert (d.replica, d.reason) == ("a", PREFIX)
    # Both holders at the bound: a prefix several replicas hold is a shared one, worth one more copy.
    reps.load.update(a=3.0, b=3.0, c=0.0)
    d, _ = reps.route(user(8))
    assert (d.replica, d.reason) == ("c", SPILL)


def test_a_conversation_leaves_its_replica_only_when_the_queue_costs_more():
    def later_turn(history_tokens: int, loads: dict):
        reps = Replicas()
        history = [1, 299] + list(range(1000, 1000 + history_tokens)) + [EOS, NL]
        reps.index["a"].apply(KvEvents(stored=block_hashes(history, 16)))  # only a holds this conversation
        reps.load.update(loads)
        return reps.route(chat_turn(history, [9] * 8))[0]

    assert later_turn(300, dict(a=1.0, b=1.0, c=0.0)).replica == "a"  # under its bound (2): it stays
    # Over its bound (ceil(1.1 x 4 / 3) = 2): the holder's 2 requests weigh 2 x 256 tokens ...
    d = later_turn(960, dict(a=2.0, b=1.0, c=0.0))
    assert (d.replica, d.reason) == ("a", PREFIX)  # ... less than prefilling 960 tokens on c
    d = later_turn(100, dict(a=2.0, b=1.0, c=0.0))
    assert (d.replica, d.reason) == ("c", SPILL)  # ... more than prefilling 100 tokens on c
    d = later_turn(960, dict(a=10.0, b=1.0, c=1.0))
    assert d.replica != "a" and d.reason == LOAD  # far above the others (> 4 and > 1.5 x): the valve


def test_a_session_keeps_its_replica_within_the_bound():
    reps = Replicas()
    prompt = chat_turn([1, 299] + list(range(1000, 1100)) + [EOS, NL], [7] * 5)
    reps.load.update(a=1.0, b=0.0, c=0.0)
    d, _ = reps.route(prompt, session_key="s1", session_current="a")
    assert (d.replica, d.reason) == ("a", STICKY)  # its cache is unknown here (another worker placed it)
    reps.load.update(a=6.0, b=0.0, c=0.0)
    d, _ = reps.route(prompt, session_key="s1", session_current="a")
    assert d.replica != "a"  # far above the others: moved


def test_a_cold_burst_of_one_long_prompt_makes_one_copy_at_a_time():
    """Eight users of one 800-token system prompt arrive at once, nothing cached. The
    first goes to a; the rest find a's copy in flight (the proxy indexes what it sent).
    A replica computing the prompt right now keeps new users while waiting behind it
    costs no more than a second cold copy; then one more copy, never three at once.
    The replicas are one-thread engines on a two-core machine (a half of it each):
    two busy ones use it all, and a third would only slow them."""
    bs, prompt, tail = 16, 816, 16
    blocks = (prompt - tail) // bs
    cands = {r: Candidate(r, 0.0, group="machine", share=0.5) for r in ("a", "b", "c")}
    placed = []
    for _ in range(8):
        d = pick_prefix(prompt, bs, list(cands.values()), CFG, key="burst")
        c = cands[d.replica]
        uncached = prompt - c.cached_blocks * bs
        c.load += 1
        c.queued_prefill += uncached
        c.queued_requests += 1
        c.cached_blocks = blocks  # what it was sent is in the index before any KV event
        placed.append(d.replica)
    counts = Counter(placed)
    assert placed[0] == placed[1]  # the second user queues behind the first's prefill
    assert len(counts) == 2 and max(counts.values()) >= 5  # one holder, then one more copy
    # Once the prompt is computed (first tokens: no queued prefill), the next user goes
    # to the copy with room.
    for c in cands.values():
        c.queued_prefill = c.queued_requests = 0
    holder, other = counts.most_common()[0][0], counts.most_common()[1][0]
    d = pick_prefix(prompt, bs, list(cands.values()), CFG, key="burst")
    assert (d.replica, d.reason) == (other, PREFIX)
    (third,) = set(cands) - {holder, other}
    # Both holders decode for 4 users (8 at a time): waiting there (16 + 4 x 256 tokens)
    # costs less than a cold copy on a third engine, which would get a third of two cores
    # (816 / (2/3)) and slow both holders.
    cands[holder].load = cands[other].load = 4.0
    d = pick_prefix(prompt, bs, list(cands.values()), CFG, key="burst")
    assert d.replica in (holder, other) and d.reason == PREFIX
    # On three cores the third engine has one of its own: the copy pays at once.
    for c in cands.values():
        c.share = 1 / 3
    d = pick_prefix(prompt, bs, list(cands.values()), CFG, key="burst")
    assert (d.replica, d.reason) == (third, SPILL)
    # And on two, once each holder decodes for 6, the queue costs more than that copy.
    for c in cands.values():
        c.share = 0.5
    cands[holder].load = cands[other].load = 6.0
    d = pick_prefix(prompt, bs, list(cands.values()), CFG, key="burst")
    assert (d.replica, d.reason) == (third, SPILL)


def test_a_replica_with_compute_of_its_own_takes_work_the_cache_would_keep():
    """A conversation with a 2,000-token history on a, which decodes for 6 others; b and
    c idle. Priced alone, queueing at a (6 x 256 tokens) costs less than prefilling the
    history again, so replicas sharing a's cores leave it there; but b and c with a GPU
    each have compute going spare while a's queue is 6 apart: the valve moves it."""
    history = 2000

    def route(group: str) -> Decision:
        cands = [Candidate("a", 6.0, history // 16, group=group and "m"), Candidate("b", 0.0, group=group and "m"),
                 Candidate("c", 0.0, group=group and "m")]
        return pick_prefix(history + 8, 16, cands, CFG, key="k")

    assert route("").reason == LOAD and route("").replica != "a"
    assert (route("m").replica, route("m").reason) == ("a", PREFIX)


def test_a_faster_replica_is_priced_by_its_measured_rate():
    # Only a holds the history; a is full. b prefills three times as fast as c (reported rates).
    history = 600
    cands = [Candidate("a", 3.0, history // 16), Candidate("b", 1.0, 0, speed=1.5), Candidate("c", 1.0, 0, speed=0.5)]
    d = pick_prefix(history + 8, 16, cands, CFG, key="k")
    assert (d.replica, d.reason) == ("b", SPILL)


# -- a conversation's home: kept within the spill bound (issue 26) -----------------------------------


def conversation_on(reps: Replicas, home: str, history_tokens: int = 200, reply_tokens: int = 16):
    """A conversation whose first turn ran on `home` and ended (the proxy expected its
    prompt there, then its reply: `Proxy._attach`, `Proxy._release`); its second turn,
    and the blocks of it `home` holds."""
    turn1 = chat_turn([1, 299] + list(range(1000, 1000 + history_tokens)) + [EOS, NL], [7] * 10)
    h1 = block_hashes(turn1, 16)
    reps.index[home].expect(h1, 0.0)
    reply = list(range(2000, 2000 + reply_tokens)) + [EOS]  # a short answer
    reps.index[home].expect_reply(turn1, h1, reply, 16, "", 0.5)
    return chat_turn(turn1 + reply + [NL], [8] * 6), (len(turn1) + len(reply) - 1) // 16


def test_a_conversation_stays_home_while_its_replica_is_briefly_the_busiest():
    """Three of a's conversations are in a turn at once, b has one, c none (the others'
    conversations are between turns). A fourth of a's conversations sends its next
    turn: a is over the placement bound (ceil(1.1 x 5 / 3) = 2), and 3 x 256 tokens of
    decoding priced against prefilling ~250 tokens on c would move it; it stays home,
    under the spill bound (ceil(1.25 x 5 / 3) + 4 = 7), with or without a session id."""
    for reply_tokens in (16, 3):  # (3: the reply fills no block; the prompt goes on past where its ids end)
        reps = Replicas()
        turn2, held = conversation_on(reps, "a", reply_tokens=reply_tokens)
        reps.load.update(a=3.0, b=1.0, c=0.0)
        d, _ = reps.route(turn2, now=1.0)
        assert (d.replica, d.reason, d.cached_blocks) == ("a", PREFIX, held)
        d, _ = reps.route(turn2, now=1.0, session_key="s", session_current="a")
        assert (d.replica, d.reason) == ("a", STICKY)
    # The same prompt's prefix known only from a prompt sent there (no reply of its own
    # there: a system prompt others share) is priced as before: it spills.
    other = Replicas()
    other.index["a"].expect(block_hashes(turn2, 16)[:-1], 0.0)
    other.load.update(a=3.0, b=1.0, c=0.0)
    d, _ = other.route(turn2, now=1.0)
    assert (d.replica, d.reason) == ("c", SPILL)


def test_past_the_spill_bound_a_conversation_is_priced_as_before():
    reps = Replicas()
    turn2, _ = conversation_on(reps, "a")
    one = lambda: [dataclasses.replace(c, group="m", share=0.5) for c in reps.cands(turn2, 1.0)]  # noqa: E731
    reps.load.update(a=8.0, b=1.0, c=0.0)  # L = 9: spill bound ceil(1.25 x 10 / 3) + 4 = 9 = 8 + 1
    d = pick_prefix(len(turn2), 16, one(), CFG, key="k")
    assert (d.replica, d.reason) == ("a", PREFIX)
    reps.load.update(a=9.0)  # 10 > ceil(1.25 x 11 / 3) + 4 = 9: 9 x 256 tokens of queue vs ~270 cold ones
    d = pick_prefix(len(turn2), 16, one(), CFG, key="k")
    assert (d.replica, d.reason) == ("c", SPILL)


def test_a_session_id_never_costs_a_conversation_its_cache():
    """Over a grid of loads: wherever the turn without a session id stays on its
    conversation's replica, it stays there with one too; and within the spill bound
    it stays in both."""
    reps = Replicas()
    turn2, _ = conversation_on(reps, "a")
    h = block_hashes(turn2, 16)
    for la in range(12):
        for lb in range(6):
            for lc in range(6):
                reps.load.update(a=float(la), b=float(lb), c=float(lc))
                cands = [dataclasses.replace(c, group="m", share=0.5) for c in reps.cands(turn2, 1.0)]
                plain = Router().route(cands, len(turn2), 16, key=str(h[0]))
                session = Router().route(cands, len(turn2), 16, key=str(h[0]), session_key="s",
                                         session_current="a")
                if plain.replica == "a":
                    assert session.replica == "a", (la, lb, lc)
                if la + 1 <= load_bound(la + lb + lc, 3, CFG):
                    assert plain.replica == session.replica == "a", (la, lb, lc)


def test_block_index_marks_a_conversations_next_turn():
    turn1 = chat_turn([1, 299] + list(range(1000, 1100)) + [EOS, NL], [7] * 10)  # 121 ids: 7 blocks and 9
    h1 = block_hashes(turn1, 16)
    short, long_ = [2000, 2001, EOS], list(range(2000, 2040)) + [EOS]  # 2 ids computed: no block filled; 40: 3

    def turn2(reply):
        p = chat_turn(turn1 + reply + [NL], [8] * 6)
        return p, block_hashes(p, 16)

    idx = BlockIndex()
    idx.expect(h1, 0.0)  # the prompt sent there (Proxy._attach)
    for reply in (short, long_):
        p, h = turn2(reply)
        assert not idx.history(h, idx.match(h, 0.0), p, 16)  # no stream ended here yet
    idx.expect_reply(turn1, h1, short, 16, "", 0.5)
    p, h = turn2(short)
    n = idx.match(h, 0.6)
    assert n == len(h1) and idx.history(h, n, p, 16)  # it goes on with the 9 + 2 ids past its 7 blocks
    other = chat_turn(turn1 + [2000, 2009, EOS] + [NL], [8] * 6)  # another reply after the same prompt
    assert not idx.history(block_hashes(other, 16), n, other, 16)
    shared = chat_turn([1, 299] + list(range(1000, 1100)) + [EOS, NL], [9] * 10)  # another user's question
    assert not idx.history(block_hashes(shared, 16), idx.match(block_hashes(shared, 16), 0.6), shared, 16)

    idx = BlockIndex()  # the long reply's conversation, on a replica of its own
    idx.expect(h1, 0.6)
    idx.expect_reply(turn1, h1, long_, 16, "", 0.7)
    filled = reply_hashes(turn1, h1, long_, 16, "")
    p, h = turn2(long_)
    n = idx.match(h, 0.8)
    assert n == len(h1) + len(filled) == 10 and idx.history(h, n, p, 16)
    # The template renders the reply back into other ids from its 30th on: the match ends
    # in the blocks the reply filled, still this conversation's.
    again = chat_turn(turn1 + long_[:29] + [5000] + long_[30:] + [NL], [8] * 6)
    ha = block_hashes(again, 16)
    assert idx.match(ha, 0.8) == 9 and idx.history(ha, 9, again, 16)
    idx.apply(KvEvents(stored=h1 + filled))  # confirmed: still marked
    assert idx.history(h, idx.match(h, 100.0), p, 16)
    idx.apply(KvEvents(removed=filled[-1:]))  # evicted: the match ends a block earlier, in the reply still
    assert idx.match(h, 100.0) == 9 and idx.history(h, 9, p, 16)
    idx.apply(KvEvents(removed=filled[:1]))  # the reply's first block too: only the prompt's are left
    n = idx.match(h, 100.0)
    assert n == len(h1) and not idx.history(h, n, p, 16)
    idx.apply(KvEvents(cleared=True))  # the replica's cache was cleared: no marks left
    assert not idx.replies and not idx.ends
    idx.expect_reply(turn1, h1, long_, 16, "", 101.0)
    idx.reset()
    assert not idx.replies and not idx.ends


def test_a_new_conversation_goes_where_fewer_conversations_are_not_where_none_is_running():
    """a holds two conversations, one of them in a turn; b and c four each, all between
    turns (load 0). By load alone the new conversation would go to b or c, and, as
    conversations stay home, a replica idle this instant collects them (12 placed
    2/4/6 in a bench run); it goes to a, which holds the fewest blocks, while a is
    under its bound."""
    reps = Replicas()
    for r, convs in (("a", 2), ("b", 4), ("c", 4)):
        for k in range(convs):
            reps.index[r].expect(block_hashes(chat_turn([1, 299, ord(r), k] + [40 + k] * 90, [7] * 5), 16), 0.0)
    prompt = chat_turn([1, 299, 500] + [80] * 90, [7] * 5)
    key = str(block_hashes(prompt, 16)[0])
    reps.load.update(a=1.0, b=0.0, c=0.0)  # L = 1: bound max(ceil(1.1 x 2 / 3), 2) = 2
    d = pick_prefix(len(prompt), 16, reps.cands(prompt), CFG, key=key)
    assert (d.replica, d.reason) == ("a", LOAD)
    reps.load.update(a=2.0)  # at its bound: the least loaded of the rest
    d = pick_prefix(len(prompt), 16, reps.cands(prompt), CFG, key=key)
    assert d.replica in ("b", "c") and d.reason == LOAD


def test_a_later_turns_home_is_the_one_replica_holding_it_deepest():
    """`mark_home`: from the match lengths every proxy sees alike (KV events), not from where
    one proxy sent the previous turn."""
    system = {"role": "system", "content": "s"}
    assert not later_turn([system, {"role": "user", "content": "q"}], "sess")  # a chat's first turn
    assert later_turn([system, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                       {"role": "user", "content": "q2"}], None)
    assert later_turn(None, "sess") and not later_turn(None, None)  # a plain prompt: its session says so

    def homes(cached: list[int], later: bool = True) -> list[str]:
        cands = [Candidate(r, 0.0, n) for r, n in zip("abc", cached)]
        mark_home(cands, later)
        return [c.id for c in cands if c.history]

    assert homes([9, 2, 2]) == ["a"]  # its history on a, the shared system prompt everywhere
    assert homes([9, 2, 2], later=False) == []  # a first turn has no home
    assert homes([9, 9, 2]) == []  # as deep on two (a spill's copy, a shared prompt): the load decides
    assert homes([0, 0, 0]) == []  # held nowhere
    # Routed on it: a home over the tight bound but within the spill bound keeps the turn.
    cands = [Candidate("a", 3.0, 9), Candidate("b", 0.0, 2), Candidate("c", 0.0, 2)]
    mark_home(cands, True)
    assert Router().route(cands, 160, 16).replica == "a"
