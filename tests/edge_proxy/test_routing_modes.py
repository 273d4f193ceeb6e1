"""Routing modes (`RouterConfig.mode`, `--routing`): on synthetic candidates, and in the proxy."""

import pytest

from edge_proxy.__main__ import parse_args
from edge_proxy.client import EdgeClient
from edge_proxy.routing import Candidate, RoundRobinRouter, Router, RouterConfig, StickyRouter, make_router

from tests.edge_proxy.conftest import proxy_for, stubs

HI = [{"role": "user", "content": "hello"}]


def mode(m):
    return make_router(RouterConfig(mode=m))


def cands(*loads, cached=()):
    cached = cached or (0,) * len(loads)
    return [Candidate(f"r{i}", float(ld), c) for i, (ld, c) in enumerate(zip(loads, cached))]


def test_round_robin_ignores_sessions_prefixes_and_order():
    r = mode("round_robin")
    picks = [r.route(list(reversed(cands(0, 0, 0, cached=(9, 0, 0)))), 100, 16, session_key="s").replica
             for _ in range(6)]
    assert picks == ["r0", "r1", "r2", "r0", "r1", "r2"]
    assert r.route([], 1, 16) is None


def test_sticky_keeps_a_session_and_balances_the_rest_by_load():
    r = mode("sticky")
    first = r.route(cands(0, 0), 100, 16, session_key="alice").replica
    assert all(r.route(cands(0, 0), 100, 16, session_key="alice", session_current=first).replica == first
               for _ in range(5))
    d = r.route(cands(3, 1, cached=(10, 0)), 200, 16)  # no session: least load, prefix ignored
    assert d.replica == "r1" and d.reason == "load"


def test_prefix_ignores_sessions():
    r = mode("prefix")
    d = r.route(cands(1, 1, cached=(0, 8)), 160, 16, session_key="alice", session_current="r0")
    assert d.replica == "r1" and d.reason == "prefix"


def test_auto_is_the_proxy_router_and_unknown_modes_fail():
    r = mode("auto")
    assert type(r) is Router and type(make_router()) is Router
    d = r.route(cands(0, 0, cached=(0, 8)), 160, 16, session_key="bob")
    assert (d.replica, d.reason) == ("r1", "prefix")  # a new session goes where its prefix is
    d = r.route(cands(0, 0, cached=(0, 8)), 160, 16, session_key="bob", session_current="r0")
    assert (d.replica, d.reason) == ("r0", "sticky")  # a session's replica is kept under the bound
    with pytest.raises(ValueError, match="round_robin"):
        RouterConfig(mode="random")


def test_cli_routing_flag(capsys):
    base = ["--replica", "ws://127.0.0.1:9/v1/replica"]
    assert parse_args(base).router.mode == "auto"
    assert parse_args(base + ["--routing", "sticky"]).router.mode == "sticky"
    with pytest.raises(SystemExit):
        parse_args(base + ["--routing", "random"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.anyio
async def test_the_proxy_routes_by_its_mode():
    async with stubs("a", "b", "c") as reps, proxy_for(reps, router=RouterConfig(mode="round_robin")) as p:
        assert type(p.proxy.router) is RoundRobinRouter
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            served = [(await c.complete(messages=HI, session="s1", max_tokens=2))[1].replica for _ in range(6)]
        assert served == ["a", "b", "c", "a", "b", "c"]  # the session and the cached prefix do not hold it
    async with stubs("a", "b") as reps, proxy_for(reps, router=RouterConfig(mode="sticky")) as p:
        assert type(p.proxy.router) is StickyRouter
