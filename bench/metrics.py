"""What the proxy's metrics cost on its per-token path, and why it has a hot store.

    .venv/bin/python bench/metrics.py                    # both tables
    .venv/bin/python bench/metrics.py --tokens 200000 --rounds 9

Per token the proxy (core.Proxy.on_tokens) observes the inter-token latency and counts
the generated tokens: one histogram observation and one counter increment. Table 1 times
exactly that, in ns a token (best and median of interleaved rounds), for:

  hand-written          wire/metrics.py before prometheus_client (a bisect and plain increments)
  prometheus_client     Histogram.observe + Counter.inc, one process (a lock per value)
  prometheus_client mp  the same in multiprocess mode (PROMETHEUS_MULTIPROC_DIR: every
                        increment also written into the process's mmap'd file)
  hot store             wire.metrics HotHistogram + HotCounter (additions into a memoryview
                        of doubles), one process, and over its mmap'd file in multiprocess mode

The budget is 1 µs a token (issue 24): prometheus_client's calls go over it, so the per-token
metrics use the hot store and everything else prometheus_client. Table 2: what the per-request
metrics cost (prometheus_client, the calls `core.Proxy` makes for one request) and what a
scrape costs with the files of two workers. Each mode runs in a child process of its own (the
multiprocess mode is chosen when prometheus_client is imported).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class OldHistogram:
    """wire/metrics.py's Histogram before this change: one bisect and three increments."""

    def __init__(self, buckets):
        self.buckets, self.counts, self.sum, self.count = tuple(buckets), [0] * (len(buckets) + 1), 0.0, 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1


class OldCounter:
    def __init__(self):
        self.values = {(): 0.0}

    def inc(self, *labels, by: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + by


def per_token_variants(multi: bool) -> dict:
    """name -> a function observing one token (ITL + generated tokens), as on_tokens does."""
    import prometheus_client as pc

    from wire.metrics import HotCounter, HotHistogram, HotStore, multiprocess_dir

    reg = pc.CollectorRegistry()
    ph, pcnt = pc.Histogram("b_itl_seconds", "h", buckets=BUCKETS, registry=reg), pc.Counter("b_tokens", "h",
                                                                                              registry=reg)
    store = HotStore(directory=multiprocess_dir())
    hh, hc = HotHistogram(store, "b_hot_itl_seconds", "h", BUCKETS), HotCounter(store, "b_hot_tokens", "h")
    variants = {}
    if not multi:
        oh, oc = OldHistogram(BUCKETS), OldCounter()

        def old(v):
            oh.observe(v)
            oc.inc(by=1)
        variants["hand-written (before)"] = old

    def prom(v):
        ph.observe(v)
        pcnt.inc(1)

    def hot(v):
        hh.observe(v)
        hc.inc(1)

    variants["prometheus_client" + (" mp" if multi else "")] = prom
    variants["hot store" + (" mp (mmap file)" if multi else "")] = hot
    return variants


def time_per_token(variants: dict, n: int, rounds: int) -> dict:
    gaps = [0.004 + (i % 97) * 0.0003 for i in range(n)]  # 4-33 ms: where inter-token latencies fall
    out = {name: [] for name in variants}

    def empty(v):
        pass
    base = []
    for _ in range(rounds):  # interleaved: a busy moment costs every variant alike
        for name, fn in [*variants.items(), ("(loop)", empty)]:
            t = time.perf_counter_ns()
            for v in gaps:
                fn(v)
            ns = (time.perf_counter_ns() - t) / n
            (base if name == "(loop)" else out[name]).append(ns)
    loop = min(base)
    return {name: (min(ts) - loop, statistics.median(ts) - loop) for name, ts in out.items()}


def per_request_ns(n: int) -> float:
    """The prometheus_client calls core.Proxy makes for one request (inflight twice, prompt tokens,
    TTFT, finish reason, e2e, cached tokens, a routing decision and its blocks)."""
    from edge_proxy.metrics import ProxyMetrics

    m = ProxyMetrics()
    t = time.perf_counter_ns()
    for i in range(n):
        m.inflight.set(1)
        m.prompt_tokens.inc(by=100)
        m.routing.inc("prefix")
        m.prefix_blocks.inc(by=6)
        m.prefix_blocks_hit.inc(by=4)
        m.ttft.observe(0.05)
        m.requests.inc("stop")
        m.e2e.observe(1.5)
        m.cached_tokens.inc(by=64)
        m.inflight.set(0)
    return (time.perf_counter_ns() - t) / n


def scrape_ms(n: int) -> float:
    from edge_proxy.metrics import ProxyMetrics

    m = ProxyMetrics()
    m.requests.inc("stop")
    t = time.perf_counter_ns()
    for _ in range(n):
        m.render()
    return (time.perf_counter_ns() - t) / n / 1e6


def child(mode: str, n: int, rounds: int) -> None:
    multi = mode == "multi"
    out = {"per_token": time_per_token(per_token_variants(multi), n, rounds),
           "per_request_ns": per_request_ns(max(n // 20, 1000)), "scrape_ms": scrape_ms(200)}
    print(json.dumps(out))


def run_child(mode: str, a, env: dict) -> dict:
    r = subprocess.run([sys.executable, __file__, "--child", mode, "--tokens", str(a.tokens), "--rounds",
                        str(a.rounds)], env=env, capture_output=True, text=True, check=True)
    return json.loads(r.stdout)


def machine() -> str:
    cpu = platform.processor() or "?"
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; Python {platform.python_version()}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=100_000, help="observations per round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--child", choices=["single", "multi"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.child, a.tokens, a.rounds)
        return
    from importlib.metadata import version

    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    single = run_child("single", a, env)
    with tempfile.TemporaryDirectory(prefix="bench-metrics-") as d:
        multi_env = {**env, "PROMETHEUS_MULTIPROC_DIR": d}
        run_child("multi", a, multi_env)  # a second worker's files, so the next one's scrape sums two
        multi = run_child("multi", a, multi_env)
    print(f"# proxy metrics on the per-token path ({machine()}; prometheus_client {version('prometheus_client')})")
    print(f"# {a.tokens} tokens x {a.rounds} interleaved rounds; ns a token = one ITL observation + one "
          "token count, the empty loop's time taken off\n")
    print(f"| {'path':<34} | {'best ns/token':>13} | {'median ns/token':>15} |")
    print(f"|{'-' * 36}|{'-' * 15}|{'-' * 17}|")
    for name, (best, med) in [*single["per_token"].items(), *multi["per_token"].items()]:
        print(f"| {name:<34} | {best:>13.0f} | {med:>15.0f} |")
    print("\n| per request (prometheus_client), scrape | one process | multiprocess (2 workers' files) |")
    print("|---|---|---|")
    one, many = single["per_request_ns"] / 1e3, multi["per_request_ns"] / 1e3
    print(f"| the calls of one request | {one:.1f} µs | {many:.1f} µs |")
    print(f"| one scrape (render) | {single['scrape_ms']:.2f} ms | {multi['scrape_ms']:.2f} ms |")


if __name__ == "__main__":
    main()
