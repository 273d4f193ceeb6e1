"""Kernel-test fixtures: every tensor the wrappers allocate starts out poisoned, so
an output element a kernel forgets to write fails the comparison."""

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
