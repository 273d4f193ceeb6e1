"""Real proxies (`python -m edge_proxy`) as subprocesses over real replicas, for the client tests:
started on a given port (so one can be killed and started again where its clients reconnect),
and a self-signed certificate made with openssl."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

from tests.replica.server import SECRET, free_port, stop_group, wait_healthy


def replica_ws(http_url: str) -> str:
    return http_url.replace("https://", "wss://").replace("http://", "ws://") + "/v1/replica"


def start_proxy(port: int, replicas: list[str], *args: str, env: dict | None = None,
                scheme: str = "http") -> subprocess.Popen:
    """`python -m edge_proxy` on `port` over `replicas` (http(s) URLs of replicas started by
    tests.replica.server, whose secret it presents), healthy on return."""
    cmd = [sys.executable, "-m", "edge_proxy", "--port", str(port), "--healthz-interval", "0.5", *args]
    for r in replicas:
        cmd += ["--replica", replica_ws(r)]
    proc = subprocess.Popen(cmd, env={**os.environ, "EDGECHAT_REPLICA_SECRET": SECRET, **(env or {})},
                            start_new_session=True)
    try:
        wait_healthy(f"{scheme}://127.0.0.1:{port}", proc, timeout=60, verify=False)
    except BaseException:
        stop_group(proc)
        raise
    return proc


@contextlib.contextmanager
def proxy(replicas: list[str], *args: str, env: dict | None = None, port: int | None = None):
    """A running proxy: yields (port, process); stopped (SIGTERM, then SIGKILL) after."""
    port = port or free_port()
    proc = start_proxy(port, replicas, *args, env=env)
    try:
        yield port, proc
    finally:
        stop_group(proc, timeout=10)


def self_signed(folder) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and localhost, and its key (PEM files in `folder`)."""
    cert, key = str(folder / "cert.pem"), str(folder / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", key, "-out", cert],
                   check=True, capture_output=True)
    return cert, key
