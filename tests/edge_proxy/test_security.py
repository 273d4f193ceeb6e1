"""API keys, origins, sessions bound to keys, tenant cache salts, rate limits, size limits,
and the proxy<->replica shared secret."""

import json
import socket

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from edge_proxy import protocol as pp
from edge_proxy.client import EdgeClient, EdgeError
from edge_proxy.pool import PoolConfig
from wire import protocol as P

from conftest import FAST_POOL, KEYS, proxy_for, stubs

pytestmark = pytest.mark.anyio
HI = [{"role": "user", "content": "a fairly long shared system prompt, long enough for several blocks " * 2}]


async def test_websocket_needs_a_known_key():
    async with stubs("a") as reps, proxy_for(reps) as p:
        for headers in (None, {"Authorization": "Bearer sk-mallory"}, {"Authorization": "Basic sk-alice"}):
            with pytest.raises(InvalidStatus) as e:
                await connect(p.ws_url, additional_headers=headers, proxy=None)
            assert e.value.response.status_code == 401
            assert json.loads(e.value.response.body)["code"] == pp.UNAUTHORIZED
        # Browsers cannot set headers: the key may ride in a subprotocol.
        async with connect(p.ws_url, subprotocols=["edgechat.v1", "bearer.sk-alice"], proxy=None) as ws:
            assert ws.subprotocol == "edgechat.v1"
        async with httpx.AsyncClient(trust_env=False) as h:
            r = await h.post(p.http + "/v1/chat/completions", json={"messages": HI})
            assert r.status_code == 401 and r.json()["error"]["code"] == pp.UNAUTHORIZED
            r = await h.get(p.http + "/v1/models", headers={"Authorization": "Bearer nope"})
            assert r.status_code == 401


async def test_any_key_is_anonymous_without_keys_and_unknown_keys_are_refused_with_them():
    """What vLLM and SGLang do without --api-key: OpenAI SDKs always send a key ("EMPTY")."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with stubs("a") as reps, proxy_for(reps, keys=[], allow_anonymous=True) as p:
        async with httpx.AsyncClient(trust_env=False) as h:
            for key in ("EMPTY", "sk-anything", None):
                r = await h.post(p.http + "/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}"} if key else {})
                assert r.status_code == 200, (key, r.text)
        async with connect(p.ws_url, additional_headers={"Authorization": "Bearer EMPTY"}, proxy=None):
            pass
    async with stubs("a") as reps, proxy_for(reps, allow_anonymous=True) as p:  # keys configured
        async with httpx.AsyncClient(trust_env=False) as h:
            r = await h.post(p.http + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer EMPTY"})
            assert r.status_code == 401 and r.json()["error"]["code"] == pp.UNAUTHORIZED
            assert (await h.post(p.http + "/v1/chat/completions", json=body)).status_code == 200  # no key: anonymous
            r = await h.post(p.http + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-bob"})
            assert r.status_code == 200


async def test_origin_allowlist():
    async with stubs("a") as reps, proxy_for(reps, allowed_origins=("https://chat.example",)) as p:
        auth = {"Authorization": "Bearer sk-alice"}
        with pytest.raises(InvalidStatus) as e:
            await connect(p.ws_url, additional_headers=auth, origin="https://evil.example", proxy=None)
        assert e.value.response.status_code == 403
        async with connect(p.ws_url, additional_headers=auth, origin="https://chat.example", proxy=None):
            pass
        async with connect(p.ws_url, additional_headers=auth, proxy=None):  # no Origin: not a browser
            pass


async def test_a_session_id_is_its_keys_own():
    """Bob naming Alice's session id gets a session of his own (namespaced by key, issue 44:
    the same answer on every proxy of a region); Alice's stays hers, on its replica."""
    async with stubs("a", "b") as reps, proxy_for(reps) as p:
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as alice, \
                await EdgeClient.connect(p.ws_url, api_key="sk-bob") as bob:
            text, d1 = await alice.complete(messages=HI, session="s1", max_tokens=2)
            _, theirs = await bob.complete(messages=HI, session="s1", max_tokens=2)
            assert theirs.usage.cached_tokens == 0  # his tenant's salt: nothing of hers
            again = HI + [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
            _, d2 = await alice.complete(messages=again, session="s1", max_tokens=2)
            assert d2.replica == d1.replica and d2.usage.cached_tokens > 0
        async with httpx.AsyncClient(trust_env=False, headers={"Authorization": "Bearer sk-bob"}) as h:
            r = await h.post(p.http + "/v1/chat/completions", json={"messages": HI, "max_tokens": 2},
                             headers={"X-Session-ID": "s1"})
            assert r.status_code == 200


async def test_prefixes_never_shared_across_tenants():
    async with stubs("a") as reps, proxy_for(reps) as p:
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as alice, \
                await EdgeClient.connect(p.ws_url, api_key="sk-bob") as bob:
            _, d1 = await alice.complete(messages=HI, max_tokens=2)
            _, d2 = await bob.complete(messages=HI, max_tokens=2)
            _, d3 = await alice.complete(messages=HI, max_tokens=2)
        assert d1.usage.cached_tokens == 0 and d2.usage.cached_tokens == 0 and d3.usage.cached_tokens > 0
        salts = [g.cache_salt for g in reps[0].generates]
        assert salts[0] == salts[2] != salts[1] and all(salts)


async def test_replicas_refuse_a_wrong_secret():
    async with stubs("a") as reps, proxy_for(reps, wait_ready=0, pool=PoolConfig(secret="wrong", backoff_max_s=0.1,
                                                                                  healthz_interval_s=0)) as p:
        conn = p.proxy.pool.conns[0]
        assert not await p.proxy.pool.wait_ready(1, timeout=0.3)
        assert conn.refused and not reps[0].conns
    for before_upgrade in (False, True):  # close 4401 after the upgrade, or HTTP 403 before it
        async with stubs("a") as reps:
            reps[0].refuse = True
            reps[0].refuse_http = before_upgrade
            async with proxy_for(reps, wait_ready=0) as p:
                assert not await p.proxy.pool.wait_ready(1, timeout=0.3)
                assert p.proxy.pool.conns[0].refused
                reps[0].refuse = False
                assert await p.proxy.pool.wait_ready(1, timeout=5)
                assert not p.proxy.pool.conns[0].refused


async def test_a_replica_with_another_tokenizer_gets_no_traffic():
    """The proxy sends token ids: a replica whose Hello names another tokenizer is refused."""
    async with stubs("good") as good, stubs("other", tokenizer="another-model") as other, \
            proxy_for(good + other, wait_ready=1) as p:
        conn = next(c for c in p.proxy.pool.conns if c.url == other[0].url)
        assert await p.proxy.pool.wait_for(lambda: conn.mismatch, timeout=5)
        assert "tokenizer another-model" in conn.mismatch and [c.id for c in p.proxy.pool.ready()] == ["good"]
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            for i in range(4):
                _, done = await c.complete(prompt=f"request {i}", max_tokens=2)
                assert done.replica == "good"
        assert not other[0].generates


async def test_per_key_rate_limit():
    async with stubs("a") as reps, proxy_for(reps) as p:
        async with await EdgeClient.connect(p.ws_url, api_key="sk-slow") as c:
            await c.complete(prompt="x", max_tokens=1)
            await c.complete(prompt="x", max_tokens=1)
            with pytest.raises(EdgeError) as e:
                await c.complete(prompt="x", max_tokens=1)
            assert e.value.code == pp.RATE_LIMITED and 0 < e.value.retry_after_s <= 1.0
        async with httpx.AsyncClient(trust_env=False, headers={"Authorization": "Bearer sk-slow"}) as h:
            r = await h.post(p.http + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert p.proxy.metrics.rejected.get(pp.RATE_LIMITED) == 2


async def test_size_limits():
    async with stubs("a") as reps, proxy_for(reps, max_frame_bytes=4096) as p:
        async with connect(p.ws_url, additional_headers={"Authorization": "Bearer sk-alice"}, proxy=None) as ws:
            await ws.send(json.dumps({"type": "generate", "id": "x", "prompt": "y" * 8000}))
            with pytest.raises(ConnectionClosed) as e:
                await ws.recv()
            assert e.value.rcvd.code == 1009  # message too big
        async with httpx.AsyncClient(trust_env=False, headers={"Authorization": "Bearer sk-alice"}) as h:
            r = await h.post(p.http + "/v1/completions", json={"prompt": "y" * 8000})
            assert r.status_code == 413 and r.json()["error"]["code"] == pp.TOO_LARGE


async def test_priority_tier_comes_from_the_key():
    async with stubs("a") as reps, proxy_for(reps) as p:
        async with await EdgeClient.connect(p.ws_url, api_key="sk-batch") as c:
            await c.complete(prompt="x", max_tokens=1, priority="interactive")  # cannot climb above its tier
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            await c.complete(prompt="x", max_tokens=1)
            await c.complete(prompt="x", max_tokens=1, priority="batch")
        assert [g.priority for g in reps[0].generates] == [P.BATCH, P.INTERACTIVE, P.BATCH]


async def test_a_subprotocol_offer_must_include_edgechat_v1():
    """Item 13: offering only `bearer.KEY` would leave no protocol to select (browsers fail
    such a handshake): refused with 400; with `edgechat.v1` the server selects it."""
    async with stubs("a") as reps, proxy_for(reps) as p:
        with pytest.raises(InvalidStatus) as e:
            await connect(p.ws_url, subprotocols=["bearer.sk-alice"], proxy=None)
        assert e.value.response.status_code == 400 and json.loads(e.value.response.body)["code"] == pp.BAD_REQUEST
        async with connect(p.ws_url, subprotocols=["bearer.sk-alice", "edgechat.v1"], proxy=None) as ws:
            assert ws.subprotocol == "edgechat.v1"
        async with connect(p.ws_url, additional_headers={"Authorization": "Bearer sk-alice"}, proxy=None) as ws:
            assert ws.subprotocol is None  # no offer, nothing to select


async def test_failed_authentication_is_throttled_per_source_address():
    """Item 13: after a burst of wrong keys, an address is refused with 429 + Retry-After
    before any key is checked (a right key included); other addresses are unaffected."""
    async with stubs("a") as reps, proxy_for(reps, auth_failure_burst=5, auth_failures_per_s=0.5) as p:
        statuses = []
        for i in range(8):
            with pytest.raises(InvalidStatus) as e:
                await connect(p.ws_url, additional_headers={"Authorization": f"Bearer sk-guess-{i}"}, proxy=None)
            statuses.append(e.value.response.status_code)
        assert statuses == [401] * 5 + [429] * 3
        assert int(e.value.response.headers["retry-after"]) >= 1
        assert json.loads(e.value.response.body)["code"] == pp.RATE_LIMITED
        with pytest.raises(InvalidStatus) as e:  # even the right key waits: guesses are not evaluated
            await connect(p.ws_url, additional_headers={"Authorization": "Bearer sk-alice"}, proxy=None)
        assert e.value.response.status_code == 429
        async with httpx.AsyncClient(trust_env=False) as h:  # HTTP shares the throttle
            r = await h.get(p.http + "/v1/models", headers={"Authorization": "Bearer sk-guess"})
            assert r.status_code == 429 and r.headers["retry-after"]
        # another source address (all of 127/8 is loopback) is not throttled
        sock = socket.socket()
        sock.bind(("127.0.0.3", 0))
        sock.connect(("127.0.0.1", p.port))
        async with connect(p.ws_url, sock=sock, additional_headers={"Authorization": "Bearer sk-alice"}, proxy=None):
            pass


async def test_a_session_cannot_be_claimed_or_evicted_by_another_key():
    """Item 10, live: bob opens 200 sessions, then names alice's session id: he gets a
    session of his own, and alice keeps hers (its replica, its cache). No proxy holds a
    table of sessions that a flood could fill."""
    keys = [dict(k, rate_per_s=10_000, burst=10_000) if k["key"] == "sk-bob" else k for k in KEYS]
    async with stubs("a", "b") as reps, proxy_for(reps, keys=keys) as p:
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as alice, \
                await EdgeClient.connect(p.ws_url, api_key="sk-bob") as bob:
            text, d1 = await alice.complete(messages=HI, session="victim", max_tokens=2)
            for i in range(200):
                await bob.complete(prompt="x", session=f"flood-{i}", max_tokens=1)
            _, his = await bob.complete(messages=HI, session="victim", max_tokens=2)
            assert his.usage.cached_tokens == 0
            again = HI + [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
            _, d2 = await alice.complete(messages=again, session="victim", max_tokens=2)
            assert d2.replica == d1.replica and d2.usage.cached_tokens > 0
