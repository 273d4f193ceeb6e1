"""kernels/csrc/vnni_peak.cpp, the roofline bench/prefill.py and bench/engine.py print: it builds,
times both instructions on one and on two threads, refuses an instruction it does not time, and
measures a memory read rate."""

import math

import pytest

from kernels import qgemm_cpu
from kernels.cpu_build import load_cpp

pytestmark = pytest.mark.skipif(not qgemm_cpu.cpu_has_vnni(), reason="needs AVX-512 VNNI")


@pytest.mark.parametrize("kind", ["dpbusd", "dpwssd"])
@pytest.mark.parametrize("threads", [1, 2])
def test_peak_is_a_finite_rate(kind, threads):
    rate = load_cpp("vnni_peak", "vnni_peak.cpp").peak_macs(kind, 20_000, threads)
    assert math.isfinite(rate) and rate > 0


def test_unknown_instruction_is_refused():
    with pytest.raises(RuntimeError, match="dpbusd or dpwssd"):
        load_cpp("vnni_peak", "vnni_peak.cpp").peak_macs("vpmaddwd", 1000, 1)


@pytest.mark.parametrize("threads", [1, 2])
def test_read_bandwidth_is_a_finite_rate(threads):
    rate = load_cpp("vnni_peak", "vnni_peak.cpp").read_bandwidth(8 << 20, threads, 2)
    assert math.isfinite(rate) and rate > 0


def test_read_bandwidth_refuses_less_than_a_page_a_thread():
    with pytest.raises(RuntimeError, match="4 KB a thread"):
        load_cpp("vnni_peak", "vnni_peak.cpp").read_bandwidth(4096, 2, 1)
