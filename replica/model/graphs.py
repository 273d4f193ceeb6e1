"""Decode steps replayed from CUDA graphs, one per batch-size bucket.

A decode step's shapes depend only on the batch size, so each bucket in a fixed
list is captured once at start-up (largest first, all in one memory pool) over
persistent input/output buffers. A step writes its metadata into pinned host
buffers, copies them into the graphs' device buffers (asynchronous: the host
never waits for the device here), padded up to the next bucket, and replays: one
launch instead of hundreds.

Padding rows are inert: slot -1 writes no KV and seq_len 0 attends to nothing
(the decode kernel returns zeros for them); their logits are never read.

Block tables: only the columns the widest row uses are written and copied
(columns past them keep stale ids, which no row's seq_len reaches), so a step's host cost follows the
batch's contexts, not the model's maximum length (Llama-3.1-8B: 8,192 blocks a
row). Two pinned staging sets alternate; before one is rewritten the host waits
on the event recorded after its last copy (with overlap the device may not have
started the previous step's copies yet when the next step is prepared).

Outputs: the logits returned are views of the graph's static output, valid until
the next replay (the sampler reads them in stream order before it). The aux
features are copied out: an EAGLE-3 head keeps them across steps.

With the runner's `aux_layers` (an EAGLE-3 head drafts from the residual streams
after those layers), the graphs also write those features, (b, 3h), so plain
decode steps of a speculating engine replay too: the head sees every token the
target computes.

With graph_mode="buffers" the same path runs eagerly and writes the same static
outputs, which is how the padding, staging and aliasing rules are tested without
a GPU. On CPU the analogue of a replayed graph is the model itself:
replica/model/cpu_model.py runs any step (no padding, no buckets) as one C++ call.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from replica.model.llama import Context
from replica.model.plan import is_placeholder, placeholder_index


def resolve_placeholders(ids: torch.Tensor, prev_tokens: torch.Tensor | None) -> torch.Tensor:
    """Overlap scheduling: input id placeholder(j) stands for prev_tokens[j], a token the
    previous step sampled that the host has not seen yet (replica.model.plan); resolve it on the device."""
    if prev_tokens is None or prev_tokens.numel() == 0:
        return ids
    return torch.where(is_placeholder(ids), prev_tokens[placeholder_index(ids).clamp(0, prev_tokens.numel() - 1)], ids)


def replay(graphs: dict, outputs: dict, key, forward, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Replay `key`'s graph, or run `forward()` eagerly into the same static outputs (graph_mode
    "buffers", or a key not captured); then (logits[:n], a copy of aux[:n] or None): the logits are
    views valid until the next replay, the aux features copied out (an EAGLE-3 head keeps them)."""
    if key in graphs:
        graphs[key].replay()
    else:
        fresh = forward()
        if key not in outputs:
            outputs[key] = tuple(torch.empty_like(t) for t in fresh)
        for dst, src in zip(outputs[key], fresh):
            dst.copy_(src)
    out = outputs[key]
    return out[0][:n], (out[1][:n].clone() if len(out) > 1 else None)


def default_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (what nano-vllm / vLLM do)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class _Staging:
    """One set of pinned host buffers for a step's metadata (pinned only on CUDA)."""

    def __init__(self, n: int, max_blocks: int, pin: bool):
        self.meta = torch.zeros(4, n, dtype=torch.int64, pin_memory=pin)  # ids, positions, slots, seq_lens
        self.tables = torch.zeros(n * max_blocks, dtype=torch.int32, pin_memory=pin)  # (b, width) row-major
        self.meta_np, self.tables_np = self.meta.numpy(), self.tables.numpy()
        self.copied = torch.cuda.Event() if pin else None  # recorded after the last copies out of these buffers


class DecodeGraphs:
    def __init__(self, model, kv_cache: torch.Tensor, block_size: int, aux_layers: tuple[int, ...],
                 max_num_seqs: int, max_model_len: int, capture: bool):
        """Graphs (capture=True, CUDA) or their eager stand-in over `model` and the KV pool.
        Holds no reference to the Runner, so an engine is freed as soon as it is dropped."""
        self.model, self.kv_cache, self.block_size, self.aux_layers = model, kv_cache, block_size, aux_layers
        self.buckets = default_buckets(max_num_seqs)
        dev, n = kv_cache.device, self.buckets[-1]
        self.device = dev
        self.max_blocks = -(-max_model_len // block_size)
        # Persistent device buffers: graphs read and write these exact tensors.
        self.meta = torch.zeros(4, n, dtype=torch.int64, device=dev)
        self.input_ids, self.positions, self.slots = self.meta[0], self.meta[1], self.meta[2]
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        on_cuda = dev.type == "cuda"
        self._staging = [_Staging(n, self.max_blocks, on_cuda) for _ in range(2 if on_cuda else 1)]
        self._turn = 0
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
        model = self.model
        if not self.aux_layers:
            hidden = model(self.input_ids[:b], self.positions[:b], ctx, self.kv_cache)
            return (model.compute_logits(hidden).float(),)
        hidden, aux = model(self.input_ids[:b], self.positions[:b], ctx, self.kv_cache, self.aux_layers)
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

    def prepare(self, plan, prev_tokens: torch.Tensor | None = None) -> int:
        """Write a pure-decode plan's metadata into the graphs' device buffers, padded
        to its bucket; returns the bucket. Host work: O(rows x blocks per row)."""
        n = len(plan.starts)
        b = self.bucket_for(n)
        bs = self.block_size
        st = self._staging[self._turn]
        self._turn = (self._turn + 1) % len(self._staging)
        if st.copied is not None:  # its previous step's copies have left these buffers (long done in practice)
            st.copied.synchronize()
        meta, tables = st.meta_np, plan.block_tables
        meta[0, :n] = plan.input_ids
        meta[1, :n] = plan.starts
        meta[2, :n] = [t[p // bs] * bs + p % bs for t, p in zip(tables, plan.starts)]
        meta[3, :n] = plan.starts
        meta[3, :n] += 1  # a decode computes the token at position `start`: the sequence holds start + 1
        meta[:2, n:b] = 0
        meta[2, n:b] = -1  # padding rows: no KV write ...
        meta[3, n:b] = 0  # ... and nothing to attend to
        width = max(len(t) for t in tables)
        rows = st.tables_np[: b * width].reshape(b, width)
        rows[:] = 0  # past a row's blocks: block 0, never read (its seq_len stops before)
        for i, t in enumerate(tables):
            rows[i, : len(t)] = t
        self.meta.copy_(st.meta, non_blocking=True)  # the whole (4, n): one small contiguous copy
        self.block_tables[:b, :width].copy_(st.tables[: b * width].view(b, width), non_blocking=True)
        if prev_tokens is not None:
            self.input_ids[:b].copy_(resolve_placeholders(self.input_ids[:b], prev_tokens))
        self.seq_lens[:b].copy_(self.meta[3, :b])
        if st.copied is not None:
            st.copied.record()
        return b

    @torch.inference_mode()
    def run(self, plan, prev_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits (B, V), aux (B, 3h) or None without aux_layers) of a pure-decode
        plan with B <= the largest bucket. The logits are valid until the next run."""
        n = len(plan.starts)
        b = self.prepare(plan, prev_tokens)
        return replay(self.graphs, self.outputs, b, lambda: self._forward(b), n)
