"""Rank 0 of a tensor-parallel engine, run as its own process by test_tp.py:
builds the engine exactly as the engine process does (spawning worker ranks),
runs a fixed workload and saves the logits of every sampled position."""

import argparse

import msgspec
import torch

from replica.config import EngineConfig
from replica.engine_process import build_engine
from tests.replica.test_tp import run_workload

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    engine = build_engine(msgspec.json.decode(args.config, type=EngineConfig))
    try:
        torch.save(run_workload(engine), args.out)
    finally:
        engine.close()
