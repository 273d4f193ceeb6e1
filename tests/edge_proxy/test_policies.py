"""Admission, auth, sessions, metrics, protocol codecs: pure, no sockets."""

import pytest

from edge_proxy import protocol as pp
from edge_proxy.admission import AdmissionConfig, LoadView, admit, predict_ttft_ms
from edge_proxy.auth import KeyStore, TokenBucket, bearer, cache_salt, parse_env
from edge_proxy.metrics import ProxyMetrics
from tests.prom import samples
from wire.metrics import HotHistogram, HotStore
from edge_proxy.sessions import placement_key
from edge_proxy.tracing import make_tracer, start_request_span, traceparent_of
from wire import protocol as P

ACFG = AdmissionConfig(default_tokens_per_s=4000.0, default_step_ms=20.0, batch_max_wait_ms=5000.0)


def test_predicted_ttft_from_the_queue():
    idle = LoadView()
    assert predict_ttft_ms(idle, 400, ACFG) == pytest.approx(20.0 + 100.0)  # one step + 400 tokens at 4/ms
    busy = LoadView(step_ms=30.0, tokens_per_s=10_000.0, waiting_tokens=20_000, pending_tokens=5_000)
    assert predict_ttft_ms(busy, 1_000, ACFG) == pytest.approx(30.0 + 26_000 / 10.0)


def test_admit_against_deadline_and_tier():
    assert admit(120.0, 0.0, P.INTERACTIVE, ACFG).ok  # no deadline
    assert admit(120.0, 200.0, P.INTERACTIVE, ACFG).ok
    v = admit(2630.0, 500.0, P.INTERACTIVE, ACFG)
    assert not v.ok and v.retry_after_s == 3.0 and "deadline" in v.reason
    assert admit(4000.0, 0.0, P.BATCH, ACFG).ok
    v = admit(9000.0, 0.0, P.BATCH, ACFG)
    assert not v.ok and v.retry_after_s == 4.0 and "batch" in v.reason
    assert admit(9000.0, 0.0, P.INTERACTIVE, ACFG).ok  # interactive waits where batch is shed


def test_token_bucket():
    b = TokenBucket(rate=2.0, burst=2.0, now=0.0)
    assert b.take(0.0) == 0.0 and b.take(0.0) == 0.0
    assert b.take(0.0) == pytest.approx(0.5)
    assert b.take(0.5) == 0.0  # refilled one token in 0.5 s


def test_keystore_checks_digests_and_tiers():
    ks = KeyStore(parse_env("sk-a=acme,sk-b=beta:batch:5:10"), salt_secret="s")
    a, b = ks.check("sk-a"), ks.check("sk-b")
    assert a.tenant == "acme" and a.priority == P.INTERACTIVE
    assert b.tenant == "beta" and b.priority == P.BATCH and b.bucket.rate == 5.0 and b.bucket.burst == 10.0
    assert ks.check("sk-c") is None and ks.check("") is None and ks.check(None) is None
    assert "sk-a" not in repr(a)  # only digests are kept
    assert a.cache_salt == cache_salt("acme", "s") != b.cache_salt
    assert cache_salt("acme", "s") != cache_salt("acme", "other secret")
    with pytest.raises(ValueError, match="no API keys"):
        KeyStore([])
    with pytest.raises(ValueError, match="tier"):
        KeyStore([{"key": "k", "tenant": "t", "tier": "gold"}])
    anon = KeyStore([], anonymous=True).check(None)
    assert anon.tenant == "anonymous"
    assert bearer("Bearer sk-a") == "sk-a" and bearer("Basic xx") is None and bearer(None) is None


def test_a_session_is_namespaced_by_its_key():
    assert placement_key("alice", "s") != placement_key("bob", "s")


def test_public_codec_round_trip_and_errors():
    server, client = pp.ClientCodec(), pp.ServerCodec()
    g = pp.Generate("r1", messages=[pp.ChatMessage("user", "hi")], session="s",
                    sampling=pp.Sampling(max_tokens=8, temperature=0.0), deadline_ms=250)
    assert server.decode(client.encode(g)) == g
    assert server.decode(b'{"type":"cancel","id":"r1"}') == pp.Cancel("r1")
    for bad, what in ((b"{", "malformed"), (b'{"type":"generate"}', "invalid"),
                      (b'{"type":"generate","id":"x","sampling":{"bogus":1}}', "invalid")):
        with pytest.raises(pp.ProtocolError, match=what) as e:
            server.decode(bad)
        assert e.value.code == pp.BAD_REQUEST
    d = pp.Done("r1", "stop", pp.Usage(3, 4, 2, 1), pp.Timing(1.5, 9.0, 1.0), "eu", "r-a", 1)
    assert client.decode(server.encode(d)) == d
    assert server.encode(pp.Delta("r1", "hé", 1)) == '{"type":"delta","id":"r1","text":"hé","tokens":1}'.encode()


def test_metrics_render_prometheus_text():
    m = ProxyMetrics()
    m.routing.inc("sticky")
    m.routing.inc("prefix", by=2)
    m.ttft.observe(0.004)
    m.ttft.observe(20.0)
    m.itl.observe(0.004)
    m.generation_tokens.inc(3)
    text = m.render().decode()
    got = samples(text)
    assert got['edgechat_proxy_routing_decisions_total{reason="prefix"}'] == 2
    assert got['edgechat_proxy_ttft_seconds_bucket{le="0.005"}'] == 1
    assert got['edgechat_proxy_ttft_seconds_bucket{le="+Inf"}'] == 2
    assert got['edgechat_proxy_itl_seconds_bucket{le="0.0025"}'] == 0
    assert got['edgechat_proxy_itl_seconds_bucket{le="0.005"}'] == 1 == got["edgechat_proxy_itl_seconds_count"]
    assert got["edgechat_proxy_generation_tokens_total"] == 3
    assert "# TYPE edgechat_proxy_itl_seconds histogram" in text and "_created" not in text
    h = HotHistogram(HotStore(), "x", "y", buckets=(1.0,))
    h.observe(1.0)  # le is inclusive
    assert h.counts() == [1, 0]


def test_traceparent_is_continued():
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exp = InMemorySpanExporter()
    tracer = make_tracer("eu", [SimpleSpanProcessor(exp)])
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    span = start_request_span(tracer, parent, {"a": 1})
    tp = traceparent_of(span)
    span.end()
    assert tp.startswith("00-0af7651916cd43dd8448eb211c80319c-") and tp.endswith("-01")
    assert tp.split("-")[2] != "b7ad6b7169203331"  # the proxy's own span is the replica's parent
    (s,) = exp.get_finished_spans()
    assert s.parent.span_id == 0xB7AD6B7169203331
