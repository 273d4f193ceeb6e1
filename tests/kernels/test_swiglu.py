"""silu(gate) * up against its reference."""

import pytest
import torch

from kernels.swiglu import silu_and_mul_ref
from tests.kernels.pool import DEVICES, DTYPES, assert_close, triton_ops


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (5, 2 * 77), (3, 2 * 5000)])  # 5000: two column blocks
def test_matches_reference(device, dtype, shape):
    x = (torch.randn(shape, device=device) * 4).to(dtype)
    assert_close(triton_ops(device).silu_and_mul(x), silu_and_mul_ref(x), dtype)
