"""Two real replicas (default model) behind a proxy, for the drain tests (test_drain_handoff.py):
each replica optionally behind `ExportCutter`, a relay that passes everything but a KV export,
which it cuts at once (a source whose export breaks: the hand-off falls back to exact resume)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time

import httpx

from tests.edge_proxy.two_replicas import SECRET, _stop
from tests.replica.server import free_port, replica_server, wait_healthy

EXPORT = b"POST /v1/kv/export"


class ExportCutter:
    """A TCP relay to 127.0.0.1:`target`: every connection relayed both ways, except one whose
    request is a KV export: closed before the source sees it (`cut` counts them) while `armed`
    (from the start; False: it relays exports too). It reads only a connection's first request,
    so arming it closes the export connections it relays: a receiver keeps one alive (replica.api.
    kv_transport), and its next export would pass the check on it."""

    def __init__(self, target: int):
        self.target = target
        self.cut = 0
        self._armed = True
        self._live: set[socket.socket] = set()  # both ends of the export connections relayed
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def armed(self) -> bool:
        return self._armed

    @armed.setter
    def armed(self, on: bool) -> None:
        self._armed = on
        if on:
            with self._lock:
                for s in self._live:
                    with contextlib.suppress(OSError):
                        s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):  # the listener closed
            while True:
                client, _ = self._listener.accept()
                threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        first = b""
        with contextlib.suppress(OSError):
            first = client.recv(1 << 16)
        if not first or (self.armed and first.startswith(EXPORT)):
            self.cut += bool(first)
            client.close()
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target))
        except OSError:  # the replica exited
            client.close()
            return
        export = first.startswith(EXPORT)
        if export:
            with self._lock:
                self._live |= {client, upstream}
        upstream.sendall(first)
        back = threading.Thread(target=self._forward, args=(upstream, client), daemon=True)
        back.start()
        self._forward(client, upstream)
        back.join()
        if export:
            with self._lock:
                self._live -= {client, upstream}
        client.close()
        upstream.close()

    @staticmethod
    def _forward(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


def prefix_hit_tokens(url: str) -> float:
    """A replica's prompt tokens served from its prefix cache so far (its /metrics counter)."""
    auth = {"Authorization": f"Bearer {SECRET['EDGECHAT_REPLICA_SECRET']}"}
    for line in httpx.get(url + "/metrics", headers=auth, timeout=10).text.splitlines():
        if line.startswith("edgechat_replica_prefix_hit_tokens_total "):
            return float(line.split()[1])
    raise LookupError(f"{url}/metrics has no edgechat_replica_prefix_hit_tokens_total")


def proxy_counter(ws_url: str, name: str) -> float:
    """A proxy's counter (its /metrics)."""
    url = ws_url.replace("ws://", "http://").rsplit("/v1/", 1)[0] + "/metrics"
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise LookupError(f"{url} has no {name}")


def handoff_tokens(ws_url: str) -> float:
    """The tokens (prompt and generated) a proxy's drained streams had when they moved."""
    return proxy_counter(ws_url, "edgechat_proxy_handoff_tokens_total")


def hot_blocks(ws_url: str) -> float:
    """The blocks of drained replicas' hot chains the successors pulled."""
    return proxy_counter(ws_url, "edgechat_proxy_handoff_hot_blocks_total")


def both_ready(proxy: str, timeout: float = 60.0) -> None:
    """Poll the proxy's /healthz until it counts both replicas ready (it answers 200 from the first)."""
    deadline = time.monotonic() + timeout
    while httpx.get(proxy + "/healthz", timeout=5).json()["replicas_ready"] < 2:
        assert time.monotonic() < deadline, "the proxy never had both replicas ready"
        time.sleep(0.1)


@contextlib.contextmanager
def stack(cut_exports: bool = False, replica_args: tuple[str, ...] = ("--kv-memory-gb", "0.25"),
          handoff_budget: float | None = None, proxy_args: tuple[str, ...] = ()):
    """Replicas A and B and a proxy over them (`handoff_budget`: its --handoff-budget, else the
    default; `proxy_args`: more of its flags); yields the proxy's public WebSocket URL, {id: (url, process)} and the relays ({}
    unless `cut_exports`). bench/drain.py starts its own so."""
    with contextlib.ExitStack() as es:
        reps, relays = {}, {}
        for rid in ("A", "B"):
            url, proc = es.enter_context(replica_server("--replica-id", rid, *replica_args, env=SECRET))
            reps[rid] = (url, proc)
        port = free_port()
        cmd = [sys.executable, "-m", "edge_proxy", "--port", str(port), "--allow-anonymous", "--region", "test",
               "--stall-timeout", "3", *proxy_args] + (["--handoff-budget", str(handoff_budget)] if handoff_budget else [])
        for rid, (url, _) in reps.items():
            if cut_exports:
                relay = relays[rid] = ExportCutter(int(url.rsplit(":", 1)[1]))
                es.callback(relay.close)
                url = f"http://127.0.0.1:{relay.port}"
            cmd += ["--replica", url.replace("http://", "ws://") + "/v1/replica"]
        proxy = subprocess.Popen(cmd, env={**os.environ, **SECRET}, start_new_session=True)
        es.callback(_stop, proxy)
        wait_healthy(f"http://127.0.0.1:{port}", proxy)
        both_ready(f"http://127.0.0.1:{port}")
        yield f"ws://127.0.0.1:{port}/v1/stream", reps, relays
