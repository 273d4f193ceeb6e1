"""Triton where it is installed; otherwise a stand-in that lets the kernel files
*define* their kernels (never run them), so `import kernels` and the PyTorch
references work on machines without triton.

Under pytest on a machine without CUDA, tests/conftest.py sets TRITON_INTERPRET=1
before this import, so the same kernels run on CPU tensors in the interpreter.
"""

from types import SimpleNamespace

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # references still work; ops(..., impl="triton") raises
    HAS_TRITON = False

    def _jit(fn=None, **_kwargs):
        return fn if fn is not None else (lambda f: f)

    triton = SimpleNamespace(jit=_jit)
    tl = SimpleNamespace(constexpr=None)

__all__ = ["HAS_TRITON", "triton", "tl"]


def dot_dtype(dtype):
    """The tl dtype to feed tl.dot for tensors of torch `dtype`: their own, except
    bfloat16 under the interpreter, whose tl.dot multiplies the raw bf16 bit
    patterns (triton 3.x); operands go in as fp32 there."""
    import os

    import torch

    if dtype == torch.bfloat16:
        return tl.float32 if os.environ.get("TRITON_INTERPRET") == "1" else tl.bfloat16
    return {torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def dot_precision(dtype) -> str:
    """fp32 operands: exact ("ieee"), not TF32, so fp32 matches the reference."""
    import torch

    return "ieee" if dtype == torch.float32 else "tf32"
