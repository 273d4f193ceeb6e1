"""`make run` as README.md tells a newcomer: the service (two regions of proxies and replicas on
the default model) says where its logs go and each replica's start-up stages, answers the
README's curl sensibly, takes MODEL_PATH / REPLICA_ARGS / PROXY_ARGS, and the README's load
test finds it at a moved PORT and loads both regions."""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from replica.hf_checkpoint import resolve_model
from tests.replica.server import free_port_range, stop_group

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
STAGES = ["building kernels", "loading weights", "building engine", "warming up"]


def readme_curl_body() -> dict:
    """The JSON body of the README's first curl example."""
    return json.loads(re.search(r"curl http://127\.0\.0\.1:8000/v1/chat/completions .*?-d '(\{.*?\})'", README,
                                re.S).group(1))


def readme_loadtest() -> list[str]:
    """The README's load-test command, after `python -m loadtest`."""
    cmd = re.search(r"`\.venv/bin/python -m loadtest (--topology [^`]*)`", README).group(1)
    return shlex.split(cmd)


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_run_as_the_readme_says(tmp_path):
    # The built-in topology uses ports PORT .. PORT + 305 (regions/builtin.toml, shifted).
    port = free_port_range(320)
    gguf = resolve_model("default", config_only=True)  # the default model, named by its file: MODEL_PATH reaches
    env = {**os.environ, "EDGECHAT_RUN_DIR": str(tmp_path / "run")}
    proc = subprocess.Popen(["make", "-s", "run", f"PORT={port}", f"MODEL_PATH={gguf}",
                             "REPLICA_ARGS=--max-num-seqs 16 --kv-memory-gb 0.25",
                             "PROXY_ARGS=--allowed-origin http://app.test"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines = []
        for line in proc.stdout:  # as it comes, until the launcher says everything is ready
            lines.append(line.rstrip("\n"))
            if line.startswith("ready:"):
                break
        else:
            raise AssertionError("make run ended before ready:\n" + "\n".join(lines))
        assert lines[0].startswith("regions: logs in ") and "starting 3 replicas" in lines[0]
        for rep in ("eu-0", "eu-1", "us-0"):
            done = [m.group(1) for ln in lines if (m := re.fullmatch(rf"  {rep}: ([a-z ]+) \d+\.\d s", ln))]
            assert done == STAGES, (rep, lines)
            ready = next(i for i, ln in enumerate(lines) if re.match(rf"replica +{rep} .* ready in", ln))
            assert all(i < ready for i, ln in enumerate(lines) if ln.startswith(f"  {rep}: "))
        url = f"http://127.0.0.1:{port}"

        # The README's curl, as written but for the port: a sensible answer at temperature 0.
        r = httpx.post(url + "/v1/chat/completions", json=readme_curl_body(), timeout=120, trust_env=False)
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
        # MODEL_PATH, PROXY_ARGS, REPLICA_ARGS reached the processes.
        r = httpx.get(url + "/v1/models", headers={"Origin": "http://app.test"}, timeout=30, trust_env=False)
        assert [m["id"] for m in r.json()["data"]] == [os.path.basename(gguf)]
        assert r.headers["access-control-allow-origin"] == "http://app.test"
        for pid in (int(m.group(1)) for ln in lines if (m := re.search(r"^replica .*\(pid (\d+)", ln))):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            assert argv[argv.index("--model") + 1] == gguf and "--max-num-seqs\x0016" in "\0".join(argv)

        # The README's load test as written but shorter: it finds this launch at its PORT, both regions loaded.
        args = readme_loadtest()
        assert args[:3] == ["--topology", "--rate", "0.2"] and "--out" in args
        short = ["--topology", "--rate", "2", "--requests", "4", "--workload", "random", "--output-tokens", "4,8",
                 "--out", str(tmp_path / "report"), "--quiet", "--no-plots"]
        lt = subprocess.run([sys.executable, "-m", "loadtest", *short], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
        assert lt.returncode == 0, lt.stderr
        result = json.loads((tmp_path / "report" / "report.json").read_text())["runs"][0]["result"]
        assert {g["region"] for g in result["groups"]} == {"eu", "us"}, lt.stdout
        assert result["totals"]["all"]["completed"] == 4
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the launcher stops everything
        try:
            proc.wait(60)
        finally:
            stop_group(proc)
            proc.stdout.close()
    assert not list((tmp_path / "run").glob("*.json"))  # its launch is no longer listed
