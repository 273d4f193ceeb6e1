"""One real replica on the default model behind the launcher: its start-up stages shown as they end,
up, a chat turn, down, nothing left."""

import io
import os
import re
from pathlib import Path

import httpx
import pytest

from edge_proxy.client import EdgeClient
from regions.launch import Stack
from edge_proxy.select import ws_url
from regions.topology import parse
from replica import stages

from tests.prom import samples
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
        lines = out.getvalue().splitlines()
        assert lines[0] == f"regions: logs in {tmp_path}; starting 1 replica (a first start compiles kernels and " \
                           "loads weights: minutes; each stage is shown as it ends)"
        # The replica's start-up stages, each once, in order, with its time, before the launcher says it is ready.
        done = [(m.group(1), float(m.group(2))) for ln in lines
                if (m := re.fullmatch(r"  local-0: ([a-z ]+) (\d+\.\d) s", ln))]
        assert [name for name, _ in done] == ["building kernels", "loading weights", "building engine", "warming up"]
        ready = next(i for i, ln in enumerate(lines) if ln.startswith("replica  local-0"))
        assert all(lines.index(f"  local-0: {name} {t:.1f} s") < ready for name, t in done)
        for i, ln in enumerate(lines):  # a stage past two seconds said so first ("building kernels ... (why)")
            if m := re.match(r"  local-0: ([a-z ]+) \.\.\.", ln):
                assert i < lines.index(next(f"  local-0: {n} {t:.1f} s" for n, t in done if n == m.group(1)))
        # The same lines in the replica's own log, as a replica alone prints them, and its ready line.
        log = (tmp_path / "replica-local-0.log").read_text().splitlines()
        assert [stages.parse(ln)[0] for ln in log if stages.parse(ln) and stages.parse(ln)[1] is not None] == \
            ["building kernels", "loading weights", "building engine", "warming up", "ready"]
        # The suite's head cache is empty (tests/conftest.py): the launcher says how to train one.
        assert "speculative decoding: off, no EAGLE-3 head" in out.getvalue()
        assert "python -m speculative.train" in out.getvalue()
        url = stack.targets()["clients"]["here"]["local"]
        async with await EdgeClient.connect(ws_url(url)) as c:
            text, done = await c.complete(messages=[{"role": "user", "content": "Say hello."}], max_tokens=8,
                                          temperature=0.0)
        assert text and done.region == "local" and done.replica == "local-0"
        assert done.usage.completion_tokens >= 1 and done.timing.ttft_ms > 0
        # The replica's /metrics, scraped as the launcher's line says: the secret from its mode-600 file.
        t = stack.targets()
        rep, secret = t["replicas"]["local-0"], Path(t["replica_secret_file"]).read_text().strip()
        async with httpx.AsyncClient(trust_env=False) as h:
            assert (await h.get(rep + "/metrics")).status_code == 401
            m = samples((await h.get(rep + "/metrics", headers={"Authorization": f"Bearer {secret}"})).text)
        assert m['edgechat_replica_requests_total{finish_reason="length"}'] + \
            m.get('edgechat_replica_requests_total{finish_reason="stop"}', 0) == 1
        pids = [c.proc.pid for c in stack.replicas + stack.proxies]
    finally:
        await stack.stop()
    for pid in pids:  # the replica's engine process went with its group
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
