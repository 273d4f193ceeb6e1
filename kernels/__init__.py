"""Hot-path kernels of the replica: Triton on CUDA, C++ on CPU, PyTorch references elsewhere.

Each module holds `name_ref` (PyTorch, the definition) beside `name_triton` (the
kernel and its wrapper, same signature); `cpu_ops` holds C++ versions of the
decode step's small ops (`name_cpu`, fp32); `qgemm_cpu` the packed int8/int4 GEMM,
`cpu_forward` the whole decoder step as one C++ call and `cpu_draft` the EAGLE-3 head's
step as another. What runs where is decided here, once at start-up, by
`ops(device_type)`: the model's layers, its quantized linears (packed or not), the
Runner's choice of the C++ step and that step's KV pool dtype (fp16 unless
`cpu_step_kv=` says fp32 or int8), and the Drafter's choice of the C++ head step all
read the one `Ops` it returns; tests force one with `impl=`. `fused_decode=True` (off by
default: not yet measured on a GPU) gives the model `rope_store` (rotary and KV store in one
launch, kernels/rope_store.py) and, with Triton, decode attention with its split merge folded
in (kernels/decode_attention.py's FusedDecodeAttention).
"""

import os
from dataclasses import dataclass
from typing import Callable

import torch

from kernels import (decode_attention, extend_attention, rmsnorm, rope_store, rotary, sampling, store_kv, swiglu,
                     tree_attention)
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


# The C++ step's KV pool dtypes by name (EngineConfig.kv_cache_dtype, "auto" the default; the
# benches' --cpu-kv).
CPU_STEP_KV = {"auto": torch.float16, "float16": torch.float16, "float32": torch.float32, "int8": torch.int8}


@dataclass(frozen=True)
class Ops:
    """The kernel set a process runs with; signatures are documented on the `_ref`s."""

    impl: str  # "triton", "cpu" or "ref"
    store_kvcache: Callable
    paged_decode_attention: Callable
    paged_extend_attention: Callable
    paged_tree_attention: Callable
    rms_norm: Callable
    fused_add_rms_norm: Callable
    apply_rotary: Callable
    silu_and_mul: Callable
    sample: Callable
    # impl "cpu" where they build (AVX-512 VNNI): quantized linears packed for the C++
    # GEMM (kernels.qgemm_cpu; else its PyTorch reference), and a packed fp32 model run
    # a step at a time as one C++ call (kernels.cpu_forward; else op by op).
    packed_qgemm: bool = False
    cpu_step: bool = False
    # impl "cpu" where it builds: the EAGLE-3 head's step as one C++ call (kernels.cpu_draft;
    # else speculative.drafting.Drafter runs the head op by op).
    cpu_draft: bool = False
    # The KV pool's dtype under the C++ step: fp16 halves the bytes a long context's decode
    # reads (kernels/csrc/include/edgechat/attention.h); fp32 is served too, and int8 (a
    # scale per token and kv head, rows of head_dim + 4 bytes: kernels/paged.py) on request.
    cpu_step_kv: torch.dtype = torch.float16
    # fused_decode: apply_rotary then store_kvcache as one call, rope_store(q, k, v, positions,
    # cos_sin, k_cache, v_cache, slot_mapping) -> q (kernels/rope_store.py); None: the two.
    rope_store: Callable | None = None
    fused_decode: bool = False


def ops(device_type: str, impl: str | None = None, cpu_step_kv: torch.dtype = torch.float16,
        fused_decode: bool = False) -> Ops:
    """Kernels for tensors on `device_type` ("cuda", "cpu", ...).

    impl=None: Triton on "cuda"; on "cpu" the C++ ops where they build (the
    references for ops they lack); the PyTorch references otherwise. impl="triton",
    "cpu" or "ref" forces one (Triton on CPU tensors needs TRITON_INTERPRET=1 set
    before triton is first imported, as tests/conftest.py does). cpu_step_kv: the
    KV pool's dtype where a model runs as the C++ step (torch.float16, torch.float32 or torch.int8).
    fused_decode: fewer launches a decode step: rope_store in place of rotary + store, and with
    Triton decode attention in one launch (no merge kernel); elsewhere rope_store is its
    reference (the same math, so the switch's path runs on CPU too) and attention is unchanged.
    """
    if cpu_step_kv not in CPU_STEP_KV.values():
        raise ValueError(f"kernels.ops: cpu_step_kv must be torch.float16, torch.float32 or torch.int8, "
                         f"got {cpu_step_kv}")
    if impl is None:
        from kernels import cpu_ops

        impl = "triton" if device_type == "cuda" else "cpu" if device_type == "cpu" and cpu_ops.available() else "ref"
    if impl not in ("triton", "cpu", "ref"):
        raise ValueError(f"kernels.ops: impl must be 'triton', 'cpu' or 'ref', got {impl!r}")
    if impl == "cpu":
        from kernels import cpu_draft, cpu_forward, cpu_ops, qgemm_cpu

        packed = qgemm_cpu.available()
        return Ops(impl=impl, **{name: getattr(cpu_ops, f"{name}_cpu", None) or getattr(mod, f"{name}_ref")
                                 for name, mod in _SOURCES.items()},
                   packed_qgemm=packed, cpu_step=packed and cpu_forward.available(), cpu_step_kv=cpu_step_kv,
                   cpu_draft=cpu_draft.available(), **_fused(impl, fused_decode))
    if impl == "triton":
        if not HAS_TRITON:
            raise RuntimeError("kernels.ops: impl='triton' needs the triton package; install it or use impl='ref'")
        if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                f"kernels.ops: Triton kernels on {device_type!r} tensors run only under the interpreter; "
                "set TRITON_INTERPRET=1 before triton is imported, or use impl='ref'"
            )
    return Ops(impl=impl, **{**{name: getattr(mod, f"{name}_{impl}") for name, mod in _SOURCES.items()},
                             **_fused(impl, fused_decode)})


def _fused(impl: str, fused_decode: bool) -> dict:
    """The fields fused_decode changes: none when off."""
    if not fused_decode:
        return {}
    if impl != "triton":
        return {"fused_decode": True, "rope_store": rope_store.rope_store_ref}
    return {"fused_decode": True, "rope_store": rope_store.rope_store_triton,
            "paged_decode_attention": decode_attention.FusedDecodeAttention()}
