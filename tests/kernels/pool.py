"""Shared helpers of the kernel tests: random paged KV pools, devices, tolerances."""

import os

import pytest
import torch

import kernels

# Per-dtype (atol, rtol) against the fp32 references. bf16 is looser than its ulp
# (2^-8) because the interpreter rounds fp32 -> bf16 by truncation (GPU: to nearest).
ELEMENTWISE_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
# Attention also rounds the softmax weights to the input dtype before P @ V.
ATTENTION_TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# The interpreter runs on CPU tensors (tests/conftest.py turns it on where there is
# no GPU); the same tests run compiled on a GPU with `pytest -m gpu`.
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                 reason="Triton on CPU tensors needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                    reason="needs a CUDA device")]),
]  # fmt: skip
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def triton_ops(device: str) -> kernels.Ops:
    return kernels.ops(device, impl="triton")


def assert_close(out, ref, dtype, tol=ELEMENTWISE_TOL):
    """Every element: finite (no poison left) and within the dtype's tolerance."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), f"{(~torch.isfinite(out)).sum().item()} non-finite output elements"
    atol, rtol = tol[dtype]
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), atol=atol, rtol=rtol)


def make_pool(lens, num_kv_heads, head_dim, block_size, dtype, device, seed=0):
    """A random K/V pool holding sequences of `lens` tokens in scattered blocks.

    Returns k_cache, v_cache (num_blocks, block_size, Hkv, D) and block_tables
    (B, max_blocks) int32 padded with -1 past each sequence's blocks (and one
    spare column), as the engine pads them.
    """
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    block_tables = torch.full((len(lens), max(need) + 1), -1, dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=g)
    used = 0
    for b, n in enumerate(need):
        block_tables[b, :n] = perm[used : used + n].int()
        used += n
    return k_cache.to(device), v_cache.to(device), block_tables.to(device)


def cu_seqlens(q_lens, device):
    return torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32, device=device)
