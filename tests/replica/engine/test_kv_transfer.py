"""The engine's KV export and import (replica.engine.kv_transfer) on the tiny model: blocks read
from one engine and cached into another are hit by the next request with that prefix, which
then decodes what the first engine decodes; a failed or refused import registers nothing."""

import pytest

from wire import protocol as P
from wire.hashing import block_hashes
from replica.engine.kv_transfer import KvTransfer
from tests.replica.engines import make_engine, prompts, run

GREEDY = P.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def generate(engine, rid, ids):
    assert engine.add(P.Generate(id=rid, prompt_ids=ids, sampling=GREEDY)) is None
    toks, fins = run(engine)
    return toks[rid], fins[rid].usage.cached_tokens


def test_blocks_moved_to_another_engine_are_hit_and_decode_the_same():
    a, _, w = make_engine()
    b, _, _ = make_engine(w=w)
    ka, kb = KvTransfer(a), KvTransfer(b)
    assert ka.spec == kb.spec and ka.spec.block_bytes == a.runner.block_nbytes()
    ids = prompts([70])["s0"]  # 4 full blocks of 16
    first, _ = generate(a, "a0", ids)
    again, cached = generate(a, "a1", ids)  # A's own cache hit: what B must reproduce
    assert cached == 64 and again == first
    hashes = block_hashes(ids, 16)
    got = ka.read(P.KvRead(id="r", hashes=hashes + [12345]))  # stops at the first hash not cached
    assert got.hashes == hashes and len(got.data) == 4 * ka.spec.block_bytes
    b.kv_events()
    written = kb.write(P.KvBlocks(id="w", hashes=got.hashes, data=got.data, ids=ids[:64]))
    assert (written.stored, written.present, written.error) == (4, 0, "")
    assert b.kv_events().stored == hashes  # imported blocks are announced as stored
    assert b.blocks.num_free == b.blocks.num_blocks  # cached free blocks: ref count 0
    b.blocks.check_invariants()
    # B can hand them on in turn: listed as a hot chain from its first block, with their ids and seed
    assert kb.hot(P.KvHot(id="h", max_blocks=8)).chains == [P.KvChain(0, ids[:64])]
    out, cached = generate(b, "b0", ids)
    assert cached == 64 and out == again
    assert kb.write(P.KvBlocks(id="w2", hashes=got.hashes, data=got.data, ids=ids[:64])).present == 4  # nothing twice


def test_an_import_that_does_not_fit_or_is_malformed_registers_nothing():
    a, _, w = make_engine()
    b, _, _ = make_engine(w=w, num_blocks=3)
    ka, kb = KvTransfer(a), KvTransfer(b)
    ids = prompts([70])["s0"]
    generate(a, "a0", ids)
    got = ka.read(P.KvRead(id="r", hashes=block_hashes(ids, 16)))
    short = kb.write(P.KvBlocks(id="w", hashes=got.hashes, data=got.data[:-1]))
    assert "bytes for 4 blocks" in short.error and short.stored == 0
    unnamed = kb.write(P.KvBlocks(id="w", hashes=got.hashes, data=got.data, ids=ids[:63]))
    assert "63 token ids for 4 blocks" in unnamed.error and unnamed.stored == 0
    full = kb.write(P.KvBlocks(id="w", hashes=got.hashes, data=got.data, ids=ids[:64]))
    assert "no room" in full.error and full.stored == 0
    assert b.kv_events() is None and b.blocks.num_free == 3
    b.blocks.check_invariants()


def test_a_write_that_fails_gives_its_blocks_back(monkeypatch):
    a, _, w = make_engine()
    b, _, _ = make_engine(w=w)
    ids = prompts([40])["s0"]
    generate(a, "a0", ids)
    got = KvTransfer(a).read(P.KvRead(id="r", hashes=block_hashes(ids, 16)))
    kb = KvTransfer(b)

    def broken(ids, data):
        raise RuntimeError("device lost")

    monkeypatch.setattr(b.runner, "write_blocks", broken)
    with pytest.raises(RuntimeError):
        kb.write(P.KvBlocks(id="w", hashes=got.hashes, data=got.data, ids=ids[:32]))
    assert b.kv_events() is None and b.blocks.num_free == b.blocks.num_blocks
    b.blocks.check_invariants()


def test_specs_name_what_differs():
    a, _, w = make_engine()
    b, _, _ = make_engine(w=w, block_size=32)
    problem = KvTransfer(a).spec.mismatch(KvTransfer(b).spec)
    assert "block_size 16 here, 32 there" in problem and "block_bytes" in problem
    other, _, _ = make_engine(w={k: v + 1 for k, v in w.items()})
    assert "model" in KvTransfer(a).spec.mismatch(KvTransfer(other).spec)  # same shapes, other weights
