"""Engine benchmark: host overhead per decode step, and the default model's speed.

    .venv/bin/python bench/engine.py            # both tables
    .venv/bin/python bench/engine.py --host     # host overhead only (seconds)
    .venv/bin/python bench/engine.py --graph-prepare   # a 64-row graph step's preparation only

Table 1 runs the real scheduler, block manager, runner metadata and sampler with
a model whose forward costs nothing (zero hidden states, zero logits over the
real vocabulary), so the time per step is the engine's own host work.
Table 2 runs the default model (SmolLM2-135M-Instruct) on this machine's device:
decode ms per step and tokens/s at batch 1 and 16 after the prompts are prefilled,
the KV pool sized to hold every row's whole context. Where a variant runs as the C++
CPU step its KV pool is fp16 (the served default) unless `--cpu-kv` asks for fp32 or
int8 (`--cpu-kv float16 int8` times both, side by side; with `--rounds N` every row
N times, the dtypes alternated, so a busy machine's load falls on each alike; with
`--threads 1 --clock cpu` a step's CPU time, which a busy machine disturbs far less):

    .venv/bin/python bench/engine.py --model-only --variants float32/gguf --batches 1 16 \
        --prompt-lens 16 2000 --cpu-kv float16 int8 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels  # noqa: E402
from kernels.cpu_build import builds, load_cpp  # noqa: E402
from wire import protocol as P  # noqa: E402
from replica.config import EngineConfig  # noqa: E402
from replica.engine.llm_engine import LLMEngine  # noqa: E402
from replica.model.loader import PRESETS, load_checkpoint  # noqa: E402


class ZeroCostModel(torch.nn.Module):
    """Same interface as LlamaModel; forward and logits are views of preallocated
    buffers, so a step's time is the engine's own work plus the sampler. The logits
    are fixed random values (peaked like a real model's, so top-p keeps a realistic
    handful of tokens rather than a flat vocabulary)."""

    def __init__(self, hidden: int, vocab: int, max_tokens: int = 4096):
        super().__init__()
        self.hidden_buf = torch.zeros(max_tokens, hidden)
        self.logits_buf = torch.randn(256, vocab, generator=torch.Generator().manual_seed(0)) * 4

    def forward(self, input_ids, positions, ctx, kv_cache, aux_layers=()):
        return self.hidden_buf[: input_ids.shape[0]]

    def compute_logits(self, hidden):
        return self.logits_buf[: hidden.shape[0]]


def decode_steps(engine: LLMEngine, batch: int, prompt_len: int, steps: int, temperature: float,
                 clock=time.perf_counter, **params) -> list[float]:
    """Prefill `batch` requests, then time `steps` decode steps (seconds each, by `clock`); `params`:
    more SamplingParams fields (bench/sampling.py)."""
    sp = P.SamplingParams(max_tokens=steps + 4, temperature=temperature, top_p=0.9 if temperature else 1.0,
                          ignore_eos=True, seed=1, **params)
    for i in range(batch):
        ids = [(7 * i + j) % 1000 + 10 for j in range(prompt_len)]
        assert engine.add(P.Generate(id=f"b{batch}-{i}", prompt_ids=ids, sampling=sp)) is None
    while any(s.num_computed < len(s) - 1 for s in engine.seqs.values()):
        engine.step()  # prefill
    times = []
    for _ in range(steps):
        t0 = clock()
        engine.step()
        times.append(clock() - t0)
    for rid in list(engine.seqs):
        engine.abort(rid)
    return times


def host_overhead(device: str) -> None:
    cfg = PRESETS["smollm2-135m"]
    model = ZeroCostModel(cfg.hidden_size, cfg.vocab_size)
    print(f"\n## Engine host time per decode step (zero-cost model, vocab {cfg.vocab_size}, {device})\n")
    print("| batch | greedy ms/step | sampled (T=0.8, top-p 0.9) ms/step |")
    print("|---:|---:|---:|")
    for batch in (1, 8, 64):
        row = []
        for temp in (0.0, 0.8):
            ecfg = EngineConfig(device=device, num_blocks=2048, max_num_seqs=64, max_num_batched_tokens=4096)
            engine = LLMEngine(ecfg, cfg, model=model)
            t = decode_steps(engine, batch, prompt_len=100, steps=200, temperature=temp)
            row.append(statistics.median(t) * 1e3)
        print(f"| {batch} | {row[0]:.3f} | {row[1]:.3f} |")
    graph_prepare(device)


def graph_prepare(device: str, rows: int = 64, max_model_len: int = 131072, reps: int = 200) -> None:
    """Host time to prepare one replayed decode step (replica.model.graphs.DecodeGraphs.prepare:
    metadata into pinned buffers, copies queued) for `rows` sequences, with a model
    context of max_model_len (Llama-3.1-8B's: 8,192 blocks of 16 a row). DESIGN.md's
    budget: 0.2 ms at 64 rows."""
    from replica.model.graphs import DecodeGraphs
    from replica.model.plan import StepPlan

    bs = 16
    kv = torch.zeros(1, device=device)
    graphs = DecodeGraphs(None, kv, bs, (), rows, max_model_len, capture=False)
    print(f"\n## Graph step preparation ({rows} rows, {graphs.max_blocks} blocks a row at most, {device})\n")
    print("| context tokens a row | blocks a row | host us/step (median) |")
    print("|---:|---:|---:|")
    for context in (512, 2048, 8192, max_model_len // 2):
        nb = -(-context // bs)
        tables = [list(range(i * nb, (i + 1) * nb)) for i in range(rows)]
        plan = StepPlan(input_ids=list(range(rows)), starts=[context - 1] * rows, num_tokens=[1] * rows,
                        block_tables=tables, sample_rows=list(range(rows)), num_decodes=rows)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            graphs.prepare(plan)
            times.append(time.perf_counter() - t0)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        print(f"| {context} | {nb} | {statistics.median(times) * 1e6:.0f} |", flush=True)


DECODE_STEPS = 48


def model_speed(device: str, variants: list[str], batches: tuple[int, ...] = (1, 16), threads: int = 1,
                prompt_lens: tuple[int, ...] = (128,), cpu_kv: tuple[str, ...] = ("float16",),
                rounds: int = 1, clock=time.perf_counter, decode_acts: tuple[str, ...] = ("int16",)) -> None:
    """One row per (round, variant, prompt length, batch, KV dtype, decode activations); a
    variant is "dtype/quantization", e.g. bfloat16/gguf; the KV dtype applies where the variant
    runs as the C++ CPU step (else the pool is in the variant's dtype: the last column says
    which), and so do int8 decode activations (EngineConfig.decode_activations; the engine
    calibrates on the tokenizer's text as a replica does). A variant's engines (one per KV dtype
    and activations) are built once and timed in turn. 48 decode steps
    after the prompt: the context grows by 48 while timed. The pool holds every row's whole
    context (no row waits for blocks, none is preempted)."""
    ckpt = load_checkpoint("default", dtype=torch.float32)
    blocks = max(batches) * -(-(max(prompt_lens) + DECODE_STEPS + 8) // 16) + 64
    print(f"\n## Default model decode ({ckpt.config.name}, {device}, {threads} threads)\n")
    bandwidth = 0.0
    probe = lambda: load_cpp("vnni_peak", "vnni_peak.cpp")  # noqa: E731
    if device == "cpu" and builds(probe, "the read-bandwidth probe", "no KV floor column"):
        bandwidth = probe().read_bandwidth(512 << 20, threads, 3)
        print(f"{threads} threads stream {bandwidth / 1e9:.1f} GB/s from memory (kernels/csrc/vnni_peak.cpp "
              "read_bandwidth); KV floor: the ms a step needs to read its rows' KV once at that rate\n")
    print("| dtype / quantization | prompt tokens | batch | ms/step | ms/token | tokens/s | KV | KV floor ms |")
    print("|---|---:|---:|---:|---:|---:|---|---:|")  # bench/peers.py reads the first six columns
    for variant in variants:
        dtype, _, quant = variant.partition("/")
        cfg = EngineConfig(device=device, dtype=dtype, quantization=quant or "none", num_blocks=blocks,
                           max_num_seqs=64, max_num_batched_tokens=2048, cpu_threads=threads)
        weights = ckpt.weights if cfg.quantization != "none" else \
            {k: v.to(getattr(torch, dtype)) for k, v in ckpt.weights.items()}
        engines = [(LLMEngine(replace(cfg, decode_activations=acts), ckpt.config, weights,
                              ops=kernels.ops(torch.device(device).type, cpu_step_kv=kernels.CPU_STEP_KV[kv]),
                              tokenizer=ckpt.tokenizer if acts == "int8" else None),
                    variant + (", decode int8" if acts == "int8" else "")) for kv in cpu_kv for acts in decode_acts]
        for _ in range(rounds):
            for plen in prompt_lens:
                for batch in batches:
                    for engine, name in engines:
                        kv = engine.runner.kv_cache
                        kv_name = str(kv.dtype).removeprefix("torch.")
                        # the pool's bytes per token slot (every layer, keys and values), times the mean
                        # context of the timed steps
                        per_token = kv.numel() * kv.element_size() / (kv.size(2) * kv.size(3))
                        floor = batch * (plen + DECODE_STEPS / 2) * per_token / bandwidth * 1e3 if bandwidth else None
                        decode_steps(engine, batch, prompt_len=plen, steps=4, temperature=0.0)  # warm-up
                        t = decode_steps(engine, batch, prompt_len=plen, steps=DECODE_STEPS, temperature=0.0,
                                         clock=clock)
                        step = statistics.median(t)
                        print(f"| {name} | {plen} | {batch} | {step * 1e3:.1f} | {step * 1e3 / batch:.2f} | "
                              f"{batch / step:.1f} | {kv_name} | {'-' if floor is None else f'{floor:.2f}'} |",
                              flush=True)
        del engines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", action="store_true", help="host overhead table only")
    ap.add_argument("--model-only", action="store_true", help="default-model table only")
    ap.add_argument("--graph-prepare", action="store_true", help="the graph step preparation table only")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--variants", nargs="+", default=None,
                    help="dtype/quantization pairs to time, e.g. float32/none bfloat16/gguf (default: the "
                         "device's default dtype, unquantized)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[128],
                    help="prompt tokens before the timed decode steps (the context a served turn decodes at)")
    ap.add_argument("--cpu-kv", nargs="+", default=["float16"], choices=["float16", "float32", "int8"],
                    help="the KV pool's dtype where a variant runs as the C++ CPU step (default: float16, served)")
    ap.add_argument("--decode-activations", nargs="+", default=["int16"], choices=["int16", "int8"],
                    help="the C++ step's activations for decode rows (default: int16, served); int8 rows say so")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every (prompt length, batch, KV dtype) row this many times, in turn")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: a step's time is the CPU time of the thread running it (with --threads 1 the whole "
                         "C++ step runs on it): what a step costs, whatever else the machine runs")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="the engine's threads on CPU (default: what the engine process uses, every core)")
    args = ap.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu times one thread: use --threads 1")
    torch.set_num_threads(max(1, args.threads - 1))  # as the engine process: torch's own pool leaves a core
    print(f"machine: {platform.processor() or platform.machine()}, {args.threads} engine threads "
          f"({torch.get_num_threads()} for torch's own ops), "
          f"torch {torch.__version__}")
    if args.graph_prepare:
        return graph_prepare(args.device)
    if not args.model_only:
        host_overhead(args.device)
    if not args.host:
        model_speed(args.device, args.variants or ["bfloat16" if args.device == "cuda" else "float32"],
                    tuple(args.batches), args.threads, tuple(args.prompt_lens), tuple(args.cpu_kv),
                    args.rounds, time.thread_time if args.clock == "cpu" else time.perf_counter,
                    tuple(args.decode_activations))


if __name__ == "__main__":
    main()
