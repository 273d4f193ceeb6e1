"""Prefill/decode disaggregation against colocated serving, on real replicas, in one run.

    flock /tmp/edgechat-bench.lock .venv/bin/python bench/disagg.py
    .venv/bin/python bench/disagg.py --sizes 256 1024 --requests 3

Two default-model replicas, P (`--role prefill`) and D (`--role decode`), one engine thread each
(as regions/launch splits this machine's cores), and two proxies: one over P and D (disaggregated:
edge_proxy.disagg prefills each cold prompt on P, D pulls its full blocks and streams) and one
over D alone (colocated: D computes the prompt itself). For each prompt size, `--requests`
distinct prompts (seeded random token ids, each under its own cache salt: cold everywhere), each
sent to both proxies in turn (the order alternating), greedy, streamed over the OpenAI API:
  * TTFT as the client sees it, request to first streamed token: median and p90 per mode;
  * the texts of the two modes equal, token for token;
  * the KV bytes D took from its cache (its prefix hits x bytes per token, from /v1/kv/spec), per
    request and per token: what the pull moved.
Then the hand-off's two phases apart, for one more prompt per size, called directly: P's
/v1/prefill (its own time) and D's /v1/kv/pull from P (bytes and time).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from time import perf_counter

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge_proxy.disagg import usable_blocks  # noqa: E402
from tests.edge_proxy.live import proxy  # noqa: E402
from tests.replica.server import AUTH, replica_server, scrape  # noqa: E402

MAX_TOKENS = 8
VOCAB = (1000, 40000)  # ordinary tokens of the default model's vocabulary


def prompt(size: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(*VOCAB) for _ in range(size)]


def stream(url: str, ids: list[int], salt: str) -> tuple[float, str, int]:
    """(TTFT s, text, cached prompt tokens) of one streamed greedy completion through a proxy."""
    body = {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True, "cache_salt": salt,
            "stream_options": {"include_usage": True}}
    t0, ttft, text, cached = perf_counter(), None, "", -1
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            for ch in ev.get("choices", []):
                if ch.get("text") and ttft is None:
                    ttft = perf_counter() - t0
                text += ch.get("text", "")
            if ev.get("usage"):
                cached = ev["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert ttft is not None, "no token streamed"
    return ttft, text, cached


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    return out.stdout.strip() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096], help="prompt tokens")
    ap.add_argument("--requests", type=int, default=5, help="prompts per size (each through both proxies)")
    ap.add_argument("--cpu-threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="per replica")
    args = ap.parse_args()
    load0 = os.getloadavg()
    rargs = ("--kv-memory-gb", "0.5", "--cpu-threads", str(args.cpu_threads))
    with contextlib.ExitStack() as es:
        p_url, _ = es.enter_context(replica_server("--replica-id", "P", "--role", "prefill", *rargs))
        d_url, _ = es.enter_context(replica_server("--replica-id", "D", "--role", "decode", *rargs))
        both, _ = es.enter_context(proxy([p_url, d_url], "--allow-anonymous", "--region", "bench"))
        alone, _ = es.enter_context(proxy([d_url], "--allow-anonymous", "--region", "bench"))
        urls = {"disaggregated": f"http://127.0.0.1:{both}", "colocated": f"http://127.0.0.1:{alone}"}
        deadline = perf_counter() + 60
        while httpx.get(urls["disaggregated"] + "/healthz", timeout=5).json()["prefill_ready"] < 1:
            assert perf_counter() < deadline, "the disaggregating proxy never had P ready"
            time.sleep(0.1)
        spec = httpx.get(d_url + "/v1/kv/spec", headers=AUTH, timeout=10).json()
        per_token = spec["block_bytes"] / spec["block_size"]
        for ids in (prompt(64, 0),):  # warm both paths once (first-request costs), not counted
            for mode, url in urls.items():
                stream(url, ids, f"warm-{mode}")
        rows, phases = [], []
        for size in args.sizes:
            ttft = {m: [] for m in urls}
            exact, moved = 0, []
            for i in range(args.requests):
                ids = prompt(size, size * 1000 + i)
                order = list(urls) if i % 2 == 0 else list(urls)[::-1]
                texts = {}
                for mode in order:
                    hits0 = scrape(d_url)["edgechat_replica_prefix_hit_tokens_total"]
                    t, texts[mode], cached = stream(urls[mode], ids, f"{mode}-{size}-{i}")
                    hits = scrape(d_url)["edgechat_replica_prefix_hit_tokens_total"] - hits0
                    ttft[mode].append(t)
                    if mode == "disaggregated":
                        moved.append(hits * per_token)
                        assert cached == hits, (cached, hits)
                    else:
                        assert cached == 0, cached
                exact += texts["colocated"] == texts["disaggregated"]
            rows.append((size, ttft, exact, moved))
            ids = prompt(size, size * 1000 + 999)  # the phases, one prompt called directly
            usable = usable_blocks(size, spec["block_size"]) * spec["block_size"]  # what the proxy has D pull
            salt = f"phase-{size}"
            t0 = perf_counter()
            pre = httpx.post(p_url + "/v1/prefill", json={"token_ids": ids, "cache_salt": salt}, headers=AUTH,
                             timeout=300).json()
            t1 = perf_counter()
            pull = httpx.post(d_url + "/v1/kv/pull", headers=AUTH, timeout=300,
                              json={"source": p_url, "token_ids": ids[:usable], "cache_salt": salt}).json()
            t2 = perf_counter()
            phases.append((size, pre["ms"], (t1 - t0) * 1e3, (t2 - t1) * 1e3, pull["imported"] * spec["block_bytes"]))
    load1 = os.getloadavg()

    print(f"# bench/disagg.py, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit()}, "
          f"{platform.node()} ({os.cpu_count()} CPUs, {platform.processor() or platform.machine()}), "
          f"{args.cpu_threads} engine thread(s) per replica, load average {load0[0]:.1f} -> {load1[0]:.1f}")
    print(f"# KV {spec['dtype']}, {spec['num_layers']} layers x {spec['num_kv_heads']} KV heads x {spec['head_dim']}: "
          f"{per_token:,.0f} bytes a token; {args.requests} prompts a size, {MAX_TOKENS} tokens each, greedy\n")
    print("| prompt tokens | colocated TTFT median / p90 (ms) | disaggregated TTFT median / p90 (ms) | added (median) "
          "| KV moved a request | exact |")
    print("|---:|---:|---:|---:|---:|---:|")
    for size, ttft, exact, moved in rows:
        c, d = ttft["colocated"], ttft["disaggregated"]
        print(f"| {size:,} | {statistics.median(c) * 1e3:,.0f} / {pct(c, 0.9) * 1e3:,.0f} "
              f"| {statistics.median(d) * 1e3:,.0f} / {pct(d, 0.9) * 1e3:,.0f} "
              f"| {(statistics.median(d) - statistics.median(c)) * 1e3:+,.0f} "
              f"| {statistics.median(moved) / 1e6:,.2f} MB | {exact}/{len(c)} |")
    print("\n| prompt tokens | P's prefill (its own ms) | prefill call (ms) | D's pull (ms) | pulled | pull rate |")
    print("|---:|---:|---:|---:|---:|---:|")
    for size, own, call, pull_ms, nbytes in phases:
        print(f"| {size:,} | {own:,.0f} | {call:,.0f} | {pull_ms:,.0f} | {nbytes / 1e6:,.2f} MB "
              f"| {nbytes / 1e6 / (pull_ms / 1e3):,.0f} MB/s |")


if __name__ == "__main__":
    main()
