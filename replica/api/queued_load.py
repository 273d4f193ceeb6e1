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
    published.chains  = engine.chains + those of queued that start a conversation (Generate.new_chain)

The proxy that placed the request counts it from `start` on (own_inflight) and takes the
first Load after that as counting it (own_at_report = own_inflight), which holds now that the
Load answering a submit counts it (edge_proxy.pool.ReplicaConn.effective_load).

A restarted engine counts `taken` from zero again. The supervisor makes that safe by order
(replica.api.engine_supervisor._watch): the old engine's reader is cancelled and awaited, and
nothing can be sent (`ready` clear) before `on_lost` calls `reset()`, so no Load of the old
engine comes after it and the new one's first Load counts from the same zero. Should a Load
ever disagree anyway (its `taken` behind what an earlier Load said, or ahead of what was
sent), `from_engine` takes the engine's figures as they are: nothing is left queued and the
count goes on from its `taken`, with one warning per engine; a request sent meanwhile and not
yet taken is uncounted until the engine takes it, never counted twice, and the relay (this
runs on the API process's dispatch path) goes on. The engine's Hello resets the count too
(replica.api.engine_client): nothing can reach an engine before it.
"""

from __future__ import annotations

import logging
from collections import deque

import msgspec

from wire import protocol as P

log = logging.getLogger("replica.engine")


class QueuedLoad:
    __slots__ = ("engine", "sent", "queued", "queued_tokens", "queued_new", "resyncs", "_warned")

    def __init__(self):
        self.engine: P.Load | None = None  # the engine's last Load
        self.sent = 0  # Generates sent to the engine since it started
        self.queued: deque[tuple[int, bool]] = deque()  # of those it had not taken, in order sent: (uncached prompt
        #                                                 tokens, whether it starts a conversation)
        self.queued_tokens = 0  # their tokens
        self.queued_new = 0  # those that start a conversation
        self.resyncs = 0  # Loads whose `taken` contradicted the count (see the module's docstring)
        self._warned = False  # said so at warning for this engine (later ones at debug)

    def sent_one(self, uncached_tokens: int, new_chain: bool = False) -> None:
        self.sent += 1
        self.queued.append((uncached_tokens, new_chain))
        self.queued_tokens += uncached_tokens
        self.queued_new += new_chain

    def from_engine(self, load: P.Load) -> None:
        """The engine's Load: those it took by then (load.taken) leave the queue."""
        before = self.sent - len(self.queued)  # taken by the engine's previous Load
        took = load.taken - before
        if 0 <= took <= len(self.queued):
            for _ in range(took):
                u, new = self.queued.popleft()
                self.queued_tokens -= u
                self.queued_new -= new
        else:
            self._resync(load.taken, before)
        self.engine = load

    def _resync(self, taken: int, before: int) -> None:
        """A Load whose count contradicts ours (a restarted engine's, or one from before a
        restart): count from the engine's figures, nothing queued."""
        self.resyncs += 1
        level = logging.DEBUG if self._warned else logging.WARNING
        self._warned = True
        log.log(level, "replica: the engine's Load says it took %d requests, where %d were sent and %d taken by "
                "its previous Load (an engine restarted unseen, or a Load from before a restart); its figures "
                "stand as they are, the %d queued are no longer counted", taken, self.sent, before, len(self.queued))
        self.sent = taken
        self.queued.clear()
        self.queued_tokens = self.queued_new = 0

    def reset(self) -> None:
        """The engine process is gone: its successor starts counting from zero."""
        self.engine = None
        self.sent = 0
        self.queued.clear()
        self.queued_tokens = self.queued_new = 0
        self._warned = False

    def current(self, draining: bool) -> P.Load | None:
        """The Load to publish (None before the engine's first)."""
        ld = self.engine
        if ld is None:
            return None
        return msgspec.structs.replace(ld, waiting=ld.waiting + len(self.queued),
                                       waiting_tokens=ld.waiting_tokens + self.queued_tokens, draining=draining,
                                       chains=ld.chains + self.queued_new if ld.chains >= 0 else -1)
