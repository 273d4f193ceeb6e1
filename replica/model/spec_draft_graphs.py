"""The EAGLE-3 draft loop and commit replayed from CUDA graphs: one per (batch bucket,
drafter shape) for the levels, one per (batch bucket, P) for the commit.

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

The commit (draft-extend: the head's entries for the tokens the target verified, with their
features) has a variable number of entries a row (the accepted drafts + 1; more after plain
steps). `commit` lays each row out in P query slots (P the next power of two of the most
pending, up to COMMIT_MAX), its real entries last; the slots before them are padding
entries at committed positions (slot -1: they store nothing, and the real entries read the
cache as the eager commit's do). Buffers `c_ids`, `c_pos`, `c_slots`, `c_feats`, `c_lens`
and the shared `tables` are rewritten by each commit before its replay; a row with more
than COMMIT_MAX pending entries, or fewer than P tokens, commits eagerly.

Padding rows are inert: live False turns every head KV slot they would write into -1 (no
store), lens 1 (the root at position 0), block table zeros; they read block 0's first
entries, stale, and rows are independent in every op, so nothing reaches a real row.
"""

from __future__ import annotations

import sys
import time

import torch

from replica.model.graphs import default_buckets

COMMIT_MAX = 8  # pending entries a row a commit graph takes (a round of depth <= 7 leaves at most 8)


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
        # the commit's: entries (ids, positions, slots, features), lengths; features sized at first use
        self.c_ids = torch.zeros(n * COMMIT_MAX, dtype=torch.int64, device=device)
        self.c_pos = torch.zeros(n * COMMIT_MAX, dtype=torch.int64, device=device)
        self.c_slots = torch.full((n * COMMIT_MAX,), -1, dtype=torch.int64, device=device)
        self.c_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.c_feats: torch.Tensor | None = None
        self._consts: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
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

    # -- the commit (draft-extend) --------------------------------------------------------------
    @torch.inference_mode()
    def commit(self, drafter, tokens: list[list[int]], states, block_tables: torch.Tensor):
        """The commit through a graph per (bucket, P): each row's pending entries (at most P, a
        power of two up to COMMIT_MAX) right-aligned in P query slots, the slots before them
        padding entries at the committed positions len - P .. (slot -1: they store nothing and
        their outputs are not read; the real entries see the cache as the eager commit does).
        None (the caller commits eagerly) where a row holds more pending entries, or fewer than
        P tokens in all. Returns (o, log q, roots, lens) as Drafter._commit."""
        B, pend = len(tokens), [st.pending for st in states]
        P = 1 << (max(pend) - 1).bit_length()
        b = self.bucket_for(B)
        if P > COMMIT_MAX or b is None or min(len(t) for t in tokens) < P:
            return None
        n, bs, dev = b * P, drafter.block_size, self.device
        feats = torch.cat([f for st in states for f in st.feats])
        if self.c_feats is None:
            self.c_feats = torch.zeros(self.buckets[-1] * COMMIT_MAX, feats.shape[-1], dtype=feats.dtype, device=dev)
        ids, pos, valid, dst = [0] * n, [0] * n, [0] * n, []
        for i, (toks, k) in enumerate(zip(tokens, pend)):
            L = len(toks)
            ids[i * P : (i + 1) * P] = toks[L - P :]
            pos[i * P : (i + 1) * P] = range(L - P, L)
            valid[(i + 1) * P - k : (i + 1) * P] = [1] * k
            dst += range((i + 1) * P - k, (i + 1) * P)
        for i in range(B, b):  # padding rows: positions 0 .. P-1, nothing stored
            pos[i * P : (i + 1) * P] = range(P)
        lens = [len(t) for t in tokens] + [P] * (b - B)
        host = torch.tensor(ids + pos + valid + lens + dst, dtype=torch.int64, pin_memory=dev.type == "cuda")
        up = host.to(dev, non_blocking=True)
        self.c_ids[:n].copy_(up[:n])
        self.c_pos[:n].copy_(up[n : 2 * n])
        self.c_lens[:b].copy_(up[3 * n : 3 * n + b])
        W = block_tables.shape[1]
        self.tables[:B, :W].copy_(block_tables)
        self.tables[B:b].zero_()
        rows = torch.arange(n, device=dev) // P
        slots = self.tables[rows, self.c_pos[:n] // bs].long() * bs + self.c_pos[:n] % bs
        self.c_slots[:n].copy_(torch.where(up[2 * n : 3 * n] > 0, slots, -1))
        self.c_feats[:n].zero_()
        self.c_feats.index_copy_(0, up[3 * n + b :], feats)
        key = ("commit", b, P)
        if key not in self.graphs and self.capture:
            self._capture_key(key, lambda: self._commit_step(drafter, b, P))
        if key in self.graphs:
            self.graphs[key].replay()
        else:
            self._eager(key, self._commit_step(drafter, b, P))
        o, logp = self.outputs[key]
        last = self._commit_consts(b, P)[1][:B]
        return o[:B], logp[:B], self.c_ids[last], self.c_lens[:B].long()

    def _commit_consts(self, b: int, P: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cu, last) of key (b, P): row i's queries are [i * P, (i + 1) * P), its newest the last."""
        if (b, P) not in self._consts:
            cu = torch.arange(0, (b + 1) * P, P, dtype=torch.int32, device=self.device)
            self._consts[(b, P)] = cu, cu[1:].long() - 1
        return self._consts[(b, P)]

    def _commit_step(self, drafter, b: int, P: int):
        n = b * P
        cu, last = self._commit_consts(b, P)
        return drafter.commit_step(self.c_ids[:n], self.c_feats[:n], self.c_pos[:n], self.c_slots[:n],
                                   self.tables[:b], cu, self.c_lens[:b], last)

    def _capture_key(self, key, fn) -> None:
        fn()  # warm-up: lazy init and autotuning outside capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            self.outputs[key] = tuple(fn())
        self.pool = self.pool or g.pool()
        self.graphs[key] = g

    def _eager(self, key, fresh) -> None:
        if key not in self.outputs:
            self.outputs[key] = tuple(torch.empty_like(t) for t in fresh)
        for dst, src in zip(self.outputs[key], fresh):
            dst.copy_(src)

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
