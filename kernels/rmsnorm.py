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
