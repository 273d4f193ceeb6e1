"""Serving: uvicorn (uvloop, httptools, sans-I/O websockets) with a graceful drain,
and several worker processes on one port (SO_REUSEPORT) where one core is not enough.

Drain on SIGTERM/SIGINT: stop listening (new connections are refused, so a load
balancer or client moves on), refuse new requests on open connections with
`shutting_down`, let every open stream finish (up to `drain_timeout_s`), then shut
uvicorn down. A second signal skips the wait.

Connections: uvicorn's HTTP and WebSocket protocols report to the app's
`ConnectionGuard` (caps per proxy and per source address, header/body timeouts,
descriptor reserve; see `connections.py`).

Drain timeout: streams still open when `drain_timeout_s` passes are each failed
with `shutting_down` (an error frame per request) before the sockets close.

Workers: each process binds its own SO_REUSEPORT socket, so the kernel spreads
connections across them; each has its own replica connections.
Every worker routes alike (routing reads the request and the replicas' reports,
never a worker's memory), and each enforces its share of every key's limits
(`limits.RegionShare`: 1 / (pods x workers)). Their
metrics are one: the parent makes a fresh multiprocess folder (under
$PROMETHEUS_MULTIPROC_DIR when set, else the system's temporary folder) and names
it in the workers' PROMETHEUS_MULTIPROC_DIR, so a scrape of any worker sums every
worker's (edge_proxy.metrics); a worker that exits is marked dead there (its
in-flight gauge leaves the sum, its counts stay), and the folder goes when all
have exited.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
from multiprocessing.connection import wait as wait_for

import uvicorn
from prometheus_client.multiprocess import mark_process_dead
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from edge_proxy import protocol as pp
from edge_proxy.app import EdgeApp, build_proxy, create_app
from edge_proxy.config import ProxyConfig
from edge_proxy.connections import guarded_protocols
from wire.metrics import MULTIPROC_ENV, multiprocess_dir

log = logging.getLogger("edge_proxy")


def _loop() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A listening socket; with `reuse_port`, others may bind the same port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def uvicorn_config(app: EdgeApp, cfg: ProxyConfig) -> uvicorn.Config:
    """uvicorn (httptools, sans-I/O websockets) with its protocols reporting to `app.guard`."""
    http, ws = guarded_protocols(HttpToolsProtocol, WebSocketsSansIOProtocol, app.guard)
    return uvicorn.Config(app, loop=_loop(), http=http, ws=ws, lifespan="on",
                          ws_max_size=cfg.max_frame_bytes, ws_per_message_deflate=False, ws_ping_interval=20.0,
                          ws_ping_timeout=20.0, access_log=False, log_level=cfg.log_level,
                          timeout_graceful_shutdown=5, ssl_certfile=cfg.ssl_certfile or None,
                          ssl_keyfile=cfg.ssl_keyfile or None)


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first exit signal drains the proxy before shutting down."""

    def __init__(self, config: uvicorn.Config, proxy):
        super().__init__(config)
        self.proxy = proxy
        self._drain_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig, frame) -> None:
        if self._loop is None or self._drain_task is not None or self.should_exit:
            super().handle_exit(sig, frame)
            return
        self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = self._loop.create_task(self.drain())

    async def drain(self) -> None:
        timeout = self.proxy.cfg.drain_timeout_s
        for server in self.servers:
            server.close()  # stop listening: new connections are refused from here on
        log.info("draining: %d streams open, waiting up to %g s", len(self.proxy.streams), timeout)
        if not await self.proxy.drain(timeout):
            log.warning("drain timed out with %d streams open; failing them", len(self.proxy.streams))
            self.proxy.fail_all(pp.SHUTTING_DOWN, f"the proxy shut down (drain timeout of {timeout:g} s passed)")
            await asyncio.sleep(0)  # error frames are written at the end of this loop turn, before the close
        self.should_exit = True


def serve(cfg: ProxyConfig, sock: socket.socket | None = None) -> None:
    """Run one worker in this process until drained."""
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per /healthz poll otherwise
    proxy = build_proxy(cfg)
    server = DrainingServer(uvicorn_config(create_app(proxy), cfg), proxy)
    if sock is None:
        sock = bind(cfg.host, cfg.port, reuse_port=cfg.workers > 1)
    http, ws = ("https", "wss") if cfg.ssl_certfile else ("http", "ws")
    print(f"edge_proxy listening on {http}://{cfg.host}:{sock.getsockname()[1]} "
          f"(chat page /, {ws}:// /v1/stream, OpenAI /v1/chat/completions)", flush=True)
    server.run(sockets=[sock])


def _worker(cfg: ProxyConfig) -> None:
    serve(cfg, bind(cfg.host, cfg.port, reuse_port=True))


def serve_workers(cfg: ProxyConfig) -> int:
    """`cfg.workers` processes sharing the port; signals are forwarded; returns the worst exit code."""
    if cfg.workers == 1:
        serve(cfg)
        return 0
    folder = tempfile.mkdtemp(prefix="edge_proxy-metrics-", dir=multiprocess_dir())
    os.environ[MULTIPROC_ENV] = folder  # what the spawned workers' prometheus_client finds when imported
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(cfg,), name=f"edge_proxy-{i}") for i in range(cfg.workers)]
    for p in procs:
        p.start()

    def forward(sig, frame):
        # SIGTERM goes to every worker. A terminal's Ctrl-C already reaches the whole
        # process group, so SIGINT is not forwarded (a second signal would skip the drain).
        if sig == signal.SIGTERM:
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGTERM)

    prev = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        running = {p.sentinel: p for p in procs}
        while running:
            for sentinel in wait_for(list(running)):
                p = running.pop(sentinel)
                p.join()
                mark_process_dead(p.pid, folder)
    finally:
        for s, h in prev.items():
            signal.signal(s, h)
        shutil.rmtree(folder, ignore_errors=True)
    return max((p.exitcode or 0) for p in procs)
