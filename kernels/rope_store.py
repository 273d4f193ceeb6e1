"""Rotary embedding and the KV store in one kernel: a decode step's two launches per layer as one.

A plain decode step runs, per layer, `apply_rotary` (kernels/rotary.py) then
`store_kvcache` (kernels/store_kv.py): two tiny launches over the same B tokens,
the second rereading the keys the first just wrote. Here one program per token
reads its position's [cos | sin] row once, rotates its q heads in place, and writes
its rotated keys and its values straight into their pool slot, so the rotated k
never goes back to memory. Same math and layouts as the two it replaces (slot -1:
not stored; the pool's dtype, bf16/fp16/fp32). The int8 pool (the C++ CPU step's,
kernels/paged.py) is refused: the Triton store does not quantize either.
Chosen by `kernels.ops(..., fused_decode=True)`.
"""

import torch

from kernels._triton import tl, triton
from kernels.rotary import _cos_sin, _rotate_heads, apply_rotary_ref
from kernels.store_kv import store_kvcache_ref


def rope_store_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping):
    """q (T, H, D) rotated in place and returned; k (T, Hkv, D) rotated (into a copy: k
    itself is left as it was) and stored with v (T, Hkv, D) into k_cache, v_cache
    (num_blocks, block_size, Hkv, D) at slot_mapping (T,) int64 (-1: not stored);
    positions (T,) int64 rows of cos_sin_cache (max_pos, D) fp32 [cos | sin]."""
    k = k.clone()
    apply_rotary_ref(q, k, positions, cos_sin_cache)
    store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping)
    return q


@triton.jit
def _rope_store_kernel(
    q_ptr,  # (T, H, D) queries, rotated in place
    k_ptr,  # (T, Hkv, D) new keys, read only (rotated on their way to the pool)
    v_ptr,  # (T, Hkv, D) new values, read only
    pos_ptr,  # (T,) int64 positions
    cache_ptr,  # (max_pos, D) fp32 [cos | sin]
    k_pool_ptr,  # key pool viewed as (num_blocks * block_size, Hkv, D)
    v_pool_ptr,  # value pool, same layout as k_pool_ptr
    slot_ptr,  # (T,) int64 destination slot per token; -1 = not stored
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache,
    stride_ps,  # pool stride between slots
    stride_ph,  # pool stride between kv heads
    H,
    HKV,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    slot = tl.load(slot_ptr + t)
    cos, sin = _cos_sin(cache_ptr, pos, stride_cache, HALF, BLOCK_HALF)
    i = tl.arange(0, BLOCK_HALF)[None, :]
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, H, cos, sin, HALF, BLOCK_H, BLOCK_HALF)

    h = tl.arange(0, BLOCK_HKV)[:, None]
    mask = (h < HKV) & (i < HALF) & (h * 0 + slot >= 0)  # (interpreter: no scalar-bool broadcast)
    src_k = k_ptr + t * stride_kt + h * stride_kh + i
    src_v = v_ptr + t * stride_vt + h * stride_vh + i
    dst = slot * stride_ps + h * stride_ph + i
    x1 = tl.load(src_k, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_k + HALF, mask=mask, other=0.0).to(tl.float32)
    # Rounded to k's dtype first, as apply_rotary's in-place write does, then to the pool's.
    k_ty = k_ptr.dtype.element_ty
    pool_ty = k_pool_ptr.dtype.element_ty
    tl.store(k_pool_ptr + dst, (x1 * cos - x2 * sin).to(k_ty).to(pool_ty), mask=mask)
    tl.store(k_pool_ptr + dst + HALF, (x2 * cos + x1 * sin).to(k_ty).to(pool_ty), mask=mask)
    tl.store(v_pool_ptr + dst, tl.load(src_v, mask=mask).to(pool_ty), mask=mask)
    tl.store(v_pool_ptr + dst + HALF, tl.load(src_v + HALF, mask=mask).to(pool_ty), mask=mask)


def rope_store_triton(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping):
    """Same contract as rope_store_ref; one program per token (q's heads, then k's and v's)."""
    t, h, d = q.shape
    hkv = k.shape[1]
    if k_cache.dtype == torch.int8:
        raise ValueError("rope_store_triton: an int8 KV pool (the C++ CPU step's) is not served by the Triton "
                         "kernels; use a bf16/fp16/fp32 pool, or kernels.ops(..., fused_decode=False) on CPU")
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1, \
        "last dim must be contiguous"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(0) == k_cache.shape[1] * k_cache.stride(1)
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.shape[1] == d and cos_sin_cache.stride(1) == 1
    assert d % 2 == 0 and k_cache.shape[3] == d
    if t > 0:
        half = d // 2
        _rope_store_kernel[(t,)](
            q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
            k_cache.stride(1), k_cache.stride(2), h, hkv,
            HALF=half, BLOCK_H=triton.next_power_of_2(h), BLOCK_HKV=triton.next_power_of_2(hkv),
            BLOCK_HALF=triton.next_power_of_2(half), num_warps=4,
        )  # fmt: skip
    return q


def bench(t: int = 64, heads: int = 32, kv_heads: int = 8, head_dim: int = 128, device: str = "cuda") -> None:
    """GB/s of the fused kernel against rotary + store, bf16 (python -m kernels.rope_store on a GPU)."""
    from kernels.rotary import apply_rotary_triton, build_cos_sin_cache
    from kernels.store_kv import store_kvcache_triton

    cache = build_cos_sin_cache(1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim), 4096).to(device)
    qkv = torch.randn(t, heads + 2 * kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    pool = torch.zeros(2, 1024, 16, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    pos = torch.randint(0, 4096, (t,), device=device)
    slots = torch.randperm(1024 * 16, device=device)[:t]
    # q read and written, k and v read, k and v written: the bytes either way must move.
    moved = (2 * heads + 4 * kv_heads) * head_dim * 2 * t

    def two():
        apply_rotary_triton(q, k, pos, cache)
        store_kvcache_triton(k, v, pool[0], pool[1], slots)

    for name, fn in (("rotary + store", two), ("rope_store", lambda: rope_store_triton(q, k, v, pos, cache, pool[0],
                                                                                        pool[1], slots))):
        ms = triton.testing.do_bench(fn)
        print(f"{name}: {ms * 1e3:.1f} us, {moved / ms / 1e6:.1f} GB/s")


if __name__ == "__main__":
    bench()
