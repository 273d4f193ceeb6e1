"""Where a speculative round's time goes at batch 1 on the engine that serves (issue 27).

    python bench/draft_round.py --head DIR [--limit 4] [--new-tokens 48] [--rounds 2]

Per configuration (plain decoding, chain 3, tree 16, each speculating one with the head
as one C++ call per step (kernels/cpu_draft.py; "1-thread head": its pool without a
helper) and op by op in PyTorch ("torch head")),
the same held-out prompts one after another, greedy: decode tokens/s, and per speculative
round the mean time of the draft (the head's commit, its steps -- of which the PyTorch
head's logits --, the rest: log-softmax, top-k, tree bookkeeping) and of the target's verify
forward (by part: the C++ forward, the LM head, the sampler), in ms; plain decoding's
steps by the same parts. Configurations alternate for --rounds rounds so a busy
machine's drift falls on all of them; the figures are means over the rounds.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import kernels  # noqa: E402
from kernels import cpu_draft  # noqa: E402
from bench.speculative import Engines  # noqa: E402
from replica.__main__ import default_quantization  # noqa: E402
from replica.config import EngineConfig  # noqa: E402
from replica.engine.offline import generate  # noqa: E402
from replica.model.loader import load_checkpoint, prepare_process  # noqa: E402
from replica.model.runner import build_model  # noqa: E402
from speculative.train import load_prompts  # noqa: E402
from speculative.tree_spec import TreeSpec  # noqa: E402
from wire.protocol import SamplingParams  # noqa: E402

SPECS = {"no speculation": None, "chain 3": TreeSpec.chain(3), "tree 16": TreeSpec(depth=5, top_k=4, budget=16)}
SPECS |= {f"{k} ({how})": v for k, v in SPECS.items() if v is not None for how in ("torch head", "1-thread head")}


class Current:
    """The accumulator of the engine whose step runs: the engines share one target model, whose
    methods are timed once (`acc=None` below) and charged to it."""

    acc: dict = defaultdict(float)


def timed(obj, name: str, acc: dict | None, key: str) -> None:
    """Wrap obj.name so each call adds its wall time to acc[key] (None: Current.acc) and counts it."""
    f = getattr(obj, name)

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        r = f(*a, **kw)
        into = Current.acc if acc is None else acc
        into[key] += time.perf_counter() - t0
        into[key + " #"] += 1
        return r

    setattr(obj, name, wrapper)


def instrument(engine, acc: dict) -> None:
    """Time a speculative round by part; for every engine, the target step (Runner.execute, into
    which the shared model's C++ forward and LM head are charged) and its sampler."""
    r = engine.runner
    timed(r, "execute", acc, "target forward")
    execute = r.execute

    def charged(*a, **kw):  # the shared model's time goes to this engine
        Current.acc = acc
        return execute(*a, **kw)

    r.execute = charged
    timed(r, "sampler", acc, "  its sampler")
    spec = engine.speculator
    if spec is None:
        return
    timed(engine, "_step_speculative", acc, "round")
    timed(spec, "draft", acc, "draft")
    d = spec.drafter
    for name in ("_commit", "_step"):
        if hasattr(d, name):
            timed(d, name, acc, f"head {name[1:]}")
    timed(d, "_rerank", acc, "rerank")
    timed(d.head, "logits", acc, "head logits (torch)")  # inside the PyTorch head's commit and steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", required=True)
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--specs", default="no speculation,chain 3,tree 16,chain 3 (torch head),tree 16 (torch head)")
    args = ap.parse_args()

    ck = load_checkpoint("default")
    prepare_process(EngineConfig(device="cpu"))  # torch's threads as a replica's engine process sets them
    ops = kernels.ops("cpu")
    quant = default_quantization("default", "cpu", 1, False)
    model = build_model(ck.config, EngineConfig(device="cpu", dtype="float32", quantization=quant), ck.weights, ops,
                        2048)
    prompts = [ck.tokenizer.encode_chat([{"role": "user", "content": p}])
               for p in load_prompts("heldout")[: args.limit]]
    engines = Engines(ck, model, ops, Path(args.head), "cpu", "float32", args.new_tokens)
    greedy = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    labels = [s.strip() for s in args.specs.split(",")]
    built = {}
    for label in labels:
        e = built[label] = engines(SPECS[label], 1, max(map(len, prompts)))
        d = e.speculator.drafter if e.speculator is not None else None
        if label.endswith("(torch head)"):
            d.cpp = None  # the reference: the head op by op
        elif label.endswith("(1-thread head)"):
            d.cpp = cpu_draft.DraftStep(d.head, d.cos_sin, 1)  # no helper thread beside the target step's
        generate(e, prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    rates, accs, outs = defaultdict(list), {lab: defaultdict(float) for lab in labels}, {}
    timed(model, "forward", None, "  its C++ forward")  # the engines' shared target model, once
    timed(model, "compute_logits", None, "  its LM head")
    for lab in labels:
        instrument(built[lab], accs[lab])
    print(f"# {ck.config.name}, {quant}, CPU {torch.get_num_threads()} threads; head {args.head}; "
          f"{len(prompts)} held-out prompts one at a time, {args.new_tokens} new tokens, greedy")
    for r in range(args.rounds):
        for lab in labels:
            made = secs = 0.0
            gens = []
            for p in prompts:
                g = generate(built[lab], [p], greedy)
                made, secs = made + g.decode_tokens, secs + g.decode_s
                gens.append(g.outputs[0])
            rates[lab].append(made / secs)
            if lab in outs:
                assert outs[lab] == gens, f"{lab}: output changed between rounds"
            outs[lab] = gens
    ref = outs.get("no speculation")
    print("\n| batch 1 | decode tokens/s per round | mean | output = plain |")
    print("|---|---|---:|---|")
    for lab in labels:
        same = "" if ref is None else "yes" if outs[lab] == ref else "NO"
        print(f"| {lab} | {', '.join(f'{x:.1f}' for x in rates[lab])} | {sum(rates[lab]) / len(rates[lab]):.1f} "
              f"| {same} |")
    for lab in labels:
        acc = accs[lab]
        if SPECS[lab] is None:  # plain decoding: its steps by part
            n = acc["target forward #"]
            print(f"\n{lab}: {int(n)} steps; ms per step (calls per step)")
        else:
            n = acc["round #"]
            print(f"\n{lab}: {int(n)} speculative rounds; ms per round (calls per round)")
            acc["rest of draft"] = acc["draft"] - acc["head commit"] - acc["head step"] - acc["rerank"]
            acc["rest of draft #"] = n
        for key in ("round", "draft", "head commit", "head step", "head logits (torch)", "rerank", "rest of draft",
                    "target forward", "  its C++ forward", "  its LM head", "  its sampler"):
            if acc.get(key + " #"):
                print(f"  {key:22s} {1e3 * acc[key] / n:7.2f}  ({acc[key + ' #'] / n:.1f})")


if __name__ == "__main__":
    main()
