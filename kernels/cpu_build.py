"""Build a C++ CPU kernel source once per machine (torch.utils.cpp_extension,
cached under ~/.cache/torch_extensions; about a minute the first time) and
return the loaded module. Callers fall back to their PyTorch reference when the
build fails (no compiler).

-ffp-contract=off: GCC would otherwise fuse a * b + c into an FMA in some
instantiations of a template and not in others, and a row's result would depend
on how many rows share its batch (seeded sampling must not).

The module's name carries a digest of its source and of the Python environment:
checkouts with different versions of a kernel (several worktrees, one cache) never
rebuild over each other, and two venvs (their include paths differ, so torch
would rebuild each time the other had built) keep a build each.

A build killed halfway leaves torch's `lock` file in the build directory, and
every later load waits on it forever (a replica that never starts). Builds here
hold an flock of their own, which the kernel releases with the process; under it
no other process of ours is building, so a `lock` file found is stale and goes."""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import sys


def build_directory(name: str, source: str) -> tuple[str, str]:
    """(module name, its build directory) for `source` built as `name` in this environment."""
    from torch.utils.cpp_extension import _get_build_directory

    name = f"{name}_{hashlib.sha1((source + sys.prefix).encode()).hexdigest()[:10]}"
    return name, _get_build_directory(name, verbose=False)


@functools.cache
def load_cpp(name: str, source: str, functions: tuple[str, ...] | None):
    """functions=None: the source defines its own PYBIND11_MODULE (classes)."""
    from torch.utils.cpp_extension import load_inline

    name, build_dir = build_directory(name, source)
    with open(os.path.join(build_dir, ".edgechat-build.flock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released when this process ends, however it ends
        try:
            os.unlink(os.path.join(build_dir, "lock"))  # torch's baton, left by a build that was killed
        except FileNotFoundError:
            pass
        return load_inline(name=name, cpp_sources=source, functions=None if functions is None else list(functions),
                           build_directory=build_dir, extra_cflags=["-O3", "-march=native", "-ffp-contract=off",
                                                                    "-fopenmp"], extra_ldflags=["-fopenmp"])


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
