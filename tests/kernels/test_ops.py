"""kernels.ops: the start-up choice between Triton and the references."""

import dataclasses
import os
from typing import Callable

import pytest

import kernels


def test_default_choice():
    from kernels import cpu_ops

    cpu = kernels.ops("cpu")
    assert kernels.ops("cuda").impl == "triton"
    assert kernels.ops("meta").impl == "ref"
    if cpu_ops.available():  # C++ where it builds; the references for the ops it lacks
        assert cpu.impl == "cpu" and cpu.rms_norm is cpu_ops.rms_norm_cpu
        assert cpu.paged_extend_attention is kernels.extend_attention.paged_extend_attention_ref
    else:
        assert cpu.impl == "ref" and cpu.rms_norm is kernels.rmsnorm.rms_norm_ref


def test_triton_on_cpu_needs_the_interpreter():
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert kernels.ops("cpu", impl="triton").sample is kernels.sampling.sample_triton
    else:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            kernels.ops("cpu", impl="triton")


def test_every_kernel_has_both_versions():
    for impl in ("ref", "triton"):
        table = kernels.ops("cuda", impl=impl)  # choosing needs no device
        for field in dataclasses.fields(table):
            if field.type == "Callable" or field.type is Callable:
                assert getattr(table, field.name).__name__.endswith("_" + impl)


def test_frozen_and_validated():
    table = kernels.ops("cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        table.sample = None
    with pytest.raises(ValueError, match="impl"):
        kernels.ops("cpu", impl="cuda")
