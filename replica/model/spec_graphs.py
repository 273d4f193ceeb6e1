"""The speculative verify replayed from CUDA graphs, one per (batch bucket, tokens per row).

A verify plan whose every row is a device draft tree (StepPlan.draft_rows == rows; the
trees are speculative.drafting.Drafts, T nodes a row, T = the drafter shape's budget + 1)
has shapes that depend only on (rows, T): b = the rows' bucket (replica.model.graphs'
buckets), b * T tokens, every one of them a logits row. Each pair is captured once (on
CUDA, in the decode graphs' memory pool) over the persistent buffers below and replayed;
under graph_mode="buffers" the same padded-buffer path runs eagerly into the same static
outputs (how the padding and aliasing rules are tested on CPU). Chains are trees too
(parents i - 1), so one path serves both.

What lives where (device buffers, sized for the largest bucket and the largest T seen):
  * `meta` (int64): for key (b, T), [0, b) the rows' starts and [b, b + b*T) node j of row
    i's KV slot (that of position start + j), written by one copy from pinned staging;
  * `input_ids`, `positions` (b*T,): the drafts' tokens, start + depth, written on the device
    from the Drafts (no host read);
  * `prefix` (b,) int32 = starts, `seq_lens` (b,) = starts + T;
  * `mask` (b*T*T bool, viewed (b*T, T)): the tree mask as data, row i*T + j says which
    nodes of row i node j sees (ancestor_masks of the drafts' parents);
  * `block_tables` (N, max_blocks) int32: the first `width` columns written each step,
    columns past them stale (no row's prefix + T reaches them: the scheduler allocated
    1 + lookahead positions for every speculating row);
  * `cu[(b, T)]`: the constant query offsets 0, T, 2T, ... of that key.

Padding rows [rows, b) are inert: every node's slot is -1 (no KV write), prefix 0, ids and
positions 0, mask the identity; they attend only to block 0's first T entries (stale,
never written by them) and their logits and features are never read. Rows are
independent in every op, so padding cannot reach a real row.

When a buffer may be rewritten: a step writes all of its key's views before replaying;
the logits returned are views of the static output, valid until the next verify replay
(the sampler and acceptance read them in stream order before it); the aux features are
copied out (the head keeps them). Two pinned staging sets alternate on CUDA; before one
is rewritten the host waits on the event recorded after its last copy.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from replica.model.graphs import default_buckets, replay
from replica.model.llama import Context
from replica.model.plan import StepPlan


def ancestor_masks(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """(B, n, n) bool on the device: [b, i, j] = node j is node i or one of its ancestors, for
    parents (B, n) (-1 the root, parents[:, i] < i) whose paths are at most `depth` long: the
    parent relation closed by squaring, ceil(log2(depth)) products, no host read."""
    B, n = parents.shape
    eye = torch.eye(n, dtype=torch.float32, device=parents.device).expand(B, n, n)
    up = torch.zeros(B, n, n + 1, dtype=torch.float32, device=parents.device)
    up.scatter_(2, torch.where(parents < 0, n, parents)[..., None], 1.0)  # [i, parent(i)]; the root's in column n
    reach, steps = eye + up[..., :n], 1  # paths of at most `steps` edges
    while steps < depth:
        reach, steps = (reach @ reach).clamp_max(1.0), 2 * steps
    return reach > 0


class _Staging:
    """Pinned (on CUDA) host buffers for a verify's host data: starts then slots, and the tables."""

    def __init__(self, size: int, tables: int, pin: bool):
        self.meta = torch.zeros(size, dtype=torch.int64, pin_memory=pin)
        self.tables = torch.zeros(tables, dtype=torch.int32, pin_memory=pin)
        self.meta_np, self.tables_np = self.meta.numpy(), self.tables.numpy()
        self.copied = torch.cuda.Event() if pin else None


class VerifyGraphs:
    def __init__(self, model, kv_cache: torch.Tensor, block_size: int, aux_layers: tuple[int, ...],
                 max_num_seqs: int, max_blocks: int):
        """Over `model` and its KV pool; `reserve` sizes the buffers and, on CUDA, captures the
        graphs; a key not captured runs eagerly over the same buffers (graph_mode="buffers")."""
        self.model, self.kv_cache, self.block_size, self.aux_layers = model, kv_cache, block_size, aux_layers
        self.buckets = default_buckets(max_num_seqs)
        self.device, self.max_blocks, self.pool = kv_cache.device, max_blocks, None
        self.block_tables = torch.zeros(self.buckets[-1], max_blocks, dtype=torch.int32, device=self.device)
        self.nodes = 0  # the largest T the buffers hold
        self.cu: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}  # logits (b*T, V) [, aux (b*T, 3h)]
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._staging: list[_Staging] = []
        self._turn = 0

    def bucket_for(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    def _grow(self, nodes: int) -> None:
        """Buffers for T = nodes (reallocated only before any graph reads them: at capture, or eagerly)."""
        if nodes <= self.nodes:
            return
        assert not self.graphs, "verify buffers grown after a capture"
        n, dev = self.buckets[-1], self.device
        self.nodes = nodes
        self.meta = torch.zeros(n + n * nodes, dtype=torch.int64, device=dev)
        self.input_ids = torch.zeros(n * nodes, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n * nodes, dtype=torch.int64, device=dev)
        self.prefix = torch.zeros(n, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.mask = torch.zeros(n * nodes * nodes, dtype=torch.bool, device=dev)
        pin = dev.type == "cuda"
        self._staging = [_Staging(n + n * nodes, n * self.max_blocks, pin) for _ in range(2 if pin else 1)]

    def _key_cu(self, b: int, T: int) -> torch.Tensor:
        if (b, T) not in self.cu:
            self.cu[(b, T)] = torch.arange(0, (b + 1) * T, T, dtype=torch.int32, device=self.device)
        return self.cu[(b, T)]

    def _forward(self, b: int, T: int) -> tuple[torch.Tensor, ...]:
        ctx = Context(slot_mapping=self.meta[b : b + b * T], num_decode_tokens=0, decode_block_tables=None,
                      decode_seq_lens=None, extend_block_tables=self.block_tables[:b],
                      extend_cu_seqlens_q=self._key_cu(b, T), extend_seq_lens=self.seq_lens[:b],
                      tree_mask=self.mask[: b * T * T].view(b * T, T), tree_prefix_lens=self.prefix[:b])
        ids, pos = self.input_ids[: b * T], self.positions[: b * T]
        if not self.aux_layers:
            return (self.model.compute_logits(self.model(ids, pos, ctx, self.kv_cache)).float(),)
        hidden, aux = self.model(ids, pos, ctx, self.kv_cache, self.aux_layers)
        return self.model.compute_logits(hidden).float(), torch.cat(aux, -1)

    def reserve(self, nodes: list[int], pool=None) -> None:
        """Buffers for T up to max(nodes) (so no step allocates); with `pool` (the decode graphs'),
        capture every bucket at each T in `nodes` into it."""
        self._grow(max(nodes))
        if pool is not None:
            self.pool = pool
            self._capture(nodes)

    @torch.inference_mode()
    def _capture(self, nodes: list[int]) -> None:
        """CUDA graphs for every bucket at each T in `nodes`, largest first, in one pool. The
        buffers' contents at capture are padding (slots -1): capture writes no KV."""
        self.meta[: self.buckets[-1]].zero_()
        self.meta[self.buckets[-1]:].fill_(-1)
        t0, keys = time.perf_counter(), [(b, T) for T in sorted(set(nodes), reverse=True)
                                          for b in reversed(self.buckets)]
        for b, T in keys:
            self.meta[b : b + b * T].fill_(-1)
            self.mask[: b * T * T].view(b, T, T).copy_(torch.eye(T, dtype=torch.bool, device=self.device))
            self._forward(b, T)  # warm-up: autotuning and lazy init outside capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.outputs[(b, T)] = self._forward(b, T)
            self.pool = self.pool or g.pool()
            self.graphs[(b, T)] = g
        torch.cuda.synchronize()
        print(f"captured {len(keys)} verify graphs (T = {sorted(set(nodes))}) in {time.perf_counter() - t0:.1f}s",
              file=sys.stderr, flush=True)

    def fits(self, plan: StepPlan, drafts) -> bool:
        """Whether `plan` is a pure verify this path serves (every row a device tree)."""
        return (drafts is not None and plan.draft_rows == len(plan.starts) and not plan.extra_logits
                and self.bucket_for(plan.draft_rows) is not None
                and (not self.graphs or (self.bucket_for(plan.draft_rows), drafts.nodes) in self.graphs))

    def _prepare(self, plan: StepPlan, drafts) -> tuple[int, int]:
        S, T = len(plan.starts), drafts.nodes
        self._grow(T)
        b, bs = self.bucket_for(S), self.block_size
        st = self._staging[self._turn]
        self._turn = (self._turn + 1) % len(self._staging)
        if st.copied is not None:  # its previous step's copies have left these buffers
            st.copied.synchronize()
        meta = st.meta_np
        meta[:S] = plan.starts
        meta[S:b] = 0
        slots = meta[b : b + b * T].reshape(b, T)
        offsets = np.arange(T)
        for i, (start, table) in enumerate(zip(plan.starts, plan.block_tables)):
            p = start + offsets  # node j: the slot of position start + j
            slots[i] = np.asarray(table, dtype=np.int64)[p // bs] * bs + p % bs
        slots[S:] = -1  # padding rows: no KV write
        width = max(len(t) for t in plan.block_tables)
        rows = st.tables_np[: b * width].reshape(b, width)
        rows[:] = 0
        for i, t in enumerate(plan.block_tables):
            rows[i, : len(t)] = t
        self.meta[: b + b * T].copy_(st.meta[: b + b * T], non_blocking=True)
        self.block_tables[:b, :width].copy_(st.tables[: b * width].view(b, width), non_blocking=True)
        if st.copied is not None:
            st.copied.record()
        # Device-side: the drafts' tokens, positions and tree mask; padding rows constant.
        starts = self.meta[:b]
        self.prefix[:b].copy_(starts)
        self.seq_lens[:b].copy_(starts + T)
        ids = self.input_ids[: b * T].view(b, T)
        ids[:S].copy_(drafts.tokens)
        ids[S:].zero_()
        pos = self.positions[: b * T].view(b, T)
        pos.copy_(starts[:, None].expand(b, T))
        pos[:S] += drafts.depths
        mask = self.mask[: b * T * T].view(b, T, T)
        mask[:S].copy_(ancestor_masks(drafts.parents, drafts.depth))
        mask[S:].copy_(torch.eye(T, dtype=torch.bool, device=self.device))
        return b, T

    @torch.inference_mode()
    def run(self, plan: StepPlan, drafts) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits (S*T, V), aux (S*T, 3h) or None) of a pure verify plan (`fits`); the logits
        are valid until the next verify run."""
        n = len(plan.starts) * drafts.nodes
        key = self._prepare(plan, drafts)
        return replay(self.graphs, self.outputs, key, lambda: self._forward(*key), n)
