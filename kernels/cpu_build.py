"""Build a C++ CPU kernel from kernels/csrc once per machine (torch.utils.cpp_extension, cached
under ~/.cache/torch_extensions; about a minute the first time) and return the loaded module:
one .cpp (its own PYBIND11_MODULE) including headers by path from csrc/include, so compiler
errors name the real file and line. Callers fall back to their PyTorch reference when it fails.

-ffp-contract=off: GCC would otherwise fuse a * b + c into an FMA in some instantiations of a
template and not in others, and a row's result would depend on how many rows share its batch.

The module's name digests the .cpp, every header under csrc, csrc's path, sys.prefix and the
CPU's instruction sets: an edited header rebuilds; checkouts and venvs sharing a cache never
rebuild over each other; a build for -march=native is never loaded on a CPU that lacks what it
was compiled for (a container image built on one machine and run on another rebuilds, or falls
back to the references where it has no compiler, instead of dying on an illegal instruction).

A build killed halfway leaves torch's `lock` file in its directory, on which every later load
waits forever. Builds here hold an flock of their own, which the kernel releases with the
process; under it no other process of ours is building, so a `lock` file found is stale."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import sys

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]


@functools.cache
def cpu_features() -> str:
    """The CPU's instruction-set flags as the kernel reports them (Linux), else its name."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def build_directory(name: str, source: str, csrc: str = CSRC) -> tuple[str, str]:
    """(module name, its build directory) for csrc/`source` built as `name` in this environment."""
    from torch.utils.cpp_extension import _get_build_directory

    headers = sorted(os.path.join(root, f) for root, _, files in os.walk(csrc) for f in files if f.endswith(".h"))
    digest = hashlib.sha1(f"{os.path.abspath(csrc)}\0{sys.prefix}\0{cpu_features()}".encode())
    for path in [os.path.join(csrc, source)] + headers:  # everything the build may read
        with open(path, "rb") as f:
            digest.update(f"\0{os.path.relpath(path, csrc)}\0".encode() + f.read())
    name = f"{name}_{digest.hexdigest()[:10]}"
    return name, _get_build_directory(name, verbose=False)


@functools.cache
def load_cpp(name: str, source: str, csrc: str = CSRC):
    """The module built from csrc/`source` (a .cpp path relative to csrc), headers from csrc/include."""
    from torch.utils.cpp_extension import load

    name, build_dir = build_directory(name, source, csrc)
    with open(os.path.join(build_dir, ".edgechat-build.flock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released when this process ends, however it ends
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(build_dir, "lock"))  # torch's baton, left by a build that was killed
        return load(name=name, sources=[os.path.join(csrc, source)], extra_include_paths=[os.path.join(csrc, "include")],
                    build_directory=build_dir, extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"])


def builds(load, what: str, fallback: str) -> bool:
    """Whether `load()` (a load_cpp call) builds and loads here; if not, says so and what runs instead."""
    try:
        load()
    except (RuntimeError, OSError, ImportError) as e:
        print(f"{what} did not build ({e}); {fallback}", file=sys.stderr)
        return False
    return True
