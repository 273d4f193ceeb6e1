"""Two real replicas (default model) and a proxy over them, as separate processes: the
stack of test_real_replicas and test_real_replica_chaos; `region`: several proxies over
them (test_region_real)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

from tests.replica.server import free_port, replica_servers, wait_healthy

SECRET = {"EDGECHAT_REPLICA_SECRET": "e2e-secret"}  # test_real_replica_chaos presents it to /metrics


@contextlib.contextmanager
def stack():
    """Replicas A and B and a proxy over them, as separate processes."""
    with region(1) as (urls, reps):
        yield urls[0], reps


@contextlib.contextmanager
def region(proxies: int, *proxy_args: str):
    """Replicas A and B and `proxies` proxies over them (one region), as separate processes;
    yields the proxies' public WebSocket URLs and the replicas {id: (url, process)}."""
    with contextlib.ExitStack() as es:
        ids = ("A", "B")
        started = es.enter_context(replica_servers(*[("--replica-id", rid, "--kv-memory-gb", "0.25") for rid in ids],
                                                   env=SECRET))
        reps = dict(zip(ids, started))
        urls = []
        for _ in range(proxies):
            port = free_port()
            cmd = [sys.executable, "-m", "edge_proxy", "--port", str(port), "--allow-anonymous", "--region", "test",
                   "--stall-timeout", "3", *proxy_args]
            for url, _ in reps.values():
                cmd += ["--replica", url.replace("http://", "ws://") + "/v1/replica"]
            proxy = subprocess.Popen(cmd, env={**os.environ, **SECRET}, start_new_session=True)
            es.callback(_stop, proxy)
            wait_healthy(f"http://127.0.0.1:{port}", proxy)
            urls.append(f"ws://127.0.0.1:{port}/v1/stream")
        yield urls, reps


def _stop(proxy: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proxy.pid, signal.SIGTERM)
    proxy.wait(30)
