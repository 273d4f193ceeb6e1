"""Routing, admission and observability through the real proxy and stubs."""

import asyncio

import httpx
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from edge_proxy import protocol as pp
from edge_proxy.client import EdgeClient, EdgeError
from edge_proxy.prompt import ByteTokenizer
from edge_proxy.routing import rendezvous_order
from edge_proxy.sessions import placement_key
from edge_proxy.tracing import make_tracer
from stub_replica.server import expected_tokens
from tests.prom import samples
from wire import protocol as P

from conftest import proxy_for, stubs, until_load

pytestmark = pytest.mark.anyio
SYSTEM = {"role": "system", "content": "You are a terse assistant. " * 8}


def turn(n: int) -> list[dict]:
    msgs = [SYSTEM]
    for i in range(n):
        msgs += [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
    return msgs + [{"role": "user", "content": f"question {n}"}]


async def test_session_turns_stick_to_one_replica():
    async with stubs("a", "b", "c") as reps, proxy_for(reps) as p:
        key_id = p.proxy.keys.check("sk-alice").key_id
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            for sess in ("s1", "s2", "s3", "s4"):
                served = set()
                for n in range(3):
                    _, d = await c.complete(messages=turn(n), session=sess, max_tokens=2)
                    served.add(d.replica)
                    if n:
                        assert d.usage.cached_tokens > 0
                assert len(served) == 1
                if sess == "s1":  # placed on idle, empty replicas: the session key's rendezvous order decided
                    assert served == {rendezvous_order(placement_key(key_id, sess), ["a", "b", "c"])[0]}
        assert p.proxy.metrics.routing.get("sticky") == 8  # the later turns: kept on the session's replica


async def test_session_id_from_http_header_and_query():
    async with stubs("a", "b") as reps, proxy_for(reps) as p:
        async with httpx.AsyncClient(trust_env=False, headers={"Authorization": "Bearer sk-alice"}) as h:
            body = {"messages": turn(0), "max_tokens": 2}
            r1 = await h.post(p.http + "/v1/chat/completions", json=body, headers={"X-Session-ID": "h1"})
            r2 = await h.post(p.http + "/v1/chat/completions?session_id=h1", json={**body, "messages": turn(1)})
        assert r1.json()["edgechat"]["replica"] == r2.json()["edgechat"]["replica"]
        assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert p.proxy.metrics.routing.get("sticky") == 1


async def test_prefix_routing_follows_kv_events():
    async with stubs("a", "b", "c") as reps, proxy_for(reps) as p:
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            _, first = await c.complete(messages=turn(2), max_tokens=2)
            # The holder's KV events rode in the frame of its first token: the index is precise now.
            assert p.conn(first.replica).index.precise
            for n in (3, 4):  # later turns of the same conversation, no session id
                _, d = await c.complete(messages=turn(n), max_tokens=2)
                assert d.replica == first.replica and d.usage.cached_tokens > 0
        m = p.proxy.metrics
        assert m.routing.get("prefix") == 2 and m.prefix_blocks_hit.get() > 0
        assert m.retokenized.get() == 0  # bytes round-trip: every reply renders back into its ids


class TrimmingTokenizer(ByteTokenizer):
    """A chat template that strips the leading whitespace of assistant replies, as Llama 3's trims them."""

    def apply_chat_template(self, messages, add_generation_prompt=True):
        msgs = [{**m, "content": m["content"].lstrip()} if m["role"] == "assistant" else m for m in messages]
        return super().apply_chat_template(msgs, add_generation_prompt)


async def test_replies_the_template_renders_into_other_ids_are_counted():
    tok, sp = TrimmingTokenizer(), P.SamplingParams(max_tokens=4, temperature=0)
    spaced, plain = [], []  # chats whose stub reply starts with a space (the template drops it) or not
    for i in range(500):
        msgs = [{"role": "user", "content": f"question {i}"}]
        (spaced if expected_tokens(tok.encode_chat(msgs), sp, 1) == [ord(" ")] else plain).append(msgs)
    async with stubs("a") as reps, proxy_for(reps, tokenizer=tok) as p:
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            for msgs in spaced[:2] + plain[:3]:
                text, _ = await c.complete(messages=msgs, max_tokens=4, temperature=0)
                assert text.startswith(" ") == (msgs in spaced)
        assert p.proxy.metrics.retokenized.get() == 2


async def test_prefix_routing_from_history_without_kv_events():
    async with stubs("a", "b", "c", kv_events=False) as reps, proxy_for(reps) as p:
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            _, first = await c.complete(messages=turn(2), max_tokens=2)
            assert not any(x.index.precise for x in p.proxy.pool.conns)  # approximate mode
            for n in (3, 4):
                _, d = await c.complete(messages=turn(n), max_tokens=2)
                assert d.replica == first.replica and d.usage.cached_tokens > 0
        assert p.proxy.metrics.routing.get("prefix") == 2


async def test_imbalanced_replicas_route_by_load():
    async with stubs("a", "b") as reps, proxy_for(reps) as p:
        reps[0].cfg.load_override = {"running": 200}
        await until_load(p.conn("a"), lambda ld: ld.running == 200)
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            for i in range(4):
                _, d = await c.complete(messages=turn(0), max_tokens=1)
                assert d.replica == "b"


async def test_replicas_sharing_compute_are_one_group_and_the_valve_skips_them():
    # a and b say they run on the same two cores, one thread each; c on a GPU of its own.
    # a is loaded (6 running): the valve weighs the a+b group against c, so the request
    # goes to c, not to idle b.
    async with stubs("a", "b", compute=["cpu:m:0", "cpu:m:1"], uses=1) as ab, stubs("c", compute=["gpu:C"]) as c1, \
            proxy_for(ab + c1) as p:
        assert [(p.conn(r).group, p.conn(r).share) for r in "abc"] == [("a", 0.5), ("a", 0.5), ("c", 1.0)]
        ab[0].cfg.load_override = {"running": 6}
        await until_load(p.conn("a"), lambda ld: ld.running == 6)
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            for k in range(6):  # prompts of their own: the tie-break between b and c differs
                _, d = await c.complete(prompt=f"conversation {k} " * 20, max_tokens=1)
                assert d.replica == "c"
        async with httpx.AsyncClient() as h:
            text = (await h.get(p.http + "/metrics")).text
        assert samples(text)["edgechat_proxy_compute_groups"] == 2


async def test_deadline_admission_rejects_at_once():
    async with stubs("a", "b") as reps, proxy_for(reps) as p:
        for r in reps:  # both replicas report a long prefill queue: ~2 s of work
            r.cfg.load_override = {"waiting": 40, "waiting_tokens": 20_000, "tokens_per_s": 10_000.0}
        for c in p.proxy.pool.conns:
            await until_load(c, lambda ld: ld.waiting == 40)
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            with pytest.raises(EdgeError) as e:
                await c.complete(prompt="quick", max_tokens=2, deadline_ms=300)
            assert e.value.code == pp.OVERLOADED and e.value.retry_after_s >= 1
            _, d = await c.complete(prompt="quick", max_tokens=2, deadline_ms=5000)  # this one fits
            assert d.finish_reason == "length"
        async with httpx.AsyncClient(trust_env=False, headers={"Authorization": "Bearer sk-alice"}) as h:
            r = await h.post(p.http + "/v1/completions", json={"prompt": "q", "max_tokens": 2},
                             headers={"X-Deadline-Ms": "100"})
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == pp.OVERLOADED
        assert p.proxy.metrics.rejected.get(pp.OVERLOADED) == 2
        # The admitted request carried its remaining deadline to the replica.
        (admitted,) = [g for r in reps for g in r.generates if g.deadline_ms > 0]
        assert 4000 < admitted.deadline_ms <= 5000


async def test_admission_picks_a_replica_that_can_make_it():
    async with stubs("a", "b") as reps, proxy_for(reps) as p:
        reps[0].cfg.load_override = {"waiting_tokens": 50_000, "tokens_per_s": 10_000.0}
        await until_load(p.conn("a"), lambda ld: ld.waiting_tokens == 50_000)
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            for _ in range(3):
                _, d = await c.complete(prompt="hurry", max_tokens=1, deadline_ms=500)
                assert d.replica == "b"


async def test_batch_tier_is_shed_first():
    async with stubs("a") as reps, proxy_for(reps) as p:
        reps[0].cfg.load_override = {"waiting_tokens": 80_000, "tokens_per_s": 10_000.0}  # ~8 s queue
        await until_load(p.conn("a"), lambda ld: ld.waiting_tokens == 80_000)
        async with await EdgeClient.connect(p.ws_url, api_key="sk-batch") as c:
            with pytest.raises(EdgeError) as e:
                await c.complete(prompt="bulk", max_tokens=1)
            assert e.value.code == pp.OVERLOADED
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            await c.complete(prompt="chat", max_tokens=1)


async def test_metrics_and_spans():
    exporter = InMemorySpanExporter()
    tracer = make_tracer("local", [SimpleSpanProcessor(exporter)])
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    async with stubs("a", "b") as reps, proxy_for(reps, tracer=tracer) as p:
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            await c.complete(messages=turn(0), max_tokens=5, traceparent=parent, session="m")
            await c.complete(messages=turn(1), max_tokens=5, session="m")
        async with httpx.AsyncClient(trust_env=False) as h:
            text = (await h.get(p.http + "/metrics")).text
    m = samples(text)
    assert m['edgechat_proxy_routing_decisions_total{reason="load"}'] == 1  # a new session: least loaded
    assert m['edgechat_proxy_routing_decisions_total{reason="sticky"}'] == 1
    assert m["edgechat_proxy_ttft_seconds_count"] == 2
    assert m["edgechat_proxy_itl_seconds_count"] == 8
    assert m['edgechat_proxy_requests_total{outcome="length"}'] == 2
    assert m["edgechat_proxy_replicas_ready"] == 2
    assert "edgechat_proxy_prefix_blocks_hit_total" in m and "edgechat_proxy_cached_tokens_total" in m
    spans = exporter.get_finished_spans()
    assert len(spans) == 2
    s = spans[0]
    assert f"{s.context.trace_id:032x}" == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert s.parent.span_id == 0x00F067AA0BA902B7
    assert s.attributes["edgechat.completion_tokens"] == 5 and s.attributes["edgechat.replica"] in ("a", "b")
    assert [e.name for e in s.events] == ["route"] and s.events[0].attributes["reason"] == "load"
    # The replica got the proxy span's context, so its spans nest under the proxy's.
    g = next(g for r in reps for g in r.generates if g.traceparent.startswith("00-4bf92f35"))
    assert g.traceparent.split("-")[2] == f"{s.context.span_id:016x}"


async def test_queued_prefill_is_counted_until_the_first_token():
    """What routing prices as a replica's queued prefill: the uncached prompt tokens of
    this proxy's requests there, from the send until each one's first token."""
    async with stubs("a", max_running=1) as reps, proxy_for(reps) as p:
        conn = p.conn("a")
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            first = await c.generate(messages=turn(0), max_tokens=60)
            await anext(aiter(first))  # producing tokens: no longer queued
            assert conn.prefilling == {} and conn.prefill_pending == 0
            second = await c.generate(messages=turn(1), max_tokens=2)  # waits for the stub's one slot
            async with asyncio.timeout(5):
                while not conn.prefilling:  # the proxy admits and sends it (no event to await)
                    await asyncio.sleep(0.002)
            (queued,) = conn.prefilling.values()
            assert conn.prefill_pending == queued > 0
            await anext(aiter(second))
            assert conn.prefilling == {} and conn.prefill_pending == 0
            await first.cancel()
            await second.result()


async def test_a_later_turn_stays_on_its_briefly_busiest_replica():
    """Issue 26: three replicas on one machine's cores (one compute group: no valve).
    A conversation's first turn ends with a short answer (no block of its own); then
    its replica reports three requests running (three of its other conversations in
    a turn at once), the others none. The next turn stays there, with and without a
    session id: over the placement bound (2) but under the spill bound (6). Priced as
    a spill instead, 3 x 256 tokens of decoding against a cold prefill of ~300 on an
    idle replica, it would leave its cache."""
    async with stubs("a", "b", "c", compute=["cpu:m:0", "cpu:m:1"], uses=1) as reps, proxy_for(reps) as p:
        by_id = {r.cfg.replica_id: r for r in reps}
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            for k, session in enumerate((None, "s1")):
                msgs = [{"role": "system", "content": f"You are help desk {k}. " * 12},
                        {"role": "user", "content": "question 0"}]
                text, first = await c.complete(messages=msgs, max_tokens=3, session=session)
                home = by_id[first.replica]
                home.cfg.load_override = {"running": 3}
                await until_load(p.conn(first.replica), lambda ld: ld.running == 3)
                msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "question 1"}]
                _, d = await c.complete(messages=msgs, max_tokens=3, session=session)
                assert d.replica == first.replica
                assert d.usage.cached_tokens >= first.usage.prompt_tokens // 16 * 16
                home.cfg.load_override = {}
                await until_load(p.conn(first.replica), lambda ld: ld.running == 0)
        m = p.proxy.metrics
        assert (m.routing.get("sticky"), m.routing.get("spill")) == (1, 0)  # (the session's turn: sticky)
