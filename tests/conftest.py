"""Suite-wide setup. Triton kernels run under the interpreter where no GPU exists;
the variable must be set before triton is first imported."""

import os

try:
    import torch

    _has_cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
