"""One OpenAI routes class (wire.openai_routes) for the proxy and the replica: each side
implements only its backend, and both answer the same malformed or unservable request
with the same status and the same error body."""

from __future__ import annotations

import httpx
import pytest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.routing import Route

from edge_proxy.app import create_app as proxy_app
from edge_proxy.auth import KeyStore
from edge_proxy.config import ProxyConfig
from edge_proxy.core import Proxy
from edge_proxy.openai_api import ProxyBackend
from edge_proxy.prompt import ByteTokenizer
from replica.api.app import create_app as replica_app
from replica.api.metrics import ReplicaMetrics
from replica.api.openai_http import MAX_BODY_BYTES, ReplicaBackend
from replica.config import EngineConfig
from wire.openai_routes import OpenAIBackend, OpenAIRoutes
from wire.openai_stream import http_error

from conftest import proxy_for, stubs

pytestmark = pytest.mark.anyio
AUTH = {"Authorization": "Bearer sk-alice"}
HI = b'[{"role": "user", "content": "hi"}]'
OPENAI_PATHS = {"/v1/chat/completions", "/v1/completions", "/infill", "/v1/models", "/v1/models/{model:path}",
                "/tokenize", "/detokenize", "/version", "/props"}

# (method, path, body): each refused before any generation starts, at the proxy and at the replica alike.
REFUSED = [
    ("POST", "/v1/chat/completions", b'{"messages": '),
    ("POST", "/v1/chat/completions", b'{"messages": ' + HI + b', "frobnicate": 1}'),
    ("POST", "/v1/chat/completions", b'{"messages": ' + HI + b', "temperature": "hot"}'),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),
    ("POST", "/v1/chat/completions", b'{"max_tokens": 3}'),
    ("POST", "/v1/chat/completions", b'{"messages": ' + HI + b', "max_tokens": -5}'),
    ("POST", "/v1/chat/completions", b'{"messages": ' + HI + b', "functions": [{"name": "f"}]}'),
    ("POST", "/v1/chat/completions", b'{"messages": ' + HI + b', "stream_options": {"include_usage": true}}'),
    ("POST", "/v1/chat/completions", b'{"messages": ' + HI + b', "priority": "urgent"}'),
    ("POST", "/v1/chat/completions", b'{"messages": ' + HI + b', "logprobs": true, "top_logprobs": 99}'),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "image_url", '
                                     b'"image_url": {"url": "x"}}]}]}'),
    ("POST", "/v1/chat/completions", b'{"model": "gpt-9", "messages": ' + HI + b'}'),
    ("POST", "/v1/chat/completions", b'{"messages": ' + HI + b', "logit_bias": {"\\u00b2": 1}}'),  # a ValueError: 400
    ("POST", "/v1/completions", b'{"prompt": "def f(", "suffix": ")", "max_tokens": 3}'),
    ("POST", "/v1/completions", b'{"prompt": [], "max_tokens": 3}'),
    ("POST", "/v1/completions", b'{"prompt": "a", "suffix": "b", "echo": true}'),
    ("POST", "/v1/completions", b'{"prompt": ["a", "b", "c", "d", "e"], "n": 128}'),
    ("POST", "/v1/completions", b'{"model": "gpt-9", "prompt": "a"}'),
    ("POST", "/infill", b'{"input_prefix": "def f(", "input_suffix": ")", "n_predict": -2}'),
    ("POST", "/infill", b'{"input_prefix": "def f(", "input_suffix": ")", "n_predict": 3}'),
    ("POST", "/v1/completions", b'{"prompt": "' + b"x" * MAX_BODY_BYTES + b'"}'),
    ("GET", "/v1/models/gpt-9", b""),
    ("GET", "/props?model=gpt-9", b""),
    ("POST", "/tokenize", b'{"prompt": '),
    ("POST", "/tokenize", b'{"prompt": "a", "messages": ' + HI + b'}'),
    ("POST", "/tokenize", b'{}'),
    ("POST", "/tokenize", b'{"prompt": "a", "frobnicate": 1}'),
    ("POST", "/tokenize", b'{"prompt": "a", "return_token_strs": true}'),
    ("POST", "/tokenize", b'{"messages": ' + HI + b', "continue_final_message": true}'),
    ("POST", "/tokenize", b'{"messages": [{"role": "wizard", "content": "hi"}]}'),
    ("POST", "/tokenize", b'{"model": "gpt-9", "prompt": "a"}'),
    ("POST", "/tokenize", b'{"content": "a", "with_pieces": true}'),
    ("POST", "/detokenize", b'{"tokens": [1, -2]}'),
    ("POST", "/detokenize", b'{"tokens": "abc"}'),
    ("POST", "/detokenize", b'{"model": "gpt-9", "tokens": [1]}'),
    ("GET", "/tokenize", b""),
    ("GET", "/v1/chat/completions", b""),
    ("POST", "/v1/nothing", b"{}"),
]


class NoEngine:
    """The replica's engine client where no request may reach it."""

    hello = None

    def submit(self, req, sink) -> None:
        raise AssertionError(f"{req.id} reached the engine")


def replica_routes(metrics: ReplicaMetrics) -> Starlette:
    """The replica's OpenAI routes as its app mounts them, over an engine nothing reaches."""
    oa = OpenAIRoutes(ReplicaBackend(NoEngine, ByteTokenizer(), "stub", metrics, lambda: 2048, 4))
    return Starlette(routes=[Route(path, endpoint, methods=methods) for path, endpoint, methods in oa.routes()],
                     exception_handlers={HTTPException: http_error})


async def test_proxy_and_replica_refuse_alike():
    """Invariant: a request refused at the front door gets the same status and the same
    error body ({"error": {message, type, param, code}}) from the proxy and the replica."""
    metrics = ReplicaMetrics(lambda: None)
    async with stubs("a") as reps, proxy_for(reps, max_frame_bytes=MAX_BODY_BYTES) as p:
        async with httpx.AsyncClient(trust_env=False, headers=AUTH, timeout=30) as proxy, \
                httpx.AsyncClient(transport=httpx.ASGITransport(replica_routes(metrics)), base_url="http://r") as rep:
            for method, path, body in REFUSED:
                kw = {"content": body, "headers": {"content-type": "application/json"}} if method == "POST" else {}
                a = await proxy.request(method, p.http + path, **kw)
                b = await rep.request(method, path, **kw)
                assert 400 <= a.status_code < 500 and set(a.json()["error"]) == {"message", "type", "param", "code"}
                assert (b.status_code, b.json()) == (a.status_code, a.json()), (method, path, body[:80])
        assert not p.proxy.streams and not reps[0].generates
    counted = metrics.render().decode()  # the replica counts every refusal of its routes (not Starlette's 404/405)
    assert 'edgechat_replica_errors_total{code="bad_request"}' in counted and '{code="not_found"}' in counted
    assert '{code="too_large"}' in counted


def test_each_side_implements_only_the_backend():
    """Invariant: the proxy's and the replica's apps mount the one routes class, over the
    backend each implements, and a backend holds nothing but what the routes ask of it."""
    members = {"hold", "tokenizer", "max_body_bytes", "authorize", "models", "served_model", "slots", "run_tokenizer",
               "submit", "count_error"}
    assert members == {m for m in [*dir(OpenAIBackend), *OpenAIBackend.__annotations__] if not m.startswith("_")}
    for cls in (ProxyBackend, ReplicaBackend):
        assert {m for m in dir(cls) if not m.startswith("_")} <= members, cls

    proxy = Proxy(ProxyConfig(replicas=["ws://127.0.0.1:9/v1/replica"], port=0, tokenizer="bytes"), ByteTokenizer(), KeyStore([], anonymous=True))
    apps = {ProxyBackend: proxy_app(proxy),
            ReplicaBackend: replica_app(EngineConfig(), ByteTokenizer(), model_name="stub", secret="s")}
    for backend, app in apps.items():
        while not isinstance(app, Starlette):  # the wrappers in front: WebSocketFront, RequireSecret
            app = app.app
        mounted = {r.path: r.endpoint for r in app.routes if r.path in OPENAI_PATHS}
        assert set(mounted) == OPENAI_PATHS
        for endpoint in mounted.values():
            routes = endpoint.__self__
            assert type(routes) is OpenAIRoutes and type(routes.backend) is backend
            assert isinstance(routes.backend, OpenAIBackend)

