"""Decode speed on a GPU: eager vs CUDA graphs vs graphs + overlap, through the engine
and Runner as served, against the memory roofline measured in the same run.

    python bench/decode.py                                  # Llama-3.1-8B shape, batch 1 8 32 64
    python bench/decode.py --models smollm2-135m --batches 1 8 --steps 32
    python bench/decode.py --peer-only --batches 1 8         # the transformers peer alone
    python bench/decode.py --profile 1 8                     # one step's device time by kernel
    python bench/decode.py --fused both                      # each mode with and without fused decode

Weights are random bf16, made on the device (timing does not depend on values); so
are the prompts (--context tokens). Per (model, batch, mode) it prints:
  * ms per decode step (--steps steps run back to back, one synchronize at the end:
    with overlap, host work for step N+1 hides under step N, and this counts it so);
  * the roofline: bytes a step must read (every weight except the embedding table,
    which a decode gathers b rows of, plus the KV cache at the mean context) over
    the device-to-device copy bandwidth measured at the start of the same run
    (bytes read + written, CUDA events);
  * GPU idle = 1 - (GPU time of the step's replayed graph, timed back to back) /
    (wall time per step): the share of a step the device waits for the host.
--fused on / both: the modes also (both: each mode twice, side by side) with
kernels.ops(..., fused_decode=True): rotary + KV store in one launch and decode attention
without its merge launch (kernels/rope_store.py, kernels/decode_attention.py), rows labelled
"<mode>, fused decode". Then (unless --no-bucket-check) every graph bucket's logits
against eager decoding's, same weights and prompts, one table row per bucket and a line
"graphs vs eager: ..." (the worst difference, top-1 agreement) that bench/gpu_summary.py
reads. The peer (--peer, on by default): Hugging Face transformers' generate with a static
cache, which compiles the decode forward itself, same shape and dtype, ms per decode
step as (time for N tokens - time for 1) / (N - 1).

On CPU (no CUDA) it runs the same code on a tiny model as a dry run of the GPU call
(bench/gpu.sh --dry-run): figures there mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels  # noqa: E402
from wire import protocol as P  # noqa: E402
from replica.config import EngineConfig, ModelConfig  # noqa: E402
from replica.engine.llm_engine import LLMEngine  # noqa: E402
from replica.model.loader import PRESETS, random_weights, weight_shapes  # noqa: E402

# The dry run's model: small enough for a CPU, the real code path.
TINY = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   rope_theta=10000.0, max_position_embeddings=2048, eos_token_ids=(0,), name="tiny")
MODES = (("eager", "off", False), ("CUDA graphs", "auto", False), ("graphs + overlap", "auto", True))


def model_config(name: str) -> ModelConfig:
    return TINY if name == "tiny" else PRESETS[name]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def gpu_time(fn, reps: int = 20) -> float:
    """Seconds per call of fn, timed with CUDA events after warm-up (median of 3 runs of reps)."""
    for _ in range(3):
        fn()
    runs = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(runs)


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy, counting bytes read and written."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    bw = 2 * n / gpu_time(lambda: b.copy_(a), reps=10)
    del a, b
    torch.cuda.empty_cache()
    return bw


def bytes_per_step(cfg: ModelConfig, itemsize: int, batch: int, context: int) -> int:
    """Weights a decode step reads (all but the embedding table, unless it is also the LM
    head) plus the KV cache of `batch` sequences at `context` tokens."""
    shapes = weight_shapes(cfg)
    params = sum(torch.Size(s).numel() for name, s in shapes.items()
                 if cfg.tie_word_embeddings or not name.endswith("embed_tokens.weight"))
    kv = 2 * cfg.num_layers * cfg.kv_size * context * batch
    return (params + kv) * itemsize


def release_memory() -> None:
    """After the last reference to an engine is dropped: its memory back to the device before
    the next engine sizes its KV pool (no cycle holds an engine; collect anyway)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def add_requests(engine: LLMEngine, batch: int, context: int, max_tokens: int, tag: str) -> None:
    sp = P.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    V = engine.model_cfg.vocab_size
    for i in range(batch):
        ids = torch.randint(10, V, (context,), generator=g).tolist()
        assert engine.add(P.Generate(id=f"{tag}-{batch}-{i}", prompt_ids=ids, sampling=sp)) is None


def decode_step_time(engine: LLMEngine, batch: int, context: int, steps: int) -> tuple[float, float | None]:
    """(seconds per decode step over `steps` back-to-back steps, seconds per replay of the
    batch's graph or None without graphs)."""
    add_requests(engine, batch, context, steps + 16, "t")
    while any(s.num_computed < len(s) - 1 for s in engine.seqs.values()):
        engine.step()  # prefill (and, with overlap, the first decode launched)
    for _ in range(4):
        engine.step()  # warm-up: every decode step from here on is the same shape
    sync(engine.cfg.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(engine.cfg.device)
    per_step = (time.perf_counter() - t0) / steps
    replay = None
    graphs = engine.runner.graphs
    if graphs is not None and graphs.graphs:
        # The last step's buffers replayed again: rewrites the same KV entries with the same values.
        replay = gpu_time(graphs.graphs[graphs.bucket_for(batch)].replay)
    for rid in list(engine.seqs):
        engine.abort(rid)
    while engine.has_work():
        engine.step()
    return per_step, replay


def check_rows(bucket: int) -> int:
    """Rows to run through `bucket`'s graph: all but one (padding rows replayed too), one for
    buckets 1 and 2 (one row fewer would be another bucket's)."""
    return bucket if bucket <= 2 else bucket - 1


def bucket_check(name: str, weights: dict, device: str, dtype: torch.dtype, max_rows: int, context: int = 64) -> None:
    """Every graph bucket's logits against eager decoding's: two engines over the same weights
    (graph_mode off and auto; "buffers" on CPU, the same padded buffers run eagerly), the same
    greedy prompts, and the logits of the first decode step after prefill compared row by row
    (the step a graph replays; the prefill before it is eager in both, so its inputs are the
    same while the prefill's tokens agree)."""
    cfg = model_config(name)
    blocks = max_rows * (-(-(context + 8) // 16)) + 8
    engines = {}
    try:
        for mode in ("off", "auto" if device == "cuda" else "buffers"):
            ecfg = EngineConfig(model=name, device=device, dtype=str(dtype).removeprefix("torch."), graph_mode=mode,
                                overlap=False, speculative="off", max_num_seqs=max_rows, num_blocks=blocks,
                                max_num_batched_tokens=4096, max_model_len=context + 64, seed=0)
            engines[mode] = LLMEngine(ecfg, cfg, weights)
        eager, graphed = engines.values()
        buckets = graphed.runner.graphs.buckets
        print(f"\n### Graphs against eager, every bucket: {name}, context {context}, first decode step after "
              f"prefill, greedy ({'CUDA graph replays' if device == 'cuda' else 'CPU: padded buffers, eagerly'})\n")
        print("| bucket | rows | max abs logit diff | top-1 equal |")
        print("|---:|---:|---:|---:|", flush=True)
        worst, agree, total = 0.0, 0, 0
        for bucket in buckets:
            n = check_rows(bucket)
            logits = []
            for engine in (eager, graphed):
                add_requests(engine, n, context, 4, f"check{bucket}")
                while any(s.num_computed < len(s) - 1 for s in engine.seqs.values()):
                    engine.step()
                _, by_id = engine.step(return_logits=True)
                logits.append(torch.stack([by_id[k].float().cpu() for k in sorted(by_id)]))
                for rid in list(engine.seqs):
                    engine.abort(rid)
                while engine.has_work():
                    engine.step()
            a, b = logits
            diff = (a - b).abs().max().item()
            same = int((a.argmax(-1) == b.argmax(-1)).sum())
            worst, agree, total = max(worst, diff), agree + same, total + n
            print(f"| {bucket} | {n} | {diff:.4g} | {same}/{n} |", flush=True)
        print(f"\ngraphs vs eager: {len(buckets)} buckets, max abs logit diff {worst:.4g}, top-1 equal {agree}/{total}",
              flush=True)
    except Exception as e:  # the timings before stay; the failure is a figure too
        print(f"\ngraphs vs eager: FAILED: {type(e).__name__}: {str(e)[:200]}", flush=True)
    finally:
        for engine in engines.values():
            engine.close()
        engines.clear()
        release_memory()


FUSED = {"off": (False,), "on": (True,), "both": (False, True)}


def bench_model(name: str, batches: list[int], context: int, steps: int, device: str, bw: float | None,
                fused_modes: tuple[bool, ...] = (False,), check: bool = True) -> None:
    cfg = model_config(name)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    weights = random_weights(cfg, dtype=dtype, seed=0, device=device)
    for (mode, graph_mode, overlap), fused in [(m, f) for m in MODES for f in fused_modes]:
        label = f"{mode}, fused decode" if fused else mode
        if device != "cuda" and graph_mode == "auto":
            graph_mode = "buffers"  # the dry run: the padded-buffer path, eagerly
        ecfg = EngineConfig(model=name, device=device, dtype=str(dtype).removeprefix("torch."), graph_mode=graph_mode,
                            overlap=overlap, speculative="off", max_num_seqs=max(batches), max_num_batched_tokens=4096,
                            max_model_len=context + steps + 64, seed=0)
        # The engine's own kernel set (replica.model.runner.kernel_set), with the switch flipped.
        ops = kernels.ops(torch.device(device).type, cpu_step_kv=kernels.CPU_STEP_KV[ecfg.kv_cache_dtype],
                          fused_decode=True) if fused else None
        engine = None
        try:
            t0 = time.perf_counter()
            engine = LLMEngine(ecfg, cfg, weights, ops=ops)
            print(f"  [{name} {label}: engine built in {time.perf_counter() - t0:.1f}s]", file=sys.stderr, flush=True)
            for b in batches:
                step, replay = decode_step_time(engine, b, context, steps)
                roof = bytes_per_step(cfg, dtype.itemsize, b, context + steps // 2) / bw if bw else None
                idle = f"{max(0.0, 1 - replay / step):.1%}" if replay else "-"
                print(f"| {name} | {b} | {label} | {step * 1e3:.3f} | {b / step:.0f} | "
                      f"{roof * 1e3 if roof else float('nan'):.3f} | {step / roof if roof else float('nan'):.2f} | "
                      f"{replay * 1e3 if replay else float('nan'):.3f} | {idle} |", flush=True)
        except Exception as e:  # one mode failing must not hide the others' figures
            print(f"| {name} | | {label} | FAILED: {type(e).__name__}: {str(e)[:200]} | | | | | |", flush=True)
        finally:
            if engine is not None:
                engine.close()
            engine = None
            release_memory()
    if check:
        bucket_check(name, weights, device, dtype, max(batches))
    del weights
    release_memory()


def profile_step(name: str, batch: int, context: int, device: str, bw: float | None, top: int = 18) -> None:
    """Where a decode step's device time goes: one engine with CUDA graphs, `batch` sequences
    at `context` tokens, 10 replays of the batch's graph under torch.profiler (CUPTI reports
    the kernels inside a graph); kernel time per step by kernel name, largest first, against
    the step's roofline. On CPU (dry run) the eager forward's ops instead."""
    from torch.profiler import ProfilerActivity, profile

    cfg = model_config(name)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    ecfg = EngineConfig(model=name, device=device, dtype=str(dtype).removeprefix("torch."),
                        graph_mode="auto" if device == "cuda" else "buffers", speculative="off", max_num_seqs=batch,
                        max_num_batched_tokens=4096, max_model_len=context + 64, seed=0)
    engine = LLMEngine(ecfg, cfg, random_weights(cfg, dtype=dtype, seed=0, device=device))
    add_requests(engine, batch, context, 32, "p")
    while any(s.num_computed < len(s) - 1 for s in engine.seqs.values()):
        engine.step()
    for _ in range(4):
        engine.step()
    graphs = engine.runner.graphs
    b = graphs.bucket_for(batch)
    if b in graphs.graphs:
        replay = graphs.graphs[b].replay
    else:  # no graph (CPU): the same buffers, eagerly
        def replay():
            graphs._forward(b)
    reps = 10
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync(device)
    with profile(activities=acts) as prof:
        for _ in range(reps):
            replay()
        sync(device)
    on_device = device == "cuda"
    rows = {}
    for e in prof.key_averages():
        t = e.device_time_total if on_device else e.self_cpu_time_total  # us over `reps`
        if t > 0 and (not on_device or e.device_type == torch.autograd.DeviceType.CUDA):
            rows[e.key] = (t / reps, e.count / reps)
    total = sum(t for t, _ in rows.values())
    roof = bytes_per_step(cfg, dtype.itemsize, batch, context) / bw * 1e6 if bw else float("nan")
    print(f"\n### Device time of one step by kernel: {name}, batch {batch}, context {context} "
          f"({'replayed graph' if on_device else 'eager ops on CPU'}): {total:.0f} us a step, "
          f"roofline {roof:.0f} us, {len([1 for _, c in rows.values() if c])} kinds\n")
    print("| kernel | us/step | launches/step | share |")
    print("|---|---:|---:|---:|")
    for key, (t, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"| {key[:90]} | {t:.1f} | {n:.0f} | {t / total:.1%} |", flush=True)
    engine.close()
    del engine
    release_memory()


def hf_peer(name: str, batches: list[int], context: int, steps: int, device: str) -> None:
    """transformers generate with a static cache (generate compiles its forward)."""
    try:
        import transformers
    except ImportError:
        print(f"| {name} | | transformers | not installed: peer skipped | | | | | |", flush=True)
        return
    cfg = model_config(name)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hf_cfg = transformers.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                      intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                                      num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                                      max_position_embeddings=context + steps + 16, rope_theta=cfg.rope_theta,
                                      tie_word_embeddings=cfg.tie_word_embeddings)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):  # random init on the device, in bf16: no fp32 copy on the host
            model = transformers.LlamaForCausalLM(hf_cfg).eval()
    finally:
        torch.set_default_dtype(default)
    model.generation_config.pad_token_id = 0
    # generate compiles the static-cache forward itself (its compile_config) unless told not to;
    # compiling `forward` here as well may be what failed on the last lease: it is left to generate.
    kw = dict(do_sample=False, cache_implementation="static")
    for b in batches:
        try:
            ids = torch.randint(10, cfg.vocab_size, (b, context), device=device)
            mask = torch.ones_like(ids)

            def gen(n):
                sync(device)
                t0 = time.perf_counter()
                model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, **kw)
                sync(device)
                return time.perf_counter() - t0

            with torch.inference_mode():
                gen(steps)  # compile, capture
                gen(steps)
                first = min(gen(1) for _ in range(2))
                total = min(gen(steps) for _ in range(2))
            step = (total - first) / (steps - 1)
            print(f"| {name} | {b} | transformers static cache (generate's compile) | {step * 1e3:.3f} | {b / step:.0f} "
                  f"| | | | |", flush=True)
        except Exception as e:
            print(f"| {name} | {b} | transformers | FAILED: {type(e).__name__}: {str(e)[:200]} | | | | | |",
                  flush=True)
    del model
    release_memory()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=None, help="PRESETS names (default: llama-3.1-8b; tiny on CPU)")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--peer-only", action="store_true")
    ap.add_argument("--peer-batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--fused", choices=sorted(FUSED), default="off",
                    help="kernels.ops(..., fused_decode=True) off, on, or both (each mode twice, same process)")
    ap.add_argument("--no-bucket-check", action="store_true",
                    help="skip the check of every graph bucket's logits against eager decoding's")
    ap.add_argument("--profile", nargs="*", type=int, metavar="BATCH",
                    help="only: one step's device time by kernel at these batch sizes (default 1)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    models = args.models or (["llama-3.1-8b"] if device == "cuda" else ["tiny"])
    bw = copy_bandwidth() if device == "cuda" else None  # measured once: every roofline of this run
    if args.profile is not None:
        for name in models:
            for b in args.profile or [1]:
                profile_step(name, b, args.context, device, bw)
        return
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (dry run: figures mean nothing)"
    print(f"device: {name}, torch {torch.__version__}, copy bandwidth "
          f"{f'{bw / 1e12:.2f} TB/s' if bw else 'n/a'}, context {args.context}, {args.steps} steps, "
          f"fused decode {args.fused}\n")
    print("| model | batch | mode | ms/step | tokens/s | roofline ms | x roofline | graph replay ms | GPU idle |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|", flush=True)
    for name in models:
        if not args.peer_only:
            bench_model(name, args.batches, args.context, args.steps, device, bw, FUSED[args.fused],
                        check=not args.no_bucket_check)
        if not args.no_peer:
            hf_peer(name, args.peer_batches, args.context, args.steps, device)


if __name__ == "__main__":
    main()
