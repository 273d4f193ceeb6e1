"""`make run` brings up the service (two regions of proxies and replicas on the
default model) and it answers a chat through the first region's proxy."""

import shutil
from pathlib import Path

import httpx
import pytest

from tests.replica.server import replica_server

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_run_serves_a_chat_request():
    # The built-in topology uses ports PORT .. PORT + 305 (regions/builtin.toml, shifted).
    with replica_server(cmd=["make", "-s", "run", "PORT={port}"], cwd=str(ROOT), span=320) as (url, _):
        r = httpx.post(url + "/v1/chat/completions", timeout=120,
                       json={"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8})
        assert r.status_code == 200
        body = r.json()
        assert body["choices"][0]["message"]["content"].strip()
        assert body["usage"]["completion_tokens"] > 0
