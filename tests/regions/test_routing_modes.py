"""Routing modes for --compare-routing, on synthetic candidates."""

import pytest

from edge_proxy.routing import Candidate
from regions.routing_modes import make_router


def cands(*loads, cached=()):
    cached = cached or (0,) * len(loads)
    return [Candidate(f"r{i}", float(ld), c) for i, (ld, c) in enumerate(zip(loads, cached))]


def test_round_robin_ignores_sessions_prefixes_and_order():
    r = make_router("round_robin")
    picks = [r.route(list(reversed(cands(0, 0, 0, cached=(9, 0, 0)))), 100, 16, session_key="s").replica
             for _ in range(6)]
    assert picks == ["r0", "r1", "r2", "r0", "r1", "r2"]
    assert r.route([], 1, 16) is None


def test_sticky_keeps_a_session_and_balances_the_rest_by_load():
    r = make_router("sticky")
    first = r.route(cands(0, 0), 100, 16, session_key="alice").replica
    assert all(r.route(cands(0, 0), 100, 16, session_key="alice", session_current=first).replica == first
               for _ in range(5))
    d = r.route(cands(3, 1, cached=(10, 0)), 200, 16)  # no session: least load, prefix ignored
    assert d.replica == "r1" and d.reason == "load"


def test_prefix_ignores_sessions():
    r = make_router("prefix")
    d = r.route(cands(1, 1, cached=(0, 8)), 160, 16, session_key="alice", session_current="r0")
    assert d.replica == "r1" and d.reason == "prefix"


def test_auto_is_the_proxy_router_and_unknown_modes_fail():
    d = make_router("auto").route(cands(0, 0, cached=(0, 8)), 160, 16, session_key="bob")
    assert d.reason == "sticky"
    with pytest.raises(ValueError, match="round_robin"):
        make_router("random")
