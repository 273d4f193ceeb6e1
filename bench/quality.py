"""Does a quantization keep quality? Greedy agreement with the fp32 path and perplexity.

    .venv/bin/python bench/quality.py                       # none, gguf, int4, int8
    .venv/bin/python bench/quality.py --tokens 64 --variants gguf int8
    .venv/bin/python bench/quality.py --variants gguf --cpu-kv float32 float16   # the KV pool's dtype
    .venv/bin/python bench/quality.py --variants gguf --cpu-kv float16 int8 --long 4
    .venv/bin/python bench/quality.py --variants gguf --prefill-activations int16 int8 --long 4
    .venv/bin/python bench/quality.py --variants gguf --prefill-activations int8 --decode-activations int16 int8

For each held-out prompt of speculative/data/prompts.json (chat-formatted), the
fp32 unquantized engine answers greedily (`--tokens` new tokens, EOS ignored);
each variant then answers the same prompts. Printed per variant: the share of
answers identical to fp32's, the share of answer tokens before the first
divergence, and the perplexity of the fp32 conversations (prompt + fp32 answer,
answer tokens scored) under the variant, computed in one teacher-forced forward.
A quantized variant runs as the C++ CPU step, whose KV pool is fp16 unless
`--cpu-kv` says fp32 or int8 (each variant runs once per dtype given; the reference's
pool is fp32: it runs op by op), and with each `--prefill-activations` (int8: prompt rows
that sample nothing as int8 activations; the perplexity's forward then rounds the rows a
replica would, the prompt's but its last, and the scored ones stay int16) and each
`--decode-activations` (int8: decode rows too; the perplexity's forward then rounds the
answer's rows, as decodes computed them). With more than one of those, a column compares
each one's answers with the first's.

Those answers are short (prompts of ~30 tokens). `--long N` adds a long-context table:
N windows of 1,536 tokens of one text (the training prompts of prompts.json, joined),
each continued greedily by fp32 and by each variant (identical continuations, tokens
before the first divergence), and the perplexity of its last 1,024 tokens, each
predicted from everything before it in the window (one teacher-forced forward).
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
def forward_logits(engine: LLMEngine, ids: list[int], rows: slice = slice(None), prompt: int = 0) -> torch.Tensor:
    """fp32 logits after ids[rows] from one forward over all of ids through the engine's runner
    (its pool's first blocks, nothing else running; bench/activations.py and bench/sampling.py too).
    prompt: the tokens that count as the prompt (StepPlan.prompt_lens: with prefill_activations
    int8 those but the last are rounded narrow, with decode_activations int8 the tokens after
    them but the last, as a replica's decodes); 0: none."""
    runner = engine.runner
    blocks = list(range(-(-len(ids) // runner.block_size)))
    plan = StepPlan(input_ids=ids, starts=[0], num_tokens=[len(ids)], block_tables=[blocks], sample_rows=[0],
                    num_decodes=0, prompt_lens=[prompt])
    input_ids, positions, ctx, _ = runner.prepare(plan)
    ctx.logits_rows = None  # every row's final hidden state: the plan samples only one, these logits read ids[rows]
    hidden = runner.model(input_ids, positions, ctx, runner.kv_cache)
    return runner.model.compute_logits(hidden[rows]).float()


@torch.inference_mode()
def nll(engine: LLMEngine, ids: list[int], scored_from: int) -> tuple[float, int]:
    """Sum of -log p(ids[t] | ids[:t]) for t >= scored_from, one forward over the whole sequence."""
    logp = forward_logits(engine, ids, slice(scored_from - 1, -1), prompt=scored_from).log_softmax(-1)
    target = torch.tensor(ids[scored_from:])
    return -logp.gather(1, target[:, None]).sum().item(), len(target)


LONG_WINDOW, LONG_SCORED_FROM = 1536, 512


def long_windows(ckpt, n: int) -> list[list[int]]:
    """n windows of LONG_WINDOW tokens of the training prompts joined into one text."""
    train = json.loads((ROOT / "speculative" / "data" / "prompts.json").read_text())["train"]
    ids = ckpt.tokenizer.encode("\n\n".join(train), add_special_tokens=False)
    assert len(ids) >= n * LONG_WINDOW, f"the text holds {len(ids) // LONG_WINDOW} windows, not {n}"
    return [ids[i * LONG_WINDOW:(i + 1) * LONG_WINDOW] for i in range(n)]


def agreement(got: list[list[int]], ref: list[list[int]]) -> tuple[int, float]:
    """(answers identical to ref's, share of ref's tokens before each first divergence)."""
    same = sum(a == b for a, b in zip(got, ref))
    prefix = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b)) for a, b in zip(got, ref))
    return same, prefix / sum(len(b) for b in ref)


def perplexity(engine: LLMEngine, seqs: list[list[int]], scored_from: list[int]) -> float:
    total, n = 0.0, 0
    for ids, start in zip(seqs, scored_from):
        s, k = nll(engine, ids, start)
        total, n = total + s, n + k
    return math.exp(total / n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=["none", "gguf", "int4", "int8"])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--cpu-kv", nargs="+", default=["float16"], choices=["float16", "float32", "int8"],
                    help="the KV pool's dtype where a variant runs as the C++ CPU step (default: float16, served)")
    ap.add_argument("--prefill-activations", nargs="+", default=["int16"], choices=["int16", "int8"],
                    help="the C++ step's activations for prompt rows that sample nothing (default: int16)")
    ap.add_argument("--decode-activations", nargs="+", default=["int16"], choices=["int16", "int8"],
                    help="the C++ step's activations for decode rows (default: int16, served)")
    ap.add_argument("--long", type=int, default=0, metavar="N",
                    help=f"also N windows of {LONG_WINDOW} tokens: greedy continuations and perplexity")
    args = ap.parse_args()
    ckpt = load_checkpoint("default", dtype=torch.float32)
    heldout = json.loads((ROOT / "speculative" / "data" / "prompts.json").read_text())["heldout"]
    prompts = [ckpt.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in heldout]
    cfg = dict(num_blocks=1024, max_num_seqs=len(prompts), max_num_batched_tokens=4096)
    reference = LLMEngine(EngineConfig(**cfg), ckpt.config, ckpt.weights)
    assert reference.runner.kv_cache.dtype == torch.float32, "the reference keeps an fp32 KV pool"
    ref = answers(reference, prompts, args.tokens)
    windows = long_windows(ckpt, args.long) if args.long else []
    long_ref = answers(reference, windows, args.tokens) if windows else []
    long_rows = [("none (fp32)", "float32", "-", agreement(long_ref, long_ref),
                  perplexity(reference, windows, [LONG_SCORED_FROM] * len(windows)), len(windows))] if windows else []
    del reference
    print(f"machine: {platform.machine()}; {time.strftime('%Y-%m-%d')}; {len(prompts)} held-out prompts, "
          f"{args.tokens} greedy tokens each, fp32 answers as the reference\n")
    acts_list = [(p, d) for p in args.prefill_activations for d in args.decode_activations]
    label = lambda acts: acts[0] + ("" if acts[1] == "int16" else f", decode {acts[1]}")  # noqa: E731
    vs_first = len(acts_list) > 1
    vs_col = f" identical to {label(acts_list[0])}'s |" if vs_first else ""
    print("| quantization | KV | activations (prefill, decode) | identical answers | tokens before first divergence | "
          "perplexity of fp32 answers |" + vs_col)
    print("|---|---|---|---:|---:|---:|" + ("---:|" if vs_first else ""))
    for variant in args.variants:
        for kv in args.cpu_kv:
            first, long_first = None, None
            for acts in acts_list:
                ops = kernels.ops("cpu", cpu_step_kv=getattr(torch, kv))
                engine = LLMEngine(EngineConfig(quantization=variant, prefill_activations=acts[0],
                                                decode_activations=acts[1], **cfg), ckpt.config, ckpt.weights,
                                   ops=ops, tokenizer=ckpt.tokenizer)
                got = answers(engine, prompts, args.tokens)
                first = first or got
                same, prefix = agreement(got, ref)
                ppl = perplexity(engine, [p + a for p, a in zip(prompts, ref)], [len(p) for p in prompts])
                kv_name = str(engine.runner.kv_cache.dtype).removeprefix("torch.")
                extra = f" {agreement(got, first)[0]}/{len(ref)} |" if vs_first else ""
                print(f"| {variant} | {kv_name} | {label(acts)} | {same}/{len(ref)} | {prefix:.1%} | {ppl:.3f} |"
                      f"{extra}", flush=True)
                if windows:
                    cont = answers(engine, windows, args.tokens)
                    long_first = long_first or cont
                    long_rows.append((variant, kv_name, label(acts), agreement(cont, long_ref),
                                      perplexity(engine, windows, [LONG_SCORED_FROM] * len(windows)),
                                      agreement(cont, long_first)[0]))
                del engine
    if long_rows:
        print(f"\nLong context: {len(windows)} windows of {LONG_WINDOW} tokens (training prompts joined), "
              f"{args.tokens} greedy tokens each against fp32's; perplexity of each window's last "
              f"{LONG_WINDOW - LONG_SCORED_FROM} tokens\n")
        print("| quantization | KV | activations (prefill, decode) | identical continuations "
              "| tokens before first divergence | perplexity |" + vs_col)
        print("|---|---|---|---:|---:|---:|" + ("---:|" if vs_first else ""))
        for variant, kv_name, acts, (same, prefix), ppl, same_first in long_rows:
            extra = f" {same_first}/{len(windows)} |" if vs_first else ""
            print(f"| {variant} | {kv_name} | {acts} | {same}/{len(windows)} | {prefix:.1%} | {ppl:.3f} |{extra}",
                  flush=True)


if __name__ == "__main__":
    main()
