"""Write the new tokens' keys and values into their slots of the paged KV pool.

Every forward stores its k/v before attention reads them, so this runs once per
layer per step; it is a pure scatter (bandwidth bound). slot = block_id *
block_size + offset; slot -1 marks a token whose k/v must not be stored (padding
of a CUDA-graph batch).
"""

import torch

from kernels._triton import tl, triton
from kernels.paged import to_pool


def store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping) -> None:
    """k, v (T, Hkv, D) -> k_cache, v_cache (num_blocks, block_size, Hkv, D) in place
    (an int8 pool: rows of D + 4, quantized as kernels.paged.quantize_kv_ref says)."""
    num_blocks, block_size, hkv, d = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(num_blocks * block_size, hkv, d)[slots] = to_pool(k[keep], k_cache.dtype)
    v_cache.view(num_blocks * block_size, hkv, d)[slots] = to_pool(v[keep], v_cache.dtype)


@triton.jit
def _store_kvcache_kernel(
    k_ptr,  # (T, Hkv, D) new keys; rows strided by stride_kt, heads by stride_kh
    v_ptr,  # (T, Hkv, D) new values
    k_cache_ptr,  # key pool viewed as (num_blocks * block_size, Hkv, D)
    v_cache_ptr,  # value pool, same layout as k_cache_ptr
    slot_ptr,  # (T,) int64 destination slot per token; -1 = skip
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,  # cache stride between slots
    stride_ch,  # cache stride between heads
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < HKV) & (d < D) & (h * 0 + slot >= 0)  # (interpreter: no scalar-bool broadcast)
    dst = slot * stride_cs + h * stride_ch + d
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache_triton(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Same contract as store_kvcache_ref; one program per token."""
    t, hkv, d = k.shape
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1, "last dim must be contiguous"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(0) == k_cache.shape[1] * k_cache.stride(1)
    if t == 0:
        return
    block_h, block_d = triton.next_power_of_2(hkv), triton.next_power_of_2(d)
    _store_kvcache_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(1), k_cache.stride(2),
        HKV=hkv, D=d, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=max(1, min(8, block_h * block_d // 256)),
    )  # fmt: skip
