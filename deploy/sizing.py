"""Host memory of a GPU replica pod, from its model's config.json (docs/deploy.md, "Sizing").

    python deploy/sizing.py deploy/k8s/models/meta-llama/Llama-3.1-70B-Instruct --tp 8
    python deploy/sizing.py /models/meta-llama/Llama-3.1-8B-Instruct --tp 2 --shm 8Gi

A replica pod runs one API process and `--tp` engine ranks (one process per GPU). Each rank
reads only its shard of the checkpoint (sharded loading) into host memory on its way to its
GPU, so at the peak, all ranks loading at once:

    limit >= W + tp * R + A + M
    W = weights in the served dtype (parameters from config.json x 2 bytes for bfloat16):
        tp shards of W / tp each
    R = fixed per rank: Python, torch and its CUDA libraries, the CUDA context, NCCL, Triton
    A = the API process: tokenizer, HTTP/WebSocket server, request buffers
    M = the /dev/shm emptyDir's sizeLimit (tmpfs pages count against the pod's memory)

The checkpoint's file pages (safetensors are mmapped) are page cache: charged to the pod but
reclaimed under its limit, not a reason to be killed, so they are not in the sum. KV blocks
live on the GPUs. The same module says whether `--tp` divides the model (the rule of
replica.model.tp.local_config, which stops a replica whose model it does not divide).
Torch-free: it reads config.json with replica.hf_checkpoint.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
RANK_OVERHEAD = 3 * GIB  # R: an estimate (no GPU measured it yet); a CPU engine process is 0.6 GiB
API_PROCESS = 1 * GIB  # A: 84 MB measured with the default model; room for a 128k vocabulary
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "K": 10**3, "M": 10**6, "G": 10**9,
          "T": 10**12}


def quantity(q: str | int) -> int:
    """A Kubernetes memory quantity ("32Gi", "500M", 1024) in bytes."""
    m = re.fullmatch(r"(\d+)([KMGT]i?)?", str(q))
    if m is None:
        raise ValueError(f"{q!r} is not a memory quantity this reads (digits, then Ki/Mi/Gi/Ti or K/M/G/T)")
    return int(m.group(1)) * _UNITS.get(m.group(2) or "", 1)


def parameters(cfg) -> int:
    """Parameters of a Llama-family model (replica.config.ModelConfig): embeddings, LM head unless
    tied, per layer q/k/v/o (+ biases), the gated FFN's three matrices, two norms; the final norm."""
    H, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    layer = H * q + 2 * H * kv + q * H + 3 * H * cfg.intermediate_size + 2 * H
    if cfg.attention_bias:
        layer += q + 2 * kv
    return cfg.vocab_size * H * (1 if cfg.tie_word_embeddings else 2) + cfg.num_layers * layer + H


def tp_problems(cfg, tp: int) -> list[str]:
    """What `--tp` does not divide (empty: it splits evenly), as replica.model.tp.local_config says it."""
    return [f"--tp {tp} must divide {name} = {n} of {cfg.name}"
            for name, n in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads),
                            ("intermediate_size", cfg.intermediate_size), ("vocab_size", cfg.vocab_size)) if n % tp]


@dataclass(frozen=True)
class Sizing:
    weights: int  # W
    tp: int
    shm: int  # M
    rank: int = RANK_OVERHEAD  # R
    api: int = API_PROCESS  # A

    @property
    def shard(self) -> int:
        return math.ceil(self.weights / self.tp)

    @property
    def limit(self) -> int:
        """The least memory limit: W + tp * R + A + M, in bytes."""
        return self.weights + self.tp * self.rank + self.api + self.shm

    def describe(self) -> str:
        g = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
        return (f"weights {g(self.weights)} ({self.tp} shards of {g(self.shard)}) + {self.tp} ranks x {g(self.rank)}"
                f" + API process {g(self.api)} + /dev/shm {g(self.shm)} = {g(self.limit)}: "
                f"limits.memory >= {math.ceil(self.limit / GIB)}Gi")


def sizing(cfg, tp: int, dtype: str = "bfloat16", shm: int = 8 * GIB) -> Sizing:
    return Sizing(weights=parameters(cfg) * DTYPE_BYTES[dtype], tp=tp, shm=shm)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="deploy/sizing.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a Hugging Face model folder (its config.json is read)")
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    ap.add_argument("--shm", default="8Gi", help="the /dev/shm emptyDir's sizeLimit (default: the base's 8Gi)")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's packages
    from replica.hf_checkpoint import config_from_hf

    cfg = config_from_hf(a.model)
    problems = tp_problems(cfg, a.tp)
    for p in problems:
        print(p, file=sys.stderr)
    print(f"{cfg.name} at --tp {a.tp}: {sizing(cfg, a.tp, a.dtype, quantity(a.shm)).describe()}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
