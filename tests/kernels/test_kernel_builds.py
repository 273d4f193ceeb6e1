"""tests/kernel_builds.py, the suite's first step under `make test`: it names the kernels the modules
load (a renamed one would be built for nothing and the real one left to the tests), and it lists as
missing exactly what the extension cache lacks."""

import pytest

from kernels import cpu_draft, cpu_forward, cpu_ops, qgemm_cpu
from kernels.cpu_build import build_directory
from tests.kernel_builds import EXTENSIONS, missing


@pytest.mark.usefixtures("cpu_ops_built")
@pytest.mark.parametrize("loader", [cpu_ops._ext, cpu_draft._ext, qgemm_cpu._extension, cpu_forward._ext],
                         ids=["cpu_ops", "cpu_draft", "qgemm", "cpu_forward"])
def test_every_module_loads_a_listed_kernel(loader):
    if loader in (qgemm_cpu._extension, cpu_forward._ext) and not qgemm_cpu.cpu_has_vnni():
        pytest.skip("needs AVX-512 VNNI")
    assert loader().__name__ in {build_directory(name, source)[0] for name, source, _ in EXTENSIONS}


def test_an_empty_cache_misses_every_kernel_this_cpu_builds(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    vnni = qgemm_cpu.cpu_has_vnni()
    assert missing() == [(name, source) for name, source, needs in EXTENSIONS if vnni or not needs]


@pytest.mark.usefixtures("cpu_ops_built")
def test_a_built_kernel_is_not_missing():
    assert ("edgechat_cpu_ops", "cpu_ops.cpp") not in missing()
