"""Write the new tokens' keys and values into their slots of the paged KV pool.

Every forward stores its k/v before attention reads them, so this runs once per
layer per step; it is a pure scatter (bandwidth bound). slot = block_id *
block_size + offset; slot -1 marks a token whose k/v must not be stored (padding
of a CUDA-graph batch).
"""

import torch

from kernels._triton import tl, triton


def store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping) -> None:
    """k, v (T, Hkv, D) -> k_cache, v_cache (num_blocks, block_size, Hkv, D) in place."""
    num_blocks, block_size, hkv, d = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(num_blocks * block_size, hkv, d)[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(num_blocks * block_size, hkv, d)[slots] = v[keep].to(v_cache.dtype)
