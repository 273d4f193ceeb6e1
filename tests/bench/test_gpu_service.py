"""bench/gpu_service.py's CPU dry run: a real replica (random weights of the smollm2-135m
preset, through the tokenizer folder the script writes) behind a real proxy, the
official openai SDK streaming at 1 and 4 concurrent streams (one round each); the table has a row per
stream count with finite figures, the exit status is 0, and nothing it started still
listens afterwards."""

from __future__ import annotations

import math
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cpu_dry_run(tmp_path):
    # One measured round of 8 tokens (the script's default is 3 rounds): every code path of a row runs, at
    # 1 and 4 streams; three rounds of 16 took 39 s of CPU and 75 s here, one of 8 24 s and 51-60 s (load 4-6).
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_service.py"), "--model", "smollm2-135m",
                        "--device", "cpu", "--max-tokens", "8", "--rounds", "1", "--streams", "1,4",
                        "--log-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-4000:]}"
    assert "edgechat service on cpu: smollm2-135m (random weights, float32)" in r.stdout
    rows = {}
    for line in r.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0].isdigit():
            rows[int(cells[0])] = [float(c) for c in cells[1:]]
    assert sorted(rows) == [1, 4], r.stdout
    for streams, (ttft50, ttft99, itl50, itl99, tok_s) in rows.items():
        assert all(math.isfinite(v) and v > 0 for v in (ttft50, ttft99, itl50, itl99, tok_s)), (streams, r.stdout)
        assert ttft50 <= ttft99 and itl50 <= itl99
    # every process it started is gone: neither port answers
    ports = re.search(r"starting the replica on :(\d+) .* and the proxy on :(\d+)", r.stderr)
    assert ports, r.stderr
    for port in map(int, ports.groups()):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"something still listens on :{port}"
    assert (tmp_path / "replica.log").is_file() and (tmp_path / "proxy.log").is_file()
