"""Extend (chunked prefill) attention over the paged cache with a cached prefix.

A step may prefill chunks of several prompts at once, each continuing a prefix
already in the pool (prefix-cache hits, earlier chunks). Queries of all
sequences are packed into one (T, H, D) tensor delimited by cu_seqlens_q; query i
of sequence b sits at position seq_len_b - q_len_b + i and attends causally to
keys [0, that position]. All keys, the new ones included, are read from the pool
(store_kvcache ran first), so one launch covers every sequence whatever its
prefix length.
"""

import torch

from kernels._triton import tl, triton
from kernels.paged import attend_ref, gather_kv


def paged_extend_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale: float):
    """q (T, H, D); block_tables (B, max_blocks) int32; cu_seqlens_q (B+1,) int32;
    seq_lens (B,) int32 = prefix + new tokens -> (T, H, D) in q's dtype."""
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b, length in enumerate(lens):
        start, end = cu[b], cu[b + 1]
        if end == start:
            continue
        k, v = gather_kv(k_cache, v_cache, block_tables[b], length)
        q_pos = torch.arange(length - (end - start), length, device=q.device)
        allowed = torch.arange(length, device=q.device)[None, :] <= q_pos[:, None]  # (M, L)
        out[start:end] = attend_ref(q[start:end], k, v, allowed, scale)
    return out
