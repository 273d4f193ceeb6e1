"""SwiGLU activation: silu(gate) * up over the fused gate_up projection output.

x = [gate | up] on the last dim (one matmul produced both); fusing the split, the
SiLU and the product reads x once and writes half of it, instead of three passes.
Computed in fp32, rounded once to x's dtype.
"""

import torch
import torch.nn.functional as F

from kernels._triton import tl, triton


def silu_and_mul_ref(x):
    """x (T, 2I) -> (T, I) in x's dtype."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # (T, 2I) [gate | up], row stride stride_x
    out_ptr,  # (T, I) output, contiguous
    stride_x,
    I,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * I + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x):
    """Same contract as silu_and_mul_ref; grid (rows, column blocks of the output)."""
    t, two_i = x.shape
    i = two_i // 2
    assert x.stride(1) == 1, "last dim must be contiguous"
    out = torch.empty((t, i), dtype=x.dtype, device=x.device)
    block = min(4096, triton.next_power_of_2(i))
    if t > 0:
        _silu_and_mul_kernel[(t, triton.cdiv(i, block))](x, out, x.stride(0), i, BLOCK=block, num_warps=4)
    return out
