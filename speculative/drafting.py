"""Draft token trees from the EAGLE-3 head: chains and EAGLE-2 dynamic trees.

A round starts at the sequence's newest token x_{n-1}, the tree's root: emitted,
not yet in the target's KV. Node i holds a token for position n - 1 + depth(i);
the target verifies the whole tree in one forward, node i's KV at slot n - 1 + i,
attending to the prefix and to its ancestors (replica.model.plan, replica.model.runner).

Head KV. The head keeps one layer of K/V in the target's paged pool (the
Runner allocates it beside the target's layers), addressed by the sequence's own
block table. Entries [0, length) are
committed: computed from the target's features, so final. `propose` first
commits the pending entries (one per token the target has processed since the
last round; see HeadState), which yields q for the root's children, then drafts.
Draft entries go to scratch slots n, n+1, ... and are never committed: rolling
them back costs nothing, the next round overwrites them with the accepted
tokens' entries and the slots past the new length are released with the
target's.

EAGLE-2 dynamic tree (arXiv 2406.16858): score(node) = Σ log q along its path.
Level 1 holds the root's top_k tokens; at each level the top_k nodes by score are
expanded (one head step for all of them together), each proposing its top_k
children; after `depth` levels the `budget` best-scored candidates form the tree.
A child never outscores its parent, so the kept set contains every kept node's
ancestors (ties go to the earlier-created node, the parent). A chain is top_k = 1.

Head steps. A commit and each draft level is one head step over all its rows, yielding
the rows' outputs o and log q (log-softmaxed draft logits): on CPU one C++ call where the
kernel set has it (`kernels.Ops.cpu_draft`, kernels/cpu_draft.py: fc, the decoder layer
over the paged layer, norm, lm_head and log-softmax fused), else the PyTorch head with
the kernel set's paged attention (the reference; same drafts to float rounding).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels import cpu_draft
from speculative.head import Eagle3Head
from speculative.tree_spec import TreeSpec
from speculative.verify import DRAFT_STREAM, gumbel_draw


@dataclass
class DraftTree:
    """Node 0 is the root. parents[i] < i; siblings are tried in node order."""

    tokens: list[int]  # target ids
    parents: list[int]
    depths: list[int] = field(default_factory=list)
    q: torch.Tensor | None = None  # (n, V): the distribution node i was drawn from; None: picked deterministically

    def __post_init__(self):
        if not self.parents or self.parents[0] != -1:
            raise ValueError("node 0 is the root: parents[0] must be -1")
        if any(not 0 <= p < i for i, p in enumerate(self.parents[1:], 1)):
            raise ValueError(f"every parent must precede its child: {self.parents}")
        if len(self.tokens) != len(self.parents):
            raise ValueError("tokens and parents differ in length")
        self.depths = [0] * len(self.parents)
        for i, p in enumerate(self.parents[1:], 1):
            self.depths[i] = self.depths[p] + 1

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.tokens]
        for i, p in enumerate(self.parents[1:], 1):
            kids[p].append(i)
        return kids


def chain(root: int, drafts: list[int], q: torch.Tensor | None = None) -> DraftTree:
    return DraftTree([root, *drafts], list(range(-1, len(drafts))), q=q)


@dataclass
class Drafts:
    """A batch's draft trees on the device, n nodes per row, node 0 the root (the row's
    newest token); the host reads none of it (`trees()` does, for host-side users)."""

    tokens: torch.Tensor  # (B, n) int64 target ids
    parents: torch.Tensor  # (B, n) int64: -1 for the root, parents[:, i] < i
    depths: torch.Tensor  # (B, n) int64
    depth: int  # the longest path a row may have (spec.depth)
    block_tables: torch.Tensor  # (B, W) int32: the rows' block tables, as drafting used them
    lens: torch.Tensor  # (B,) int64: the rows' lengths (the root sits at lens - 1)
    q: torch.Tensor | None = None  # (B, n, V): the law node i was drawn from; None: picked deterministically

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def nodes(self) -> int:
        return self.tokens.shape[1]

    def trees(self) -> list[DraftTree]:
        """The host's copy (one read): for grammar masks and tensor-parallel plans."""
        tokens, parents = torch.stack([self.tokens, self.parents]).tolist()
        q = [None] * len(self) if self.q is None else list(self.q)
        return [DraftTree(t, p, q=qb) for t, p, qb in zip(tokens, parents, q)]


def upload(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host data (lists, ints) on the device without the host waiting: an asynchronous copy,
    from pinned memory on CUDA."""
    return torch.tensor(data, dtype=dtype, pin_memory=device.type == "cuda").to(device, non_blocking=True)


@dataclass
class HeadState:
    """The head's view of one sequence: KV entries [0, length) are committed and
    feats holds the target features for the next entries (entry p reads the
    target's features at p - 1), one row per entry. Invariant when `propose` runs:
    length + pending == number of tokens."""

    length: int = 0
    feats: list[torch.Tensor] = field(default_factory=list)

    @property
    def pending(self) -> int:
        return sum(f.shape[0] for f in self.feats)

    def add_features(self, aux: torch.Tensor) -> None:
        """aux (k, 3h): the target's [lo ; mid ; hi] residual streams for the k tokens it just processed."""
        self.feats.append(aux)


class Drafter:
    """Runs the head over a batch of sequences: commit pending entries, then draft.
    kv (2, num_blocks, block_size, Hkv, D): the head's layer of the paged pool
    (replica.model.runner.Runner.draft_kv), in the head's dtype."""

    def __init__(self, head: Eagle3Head, cos_sin: torch.Tensor, kv: torch.Tensor, ops, threads: int | None = None):
        """threads: the C++ head step's (default torch's thread count). `graphs` (set by the
        engine, replica.model.spec_draft_graphs.DraftGraphs): the commit and the draft levels of
        a round run through it, a replay each per (batch bucket, shape), instead of eagerly."""
        assert kv.shape[-2:] == head.kv_shape() and kv.dtype == head.fc.weight.dtype, "the head's KV layer"
        self.head, self.cos_sin, self.ops, self.block_size = head, cos_sin, ops, kv.shape[2]
        self.kv, self.k_cache, self.v_cache = kv, kv[0], kv[1]
        self.scale = head.cfg.head_dim**-0.5
        self.cpp = None  # the C++ head step (kernels.cpu_draft.DraftStep), where the kernel set has it
        self.graphs = None
        if getattr(ops, "cpu_draft", False) and cpu_draft.supports(head, kv):
            self.cpp = cpu_draft.DraftStep(head, cos_sin, threads or torch.get_num_threads())

    def new_state(self, cached: int = 0) -> HeadState:
        """State for a sequence whose first `cached` tokens already have head KV in
        their blocks (a prefix-cache hit; 0 otherwise). The feature before the first
        new entry is zeros: exact at position 0; after a hit it stands in for a
        feature the target did not recompute (drafts stay lossless either way)."""
        return HeadState(length=cached, feats=[torch.zeros(1, 3 * self.head.cfg.hidden_size,
                                                           dtype=self.head.fc.weight.dtype,
                                                           device=self.k_cache.device)])

    def _slots(self, block_tables, rows, positions):
        bs = self.block_size
        return block_tables[rows, positions // bs].long() * bs + positions % bs

    # -- commit: pending entries with the target's features ---------------------------------
    def _commit(self, tokens, states, block_tables):
        for toks, st in zip(tokens, states):
            if st.length + st.pending != len(toks) or st.pending == 0:
                raise RuntimeError(f"head state out of step: {st.length} committed + {st.pending} pending entries "
                                   f"for {len(toks)} tokens; feed add_features() after every target forward")
        got = self.graphs.commit(self, tokens, states, block_tables) if self.graphs is not None else None
        if got is None:  # eager: each row's pending entries, packed
            ids, pos, rows, feats, cu = [], [], [], [], [0]
            for b, (toks, st) in enumerate(zip(tokens, states)):
                ids += toks[st.length:]
                pos += range(st.length, len(toks))
                rows += [b] * st.pending
                feats += st.feats
                cu.append(len(ids))
            dev = self.k_cache.device
            ids, pos, rows = (upload(x, torch.int64, dev) for x in (ids, pos, rows))
            slots = self._slots(block_tables, rows, pos)
            cu = upload(cu, torch.int32, dev)
            lens = upload([len(t) for t in tokens], torch.int32, dev)
            last = cu[1:].long() - 1  # each sequence's newest entry
            o, logp = self.commit_step(ids, torch.cat(feats), pos, slots, block_tables, cu, lens, last)
            got = o, logp, ids[last], lens.long()
        for st, toks in zip(states, tokens):
            st.length, st.feats = len(toks), []
        return got

    def commit_step(self, ids, feats, pos, slots, block_tables, cu, lens, last):
        """The head over entries ids (T,) at positions pos with the target's features feats (T, 3h),
        rows by cu, causal over each row's committed entries (lens: its length after them); KV to
        `slots` (-1: not stored). Returns o (B, h) and log q (B, V) of the entries `last`. Fixed
        shapes for fixed (T, B) and no host read: what a commit graph captures."""
        if self.cpp is not None:
            return self.cpp(ids, feats, pos, slots, block_tables, cu, lens, self.kv, last)  # (B, h), (B, V)

        def attend(q, k, v):  # causal over the committed entries, as a prefill chunk
            self.ops.store_kvcache(k, v, self.k_cache, self.v_cache, slots)
            return self.ops.paged_extend_attention(q, self.k_cache, self.v_cache, block_tables, cu, lens, self.scale)

        o = self.head(ids, self.head.fuse(feats), pos, self.cos_sin, attend)[last]  # (B, h)
        return o, self.head.logits(o).float().log_softmax(-1)

    # -- one draft level ----------------------------------------------------------------------
    def _step(self, tok, g, lens, level: int, e0: int, anc, block_tables, live=None):
        """Head step for K nodes per sequence at depth `level`: tok (B, K) target ids,
        g (B, K, h) their parents' outputs. Their entries go to scratch slots
        n + e0 .. n + e0 + K - 1; anc (B, E, E) says which scratch entries each sees;
        live (B,) bool or None (all): rows not live write no KV (graph padding).
        Returns the nodes' outputs o (B, K, h) and log q (B, K, V), fp32."""
        B, K = tok.shape
        dev = tok.device
        pos = (lens - 1 + level)[:, None].expand(B, K)  # RoPE position of the drafted token
        scratch = lens[:, None] + e0 + torch.arange(K, device=dev)  # (B, K)
        rows = torch.arange(B, device=dev)[:, None].expand(B, K)
        slots = self._slots(block_tables, rows.flatten(), scratch.flatten())
        if live is not None:
            slots = torch.where(live[rows.flatten()], slots, -1)
        # Tree attention: a sequence's scratch entries follow its n committed ones; the K
        # queries are entries e0 .. e0 + K - 1, the newest so far, and see the prefix and
        # the scratch entries anc allows (their ancestors and themselves).
        cu = torch.arange(0, (B + 1) * K, K, dtype=torch.int32, device=dev)
        prefix = lens.to(torch.int32)
        n_tree = torch.full((B,), e0 + K, dtype=torch.int32, device=dev)
        mask = anc[:, e0 : e0 + K].reshape(B * K, anc.shape[-1]).contiguous()  # (B*K, E)
        if self.cpp is not None:
            o, logp = self.cpp(tok.flatten(), g.flatten(0, 1), pos.flatten(), slots, block_tables, cu, prefix,
                               self.kv, torch.arange(B * K, device=dev), tree_mask=mask, tree_n=n_tree)
            return o.view(B, K, -1), logp.view(B, K, -1)

        def attend(q, k, v):  # q (B*K, H, D)
            self.ops.store_kvcache(k, v, self.k_cache, self.v_cache, slots)
            return self.ops.paged_tree_attention(q, self.k_cache, self.v_cache, block_tables, cu, prefix, mask,
                                                 self.scale, n_tree)

        o = self.head(tok.flatten(), g.flatten(0, 1), pos.flatten(), self.cos_sin, attend).view(B, K, -1)
        return o, self.head.logits(o).float().log_softmax(-1)

    # -- public -------------------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, tokens: list[list[int]], states: list[HeadState], block_tables: torch.Tensor, spec: TreeSpec,
              temperatures=None, seeds=None) -> Drafts:
        """One draft tree per sequence, on the device. block_tables (B, W) int32 must cover
        positions [0, len + spec.lookahead). temperatures/seeds: for spec.sample only."""
        o, logp, roots, lens = self._commit(tokens, states, block_tables)
        dev = o.device
        temps = upload(temperatures, torch.float32, dev) if spec.sample else None
        seeds = upload(seeds, torch.int64, dev) if spec.sample else None
        inputs = (roots, o, logp, lens, block_tables, temps, seeds)
        if self.graphs is not None:  # views of the graphs' buffers, valid until the next round
            out, block_tables, lens = self.graphs.run(self, spec, inputs)
        else:
            out = self.levels(spec, *inputs)
        tokens, parents, depths, q = out if spec.sample else (*out, None)
        return Drafts(tokens, parents, depths, spec.depth, block_tables, lens, q=q)

    def levels(self, spec: TreeSpec, roots, o, logp, lens, block_tables, temps=None, seeds=None, live=None):
        """Every draft level of a round, from the commit's outputs (roots (B,), o (B, h), log q
        (B, V), lens (B,)): (tokens, parents, depths) (B, n) [+ q (B, n, V) for spec.sample].
        Fixed shapes for a given (B, spec) and no host read: what one graph captures. live (B,)
        bool: rows that are padding (False) write no head KV."""
        if spec.sample:
            return self._sample_chain(roots, o, logp, lens, block_tables, spec, temps, seeds, live)
        return self._tree(roots, o, logp, lens, block_tables, spec, live)

    def propose(self, tokens: list[list[int]], states: list[HeadState], block_tables: torch.Tensor, spec: TreeSpec,
                temperatures=None, seeds=None) -> list[DraftTree]:
        """`draft`, read back as host trees."""
        return self.draft(tokens, states, block_tables, spec, temperatures, seeds).trees()

    def _tree(self, roots, o, logp, lens, block_tables, spec: TreeSpec, live=None):
        B, K, d2t = roots.shape[0], spec.top_k, self.head.d2t
        E = K * (spec.depth - 1)
        anc = torch.zeros(B, E, E, dtype=torch.bool, device=o.device)
        top = logp.topk(K, dim=-1)
        # Candidates in creation order, per sequence: draft token, score, parent candidate
        # (-1: the root) and the scratch entry of that parent (-1: the root).
        c_tok, c_score = [top.indices], [top.values]
        c_parent = [torch.full((B, K), -1, device=o.device)]
        c_parent_e = [torch.full((B, K), -1, device=o.device)]
        frontier = torch.arange(K, device=o.device).expand(B, K)  # candidates to expand (level 1: all)
        g = o[:, None].expand(B, K, o.shape[-1])
        for level in range(1, spec.depth):
            n_prev = sum(t.shape[1] for t in c_tok)
            tok_all, score_all = torch.cat(c_tok, 1), torch.cat(c_score, 1)
            pe_all = torch.cat(c_parent_e, 1)
            e0 = (level - 1) * K
            f_tok, f_score = tok_all.gather(1, frontier), score_all.gather(1, frontier)
            f_pe = pe_all.gather(1, frontier)
            batch_rows = torch.arange(B, device=o.device)
            for r in range(K):  # scratch entry e0 + r sees its parent's ancestors and itself
                parent_rows = anc[batch_rows, f_pe[:, r].clamp_min(0)] & (f_pe[:, r] >= 0)[:, None]
                anc[:, e0 + r] = parent_rows
                anc[:, e0 + r, e0 + r] = True
            o_f, logp_f = self._step(d2t[f_tok], g, lens, level, e0, anc, block_tables, live)  # (B, K, h), (B, K, V)
            lp = logp_f.topk(K, dim=-1)  # (B, K, K)
            new_score = (f_score[..., None] + lp.values).flatten(1)  # (B, K*K)
            c_tok.append(lp.indices.flatten(1))
            c_score.append(new_score)
            c_parent.append(frontier[..., None].expand(B, K, K).flatten(1))
            c_parent_e.append((e0 + torch.arange(K, device=o.device))[None, :, None].expand(B, K, K).flatten(1))
            best = new_score.topk(K, dim=-1).indices  # next frontier, best first
            frontier = n_prev + best
            g = o_f.gather(1, (best // K)[..., None].expand(B, K, o_f.shape[-1]))
        return self._rerank(roots, torch.cat(c_tok, 1), torch.cat(c_score, 1), torch.cat(c_parent, 1), spec)

    def _rerank(self, roots, tok, score, parent, spec: TreeSpec):
        """Keep the `budget` best candidates, ordered by depth then score: (tokens, parents,
        depths), each (B, budget + 1), the root first."""
        K, N, dev = spec.top_k, spec.budget, tok.device
        B, C = tok.shape
        c = torch.arange(C, device=dev)
        level = torch.where(c < K, 1, 2 + (c - K).clamp_min(0) // (K * K))  # (C,): a candidate's depth
        keep = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :N]  # (B, N)
        keep = keep.gather(1, torch.sort(level[keep], dim=-1, stable=True).indices)  # by level; score order within
        node_of = torch.zeros(B, C, dtype=torch.long, device=dev).scatter_(
            1, keep, torch.arange(1, N + 1, device=dev).expand(B, N))  # candidate -> its node
        up = parent.gather(1, keep)  # (B, N): the parent candidate, -1 the root
        parents = torch.where(up < 0, 0, node_of.gather(1, up.clamp_min(0)))
        minus = torch.full((B, 1), -1, dtype=torch.long, device=dev)
        return (torch.cat([roots[:, None], self.head.d2t[tok.gather(1, keep)]], 1), torch.cat([minus, parents], 1),
                torch.cat([torch.zeros_like(minus), level[keep]], 1))

    def _sample_chain(self, roots, o, logp, lens, block_tables, spec, temps, seeds, live=None):
        """Chain drafts x_k ~ q_k = softmax(head logits / T) = softmax(log q / T), recorded for verification."""
        B, dev, d2t = roots.shape[0], o.device, self.head.d2t
        V = self.head.cfg.target_vocab_size
        anc = torch.ones(B, spec.depth, spec.depth, device=dev, dtype=torch.bool).tril()
        qs, drafts, g = [torch.zeros(B, V, device=dev)], [], o[:, None]
        for level in range(1, spec.depth + 1):
            t = torch.where(temps > 0, temps, 1.0)[:, None]
            q = torch.softmax(logp / t, dim=-1)
            greedy = torch.nn.functional.one_hot(logp.argmax(-1), q.shape[-1]).float()
            q = torch.where((temps > 0)[:, None], q, greedy)
            x = gumbel_draw(q, seeds, lens - 1 + level, DRAFT_STREAM)  # (B,) draft ids
            qs.append(torch.zeros(B, V, device=dev).index_copy_(1, d2t, q))
            drafts.append(d2t[x])
            if level < spec.depth:
                g, logp_f = self._step(d2t[x][:, None], g, lens, level, level - 1, anc, block_tables, live)
                logp = logp_f[:, 0]
        q_all = torch.stack(qs, 1)  # (B, depth + 1, V)
        tokens = torch.stack([roots] + drafts, 1)  # (B, depth + 1)
        nodes = torch.arange(spec.depth + 1, device=dev).expand(B, -1)
        return tokens, nodes - 1, nodes, q_all
