"""The API process's hold on its engine process: spawn, connect, watch, restart.

The engine process (`python -m replica.engine.process`) connects back over a Unix
socket and opens with Hello; `ready` is set from then until it is lost. It is lost
when its socket closes (it exited or was killed) or when it says nothing for
`stall_s` (an idle engine reports Load every `load_report_interval_s`, so silence
means it hangs; it is then killed). Once lost, `on_lost(exit_code)` lets the
owner fail the requests in flight, and the process is started again after a
backoff that doubles from `backoff_min_s` to `backoff_max_s` (and starts over once
an engine has stayed up for `stable_s`). While it restarts `ready` is clear, so
`/healthz` answers 503 and new requests are refused.

Every engine process it starts gets the same shared-memory segment for KV frames
(`slots`, replica.kv_slots; its fd passed at spawn), mapped here at the first Hello.

The first start is different: if it fails, `start()` raises (a replica whose model
does not load should not come up at all).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import msgspec

from wire import protocol as P
from replica.config import EngineConfig
from replica.kv_slots import Slots

log = logging.getLogger("replica.engine")


class EngineUnavailable(ConnectionError):
    """The engine process is (re)starting: nothing can be sent to it now."""


class EngineSupervisor:
    def __init__(self, cfg: EngineConfig, replica_id: str, on_message: Callable[[object], None],
                 on_lost: Callable[[int | None], None], *, backoff_min_s: float = 0.5, backoff_max_s: float = 30.0,
                 stable_s: float = 60.0, stall_s: float = 60.0):
        self.cfg, self.replica_id = cfg, replica_id
        self.on_message, self.on_lost = on_message, on_lost
        self.backoff_min_s, self.backoff_max_s, self.stable_s = backoff_min_s, backoff_max_s, stable_s
        self.stall_s = max(stall_s, 4 * cfg.load_report_interval_s)
        self.ready = asyncio.Event()
        self.hello: P.Hello | None = None
        self.restarts = 0
        self.pid: int | None = None
        self._proc: subprocess.Popen | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._tmpdir = tempfile.TemporaryDirectory(prefix="edgechat-")
        self.slots = Slots()  # the shared segment KV frames cross in, handed to every engine process it starts
        self._last_rx = 0.0
        self._stopping = False

    # -- lifecycle -------------------------------------------------------------------
    async def start(self, timeout: float = 600.0) -> None:
        await self._launch(timeout)
        self._watcher = asyncio.create_task(self._watch(timeout))

    async def stop(self) -> None:
        self._stopping = True
        self.ready.clear()
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        await self._end_process(terminate=True)
        self._tmpdir.cleanup()
        self.slots.close()

    def send(self, frame: bytes) -> None:
        if not self.ready.is_set() or self._writer is None:
            raise EngineUnavailable("the engine process is restarting; retry on another replica or shortly")
        self._writer.write(frame)

    # -- one engine process ----------------------------------------------------------
    async def _launch(self, timeout: float) -> None:
        """Start an engine process and wait for its Hello; RuntimeError if it does not come."""
        path = os.path.join(self._tmpdir.name, "engine.sock")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        connected: asyncio.Future = asyncio.get_running_loop().create_future()

        def on_connect(reader, writer):
            if not connected.done():
                connected.set_result((reader, writer))

        server = await asyncio.start_unix_server(on_connect, path=path)
        self._proc = proc = subprocess.Popen([sys.executable, "-m", "replica.engine.process", "--socket", path,
                                              "--config", msgspec.json.encode(self.cfg).decode(),
                                              "--replica-id", self.replica_id, "--kv-slots-fd", str(self.slots.fd)],
                                             pass_fds=(self.slots.fd,))
        self.pid = proc.pid
        exited = asyncio.ensure_future(asyncio.to_thread(proc.wait))
        try:
            done, _ = await asyncio.wait([connected, exited], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if connected not in done:
                raise RuntimeError(f"engine process failed to start (exit code {proc.poll()})")
            reader, self._writer = connected.result()
            self._last_rx = time.monotonic()
            self._reader = asyncio.create_task(self._read(reader))
            hello = asyncio.ensure_future(self.ready.wait())
            await asyncio.wait([hello, self._reader], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            hello.cancel()
            if not self.ready.is_set():
                raise RuntimeError(f"engine process closed before it was ready (exit code {proc.poll()})")
        except BaseException:
            await self._end_process(terminate=False)
            raise
        finally:
            server.close()
            exited.cancel()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        codec = P.FrameCodec()
        while data := await reader.read(1 << 20):
            self._last_rx = time.monotonic()
            for msg in codec.feed(data):
                if isinstance(msg, P.Hello):
                    self.slots.mapped(msg.kv_slots, msg.kv_slot_bytes)
                    self.hello = msg
                    self.ready.set()
                try:
                    self.on_message(msg)
                except Exception:  # noqa: BLE001 - a consumer's bug must not cost the engine its link
                    log.exception("replica: handling the engine's %s failed", type(msg).__name__)

    async def _end_process(self, terminate: bool) -> int | None:
        """Close the socket (the engine exits at its end: it ignores SIGTERM: replica.lifetime)
        and make sure the process is gone; its exit code."""
        self.ready.clear()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.terminate() if terminate else proc.kill()
            try:
                await asyncio.wait_for(asyncio.to_thread(proc.wait), 10)
            except TimeoutError:
                proc.kill()
                await asyncio.to_thread(proc.wait)
        return proc.returncode

    # -- supervision -----------------------------------------------------------------
    async def _watch(self, start_timeout: float) -> None:
        backoff = self.backoff_min_s
        while True:
            up_since = time.monotonic()
            await self._until_lost()
            code = await self._end_process(terminate=False)
            log.error("engine process exited (code %s); restarting it in %.1f s", code, backoff)
            self.on_lost(code)
            if time.monotonic() - up_since > self.stable_s:
                backoff = self.backoff_min_s
            while True:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.backoff_max_s)
                try:
                    await self._launch(start_timeout)
                    break
                except RuntimeError as e:
                    log.error("engine restart failed: %s; next try in %.1f s", e, backoff)
            self.restarts += 1
            log.warning("engine process restarted (pid %d, restart %d)", self.pid, self.restarts)

    async def _until_lost(self) -> None:
        """Return when the engine's socket closes, or kill it when it has been silent for stall_s."""
        while True:
            done, _ = await asyncio.wait([self._reader], timeout=min(1.0, self.stall_s / 4))
            if done:
                return
            silent = time.monotonic() - self._last_rx
            if silent > self.stall_s:
                log.error("engine process silent for %.0f s: killing it", silent)
                self._proc.kill()
                return
