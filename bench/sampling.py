"""What issue 12's sampling parameters cost the engine, and what n > 1 saves.

    .venv/bin/python bench/sampling.py                # both tables, default model
    .venv/bin/python bench/sampling.py --batch 8 --steps 24
    .venv/bin/python bench/sampling.py --sampler-only        # the sampler alone (table 0)

Table 0: the sampler alone at T > 0 over the default model's own logits (one
forward over a held-out prompt and the start of an answer, its rows repeated to the
batch): `kernels.sampling.sample_ref` as the engine calls it, against the definition
it must equal (Gumbel noise hashed for every vocabulary entry), one thread, the
best of 5, and whether the tokens are identical.

Table 1: decode ms per step of the default model at one batch size, every request
plain versus every request asking for one parameter (penalties, logit_bias, min_p,
logprobs), side by side in one run (interleaved rounds, the best of each), and the
overhead over plain.
Table 2: n samples of one prompt as one request (`fork_of`: the prompt computed once,
replica.engine.forks) versus n independent requests (the same prompt n times, arriving
together: the prefix cache helps only those scheduled after the first prefills
finished): prompt tokens the engine computed, and the time until every sample has
its first token.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import decode_steps  # noqa: E402  (bench/engine.py: this script's folder is on sys.path)
from bench.quality import forward_logits  # noqa: E402
from replica.config import EngineConfig  # noqa: E402
from replica.engine.llm_engine import LLMEngine  # noqa: E402
from replica.model.loader import load_checkpoint  # noqa: E402
from wire import protocol as P  # noqa: E402

PARAMS = {
    "plain": {},
    "repetition_penalty": dict(repetition_penalty=1.2),
    "frequency+presence": dict(frequency_penalty=0.5, presence_penalty=0.5),
    "logit_bias (8 tokens)": dict(logit_bias={t: 2.0 for t in range(100, 108)}),
    "min_p": dict(min_p=0.05),
    "logprobs (top 5)": dict(logprobs=5),
    "all of them": dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5, min_p=0.05,
                        logit_bias={t: 2.0 for t in range(100, 108)}, logprobs=5),
}


def engine(ckpt) -> LLMEngine:
    cfg = EngineConfig(num_blocks=1024, max_num_seqs=64, max_num_batched_tokens=2048, speculative="off")
    return LLMEngine(cfg, ckpt.config, ckpt.weights)


def decode_ms(eng: LLMEngine, batch: int, prompt_len: int, steps: int, params: dict) -> float:
    return statistics.median(decode_steps(eng, batch, prompt_len, steps, 0.8, **params)) * 1e3


def first_tokens(eng: LLMEngine, n: int, prompt_len: int, fork: bool) -> tuple[int, float]:
    """(prompt tokens computed, seconds until all n samples have a token)."""
    ids = [(11 * j) % 40000 + 100 for j in range(prompt_len)] + [int(time.time() * 1e6) % 40000]  # unseen prompt
    computed, started = 0, set()
    schedule = eng.scheduler.schedule

    def counting():
        nonlocal computed
        batch = schedule()
        computed += sum(k for s, k in zip(batch.seqs, batch.num_tokens) if s.num_computed < s.num_prompt_tokens)
        return batch
    eng.scheduler.schedule = counting
    t = time.perf_counter()
    for i in range(n):
        sp = P.SamplingParams(max_tokens=4, temperature=1.0, seed=P.sample_seed(5, i), ignore_eos=True)
        eng.add(P.Generate(id=f"f{i}", prompt_ids=ids, sampling=sp, fork_of="f0" if fork and i else ""))
    while len(started) < n:
        started.update(m.id for m in eng.step())
    elapsed = time.perf_counter() - t
    eng.scheduler.schedule = schedule
    for rid in list(eng.seqs):
        eng.abort(rid)
    return computed, elapsed


def sampler_table(ckpt) -> None:
    from kernels.sampling import sample_ref, uniforms_ref

    prompt = ckpt.tokenizer.encode_chat([{"role": "user", "content": "Explain how a rocket reaches orbit."}])
    ids = prompt + ckpt.tokenizer.encode("A rocket reaches orbit by burning fuel to push", add_special_tokens=False)
    logits = forward_logits(engine(ckpt), ids, slice(-8, None))  # the rows of a real answer's first tokens
    torch.set_num_threads(1)
    print("| batch | temperature | every token hashed, ms | kernels.sampling, ms | speed-up | same tokens |")
    print("|---:|---:|---:|---:|---:|---|")
    for b in (16, 192):
        x = logits.repeat(-(-b // len(logits)), 1)[:b].contiguous()
        for t in (0.7, 1.0):
            temp, seeds, pos = torch.full((b,), t), torch.arange(b), torch.arange(b) + len(ids)
            top_k, top_p = torch.zeros(b, dtype=torch.int32), torch.ones(b)

            def full():
                u = uniforms_ref(seeds, pos, torch.arange(x.shape[1]))
                return (x / temp[:, None] - torch.log(-torch.log(u))).argmax(-1)

            def ours():
                return sample_ref(x, temp, top_k, top_p, seeds, pos)

            ms = {}
            for name, f in (("full", full), ("ours", ours)):
                ms[name] = min(timed(f) for _ in range(5))
            print(f"| {b} | {t} | {ms['full']:.1f} | {ms['ours']:.1f} | {ms['full'] / ms['ours']:.1f}x | "
                  f"{torch.equal(full(), ours())} |")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))


def timed(f) -> float:
    t = time.perf_counter()
    f()
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--fork-prompt", type=int, default=1000)
    ap.add_argument("--sampler-only", action="store_true", help="only table 0: the sampler alone")
    args = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    ckpt = load_checkpoint("default")
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; default model on CPU, float32\n")
    sampler_table(ckpt)
    if args.sampler_only:
        return
    eng = engine(ckpt)
    decode_ms(eng, args.batch, args.prompt, 4, {})  # warm-up
    best = {name: float("inf") for name in PARAMS}
    for _ in range(args.rounds):  # interleaved, best of the rounds: others' load hits every row alike
        for name, params in PARAMS.items():
            best[name] = min(best[name], decode_ms(eng, args.batch, args.prompt, args.steps, params))
    print(f"| every request asks for (batch {args.batch}) | decode ms/step (best of {args.rounds}) | "
          "overhead vs plain |")
    print("|---|---:|---:|")
    for name, ms in best.items():
        print(f"| {name} | {ms:.1f} | {100 * (ms / best['plain'] - 1):+.1f} % |")
    print(f"\n| {args.n} samples of a {args.fork_prompt}-token prompt | prompt tokens computed | "
          "s until every sample has a token |")
    print("|---|---:|---:|")
    for label, fork in (("one request, n samples (fork after prefill)", True), ("n independent requests", False)):
        computed, s = first_tokens(engine(ckpt), args.n, args.fork_prompt, fork)
        print(f"| {label} | {computed} | {s:.2f} |")


if __name__ == "__main__":
    main()
