"""Scatter of new k/v into the paged pool against its reference."""

import pytest
import torch

from kernels.store_kv import store_kvcache_ref
from tests.kernels.pool import DEVICES, DTYPES, triton_ops


def _run(device, dtype, kv_heads, head_dim, slots, src=None):
    t = len(slots)
    shape = (4, 16, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)  # poison: untouched slots stay NaN
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    if src is None:  # k/v as slices of one fused qkv output (non-contiguous rows)
        qkv = torch.randn(t, 5 * kv_heads, head_dim, device=device).to(dtype)
        src = qkv[:, 3 * kv_heads : 4 * kv_heads], qkv[:, 4 * kv_heads :]
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    triton_ops(device).store_kvcache(*src, k_cache, v_cache, slot_mapping)
    store_kvcache_ref(*src, k_ref, v_ref, slot_mapping)
    # a copy: exact, and every slot not in slot_mapping untouched
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0, equal_nan=True)
    written = torch.zeros(64, dtype=torch.bool)
    written[[s for s in slots if s >= 0]] = True
    assert torch.isfinite(k_cache.view(64, -1)[written]).all() and torch.isnan(k_cache.view(64, -1)[~written]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads", [1, 3, 8])
def test_matches_reference(device, dtype, kv_heads):
    # slots at block starts/ends, across blocks, the last slot, and -1 (skip)
    _run(device, dtype, kv_heads, 64, [0, 15, 16, 17, -1, 47, 63, 5, -1])


@pytest.mark.parametrize("device", DEVICES)
def test_odd_head_dim_and_cast(device):
    """head_dim 40 (not a power of two); fp32 k/v stored into an fp16 pool."""
    k, v = torch.randn(3, 2, 40, device=device), torch.randn(3, 2, 40, device=device)
    _run(device, torch.float16, 2, 40, [62, -1, 1], src=(k, v))


def test_the_reference_stores_int8_rows_and_the_references_read_them():
    """An int8 pool (the C++ step's, kernels/paged.py): each stored (token, kv head) row is
    quantize_kv_ref of it, other slots untouched; the attention references read the values back."""
    from kernels.decode_attention import paged_decode_attention_ref
    from kernels.paged import attend_ref, dequantize_kv_ref, gather_kv, quantize_kv_ref

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(5, 3, 64, generator=g), torch.randn(5, 3, 64, generator=g)
    k_cache = torch.zeros(4, 16, 3, 68, dtype=torch.int8)
    v_cache = torch.zeros(4, 16, 3, 68, dtype=torch.int8)
    slots = torch.tensor([3, 17, -1, 18, 40])
    store_kvcache_ref(k, v, k_cache, v_cache, slots)
    keep = slots >= 0
    assert torch.equal(k_cache.view(64, 3, 68)[slots[keep]], quantize_kv_ref(k[keep]))
    assert torch.equal(v_cache.view(64, 3, 68)[slots[keep]], quantize_kv_ref(v[keep]))
    assert (k_cache.view(64, -1).ne(0).any(-1).nonzero().flatten() == torch.tensor([3, 17, 18, 40])).all()
    table = torch.tensor([1, 2], dtype=torch.int32)  # positions 0..2: slots 16, 17, 18
    kk, vv = gather_kv(k_cache, v_cache, table, 3)
    assert torch.equal(kk[1:], dequantize_kv_ref(quantize_kv_ref(k[[1, 3]])))
    assert (kk[1:] - k[[1, 3]]).abs().max() <= k.abs().max() / 254 * 1.001
    q = torch.randn(1, 6, 64, generator=g)
    out = paged_decode_attention_ref(q, k_cache, v_cache, table[None], torch.tensor([3], dtype=torch.int32), 0.125)
    torch.testing.assert_close(out, attend_ref(q, kk, vv, torch.ones(1, 3, dtype=torch.bool), 0.125))
