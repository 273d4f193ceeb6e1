"""The Load a replica's API process publishes: the engine's last, plus the requests it sent
the engine that the engine had not yet taken when it built that Load.

Why: the engine reports its Load after a step ends, and reads new requests only between
steps. A request accepted during a step (up to most of a second on a loaded CPU) would be
invisible to every proxy until then, so another proxy process placing a new conversation
meanwhile sees the replica idle and sends it there too (docs/perf.md, "One region, several
proxies"). Publishing at once, the placement is seen one network hop later by every proxy.

Exact, not estimated: the engine counts the Generates it has taken (`Load.taken`); the
socket keeps order, so the first `taken - taken_before` of those sent are the ones it took,
and the rest are still queued on the socket: each adds 1 to `waiting` and its uncached
prompt tokens to `waiting_tokens`. A request therefore counts exactly once, queued here or
in the engine's own figures, never both and never neither:

    published.waiting = engine.waiting + len(queued)      (queued: sent, not yet taken)

The proxy that placed the request counts it from `start` on (own_inflight) and takes the
first Load after that as counting it (own_at_report = own_inflight), which holds now that the
Load answering a submit counts it (edge_proxy.pool.ReplicaConn.effective_load).
"""

from __future__ import annotations

from collections import deque

import msgspec

from wire import protocol as P


class QueuedLoad:
    __slots__ = ("engine", "sent", "queued", "queued_tokens")

    def __init__(self):
        self.engine: P.Load | None = None  # the engine's last Load
        self.sent = 0  # Generates sent to the engine since it started
        self.queued: deque[int] = deque()  # uncached prompt tokens of those it had not taken, in order sent
        self.queued_tokens = 0  # their sum

    def sent_one(self, uncached_tokens: int) -> None:
        self.sent += 1
        self.queued.append(uncached_tokens)
        self.queued_tokens += uncached_tokens

    def from_engine(self, load: P.Load) -> None:
        """The engine's Load: those it took by then (load.taken) leave the queue."""
        took = load.taken - (self.sent - len(self.queued))
        assert 0 <= took <= len(self.queued), (load.taken, self.sent, len(self.queued))
        for _ in range(took):
            self.queued_tokens -= self.queued.popleft()
        self.engine = load

    def reset(self) -> None:
        """The engine process is gone: its successor starts counting from zero."""
        self.engine = None
        self.sent = 0
        self.queued.clear()
        self.queued_tokens = 0

    def current(self, draining: bool) -> P.Load | None:
        """The Load to publish (None before the engine's first)."""
        ld = self.engine
        if ld is None:
            return None
        return msgspec.structs.replace(ld, waiting=ld.waiting + len(self.queued),
                                       waiting_tokens=ld.waiting_tokens + self.queued_tokens, draining=draining)
