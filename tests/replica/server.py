"""Start a real replica (`python -m replica`) on a free port for tests (`replica_servers`: several at
once); the suite's free-port helpers (`free_port`, `free_port_range`) and a replica's metrics (`scrape`,
`idle_within`)."""

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

SECRET = "test-replica-secret"  # every replica requires one; tests start theirs with this
AUTH = {"Authorization": f"Bearer {SECRET}"}


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` right now (the kernel picks it: bind to port 0). The one
    free-port helper of the suite; `free_port_range` for a block of consecutive ports."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_range(span: int) -> int:
    """A base port B with B..B+span-1 all free, below the kernel's ephemeral range
    (so no outgoing connection takes one of them while a topology starts)."""
    rng = random.Random()
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    top = min(32000, ephemeral_low) - span
    for _ in range(200):
        base = rng.randrange(min(20000, top - 1000), top)
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


def _spawn(args: tuple[str, ...], cmd: list[str] | None, cwd: str | None, env: dict | None,
           span: int) -> tuple[str, subprocess.Popen]:
    """Start a replica (see `replica_server`), not waiting for it: (its base URL, its process)."""
    port = free_port_range(span) if span > 1 else free_port()
    cmd = [a.replace("{port}", str(port)) for a in cmd] if cmd else [
        sys.executable, "-m", "replica", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, "EDGECHAT_REPLICA_SECRET": SECRET, **(env or {})},
                            start_new_session=True)
    return f"http://127.0.0.1:{port}", proc


@contextlib.contextmanager
def replica_server(*args: str, cmd: list[str] | None = None, cwd: str | None = None, env: dict | None = None,
                   span: int = 1):
    """Yield the base URL of a running replica; stop its whole process group after.
    With `cmd`, "{port}" in its arguments is replaced by the chosen free port; `span`
    reserves that many consecutive free ports from it (a whole topology). The replica's
    secret is `SECRET` (send `AUTH`) unless `env` sets EDGECHAT_REPLICA_SECRET."""
    url, proc = _spawn(args, cmd, cwd, env, span)
    try:
        wait_healthy(url, proc)
        yield url, proc
    finally:
        stop_group(proc)


@contextlib.contextmanager
def replica_servers(*args_each: tuple[str, ...], env: dict | None = None):
    """Several replicas (one tuple of `python -m replica` arguments each) started together, then each
    waited for: their starts overlap (each is mostly one process importing torch and loading the model,
    so on two cores two take about as long as one). Yields [(url, process)] in the order given; stops
    every process group after, also when one fails to start."""
    with contextlib.ExitStack() as es:
        started = []
        for args in args_each:
            url, proc = _spawn(args, None, None, env, 1)
            es.callback(stop_group, proc)
            started.append((url, proc))
        for url, proc in started:
            wait_healthy(url, proc)
        yield started


def engine_pid(api_pid: int) -> int:
    """The engine process of a replica's API process (its child running replica.engine.process)."""
    with open(f"/proc/{api_pid}/task/{api_pid}/children") as f:
        children = [int(p) for p in f.read().split()]
    for pid in children:
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"replica.engine.process" in f.read():
                return pid
    raise LookupError(f"process {api_pid} has no engine process")


def scrape(url: str) -> dict[str, float]:
    """A replica's unlabelled /metrics values by name."""
    out = {}
    for line in httpx.get(url + "/metrics", headers=AUTH, timeout=10).text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def idle_within(url: str, bound_s: float) -> float:
    """Seconds until /metrics shows nothing running and no KV block in use (fails past bound_s)."""
    t0 = time.perf_counter()
    while True:
        m = scrape(url)
        if m["edgechat_replica_running"] == 0 and m["edgechat_replica_waiting"] == 0 \
                and m["edgechat_replica_kv_usage"] == 0:
            return time.perf_counter() - t0
        assert time.perf_counter() - t0 < bound_s, f"still busy after {bound_s} s: {m}"
        time.sleep(0.01)
