"""RMSNorm, alone and fused with the residual add that precedes it.

out = x / sqrt(mean(x^2) + eps) * weight, computed in fp32 and rounded once to
x's dtype. The fused form reads x and the residual once, writes the new residual
(x + residual, rounded to x's dtype as the unfused model would) and the
normalized output: 3 reads + 2 writes of a row instead of 5 + 3 unfused.
"""

import torch

from kernels._triton import tl, triton


def rms_norm_ref(x, weight, eps: float):
    """x (T, N), weight (N,) -> (T, N) in x's dtype."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return out.to(x.dtype)


def fused_add_rms_norm_ref(x, residual, weight, eps: float):
    """-> (rms_norm(x + residual) * weight, x + residual), both in x's dtype."""
    new_residual = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(new_residual, weight, eps), new_residual


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # (T, N) input rows, row stride stride_x
    res_ptr,  # (T, N) residual rows (read only when HAS_RESIDUAL)
    w_ptr,  # (N,) weight
    out_ptr,  # (T, N) normalized output, contiguous
    res_out_ptr,  # (T, N) new residual x + residual, contiguous (HAS_RESIDUAL)
    stride_x,
    stride_r,
    N,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(res_out_ptr.dtype.element_ty)  # rounded as the unfused model would
        tl.store(res_out_ptr + row * N + cols, s, mask=mask)
        x = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, eps):
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    assert x2.stride(-1) == 1, "last dim must be contiguous"
    block_n = triton.next_power_of_2(n)
    assert block_n <= 65536, f"rms_norm: hidden size {n} too large for one row per program"
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    r2 = residual.reshape(-1, n) if residual is not None else x2
    assert r2.stride(-1) == 1, "last dim must be contiguous"
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, res_out, x2.stride(0), r2.stride(0), n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK_N=block_n, num_warps=max(1, min(16, block_n // 512)),
        )  # fmt: skip
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm_triton(x, weight, eps: float):
    """Same contract as rms_norm_ref; one program per row, the whole row in registers."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm_triton(x, residual, weight, eps: float):
    """Same contract as fused_add_rms_norm_ref."""
    return _launch(x, residual, weight, eps)
