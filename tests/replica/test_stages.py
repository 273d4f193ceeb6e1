"""A replica says its start-up stages on stderr (replica.stages), in order, each with its time,
then ready once /healthz answers; a port already in use stops it at once, before the model loads."""

import io
import os
import socket
import subprocess
import sys
import threading

import httpx

from replica import stages
from tests.replica.server import SECRET, free_port, stop_group


def test_stage_lines_round_trip():
    assert stages.line("loading weights", 1.25) == "stage: loading weights 1.2 s"
    assert stages.parse("stage: loading weights 1.2 s\n") == ("loading weights", 1.2, "")
    assert stages.parse("stage: building kernels ... (about a minute)") == ("building kernels", None,
                                                                           " (about a minute)")
    for other in ("stage: ", "stage: Loading 1 s", "edgechat replica x: model y", "stages: ready 1.0 s"):
        assert stages.parse(other) is None


class _Out(io.StringIO):
    """An stderr that sets `said` when a "..." line arrives (from the stage's timer thread)."""

    def __init__(self):
        super().__init__()
        self.said = threading.Event()

    def write(self, s: str) -> int:
        n = super().write(s)
        if "..." in s:
            self.said.set()
        return n


def test_a_stage_says_when_it_ends_and_a_slow_one_says_so_first():
    out = _Out()
    st = stages.Stages(out, slow_s=0.0)
    with st.stage("building kernels", " (why)"):
        assert out.said.wait(30)  # still inside the stage: the "..." line came first
    st = stages.Stages(out, slow_s=60.0)
    with st.stage("warming up"):
        pass
    try:
        with st.stage("loading weights"):
            raise OSError("no such file")
    except OSError:
        pass
    lines = out.getvalue().splitlines()
    assert lines[0] == "stage: building kernels ... (why)"
    assert [stages.parse(ln)[:1] for ln in lines[1:]] == [("building kernels",), ("warming up",)]  # not the failed


def test_a_replica_alone_prints_its_stages_then_ready():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "replica", "--port", str(port), "--kv-memory-gb", "0.25",
                             "--cpu-threads", "1"], stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "EDGECHAT_REPLICA_SECRET": SECRET})
    try:
        said = []
        for ln in proc.stderr:  # read as it comes: "ready" is the last stage
            if (parsed := stages.parse(ln)) is not None:
                said.append(parsed)
                if parsed[0] == "ready":
                    break
        ends = [(name, seconds) for name, seconds, _ in said if seconds is not None]
        assert [name for name, _ in ends] == ["building kernels", "loading weights", "building engine", "warming up",
                                              "ready"]
        assert ends[-1][1] >= sum(s for _, s in ends[:-1]) - 0.5  # ready: the whole start, stages and the rest
        assert all(s is None for name, s, _ in said if (name, s) not in ends)  # the rest are "..." lines
        r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10, trust_env=False)
        assert r.status_code == 200  # ready means serving
    finally:
        stop_group(proc)
        proc.stderr.close()


def test_a_busy_port_stops_a_replica_before_its_model_loads():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "replica", "--port", str(port)], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "EDGECHAT_REPLICA_SECRET": SECRET})
    assert r.returncode == 1
    assert f"python -m replica: cannot listen on 127.0.0.1:{port}: Address already in use" in r.stderr
    assert "choose another --port" in r.stderr and "stage:" not in r.stderr and "Traceback" not in r.stderr
