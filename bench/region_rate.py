"""A key's rate limit across the proxies of one region, measured from outside (issue 44).

    .venv/bin/python bench/region_rate.py                         # 1 proxy, 2, 2 x 2 workers, 2 skewed; 20 s each
    .venv/bin/python bench/region_rate.py --seconds 5 --rate 40 --shapes 2x1

Processes (all on 127.0.0.1): one replica stub (`python -m stub_replica`, 1 ms steps),
P proxy processes over it (`python -m edge_proxy --region-proxies P --workers W`: each
process enforces 1 / (P x W) of every key's limits, `edge_proxy/limits.py`), and one
client process per proxy (this file, `--role client`). The key under test has `--rate`
requests a second for the region and a burst of `--burst`. Each client process runs
`--concurrency` loops that send a one-token `/v1/completions` request, each on a new
connection (so the kernel's SO_REUSEPORT choice spreads them over a proxy's workers, as a
load balancer would), and the next one as soon as it is answered (200, or 429 when the
key is over its limit): far more than the limit, half to each proxy (":one": all of it to
the first, which can take only its share: the limit's design assumes a load balancer
spreading a key's requests, `edge_proxy/limits.py`).

Figures, over the steady window (requests sent from `--warmup` s after the clients start,
when the burst is spent, to the end): offered and accepted requests a second, accepted /
the limit (the goal: 1 +- 0.10 with several proxies, as with one), and how the accepted
split over the proxies. Send times are read on the machine's one monotonic clock in
every client process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.replica.server import free_port, stop_group  # noqa: E402  (process helpers shared with the tests)

PY = sys.executable
KEY = "sk-metered"


def spawn(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    f = open(log, "ab")
    return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            start_new_session=True, cwd=ROOT)


def wait_ready(url: str, proc: subprocess.Popen, what: str, timeout: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} (see the logs)")
        try:
            if httpx.get(url, timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{what} not ready at {url} after {timeout:g} s")


def run_shape(a, proxies: int, workers: int, one: bool, logs: Path) -> dict:
    """One region of `proxies` x `workers` processes over one stub; its clients' calls (a
    client process per proxy, each to its own, or with `one` every one to the first)."""
    procs: list[subprocess.Popen] = []
    try:
        port = free_port()
        procs.append(spawn([PY, "-m", "stub_replica", "--port", str(port), "--step-ms", "1",
                            "--load-interval-ms", "50"], logs / "stub.log"))
        replica = f"ws://127.0.0.1:{port}/v1/replica"
        env = {"EDGECHAT_REPLICA_SECRET": "", "EDGECHAT_API_KEYS": f"{KEY}=metered:interactive:{a.rate:g}:{a.burst:g}"}
        urls = []
        for i in range(proxies):
            port = free_port()
            procs.append(p := spawn([PY, "-m", "edge_proxy", "--replica", replica, "--port", str(port), "--tokenizer",
                                     "bytes", "--workers", str(workers), "--region-proxies", str(proxies),
                                     "--log-level", "warning"], logs / f"proxy{i}-{proxies}x{workers}.log", env))
            wait_ready(f"http://127.0.0.1:{port}/healthz", p, "edge_proxy")
            urls.append(f"http://127.0.0.1:{port}")
        if one:
            urls = urls[:1] * proxies
        start = time.monotonic() + 1.0  # every client starts at once
        outs = [logs / f"calls{i}-{proxies}x{workers}.json" for i in range(proxies)]
        clients = [spawn([PY, __file__, "--role", "client", "--url", u, "--start", repr(start), "--seconds",
                          str(a.seconds), "--concurrency", str(a.concurrency), "--json", str(out)],
                         logs / f"client{i}-{proxies}x{workers}.log") for i, (u, out) in enumerate(zip(urls, outs))]
        calls = []
        for i, (c, out) in enumerate(zip(clients, outs)):
            if c.wait(timeout=a.seconds + 120) != 0:
                raise RuntimeError(f"client {i} exited with {c.returncode} (see {logs})")
            calls.append(json.loads(out.read_text()))
        return {"start": start, "calls": calls}
    finally:
        for p in reversed(procs):
            stop_group(p)


def summarize(a, proxies: int, workers: int, one: bool, run: dict) -> dict:
    lo, hi = run["start"] + a.warmup, run["start"] + a.seconds
    window = hi - lo
    per_proxy, offered, codes = [], 0, set()
    for calls in run["calls"]:
        steady = [(s, code) for s, code in calls if lo <= s < hi]
        offered += len(steady)
        per_proxy.append(sum(code == 200 for _, code in steady))
        codes |= {code for _, code in calls}
    accepted = sum(per_proxy)
    return {"shape": f"{proxies}x{workers}" + (":one" if one else ""), "proxies": proxies, "workers": workers,
            "one": one, "window_s": window,
            "offered_per_s": offered / window, "accepted_per_s": accepted / window,
            "of_limit": accepted / window / a.rate, "per_proxy": per_proxy, "codes": sorted(codes)}


async def client(url: str, start: float, seconds: float, concurrency: int) -> list[tuple[float, int]]:
    import httpx

    calls: list[tuple[float, int]] = []
    limits = httpx.Limits(max_keepalive_connections=0)  # a new connection a request: spread over the workers
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30, trust_env=False,
                                 headers={"Authorization": f"Bearer {KEY}"}) as h:
        async def loop() -> None:
            while (sent := time.monotonic()) < start + seconds:
                r = await h.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
                calls.append((sent, r.status_code))

        await asyncio.sleep(max(start - time.monotonic(), 0.0))
        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=50.0, help="the key's requests a second, for the region")
    p.add_argument("--burst", type=float, default=10.0)
    p.add_argument("--seconds", type=float, default=20.0, help="how long the clients send, per shape")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds left out at the start (the burst)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight per proxy")
    p.add_argument("--shapes", default="1x1,2x1,2x2,2x1:one", help="PROXIESxWORKERS[:one], comma-separated "
                   "(\":one\": every client on the first proxy, as when a load balancer sends a key's traffic to one)")
    p.add_argument("--json", default="", help="also write the rows here")
    p.add_argument("--role", default="main", choices=["main", "client"], help=argparse.SUPPRESS)
    p.add_argument("--url", default="", help=argparse.SUPPRESS)
    p.add_argument("--start", type=float, default=0.0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.role == "client":
        import uvloop

        Path(a.json).write_text(json.dumps(uvloop.run(client(a.url, a.start, a.seconds, a.concurrency))))
        return
    if a.warmup >= a.seconds:
        raise SystemExit("--warmup must be shorter than --seconds")
    load0, began = os.getloadavg()[0], time.strftime("%Y-%m-%d %H:%M")
    logs = Path(tempfile.mkdtemp(prefix="bench-region-rate-"))
    print(f"logs in {logs}", flush=True)
    rows = []
    for shape in a.shapes.split(","):
        size, _, mod = shape.partition(":")
        proxies, _, workers = size.partition("x")
        if mod not in ("", "one"):
            raise SystemExit(f"--shapes: {shape!r}: PROXIESxWORKERS[:one]")
        n, w, one = int(proxies), int(workers or 1), mod == "one"
        rows.append(row := summarize(a, n, w, one, run_shape(a, n, w, one, logs)))
        print(f"{row['shape']}: accepted {row['accepted_per_s']:.1f}/s of {row['offered_per_s']:.0f}/s offered "
              f"({row['of_limit']:.3f} of the limit), per proxy {row['per_proxy']}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    print(f"\na key's rate limit across one region's proxies — {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, {platform.system()} {platform.release()}, {began}; load average {load0:.1f} "
          f"at the start, {os.getloadavg()[0]:.1f} at the end; limit {a.rate:g}/s (burst {a.burst:g}) for the region; "
          f"{a.concurrency} requests in flight per proxy; steady window {a.seconds - a.warmup:g} s")
    print("| proxies | offered /s | accepted /s | accepted / limit | accepted per proxy | answers |")
    print("|---|---:|---:|---:|---|---|")
    for r in rows:
        name = (f"{r['proxies']}" + (f" x {r['workers']} workers" if r["workers"] > 1 else "")
                + (", every client on the first" if r["one"] else ""))
        per = " / ".join(map(str, r["per_proxy"])) if not r["one"] else f"{sum(r['per_proxy'])} / 0"
        print(f"| {name} | {r['offered_per_s']:.0f} | {r['accepted_per_s']:.1f} | {r['of_limit']:.3f} | "
              f"{per} | {', '.join(map(str, r['codes']))} |")


if __name__ == "__main__":
    main()
