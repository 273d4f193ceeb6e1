"""Every replica launch has a secret: from the environment, a --secret-file, or generated
for the launch and written (mode 600) where a proxy on the machine can read it. A plain
`python -m replica` plus a proxy given that file's secret serves; without it, nothing
but /healthz answers."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys

import httpx
import pytest

from edge_proxy.client import EdgeClient
from kernels.cpu_build import build_directory
from replica.api.auth import launch_secret
from tests.replica.server import free_port, replica_server, wait_healthy


def test_where_a_launch_gets_its_secret(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert launch_secret("from-env", str(tmp_path / "ignored"), "127.0.0.1", 1)[0] == "from-env"
    given = tmp_path / "given"
    given.write_text("from-file\n")
    assert launch_secret(None, str(given), "127.0.0.1", 1)[0] == "from-file"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        launch_secret(None, str(tmp_path / "empty"), "127.0.0.1", 1)
    first, note = launch_secret("", "", "127.0.0.1", 8123)
    path = tmp_path / "cache" / "edgechat" / "replica-secrets" / "127.0.0.1-8123"
    assert str(path) in note and path.read_text().strip() == first and len(first) >= 40
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    second, _ = launch_secret("", "", "127.0.0.1", 8123)
    assert second != first and path.read_text().strip() == second  # a fresh one per launch
    wanted = tmp_path / "new" / "secret"
    third, _ = launch_secret("", str(wanted), "127.0.0.1", 8123)
    assert wanted.read_text().strip() == third  # --secret-file that does not exist yet: written there


def test_a_plain_replica_and_a_proxy_with_its_generated_secret(tmp_path):
    # Nothing configured: the generated secret goes under XDG_CACHE_HOME; torch's extension cache stays where
    # the suite's kernels are built (moved with XDG_CACHE_HOME, the replica compiled every C++ kernel anew:
    # up to 9 minutes on two busy cores, past the replica's start bound).
    kernels_root = os.path.dirname(build_directory("edgechat_cpu_ops", "cpu_ops.cpp")[1])  # torch's, + py*_cpu
    env = {"EDGECHAT_REPLICA_SECRET": "", "XDG_CACHE_HOME": str(tmp_path), "TORCH_EXTENSIONS_DIR": kernels_root}
    with replica_server("--kv-memory-gb", "0.1", env=env) as (url, _):
        port = url.rsplit(":", 1)[1]
        secret = (tmp_path / "edgechat" / "replica-secrets" / f"127.0.0.1-{port}").read_text().strip()
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 401
        ok = httpx.post(url + "/v1/chat/completions", json=body, timeout=60,
                        headers={"Authorization": f"Bearer {secret}"})
        assert ok.status_code == 200
        pport = free_port()
        proxy = subprocess.Popen([sys.executable, "-m", "edge_proxy", "--port", str(pport), "--allow-anonymous",
                                  "--replica", url.replace("http://", "ws://") + "/v1/replica"],
                                 env={**os.environ, "EDGECHAT_REPLICA_SECRET": secret}, start_new_session=True)
        try:
            wait_healthy(f"http://127.0.0.1:{pport}", proxy)

            async def ask():
                async with await EdgeClient.connect(f"ws://127.0.0.1:{pport}/v1/stream") as c:
                    return await c.complete(messages=body["messages"], max_tokens=4, temperature=0)
            text, done = asyncio.run(asyncio.wait_for(ask(), 120))
            assert done.usage.completion_tokens > 0 and done.finish_reason in ("length", "stop")
        finally:
            proxy.terminate()
            proxy.wait(30)
