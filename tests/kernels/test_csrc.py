"""The C++ kernels as real files (kernels/csrc): formatted by the repository's .clang-format,
compiled by kernels/cpu_build.py so that an error names the file and line it is on, and
rebuilt when any header changes."""

import os
import shutil
import subprocess
import sysconfig

import pytest

from kernels.cpu_build import CSRC, build_directory, load_cpp

SOURCES = sorted(os.path.join(root, f) for root, _, files in os.walk(CSRC) for f in files if f.endswith((".h", ".cpp")))


def clang_format() -> str | None:
    """The venv's clang-format (the `test` extra's wheel), else one on PATH."""
    venv = os.path.join(sysconfig.get_path("scripts"), "clang-format")
    return venv if os.access(venv, os.X_OK) else shutil.which("clang-format")


def test_there_are_sources():
    names = {os.path.relpath(p, CSRC) for p in SOURCES}
    assert {"qgemm.cpp", "cpu_ops.cpp", "cpu_forward.cpp", "include/edgechat/qgemm.h"} <= names


def test_the_sources_are_clang_formatted():
    exe = clang_format()
    if exe is None:
        pytest.skip("clang-format is not installed (pip install clang-format, or the `test` extra)")
    r = subprocess.run([exe, "--style=file", "--dry-run", "--Werror", *SOURCES], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, f"run `{exe} -i` on kernels/csrc:\n{r.stderr[-4000:]}"


def copy_of_csrc(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))  # nothing left in the real cache
    return shutil.copytree(CSRC, tmp_path / "csrc")


def test_the_build_digest_covers_every_header(tmp_path, monkeypatch):
    csrc = copy_of_csrc(tmp_path, monkeypatch)
    before = build_directory("edgechat_digest_test", "cpu_forward.cpp", csrc)
    with open(os.path.join(csrc, "include", "edgechat", "pool.h"), "a") as f:
        f.write("// an edit\n")
    assert build_directory("edgechat_digest_test", "cpu_forward.cpp", csrc)[0] != before[0]


def include_line(path: str) -> int:
    """The line (1-based) of the first #include in `path`: what follows it the compiler reads after."""
    with open(path) as f:
        return next(i for i, ln in enumerate(f, 1) if ln.startswith("#include"))


# The broken line names a header that does not exist: a fatal error, so the compiler stops there instead of
# parsing torch/extension.h (25 s of a loaded core) to reach a static_assert at the end of the file. It goes at
# the line of the file's first #include (not line 1, which a compiler that lost track of lines could also
# print); in qgemm.h that is before torch's headers too, which qgemm.cpp includes after it.
@pytest.mark.usefixtures("cpu_ops_built")  # a compiler is there
@pytest.mark.parametrize("broken", ["cpu_ops.cpp", "include/edgechat/qgemm.h"])
def test_a_compiler_error_names_the_real_file_and_line(tmp_path, monkeypatch, broken):
    csrc = copy_of_csrc(tmp_path, monkeypatch)
    path = os.path.join(csrc, broken)
    line = include_line(path)
    assert line > 1, path
    with open(path) as f:
        lines = f.read().splitlines(keepends=True)
    lines.insert(line - 1, '#include "edgechat/broken_on_purpose.h"\n')
    with open(path, "w") as f:
        f.writelines(lines)
    source = "cpu_ops.cpp" if broken.endswith(".cpp") else "qgemm.cpp"
    with pytest.raises(RuntimeError) as e:
        load_cpp("edgechat_broken_test", source, csrc)
    assert f"{path}:{line}:" in str(e.value) and "broken_on_purpose.h" in str(e.value), str(e.value)[-4000:]
