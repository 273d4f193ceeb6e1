"""Hot-path kernels of the replica: Triton on CUDA, PyTorch references elsewhere.

Each module holds `name_ref` (PyTorch, the definition) beside `name_triton` (the
kernel and its wrapper, same signature). The engine picks one set once at
start-up with `ops(device_type)`; tests force either with `impl=`.
"""

import os
from dataclasses import dataclass
from typing import Callable

from kernels import decode_attention, extend_attention, rmsnorm, rotary, sampling, store_kv, swiglu, tree_attention
from kernels._triton import HAS_TRITON

_SOURCES = {
    "store_kvcache": store_kv,
    "paged_decode_attention": decode_attention,
    "paged_extend_attention": extend_attention,
    "paged_tree_attention": tree_attention,
    "rms_norm": rmsnorm,
    "fused_add_rms_norm": rmsnorm,
    "apply_rotary": rotary,
    "silu_and_mul": swiglu,
    "sample": sampling,
}


@dataclass(frozen=True)
class Ops:
    """The kernel set a process runs with; signatures are documented on the `_ref`s."""

    impl: str  # "triton" or "ref"
    store_kvcache: Callable
    paged_decode_attention: Callable
    paged_extend_attention: Callable
    paged_tree_attention: Callable
    rms_norm: Callable
    fused_add_rms_norm: Callable
    apply_rotary: Callable
    silu_and_mul: Callable
    sample: Callable


def ops(device_type: str, impl: str | None = None) -> Ops:
    """Kernels for tensors on `device_type` ("cuda", "cpu", ...).

    impl=None: Triton on "cuda", the PyTorch references otherwise. impl="triton" or
    "ref" forces one (Triton on CPU tensors needs TRITON_INTERPRET=1 set before
    triton is first imported, as tests/conftest.py does).
    """
    if impl is None:
        impl = "triton" if device_type == "cuda" else "ref"
    if impl not in ("triton", "ref"):
        raise ValueError(f"kernels.ops: impl must be 'triton' or 'ref', got {impl!r}")
    if impl == "triton":
        if not HAS_TRITON:
            raise RuntimeError("kernels.ops: impl='triton' needs the triton package; install it or use impl='ref'")
        if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                f"kernels.ops: Triton kernels on {device_type!r} tensors run only under the interpreter; "
                "set TRITON_INTERPRET=1 before triton is imported, or use impl='ref'"
            )
    return Ops(impl=impl, **{name: getattr(mod, f"{name}_{impl}") for name, mod in _SOURCES.items()})
