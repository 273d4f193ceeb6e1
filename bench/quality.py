"""Does a quantization keep quality? Greedy agreement with the fp32 path and perplexity.

    .venv/bin/python bench/quality.py                       # none, gguf, int4, int8
    .venv/bin/python bench/quality.py --tokens 64 --variants gguf int8
    .venv/bin/python bench/quality.py --variants gguf --cpu-kv float32 float16   # the KV pool's dtype

For each held-out prompt of speculative/data/prompts.json (chat-formatted), the
fp32 unquantized engine answers greedily (`--tokens` new tokens, EOS ignored);
each variant then answers the same prompts. Printed per variant: the share of
answers identical to fp32's, the share of answer tokens before the first
divergence, and the perplexity of the fp32 conversations (prompt + fp32 answer,
answer tokens scored) under the variant, computed in one teacher-forced forward.
A quantized variant runs as the C++ CPU step, whose KV pool is fp16 unless
`--cpu-kv` says fp32 (each variant runs once per dtype given; the reference's pool
is fp32: it runs op by op).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kernels  # noqa: E402
from wire import protocol as P  # noqa: E402
from replica.config import EngineConfig  # noqa: E402
from replica.engine.llm_engine import LLMEngine  # noqa: E402
from replica.model.loader import load_checkpoint  # noqa: E402
from replica.model.runner import StepPlan  # noqa: E402


def answers(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    sp = P.SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        assert engine.add(P.Generate(id=str(i), prompt_ids=ids, sampling=sp)) is None
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for m in engine.step():
            out.setdefault(m.id, []).extend(m.ids)
    return [out[str(i)] for i in range(len(prompts))]


@torch.inference_mode()
def nll(engine: LLMEngine, ids: list[int], scored_from: int) -> tuple[float, int]:
    """Sum of -log p(ids[t] | ids[:t]) for t >= scored_from, one forward over the whole sequence."""
    runner = engine.runner
    blocks = list(range(-(-len(ids) // runner.block_size)))
    plan = StepPlan(input_ids=ids, starts=[0], num_tokens=[len(ids)], block_tables=[blocks], sample_rows=[0],
                    num_decodes=0)
    input_ids, positions, ctx, _ = runner.prepare(plan)
    hidden = runner.model(input_ids, positions, ctx, runner.kv_cache)
    logp = runner.model.compute_logits(hidden[scored_from - 1:-1]).float().log_softmax(-1)
    target = torch.tensor(ids[scored_from:])
    return -logp.gather(1, target[:, None]).sum().item(), len(target)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=["none", "gguf", "int4", "int8"])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--cpu-kv", nargs="+", default=["float16"], choices=["float16", "float32"],
                    help="the KV pool's dtype where a variant runs as the C++ CPU step (default: float16, served)")
    args = ap.parse_args()
    ckpt = load_checkpoint("default", dtype=torch.float32)
    heldout = json.loads((ROOT / "speculative" / "data" / "prompts.json").read_text())["heldout"]
    prompts = [ckpt.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in heldout]
    cfg = dict(num_blocks=1024, max_num_seqs=len(prompts), max_num_batched_tokens=4096)
    reference = LLMEngine(EngineConfig(**cfg), ckpt.config, ckpt.weights)
    assert reference.runner.kv_cache.dtype == torch.float32, "the reference keeps an fp32 KV pool"
    ref = answers(reference, prompts, args.tokens)
    del reference
    print(f"machine: {platform.machine()}; {time.strftime('%Y-%m-%d')}; {len(prompts)} held-out prompts, "
          f"{args.tokens} greedy tokens each, fp32 answers as the reference\n")
    print("| quantization | KV | identical answers | tokens before first divergence | perplexity of fp32 answers |")
    print("|---|---|---:|---:|---:|")
    for variant in args.variants:
        for kv in args.cpu_kv:
            ops = kernels.ops("cpu", cpu_step_kv=getattr(torch, kv))
            engine = LLMEngine(EngineConfig(quantization=variant, **cfg), ckpt.config, ckpt.weights, ops=ops)
            got = answers(engine, prompts, args.tokens)
            same = sum(a == b for a, b in zip(got, ref))
            prefix = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b)) for a, b in zip(got, ref))
            total, n = 0.0, 0
            for p, a in zip(prompts, ref):
                s, k = nll(engine, p + a, len(p))
                total, n = total + s, n + k
            kv_name = str(engine.runner.kv_cache.dtype).removeprefix("torch.")
            print(f"| {variant} | {kv_name} | {same}/{len(ref)} | {prefix / (len(ref) * args.tokens):.1%} | "
                  f"{math.exp(total / n):.3f} |", flush=True)
            del engine


if __name__ == "__main__":
    main()
