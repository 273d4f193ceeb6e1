"""Rotary position embedding, rotate-half (GPT-NeoX / HF Llama) style, in place.

For head vector x = [x1 | x2] (halves of D) at position p:
    x1' = x1 cos - x2 sin,   x2' = x2 cos + x1 sin,
with cos/sin = cos_sin_cache[p] = [cos(p * inv_freq) | sin(p * inv_freq)].
Llama-3 frequency scaling lives entirely in inv_freq, which the caller computes
(see replica model code) and passes to build_cos_sin_cache once.
"""

import torch

from kernels._triton import tl, triton


def build_cos_sin_cache(inv_freq: torch.Tensor, max_pos: int) -> torch.Tensor:
    """inv_freq (D/2,) -> (max_pos, D) fp32: [cos | sin] per position."""
    t = torch.arange(max_pos, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(t, inv_freq.float())  # (max_pos, D/2)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _rotate_ref(x, cos, sin):
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    x.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))


def apply_rotary_ref(q, k, positions, cos_sin_cache):
    """q (T, H, D), k (T, Hkv, D) rotated in place at positions (T,) int64; returns (q, k)."""
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache[positions]  # (T, D)
    cos, sin = cs[:, None, :half], cs[:, None, half:]  # (T, 1, D/2)
    _rotate_ref(q, cos, sin)
    _rotate_ref(k, cos, sin)
    return q, k


@triton.jit
def _cos_sin(cache_ptr, pos, stride_cache, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """The (1, BLOCK_HALF) fp32 cos and sin rows of position `pos` in the [cos | sin] cache."""
    i = tl.arange(0, BLOCK_HALF)[None, :]
    row = cache_ptr + pos * stride_cache + i
    return tl.load(row, mask=i < HALF, other=0.0), tl.load(row + HALF, mask=i < HALF, other=0.0)


@triton.jit
def _rotate_heads(
    x_ptr,  # first element of this token's (n_heads, D) block
    stride_h,
    n_heads,
    cos,  # (1, BLOCK_HALF) fp32
    sin,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < n_heads) & (i < HALF)
    p1 = x_ptr + h * stride_h + i
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # (T, H, D) queries, rotated in place
    k_ptr,  # (T, Hkv, D) keys, rotated in place
    pos_ptr,  # (T,) int64 positions
    cache_ptr,  # (max_pos, D) fp32 [cos | sin]
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cache,
    H,
    HKV,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    cos, sin = _cos_sin(cache_ptr, pos, stride_cache, HALF, BLOCK_HALF)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, H, cos, sin, HALF, BLOCK_H, BLOCK_HALF)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, HKV, cos, sin, HALF, BLOCK_HKV, BLOCK_HALF)


def apply_rotary_triton(q, k, positions, cos_sin_cache):
    """Same contract as apply_rotary_ref; one program per token rotates all its q and k heads."""
    t, h, d = q.shape
    hkv = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos_sin_cache.stride(1) == 1, "last dim must be contiguous"
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.shape[1] == d
    if t > 0:
        half = d // 2
        _rotary_kernel[(t,)](
            q, k, positions, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0), h, hkv,
            HALF=half, BLOCK_H=triton.next_power_of_2(h), BLOCK_HKV=triton.next_power_of_2(hkv),
            BLOCK_HALF=triton.next_power_of_2(half), num_warps=4,
        )  # fmt: skip
    return q, k
