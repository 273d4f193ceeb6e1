"""New conversations placed by several proxies of one region at once (issue 44): each
proxy's view is its own prefix indexes, fed the same KV events, and the replicas' loads;
no sockets. The tie band (`routing.fewest_held`) spreads simultaneous placements by
their keys; a replica clearly emptier still takes them all."""

from collections import Counter

from edge_proxy.prefix_index import BlockIndex
from edge_proxy.routing import LOAD, Candidate, Router, fewest_held, rendezvous_order
from wire.hashing import block_hashes
from wire.protocol import KvEvents

BS = 16
IDS = ("a", "b", "c")


def conversation(k: int, blocks: int) -> list[int]:
    """A prompt of its own (a system prompt no other conversation shares), `blocks` full blocks long."""
    return [1, 299, 10_000 + k] + [20_000 + k] * (blocks * BS - 3)


class ProxyView:
    """One proxy process: a prefix index per replica, fed the replicas' KV events (alike on
    every proxy) and its own expectations, and the loads as the replicas report them."""

    def __init__(self, held: dict[str, int], loads: dict[str, float]):
        self.index = {r: BlockIndex() for r in IDS}
        for i, (r, idx) in enumerate(self.index.items()):
            idx.apply(KvEvents(cleared=True))
            idx.apply(KvEvents(stored=block_hashes(conversation(1000 + i, held[r]), BS)))
        self.load = dict(loads)
        self.router = Router()

    def place(self, prompt: list[int], key: str) -> str:
        hashes = block_hashes(prompt, BS)
        cands = [Candidate(r, self.load[r], idx.match(hashes, 0.0), held_blocks=len(idx))
                 for r, idx in self.index.items()]  # as Proxy._candidates builds them
        d = self.router.route(cands, len(prompt), BS, key=str(hashes[0]), session_key=key)
        assert d.reason == LOAD and d.cached_blocks == 0
        self.index[d.replica].expect(hashes, 0.0)  # Proxy._attach: its own placement, seen at once
        self.load[d.replica] += 1  # ... and counted in its load (`effective_load`)
        return d.replica


def test_two_proxies_spread_simultaneous_new_sessions_over_the_tie_band():
    """a holds 40 blocks, b 44, c 70; a new conversation's prompt is 12 blocks, so a and b
    tie (b holds less than a prompt more than a), c does not. Two proxies place a new
    session each at the same instant, neither seeing the other's: the pair splits over a
    and b by their keys, where "the fewest blocks" sent both to a; every proxy places one
    key alike."""
    held, loads = {"a": 40, "b": 44, "c": 70}, {"a": 1.0, "b": 1.0, "c": 1.0}
    assert [c.id for c in fewest_held([Candidate(r, 1.0, held_blocks=n) for r, n in held.items()], 12)] == ["a", "b"]
    split, where = 0, Counter()
    for i in range(40):
        p, q = ProxyView(held, loads), ProxyView(held, loads)  # the same reports, two processes
        x = p.place(conversation(2 * i, 12), f"k/s{2 * i}")
        y = q.place(conversation(2 * i + 1, 12), f"k/s{2 * i + 1}")
        assert x == rendezvous_order(f"k/s{2 * i}", ["a", "b"])[0]  # the key's draw over the band
        assert ProxyView(held, loads).place(conversation(2 * i, 12), f"k/s{2 * i}") == x  # any proxy: alike
        split += x != y
        where.update((x, y))
    assert set(where) == {"a", "b"} and where["a"] >= 20 and where["b"] >= 20, where
    assert split >= 10, split  # independent draws over two replicas: about half the pairs split


def test_a_replica_clearly_emptier_takes_every_new_conversation():
    """a holds 20 blocks, b and c 40: more than a 12-block prompt apart. Whatever the key,
    and with a running one request more than the others (under its bound), a takes it."""
    held, loads = {"a": 20, "b": 40, "c": 40}, {"a": 1.0, "b": 0.0, "c": 0.0}
    for i in range(30):
        assert ProxyView(held, loads).place(conversation(i, 12), f"k/s{i}") == "a"


def test_within_the_band_the_least_loaded_takes_it():
    """a holds 40 blocks with a request running, b 44 with none: b, for every key (c, idle
    too, holds a prompt's worth more than a: not in the band)."""
    held, loads = {"a": 40, "b": 44, "c": 70}, {"a": 1.0, "b": 0.0, "c": 0.0}
    for i in range(30):
        assert ProxyView(held, loads).place(conversation(i, 12), f"k/s{i}") == "b"


def test_one_proxys_burst_of_new_conversations_still_spreads_evenly():
    """Six new conversations through one proxy at once, each prompt a block longer than the
    last (so the replica just given one is still within the band of the next): its own
    placements count in its load at once, and they go 2/2/2."""
    view = ProxyView({"a": 0, "b": 0, "c": 0}, {"a": 0.0, "b": 0.0, "c": 0.0})
    placed = Counter(view.place(conversation(k, 10 + k), f"k/s{k}") for k in range(6))
    assert placed == {"a": 2, "b": 2, "c": 2}


def test_new_conversations_go_where_fewer_conversations_are_not_fewer_blocks():
    """a holds 3 short conversations (30 blocks), b 2 long ones (44 blocks), c 3 (40): where every
    replica reports its chains, b takes the new one, whatever the key (by blocks it went to a,
    which then held 4 to b's 2); two tied on chains split by load, then by key."""
    chains, held = {"a": 3, "b": 2, "c": 3}, {"a": 30, "b": 44, "c": 40}
    for i in range(30):
        cands = [Candidate(r, 0.0, held_blocks=held[r], chains=chains[r]) for r in IDS]
        assert Router().route(cands, 12 * BS, BS, key=f"k{i}").replica == "b"
    chains = {"a": 2, "b": 2, "c": 3}
    cands = [Candidate(r, 1.0 if r == "a" else 0.0, held_blocks=held[r], chains=chains[r]) for r in IDS]
    assert [c.id for c in fewest_held(cands, 12)] == ["a", "b"]
    assert all(Router().route(cands, 12 * BS, BS, key=f"k{i}").replica == "b" for i in range(30))
    # one replica that reports none (an older one): every replica compared by blocks, as before
    cands = [Candidate(r, 0.0, held_blocks=held[r], chains=-1 if r == "c" else chains[r]) for r in IDS]
    assert [c.id for c in fewest_held(cands, 12)] == ["a", "c"]  # b holds a prompt more than a
