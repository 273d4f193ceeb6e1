"""Rank 0 of a tensor-parallel engine, run as its own process by test_tp.py:
builds the engine as the engine process does (spawning worker ranks), runs a
fixed workload (`run_workload`, which test_tp.py runs on one rank too) and saves
its tokens, the logits of every sampled position and the number of KV blocks.
With --worker-config, rank 1 gets a config of its own (a different memory budget).

With --measure (test_sharded_loading.py), each rank's load is measured in its own process:
the peak RSS over reading its weights and building its model, above the RSS just
before (Linux's clear_refs starts a new peak), and the stored bytes it read. Rank 1
then runs here as `--rank 1 --init-method M`, what replica.model.worker does plus the
measurement, which it writes to --out as JSON before it serves."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import msgspec
import torch

from wire import protocol as P
from replica.model import tp as TP
from replica.config import EngineConfig
from replica.engine.llm_engine import LLMEngine
from replica.engine.process import build_engine
from replica.model.loader import Weights, load_model_for
from tests.replica.server import free_port


def run_workload(engine, rounds: int = 1):
    """Rounds of greedy and seeded requests with chunked prefill, one round after the
    other (finished prompts stay cached, so later rounds take fresh blocks while there
    are any); {id: [logits rows]} and tokens."""
    sp = [P.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
          P.SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)]
    logits, tokens = {}, {}
    for r in range(rounds):
        for i in range(4):
            ids = [(5 * i + 7 * r + j) % 120 + 2 for j in range(10 + 9 * i)]
            engine.add(P.Generate(id=f"r{r}-{i}", prompt_ids=ids, sampling=sp[i % 2]))
        while engine.has_work():
            res = engine.step(return_logits=True)
            out, lg = res if isinstance(res, tuple) else (res, {})  # with overlap: tokens only
            for k, v in lg.items():
                logits.setdefault(k, []).append(v.clone())
            for m in out:
                tokens.setdefault(m.id, []).extend(m.ids)
    return {"logits": {k: torch.stack(v) for k, v in logits.items()}, "tokens": tokens}


def run_spec_workload(engine) -> dict:
    """Longer greedy and seeded answers to prompts that repeat themselves (so drafts get
    accepted and their KV moves): tokens, and the draft tokens accepted in all."""
    sp = [P.SamplingParams(max_tokens=28, temperature=0, ignore_eos=True),
          P.SamplingParams(max_tokens=28, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)]
    tokens, accepted = {}, 0
    for i in range(4):
        motif = [(11 * i + 3 * j) % 120 + 2 for j in range(5 + i)]
        engine.add(P.Generate(id=f"s{i}", prompt_ids=motif * 4, sampling=sp[i % 2]))
    while engine.has_work():
        for m in engine.step():
            tokens.setdefault(m.id, []).extend(getattr(m, "ids", ()))
            usage = getattr(m, "usage", None)
            accepted += usage.accepted_draft_tokens if usage is not None else 0
    return {"tokens": tokens, "accepted": accepted}


def engine_with_worker_config(cfg: EngineConfig, worker_config: str) -> LLMEngine:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    worker = subprocess.Popen([sys.executable, "-m", "replica.model.worker", "--rank", "1", "--world", "2",
                               "--init-method", init_method, "--config", worker_config])
    model_cfg, weights = load_model_for(cfg)
    return LLMEngine(cfg, model_cfg, weights, tp=TP.init(0, 2, init_method, cfg.device), workers=[worker])


# -- measured loads --------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def new_peak() -> int:
    """Start a new peak-RSS window (writing 5 to clear_refs resets VmHWM); the RSS now, bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def peak_above(base: int) -> int:
    return _status_kib("VmHWM") * 1024 - base


def read_bytes(weights) -> int:
    """Stored bytes the rank read: what its Weights counted (every tensor, for weights held in memory)."""
    return weights.bytes_read if isinstance(weights, Weights) else sum(w.nbytes for w in weights.values())


def _warm(cfg: EngineConfig) -> None:
    """Imports and kernels before a window opens: the window sees the load alone."""
    import safetensors.torch  # noqa: F401

    from replica.model.runner import kernel_set

    kernel_set(cfg)


def measured_engine(cfg: EngineConfig, out: Path) -> tuple[LLMEngine, dict]:
    """The engine (tp 1: build_engine itself; tp 2: rank 0 as build_engine builds it, rank 1
    measured in its process) and {"peak": [per rank], "read": [per rank]}."""
    _warm(cfg)
    if cfg.tp == 1:
        base = new_peak()
        engine = build_engine(cfg)
        return engine, {"peak": [peak_above(base)], "read": [None]}
    assert cfg.tp == 2
    init_method = f"tcp://127.0.0.1:{free_port()}"
    rank1 = out.with_suffix(".rank1.json")
    worker = subprocess.Popen([sys.executable, "-m", "tests.replica.tp_job", "--rank", "1", "--init-method",
                               init_method, "--config", msgspec.json.encode(cfg).decode(), "--out", str(rank1)])
    base = new_peak()
    model_cfg, weights = load_model_for(cfg, rank=0)
    engine = LLMEngine(cfg, model_cfg, weights, tp=TP.init(0, 2, init_method, cfg.device), workers=[worker])
    mine = {"peak": peak_above(base), "read": read_bytes(weights)}
    theirs = json.loads(rank1.read_text())  # written before rank 1 joined allocate_kv, which LLMEngine waited on
    return engine, {k: [mine[k], theirs[k]] for k in mine}


def measured_rank(cfg: EngineConfig, rank: int, init_method: str, out: Path) -> None:
    """Rank `rank` as replica.model.worker runs it, its load measured and written to `out`."""
    from replica.model.runner import Runner

    _warm(cfg)
    tp = TP.init(rank, cfg.tp, init_method, cfg.device)
    base = new_peak()
    model_cfg, weights = load_model_for(cfg, rank=rank)
    runner = Runner(cfg, model_cfg, weights, tp=tp)
    out.write_text(json.dumps({"peak": peak_above(base), "read": read_bytes(weights)}))
    del weights
    runner.allocate_kv()
    runner.loop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--worker-config")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--spec-workload", action="store_true", help="run_spec_workload instead of run_workload")
    ap.add_argument("--measure", action="store_true", help="measure each rank's load (saved as 'load')")
    ap.add_argument("--rank", type=int, help="run as this worker rank, measured (with --init-method)")
    ap.add_argument("--init-method")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cfg = msgspec.json.decode(args.config, type=EngineConfig)
    if args.rank:
        measured_rank(cfg, args.rank, args.init_method, Path(args.out))
        sys.exit()
    load = None
    if args.measure:
        engine, load = measured_engine(cfg, Path(args.out))
    else:
        engine = engine_with_worker_config(cfg, args.worker_config) if args.worker_config else build_engine(cfg)
    try:
        result = run_spec_workload(engine) if args.spec_workload else run_workload(engine, args.rounds)
        torch.save(result | {"num_blocks": engine.blocks.num_blocks, "load": load}, args.out)
    finally:
        engine.close()
