"""How a request ends is the proxy's decision (core.Proxy), without sockets: the pool
hands it each replica message about a request, the request (stream.ProxiedRequest)
keeps its state and relays to its sink, by the sink's type, and never calls back."""

from time import perf_counter

import pytest
from opentelemetry.trace import INVALID_SPAN

from edge_proxy import protocol as pp
from edge_proxy.auth import KeyStore
from edge_proxy.config import ProxyConfig
from edge_proxy.core import Proxy
from edge_proxy.prefix_index import BlockIndex
from edge_proxy.prompt import ByteTokenizer
from edge_proxy.sinks import TokenSink
from edge_proxy.stream import ProxiedRequest
from wire import protocol as P

pytestmark = pytest.mark.anyio


class Texts:
    """A text sink (the WebSocket's kind): deltas, then one end."""

    def __init__(self):
        self.deltas: list[tuple[str, int]] = []
        self.ends: list = []

    def delta(self, s, text, ntok):
        self.deltas.append((text, ntok))

    def finish(self, s, msg):
        self.ends.append(msg)


class Messages(Texts):
    """A token sink (the OpenAI API's kind): every replica message as it came."""

    def __init__(self):
        super().__init__()
        self.messages: list = []

    def tokens(self, s, msg):
        self.messages.append(msg)


class Conn:
    """Stands in for the replica connection a request is registered on."""

    id = "replica-a"

    def __init__(self):
        self.index = BlockIndex()
        self.released: list[tuple[str, bool]] = []

    def release(self, rid, abort):
        self.released.append((rid, abort))


def make_proxy() -> Proxy:
    cfg = ProxyConfig(replicas=["ws://127.0.0.1:9/v1/replica"], region="here", tokenizer="bytes")
    proxy = Proxy(cfg, ByteTokenizer(), KeyStore([{"key": "sk-a", "tenant": "a"}], salt_secret="s"))
    proxy.pool.block_size = 4
    return proxy


def request(sink, n: int = 1, proxy: Proxy | None = None) -> ProxiedRequest:
    """A request on a (stand-in) replica connection, as `Proxy.submit` leaves it."""
    gen = P.Generate("", [1, 2, 3], P.SamplingParams(max_tokens=4, n=n, seed=1))
    s = ProxiedRequest("c1", None, sink, gen, [], None, perf_counter(), INVALID_SPAN)
    s.conn, s.rid = Conn(), "r1"
    if proxy is not None:
        proxy.streams.add(s)
    return s


def test_a_request_alone_relays_to_its_sink_by_its_type():
    """No proxy is needed to record tokens and relay them: a text sink gets deltas, a
    token sink the messages themselves."""
    texts, messages = Texts(), Messages()
    assert isinstance(messages, TokenSink) and not isinstance(texts, TokenSink)  # what has `tokens`
    a, b = request(texts), request(messages)
    tokens = P.Tokens("r1", [104, 105], "hi", cached_tokens=2)
    a.add_tokens(tokens, 1.0)
    b.add_tokens(tokens, 1.0)
    assert texts.deltas == [("hi", 2)] and a.ids == [104, 105] and a.cached_tokens == 2 and a.t_first == 1.0
    assert messages.messages == [tokens] and messages.deltas == [] and b.ids == [104, 105]


async def test_the_proxy_ends_a_request_its_replica_finished():
    proxy, sink = make_proxy(), Texts()
    s = request(sink, proxy=proxy)
    proxy.on_tokens(s, P.Tokens("r1", [104, 105], "hi"), perf_counter())
    proxy.on_finished(s, P.Finished("r1", P.FINISH_LENGTH, P.Usage(3, 4), 12.5, [106, 107], "jk"), perf_counter())
    assert sink.deltas == [("hi", 2), ("jk", 2)]
    (done,) = sink.ends
    assert type(done) is pp.Done and done.finish_reason == "length" and done.usage.completion_tokens == 4
    assert done.region == "here" and done.replica == "replica-a" and done.timing.replica_ttft_ms == 12.5
    assert s.done and s not in proxy.streams and s.conn.released == [("r1", False)]  # finished there: no Abort
    assert proxy.metrics.generation_tokens.get() == 4 and proxy.metrics.requests.get("length") == 1


async def test_a_token_sink_sees_every_finished_and_the_end_waits_for_every_sample():
    proxy, sink = make_proxy(), Messages()
    s = request(sink, n=2, proxy=proxy)
    first = P.Finished("r1", P.FINISH_STOP, index=0)  # no tokens in it: a token sink still sees it
    proxy.on_finished(s, first, perf_counter())
    assert sink.messages == [first] and sink.ends == [] and not s.done
    proxy.on_finished(s, P.Finished("r1", P.FINISH_LENGTH, ids=[9], text="x", index=1), perf_counter())
    assert len(sink.messages) == 2 and s.samples == [[], [9]] and sink.deltas == []
    assert [type(e) for e in sink.ends] == [pp.Done] and s.done


async def test_cancels_end_a_request_once():
    proxy = make_proxy()
    answered, gone = Texts(), Texts()
    a, b = request(answered, proxy=proxy), request(gone, proxy=proxy)
    proxy.cancel(a, notify=True)  # the client's cancel: answered done/abort, the replica told to stop
    proxy.cancel(a, notify=True)
    assert [(type(e), e.finish_reason) for e in answered.ends] == [(pp.Done, "abort")]
    assert a.conn.released == [("r1", True)]
    proxy.cancel(b, notify=False)  # the client went away: nothing to answer
    assert gone.ends == [] and b.done and b.conn.released == [("r1", True)]
    assert not proxy.streams and proxy.metrics.requests.get("disconnect") == 1


async def test_replica_endings_the_proxy_does_not_pass_on():
    """An abort nobody asked for moves the request (here: waits for a replica, as none is
    ready); a request the replica refuses as malformed fails with the replica's code."""
    proxy = make_proxy()
    moved, refused = Texts(), Texts()
    a, b = request(moved, proxy=proxy), request(refused, proxy=proxy)
    conn = a.conn
    proxy.on_finished(a, P.Finished("r1", P.FINISH_ABORT, ids=[104], text="h"), perf_counter())
    assert moved.deltas == [("h", 1)] and moved.ends == [] and not a.done and a in proxy.streams
    assert a.conn is None and conn.released == [("r1", False)]  # the replica ended it: no Abort
    proxy.on_replica_error(b, P.Error(P.BAD_REQUEST, "bad sampling", "r1"))
    (err,) = refused.ends
    assert type(err) is pp.Error and err.code == pp.BAD_REQUEST and err.message == "replica: bad sampling"
    proxy.cancel(a, notify=False)
    assert not proxy.streams
