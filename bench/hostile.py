"""Hostile load at the edge (issue 11): admission at 2x overload, and bystanders'
inter-token gaps while attackers send megabyte prompts.

    .venv/bin/python bench/hostile.py                 # both parts, ~30 s
    .venv/bin/python bench/hostile.py --overload-s 5 --attack-tokens 200

Processes (all on 127.0.0.1): replica stubs (`python -m stub_replica`), the proxy
(`python -m edge_proxy`), attacker clients (this script, `--role attacker`), and
this process as the measured clients.

Overload: one stub running `--max-running 8` requests at once, 10 ms steps, 20
tokens per request (capacity 40 requests/s), offered 80 requests/s open loop.
Side by side: with a deadline (`deadline_ms` 300: admission refuses what cannot
start in time) and without one (everything queues). `late` = admitted requests
whose first token came after 300 ms (client clock); `refusal` = time from sending a
request to its `overloaded` answer.

Attack: the proxy on the model's own tokenizer, a stub announcing it, 4 bystander
streams of 20 ms tokens. Side by side: their inter-token gaps alone, and while 3
attacker connections loop over a 1 MB prompt, a 1 MB role, 30,000 messages and a
200 KB prompt (tokenized, then over the context).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PY = sys.executable
KEY = "sk-bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], ready: str, env=None, timeout: float = 60.0) -> subprocess.Popen:
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        line = p.stdout.readline()
        if not line:
            raise SystemExit(f"{cmd[:3]} exited before {ready!r}")
        if ready in line:
            return p
    raise SystemExit(f"{cmd[:3]}: no {ready!r} within {timeout} s")


def stub(step_ms: float, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    p = start([PY, "-m", "stub_replica", "--port", str(port), "--step-ms", str(step_ms), "--load-interval-ms", "20",
               *extra], "READY")
    return p, f"ws://127.0.0.1:{port}/v1/replica"


def proxy(replica: str, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "EDGECHAT_REPLICA_SECRET": "", "EDGECHAT_API_KEYS": f"{KEY}=bench:interactive:1e9:1e9"}
    p = start([PY, "-m", "edge_proxy", "--replica", replica, "--port", str(port), "--healthz-interval", "0.5",
               "--max-frame-bytes", str(2 << 20), "--log-level", "warning", *extra], "listening", env=env)
    import httpx

    t_end = time.monotonic() + 30
    while time.monotonic() < t_end:  # until its replica is ready
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", trust_env=False).status_code == 200:
                return p, f"ws://127.0.0.1:{port}/v1/stream"
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit("the proxy's replica did not become ready")


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else float("nan")


class Client:
    """The public protocol, timing every frame's arrival per request id."""

    def __init__(self, ws):
        self.ws, self.first, self.arrivals, self.ends = ws, {}, {}, {}
        self.changed = asyncio.Event()
        self.reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def connect(cls, url: str) -> Client:
        from websockets.asyncio.client import connect

        return cls(await connect(url, additional_headers={"Authorization": f"Bearer {KEY}"}, compression=None,
                                 proxy=None, max_size=None))

    async def _read(self) -> None:
        async for data in self.ws:
            now = time.perf_counter()
            f = json.loads(data)
            rid = f.get("id")
            self.first.setdefault(rid, now)
            if f["type"] == "delta":
                self.arrivals.setdefault(rid, []).append(now)
            else:
                self.ends[rid] = f
            self.changed.set()

    async def until(self, pred, timeout: float = 60.0) -> None:
        async with asyncio.timeout(timeout):
            while not pred():
                self.changed.clear()
                await self.changed.wait()

    async def send(self, rid: str, prompt: str, max_tokens: int, **kw) -> None:
        await self.ws.send(json.dumps({"type": "generate", "id": rid, "prompt": prompt,
                                       "sampling": {"max_tokens": max_tokens, "temperature": 0}, **kw}))

    async def close(self) -> None:
        await self.ws.close()
        await asyncio.gather(self.reader, return_exceptions=True)


# -- overload ---------------------------------------------------------------------------------

async def offer(url: str, rate: float, secs: float, deadline_ms: float, tag: str) -> dict:
    clients = [await Client.connect(url) for _ in range(4)]
    sent = {}
    t0 = time.perf_counter()
    n = int(rate * secs)
    for i in range(n):
        await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
        rid = f"{tag}{i}"
        sent[rid] = time.perf_counter()
        await clients[i % 4].send(rid, f"load {i}", 20, deadline_ms=deadline_ms)
    for c in clients:
        await c.until(lambda c=c: len(c.ends) == n // 4, timeout=120)
    ends = {r: (c.ends[r], c.first[r]) for c in clients for r in c.ends}
    admitted = [r for r, (f, _) in ends.items() if f["type"] == "done"]
    refused = [(t - sent[r]) * 1e3 for r, (f, t) in ends.items() if f["type"] == "error"]
    ttft = [(ends[r][1] - sent[r]) * 1e3 for r in admitted]
    for c in clients:
        await c.close()
    return {"admitted": len(admitted), "offered": n, "late": sum(t > 300.0 for t in ttft),
            "ttft50": pct(ttft, 50), "ttft99": pct(ttft, 99), "ref50": pct(refused, 50), "ref99": pct(refused, 99),
            "secs": secs}


# -- attack -----------------------------------------------------------------------------------

def attack_frames() -> list[str]:
    words = " ".join(f"w{i % 997}" for i in range(40_000))
    return [json.dumps(m) for m in (
        {"type": "generate", "id": "big", "prompt": "x" * 1_000_000},
        {"type": "generate", "id": "role", "messages": [{"role": "r" * 1_000_000, "content": "x"}]},
        {"type": "generate", "id": "many", "messages": [{"role": "user", "content": ""}] * 30_000},
        {"type": "generate", "id": "long", "prompt": words})]


async def attacker(url: str, conns: int) -> None:
    """--role attacker: loop over the attack frames on `conns` sockets until stdin closes."""
    frames, stop, rounds = attack_frames(), asyncio.Event(), [0]

    async def one():
        c = await Client.connect(url)
        while not stop.is_set():
            c.ends.clear()
            for f in frames:
                await c.ws.send(f)
            await c.until(lambda: len(c.ends) == len(frames))
            rounds[0] += 1
        await c.close()

    tasks = [asyncio.create_task(one()) for _ in range(conns)]
    print("READY", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    stop.set()
    await asyncio.gather(*tasks)
    print(json.dumps({"rounds": rounds[0]}), flush=True)


async def bystanders(url: str, tokens: int) -> list[float]:
    c = await Client.connect(url)
    rids = [f"b{i}-{time.monotonic_ns()}" for i in range(4)]
    for i, rid in enumerate(rids):
        await c.send(rid, f"bystander {i}", tokens)
    await c.until(lambda: all(r in c.ends for r in rids), timeout=120)
    await c.close()
    return [(b - a) * 1e3 for r in rids for a, b in zip(c.arrivals[r], c.arrivals[r][1:])]


async def measure(a) -> None:
    procs: list[subprocess.Popen] = []
    try:
        s, surl = stub(10.0, "--max-running", "8")
        procs.append(s)
        p, purl = proxy(surl, "--tokenizer", "bytes")
        procs.append(p)
        rows = []
        for label, deadline in (("admission (deadline 300 ms)", 300.0), ("no deadline (all queue)", 0.0)):
            rows.append((label, await offer(purl, 80.0, a.overload_s, deadline, label[:2])))
            await asyncio.sleep(2.0)  # let the queue drain between the two
        print(f"\n## Overload: 80 requests/s offered to a 40/s stub for {a.overload_s:g} s\n")
        print("| run | admitted/s | late (>300 ms) | TTFT p50 | TTFT p99 | refusal p50 | refusal p99 |")
        print("|---|---|---|---|---|---|---|")
        for label, r in rows:
            print(f"| {label} | {r['admitted'] / r['secs']:.1f} | {r['late']}/{r['admitted']} | "
                  f"{r['ttft50']:.0f} ms | {r['ttft99']:.0f} ms | {r['ref50']:.2f} ms | {r['ref99']:.2f} ms |")

        from edge_proxy.prompt import load_tokenizer

        fp = load_tokenizer("default").fingerprint
        s2, surl2 = stub(20.0, "--tokenizer", fp)
        procs.append(s2)
        p2, purl2 = proxy(surl2, "--tokenizer", "default")
        procs.append(p2)
        await bystanders(purl2, 10)
        base = await bystanders(purl2, a.attack_tokens)
        att = subprocess.Popen([PY, __file__, "--role", "attacker", "--url", purl2], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
        procs.append(att)
        assert att.stdout.readline().strip() == "READY"
        under = await bystanders(purl2, a.attack_tokens)
        att.stdin.close()
        rounds = json.loads(att.stdout.readline())["rounds"]
        print(f"\n## Bystanders (4 streams x {a.attack_tokens} tokens, 20 ms steps) under attack "
              f"({rounds} rounds of 4 frames by 3 attackers)\n")
        print("| run | gap p50 | gap p99 | gap max |")
        print("|---|---|---|---|")
        for label, g in (("alone", base), ("under attack", under)):
            print(f"| {label} | {pct(g, 50):.1f} ms | {pct(g, 99):.1f} ms | {max(g):.1f} ms |")
        print(f"\n{platform.node()} ({os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}), "
              f"{time.strftime('%Y-%m-%d')}, `{' '.join([Path(sys.executable).name] + sys.argv)}`")
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--overload-s", type=float, default=4.0)
    ap.add_argument("--attack-tokens", type=int, default=150)
    ap.add_argument("--role", default="bench", choices=["bench", "attacker"])
    ap.add_argument("--url", default="")
    a = ap.parse_args()
    import uvloop

    if a.role == "attacker":
        uvloop.run(attacker(a.url, 3))
    else:
        uvloop.run(measure(a))


if __name__ == "__main__":
    main()
