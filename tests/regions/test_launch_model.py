"""One real replica on the default model behind the launcher: up, a chat turn, down, nothing left."""

import io
import os

import pytest

from edge_proxy.client import EdgeClient
from regions.launch import Stack
from edge_proxy.select import ws_url
from regions.topology import parse

from tests.regions.ports import free_block

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


async def test_default_model_region_up_and_down(tmp_path):
    base = free_block(4)
    topo = parse(f'base_port = {base}\n[regions.local]\nreplicas = [{{}}]\n[clients.here]\nrtt_ms = {{ local = 20 }}\n',
                 "one.toml")
    out = io.StringIO()
    stack = Stack(topo, log_dir=tmp_path, out=out)
    await stack.start()
    try:
        # The suite's head cache is empty (tests/conftest.py): the launcher says how to train one.
        assert "speculative decoding: off, no EAGLE-3 head" in out.getvalue()
        assert "python -m speculative.train" in out.getvalue()
        url = stack.targets()["clients"]["here"]["local"]
        async with await EdgeClient.connect(ws_url(url)) as c:
            text, done = await c.complete(messages=[{"role": "user", "content": "Say hello."}], max_tokens=8,
                                          temperature=0.0)
        assert text and done.region == "local" and done.replica == "local-0"
        assert done.usage.completion_tokens >= 1 and done.timing.ttft_ms > 0
        pids = [c.proc.pid for c in stack.replicas + stack.proxies]
    finally:
        await stack.stop()
    for pid in pids:  # the replica's engine process went with its group
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
