"""The engine's KV export and import (replica.engine.kv_transfer) on the tiny model: blocks read
from one engine (into a KV slot, replica.kv_slots) and cached into another (from one) are hit by
the next request with that prefix, which then decodes what the first engine decodes; a failed or
refused import registers nothing."""

import pytest

from wire import protocol as P
from wire.hashing import block_hashes
from replica.engine.kv_transfer import KvTransfer
from replica.kv_slots import SLOT_BLOCKS, new_segment
from tests.replica.engines import make_engine, prompts, run

GREEDY = P.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def generate(engine, rid, ids):
    assert engine.add(P.Generate(id=rid, prompt_ids=ids, sampling=GREEDY)) is None
    toks, fins = run(engine)
    return toks[rid], fins[rid].usage.cached_tokens


def transfer(engine) -> KvTransfer:
    return KvTransfer(engine, new_segment())


def moved(ka: KvTransfer, kb: KvTransfer, got: P.KvBlocks, slot: int = 1) -> None:
    """What the API processes do between two engines: the read slot's bytes into a write slot."""
    n = len(got.hashes) * ka.spec.block_bytes
    kb.slots.view(slot, n)[:] = ka.slots.view(got.slot, n)


def test_blocks_moved_to_another_engine_are_hit_and_decode_the_same():
    a, _, w = make_engine()
    b, _, _ = make_engine(w=w)
    ka, kb = transfer(a), transfer(b)
    assert ka.spec == kb.spec and ka.spec.block_bytes == a.runner.block_nbytes()
    ids = prompts([70])["s0"]  # 4 full blocks of 16
    first, _ = generate(a, "a0", ids)
    again, cached = generate(a, "a1", ids)  # A's own cache hit: what B must reproduce
    assert cached == 64 and again == first
    hashes = block_hashes(ids, 16)
    got = ka.read(P.KvRead(id="r", hashes=hashes + [12345], slot=2))  # stops at the first hash not cached
    assert got.hashes == hashes and got.slot == 2 and not got.error
    moved(ka, kb, got)
    b.kv_events()
    written = kb.write(P.KvBlocks(id="w", hashes=got.hashes, slot=1, ids=ids[:64]))
    assert (written.stored, written.present, written.error) == (4, 0, "")
    assert b.kv_events().stored == hashes  # imported blocks are announced as stored
    assert b.blocks.num_free == b.blocks.num_blocks  # cached free blocks: ref count 0
    b.blocks.check_invariants()
    # B can hand them on in turn: listed as a hot chain from its first block, with their ids and seed
    assert kb.hot(P.KvHot(id="h", max_blocks=8)).chains == [P.KvChain(0, ids[:64])]
    out, cached = generate(b, "b0", ids)
    assert cached == 64 and out == again
    assert kb.write(P.KvBlocks(id="w2", hashes=got.hashes, slot=1, ids=ids[:64])).present == 4  # nothing twice


def test_an_import_that_does_not_fit_or_is_malformed_registers_nothing():
    a, _, w = make_engine()
    b, _, _ = make_engine(w=w, num_blocks=3)
    ka, kb = transfer(a), transfer(b)
    ids = prompts([70])["s0"]
    generate(a, "a0", ids)
    got = ka.read(P.KvRead(id="r", hashes=block_hashes(ids, 16), slot=0))
    moved(ka, kb, got)
    for bad in (-1, kb.slots.count):
        wrong = kb.write(P.KvBlocks(id="w", hashes=got.hashes, slot=bad, ids=ids[:64]))
        assert f"in KV slot {bad}" in wrong.error and wrong.stored == 0
    many = kb.write(P.KvBlocks(id="w", hashes=[1] * (SLOT_BLOCKS + 1), slot=1, ids=[0] * 16 * (SLOT_BLOCKS + 1)))
    assert f"slots of {SLOT_BLOCKS} blocks" in many.error and many.stored == 0
    assert "slots of" in ka.read(P.KvRead(id="r", hashes=block_hashes(ids, 16), slot=-1)).error
    unnamed = kb.write(P.KvBlocks(id="w", hashes=got.hashes, slot=1, ids=ids[:63]))
    assert "63 token ids for 4 blocks" in unnamed.error and unnamed.stored == 0
    full = kb.write(P.KvBlocks(id="w", hashes=got.hashes, slot=1, ids=ids[:64]))
    assert "no room" in full.error and full.stored == 0
    assert b.kv_events() is None and b.blocks.num_free == 3
    b.blocks.check_invariants()


def test_a_write_that_fails_gives_its_blocks_back(monkeypatch):
    a, _, w = make_engine()
    b, _, _ = make_engine(w=w)
    ids = prompts([40])["s0"]
    generate(a, "a0", ids)
    ka, kb = transfer(a), transfer(b)
    got = ka.read(P.KvRead(id="r", hashes=block_hashes(ids, 16), slot=0))
    moved(ka, kb, got)

    def broken(ids, data):
        raise RuntimeError("device lost")

    monkeypatch.setattr(b.runner, "write_blocks", broken)
    with pytest.raises(RuntimeError):
        kb.write(P.KvBlocks(id="w", hashes=got.hashes, slot=1, ids=ids[:32]))
    assert b.kv_events() is None and b.blocks.num_free == b.blocks.num_blocks
    b.blocks.check_invariants()


def test_specs_name_what_differs():
    a, _, w = make_engine()
    b, _, _ = make_engine(w=w, block_size=32)
    problem = transfer(a).spec.mismatch(transfer(b).spec)
    assert "block_size 16 here, 32 there" in problem and "block_bytes" in problem
    other, _, _ = make_engine(w={k: v + 1 for k, v in w.items()})
    assert "model" in transfer(a).spec.mismatch(transfer(other).spec)  # same shapes, other weights
