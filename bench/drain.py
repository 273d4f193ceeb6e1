"""Drain with hand-off against drain by exact resume, on real replicas, in one run.

    .venv/bin/python bench/drain.py                     # 8 conversations of ~1,500 tokens, SIGTERM at 10 deltas
    .venv/bin/python bench/drain.py --streams 4 --prompt-tokens 600

Two default-model replicas behind one proxy (tests/edge_proxy/drain_stack.py), `--streams`
conversations of about `--prompt-tokens` tokens each, greedy. Each variant first runs them
undisturbed (the texts to compare with; each prompt's blocks then live on the replica that ran
it), then again, and sends SIGTERM to replica A's API process once every stream has `--at`
deltas. A drains (replica.api.drain); the proxy moves A's streams to B:
  * handoff: B pulls each stream's KV from A, the stream resumes on B with its full blocks cached
    (edge_proxy.handoff);
  * nohot:   the hand-off without A's hot chains (the proxy's --handoff-hot-blocks 0);
  * resume:  the same drain with A's KV exports cut by a relay (drain_stack.ExportCutter): every
    pull fails, B recomputes each moved stream (exact resume, the fallback).
Between the undisturbed run and the drained one, `--idle` other conversations of `--idle-tokens`
run to their end (each then cached where it ran, no stream holding it: A's are its hot chains);
after A's exit each of A's gets its next turn, now on B.
Per variant: streams moved, texts equal to the undisturbed run's, the longest gap a moved stream's
client saw from the signal on, the undisturbed run's median inter-token gap, the tokens B's cache
served each moved stream (usage.cached_tokens), A's time from the signal to its exit, and for A's
idle conversations the next turn's cached tokens and time to first token on B.
`--burn N` runs N CPU-bound processes beside each variant (a busy machine: another tenant's work on
the same cores), from once the replicas are up to the variant's end.
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
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path
from time import perf_counter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge_proxy.client import EdgeClient  # noqa: E402
from tests.edge_proxy.drain_stack import stack  # noqa: E402

FILLER = ("The archive of the harbour town keeps the logbooks of every boat, the weather of every morning, "
          "the names of the children born in each street and the prices of fish at the market. ")


def conversation(k: int, prompt_tokens: int) -> list[dict]:
    """A distinct ~prompt_tokens-token conversation (no two share a first block)."""
    words = max(1, prompt_tokens * 10 // 13 // len(FILLER.split()))
    return [{"role": "user", "content": f"Conversation {k}: a question about record {k * 7919}. "
             + FILLER * words + f"Now tell a long story about record {k * 7919} and the people in it."}]


def exit_time(proc) -> tuple[int, float]:
    """Wait for `proc` to exit: its exit code and the moment it was seen."""
    code = proc.wait(60)
    return code, perf_counter()


async def run(url: str, convs, max_tokens: int, sigterm=None, at: int = 0):
    """Stream every conversation at once; `sigterm()` once each has `at` deltas. Per stream: its
    text, its Done and its delta arrival times; and the signal's time."""
    async with await EdgeClient.connect(url) as c:
        reqs = [await c.generate(messages=m, max_tokens=max_tokens, temperature=0) for m in convs]
        times = [[] for _ in reqs]
        fired = asyncio.Event()
        t_sig = [0.0]

        async def follow(i, req):
            async for _ in req:
                times[i].append(perf_counter())
                if sigterm is not None and not fired.is_set() and all(len(t) >= at for t in times):
                    fired.set()
                    t_sig[0] = perf_counter()
                    sigterm()

        await asyncio.gather(*(follow(i, r) for i, r in enumerate(reqs)))
        return [(r.text, r.done, t) for r, t in zip(reqs, times)], t_sig[0]


async def next_turns(url: str, convs) -> list:
    """Each conversation's next turn (its reply so far and a question), one after another: their Dones."""
    out = []
    async with await EdgeClient.connect(url) as c:
        for messages, text in convs:
            turn = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": "Go on."}]
            out.append((await c.complete(messages=turn, max_tokens=8, temperature=0))[1])
    return out


def burners(n: int, es: ExitStack) -> None:
    """N busy loops on the machine's cores until `es` closes."""
    for _ in range(n):
        p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        es.callback(p.wait)
        es.callback(p.kill)


async def variant(name: str, args) -> list:
    hot = ("--handoff-hot-blocks", "0" if name == "nohot" else str(args.hot_blocks))
    with ExitStack() as es, stack(cut_exports=name == "resume", replica_args=("--kv-memory-gb", str(args.kv_memory_gb)),
               handoff_budget=args.handoff_budget, proxy_args=hot) as (url, reps, _):
        burners(args.burn, es)
        convs = [conversation(k, args.prompt_tokens) for k in range(args.streams)]
        base, _ = await run(url, convs, args.max_tokens)
        gaps = [b - a for _, _, t in base for a, b in zip(t, t[1:])]
        idle = [conversation(1000 + k, args.idle_tokens) for k in range(args.idle)]
        idle_done, _ = await run(url, idle, 32)
        on_a = [(m, text) for m, (text, d, _) in zip(idle, idle_done) if d.replica == "A"]
        proc = reps["A"][1]
        exited = []

        def sigterm() -> None:
            os.kill(proc.pid, signal.SIGTERM)
            exited.append(asyncio.ensure_future(asyncio.to_thread(exit_time, proc)))

        out, t_sig = await run(url, convs, args.max_tokens, sigterm, args.at)
        code, t_exit = await exited[0]
        exit_s = t_exit - t_sig
        later = await next_turns(url, on_a)
        moved = [(o, b) for o, b in zip(out, base) if o[1].failovers]
        longest = max((max(b - a for a, b in zip(t, t[1:]) if b > t_sig) for (_, _, t), _ in moved), default=0.0)
        cached = [o[1].usage.cached_tokens for o, _ in moved]
        for (_, d, t), _ in moved:  # where each moved stream's longest gaps lie (monotonic, as the proxy logs)
            top = sorted((k for k in range(1, len(t)) if t[k] > t_sig), key=lambda k: t[k - 1] - t[k])[:3]
            print(f"trace {name}: signal t={t_sig:.3f}; cached {d.usage.cached_tokens}; longest gaps: " + ", ".join(
                f"{1e3 * (t[i] - t[i - 1]):.0f} ms from t={t[i - 1]:.3f} (delta {i - 1})" for i in top), file=sys.stderr)
        return [name, len(moved), f"{sum(o[0] == b[0] for o, b in zip(out, base))}/{len(out)}",
                f"{longest * 1e3:.0f}", f"{statistics.median(gaps) * 1e3:.0f}",
                f"{min(cached, default=0)}..{max(cached, default=0)}",
                f"{statistics.mean(d.usage.prompt_tokens for _, d, _ in base):.0f}",
                f"{exit_s:.2f} (code {code})",
                f"{len(later)}: " + (f"{statistics.mean(d.usage.cached_tokens for d in later):.0f} of "
                                     f"{statistics.mean(d.usage.prompt_tokens for d in later):.0f}, "
                                     f"{statistics.median(d.timing.ttft_ms for d in later):.0f} ms" if later else "-")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=160)  # the issue's
    ap.add_argument("--at", type=int, default=10, help="deltas every stream has when A gets SIGTERM")
    ap.add_argument("--kv-memory-gb", type=float, default=2.0)
    ap.add_argument("--only", choices=["handoff", "nohot", "resume"])
    ap.add_argument("--idle", type=int, default=6, help="conversations finished before the drain (A's: hot chains)")
    ap.add_argument("--idle-tokens", type=int, default=600)
    ap.add_argument("--hot-blocks", type=int, default=128, help="the proxy's --handoff-hot-blocks (nohot: 0)")
    ap.add_argument("--handoff-budget", type=float, help="the proxy's --handoff-budget (its default: 4 s)")
    ap.add_argument("--burn", type=int, default=0, help="CPU-bound processes beside the replicas (a busy machine)")
    args = ap.parse_args()
    rows = [asyncio.run(variant(v, args)) for v in ("handoff", "nohot", "resume") if args.only in (None, v)]
    print(f"# drain: {args.streams} streams of ~{args.prompt_tokens} prompt tokens, greedy, max_tokens "
          f"{args.max_tokens}, SIGTERM to replica A at {args.at} deltas; {args.idle} idle conversations of "
          f"~{args.idle_tokens} tokens, hot blocks {args.hot_blocks}, {args.burn} CPU burners beside; "
          f"{platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")
    print("| variant | moved | exact | longest gap of a moved stream (ms) | undisturbed gap p50 (ms) "
          "| successor's cached tokens per moved stream | prompt tokens (mean) | A: signal -> exit (s) "
          "| A's idle conversations: next turn on B, cached of prompt tokens (mean), TTFT p50 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")


if __name__ == "__main__":
    main()
