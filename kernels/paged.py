"""Helpers shared by the attention references: read one sequence's keys and
values out of the paged KV pool, and masked GQA attention in fp32.

Pool layout (per layer): cache (num_blocks, block_size, num_kv_heads, head_dim);
token position p of a sequence lives at slot block_table[p // block_size] *
block_size + p % block_size. Query head h reads kv head h // (H // Hkv).

An int8 pool (the C++ CPU step's `cpu_step_kv=torch.int8`) holds each (token, kv
head) row as its head_dim codes followed by the 4 bytes of its fp32 scale
(`quantize_kv_ref`, the definition the C++ store follows bit for bit): its last
dimension is head_dim + 4 (`pool_row`), and the references read it through
`dequantize_kv_ref`.
"""

import torch
import torch.nn.functional as F

SCALE_BYTES = 4  # an int8 row's fp32 scale, after its codes


def pool_row(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of a (token, kv head) row of a pool of `dtype`: head_dim, plus the scale's bytes in int8."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def quantize_kv_ref(x: torch.Tensor) -> torch.Tensor:
    """(..., D) float -> (..., D + 4) int8 rows: codes round(x 127 / max|x|) (half to even, all
    in fp32), then the bytes of the fp32 scale max|x| / 127 (a row of zeros: codes 0, scale 0)."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = (x * inv).round().to(torch.int8)
    return torch.cat([codes, (amax / 127.0).view(torch.int8)], -1)


def dequantize_kv_ref(rows: torch.Tensor) -> torch.Tensor:
    """Pool rows as fp32 values: int8 rows (..., D + 4) as codes * scale; other dtypes widened."""
    if rows.dtype != torch.int8:
        return rows.float()
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)  # (..., 1)
    return rows[..., :-SCALE_BYTES].float() * scale


def to_pool(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values (..., D) as a pool of `dtype` stores them."""
    return quantize_kv_ref(x) if dtype == torch.int8 else x.to(dtype)


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, length: int):
    """Keys and values of positions [0, length) of one sequence: two (length, Hkv, D)."""
    block_size = k_cache.shape[1]
    n_blocks = -(-length // block_size)
    ids = block_table[:n_blocks].long()
    k = k_cache[ids].flatten(0, 1)[:length]  # (length, Hkv, D) (D + 4 in int8)
    v = v_cache[ids].flatten(0, 1)[:length]
    if k_cache.dtype == torch.int8:
        return dequantize_kv_ref(k), dequantize_kv_ref(v)
    return k, v


def attend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float):
    """softmax(q k^T * scale, masked) v in fp32 for one sequence.

    q (M, H, D), k/v (L, Hkv, D), allowed bool (M, L) -> (M, H, D) in q's dtype.
    Every query must be allowed at least one key. PyTorch's fused SDPA on fp32
    copies (exact math, and several times faster on CPU than einsum + softmax).
    """
    o = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1),
        attn_mask=allowed, scale=scale, enable_gqa=True,
    )  # (H, M, D)  # fmt: skip
    return o.transpose(0, 1).to(q.dtype)
