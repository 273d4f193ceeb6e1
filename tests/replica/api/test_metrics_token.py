"""The metrics token: a read-only credential for Prometheus (deploy/k8s/components/prometheus).
A replica given one answers GET /metrics with it and refuses it everywhere else (403, and the
proxy WebSocket's handshake), so a scraper holding it cannot generate text; the replica secret
keeps working everywhere. Checked on the middleware alone and on a real replica."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from replica.api.auth import RequireSecret, metrics_token
from tests.prom import samples
from tests.replica.server import AUTH, SECRET, free_port, replica_server

TOKEN = "test-metrics-token"
SCRAPER = {"Authorization": f"Bearer {TOKEN}"}
CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 4,
        "temperature": 0}


def _app(**kw) -> TestClient:
    async def ok(request):
        return PlainTextResponse("ok")

    async def ws(websocket):
        await websocket.accept()
        await websocket.send_text("hello")
        await websocket.close()

    app = Starlette(routes=[Route("/metrics", ok, methods=["GET", "POST"]), Route("/v1/models", ok),
                            Route("/v1/chat/completions", ok, methods=["POST"]), Route("/healthz", ok),
                            WebSocketRoute("/v1/replica", ws)])
    return TestClient(RequireSecret(app, SECRET, open_paths=("/healthz",), **kw))


def test_the_token_reads_get_metrics_and_nothing_else():
    c = _app(metrics_token=TOKEN)
    assert c.get("/metrics", headers=SCRAPER).text == "ok"
    for method, path in (("POST", "/metrics"), ("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
        r = c.request(method, path, headers=SCRAPER)
        assert r.status_code == 403, (method, path)
        assert r.json()["error"]["code"] == "forbidden" and "metrics token" in r.json()["error"]["message"]
    # websocket_connect adds its handshake headers to the dict it is given: a copy, never the shared ones
    with pytest.raises(WebSocketDisconnect) as closed, c.websocket_connect("/v1/replica", headers=dict(SCRAPER)):
        pass
    assert closed.value.code == 4403
    for method, path in (("GET", "/metrics"), ("POST", "/metrics"), ("GET", "/v1/models"),
                         ("POST", "/v1/chat/completions")):  # the secret: everything, as before
        assert c.request(method, path, headers=AUTH).status_code == 200, (method, path)
    with c.websocket_connect("/v1/replica", headers=dict(AUTH)) as ws:
        assert ws.receive_text() == "hello"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):  # neither: 401
        r = c.get("/metrics", headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert c.get("/healthz").status_code == 200


def test_without_a_token_metrics_needs_the_secret():
    c = _app()
    assert c.get("/metrics", headers=SCRAPER).status_code == 401
    assert c.get("/metrics", headers=AUTH).status_code == 200


def test_the_token_must_differ_from_the_secret():
    with pytest.raises(ValueError, match="must differ"):
        RequireSecret(None, SECRET, metrics_token=SECRET)


def test_where_a_launch_gets_its_metrics_token(tmp_path):
    assert metrics_token("from-env", str(tmp_path / "ignored"))[0] == "from-env"
    given = tmp_path / "token"
    given.write_text("from-file\n")
    assert metrics_token(None, str(given)) == ("from-file", f"metrics token from {given}")
    assert metrics_token("", "")[0] == ""  # none: /metrics needs the secret
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        metrics_token(None, str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError):
        metrics_token(None, str(tmp_path / "missing"))  # never generated: the deployer gives it


async def _handshake(url: str, headers: dict) -> str:
    """"open" once the replica's Hello came, or "refused <status> <body>" (a close before accept, 4401
    or 4403, is a 403 from uvicorn)."""
    try:
        async with connect(url.replace("http://", "ws://") + "/v1/replica", additional_headers=headers) as ws:
            await ws.recv()  # the replica's Hello
            return "open"
    except InvalidStatus as e:
        return f"refused {e.response.status_code} {bytes(e.response.body or b'')[:200]!r}"


def test_a_real_replica_serves_metrics_to_the_token_and_generation_only_to_the_secret(tmp_path):
    token_file = tmp_path / "metrics-token"
    token_file.write_text(TOKEN + "\n")
    env = {"EDGECHAT_METRICS_TOKEN": ""}  # the file's, as --metrics-token-file names it
    with replica_server("--kv-memory-gb", "0.1", "--metrics-token-file", str(token_file), env=env) as (url, _):
        scrape = httpx.get(url + "/metrics", headers=SCRAPER, timeout=10)
        assert scrape.status_code == 200 and scrape.headers["content-type"].startswith("text/plain")
        assert samples(scrape.text)["edgechat_replica_prompt_tokens_total"] == 0
        for path in ("/v1/chat/completions", "/v1/completions"):
            body = CHAT if "chat" in path else {"prompt": "Paris is", "max_tokens": 4}
            r = httpx.post(url + path, json=body, headers=SCRAPER, timeout=60)
            assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", (path, r.text)
        assert httpx.get(url + "/v1/models", headers=SCRAPER, timeout=10).status_code == 403
        assert httpx.get(url + "/metrics", timeout=10).status_code == 401
        assert asyncio.run(asyncio.wait_for(_handshake(url, SCRAPER), 60)) == "refused 403 b''"  # no proxy connection either
        after = samples(httpx.get(url + "/metrics", headers=SCRAPER, timeout=10).text)
        assert after["edgechat_replica_prompt_tokens_total"] == 0  # nothing reached the engine

        ok = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=AUTH, timeout=120)  # the secret still works
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] > 0
        assert asyncio.run(asyncio.wait_for(_handshake(url, AUTH), 60)) == "open"
        by_secret = samples(httpx.get(url + "/metrics", headers=AUTH, timeout=10).text)
        assert by_secret["edgechat_replica_prompt_tokens_total"] > 0


def test_a_replica_refuses_a_metrics_token_equal_to_its_secret():
    r = subprocess.run([sys.executable, "-m", "replica", "--port", str(free_port())], capture_output=True, text=True,
                       env={**os.environ, "EDGECHAT_REPLICA_SECRET": SECRET, "EDGECHAT_METRICS_TOKEN": SECRET},
                       timeout=120)
    assert r.returncode != 0 and "metrics token must differ from the replica secret" in r.stderr, r.stderr
