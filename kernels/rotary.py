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
