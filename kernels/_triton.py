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
