"""Speculative decoding on the default model with its trained EAGLE-3 head.

    python bench/speculative.py [--device cpu|cuda] [--head DIR] [--new-tokens 64]

On the held-out prompts of speculative/data/prompts.json (never trained on):
  1. mean acceptance length tau (tokens per sequence per target forward) for
     chains of 3/5/7 and EAGLE-2 trees of 16/32/64 draft tokens, greedy and at
     temperature 0.7 (trees verify with rejection sampling, chains draw their
     drafts from the head and verify with min(1, p/q)), plus the n-gram drafter;
  2. decode tokens/s with and without speculation at batch 1, 4 and 16, and the
     speculation policy they imply (speculative.policy: the fastest
     configuration per batch size; --write-policy saves it beside the head);
  3. why: the target's matrix multiplies at 1, 4, 16 and 33 rows (a decode
     step, chain 3, tree 16, tree 32 at batch 1), time and weight GB/s -- a
     verify forward is cheap only where several rows cost about what one does.
Runs speculative.decode (the standalone loop), same model code either way.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import kernels  # noqa: E402
from replica.config import EngineConfig  # noqa: E402
from replica.loader import load_checkpoint  # noqa: E402
from wire.protocol import SamplingParams  # noqa: E402
from replica.runner import build_model  # noqa: E402
from speculative.decode import SpeculativeGenerator  # noqa: E402
from speculative.drafting import TreeSpec  # noqa: E402
from speculative.head import head_dir, load_head  # noqa: E402
from speculative.ngram import NgramDrafter  # noqa: E402
from speculative.policy import SpecPolicy  # noqa: E402
from speculative.train import load_prompts  # noqa: E402

# EAGLE-2-style shapes per token budget: (depth, top_k).
TREES = {16: (5, 4), 32: (6, 6), 64: (7, 8)}


def specs():
    out = {f"chain {k}": TreeSpec.chain(k) for k in (3, 5, 7)}
    out |= {f"tree {n}": TreeSpec(depth=d, top_k=k, budget=n) for n, (d, k) in TREES.items()}
    out["n-gram 5"] = NgramDrafter(k=5, min_n=2)
    return out


def sampled(spec):
    """At temperature > 0 chains draw their drafts from q; trees stay top-k."""
    return TreeSpec.chain(spec.depth, sample=True) if isinstance(spec, TreeSpec) and spec.top_k == 1 else spec


def gemm_table(model, dev: str, rows=(1, 4, 16, 33), reps: int = 20) -> None:
    """Time the target's own linear layers (one decoder layer's and the lm head) per row count."""
    layer = model.layers[0]
    mats = {"qkv": layer.self_attn.qkv_proj.weight, "o": layer.self_attn.o_proj.weight,
            "gate_up": layer.mlp.gate_up_proj.weight, "down": layer.mlp.down_proj.weight,
            "lm head": model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight}
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    print("\n| weights (out x in) | " + " | ".join(f"{m} rows: us, GB/s" for m in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for name, w in mats.items():
        cells = []
        for m in rows:
            x = torch.randn(m, w.shape[1], dtype=w.dtype, device=w.device)
            for _ in range(3):
                torch.nn.functional.linear(x, w)
            sync()
            t0 = time.perf_counter()
            for _ in range(reps):
                torch.nn.functional.linear(x, w)
            sync()
            dt = (time.perf_counter() - t0) / reps
            cells.append(f"{dt * 1e6:.0f}, {w.numel() * w.element_size() / dt / 1e9:.1f}")
        print(f"| {name} ({w.shape[0]} x {w.shape[1]}) | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="default")
    ap.add_argument("--head", help="head folder (default: speculative.head.head_dir(model))")
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
    ck = load_checkpoint(args.model)
    ops = kernels.ops(torch.device(dev).type)
    model = build_model(ck.config, EngineConfig(device=dev, dtype=dtype), ck.weights, ops, 2048)
    path = Path(args.head) if args.head else head_dir(ck.config.name)
    head = load_head(path, ck.config, model.embed_tokens.weight)
    texts = load_prompts(args.split)[: args.limit or None]
    prompts = [ck.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in texts]
    gen = SpeculativeGenerator(model, head, num_blocks=1536)
    name = torch.cuda.get_device_name() if dev.startswith("cuda") else f"CPU, {torch.get_num_threads()} threads"
    print(f"# {ck.config.name} on {name}, {dtype}; head {path}; {len(prompts)} {args.split} prompts, "
          f"{args.new_tokens} new tokens")
    wanted = [s.strip() for s in args.tau_specs.split(",") if s.strip()]

    greedy = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    if not args.skip_tau:
        print("\n| drafter | draft tokens | tau greedy | tau T=0.7 | accepted / drafted (greedy) |")
        print("|---|---|---|---|---|")
        for label, spec in specs().items():
            if wanted and label not in wanted:
                continue
            _, g = gen.generate(prompts, greedy, spec)
            seeded = [SamplingParams(max_tokens=args.new_tokens, temperature=0.7, seed=i, ignore_eos=True)
                      for i in range(len(prompts))]
            _, s = gen.generate(prompts, seeded, sampled(spec))
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
            gen.generate(groups[0][:1], SamplingParams(max_tokens=4, temperature=0.0), spec)  # warm-up
            if dev.startswith("cuda"):
                torch.cuda.synchronize()
            made, secs, fwd, emitted = 0, 0.0, 0, 0
            for batch in groups:
                _, st = gen.generate(batch, greedy, spec)
                made += st.generated - b  # tokens after the first, which prefill makes
                secs += st.decode_s
                fwd, emitted = fwd + st.seq_rounds, emitted + st.emitted
            rate = made / secs
            rates[b][spec] = rate
            row.append(f"{rate:.1f}" + (f" (tau {emitted / max(1, fwd):.2f})" if spec is not None else ""))
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
