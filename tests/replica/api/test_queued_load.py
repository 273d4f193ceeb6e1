"""The Load a replica's API process publishes (replica.api.queued_load), socket-free: a request
sent to the engine counts once, queued until the engine's Load says it was taken, then in the
engine's own figures; never both, never neither."""

import logging

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


def test_a_restart_seen_only_in_the_count_resyncs_and_warns_once(caplog):
    """An engine restarted without reset() (its count back at zero), then a Load from before
    the restart arriving late: the relay goes on, no request is counted twice."""
    q = QueuedLoad()
    q.from_engine(engine_load(0, 0))
    for u in (30, 20, 10):
        q.sent_one(u)
    q.from_engine(engine_load(0, 1, running=1))  # the old engine took the first
    with caplog.at_level(logging.DEBUG, logger="replica.engine"):
        q.from_engine(engine_load(0, 0))  # the new engine: taken back at zero
        ld = q.current(False)
        assert (ld.running, ld.waiting, ld.waiting_tokens) == (0, 0, 0)  # its figures as they are
        q.sent_one(40)
        assert (q.current(False).waiting, q.current(False).waiting_tokens) == (1, 40)
        q.from_engine(engine_load(0, 3, running=1))  # a late Load of the old engine: ahead of what was sent
        ld = q.current(False)
        assert (ld.running, ld.waiting, ld.waiting_tokens) == (1, 0, 0)
        q.sent_one(50)
        q.from_engine(engine_load(1, 3, running=1, waiting_tokens=40))  # the new one's again, the 50 not taken
        ld = q.current(False)
        assert (ld.running, ld.waiting, ld.waiting_tokens) == (1, 2, 90)
        q.from_engine(engine_load(0, 4, running=2))  # it took it: counted once
        ld = q.current(False)
        assert (ld.running, ld.waiting, ld.waiting_tokens) == (2, 0, 0)
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [lv for lv, _ in said] == [logging.WARNING, logging.DEBUG]
    assert "took 0 requests, where 3 were sent and 1 taken" in said[0][1]
    assert q.resyncs == 2
    q.reset()  # a restart seen: the next contradiction is said at warning again
    with caplog.at_level(logging.WARNING, logger="replica.engine"):
        q.sent_one(5)
        q.from_engine(engine_load(0, 2))
    assert [r.levelno for r in caplog.records[len(said):]] == [logging.WARNING]
    assert q.current(False).waiting == 0


def test_an_engine_that_took_more_than_was_sent_is_counted_as_it_says():
    q = QueuedLoad()
    q.sent_one(30)
    q.from_engine(engine_load(0, 2, running=2))
    ld = q.current(False)
    assert (ld.running, ld.waiting, ld.waiting_tokens) == (2, 0, 0)
    q.sent_one(20)
    assert q.current(False).waiting == 1
    q.from_engine(engine_load(0, 3, running=3))
    assert (q.current(False).waiting, q.resyncs) == (0, 1)


def test_a_new_conversation_counts_in_the_chains_queued_then_in_the_engines():
    q = QueuedLoad()
    q.from_engine(P.Load(0, 0, 8, 8, chains=2))
    q.sent_one(30, new_chain=True)
    q.sent_one(20)  # a later turn
    assert q.current(False).chains == 3
    q.from_engine(P.Load(1, 1, 8, 8, taken=1, chains=3))  # the engine has it (waiting or prefilling)
    assert q.current(False).chains == 3
    q.from_engine(P.Load(2, 0, 8, 8, taken=2))  # an engine that counts none: none added
    assert q.current(False).chains == -1
