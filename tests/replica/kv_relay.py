"""A TCP relay in front of a replica that cuts the answer after a set number of bytes: a source
that dies half-way through a KV export, at a moment set by the bytes that went through (an
event, never a timer). Used by tests/replica/api/test_kv_channel.py."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable


class CuttingRelay:
    """Relays one connection to 127.0.0.1:`target`; once `limit` bytes of the answer went back,
    calls `cut()` (the test kills the source there), then closes both sides. `done` is set then."""

    def __init__(self, target: int, limit: int, cut: Callable[[], None]):
        self.target, self.limit, self.cut = target, limit, cut
        self.done = threading.Event()
        self.relayed = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        client, _ = self._listener.accept()
        upstream = socket.create_connection(("127.0.0.1", self.target))
        threading.Thread(target=pipe, args=(client, upstream), daemon=True).start()
        try:
            while self.relayed < self.limit and (data := upstream.recv(1 << 16)):
                data = data[: self.limit - self.relayed]
                client.sendall(data)
                self.relayed += len(data)
            self.cut()
        finally:
            for s in (client, upstream, self._listener):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
            self.done.set()


def pipe(src: socket.socket, dst: socket.socket) -> None:
    """Forward src's bytes to dst until src ends, then end dst's sending side."""
    with contextlib.suppress(OSError):
        while data := src.recv(1 << 16):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


class CountingRelay:
    """Relays every connection to 127.0.0.1:`target` both ways, untouched; `accepted` counts them
    (a receiver that keeps its connection to a source alive opens one for many pulls)."""

    def __init__(self, target: int):
        self.target = target
        self.accepted = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):  # the listener closed
            while True:
                client, _ = self._listener.accept()
                self.accepted += 1
                upstream = socket.create_connection(("127.0.0.1", self.target))
                for src, dst in ((client, upstream), (upstream, client)):
                    threading.Thread(target=pipe, args=(src, dst), daemon=True).start()

    def close(self) -> None:
        self._listener.close()
