"""Chaos with real signals: replica stub processes SIGKILLed or SIGSTOPped mid-stream,
100 times each, under a proxy; every stream finishes exactly as it would have.

Each kill hits the replica serving a stream after its 5th token, with a bystander
stream in flight on the same replica (same session) and one wherever the load put it. A killed stub is started again
on its port (the proxy reconnects); a stopped one is let go on (SIGCONT) once its
stream has moved. Lanes (a proxy and its own stubs each) run side by side so the
waits overlap. Asserted per iteration: the text is token for token the stub's
deterministic stream (no gap, no repeat), the stream moved exactly once and away
from the victim, every bystander is exact too; at the end no stream is left in
the proxy and no replica lost count of its requests.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from dataclasses import dataclass, replace

import pytest

from edge_proxy.client import EdgeClient
from edge_proxy.prompt import ByteTokenizer
from stub_replica.server import expected_tokens
from tests.replica.server import free_port_range
from wire import protocol as P

from conftest import FAST_POOL, SECRET, proxy_for

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
ITERATIONS = int(os.environ.get("EDGECHAT_CHAOS_ITERATIONS", "100"))
LANES = min(4, ITERATIONS)
STUBS_PER_LANE = 4
TOKENS = 60  # per stream: 0.3 s at the stubs' 5 ms steps
# Detection fast enough for 100 freezes, slow enough that a loaded 2-core machine (4 proxies and their
# clients in this process) is not mistaken for a frozen replica: a false loss on top of the real one
# would fail the stream as a poison pill (two replicas lost under it).
POOL = replace(FAST_POOL, stall_timeout_s=1.0, ping_interval_s=0.5, ping_timeout_s=1.0, healthz_interval_s=0.3,
               healthz_failures=3, backoff_min_s=0.02, backoff_max_s=0.1, hello_timeout_s=2.0)


@dataclass
class StubProcess:
    rid: str
    port: int
    proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/replica"

    async def start(self) -> StubProcess:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "stub_replica", "--port", str(self.port), "--id", self.rid, "--secret", SECRET,
            "--step-ms", "5", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        line = await asyncio.wait_for(self.proc.stdout.readline(), 60)
        assert line.startswith(b"READY"), line
        return self

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()


def expected_text(prompt: str, max_tokens: int, seed: int) -> str:
    sp = P.SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=seed)
    return "".join(map(chr, expected_tokens(ByteTokenizer().encode(prompt), sp, max_tokens)))


async def lane(n: int, sig: int, iterations: int, base_port: int) -> dict:
    stubs = [await StubProcess(f"l{n}-{k}", base_port + k).start() for k in range(STUBS_PER_LANE)]
    restarts: set[asyncio.Task] = set()
    try:
        async with proxy_for(stubs, pool=POOL) as p, await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            i = attempt = 0
            while i < iterations:
                attempt += 1
                assert attempt < 2 * iterations, "streams keep finishing before they can be hit"
                assert await p.proxy.pool.wait_ready(STUBS_PER_LANE - 1, timeout=30), "replicas did not come back"
                seed = 1000 * n + attempt
                prompts = [f"chaos {sig} lane {n} attempt {attempt} stream {k}" for k in range(3)]
                # Streams 0 and 1 share a session (so a replica); stream 2 goes where the load says.
                reqs = [await c.generate(prompt=q, max_tokens=TOKENS, temperature=0.9, seed=seed,
                                         session=f"lane{n}-{attempt}" if k < 2 else None)
                        for k, q in enumerate(prompts)]
                main, victim, got = reqs[0], None, 0
                async for delta in main:
                    got += len(delta)
                    if victim is None and got >= 5:
                        s = next((s for s in p.proxy.streams if s.cid == main.id and s.conn is not None), None)
                        if s is None:
                            break  # a loaded machine read the deltas late: the stream is over, try again
                        victim = next(stub for stub in stubs if stub.rid == s.conn.id)
                        os.kill(victim.proc.pid, sig)
                for q, r in zip(prompts, reqs):
                    text, done = (main.text, main.done) if r is main and main.done else await r.result()
                    assert text == expected_text(q, TOKENS, seed), (n, attempt, q)
                if victim is None:
                    continue
                assert main.done.failovers <= 1, (n, attempt, main.done)
                if main.done.failovers == 1:  # else the kill came after its last token had left the stub
                    i += 1
                    assert main.done.replica != victim.rid, (n, attempt, main.done)
                if sig == signal.SIGSTOP:
                    os.kill(victim.proc.pid, signal.SIGCONT)  # thawed: its stale socket closes, the proxy reconnects
                else:
                    restarts.add(asyncio.create_task(restart(victim)))
            await asyncio.gather(*restarts)
            assert await p.proxy.pool.wait_ready(STUBS_PER_LANE, timeout=30)
            assert not p.proxy.streams and all(not conn.streams for conn in p.proxy.pool.conns)
            return dict(p.proxy.metrics.failovers.values)
    finally:
        for t in restarts:
            t.cancel()
        for s in stubs:
            await s.kill()


async def restart(s: StubProcess) -> None:
    await s.kill()
    await s.start()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
async def test_replicas_killed_or_frozen_mid_stream_lose_nothing(sig):
    per_lane = ITERATIONS // LANES
    # Ports below the ephemeral range: a killed stub's port stays free for its restart.
    base = free_port_range(LANES * STUBS_PER_LANE)
    async with asyncio.timeout(240), asyncio.TaskGroup() as tg:  # a failing lane cancels the others
        lanes = [tg.create_task(lane(n, sig, per_lane, base + n * STUBS_PER_LANE)) for n in range(LANES)]
    failovers = [t.result() for t in lanes]
    causes = {k: sum(f.get(k, 0) for f in failovers) for f in failovers for k in f}
    assert sum(causes.values()) >= 2 * ITERATIONS, causes  # the bystander sharing the victim moved too
    print(f"{signal.Signals(sig).name}: {ITERATIONS} kills in {LANES} lanes, failovers by cause {causes}")


async def test_a_replica_thawed_after_a_long_freeze_stays_up():
    """The proxy's reconnect to a frozen replica waits in the handshake; once thawed, keepalive
    counts from the upgrade (not from that wait), so the replica is not dropped again."""
    pool = replace(POOL, hello_timeout_s=10.0)
    base = free_port_range(2)
    stubs = [await StubProcess(f"t{k}", base + k).start() for k in range(2)]
    try:
        async with proxy_for(stubs, pool=pool) as p:
            frozen = stubs[0]
            os.kill(frozen.proc.pid, signal.SIGSTOP)
            conn = p.conn(frozen.rid)
            assert await p.proxy.pool.wait_for(lambda: not conn.ready, timeout=10)
            await asyncio.sleep(3 * (pool.ping_interval_s + pool.ping_timeout_s))  # reconnecting meanwhile
            os.kill(frozen.proc.pid, signal.SIGCONT)
            assert await p.proxy.pool.wait_for(lambda: conn.ready, timeout=10)
            states: list[bool] = []
            p.proxy.pool.state_listeners.append(lambda: states.append(conn.ready))
            await asyncio.sleep(2 * (pool.ping_interval_s + pool.ping_timeout_s))
            assert conn.ready and False not in states, "dropped again after the thaw"
    finally:
        for s in stubs:
            await s.kill()
