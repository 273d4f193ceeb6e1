"""Decode speed on a GPU: eager vs CUDA graphs vs graphs + overlap, against the HBM roofline and a
Hugging Face transformers peer (static cache + torch.compile), same run, same GPU.

    python bench/decode.py                      # default model + Llama-3.1-8B shape (random bf16 weights)
    python bench/decode.py --models smollm2-135m --batches 1 8 32 --steps 64

Per (model, batch, mode) it prints ms per decode step, ms per output token,
tokens/s, the roofline (bytes of weights + KV read per step / measured
device-to-device copy bandwidth), the fraction of wall time the GPU sat idle
(torch profiler: 1 - kernel time / wall time) and kernels per step. Prompts are
random token ids of --context tokens (timing does not depend on values).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wire import protocol as P  # noqa: E402
from replica.config import EngineConfig  # noqa: E402
from replica.engine import LLMEngine  # noqa: E402
from replica.loader import PRESETS, random_weights  # noqa: E402


def copy_bandwidth(device) -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read and written."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * n * 10 / (time.perf_counter() - t0)


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_decode(engine: LLMEngine, batch: int, context: int, steps: int) -> list[float]:
    sp = P.SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    V = engine.model_cfg.vocab_size
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        ids = torch.randint(10, V, (context,), generator=g).tolist()
        assert engine.add(P.Generate(id=f"{batch}-{i}-{time.monotonic_ns()}", prompt_ids=ids, sampling=sp)) is None
    while any(s.num_computed < len(s) - 1 for s in engine.seqs.values()):
        engine.step()
    times = []
    for _ in range(steps):
        sync(engine.cfg.device)
        t0 = time.perf_counter()
        engine.step()  # ends in a host sync (tokens to the host)
        times.append(time.perf_counter() - t0)
    for rid in list(engine.seqs):
        engine.abort(rid)
    return times


def profile_idle(engine: LLMEngine, batch: int, context: int, steps: int) -> tuple[float, float]:
    """(GPU idle fraction of wall time, kernels per step) over `steps` decode steps."""
    from torch.profiler import ProfilerActivity, profile

    sp = P.SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add(P.Generate(id=f"prof-{i}", prompt_ids=list(range(10, 10 + context)), sampling=sp))
    while any(s.num_computed < len(s) - 1 for s in engine.seqs.values()):
        engine.step()
    sync(engine.cfg.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(engine.cfg.device)
        wall = time.perf_counter() - t0
    for rid in list(engine.seqs):
        engine.abort(rid)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels) * 1e-6  # us -> s (overlaps ignored: one stream)
    return max(0.0, 1 - busy / wall), len(kernels) / steps


def bytes_per_step(cfg, dtype: torch.dtype, batch: int, context: int) -> int:
    n_params = sum(v.numel() for v in random_weights_shapes(cfg))
    kv = 2 * cfg.num_layers * cfg.kv_size * dtype.itemsize * context * batch
    return n_params * dtype.itemsize + kv


def random_weights_shapes(cfg):
    from replica.loader import weight_shapes

    return [torch.empty(s, device="meta") for s in weight_shapes(cfg).values()]


def hf_peer(name: str, cfg, batch: int, context: int, steps: int, compiled: bool) -> float | None:
    """ms per decode step of transformers generate (static cache), or None if unavailable."""
    try:
        import transformers
    except ImportError:
        return None
    hf_cfg = transformers.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                      intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                                      num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                                      max_position_embeddings=context + steps + 16, rope_theta=cfg.rope_theta,
                                      tie_word_embeddings=cfg.tie_word_embeddings)
    model = transformers.LlamaForCausalLM(hf_cfg).to("cuda", torch.bfloat16).eval()
    if compiled:
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    ids = torch.randint(10, cfg.vocab_size, (batch, context), device="cuda")
    kw = dict(do_sample=False, cache_implementation="static", pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, **kw)  # warm-up / compile
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, **kw)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        torch.cuda.synchronize()
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, **kw)
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
    del model
    torch.cuda.empty_cache()
    return (total - prefill) / (steps - 1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "llama-3.1-8b"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--no-peer", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/decode.py measures GPU decode; no CUDA device here (CPU figures: bench/engine.py)")
    dev = "cuda"
    bw = copy_bandwidth(dev)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bw / 1e12:.2f} TB/s")
    print("\n| model | batch | mode | ms/step | ms/token | tokens/s | roofline ms | x roofline | GPU idle | kernels/step |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.models:
        cfg = PRESETS[name]
        weights = random_weights(cfg, dtype=torch.bfloat16, seed=0, device=dev)
        for mode, overlap, label in (("off", False, "eager"), ("auto", False, "CUDA graphs"),
                                     ("auto", True, "graphs + overlap")):
            ecfg = EngineConfig(model=name, device=dev, dtype="bfloat16", graph_mode=mode, overlap=overlap,
                                max_num_seqs=max(args.batches), max_num_batched_tokens=4096,
                                max_model_len=args.context + args.steps + 64)
            engine = LLMEngine(ecfg, cfg, weights)
            for b in args.batches:
                run_decode(engine, b, args.context, 4)  # warm-up
                step = statistics.median(run_decode(engine, b, args.context, args.steps))
                roof = bytes_per_step(cfg, torch.bfloat16, b, args.context + args.steps // 2) / bw
                idle, kps = profile_idle(engine, b, args.context, 16)
                print(f"| {name} | {b} | {label} | {step * 1e3:.3f} | {step * 1e3 / b:.3f} | {b / step:.0f} | "
                      f"{roof * 1e3:.3f} | {step / roof:.2f} | {idle:.1%} | {kps:.0f} |", flush=True)
            del engine
            torch.cuda.empty_cache()
        del weights
        if not args.no_peer:
            for compiled in (False, True):
                for b in args.batches:
                    ms = hf_peer(name, cfg, b, args.context, args.steps, compiled)
                    if ms is None:
                        print("| transformers not installed: peer skipped |")
                        break
                    label = "HF generate" + (" + compile" if compiled else "")
                    print(f"| {name} | {b} | {label} | {ms:.3f} | {ms / b:.3f} | {b / ms * 1e3:.0f} | | | | |",
                          flush=True)


if __name__ == "__main__":
    main()
