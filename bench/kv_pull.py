"""One replica pulls a long prompt's KV from another, by export frame size: wall time and the CPU
seconds of each of the four processes the bytes cross, in one run; idle, or with both replicas
decoding (`--busy N`: N streams on each, as in a drain).

    .venv/bin/python bench/kv_pull.py              # ~1,300 tokens (~30 MB of fp16 KV), frames of 4, 8, 22 blocks
    .venv/bin/python bench/kv_pull.py --frames 8,32 --repeat 3
    .venv/bin/python bench/kv_pull.py --frames 8 --repeat 3 --busy 4

Two default-model replicas A and B (`--kv-memory-gb 2`); each trial prefills a distinct prompt
on A (its first token differs) and times B's POST /v1/kv/pull of it (every full block moves: B
never saw it). The frame size is the pull's `frame_blocks` (A cuts a frame to 16 MiB: 22 blocks
here). CPU is each process's user + system time over the pull, from /proc. With `--busy N`, N
streaming completions run on each replica through the pull (the prompt's blocks and a distinct
last token: cached but the last block, then decoding), started before it and closed after it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import threading
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from time import perf_counter

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.replica.server import AUTH, engine_pid, replica_server  # noqa: E402

TEXT = "The archive of the harbour town keeps the logbooks of every boat, the weather of every morning. " * 60


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def decoding(urls: list[str], ids: list[int], n: int):
    """n streams decoding on each replica of `urls` while the block runs (each past its first token first)."""
    if n == 0:
        yield
        return
    stop, ready, threads = threading.Event(), threading.Semaphore(0), []

    def stream(url: str, k: int) -> None:
        body = {"prompt": ids[:-1] + [300 + k], "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", headers=AUTH, json=body, timeout=300) as r:
            lines = r.iter_lines()
            next(lines)
            ready.release()
            for _ in lines:
                if stop.is_set():
                    break  # the connection closes: the replica aborts the request

    for url in urls:
        for k in range(n):
            threads.append(threading.Thread(target=stream, args=(url, len(threads)), daemon=True))
            threads[-1].start()
    for _ in threads:
        assert ready.acquire(timeout=300), "a busy stream never started"
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frames", default="4,8,22", help="frame_blocks to compare, comma-separated")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1300)
    ap.add_argument("--busy", type=int, default=0, help="streams decoding on each replica during each pull")
    args = ap.parse_args()
    frames = [int(f) for f in args.frames.split(",")] * args.repeat
    rows = []
    with replica_server("--kv-memory-gb", "2") as (a, pa), replica_server("--kv-memory-gb", "2") as (b, pb):
        base = httpx.post(a + "/tokenize", json={"prompt": TEXT}, headers=AUTH, timeout=30).json()["tokens"]
        base = base[: args.tokens]
        block_bytes = httpx.get(a + "/v1/kv/spec", headers=AUTH, timeout=30).json()["block_bytes"]
        pids = {"A api": pa.pid, "A engine": engine_pid(pa.pid), "B api": pb.pid, "B engine": engine_pid(pb.pid)}
        for k, fb in enumerate(frames):
            ids = [100 + k] + base  # a prompt B has never seen
            r = httpx.post(a + "/v1/completions", headers=AUTH, timeout=300, json={"prompt": ids, "max_tokens": 1})
            assert r.status_code == 200, r.text
            with decoding([a, b], base, args.busy):
                before = {n: cpu_s(p) for n, p in pids.items()}
                t0 = perf_counter()
                res = httpx.post(b + "/v1/kv/pull", headers=AUTH, timeout=120,
                                 json={"source": a, "token_ids": ids, "frame_blocks": fb}).json()
                wall = perf_counter() - t0
                cpu = {n: cpu_s(p) - before[n] for n, p in pids.items()}
            assert res["complete"], res
            rows.append((fb, res["imported"], wall, cpu, os.getloadavg()[0]))
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    print(f"# KV pull of ~{args.tokens} tokens ({block_bytes} bytes a block), {args.busy} streams decoding on "
          f"each replica; {machine}, "
          f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")
    print("| frame blocks | blocks | wall (s) | MB/s | CPU A api / A engine / B api / B engine (s) | CPU in all (s) "
          "| load |")
    print("|---|---|---|---|---|---|---|")
    for fb, n, wall, cpu, load in rows:
        mb = n * block_bytes / 1e6
        per = " / ".join(f"{v:.2f}" for v in cpu.values())
        print(f"| {fb} | {n} | {wall:.3f} | {mb / wall:.0f} | {per} | {sum(cpu.values()):.2f} | {load:.1f} |")


if __name__ == "__main__":
    main()
