"""Speculative decoding on the default model with its trained EAGLE-3 head, measured
on the engine that serves it (continuous batching, the real step).

    python bench/speculative.py [--device cpu|cuda] [--head DIR] [--new-tokens 64]

On the held-out prompts of speculative/data/prompts.json (never trained on):
  1. mean acceptance length tau (tokens per decoding sequence per target forward)
     for chains of 3/5/7 and EAGLE-2 trees of 16/32/64 draft tokens, greedy and at
     temperature 0.7 (chains then draw their drafts from the head and are verified
     by rejection sampling, spec_sample; trees stay top-k), plus the n-gram drafter;
  2. decode tokens/s with and without speculation at batch 1, 4 and 16, and the
     speculation policy they imply (speculative.policy: the fastest configuration
     per batch size; --write-policy saves it beside the head, where `--speculative
     auto` serves it from);
  3. why: the target's matrix multiplies at 1, 4, 16 and 33 rows (a decode
     step, chain 3, tree 16, tree 32 at batch 1), time and weight GB/s -- a
     verify forward is cheap only where several rows cost about what one does.
Each configuration is an LLMEngine over one shared copy of the model, its draft
shape fixed by a one-rule policy (the mechanism `--speculative auto` uses).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import kernels  # noqa: E402
from replica.config import EngineConfig  # noqa: E402
from replica.engine.llm_engine import LLMEngine  # noqa: E402
from replica.model.loader import load_checkpoint  # noqa: E402
from replica.engine.offline import generate  # noqa: E402
from replica.model.runner import build_model  # noqa: E402
from speculative.cache import head_dir  # noqa: E402
from speculative.tree_spec import TreeSpec  # noqa: E402
from speculative.ngram import NgramDrafter  # noqa: E402
from speculative.policy import SpecPolicy  # noqa: E402
from speculative.train import load_prompts  # noqa: E402
from wire.protocol import SamplingParams  # noqa: E402

# EAGLE-2-style shapes per token budget: (depth, top_k).
TREES = {16: (5, 4), 32: (6, 6), 64: (7, 8)}


def specs():
    out = {f"chain {k}": TreeSpec.chain(k) for k in (3, 5, 7)}
    out |= {f"tree {n}": TreeSpec(depth=d, top_k=k, budget=n) for n, (d, k) in TREES.items()}
    out["n-gram 5"] = NgramDrafter(k=5, min_n=2)
    return out


class Engines:
    """LLMEngines over one copy of the model, one draft shape each."""

    def __init__(self, ck, model, ops, head: Path, dev: str, dtype: str, new_tokens: int):
        self.ck, self.model, self.ops, self.head, self.dev, self.dtype = ck, model, ops, head, dev, dtype
        self.new_tokens = new_tokens
        self.policies = Path(tempfile.mkdtemp(prefix="bench-spec-"))

    def __call__(self, spec, batch: int, max_prompt: int, sample: bool = False) -> LLMEngine:
        """An engine for `batch` sequences decoding with `spec` (None: plainly) at every batch size."""
        draft = 0 if spec is None else spec.budget if isinstance(spec, TreeSpec) else spec.k
        kw = dict(speculative="off")
        if isinstance(spec, NgramDrafter):
            kw = dict(speculative="ngram", spec_depth=spec.k, spec_max_batch=1 << 20)  # no taper
        elif spec is not None:
            folder = self.policies / f"{spec.depth}-{spec.top_k}-{spec.budget}"
            folder.mkdir(exist_ok=True)
            SpecPolicy(((1, spec),), torch.device(self.dev).type).save(folder)
            kw = dict(speculative="eagle3", spec_head=str(self.head), spec_policy=str(folder), spec_sample=sample,
                      spec_top_k=spec.top_k)
        blocks = batch * -(-(max_prompt + self.new_tokens + draft + 1) // 16)
        cfg = EngineConfig(device=self.dev, dtype=self.dtype, num_blocks=blocks, max_num_seqs=batch, max_model_len=2048,
                           max_num_batched_tokens=max(512, batch * (1 + draft)), **kw)
        return LLMEngine(cfg, self.ck.config, model=self.model, ops=self.ops)


def gemm_table(model, dev: str, rows=(1, 4, 16, 33), reps: int = 20) -> None:
    """Time the target's own linear layers (one decoder layer's and the lm head) per row count:
    dense weights through F.linear, quantized ones (replica.model.quant.QLinear) through their kernel."""
    model = getattr(model, "model", model)  # replica.model.cpu_model.CpuModel wraps the LlamaModel
    layer = model.layers[0]
    head = model.lm_head if model.lm_head is not None else torch.nn.Linear(1, 1)
    if model.lm_head is None:
        head.weight = model.embed_tokens.weight
    mats = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
            "down": layer.mlp.down_proj, "lm head": head}

    def size(mod) -> tuple[int, int, int]:  # out, in, bytes read
        if isinstance(mod, torch.nn.Linear):
            return *mod.weight.shape, mod.weight.numel() * mod.weight.element_size()
        return mod.out_features, mod.in_features, sum(t.numel() * t.element_size() for t in
                                                      ((mod.packed,) if mod.packed is not None else (mod.qs, mod.d, mod.m)))

    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    print("\n| weights (out x in) | " + " | ".join(f"{m} rows: us, GB/s" for m in rows) + " |")
    print("|---|" + "---|" * len(rows))
    with torch.inference_mode():
        for name, mod in mats.items():
            n_out, n_in, nbytes = size(mod)
            cells = []
            for m in rows:
                x = torch.randn(m, n_in, device=dev, dtype=torch.float32 if not isinstance(mod, torch.nn.Linear)
                                else mod.weight.dtype)
                for _ in range(3):
                    mod(x)
                sync()
                t0 = time.perf_counter()
                for _ in range(reps):
                    mod(x)
                sync()
                dt = (time.perf_counter() - t0) / reps
                cells.append(f"{dt * 1e6:.0f}, {nbytes / dt / 1e9:.1f}")
            print(f"| {name} ({n_out} x {n_in}) | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="default")
    ap.add_argument("--quantization", default=None,
                    help="none|int8|int4|gguf (default: gguf on CPU for a GGUF model, as served; none on CUDA)")
    ap.add_argument("--head", help="head folder (default: speculative.cache.head_dir(model))")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--min-seqs", type=int, default=8, help="sequences timed per batch size (at least)")
    ap.add_argument("--speed-specs", default="chain 3,chain 5,tree 16,tree 32",
                    help="speculation configs timed against plain decoding")
    ap.add_argument("--skip-tau", action="store_true")
    ap.add_argument("--tau-specs", default="", help="only these rows of the tau table (default: all)")
    ap.add_argument("--split", default="heldout", choices=["heldout", "train"],
                    help="prompts (train: the ones the head learned from, to see how far it generalizes)")
    ap.add_argument("--limit", type=int, default=0, help="use only the first N prompts")
    ap.add_argument("--skip-gemm", action="store_true")
    ap.add_argument("--write-policy", action="store_true", help="save the measured policy as policy.json by the head")
    args = ap.parse_args()

    dev = args.device
    dtype = "bfloat16" if dev.startswith("cuda") else "float32"
    if args.quantization is None:
        from replica.__main__ import default_quantization

        args.quantization = default_quantization(args.model, dev, 1, False)
    ck = load_checkpoint(args.model)
    ops = kernels.ops(torch.device(dev).type)
    # the model as served: on CPU quantized (the GGUF's own blocks, or --quantization) and one C++ call per step
    model = build_model(ck.config, EngineConfig(device=dev, dtype=dtype, quantization=args.quantization), ck.weights,
                        ops, 2048)
    path = Path(args.head) if args.head else head_dir(ck.config.name)
    texts = load_prompts(args.split)[: args.limit or None]
    prompts = [ck.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in texts]
    longest = max(map(len, prompts))
    engines = Engines(ck, model, ops, path, dev, dtype, args.new_tokens)
    name = torch.cuda.get_device_name() if dev.startswith("cuda") else f"CPU, {torch.get_num_threads()} threads"
    print(f"# {ck.config.name} on {name}, {dtype}; head {path}; {len(prompts)} {args.split} prompts, "
          f"{args.new_tokens} new tokens; the engine (continuous batching)")
    wanted = [s.strip() for s in args.tau_specs.split(",") if s.strip()]

    greedy = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    if not args.skip_tau:
        print("\n| drafter | draft tokens | tau greedy | tau T=0.7 | accepted / drafted (greedy) |")
        print("|---|---|---|---|---|")
        for label, spec in specs().items():
            if wanted and label not in wanted:
                continue
            g = generate(engines(spec, len(prompts), longest), prompts, greedy).stats
            seeded = [SamplingParams(max_tokens=args.new_tokens, temperature=0.7, seed=i, ignore_eos=True)
                      for i in range(len(prompts))]
            chain = isinstance(spec, TreeSpec) and spec.top_k == 1
            s = generate(engines(spec, len(prompts), longest, sample=chain), prompts, seeded).stats
            n = spec.budget if isinstance(spec, TreeSpec) else spec.k
            print(f"| {label} | {n} | {g.tau:.2f} | {s.tau:.2f} | {g.accepted / max(1, g.drafted):.1%} |",
                  flush=True)

    if not args.skip_gemm:
        gemm_table(model, dev)

    all_specs = specs()
    speed = [None] + [all_specs[s.strip()] for s in args.speed_specs.split(",") if s.strip()]
    labels = ["no speculation"] + [s.strip() for s in args.speed_specs.split(",") if s.strip()]
    batch_sizes = [int(b) for b in args.batches.split(",") if b.strip()]
    if not batch_sizes:
        return
    print("\n| decode tokens/s (greedy) | " + " | ".join(f"batch {b}" for b in batch_sizes) + " |")
    print("|---|" + "---|" * len(batch_sizes))
    rates: dict[int, dict] = {b: {} for b in batch_sizes}
    for label, spec in zip(labels, speed):
        row = []
        for b in batch_sizes:
            # At least --min-seqs sequences per batch size (batch 1: that many prompts one after
            # another), so one prompt's easy or hard text does not decide the figure.
            groups = [[prompts[(g * b + i) % len(prompts)] for i in range(b)]
                      for g in range(max(1, -(-args.min_seqs // b)))]
            engine = engines(spec, b, longest)
            generate(engine, groups[0][:1], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
            made, secs, rows, emitted = 0, 0.0, 0, 0
            for batch in groups:
                run = generate(engine, batch, greedy)
                made, secs = made + run.decode_tokens, secs + run.decode_s
                rows, emitted = rows + run.stats.decode_rows, emitted + run.stats.decode_tokens
            rate = made / secs
            rates[b][spec] = rate
            row.append(f"{rate:.1f}" + (f" (tau {emitted / max(1, rows):.2f})" if spec is not None else ""))
        print(f"| {label} | " + " | ".join(row) + " |", flush=True)
    policy = SpecPolicy.from_rates(rates, torch.device(dev).type, name)
    names = {id(s): lab for lab, s in zip(labels, speed)}
    print("\npolicy: " + "; ".join(f"batch >= {b}: {names[id(s)]}" for b, s in policy.rules))
    if args.write_policy:
        print(f"saved {policy.save(path)}")


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"\n({time.perf_counter() - t0:.0f} s)")
