"""Prefill against the machine's int8 peak: the VNNI roofline, the model's matmuls alone, a cold prompt.

    .venv/bin/python bench/prefill.py                       # 256-token prompts, every core
    .venv/bin/python bench/prefill.py --prompt-lens 64 256 1024 --threads 2
    .venv/bin/python bench/prefill.py --activations int16      # main's default only

Four tables, one run:

1. The peak: independent chains of one VNNI instruction on registers, on 1 and on
   `--threads` threads at once (kernels/csrc/vnni_peak.cpp): `vpdpbusd` (int8 x
   int8, 64 multiply-adds an instruction, the machine's int8 peak) and `vpdpwssd`
   (int16 pairs, 32, what the block-quantized GEMM in csrc/include/edgechat/qgemm.h
   is the arithmetic of an int16 activation).
2. Each matmul of the default model alone at M = prompt rows (kernels.qgemm_cpu on
   its packed weights, the engine's threads), every row wide (int16) or narrow
   (int8): ms, G multiply-adds/s and the share of both peaks.
3. A cold prompt's prefill through the engine (the C++ whole step, sampling one
   token; every repetition a new prompt, so nothing is cached), per
   `--activations` (the engine's `prefill_activations`): ms, and the
   matmuls' multiply-adds (LM head for the last row only) over that time against
   the peaks. The rest of the step (attention, norms, RoPE, activation prep) is
   the difference between its time and table 2's sum.
4. The same prefill by phase of the C++ step (Decoder.set_timing): qkv, RoPE and
   KV store, attention, merge, o, gate/up, down, summed over the layers.
5. The step's two attention kernels for one layer of a prompt (kernels.cpu_forward
   `prompt_attention`, one thread, the model's head shape over an fp16 pool): the
   one-token kernel (every row but a prompt's narrow ones) and the blocked one
   (narrow rows; its products on bf16 pairs where the CPU has AVX512_BF16), ms x layers,
   against one core's fp32 FMA rate (16 lanes a cycle at the clock the vpdpbusd peak
   implies: 64 multiply-adds an instruction a cycle; bf16 pairs can reach twice it).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import cpu_forward, qgemm_cpu  # noqa: E402
from kernels.cpu_build import load_cpp  # noqa: E402
from replica.config import EngineConfig  # noqa: E402
from replica.engine.llm_engine import LLMEngine  # noqa: E402
from replica.model.loader import load_checkpoint  # noqa: E402
from replica.model.quant import QLinear  # noqa: E402
from wire import protocol as P  # noqa: E402


def peaks(threads: int, iters: int) -> dict[tuple[str, int], float]:
    """(instruction, threads) -> multiply-adds per second, the best of 5."""
    m = load_cpp("vnni_peak", "vnni_peak.cpp")
    out = {}
    for kind in ("dpbusd", "dpwssd"):
        for t in sorted({1, threads}):
            out[kind, t] = max(m.peak_macs(kind, iters, t) for _ in range(5))
    return out


def best_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def matmuls(engine: LLMEngine) -> dict[str, QLinear]:
    """The distinct packed linears of the model's first layer, by name."""
    out = {}
    for name, mod in engine.runner.model.named_modules():
        if isinstance(mod, QLinear) and mod.packed is not None and ".0." in f".{name}.":
            out[name.rsplit(".", 1)[-1]] = mod
    return out


# Decoder.phase_ms's phases (kernels/csrc/cpu_forward.cpp), in order
PHASES = ("qkv (norm, prep, matmul)", "RoPE, KV store", "attention", "merge", "o", "gate/up, SwiGLU", "down")


def prefill_ms(engine: LLMEngine, plen: int, reps: int, vocab: int, seed: int = 0) -> list[float]:
    """Seconds of each of `reps` cold prompts of plen tokens (and a warm-up one), new prompts for each seed."""
    rng = random.Random(plen * 1_000_003 + seed)
    sp = P.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for i in range(reps + 1):
        ids = [rng.randrange(1000, vocab) for _ in range(plen)]  # a new prompt: nothing in the cache
        assert engine.add(P.Generate(id=f"p{plen}-{i}", prompt_ids=ids, sampling=sp)) is None
        t0 = time.perf_counter()
        while engine.has_work():
            engine.step()
        times.append(time.perf_counter() - t0)
    return times[1:]  # the first warms the step's buffers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[256])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--peak-iters", type=int, default=5_000_000)
    ap.add_argument("--activations", nargs="+", default=["int16", "int8"], choices=["int16", "int8"],
                    help="the engines' prefill_activations, one engine each")
    args = ap.parse_args()
    if not qgemm_cpu.available():
        sys.exit("bench/prefill.py needs the AVX-512 VNNI kernels (kernels.qgemm_cpu.available() is False here)")
    torch.set_num_threads(args.threads)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {args.threads} threads; "
          f"{time.strftime('%Y-%m-%d %H:%M')}; torch {torch.__version__}")

    pk = peaks(args.threads, args.peak_iters)
    print("\n## The peak (multiply-adds on registers)\n")
    print("| instruction | operands | G MAC/s, 1 thread | G MAC/s, all threads |")
    print("|---|---|---:|---:|")
    for kind, what in (("dpbusd", "int8 x int8"), ("dpwssd", "int16 x int16")):
        print(f"| vp{kind} | {what} | {pk[kind, 1] / 1e9:.0f} | {pk[kind, args.threads] / 1e9:.0f} |")
    int8, int16 = pk["dpbusd", args.threads], pk["dpwssd", args.threads]

    ckpt = load_checkpoint("default", dtype=torch.float32)
    engines = {}
    for acts in args.activations:
        cfg = EngineConfig(quantization="gguf", num_blocks=2048, max_num_seqs=16,
                           max_num_batched_tokens=max(4096, max(args.prompt_lens)), cpu_threads=args.threads,
                           prefill_activations=acts)
        engines[acts] = LLMEngine(cfg, ckpt.config, ckpt.weights, tokenizer=ckpt.tokenizer)
    c = ckpt.config
    lins = matmuls(next(iter(engines.values())))
    print(f"\n## The matmuls alone ({c.name}, {cfg.quantization} weights, M = prompt rows)\n")
    print("| prompt rows | activations | matmul | N x K | bits | ms | G MAC/s | of int8 peak | of int16 peak |")
    print("|---:|---|---|---|---:|---:|---:|---:|---:|")
    per_layer_ms = {}
    for plen in args.prompt_lens:
        x = torch.randn(plen, max(m.in_features for m in lins.values()))
        for acts in args.activations:
            narrow = torch.full((plen,), acts == "int8")
            total = 0.0
            for name, m in lins.items():
                xi = x[:, :m.in_features].contiguous()
                ms = best_ms(lambda m=m, xi=xi: qgemm_cpu.qgemm_cpu(xi, m.packed, m.out_features, m.bits, narrow),
                             args.reps)
                rate = plen * m.out_features * m.in_features / ms / 1e6
                total += ms
                print(f"| {plen} | {acts} | {name} | {m.out_features} x {m.in_features} | {m.bits} | {ms:.2f} | "
                      f"{rate:.0f} | {rate * 1e9 / int8:.0%} | {rate * 1e9 / int16:.0%} |")
            per_layer_ms[plen, acts] = total

    macs_token = sum(m.out_features * m.in_features for m in lins.values()) * c.num_layers
    head = c.vocab_size * c.hidden_size
    print(f"\n## A cold prompt's prefill (engine step, {args.threads} threads, best and median of {args.reps})\n")
    print("| prompt tokens | activations | best ms | median ms | ms a token | G MAC/s (matmuls) | of int8 peak | "
          "of int16 peak | matmuls alone x layers, ms |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for plen in args.prompt_lens:
        for acts, engine in engines.items():
            t = prefill_ms(engine, plen, args.reps, c.vocab_size)
            best, med = min(t) * 1e3, statistics.median(t) * 1e3
            rate = (plen * macs_token + head) / best / 1e6
            print(f"| {plen} | {acts} | {best:.1f} | {med:.1f} | {best / plen:.2f} | {rate:.0f} | "
                  f"{rate * 1e9 / int8:.0%} | {rate * 1e9 / int16:.0%} | {per_layer_ms[plen, acts] * c.num_layers:.1f} |",
                  flush=True)

    if not all(hasattr(e.runner.model, "decoder") for e in engines.values()):  # the C++ step: CpuModel
        return
    print(f"\n## Where a cold prompt's prefill goes (the C++ step's phases, summed over the layers, ms a prompt, "
          f"mean of {args.reps})\n")
    print("| prompt tokens | activations | " + " | ".join(PHASES) + " | step, ms |")
    print("|---:|---|" + "---:|" * (len(PHASES) + 1))
    for plen in args.prompt_lens:
        for acts, engine in engines.items():
            decoder = engine.runner.model.decoder
            decoder.set_timing(True)
            t = prefill_ms(engine, plen, args.reps, c.vocab_size, seed=1)  # prompts the first table did not cache
            steps, *ms = decoder.phase_ms()
            decoder.set_timing(False)
            n = len(t) + 1  # prefill_ms runs a warm-up prompt too
            print(f"| {plen} | {acts} | " + " | ".join(f"{x / n:.1f}" for x in ms) + f" | {sum(ms) / n:.1f} "
                  f"(steps a prompt: {steps / n:g}) |", flush=True)

    fma = pk["dpbusd", 1] / 64 * 16  # fp32 multiply-adds a second on one core
    print("\n## The prefill attention kernels (one thread, one layer's prompt rows x layers, fp16 pool, "
          f"best of {args.reps})\n")
    bf16 = cpu_forward.block_bf16()  # its products on bf16 pairs: two multiply-adds a lane an instruction
    print("| prompt tokens | one-token kernel, ms | blocked kernel" + (" (bf16 products)" if bf16 else "") +
          ", ms | multiply-adds (scores, values) | blocked: of one core's fp32 FMA rate" +
          (" (bf16 pairs reach 200 %)" if bf16 else "") + " |")
    print("|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for plen in args.prompt_lens:
        page = 16
        blocks = -(-plen // page)
        k = torch.randn(blocks, page, c.num_kv_heads, c.head_dim, generator=g).half()
        v = torch.randn(blocks, page, c.num_kv_heads, c.head_dim, generator=g).half()
        table = torch.randperm(blocks, generator=g).int()
        q = torch.randn(plen, c.num_heads, c.head_dim, generator=g)
        ms = {b: best_ms(lambda b=b: cpu_forward.prompt_attention(q, k, v, table, 1, b), args.reps) * c.num_layers
              for b in (False, True)}
        macs = 2 * plen * (plen + 1) / 2 * c.num_heads * c.head_dim * c.num_layers
        print(f"| {plen} | {ms[False]:.1f} | {ms[True]:.1f} | {macs / 1e9:.2f} G | "
              f"{macs / (ms[True] / 1e3) / fma:.0%} |", flush=True)


if __name__ == "__main__":
    main()
