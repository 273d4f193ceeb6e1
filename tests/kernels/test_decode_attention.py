"""Split-K paged decode attention (Triton, interpreter on CPU) against its reference."""

import pytest
import torch

from kernels.decode_attention import _decode, paged_decode_attention_ref
from tests.kernels.pool import ATTENTION_TOL, DEVICES, DTYPES, assert_close, make_pool, needs_gpu, triton_ops

# Block size 16 and the kernel's 64-key tile: lengths at, below and across both.
LENS = [1, 15, 16, 17, 63, 64, 65, 130]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 1)])  # GQA ratios 1, 3, 8
def test_matches_reference(device, dtype, heads, kv_heads):
    torch.manual_seed(0)
    k_cache, v_cache, block_tables = make_pool(LENS, kv_heads, 64, 16, dtype, device)
    q = torch.randn(len(LENS), heads, 64, device=device).to(dtype)
    seq_lens = torch.tensor(LENS, dtype=torch.int32, device=device)
    out = triton_ops(device).paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.125)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, 0.125)
    assert_close(out, ref, dtype, ATTENTION_TOL)


def test_reference_is_softmax_attention():
    """The reference against the textbook formula, one sequence and head at a time."""
    lens = [1, 20, 33]
    k_cache, v_cache, block_tables = make_pool(lens, 2, 8, 4, torch.float32, "cpu")
    q = torch.randn(3, 6, 8)
    out = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, torch.tensor(lens, dtype=torch.int32), 0.3)
    for b, n in enumerate(lens):
        for h in range(6):
            slots = [(int(block_tables[b, p // 4]), p % 4) for p in range(n)]
            k = torch.stack([k_cache[blk, off, h // 3] for blk, off in slots])  # (n, D)
            v = torch.stack([v_cache[blk, off, h // 3] for blk, off in slots])
            expected = torch.softmax(k @ q[b, h] * 0.3, dim=0) @ v
            torch.testing.assert_close(out[b, h], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
def test_split_k_merge(device, num_splits):
    """More splits than a short sequence has tiles leaves empty splits: weight 0."""
    lens = [3, 64, 200]
    k_cache, v_cache, block_tables = make_pool(lens, 2, 32, 16, torch.float32, device)
    q = torch.randn(3, 6, 32, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    out = _decode(q, k_cache, v_cache, block_tables, seq_lens, 0.2, num_splits)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, 0.2)
    assert_close(out, ref, torch.float32, ATTENTION_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_padding_rows_get_zeros(device):
    """CUDA-graph padding rows (seq_len 0, block table of zeros) attend to nothing: zeros."""
    lens = [0, 5, 0]
    k_cache, v_cache, block_tables = make_pool([5, 5, 5], 1, 16, 16, torch.float32, device)
    block_tables[0] = 0
    q = torch.randn(3, 2, 16, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    out = triton_ops(device).paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.25)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, 0.25)
    assert_close(out, ref, torch.float32, ATTENTION_TOL)
    assert (out[0] == 0).all() and (out[2] == 0).all()
    zero = torch.zeros(3, dtype=torch.int32, device=device)
    assert (paged_decode_attention_ref(q, k_cache, v_cache, block_tables, zero, 0.25) == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size,head_dim", [(5, 40), (1, 16)])
def test_odd_block_size_and_head_dim(device, block_size, head_dim):
    lens = [1, 9, 23]
    k_cache, v_cache, block_tables = make_pool(lens, 3, head_dim, block_size, torch.float16, device)
    q = torch.randn(3, 6, head_dim, device=device).half()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    out = triton_ops(device).paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.3)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, 0.3)
    assert_close(out, ref, torch.float16, ATTENTION_TOL)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("batch,context", [(1, 32768), (32, 4096)])
def test_long_context_gpu(batch, context):
    lens = [context - 7 * i for i in range(batch)]
    k_cache, v_cache, block_tables = make_pool(lens, 8, 128, 16, torch.bfloat16, "cuda")
    q = torch.randn(batch, 32, 128, device="cuda").bfloat16()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = triton_ops("cuda").paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 128**-0.5)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, 128**-0.5)
    assert_close(out, ref, torch.bfloat16, ATTENTION_TOL)
