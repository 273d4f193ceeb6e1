"""Tensor parallelism (Megatron-style): sharding and collectives, one process per device.

    q/k/v, gate/up     column-parallel: each rank holds 1/N of the heads / FFN rows
    o_proj, down_proj  row-parallel: partial sums, then all-reduce
    embed_tokens       vocab-parallel: each rank embeds its vocab slice, all-reduce
    lm_head            vocab-parallel: each rank's logit slice, all-gather

Step plans and the KV layout travel from rank 0 as msgspec bytes over a gloo
group (`broadcast_bytes`), so NCCL only ever carries activations. NCCL on GPUs,
gloo on CPU (tests). Who runs what: replica.model.runner (rank 0's engine calls
`Runner.execute`, the other ranks run `Runner.loop`), replica.model.worker (their
processes).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from replica.config import ModelConfig

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
_ROW = ("o_proj", "down_proj")


class TensorParallel:
    """This rank's view of the group. With world == 1 every op is the identity."""

    def __init__(self, rank: int = 0, world: int = 1, plan_group=None):
        self.rank, self.world, self.plan_group = rank, world, plan_group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(x)
        return x

    def embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: weight holds rows [rank*Vl, (rank+1)*Vl)."""
        if self.world == 1:
            return F.embedding(ids, weight)
        local = ids - self.rank * weight.shape[0]
        outside = (local < 0) | (local >= weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), weight).masked_fill(outside[:, None], 0)
        return self.all_reduce(out)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """(T, V/N) slices from every rank -> (T, V)."""
        if self.world == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.world)]
        dist.all_gather(parts, logits.contiguous())
        return torch.cat(parts, dim=-1)

    def gather_rows(self, shard: torch.Tensor) -> torch.Tensor:
        """(V/N, H) row shards from every rank -> (V, H) on every rank (a collective)."""
        if self.world == 1:
            return shard
        parts = [torch.empty_like(shard) for _ in range(self.world)]
        dist.all_gather(parts, shard.contiguous())
        return torch.cat(parts, dim=0)

    # -- step plans (rank 0 -> workers) ---------------------------------------------
    def broadcast_bytes(self, payload: bytes | None) -> bytes | None:
        """Rank 0 sends payload (None = shut down); other ranks receive it."""
        n = torch.tensor([-1 if payload is None else len(payload)], dtype=torch.int64)
        dist.broadcast(n, 0, group=self.plan_group)
        if n.item() < 0:
            return None
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.rank == 0 else \
            torch.empty(int(n.item()), dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self.plan_group)
        return payload if self.rank == 0 else buf.numpy().tobytes()

    def gather_int(self, value: int) -> list[int]:
        """Every rank's value on rank 0 (other ranks get [])."""
        mine = torch.tensor([value], dtype=torch.int64)
        parts = [torch.empty_like(mine) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(mine, parts, dst=0, group=self.plan_group)
        return [int(p) for p in parts] if self.rank == 0 else []

    def close(self) -> None:
        """Leave the group together: a barrier first, so no rank tears its connections
        down while another is still inside a collective (gloo aborts the process,
        "terminate called without an active exception", when that happens)."""
        dist.barrier(group=self.plan_group)
        dist.destroy_process_group()


def local_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The per-rank shape of the model."""
    for name, n in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads),
                    ("intermediate_size", cfg.intermediate_size), ("vocab_size", cfg.vocab_size)):
        if n % world:
            raise ValueError(f"--tp {world} must divide {name} = {n} of {cfg.name}")
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // world, num_kv_heads=cfg.num_kv_heads // world,
                               intermediate_size=cfg.intermediate_size // world, head_dim=cfg.head_dim)


def shard_range(name: str, shape: tuple[int, ...], rank: int, world: int) -> tuple[int, int, int] | None:
    """(dim, start, stop): the slice of Hugging Face-named tensor `name` (of full `shape`)
    that `rank` of `world` holds; None where every rank holds all of it (norms, o/down
    biases, world 1). What `shard` cuts from tensors in memory and what the loader reads
    from the files (replica.model.loader.Weights)."""
    parts = name.split(".")
    if any(p in _COLUMN for p in parts):
        dim = 0  # output rows (heads, FFN rows, vocab rows); a column-parallel bias too
    elif any(p in _ROW for p in parts) and name.endswith("weight"):
        dim = 1  # input columns: each rank's partial sum, all-reduced
    else:
        return None
    if world == 1:
        return None
    n = shape[dim]
    assert n % world == 0, f"{name}: dim {dim} of {shape} does not split into {world} (local_config checks this)"
    return dim, rank * n // world, (rank + 1) * n // world


def shard(weights: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """This rank's slice of Hugging Face-named weights in memory (norms are replicated)."""
    out = {}
    for name, w in weights.items():
        part = shard_range(name, tuple(w.shape), rank, world)
        out[name] = w if part is None else w.narrow(part[0], part[1], part[2] - part[1]).clone()
    return out


def init(rank: int, world: int, init_method: str, device: str) -> TensorParallel:
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init_method, world_size=world, rank=rank)
    plan_group = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    return TensorParallel(rank, world, plan_group)
