"""Issue 11, item 9: connection caps per proxy and per source address with a clear
refusal, header timeouts, and /healthz answering under slowloris and descriptor
pressure while bystanders are served."""

import asyncio
import json
import os
import resource
import sys
import time

import httpx
import pytest

from edge_proxy import protocol as pp
from edge_proxy.client import EdgeClient
from edge_proxy.connections import ConnectionLimits
from stub_replica.server import expected_tokens
from tests.replica.server import free_port
from wire import protocol as P

from conftest import SECRET, proxy_for, stubs, until_line

pytestmark = pytest.mark.anyio


class Raw:
    """Raw TCP connections to the proxy from chosen source addresses (any of 127/8), all
    closed on exit."""

    def __init__(self, port: int):
        self.port, self.writers = port, []

    async def open(self, addr: str):
        r, w = await asyncio.open_connection("127.0.0.1", self.port, local_addr=(addr, 0))
        self.writers.append(w)
        return r, w

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        for w in self.writers:
            w.close()
        await asyncio.gather(*(w.wait_closed() for w in self.writers), return_exceptions=True)


async def answer(reader, timeout: float = 5.0) -> tuple[int, dict | None]:
    """(HTTP status, JSON body) of what the proxy answered on a raw connection (0: closed silently)."""
    data = await asyncio.wait_for(reader.read(), timeout)
    if not data:
        return 0, None
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body) if body else None


async def healthz(port: int) -> int:
    async with httpx.AsyncClient(trust_env=False, timeout=2.0) as h:  # a new connection each time
        return (await h.get(f"http://127.0.0.1:{port}/healthz")).status_code


async def test_per_address_cap_refuses_clearly():
    limits = ConnectionLimits(max_per_address=5)
    async with stubs("a") as reps, proxy_for(reps, connections=limits) as p, Raw(p.port) as raw:
        for _ in range(5):
            await raw.open("127.0.0.2")
        r, _ = await raw.open("127.0.0.2")
        status, body = await answer(r)
        assert status == 503 and body["code"] == pp.TOO_MANY_CONNECTIONS and "127.0.0.2" in body["message"]
        assert await healthz(p.port) == 200  # another address is not affected
        assert p.server.config.app.guard.counts["refused_address"] == 1


async def test_headers_must_arrive_in_time():
    limits = ConnectionLimits(header_timeout_s=0.3)
    async with stubs("a") as reps, proxy_for(reps, connections=limits) as p, Raw(p.port) as raw:
        r, w = await raw.open("127.0.0.2")
        t0 = time.perf_counter()
        w.write(b"GET /healthz HTTP/1.1\r\n")  # ... and the rest never comes
        status, body = await answer(r)
        assert status == 408 and 0.25 < time.perf_counter() - t0 < 2.0
        # a kept-alive connection: one full request, then a trickle
        r, w = await raw.open("127.0.0.2")
        w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(r.readuntil(b"}"), 5)).startswith(b"HTTP/1.1 200")
        w.write(b"GET /hea")
        status, _ = await answer(r)
        assert status == 408
        assert p.server.config.app.guard.counts["header_timeout"] == 2


async def test_at_the_cap_idle_connections_make_room_and_streams_are_never_evicted():
    limits = ConnectionLimits(max_connections=12)
    async with stubs("a", step_s=0.01) as reps, proxy_for(reps, connections=limits) as p, Raw(p.port) as raw:
        async with await EdgeClient.connect(p.ws_url, api_key="sk-alice") as c:
            req = await c.generate(prompt="keep going", max_tokens=100, temperature=0)
            idle = [await raw.open(f"127.0.0.{2 + i}") for i in range(11)]  # 12 with the stream's
            idle += [await raw.open("127.0.0.2") for _ in range(5)]  # each evicts the oldest idle one
            assert await healthz(p.port) == 200  # ... and so does a health check
            text, done = await req.result()
            assert done.finish_reason == "length" and len(text) == 100
            guard = p.server.config.app.guard
            assert guard.counts["evicted"] == 6 and "refused_total" not in guard.counts
            statuses = [(await answer(r))[0] for r, _ in idle[:6]]
            assert statuses == [0] * 6  # the six oldest were closed


async def _slowloris(addr: str, port: int, stop: asyncio.Event, stats: dict) -> None:
    """One attacker: open, trickle a request line a byte at a time, reconnect when dropped."""
    while not stop.is_set():
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port, local_addr=(addr, 0))
        except OSError:
            stats["connect_failed"] += 1
            await asyncio.sleep(0.05)
            continue
        stats["opened"] += 1
        try:
            for b in b"GET /v1/models HTTP/1.1\r\nHost: x\r\n":
                w.write(bytes([b]))
                try:
                    await asyncio.wait_for(r.read(1024), 0.5)  # anything read means we were answered/closed
                    break
                except TimeoutError:
                    if stop.is_set():
                        break
        except (ConnectionError, OSError):
            pass
        finally:
            w.close()
            try:
                await w.wait_closed()
            except (ConnectionError, OSError):
                pass
        stats["dropped"] += 1


async def test_slowloris_and_descriptor_pressure_keep_healthz_and_bystanders_served():
    """The proxy as a process with RLIMIT_NOFILE 256: 300 slowloris connections (ten
    source addresses, each reconnecting when dropped) for 4 s. /healthz answers 200
    every time, an open stream completes token-exact, a new client connects and is
    served, and the proxy logs what it refused and evicted."""
    async with stubs("a", step_s=0.02) as reps:
        port = free_port()
        env = {**os.environ, "EDGECHAT_REPLICA_SECRET": SECRET, "EDGECHAT_API_KEYS": "sk-t=tenant"}

        def low_fd_limit():
            resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "edge_proxy", "--replica", reps[0].url, "--port", str(port), "--tokenizer", "bytes",
            "--header-timeout", "2", "--max-connections-per-address", "40", stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, env=env, preexec_fn=low_fd_limit)
        stop = asyncio.Event()
        stats = {"opened": 0, "dropped": 0, "connect_failed": 0}
        try:
            await until_line(proc, "connection cap 192 (file limit 256 minus 64 reserved)")
            await until_line(proc, "ready at")
            url = f"ws://127.0.0.1:{port}/v1/stream"
            async with await EdgeClient.connect(url, api_key="sk-t") as c:
                req = await c.generate(prompt="bystander", max_tokens=150, temperature=0)  # 3 s of tokens
                attack = [asyncio.create_task(_slowloris(f"127.0.0.{10 + i % 10}", port, stop, stats))
                          for i in range(300)]
                t_end = time.perf_counter() + 4.0
                checks = []
                while time.perf_counter() < t_end:
                    t0 = time.perf_counter()
                    checks.append((await healthz(port), time.perf_counter() - t0))
                    await asyncio.sleep(0.2)
                async with await EdgeClient.connect(url, api_key="sk-t") as late:  # a new client gets in
                    _, d = await late.complete(prompt="late", max_tokens=3)
                    assert d.finish_reason == "length"
                text, done = await req.result()
                stop.set()
                await asyncio.gather(*attack)
            assert [s for s, _ in checks] == [200] * len(checks) and max(t for _, t in checks) < 1.0, checks
            want = "".join(map(chr, expected_tokens(list(b"bystander"), P.SamplingParams(temperature=0.0), 150)))
            assert done.finish_reason == "length" and text == want
            print(stats, f"healthz max {max(t for _, t in checks) * 1e3:.0f} ms over {len(checks)} checks")
            assert stats["opened"] > 300 and stats["dropped"] > 100, stats  # the attack really ran (and churned)
            proc.send_signal(2)
            _, err = await asyncio.wait_for(proc.communicate(), 20)
            log = err.decode()
            assert "refused a connection" in log or "evicted an idle connection" in log, log[-2000:]
            assert "Too many open files" not in log and "Traceback" not in log
        finally:
            stop.set()
            if proc.returncode is None:
                proc.kill()
                await proc.communicate()
