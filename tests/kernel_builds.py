"""`pytest --build-kernels` (what `make test` runs; tests/conftest.py's session start): the C++ kernels of
kernels/csrc that torch's extension cache lacks are built before the first test, one compiler per core.

Each build is one single-threaded compiler run (20-80 s of a core, most of it torch's headers). Left to the
suite, the first test that needs a kernel (a replica's start, a kernel test's fixture) builds it while
the other core idles, and the next one later: about four minutes in a row on a clean clone, where every
digest is new (kernels/cpu_build.py). Here they run side by side; a kernel already built costs a stat.

A build that fails here is reported (its compiler's last lines) and the session goes on as it would
without this step: the modules fall back to their references where a kernel does not build
(kernels/cpu_build.py's `builds`), and the tests that need it skip or fail, saying why. A CPU without
AVX-512 VNNI is not asked for the kernels that need it (`qgemm_cpu.cpu_has_vnni`, as the modules check)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (load_cpp name, source, needs VNNI): what kernels/*.py and bench load, the longest build first.
# tests/kernels/test_kernel_builds.py checks these are the names the modules load.
EXTENSIONS = (
    ("edgechat_cpu_forward", "cpu_forward.cpp", True),
    ("edgechat_cpu_draft", "cpu_draft.cpp", False),
    ("edgechat_qgemm_packed", "qgemm.cpp", True),
    ("edgechat_cpu_ops", "cpu_ops.cpp", False),
    ("vnni_peak", "vnni_peak.cpp", True),
)
BUILD_TIMEOUT_S = 900  # one compile of cpu_forward.cpp took 82 s on this machine at load ~5


def missing() -> list[tuple[str, str]]:
    """The (name, source) pairs of EXTENSIONS this CPU can build whose module is not in the cache."""
    from kernels.cpu_build import build_directory
    from kernels.qgemm_cpu import cpu_has_vnni

    vnni = cpu_has_vnni()
    out = []
    for name, source, needs_vnni in EXTENSIONS:
        if needs_vnni and not vnni:
            continue
        module, build_dir = build_directory(name, source)
        if not os.path.exists(os.path.join(build_dir, f"{module}.so")):
            out.append((name, source))
    return out


def build(name: str, source: str) -> tuple[str, int, str, float]:
    """Build one kernel in a process of its own: (source, exit status, its output's tail, seconds)."""
    t0 = time.perf_counter()
    code = f"from kernels.cpu_build import load_cpp; load_cpp({name!r}, {source!r})"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=BUILD_TIMEOUT_S, stdin=subprocess.DEVNULL)
    return source, r.returncode, (r.stdout + r.stderr)[-3000:], time.perf_counter() - t0


def build_missing(workers: int | None = None) -> str:
    """Build what `missing()` lists, `workers` at a time (default: the cores this process may use); an
    account: one line, then each kernel that did not build with its output's tail."""
    todo = missing()
    if not todo:
        return "kernels: every C++ kernel was already built"
    workers = workers or len(os.sched_getaffinity(0))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(lambda job: build(*job), todo))
    each = ", ".join(f"{source} {s:.0f} s" + ("" if rc == 0 else f" FAILED (exit {rc})") for source, rc, _, s in results)
    failed = [f"--- {source} did not build (exit {rc}):\n{log}" for source, rc, log, _ in results if rc != 0]
    return "\n".join([f"kernels: {len(todo)} not in the cache, built in {time.perf_counter() - t0:.0f} s, {workers} at a time ({each})",
                      *failed])
