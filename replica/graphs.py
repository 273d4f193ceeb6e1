"""Decode steps replayed from CUDA graphs, one per batch-size bucket.

A decode step's shapes depend only on the batch size, so each bucket in a fixed
list is captured once at start-up (largest first, all in one memory pool) over
persistent input/output buffers. A step copies its metadata into the buffers,
padded up to the next bucket, and replays: one launch instead of hundreds.

Padding rows are inert: slot -1 writes no KV and seq_len 0 attends to nothing
(the decode kernel returns zeros for them); their logits are never read.

With the runner's `aux_layers` (an EAGLE-3 head drafts from the residual streams
after those layers), the graphs also write those features, (b, 3h), so plain
decode steps of a speculating engine replay too: the head sees every token the
target computes.

With graph_mode="buffers" the same padded-buffer path runs eagerly, which is how
the padding logic is tested without a GPU. On CPU the analogue of a replayed
graph is the model itself: replica/cpu_model.py runs any step (no padding, no
buckets) as one C++ call.
"""

from __future__ import annotations

import sys
import time

import torch

from replica.model import Context


def resolve_placeholders(ids: torch.Tensor, prev_tokens: torch.Tensor | None) -> torch.Tensor:
    """Overlap scheduling: input id -(j + 1) stands for prev_tokens[j], a token the
    previous step sampled that the host has not seen yet; resolve it on the device."""
    if prev_tokens is None or prev_tokens.numel() == 0:
        return ids
    return torch.where(ids >= 0, ids, prev_tokens[(-ids - 1).clamp(0, prev_tokens.numel() - 1)])


def default_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (what nano-vllm / vLLM do)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    def __init__(self, runner, max_num_seqs: int, max_model_len: int, capture: bool):
        self.runner = runner
        self.aux_layers = runner.aux_layers
        self.buckets = default_buckets(max_num_seqs)
        dev, n = runner.device, self.buckets[-1]
        self.max_blocks = -(-max_model_len // runner.block_size)
        # Persistent buffers: graphs read and write these exact tensors.
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}  # logits (b, V) [, aux (b, 3h)] per bucket
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.capture_bytes = 0
        if capture:
            self._capture_all()

    def bucket_for(self, batch: int) -> int | None:
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def _forward(self, b: int) -> tuple[torch.Tensor, ...]:
        ctx = Context(slot_mapping=self.slots[:b], num_decode_tokens=b, decode_block_tables=self.block_tables[:b],
                      decode_seq_lens=self.seq_lens[:b], extend_block_tables=None, extend_cu_seqlens_q=None,
                      extend_seq_lens=None)
        model = self.runner.model
        if not self.aux_layers:
            hidden = model(self.input_ids[:b], self.positions[:b], ctx, self.runner.kv_cache)
            return (model.compute_logits(hidden).float(),)
        hidden, aux = model(self.input_ids[:b], self.positions[:b], ctx, self.runner.kv_cache, self.aux_layers)
        return model.compute_logits(hidden).float(), torch.cat(aux, -1)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        free_before = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        for i, b in enumerate(reversed(self.buckets)):  # largest first: later graphs reuse its pool
            self._forward(b)  # warm-up: autotuning and lazy init must not happen inside capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.outputs[b] = self._forward(b)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[b] = g
            print(f"\rcapturing CUDA graphs: {i + 1}/{len(self.buckets)} (batch {b})", end="", file=sys.stderr,
                  flush=True)
        torch.cuda.synchronize()
        self.capture_bytes = free_before - torch.cuda.mem_get_info()[0]
        print(f"\rcaptured {len(self.buckets)} CUDA graphs in {time.perf_counter() - t0:.1f}s, "
              f"{self.capture_bytes / 2**20:.0f} MiB", file=sys.stderr, flush=True)

    @torch.inference_mode()
    def run(self, plan, prev_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits (B, V), aux (B, 3h) or None without aux_layers) of a pure-decode
        plan with B <= the largest bucket."""
        n = len(plan.starts)
        b = self.bucket_for(n)
        bs = self.runner.block_size
        starts = plan.starts
        table = [t + [0] * (self.max_blocks - len(t)) for t in plan.block_tables] + \
            [[0] * self.max_blocks] * (b - n)
        host = torch.tensor([plan.input_ids + [0] * (b - n),
                             starts + [0] * (b - n),
                             [t[p // bs] * bs + p % bs for t, p in zip(plan.block_tables, starts)] + [-1] * (b - n),
                             [p + 1 for p in starts] + [0] * (b - n)], dtype=torch.int64)
        dev = self.runner.device
        self.input_ids[:b].copy_(resolve_placeholders(host[0].to(dev, non_blocking=True), prev_tokens))
        self.positions[:b].copy_(host[1].to(dev, non_blocking=True))
        self.slots[:b].copy_(host[2].to(dev, non_blocking=True))
        self.seq_lens[:b].copy_(host[3].to(dev, non_blocking=True))
        self.block_tables[:b].copy_(torch.tensor(table, dtype=torch.int32).to(dev, non_blocking=True))
        if b in self.graphs:
            self.graphs[b].replay()
            out = self.outputs[b]
        else:
            out = self._forward(b)
        return out[0][:n], (out[1][:n] if len(out) > 1 else None)
