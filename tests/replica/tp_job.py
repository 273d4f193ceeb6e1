"""Rank 0 of a tensor-parallel engine, run as its own process by test_tp.py:
builds the engine as the engine process does (spawning worker ranks), runs a
fixed workload and saves its tokens, the logits of every sampled position and the
number of KV blocks. With --worker-config, rank 1 gets a config of its own (a
different memory budget)."""

import argparse
import socket
import subprocess
import sys

import msgspec
import torch

from replica import tp as TP
from replica.config import EngineConfig
from replica.engine import LLMEngine
from replica.engine_process import build_engine
from replica.loader import load_model_for
from tests.replica.test_tp import run_workload


def engine_with_worker_config(cfg: EngineConfig, worker_config: str) -> LLMEngine:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    worker = subprocess.Popen([sys.executable, "-m", "replica.worker", "--rank", "1", "--world", "2",
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
