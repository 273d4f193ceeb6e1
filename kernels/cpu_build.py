"""Build a C++ CPU kernel source once per machine (torch.utils.cpp_extension,
cached under ~/.cache/torch_extensions; about a minute the first time) and
return the loaded module. Callers fall back to their PyTorch reference when the
build fails (no compiler).

-ffp-contract=off: GCC would otherwise fuse a * b + c into an FMA in some
instantiations of a template and not in others, and a row's result would depend
on how many rows share its batch (seeded sampling must not).

The module's name carries a digest of its source: checkouts with different
versions of a kernel (several worktrees, one cache) never rebuild over each other."""

from __future__ import annotations

import functools
import hashlib


@functools.cache
def load_cpp(name: str, source: str, functions: tuple[str, ...] | None):
    """functions=None: the source defines its own PYBIND11_MODULE (classes)."""
    from torch.utils.cpp_extension import load_inline

    name = f"{name}_{hashlib.sha1(source.encode()).hexdigest()[:10]}"
    return load_inline(name=name, cpp_sources=source, functions=None if functions is None else list(functions),
                       extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"], extra_ldflags=["-fopenmp"])


def builds(load, what: str, fallback: str) -> bool:
    """Whether `load()` (a load_cpp call) builds and loads here; if not, says so on stderr
    and what runs instead (no compiler, no headers: the caller falls back)."""
    try:
        load()
    except (RuntimeError, OSError, ImportError) as e:
        import sys

        print(f"{what} did not build ({e}); {fallback}", file=sys.stderr)
        return False
    return True
