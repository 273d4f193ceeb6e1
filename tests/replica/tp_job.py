"""Rank 0 of a tensor-parallel engine, run as its own process by test_tp.py:
builds the engine as the engine process does (spawning worker ranks), runs a
fixed workload (`run_workload`, which test_tp.py runs on one rank too) and saves
its tokens, the logits of every sampled position and the number of KV blocks.
With --worker-config, rank 1 gets a config of its own (a different memory budget)."""

import argparse
import subprocess
import sys

import msgspec
import torch

from wire import protocol as P
from replica.model import tp as TP
from replica.config import EngineConfig
from replica.engine.llm_engine import LLMEngine
from replica.engine.process import build_engine
from replica.model.loader import load_model_for
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


def engine_with_worker_config(cfg: EngineConfig, worker_config: str) -> LLMEngine:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    worker = subprocess.Popen([sys.executable, "-m", "replica.model.worker", "--rank", "1", "--world", "2",
                               "--init-method", init_method, "--config", worker_config])
    model_cfg, weights = load_model_for(cfg)
    return LLMEngine(cfg, model_cfg, weights, tp=TP.init(0, 2, init_method, cfg.device), workers=[worker])


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--worker-config")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cfg = msgspec.json.decode(args.config, type=EngineConfig)
    engine = engine_with_worker_config(cfg, args.worker_config) if args.worker_config else build_engine(cfg)
    try:
        torch.save(run_workload(engine, args.rounds) | {"num_blocks": engine.blocks.num_blocks}, args.out)
    finally:
        engine.close()
