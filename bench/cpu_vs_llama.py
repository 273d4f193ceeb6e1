"""edgechat's engine beside llama.cpp's llama-bench on this CPU: same GGUF, threads and context.

    .venv/bin/python bench/cpu_vs_llama.py                       # 2 threads, depth 128, prompt 200, 5 rounds
    .venv/bin/python bench/cpu_vs_llama.py --threads 1 2 --rounds 3

Decode: ms per token at batch 1 after a `--depth`-token context (llama-bench
`-d DEPTH -n 64 -p 0`; the engine: a DEPTH-token prompt prefilled, then 64 greedy
`engine.step()`s, the median step, scheduler and sampler included). Prefill: ms
for a `--prompt`-token prompt (llama-bench `-p PROMPT -n 0`; the engine: one
request's prefill steps under its default token budget). The two run in
alternating rounds so a busy machine slows both alike; the table gives the best
and the median round of each and the ratio of the bests (the goal: engine decode
<= 0.9 x llama.cpp's). llama.cpp is built once by bench/peers.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from peers import gguf_path, llama_bins  # noqa: E402
from replica.config import EngineConfig  # noqa: E402
from replica.engine.llm_engine import LLMEngine  # noqa: E402
from replica.model.loader import load_checkpoint  # noqa: E402
from wire import protocol as P  # noqa: E402

GEN = 64


def llama(threads: int, depth: int, prompt: int) -> tuple[float, float]:
    """(decode ms/token at depth, prefill ms for `prompt` tokens) from one llama-bench run."""
    out = subprocess.run([str(llama_bins() / "llama-bench"), "-m", gguf_path(), "-t", str(threads), "-r", "1",
                          "-o", "json", "-p", f"0,{prompt}", "-n", f"{GEN},0", "-d", str(depth)],
                         capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    tg = next(r for r in rows if r["n_gen"] == GEN and r["n_prompt"] == 0)
    pp = next(r for r in rows if r["n_prompt"] == prompt and r["n_gen"] == 0)
    return 1e3 / tg["avg_ts"], prompt * 1e3 / pp["avg_ts"]


def engine_round(engine: LLMEngine, depth: int, prompt: int, rnd: int) -> tuple[float, float]:
    """(median decode step ms at batch 1 after `depth` tokens, prefill ms of a `prompt`-token prompt)."""
    sp = P.SamplingParams(max_tokens=GEN + 1, temperature=0.0, ignore_eos=True)
    ids = [(7 * rnd + 13 * j) % 30000 + 100 for j in range(prompt)]  # a fresh prompt: nothing cached
    t0 = time.perf_counter()
    engine.add(P.Generate(id=f"p{rnd}", prompt_ids=ids, sampling=sp))
    while not any(s.num_computed >= len(ids) for s in engine.seqs.values()):
        engine.step()
    prefill = (time.perf_counter() - t0) * 1e3
    engine.abort(f"p{rnd}")
    ids = [(11 * rnd + 17 * j) % 30000 + 100 for j in range(depth)]
    engine.add(P.Generate(id=f"d{rnd}", prompt_ids=ids, sampling=sp))
    while any(s.num_computed < len(s) - 1 for s in engine.seqs.values()):
        engine.step()
    steps = []
    for _ in range(GEN):
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    engine.abort(f"d{rnd}")
    return statistics.median(steps) * 1e3, prefill


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[os.cpu_count() or 1])
    ap.add_argument("--depth", type=int, default=128, help="context tokens before the timed decode")
    ap.add_argument("--prompt", type=int, default=200, help="prompt tokens of the timed prefill")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quantization", default="gguf")
    args = ap.parse_args()
    ckpt = load_checkpoint("default", dtype=torch.float32)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, load average {os.getloadavg()[0]:.1f} at start")
    print(f"\n| threads | server | decode ms/token at depth {args.depth}: best / median | "
          f"prefill {args.prompt} tokens ms: best / median |")
    print("|---:|---|---:|---:|")
    for threads in args.threads:
        torch.set_num_threads(max(1, threads - 1))  # as the engine process: torch's own pool leaves a core
        engine = LLMEngine(EngineConfig(quantization=args.quantization, cpu_threads=threads, num_blocks=256),
                           ckpt.config, ckpt.weights, tokenizer=ckpt.tokenizer)  # as served: int8 prefill rows
        engine_round(engine, 16, 16, -1)  # warm-up
        ours, theirs = [], []
        for r in range(args.rounds):
            theirs.append(llama(threads, args.depth, args.prompt))
            ours.append(engine_round(engine, args.depth, args.prompt, r))
            print(f"  round {r}: llama.cpp {theirs[-1][0]:.2f} / {theirs[-1][1]:.0f}, edgechat {ours[-1][0]:.2f} / "
                  f"{ours[-1][1]:.0f} ms (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
        for name, rows in ((f"edgechat ({args.quantization})", ours), ("llama.cpp llama-bench", theirs)):
            dec, pre = [r[0] for r in rows], [r[1] for r in rows]
            print(f"| {threads} | {name} | {min(dec):.2f} / {statistics.median(dec):.2f} | "
                  f"{min(pre):.0f} / {statistics.median(pre):.0f} |")
        print(f"| {threads} | ratio of bests, edgechat / llama.cpp | {min(r[0] for r in ours) / min(r[0] for r in theirs):.2f}"
              f" | {min(r[1] for r in ours) / min(r[1] for r in theirs):.2f} |", flush=True)
        del engine
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
