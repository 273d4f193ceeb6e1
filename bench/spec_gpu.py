"""EAGLE-3 step times on a GPU, and the speed-up they imply with tau measured on CPU.

    python bench/spec_gpu.py [--model llama-3.1-8b] [--device cuda] [--dtype bfloat16]
                             [--context 512] [--steps 32] [--batches 1,4]

The target is a PRESETS shape (default Llama-3.1-8B) with random weights made on the
device in --dtype (an 8B model never exists in fp32), and an EAGLE-3 head of random
weights for it (speculative.head, saved to a temporary folder; each configuration is
an engine pointed at it with a one-rule policy, as bench/speculative.py's Engines).
Per batch size, through the engine as served (continuous batching, `step()`):
  * the plain decode step: speculative="off", CUDA graphs (graph_mode="auto"),
    overlap as on CUDA by default. With overlap a step() returns once the previous
    step's tokens are back, so the time between returns is the device's step;
  * one speculating step (draft + verify + accept) for chain 3, chain 5, tree 16
    (depth 5, top-k 4) and tree 32 (depth 6, top-k 6). Such a step reads its tokens
    back (drafting needs them) and is followed by a synchronize before the clock
    stops (the accepted drafts' KV moves are still queued then). On CUDA its verify
    and its draft loop and commit replay graphs (replica.model.spec_graphs,
    spec_draft_graphs); a line per configuration says what replayed.
Each time is the median over --steps steps after --warmup steps (Triton compiles,
graph buckets). Random weights accept almost nothing: the step is timed, not the
acceptance. The implied speed-up is tau x t_plain / t_spec with tau measured on CPU
for SmolLM2-135M's trained head (TAU_CPU, docs/perf.md), not on this target.

Dry run on CPU (figures mean nothing):
    python bench/spec_gpu.py --model smollm2-135m --device cpu --dtype float32 --steps 3 --context 32
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels  # noqa: E402
from wire import protocol as P  # noqa: E402
from replica.config import EngineConfig  # noqa: E402
from replica.engine.llm_engine import LLMEngine  # noqa: E402
from replica.model.loader import PRESETS, random_weights  # noqa: E402
from replica.model.runner import build_model  # noqa: E402
from speculative.tree_spec import TreeSpec  # noqa: E402
from speculative.head import Eagle3Head, HeadConfig, save_head  # noqa: E402
from speculative.policy import SpecPolicy  # noqa: E402

SPECS = {"chain 3": TreeSpec.chain(3), "chain 5": TreeSpec.chain(5),
         "tree 16": TreeSpec(depth=5, top_k=4, budget=16), "tree 32": TreeSpec(depth=6, top_k=6, budget=32)}
# Greedy tau of SmolLM2-135M's trained head on the held-out prompts, measured on CPU
# (bench/speculative.py; docs/perf.md): tokens per decoding sequence per target forward.
TAU_CPU = {"chain 3": 1.59, "chain 5": 1.62, "tree 16": 2.09, "tree 32": 2.26}
BLOCK = 16


def log(msg: str) -> None:
    print(msg, flush=True)


def sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize(dev)


def release(dev: str) -> str:
    """After an engine is dropped: its KV pool, graphs and head back to the device."""
    gc.collect()
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
        return f"{torch.cuda.memory_allocated(dev) / 2**30:.2f} GiB allocated"
    return ""


def make_head(model, dev: str, dtype: torch.dtype, draft_vocab: int, folder: Path, seed: int) -> Path:
    """A random EAGLE-3 head for the target, built on the device (no fp32 copy on the host), saved."""
    torch.manual_seed(seed)
    cfg = HeadConfig.for_target(model.cfg, draft_vocab)
    with torch.device(dev):
        head = Eagle3Head(cfg, model.embed_tokens.weight).to(dtype)
    path = save_head(head, folder / "head")
    del head
    return path


def engine_for(model, ops, model_cfg, args, head: Path, policies: Path, spec: TreeSpec | None, batch: int,
               max_tokens: int) -> LLMEngine:
    """An engine for `batch` sequences drafting `spec` at every batch size (None: plain decoding)."""
    kw = dict(speculative="off")
    draft = lookahead = 0
    if spec is not None:
        folder = policies / f"{spec.depth}-{spec.top_k}-{spec.budget}"
        folder.mkdir(exist_ok=True)
        SpecPolicy(((1, spec),), torch.device(args.device).type).save(folder)
        kw = dict(speculative="eagle3", spec_head=str(head), spec_policy=str(folder), spec_top_k=spec.top_k)
        draft, lookahead = spec.budget, spec.lookahead
    blocks = batch * (-(-(args.context + max_tokens + lookahead + 1) // BLOCK) + 1)
    cfg = EngineConfig(device=args.device, dtype=args.dtype, block_size=BLOCK, num_blocks=blocks,
                       max_num_seqs=batch, max_model_len=args.max_len, graph_mode="auto",
                       max_num_batched_tokens=max(512, batch * (1 + draft)), **kw)
    engine = LLMEngine(cfg, model_cfg, model=model, ops=ops)
    if engine.speculator is not None:  # speculative.loading.load_head builds the head on the target's device
        assert engine.speculator.head.fc.weight.device == model.embed_tokens.weight.device, "head off the target's device"
    return engine


def host_syncs(engine: LLMEngine, dev: str) -> int | None:
    """Synchronizing CUDA calls the host makes in one step() (torch.cuda.set_sync_debug_mode
    warns at each: .item(), .tolist(), a blocking copy to the host, ...); None off CUDA."""
    if not dev.startswith("cuda"):
        return None
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def time_steps(engine: LLMEngine, batch: int, args, max_tokens: int, speculating: bool) -> dict:
    """Median seconds per step() once every sequence decodes, and what those steps did."""
    sp = P.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    V = engine.model_cfg.vocab_size
    for i in range(batch):
        ids = torch.randint(10, V, (args.context,), generator=g).tolist()
        assert engine.add(P.Generate(id=f"b{batch}-{i}", prompt_ids=ids, sampling=sp)) is None
    while not all(s.first_token_time for s in engine.seqs.values()):
        engine.step()  # prefill chunks, until every sequence has its first token
    for _ in range(args.warmup):
        engine.step()
    sync(args.device)
    st0 = dataclasses.replace(engine.stats)
    emitted, times = 0, []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        out = engine.step()
        if speculating:
            sync(args.device)
        times.append(time.perf_counter() - t0)
        emitted += sum(len(m.ids) for m in out)
    sync(args.device)
    syncs = host_syncs(engine, args.device)  # one more step, counted
    sync(args.device)
    assert len(engine.seqs) == batch, "a sequence finished while timed: raise max_tokens"
    st, graphs = engine.stats, engine.runner.graphs
    how = ("CUDA graphs" if graphs is not None and graphs.graphs else "eager") + (" + overlap" if engine.overlap else "")
    return dict(t=statistics.median(times), tokens_per_step=emitted / args.steps / batch, how=how,
                drafted=st.drafted - st0.drafted, accepted=st.accepted - st0.accepted, steps=st.steps - st0.steps,
                syncs=syncs, spec_graphs=spec_graphs(engine) if speculating else "")


def spec_graphs(engine: LLMEngine) -> str:
    """What a speculating step replayed: the verify's graphs (replica.model.spec_graphs, captured
    at the engine's start for every bucket) and the draft loop's and commit's
    (replica.model.spec_draft_graphs, captured at first use); 'eager' where none was captured."""
    verify, drafter = engine.runner.verify_graphs, engine.speculator.drafter
    n_verify = len(verify.graphs) if verify is not None else 0
    n_draft = len(drafter.graphs.graphs) if drafter.graphs is not None else 0
    if not n_verify and not n_draft:
        return "verify and draft loop eager"
    return f"verify replayed ({n_verify} graphs captured), draft loop and commit replayed ({n_draft} captured)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(PRESETS), help="target shape (PRESETS)")
    ap.add_argument("--layers", type=int, default=0, help="override the preset's layer count (quick runs; >= 3)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    ap.add_argument("--steps", type=int, default=32, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps first (compiles, graph buckets)")
    ap.add_argument("--batches", default="1,4,16", help="comma-separated batch sizes")
    ap.add_argument("--specs", default="chain 3,tree 16,tree 32",
                    help="comma-separated subset of: " + ", ".join(SPECS))
    ap.add_argument("--draft-vocab", type=int, default=32000, help="the head's draft vocabulary (EAGLE-3's for Llama 3)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t_start = time.perf_counter()
    dev, dtype = args.device, getattr(torch, args.dtype)
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    labels = [s.strip() for s in args.specs.split(",") if s.strip()]
    unknown = [s for s in labels if s not in SPECS]
    if unknown:
        ap.error(f"unknown --specs {unknown}; choose from {list(SPECS)}")
    cfg = PRESETS[args.model]
    if args.layers:
        if args.layers < 3:
            ap.error("--layers: an EAGLE-3 head reads three distinct target layers")
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    # Every step stays in its sequence's first max_tokens; a speculating step emits at most depth + 1.
    max_tokens = (args.warmup + args.steps + 5) * (max(SPECS[s].depth for s in labels) + 1 if labels else 1)
    args.max_len = args.context + max_tokens + max((SPECS[s].lookahead for s in labels), default=0) + BLOCK
    gpu = torch.cuda.get_device_name(dev) if dev.startswith("cuda") else f"CPU ({torch.get_num_threads()} threads)"

    log(f"# EAGLE-3 step times: {cfg.name} ({cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab "
        f"{cfg.vocab_size}), random {args.dtype} weights, on {gpu}; context {args.context} tokens, median of "
        f"{args.steps} steps after {args.warmup}")
    t0 = time.perf_counter()
    ops = kernels.ops(torch.device(dev).type)
    # graph_mode "off" here: the plain LlamaModel (on CPU, "auto" would build the C++ step); engines decide graphs.
    model = build_model(cfg, EngineConfig(device=dev, dtype=args.dtype, graph_mode="off"),
                        random_weights(cfg, dtype=dtype, seed=args.seed, device=dev), ops, args.max_len)
    sync(dev)
    mem = release(dev)
    log(f"target built in {time.perf_counter() - t0:.1f} s" + (f" ({mem})" if mem else ""))
    tmp = Path(tempfile.mkdtemp(prefix="spec-gpu-"))
    t0 = time.perf_counter()
    head = make_head(model, dev, dtype, args.draft_vocab, tmp, args.seed)
    log(f"random head (draft vocabulary {min(args.draft_vocab, cfg.vocab_size)}) saved to {head} in "
        f"{time.perf_counter() - t0:.1f} s")
    policies = tmp / "policies"
    policies.mkdir()

    results: dict[tuple[str, int], dict] = {}
    for b in batches:
        for label in ["plain"] + labels:
            spec = SPECS.get(label)
            t0 = time.perf_counter()
            engine = engine_for(model, ops, cfg, args, head, policies, spec, b, max_tokens)
            built = time.perf_counter() - t0
            try:
                r = time_steps(engine, b, args, max_tokens, spec is not None)
            finally:
                engine.close()
                del engine
                freed = release(dev)
            if spec is not None and r["drafted"] != r["steps"] * b * spec.budget:
                log(f"  warning: {label} at batch {b} drafted {r['drafted']} tokens in {r['steps']} steps, "
                    f"not {b * spec.budget} a step: some steps did not speculate")
            results[label, b] = r
            log(f"batch {b} {label}: {r['t'] * 1e3:.2f} ms/step, {r['tokens_per_step']:.2f} tokens/sequence/step, "
                f"accepted {r['accepted']}/{r['drafted']} (engine built in {built:.1f} s; {freed or 'freed'})")
            log(f"host syncs per step: {label} at batch {b}: {'n/a' if r['syncs'] is None else r['syncs']}")
            if r["spec_graphs"]:
                log(f"  {label} at batch {b}: {r['spec_graphs']}")

    log(f"\nimplied speed-up = tau x t_plain / t_spec (tau measured on CPU for SmolLM2-135M, step times measured "
        f"on {gpu}); {cfg.name} ({cfg.num_layers} layers), {args.dtype}, context {args.context}\n")
    head_row = "| step | draft tokens | tau (CPU) | " + " | ".join(f"batch {b}: ms/step | batch {b}: implied"
                                                                for b in batches) + " |"
    log(head_row)
    log("|---|---:|---:|" + "---:|---:|" * len(batches))
    cells = [f"{results['plain', b]['t'] * 1e3:.2f} | 1.00x" for b in batches]
    log(f"| plain decode ({results['plain', batches[0]]['how']}) | 0 | 1 | " + " | ".join(cells) + " |")
    for label in labels:
        cells = []
        for b in batches:
            t_spec, t_plain = results[label, b]["t"], results["plain", b]["t"]
            cells.append(f"{t_spec * 1e3:.2f} | {TAU_CPU[label] * t_plain / t_spec:.2f}x")
        log(f"| {label} | {SPECS[label].budget} | {TAU_CPU[label]:.2f} | " + " | ".join(cells) + " |")
    log(f"\n({time.perf_counter() - t_start:.0f} s in all)")


if __name__ == "__main__":
    main()
