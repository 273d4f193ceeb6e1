"""The decode step's small ops in C++ for CPU (fp32): one call each instead of a
chain of PyTorch dispatches.

At batch 1 a 135M-parameter layer's matmuls take tens of microseconds, and each
PyTorch op costs a few microseconds of dispatch and allocation: the reference
norm, rotary, SwiGLU, KV store and paged attention spend ~20 ops a layer, more
than the matmuls. These are the same contracts as the `_ref`s (kernels/*.py),
written as plain loops the compiler vectorizes; paged decode attention reads
each key and value once from the pool through the block table (scores, softmax,
weighted values; the G query heads of a kv head together) instead of gathering a padded copy.
fp32 only: other dtypes use the references (`cpu_ops()` wraps both). The C++ is
kernels/csrc/cpu_ops.cpp.
"""

from __future__ import annotations

import torch

from kernels import decode_attention, rmsnorm, rotary, store_kv, swiglu
from kernels.cpu_build import builds, load_cpp


def _ext():
    return load_cpp("edgechat_cpu_ops", "cpu_ops.cpp")


def _fp32(*tensors) -> bool:
    return all(t.dtype == torch.float32 for t in tensors)


def rms_norm_cpu(x, weight, eps: float):
    if not _fp32(x, weight):
        return rmsnorm.rms_norm_ref(x, weight, eps)
    return _ext().add_rms_norm(x, None, weight, eps)[0]


def fused_add_rms_norm_cpu(x, residual, weight, eps: float):
    if not _fp32(x, residual, weight):
        return rmsnorm.fused_add_rms_norm_ref(x, residual, weight, eps)
    out, res = _ext().add_rms_norm(x, residual, weight, eps)
    return out, res


def apply_rotary_cpu(q, k, positions, cos_sin_cache):
    if not _fp32(q, k, cos_sin_cache) or q.stride(2) != 1 or k.stride(2) != 1:
        return rotary.apply_rotary_ref(q, k, positions, cos_sin_cache)
    _ext().apply_rotary(q, k, positions, cos_sin_cache)
    return q, k


def silu_and_mul_cpu(x):
    if not _fp32(x):
        return swiglu.silu_and_mul_ref(x)
    return _ext().silu_and_mul(x)


def store_kvcache_cpu(k, v, k_cache, v_cache, slot_mapping) -> None:
    if not _fp32(k, v, k_cache, v_cache) or k.stride(2) != 1 or v.stride(2) != 1 \
            or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        return store_kv.store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping)
    _ext().store_kvcache(k, v, k_cache, v_cache, slot_mapping)


def paged_decode_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens, scale: float):
    if not _fp32(q, k_cache, v_cache) or q.stride(2) != 1 or not k_cache.is_contiguous() \
            or not v_cache.is_contiguous():
        return decode_attention.paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale)
    return _ext().paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)


def available() -> bool:
    """The C++ ops build (once per machine) and run here."""
    return builds(_ext, "kernels.cpu_ops: the C++ ops", "using the references")
