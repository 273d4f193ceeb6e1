"""Prefix-aware routing end to end: a proxy over three real default-model replicas,
chats without session ids.

Six conversations start together (each with its own system prompt), and take three
short turns each, all six streaming at once. Each later turn must find its
conversation's replica with nothing but the prompt: the cached tokens it reports
cover at least every full block of its first turn's prompt; and the replicas stay
balanced (two conversations each). The replicas announce the cores they run on, so
the proxy sees them as one compute group.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections import Counter

import httpx
import pytest

from edge_proxy.client import EdgeClient
from tests.prom import samples
from tests.replica.server import free_port, replica_server, wait_healthy

SECRET = {"EDGECHAT_REPLICA_SECRET": "e2e-routing-secret"}
BLOCK = 16
SUBJECTS = ["trains", "gardens", "invoices", "telescopes", "bicycles", "recipes"]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@contextlib.contextmanager
def proxy_over_three_replicas():
    with contextlib.ExitStack() as es:
        urls = [es.enter_context(replica_server("--replica-id", rid, "--kv-memory-gb", "0.25", "--speculative", "off",
                                                env=SECRET))[0] for rid in ("A", "B", "C")]
        port = free_port()
        cmd = [sys.executable, "-m", "edge_proxy", "--port", str(port), "--allow-anonymous", "--stall-timeout", "30"]
        for url in urls:
            cmd += ["--replica", url.replace("http://", "ws://") + "/v1/replica"]
        proxy = subprocess.Popen(cmd, env={**os.environ, **SECRET}, start_new_session=True)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", proxy)
            yield f"ws://127.0.0.1:{port}/v1/stream"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proxy.pid, signal.SIGTERM)
            proxy.wait(30)


async def chat(c: EdgeClient, k: int, turns: int) -> list:
    msgs = [{"role": "system", "content": f"Desk {k}. You answer questions about {SUBJECTS[k]} in one short "
                                          f"sentence, politely, and never ask a question back. " * 2}]
    done = []
    for n in range(turns):
        msgs.append({"role": "user", "content": f"Tell me fact number {n + 1} about {SUBJECTS[k]}."})
        text, d = await c.complete(messages=msgs, max_tokens=6, temperature=0)
        done.append(d)
        msgs.append({"role": "assistant", "content": text})
    return done


def test_later_turns_find_their_replica_without_a_session():
    with proxy_over_three_replicas() as url:
        async def run():
            async with await EdgeClient.connect(url) as c:
                return await asyncio.gather(*(chat(c, k, 3) for k in range(len(SUBJECTS))))

        convs = asyncio.run(run())
        metrics = httpx.get(url.replace("ws://", "http://").replace("/v1/stream", "/metrics"), trust_env=False).text
    # The three replicas run on this machine's cores: one compute group (no valve between them).
    assert samples(metrics)["edgechat_proxy_compute_groups"] == 1
    for first, *later in convs:
        assert first.usage.prompt_tokens >= 3 * BLOCK
        for d in later:
            assert d.replica == first.replica, "a later turn left its conversation's replica"
            assert d.usage.cached_tokens >= first.usage.prompt_tokens // BLOCK * BLOCK
    assert sorted(Counter(first.replica for first, *_ in convs).values()) == [2, 2, 2]
