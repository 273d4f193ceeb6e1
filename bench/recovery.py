"""Recovery benchmark: what a fault costs, next to the fault-free figure of the same run.

    .venv/bin/python bench/recovery.py              # all four tables
    .venv/bin/python bench/recovery.py --only gap   # one of: contain, engine, gap, supervise

1. contain: an engine step that raises (a poisoned request in a batch of 8 on the
   default model) and its containment (bisection, the culprit failed), against a
   plain decode step of the same batch.
2. engine: a real replica's engine process SIGKILLed: seconds until /healthz is 200
   again and until a new request's first token (the replica's cold start beside it).
3. gap: the longest silence a client sees in a stream whose replica (a stub process,
   5 ms steps, behind an in-process proxy) is SIGKILLed or SIGSTOPped after 5 tokens,
   against the stream's ordinary inter-token gap.
4. supervise: `regions.launch.Stack.supervise` on the stub topology: a replica
   SIGKILLed, seconds until its proxy counts it ready again.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from wire import protocol as P  # noqa: E402

SECRET = "bench-recovery-secret"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


# -- 1. containment -----------------------------------------------------------------------------------
def bench_contain(repeats: int) -> list[str]:
    import torch

    from replica.config import EngineConfig
    from replica.engine.containment import Containment
    from replica.engine.llm_engine import LLMEngine
    from replica.model.loader import load_checkpoint

    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    ckpt = load_checkpoint("default")
    plain, contained = [], []
    for r in range(repeats):
        engine = LLMEngine(EngineConfig(num_blocks=256, max_num_seqs=8), ckpt.config, ckpt.weights)
        box = Containment(engine)
        for i in range(8):
            sp = P.SamplingParams(max_tokens=64, temperature=0.7, seed=i, ignore_eos=True)
            engine.add(P.Generate(id=f"s{i}", prompt_ids=[1 + (7 * i + j) % 1000 for j in range(40)], sampling=sp))
        for _ in range(4):
            box.step()  # prefill, then decode
        t0 = time.perf_counter()
        box.step()
        plain.append(time.perf_counter() - t0)
        engine.seqs["s5"].sampling.top_k = 2**31  # the query of death, past validation
        t0 = time.perf_counter()
        out = box.step()
        contained.append(time.perf_counter() - t0)
        assert [m.id for m in out if isinstance(m, P.Error)] == ["s5"]
    ms = lambda xs: f"{statistics.median(xs) * 1e3:.0f}"  # noqa: E731
    return ["| step, batch 8, default model | median ms |", "|---|---|",
            row("plain decode step", ms(plain)),
            row("failing step + containment (bisection, culprit failed, 7 go on)", ms(contained))]


# -- 2. engine restart --------------------------------------------------------------------------------
def bench_engine(repeats: int) -> list[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {SECRET}"}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "replica", "--port", str(port), "--kv-memory-gb", "0.25"],
                            env={**os.environ, "EDGECHAT_REPLICA_SECRET": SECRET}, start_new_session=True,
                            stderr=subprocess.DEVNULL)

    def healthy() -> float:
        t = time.perf_counter()
        while True:
            try:
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    return time.perf_counter() - t
            except httpx.HTTPError:
                pass
            time.sleep(0.02)

    def first_token() -> float:
        t = time.perf_counter()
        with httpx.stream("POST", url + "/v1/completions", headers=auth, timeout=60,
                          json={"prompt": "Hello", "max_tokens": 2, "stream": True}) as r:
            for _ in r.iter_lines():
                return time.perf_counter() - t
        return float("nan")

    try:
        healthy()
        cold = time.perf_counter() - t0
        ready, token = [], []
        for _ in range(repeats):
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                engine = next(int(p) for p in f.read().split()
                              if b"engine_process" in open(f"/proc/{p}/cmdline", "rb").read())
            t = time.perf_counter()
            os.kill(engine, signal.SIGKILL)
            while httpx.get(url + "/healthz", timeout=2).status_code == 200:
                time.sleep(0.005)  # until the API process has noticed
            healthy()
            ready.append(time.perf_counter() - t)
            token.append(ready[-1] + first_token())
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    s = lambda xs: f"{statistics.median(xs):.2f}"  # noqa: E731
    return ["| replica, default model | median s |", "|---|---|",
            row("cold start of the whole replica (spawn to /healthz 200)", f"{cold:.2f}"),
            row(f"engine SIGKILL to /healthz 200 again ({repeats}x)", s(ready)),
            row("engine SIGKILL to a new request's first token", s(token))]


# -- 3. failover gap ----------------------------------------------------------------------------------
async def _gap(sig: int, repeats: int) -> tuple[list[float], list[float]]:
    from edge_proxy.app import create_app
    from edge_proxy.auth import KeyStore
    from edge_proxy.client import EdgeClient
    from edge_proxy.config import ProxyConfig
    from edge_proxy.core import Proxy
    from edge_proxy.pool import PoolConfig
    from edge_proxy.prompt import ByteTokenizer
    from edge_proxy.server import DrainingServer, bind, uvicorn_config

    async def stub(port: int):
        p = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "stub_replica", "--port", str(port), "--id", f"s{port}", "--secret", SECRET,
            "--step-ms", "5", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        await p.stdout.readline()
        return p

    ports = [free_port() for _ in range(3)]
    procs = {pt: await stub(pt) for pt in ports}
    pool = PoolConfig(secret=SECRET, stall_timeout_s=0.5, ping_interval_s=0.2, ping_timeout_s=0.4,
                      healthz_interval_s=0.2, backoff_min_s=0.02, backoff_max_s=0.1)
    cfg = ProxyConfig(replicas=[f"ws://127.0.0.1:{p}/v1/replica" for p in ports], port=0, tokenizer="bytes",
                      pool=pool, allow_anonymous=True, log_level="warning")
    proxy = Proxy(cfg, ByteTokenizer(), KeyStore([], salt_secret=SECRET, anonymous=True))
    sock = bind("127.0.0.1", 0)
    server = DrainingServer(uvicorn_config(create_app(proxy), cfg), proxy)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    normal, gaps = [], []
    try:
        await proxy.pool.wait_ready(3, timeout=30)
        async with await EdgeClient.connect(f"ws://127.0.0.1:{sock.getsockname()[1]}/v1/stream") as c:
            for i in range(repeats):
                await proxy.pool.wait_ready(3, timeout=30)
                req = await c.generate(prompt=f"gap {i}", max_tokens=40, temperature=0.5, seed=i)
                prev, seen, victim, fault = time.perf_counter(), 0, None, False
                async for d in req:
                    now = time.perf_counter()
                    if fault:
                        gaps.append(now - prev)  # kill to the next delta
                        fault = False
                    elif seen > 1 and not req.q.qsize():
                        normal.append(now - prev)
                    prev, seen = now, seen + len(d)
                    if seen >= 5 and victim is None and not req.q.qsize():  # caught up: the next one is due
                        victim = urlsplit(next(s for s in proxy.streams if s.cid == req.id).conn.url).port
                        os.kill(procs[victim].pid, sig)
                        prev, fault = time.perf_counter(), True
                assert req.done.failovers == 1
                if sig == signal.SIGSTOP:
                    os.kill(procs[victim].pid, signal.SIGCONT)
                else:
                    await procs[victim].wait()
                    procs[victim] = await stub(victim)
    finally:
        server.should_exit = True
        await task
        for p in procs.values():
            if p.returncode is None:
                p.kill()
            await p.wait()
    return normal, gaps


def bench_gap(repeats: int) -> list[str]:
    out = ["| replica lost mid-stream (stub, 5 ms steps) | ordinary gap p50 ms | gap at the fault p50 ms | max ms |",
           "|---|---|---|---|"]
    for sig, what in ((signal.SIGKILL, "SIGKILL (socket reset)"), (signal.SIGSTOP, "SIGSTOP (stall, 0.5 s)")):
        normal, gaps = asyncio.run(_gap(sig, repeats))
        out.append(row(what, f"{statistics.median(normal) * 1e3:.1f}", f"{statistics.median(gaps) * 1e3:.1f}",
                       f"{max(gaps) * 1e3:.1f}"))
    return out


# -- 4. supervised restart ----------------------------------------------------------------------------
async def _supervise(repeats: int) -> list[float]:
    import io

    from regions.launch import Stack
    from regions.topology import parse

    base = free_port()  # the topology's ports count up from here
    topo = f"""replica_kind = "stub"\nbase_port = {base}\nstub_step_ms = 5.0\n[regions.eu]\nreplicas = [{{}}, {{}}]\n"""
    stack = Stack(parse(topo, "stub.toml"), log_dir=tempfile.mkdtemp(), out=io.StringIO(), relays=False)
    await stack.start()
    out = []
    try:
        stack.supervise(stable_s=0.0)  # every restart waits the first backoff, 0.5 s
        url = stack.proxy_url("eu")
        async with httpx.AsyncClient(trust_env=False) as h:
            for i in range(repeats):
                victim = stack.replicas[i % 2]
                t = time.perf_counter()
                os.killpg(victim.proc.pid, signal.SIGKILL)
                while (await h.get(url + "/healthz")).json()["replicas_ready"] == 2:
                    await asyncio.sleep(0.005)
                while (await h.get(url + "/healthz")).json()["replicas_ready"] < 2:
                    await asyncio.sleep(0.01)
                out.append(time.perf_counter() - t)
    finally:
        await stack.stop()
    return out


def bench_supervise(repeats: int) -> list[str]:
    times = asyncio.run(_supervise(repeats))
    return ["| regions up, stub replica SIGKILLed | median s | max s |", "|---|---|---|",
            row(f"kill to the proxy counting it ready again ({repeats}x; 0.5 s backoff included)",
                f"{statistics.median(times):.2f}", f"{max(times):.2f}")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["contain", "engine", "gap", "supervise"])
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
          f"{time.strftime('%Y-%m-%d')}; python bench/recovery.py{' --only ' + a.only if a.only else ''}\n")
    benches = {"contain": bench_contain, "engine": bench_engine, "gap": lambda n: bench_gap(4 * n),
               "supervise": bench_supervise}
    for name, fn in benches.items():
        if a.only in (None, name):
            print("\n".join(fn(a.repeats)) + "\n", flush=True)


if __name__ == "__main__":
    main()
