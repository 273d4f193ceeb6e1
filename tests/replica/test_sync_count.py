"""tests/replica/sync_count.py sees each kind of host read and synchronising copy a speculative
step used to make (the ones issue 42 names), and not the host data sent up without waiting."""

import torch

from kernels.sampling import probs_ref, sample_ref
from tests.replica.sync_count import SyncCounter

dev = torch.device("cpu")
x = torch.arange(12.0).view(3, 4)  # made before: a "device" tensor


def count(fn, exempt=()) -> tuple[int, int]:
    with SyncCounter(exempt) as c:
        fn()
    return c.count, c.uploads


def test_each_offender_counts_once():
    offenders = {
        "tolist": lambda: x.tolist(),
        "item": lambda: x[0, 0].item(),
        "bool": lambda: bool(x[0, 0] > 1),
        "int": lambda: int(x[0, 1]),
        "tensor from a list, device=": lambda: torch.tensor([1, 2], device=dev),
        "as_tensor from a list, device=": lambda: torch.as_tensor([1.0], device=dev),
        "a host arange indexing": lambda: x[torch.arange(3), 0],
        "a host tensor moved blocking": lambda: torch.zeros(3, 4, dtype=torch.bool).to(dev),
        "a python list index": lambda: x[[0, 2]],
        "nonzero": lambda: (x > 3).nonzero(),
        "a bool mask read": lambda: x[x > 3],
    }
    for name, fn in offenders.items():
        assert count(fn) == (1, 0), name


def test_uploads_device_work_and_exempt_kernels_are_not_counted():
    def uploaded():
        ids = torch.tensor([0, 2]).to(dev, non_blocking=True)
        y = x[ids] * 2 + torch.arange(4, device=dev)  # device work, a device arange
        y[:, 0] = 0  # a python scalar
        return torch.where(y > 3, y, 0.0).sum(-1)

    assert count(uploaded) == (0, 1)
    args = (x, torch.tensor([1.0] * 3), torch.tensor([0, 2, 0]), torch.tensor([1.0, 1.0, 0.5]))
    seeds, positions = torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])

    def sample():
        sample_ref(*args, seeds, positions)

    assert count(sample, exempt=[sample_ref])[0] == 0  # a kernel set's reference: a Triton launch on a GPU
    assert count(sample)[0] > 0 and count(lambda: probs_ref(*args))[0] > 0  # the references do read
