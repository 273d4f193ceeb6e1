"""Kernel-test fixtures: every tensor the wrappers allocate starts out poisoned, so
an output element a kernel forgets to write fails the comparison. The C++ CPU
extensions are built by fixtures, when a test that needs one runs, never while
collecting: `pytest -m gpu` on a GPU machine builds none of them."""

import pytest
import torch

_POISON_INT = -7


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(True)
    return t.fill_(_POISON_INT)


@pytest.fixture(autouse=True)
def poisoned_alloc(monkeypatch):
    """torch.empty / torch.empty_like return NaN (floats) or -7 (ints) filled tensors."""
    empty, empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: _poison(empty_like(*a, **k)))


def _built(available, reason: str) -> None:
    if not available():
        pytest.skip(reason)


@pytest.fixture(scope="session")
def qgemm_built():
    from kernels import qgemm_cpu

    _built(qgemm_cpu.available, "needs AVX-512 VNNI and a C++ compiler")


@pytest.fixture(scope="session")
def cpu_ops_built():
    from kernels import cpu_ops

    _built(cpu_ops.available, "needs a C++ compiler")


@pytest.fixture(scope="session")
def cpu_forward_built():
    from kernels import cpu_forward

    _built(cpu_forward.available, "needs AVX-512 VNNI and a C++ compiler")
