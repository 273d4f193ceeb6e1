"""Paged decode attention: one query token per sequence over its cached keys.

Decode reads the whole KV cache of every sequence once per step and does almost
no arithmetic per byte, so it is bound by HBM bandwidth. At batch 1 with a long
context a kernel with one program per (sequence, kv head) would use a handful of
SMs; flash-decoding splits each sequence's keys into chunks processed in
parallel (partial softmax per split), then a small kernel merges the splits with
their log-sum-exps. The G = H / Hkv query heads sharing a kv head are processed
together so each key is read from memory once.
"""

import torch

from kernels._triton import tl, triton


def paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale: float):
    """q (B, H, D); caches (num_blocks, block_size, Hkv, D); block_tables (B, max_blocks)
    int32; seq_lens (B,) int32, each >= 1 -> (B, H, D) in q's dtype.

    Batched: gathers every sequence's blocks into a padded (B, L, Hkv, D) and masks.
    """
    b, h, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    n_blocks = -(-int(seq_lens.max()) // block_size)
    ids = block_tables[:, :n_blocks].long().clamp_min(0)  # padding entries may be -1
    k = k_cache[ids].flatten(1, 2).float()  # (B, L, Hkv, D)
    v = v_cache[ids].flatten(1, 2).float()
    qg = q.float().view(b, hkv, h // hkv, d)  # (B, Hkv, G, D)
    s = torch.einsum("bkgd,blkd->bkgl", qg, k) * scale  # (B, Hkv, G, L)
    pos = torch.arange(k.shape[1], device=q.device)
    s = s.masked_fill((pos[None, :] >= seq_lens[:, None])[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = torch.einsum("bkgl,blkd->bkgd", p, v)
    return o.reshape(b, h, d).to(q.dtype)
