"""Varlen extend (chunked prefill over a cached prefix) attention against its reference."""

import pytest
import torch

from kernels.extend_attention import paged_extend_attention_ref
from tests.kernels.pool import (
    ATTENTION_TOL, DEVICES, DTYPES, assert_close, cu_seqlens, make_pool, needs_gpu, triton_ops,
)  # fmt: skip

# (total keys, new queries) per sequence: whole prompts, chunks after a prefix,
# one-token extends, an empty sequence, lengths at/below/across the 16-token block
# and the 16/32/64-query and 64-key tiles.
CASES = [(17, 17), (40, 3), (16, 0), (65, 65), (130, 33), (64, 1), (15, 15)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (3, 1), (8, 1)])  # GQA ratios 1, 3, 8
def test_matches_reference(device, dtype, heads, kv_heads):
    torch.manual_seed(0)
    lens = [n for n, _ in CASES]
    q_lens = [m for _, m in CASES]
    k_cache, v_cache, block_tables = make_pool(lens, kv_heads, 32, 16, dtype, device)
    q = torch.randn(sum(q_lens), heads, 32, device=device).to(dtype)
    cu = cu_seqlens(q_lens, device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    out = triton_ops(device).paged_extend_attention(q, k_cache, v_cache, block_tables, cu, seq_lens, 0.17)
    ref = paged_extend_attention_ref(q, k_cache, v_cache, block_tables, cu, seq_lens, 0.17)
    assert_close(out, ref, dtype, ATTENTION_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_lens", [[1] * 9, [5, 70], [100]])  # 16-, 32- and 64-row query tiles
def test_tile_heights(device, q_lens):
    lens = [m + 11 for m in q_lens]
    k_cache, v_cache, block_tables = make_pool(lens, 2, 48, 8, torch.float32, device)
    q = torch.randn(sum(q_lens), 6, 48, device=device)
    cu = cu_seqlens(q_lens, device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    out = triton_ops(device).paged_extend_attention(q, k_cache, v_cache, block_tables, cu, seq_lens, 0.2)
    ref = paged_extend_attention_ref(q, k_cache, v_cache, block_tables, cu, seq_lens, 0.2)
    assert_close(out, ref, torch.float32, ATTENTION_TOL)


@pytest.mark.gpu
@needs_gpu
def test_long_prefill_gpu():
    lens, q_lens = [8192, 3000, 600], [2048, 3000, 1]
    k_cache, v_cache, block_tables = make_pool(lens, 8, 128, 16, torch.bfloat16, "cuda")
    q = torch.randn(sum(q_lens), 32, 128, device="cuda").bfloat16()
    cu = cu_seqlens(q_lens, "cuda")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = triton_ops("cuda").paged_extend_attention(q, k_cache, v_cache, block_tables, cu, seq_lens, 128**-0.5)
    ref = paged_extend_attention_ref(q, k_cache, v_cache, block_tables, cu, seq_lens, 128**-0.5)
    assert_close(out, ref, torch.bfloat16, ATTENTION_TOL)
