"""The GPU call stays runnable: bench/gpu.sh --dry-run runs every stage of the lease's
call on this CPU, on tiny shapes (the figures mean nothing; the code paths, flags,
imports and output files are the call's), and what the call would send fits the
device tool's limits."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The lease's calls, as bench/gpu.sh's header lays them out (each call's $OUT comes back on its
# own, at most 8 files); service: tests/bench/test_gpu_service.py runs its dry run (and checks
# that it leaves nothing behind).
CALLS = [[], ["load", "kernels", "host"], ["train"]]  # []: the default, the lease's one call
MAX_FILES_BACK = 8  # the device tool returns at most 8 files from $OUT, 16 MiB each
MAX_TREE = 64 << 20  # working tree + carried paths, per call

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


DEFAULT = ["decode", "spec", "tests", "profile", "peer"]
SUMMARY_KEYS = {"card", "decode_ms_b1", "roofline_ms_b1", "decode_over_roofline_b1", "graphs_vs_eager", "peer_ms_b1",
                "host_syncs_per_spec_step", "spec_step_over_plain", "spec_implied_speedup", "start_from_disk", "stages"}


@pytest.mark.parametrize("call", CALLS, ids=lambda c: "+".join(c) or "default")
def test_every_stage_of_the_call_runs_on_cpu(tmp_path, call):
    stages = call or DEFAULT
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "OUT"} | {"OUT": str(out), "PY": str(ROOT / ".venv/bin/python")}
    if not (ROOT / ".venv/bin/python").exists():
        env["PY"] = "python3"
    proc = subprocess.run(["bash", "bench/gpu.sh", "--dry-run", *call], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=2300, stdin=subprocess.DEVNULL)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    summary = log[log.index("## summary"):]
    for stage in stages:
        m = re.search(rf"^{stage}: rc=(\d+) in \d+s$", summary, re.M)
        assert m, f"stage {stage} missing from the summary:\n{summary}"
        assert m.group(1) == "0", f"stage {stage} failed in the dry run:\n{(out / f'{stage}.md').read_text()[-3000:]}"
    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert [f for f in files if f.endswith(".md")] == sorted(f"{s}.md" for s in stages), files
    assert len(files) <= MAX_FILES_BACK and all((out / f).stat().st_size <= 16 << 20 for f in files), files
    summary = json.loads((out / "summary.json").read_text())  # the figures in one file, whichever stages ran
    assert set(summary) == SUMMARY_KEYS and len(summary["stages"]) == len(stages), summary
    if "decode" in stages:
        assert summary["card"].startswith("CPU (dry run") and summary["decode_ms_b1"] > 0, summary
        check = summary["graphs_vs_eager"]  # every bucket of the dry run's engines (max_num_seqs 4: 1, 2, 4)
        assert check["buckets"] == 3 and check["top1_equal"] == check["rows"] == 6, summary
    if "spec" in stages:  # the dry run's batch sizes 1 and 4; host syncs are counted on CUDA only
        assert set(summary["spec_step_over_plain"]) == {"chain3", "tree16", "tree32"}, summary
        assert all(set(r) == {"1", "4"} for r in summary["spec_step_over_plain"].values()), summary
        assert summary["spec_implied_speedup"]["best"] > 0 and "implied" in summary["spec_implied_speedup"]["tau_source"]
    if "decode" in stages:
        decode = (out / "decode.md").read_text()
        for mode in ("eager", "CUDA graphs", "graphs + overlap"):
            assert re.search(rf"^\| tiny \| 1 \| {re.escape(mode)} \| \d+\.\d+ \|", decode, re.M), decode
        assert "FAILED" not in decode
    if "load" in stages:  # a replica from the folder the stage wrote: ready, and it served a completion
        load = summary["start_from_disk"]
        assert load["start_to_ready_s"] > 0 and load["served"] == "200, 8 tokens", summary
    if "tests" in stages:
        tests = (out / "tests.md").read_text()
        assert re.search(r"\d+ skipped", tests) and "error" not in tests.lower(), tests  # collected, skipped, no build
    if "train" in stages:
        assert any(f.startswith("eagle3-head.tar.part-") for f in files), files  # the trained head comes back


def test_what_a_call_sends_fits_the_device_limit():
    """Tracked and untracked-not-ignored files, plus the carried wheels (.whl, when fetched)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.split(b"\0")
    size = sum((ROOT / os.fsdecode(p)).stat().st_size for p in listed if p and (ROOT / os.fsdecode(p)).is_file())
    wheels = sum(p.stat().st_size for p in (ROOT / ".whl").glob("*.whl")) if (ROOT / ".whl").is_dir() else 0
    assert size + wheels < MAX_TREE, f"tree {size / 2**20:.1f} MiB + wheels {wheels / 2**20:.1f} MiB"
    assert size < MAX_TREE - (16 << 20), f"tree {size / 2**20:.1f} MiB leaves under 16 MiB for the wheels"
