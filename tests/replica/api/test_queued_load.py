"""The Load a replica's API process publishes (replica.api.queued_load), socket-free: a request
sent to the engine counts once, queued until the engine's Load says it was taken, then in the
engine's own figures; never both, never neither."""

import pytest

from wire import protocol as P
from replica.api.queued_load import QueuedLoad


def engine_load(waiting: int, taken: int, running: int = 0, waiting_tokens: int = 0) -> P.Load:
    return P.Load(running=running, waiting=waiting, free_blocks=8, total_blocks=8, waiting_tokens=waiting_tokens,
                  taken=taken)


def test_nothing_is_published_before_the_engines_first_load():
    q = QueuedLoad()
    q.sent_one(30)
    assert q.current(False) is None


def test_a_request_counts_once_queued_then_once_in_the_engines_figures():
    q = QueuedLoad()
    q.from_engine(engine_load(0, 0))
    q.sent_one(30)
    q.sent_one(20)
    ld = q.current(False)
    assert (ld.waiting, ld.waiting_tokens) == (2, 50)
    # the engine's step ended having taken the first only (the second came during it): it counts one
    q.from_engine(engine_load(0, 1, running=1))
    ld = q.current(False)
    assert (ld.running, ld.waiting, ld.waiting_tokens) == (1, 1, 20)
    q.from_engine(engine_load(1, 2, running=1, waiting_tokens=20))
    ld = q.current(True)
    assert (ld.running, ld.waiting, ld.waiting_tokens, ld.draining) == (1, 1, 20, True)


def test_a_restarted_engine_counts_from_zero():
    q = QueuedLoad()
    q.from_engine(engine_load(0, 0))
    q.sent_one(30)
    q.reset()
    assert q.current(False) is None
    q.from_engine(engine_load(0, 0))
    assert q.current(False).waiting == 0


def test_an_engine_that_took_more_than_was_sent_is_a_broken_invariant():
    q = QueuedLoad()
    q.sent_one(30)
    with pytest.raises(AssertionError):
        q.from_engine(engine_load(0, 2))
