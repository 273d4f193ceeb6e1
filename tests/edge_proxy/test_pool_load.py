"""What a proxy believes a replica holds (edge_proxy.pool.ReplicaConn.effective_load), without
sockets: the replica's Load plus this proxy's requests that Load does not count, which the Load
names (`Load.seen_id`: the last of ours it had received). A proxy that sends X then Y, and gets
X's Load between, counts Y until Y's own Load comes; where the replica holds others' requests
too, the rule before the name lost Y for that hop."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from edge_proxy.pool import PoolConfig, ReplicaPool
from wire import protocol as P

pytestmark = pytest.mark.anyio
BS = 16


def connected_replica():
    pool = ReplicaPool(["ws://r0:8000/v1/replica"], PoolConfig(secret="s3cret"), SimpleNamespace())
    conn = pool.conns[0]
    conn.connected, conn.hello, conn.id = True, P.Hello("r0", "m", BS, 4096), "r0"  # no link: frames go nowhere
    return conn


def send(conn, uncached: int) -> str:
    gen = P.Generate("", list(range(uncached)), P.SamplingParams(max_tokens=8), "salt")
    return conn.start(SimpleNamespace(gen=gen, samples=None, ids=[]), gen, uncached)


def load(conn, running: int, waiting: int, seen_id: str = "") -> None:
    conn._dispatch([P.Load(running, waiting, 8, 8, waiting_tokens=0, seen_id=seen_id)], 0.0)


async def test_a_request_sent_after_the_one_a_load_answers_still_counts():
    conn = connected_replica()
    load(conn, 2, 0)  # two requests of other proxies running
    x, y = send(conn, 30), send(conn, 20)
    assert conn.effective_load() == 4.0
    load(conn, 2, 1, seen_id=x)  # X's Load, built before Y arrived: it counts X, not Y
    assert conn.effective_load() == 4.0  # the rule before the name: 3 (Y counted by nobody)
    assert (conn.pending_tokens, conn.load_view().unknown_ahead) == (20, 2)
    load(conn, 2, 2, seen_id=y)
    assert conn.effective_load() == 4.0
    assert (conn.pending_tokens, conn.load_view().unknown_ahead) == (0, 2)
    load(conn, 3, 1, seen_id=y)  # a later Load naming the same one: nothing more to take off
    assert (conn.effective_load(), conn.own_at_report) == (4.0, 2)
    conn.release(x, abort=False)  # X finished (its Finished came before the Load that drops it)
    load(conn, 2, 1, seen_id=y)
    assert (conn.effective_load(), conn.load_view().unknown_ahead) == (3.0, 2)


async def test_a_request_released_before_the_replica_saw_it_is_not_counted_twice():
    conn = connected_replica()
    load(conn, 1, 0)
    x, y = send(conn, 30), send(conn, 20)
    conn.release(y, abort=True)  # cancelled at once: its Abort follows its Generate
    load(conn, 1, 1, seen_id=x)
    assert conn.effective_load() == 2.0  # the foreign one and X
    load(conn, 1, 2, seen_id=y)  # the replica took Y before its Abort: counted there until then, once
    assert conn.effective_load() == 3.0
    assert list(conn.unseen) == []


async def test_a_replica_that_names_nothing_is_taken_to_count_every_request():
    conn = connected_replica()
    load(conn, 2, 0)
    send(conn, 30), send(conn, 20)
    load(conn, 2, 1)  # an older replica's Load (no seen_id): as before, it counts both
    assert (conn.effective_load(), conn.pending_tokens, list(conn.unseen)) == (3.0, 0, [])
    send(conn, 10)
    load(conn, 2, 1, seen_id="someone-else-7")  # one we never sent: the same
    assert (conn.effective_load(), list(conn.unseen)) == (3.0, [])


async def test_a_lost_connection_leaves_nothing_unseen():
    conn = connected_replica()
    load(conn, 0, 0)
    send(conn, 30)
    conn.pool.events = SimpleNamespace(on_lost=lambda *a: None)
    conn.lose("disconnect")
    assert (list(conn.unseen), conn.own_inflight, conn.pending_tokens) == ([], 0, 0)


async def test_its_own_new_conversations_count_in_the_chains_until_a_load_counts_them():
    """A proxy's new conversation (Generate.new_chain) sent to a replica counts in its `chains` at once,
    until a Load names it (`seen_id`: the replica counts a new one from the moment it has it, as it does
    its load); one released before counts no more."""
    conn = connected_replica()
    assert conn.chains() == -1  # no Load yet: unknown
    conn._dispatch([P.Load(0, 0, 8, 8, chains=3)], 0.0)

    def new(ids):
        gen = P.Generate("", ids, P.SamplingParams(max_tokens=8), "salt", new_chain=True)
        return conn.start(SimpleNamespace(gen=gen, samples=None, ids=[]), gen, len(ids))

    x, y = new([1] * 40), new([2] * 40)
    z = send(conn, 20)  # a later turn: no new chain
    assert conn.chains() == 5
    conn._dispatch([P.Load(2, 0, 8, 8, chains=4, seen_id=x)], 0.0)  # it has x (counted), not y yet
    assert conn.chains() == 5
    conn.release(y, abort=True)  # cancelled before the replica saw it
    assert conn.chains() == 4
    conn._dispatch([P.Load(2, 0, 8, 8, chains=4, seen_id=z)], 0.0)
    assert conn.chains() == 4 and not conn.fresh_chains
    conn._dispatch([P.Load(2, 0, 8, 8)], 0.0)  # a replica that reports no chains
    assert conn.chains() == -1
