"""A C++ kernel build killed halfway must not hang every later load."""

import os
import subprocess
import sys

from kernels import cpu_ops
from kernels.cpu_build import build_directory, builds


def test_a_stale_torch_build_lock_does_not_hang_the_next_load():
    assert builds(cpu_ops._ext, "cpu ops", "skip")  # built (or loaded) once in this process
    lock = os.path.join(build_directory("edgechat_cpu_ops", "cpu_ops.cpp")[1], "lock")
    open(lock, "w").close()  # what a build killed between taking the baton and releasing it leaves
    # torch's own loader would poll this file forever; ours takes it for what it is
    r = subprocess.run([sys.executable, "-c", "from kernels import cpu_ops; cpu_ops._ext(); print('loaded')"],
                       capture_output=True, text=True, timeout=240, cwd=os.path.dirname(os.path.dirname(cpu_ops.__file__)))
    assert r.returncode == 0 and "loaded" in r.stdout, r.stderr
    assert not os.path.exists(lock)


def test_a_build_is_named_for_the_cpu_it_was_compiled_for(monkeypatch):
    """-march=native: a build made on another CPU (a container image moved between
    machines) has another name, so it is rebuilt (or the references run), never loaded."""
    from kernels import cpu_build

    here = cpu_build.build_directory("edgechat_qgemm", "qgemm.cpp")[0]
    assert cpu_build.build_directory("edgechat_qgemm", "qgemm.cpp")[0] == here  # stable on one machine
    monkeypatch.setattr(cpu_build, "cpu_features", lambda: "fpu sse sse2 avx2")  # a CPU without AVX-512
    assert cpu_build.build_directory("edgechat_qgemm", "qgemm.cpp")[0] != here
