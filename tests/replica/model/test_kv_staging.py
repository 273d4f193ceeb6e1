"""replica.model.kv_staging, the CUDA path of a KV transfer, run on CPU (`pin=False`): its bytes
are the CPU path's (Runner.read_blocks: each block's views copied straight in), block for block
and pool after pool, and what it writes reads back the same; with a draft head's layer beside
the pool, and with an int8 pool."""

from __future__ import annotations

import torch

from replica.model.kv_staging import KvStaging
from tests.replica.engines import make_engine


def reference(pools, ids) -> bytes:
    """The travel layout spelled out: per block, each pool's view of it, in order."""
    return b"".join(t.select(d, b).contiguous().view(torch.uint8).numpy().tobytes() for b in ids for t, d in pools)


def block_bytes(pools) -> int:
    return sum(t.select(d, 0).numel() * t.element_size() for t, d in pools)


def test_a_runners_blocks_read_and_written_as_the_cpu_path_does():
    engine, _, _ = make_engine()
    runner = engine.runner
    g = torch.Generator().manual_seed(0)
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=g).to(runner.kv_cache.dtype))
    ids = [5, 2, 9]
    direct = bytearray(len(ids) * runner.block_nbytes())
    runner.read_blocks(ids, direct)
    staged = bytearray(len(direct))
    KvStaging(pin=False).read(runner.kv_pools(), ids, torch.frombuffer(staged, dtype=torch.uint8))
    assert staged == direct == reference(runner.kv_pools(), ids)
    others = [30, 31, 40]
    KvStaging(pin=False).write(runner.kv_pools(), others, torch.frombuffer(bytearray(direct), dtype=torch.uint8))
    again = bytearray(len(direct))
    runner.read_blocks(others, again)
    assert again == direct
    assert torch.equal(runner.kv_cache[:, :, 30], runner.kv_cache[:, :, 5])


def test_two_pools_and_an_int8_pool_travel_in_order():
    g = torch.Generator().manual_seed(1)
    main = torch.randint(-128, 128, (3, 2, 12, 4, 2, 10), generator=g, dtype=torch.int8)  # int8 rows: D + 4
    draft = torch.randn(2, 12, 4, 1, 8, generator=g, dtype=torch.float32)
    pools = [(main, 2), (draft, 1)]
    ids = [11, 0, 7, 3]
    stage = KvStaging(pin=False)
    out = torch.empty(len(ids) * block_bytes(pools), dtype=torch.uint8)
    stage.read(pools, ids, out)
    assert out.numpy().tobytes() == reference(pools, ids)
    copy = [(torch.zeros_like(main), 2), (torch.zeros_like(draft), 1)]
    stage.write(copy, ids, out.clone())
    assert reference(copy, ids) == reference(pools, ids)
    untouched = [b for b in range(12) if b not in ids]
    assert not copy[0][0][:, :, untouched].any() and not copy[1][0][:, untouched].any()
    small = torch.empty(block_bytes(pools), dtype=torch.uint8)  # the staging buffer, made for 4, serves 1
    stage.read(pools, [7], small)
    assert small.numpy().tobytes() == reference(pools, [7])
