"""Start a real replica (`python -m replica`) on a free port for tests."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_range(span: int) -> int:
    """A base port B with B..B+span-1 all free, below the kernel's ephemeral range
    (so no outgoing connection takes one of them while a topology starts)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32000 - span)
        try:
            with contextlib.ExitStack() as es:
                for p in range(base, base + span):
                    s = es.enter_context(socket.socket())
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {span} consecutive free ports")


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 240.0, verify: bool = True) -> None:
    """Poll /healthz until the engine reports ready (model load takes seconds); `verify=False`
    for an https:// server with a self-signed certificate."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/healthz", timeout=2, verify=verify).status_code == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout}s")


def stop_group(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM the process group started with `start_new_session=True`; SIGKILL it after `timeout`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def replica_server(*args: str, cmd: list[str] | None = None, cwd: str | None = None, env: dict | None = None,
                   span: int = 1):
    """Yield the base URL of a running replica; stop its whole process group after.
    With `cmd`, "{port}" in its arguments is replaced by the chosen free port; `span`
    reserves that many consecutive free ports from it (a whole topology)."""
    port = free_port_range(span) if span > 1 else free_port()
    cmd = [a.replace("{port}", str(port)) for a in cmd] if cmd else [
        sys.executable, "-m", "replica", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, **(env or {})}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url, proc
    finally:
        stop_group(proc)
