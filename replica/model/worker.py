"""Tensor-parallel ranks 1..N-1 as processes: each builds its Runner (its shard of
the weights, read from the files alone; the KV layout rank 0 decides) and runs `Runner.loop()` until rank 0
closes. Rank 0 is the engine process (`replica.engine.process.build_engine`).

    python -m replica.model.worker --rank R --world N --init-method tcp://H:P --config JSON
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import msgspec

from replica.config import EngineConfig
from replica.lifetime import follow_parent


def spawn_workers(cfg: EngineConfig, init_method: str) -> list[subprocess.Popen]:
    """Start ranks 1..tp-1 (rank 0 is the caller)."""
    conf = msgspec.json.encode(cfg).decode()
    return [subprocess.Popen([sys.executable, "-m", "replica.model.worker", "--rank", str(r), "--world", str(cfg.tp),
                              "--init-method", init_method, "--config", conf]) for r in range(1, cfg.tp)]


def main(argv: list[str] | None = None) -> None:
    from replica.model import tp as TP
    from replica.model.loader import load_model_for
    from replica.model.runner import Runner

    follow_parent()  # rank 0 closes it
    ap = argparse.ArgumentParser(description="one worker rank of a tensor-parallel engine")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--init-method", required=True)
    ap.add_argument("--config", required=True, help="EngineConfig as JSON (this rank's: its own memory budget)")
    args = ap.parse_args(argv)
    cfg = msgspec.json.decode(args.config, type=EngineConfig)
    if cfg.device.startswith("cuda"):
        cfg.device = f"cuda:{args.rank}"
    tp = TP.init(args.rank, args.world, args.init_method, cfg.device)
    model_cfg, weights = load_model_for(cfg, rank=args.rank)  # read as this rank's shard, tensor by tensor
    runner = Runner(cfg, model_cfg, weights, tp=tp)
    del weights
    runner.allocate_kv()
    runner.loop()


if __name__ == "__main__":
    main(sys.argv[1:])
