"""Helpers shared by the attention references: read one sequence's keys and
values out of the paged KV pool, and masked GQA attention in fp32.

Pool layout (per layer): cache (num_blocks, block_size, num_kv_heads, head_dim);
token position p of a sequence lives at slot block_table[p // block_size] *
block_size + p % block_size. Query head h reads kv head h // (H // Hkv).
"""

import torch
import torch.nn.functional as F


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, length: int):
    """Keys and values of positions [0, length) of one sequence: two (length, Hkv, D)."""
    block_size = k_cache.shape[1]
    n_blocks = -(-length // block_size)
    ids = block_table[:n_blocks].long()
    k = k_cache[ids].flatten(0, 1)[:length]  # (length, Hkv, D)
    v = v_cache[ids].flatten(0, 1)[:length]
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
