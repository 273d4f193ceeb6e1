"""Count a region's host reads and synchronising copies on CPU, where none of them shows.

On a GPU a host read (`.tolist()`, `.item()`, `bool(t)`, a shape that depends on the data)
waits for every queued kernel, and so does a blocking host->device copy; on CPU none of
them costs anything and `.tolist()` of a CPU tensor never reaches the dispatcher. A
`torch.overrides.TorchFunctionMode` sees every torch call from Python, so `SyncCounter`
counts, while it is active, the calls that would synchronise on a GPU:

  reads     a tensor turned into Python data: tolist, item, numpy, cpu, __bool__,
            __int__, __float__, __index__, __contains__, __array__, equal, allclose;
  syncs     - a tensor built from Python data (lists, ints) with `device=` given: a
              blocking copy from pageable memory (torch.tensor(..., device=d));
            - an op whose output size depends on the data (nonzero, masked_select,
              unique, reading through a bool mask, ...);
            - Python lists indexing a tensor (each a blocking copy of the index);
            - a host tensor (made in the region without `device=`: torch.tensor(data),
              torch.arange(n), ...) meeting a device tensor in an op (an implicit copy,
              blocking where it indexes), or moved with a blocking `.to(...)`.

Not counted: `uploads`, host data moved with `.to(device, non_blocking=True)` (an
asynchronous copy: the host does not wait for the device), counted apart. "Device"
tensors are those made with `device=` or by ops on them, and every tensor that existed
before the region (weights, the KV pool, state kept between steps).
"""

from __future__ import annotations

import os
import sys
import weakref

import torch
from torch.overrides import TorchFunctionMode

T = torch.Tensor
READS = {T.tolist, T.item, T.numpy, T.cpu, T.__bool__, T.__int__, T.__float__, T.__index__, T.__contains__,
         T.__array__, torch.equal, torch.allclose, T.equal, T.allclose, T.is_nonzero}
DATA_SHAPED = {torch.nonzero, T.nonzero, torch.masked_select, T.masked_select, torch.unique, T.unique,
               torch.unique_consecutive, T.unique_consecutive, torch.argwhere, T.argwhere, torch.bincount,
               T.bincount, torch.repeat_interleave, T.repeat_interleave}
FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
FACTORIES = FROM_DATA | {torch.arange, torch.zeros, torch.ones, torch.full, torch.empty, torch.eye, torch.linspace,
                         torch.randperm, torch.rand, torch.randn, torch.randint, torch.range}
INDEXING = {T.__getitem__, T.__setitem__, T.index_put_, T.index_put}
MOVES = {T.to, T.cuda, T.copy_}


def _flat(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flat(y)
    else:
        yield x


def _python_index(x) -> bool:
    """A list (or a tuple holding a list) of ints used as an index: torch copies it to the device."""
    if isinstance(x, list):
        return True
    return isinstance(x, tuple) and any(isinstance(y, list) for y in x)


class SyncCounter(TorchFunctionMode):
    """`with SyncCounter(exempt) as c:` ... then c.reads, c.syncs (lists of "what at file:line"),
    c.uploads. exempt: functions whose calls, and everything under them, are not looked at (a
    kernel set's CPU references, which stand for device kernels that never read the host)."""

    def __init__(self, exempt=()):
        super().__init__()
        self.exempt = {f.__code__ for f in exempt if hasattr(f, "__code__")}
        self.reads: list[str] = []
        self.syncs: list[str] = []
        self.uploads = 0
        self._host: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    @property
    def count(self) -> int:
        """What must stay at one per speculative step: reads + synchronising copies."""
        return len(self.reads) + len(self.syncs)

    def _is_host(self, t) -> bool:
        return isinstance(t, torch.Tensor) and self._host.get(id(t)) is t

    def _mark(self, out) -> None:
        for t in _flat(out):
            if isinstance(t, torch.Tensor):
                self._host[id(t)] = t

    def _caller(self):
        """The innermost frame outside torch and this file, or None inside an exempt function."""
        f, caller = sys._getframe(2), None
        while f is not None:
            if f.f_code in self.exempt:
                return None
            if caller is None and f.f_code.co_filename != __file__ and f"{os.sep}torch{os.sep}" not in f.f_code.co_filename:
                caller = f
            f = f.f_back
        return caller

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        caller = self._caller()
        if caller is None:
            return out
        name = getattr(func, "__name__", str(func))
        self._where = lambda what: f"{what} at {os.path.relpath(caller.f_code.co_filename)}:{caller.f_lineno}"
        if func in READS:
            self.reads.append(self._where(name))
            return out
        if func in FACTORIES:
            data = args[0] if args else kwargs.get("data")
            from_python = func in FROM_DATA and not isinstance(data, torch.Tensor)
            if kwargs.get("device") is None:
                if func in FROM_DATA and isinstance(data, torch.Tensor):
                    if self._is_host(data):
                        self._mark(out)
                else:
                    self._mark(out)  # a host tensor
            elif from_python:
                self.syncs.append(self._where(f"{name}(python data, device=)"))
            elif func in FROM_DATA and self._is_host(data):
                self.syncs.append(self._where(f"{name}(host tensor, device=)"))
            return out
        tensors = [a for a in _flat(list(args) + list(kwargs.values())) if isinstance(a, torch.Tensor)]
        host = [self._is_host(t) for t in tensors]
        if func in MOVES and host and host[0] and func is not T.copy_:
            if kwargs.get("non_blocking"):
                self.uploads += 1
                self._host.pop(id(out), None)  # on the device now (on CPU `.to` may return its input)
            elif any(isinstance(a, (str, torch.device)) for a in args[1:]) or "device" in kwargs:
                self.syncs.append(self._where(f"{name} of a host tensor (blocking)"))
            else:
                self._mark(out)  # a dtype change stays on the host
            return out
        if func is T.copy_ and len(host) >= 2 and host[1] and not host[0]:
            if kwargs.get("non_blocking") or (len(args) > 2 and args[2]):
                self.uploads += 1
            else:
                self.syncs.append(self._where("copy_ from a host tensor (blocking)"))
            return out
        if func in DATA_SHAPED:
            self.syncs.append(self._where(name))
        elif func in INDEXING and len(args) > 1 and _python_index(args[1]):
            self.syncs.append(self._where(f"{name} with a python list"))
        elif func is T.__getitem__ and any(isinstance(t, torch.Tensor) and t.dtype == torch.bool
                                           for t in _flat(args[1])):
            self.syncs.append(self._where(f"{name} with a bool mask"))
        if host and all(host):
            self._mark(out)  # host work on host tensors
        elif any(host):
            self.syncs.append(self._where(f"host tensor meets a device tensor in {name}"))
        return out
