"""The launcher's processes as the tests see them: whether a process group is still
alive, and `python -m regions up` run until ready (test_launch, test_supervise)."""

import contextlib
import os
import re
import signal
import subprocess
import sys

from tests.regions.ports import free_block, stub_topology


def alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)  # any process left in the group?
        return True
    except ProcessLookupError:
        return False


@contextlib.contextmanager
def cli_up(tmp_path, *args: str, env: dict | None = None):
    """`python -m regions up` on a stub topology (its file `tmp_path/t.toml`; `args`: more
    flags), read until ready: (process, its lines so far, the pids it printed); the
    process group is killed if the test leaves it up. Its run dir (regions.running) is
    `tmp_path/run` unless `env` names one."""
    path = tmp_path / "t.toml"
    path.write_text(stub_topology(free_block(12)))
    env = {**os.environ, "EDGECHAT_RUN_DIR": str(tmp_path / "run"), **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "regions", "up", str(path), "--log-dir", str(tmp_path / "logs"),
                             *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line.rstrip())
            if line.startswith("ready:"):
                break
        else:
            raise AssertionError("launcher ended before ready:\n" + "\n".join(lines))
        yield proc, lines, [int(m.group(1)) for ln in lines if (m := re.search(r"\(pid (\d+)", ln))]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()  # a failed start must not leave its pipe to a later test's garbage collection
