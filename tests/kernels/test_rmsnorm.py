"""RMSNorm and fused residual-add RMSNorm against their references."""

import pytest
import torch

from kernels.rmsnorm import fused_add_rms_norm_ref, rms_norm_ref
from tests.kernels.pool import DEVICES, DTYPES, assert_close, triton_ops

# hidden sizes: SmolLM2's 576 (not a power of two), a power of two, a small odd one
SHAPES = [(1, 576), (7, 64), (33, 101)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(device, dtype, shape):
    x = torch.randn(shape, device=device).to(dtype)
    w = torch.randn(shape[1], device=device).to(dtype)
    assert_close(triton_ops(device).rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_add_rms_norm(device, dtype, shape):
    x = torch.randn(shape, device=device).to(dtype)
    residual = torch.randn(shape, device=device).to(dtype)
    w = torch.randn(shape[1], device=device).to(dtype)
    x0, r0 = x.clone(), residual.clone()
    out, new_residual = triton_ops(device).fused_add_rms_norm(x, residual, w, 1e-5)
    out_ref, new_residual_ref = fused_add_rms_norm_ref(x, residual, w, 1e-5)
    assert_close(new_residual, new_residual_ref, dtype)
    assert_close(out, out_ref, dtype)
    assert torch.equal(x, x0) and torch.equal(residual, r0)  # inputs untouched


@pytest.mark.parametrize("device", DEVICES)
def test_strided_rows(device):
    """Rows of a wider buffer (row stride != hidden size)."""
    buf = torch.randn(5, 200, device=device)
    x = buf[:, :150]
    w = torch.randn(150, device=device)
    assert_close(triton_ops(device).rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), torch.float32)
