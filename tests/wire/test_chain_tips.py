"""wire.hashing.ChainTips: the chains a set of chained block hashes holds (Load.chains)."""

from wire.hashing import ChainTips, block_hashes, salt_seed


def chain(ids: list[int], salt: str = "") -> list[tuple[int, int]]:
    hs = block_hashes(ids, 4, salt)
    return list(zip(hs, [salt_seed(salt)] + hs[:-1]))


def test_a_chain_extended_is_one_a_branch_is_two():
    t = ChainTips()
    for h, p in chain(list(range(12))):
        t.add(h, p)
    assert t.tips == 1
    for h, p in chain(list(range(16))):  # the next turn: the same blocks and one more
        t.add(h, p)
    assert t.tips == 1
    for h, p in chain(list(range(8)) + [7] * 8):  # a branch after two shared blocks
        t.add(h, p)
    assert t.tips == 2
    for h, p in chain(list(range(16)), salt="tenant"):  # another tenant's copy: a chain of its own
        t.add(h, p)
    assert t.tips == 3


def test_removal_in_any_order_keeps_the_count():
    t, hs = ChainTips(), chain(list(range(16)))
    for h, p in hs:
        t.add(h, p)
    t.remove(hs[-1][0])  # the tip: its parent is the tip now
    assert t.tips == 1
    t.remove(hs[1][0])  # from the middle: two pieces
    assert t.tips == 2
    t.add(*hs[1])  # back: one chain again
    assert t.tips == 1
    for h, _ in hs:
        t.remove(h)
    t.remove(hs[0][0])  # a hash not held: nothing
    assert (t.tips, t.parent, t.children) == (0, {}, {})
    for h, p in reversed(hs):  # children before their parents (an import's frames out of order)
        t.add(h, p)
    assert t.tips == 1
