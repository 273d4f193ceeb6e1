"""A newcomer's first hour, replayed: clone the repository, run README.md's commands as
written (only the port moved), check every answer, print how long each took.

    python bench/newcomer.py                     # clone this checkout's HEAD into a temp folder
    python bench/newcomer.py --keep /tmp/nc      # keep the clone (its .venv makes a rerun warm)
    python bench/newcomer.py --full-loadtest     # the README's load test at its own length (60 s)

Steps: `git clone`; `make run PORT=P` (a fresh clone installs its .venv: minutes) until
`ready:`, its first lines printed as they come; the README's curl example (bash, port
replaced) must say Paris; the README's SDK example (its python block, port replaced) must
print Paris; the README's load test (shortened unless --full-loadtest) must report every
region; Ctrl-C; then `make run` again (warm: venv, kernels and built model in place), timed
to `ready:`. The figures go to docs/perf.md ("Start-up"). Never part of `make test`
(tests/replica/test_make_run.py checks the same commands on this checkout).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_block(span: int = 320) -> int:
    """A port P with P .. P + span free (the built-in topology's ports, shifted)."""
    for base in range(20000, 30000, span):
        socks = []
        try:
            for p in range(base, base + span):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise SystemExit("no free block of ports")


def readme_blocks(readme: str) -> tuple[str, str, str]:
    """(curl command, SDK python block, load-test command) as README.md writes them."""
    curl = re.search(r"```\n(curl http://127\.0\.0\.1:8000/v1/chat/completions.*?)\n```", readme, re.S).group(1)
    sdk = re.search(r"```python\n(from openai import OpenAI.*?)\n```", readme, re.S).group(1)
    lt = re.search(r"`(\.venv/bin/python -m loadtest --topology[^`]*)`", readme).group(1)
    return curl, sdk, lt


def make_run(clone: Path, port: int, env: dict) -> tuple[subprocess.Popen, float, list[str]]:
    t0 = time.monotonic()
    proc = subprocess.Popen(["make", "-s", "run", f"PORT={port}"], cwd=clone, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, stdin=subprocess.DEVNULL)
    lines = []
    for line in proc.stdout:
        line = line.rstrip("\n")
        lines.append(line)
        print(f"    | {line}", flush=True)
        if line.startswith("ready:"):
            return proc, time.monotonic() - t0, lines
    raise SystemExit(f"make run ended (code {proc.wait()}) before ready")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", type=Path, help="clone here and keep it (default: a temp folder, removed)")
    ap.add_argument("--full-loadtest", action="store_true", help="the README's load test at its own length")
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory(prefix="newcomer-") if args.keep is None else None
    clone = Path(tmp.name) / "edgechat" if tmp else args.keep
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["EDGECHAT_RUN_DIR"] = str(clone.parent / "run")
    figures = {}
    if not (clone / ".git").is_dir():
        t = time.monotonic()
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        figures["git clone"] = time.monotonic() - t
    rev = subprocess.run(["git", "-C", str(clone), "log", "-1", "--format=%h"], capture_output=True,
                         text=True).stdout.strip()
    curl, sdk, lt = readme_blocks((clone / "README.md").read_text())
    port = free_block()
    print(f"clone {clone} at {rev}; make run PORT={port}", flush=True)
    proc, figures["make run (first) to ready"], _ = make_run(clone, port, env)
    try:
        out = subprocess.run(["bash", "-c", curl.replace("8000", str(port))], capture_output=True, text=True,
                             timeout=120, env=env).stdout
        answer = json.loads(out)["choices"][0]["message"]["content"]
        print(f"curl: {answer!r}")
        assert "Paris" in answer, out
        out = subprocess.run([str(clone / ".venv/bin/python"), "-c", sdk.replace("8000", str(port))],
                             capture_output=True, text=True, timeout=120, env=env)
        print(f"SDK: {out.stdout.strip()!r}")
        assert out.returncode == 0 and "Paris" in out.stdout, out.stderr
        cmd = shlex.split(lt)
        if not args.full_loadtest:
            cmd[cmd.index("--duration") + 1] = "10"
        t = time.monotonic()
        out = subprocess.run(cmd, cwd=clone, capture_output=True, text=True, timeout=900, env=env)
        figures["load test"] = time.monotonic() - t
        assert out.returncode == 0, out.stderr
        report = json.loads((clone / "report" / "report.json").read_text())["runs"][0]["result"]
        regions = sorted({g["region"] for g in report["groups"]})
        print(f"load test: regions {regions}, {report['totals']['all']['completed']} requests completed")
        assert len(regions) >= 2, regions
    finally:
        stop(proc)
    proc, figures["make run (warm) to ready"], _ = make_run(clone, port, env)
    stop(proc)
    print(f"\n{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, clone of {rev}:")
    for k, v in figures.items():
        print(f"- {k}: {v:.1f} s")
    if tmp:
        tmp.cleanup()


if __name__ == "__main__":
    main()
