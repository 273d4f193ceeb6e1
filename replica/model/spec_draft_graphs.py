"""The EAGLE-3 draft loop replayed from CUDA graphs, one per (batch bucket, drafter shape).

After the commit (the head's entries for the tokens the target verified), every draft
level of a round -- the head step over the frontier, top-k, scores, parents, the scratch
entries' ancestor masks, the rerank (speculative.drafting.Drafter.levels) -- has shapes
fixed by (rows, shape) and reads nothing back. So one graph per (bucket, TreeSpec) holds
the whole loop: one replay per round instead of ~90 launches a level. On CUDA a key is
captured the first time it is needed (a warm-up run, the capture, then its replay: the
same inputs, so the same drafts), all keys in one memory pool of their own; under
graph_mode="buffers" the same padded-buffer path runs eagerly into the same static
outputs (how padding and aliasing are tested on CPU).

What lives where (device buffers, the largest bucket's rows):
  * inputs, rewritten by `run` before each replay, rows [0, B) from the commit, rows [B, b)
    padding: `roots` (target ids), `o` (the commit's head outputs, the head's dtype),
    `logp` (log q of the root's children, fp32), `lens` (the rows' lengths), `tables`
    (block tables, the first W columns written; columns past them stale and never read: a
    round reads positions below lens + lookahead, inside the scheduler's allocation),
    `live` (False for padding), `temps`, `seeds` (sampled chains);
  * outputs: per key, the tokens, parents, depths (and q for sampled chains) the graph
    wrote; what `run` returns are views of them, valid until the next round of that key
    (the verify and the acceptance read them before it).

Padding rows are inert: live False turns every head KV slot they would write into -1 (no
store), lens 1 (the root at position 0), block table zeros; they read block 0's first
entries, stale, and rows are independent in every op, so nothing reaches a real row.
"""

from __future__ import annotations

import sys
import time

import torch

from replica.model.graphs import default_buckets


class DraftGraphs:
    def __init__(self, hidden: int, draft_vocab: int, dtype: torch.dtype, device: torch.device,
                 max_num_seqs: int, max_blocks: int, capture: bool):
        """Buffers for up to max_num_seqs rows of a head of `hidden` and `draft_vocab` in `dtype`;
        capture=True (CUDA): keys are captured as graphs at first use, else run eagerly."""
        self.buckets = default_buckets(max_num_seqs)
        n, self.device, self.capture = self.buckets[-1], device, capture
        self.roots = torch.zeros(n, dtype=torch.int64, device=device)
        self.o = torch.zeros(n, hidden, dtype=dtype, device=device)
        self.logp = torch.zeros(n, draft_vocab, dtype=torch.float32, device=device)
        self.lens = torch.ones(n, dtype=torch.int64, device=device)
        self.tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.live = torch.zeros(n, dtype=torch.bool, device=device)
        self.temps = torch.zeros(n, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(n, dtype=torch.int64, device=device)
        self.outputs: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def bucket_for(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    def _levels(self, drafter, spec, b: int):
        return drafter.levels(spec, self.roots[:b], self.o[:b], self.logp[:b], self.lens[:b], self.tables[:b],
                              self.temps[:b], self.seeds[:b], live=self.live[:b])

    def _write(self, inputs, b: int) -> None:
        roots, o, logp, lens, tables, temps, seeds = inputs
        B, W = roots.shape[0], tables.shape[1]
        for buf, x in ((self.roots, roots), (self.o, o), (self.logp, logp), (self.lens, lens)):
            buf[:B].copy_(x)
        self.tables[:B, :W].copy_(tables)
        self.live[:B].fill_(True)
        if temps is not None:
            self.temps[:B].copy_(temps)
            self.seeds[:B].copy_(seeds)
        if b > B:  # padding rows (constant)
            for buf in (self.roots, self.o, self.logp, self.tables, self.live, self.temps, self.seeds):
                buf[B:b].zero_()
            self.lens[B:b].fill_(1)

    @torch.inference_mode()
    def _capture(self, drafter, spec, b: int) -> None:
        key = (b, spec)
        self._levels(drafter, spec, b)  # warm-up: lazy init and autotuning outside capture
        torch.cuda.synchronize()
        t0, g = time.perf_counter(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            self.outputs[key] = self._levels(drafter, spec, b)
        self.pool = self.pool or g.pool()
        self.graphs[key] = g
        print(f"captured the draft graph for {b} rows of {spec} in {(time.perf_counter() - t0) * 1e3:.0f} ms",
              file=sys.stderr, flush=True)

    @torch.inference_mode()
    def run(self, drafter, spec, inputs) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
        """Drafter.levels over `inputs` (roots, o, logp, lens, block tables, temps, seeds) through
        the key's graph: (its outputs, rows [0, B)), and the block tables and lens it drafted with
        (views of the buffers: Drafts keeps them for the acceptance's KV moves)."""
        B = inputs[0].shape[0]
        b = self.bucket_for(B)
        assert b is not None, f"{B} drafting rows, more than the draft graphs' {self.buckets[-1]}"
        key = (b, spec)
        self._write(inputs, b)
        if key not in self.graphs and self.capture:
            self._capture(drafter, spec, b)
        if key in self.graphs:
            self.graphs[key].replay()
        else:  # eager over the same buffers, into the same static outputs
            fresh = self._levels(drafter, spec, b)
            if key not in self.outputs:
                self.outputs[key] = tuple(torch.empty_like(t) for t in fresh)
            for dst, src in zip(self.outputs[key], fresh):
                dst.copy_(src)
        return tuple(t[:B] for t in self.outputs[key]), self.tables[:B], self.lens[:B]
