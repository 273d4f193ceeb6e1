"""Standalone speculative generation: the target LlamaModel over a paged KV pool,
batch >= 1, drafts from the EAGLE-3 head (chains, EAGLE-2 trees) or the n-gram
drafter, one tree-verify forward per round, KV rollback of rejected drafts.
Tests and bench/speculative.py run it; the engine's side follows it.

One round for a batch of sequences (`SpeculativeGenerator._spec_step`), n = a
sequence's length, its newest token x_{n-1} (the root) not yet in the target KV:

  1. pool.reserve(n + spec.lookahead)           slots for the tree and the head's drafts
  2. trees = drafter.propose(tokens, states, block_tables, spec[, temps, seeds])
                                                commits the head's pending entries, drafts
  3. model(ids, positions, tree_context(...),  node i of a tree: token tree.tokens[i],
           kv_cache, aux_layers)                position n-1 + depth(i), KV slot n-1 + i,
                                                attends to the prefix + ancestor_mask()[i]
  4. verdicts = verify(trees, logits, temps, top_ks, top_ps, seeds, roots)
  5. per sequence: pool.move(verdict.kv_moves(n-1))     accepted KV made contiguous
                   state.add_features(aux[rows of verdict.path])
                   append verdict.tokens (stop checks), pool.truncate(new length)
                                                rejected drafts' blocks released

The engine serves the same round inside continuous batching (replica/speculation.py:
plain rows and trees in one forward, per-request acceptance, the batch-size policy
of speculative/policy.py); tests check the two agree token for token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from replica.model import Context, LlamaModel
from wire.protocol import SamplingParams
from speculative.drafting import DraftTree, Drafter, HeadState, TreeSpec
from speculative.head import Eagle3Head
from speculative.ngram import NgramDrafter
from speculative.pool import KVPool
from speculative.verify import verify


@dataclass
class Stats:
    steps: int = 0  # target forwards after prefill
    seq_rounds: int = 0  # Σ over steps of the sequences they decoded
    emitted: int = 0  # tokens those rounds produced (accepted drafts + bonus), before stop truncation
    drafted: int = 0
    accepted: int = 0
    generated: int = 0  # tokens returned
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def tau(self) -> float:
        """Mean acceptance length: tokens per sequence per target forward."""
        return self.emitted / max(1, self.seq_rounds)

    @property
    def tokens_per_s(self) -> float:
        return self.generated / max(1e-9, self.prefill_s + self.decode_s)


@dataclass
class _Seq:
    sid: int
    tokens: list[int]
    n_prompt: int
    params: SamplingParams
    seed: int
    state: HeadState | None = None
    done: bool = False
    out: list[int] = field(default_factory=list)


class SpeculativeGenerator:
    def __init__(self, model: LlamaModel, head: Eagle3Head | None = None, *, num_blocks: int = 256,
                 block_size: int = 16):
        cfg = model.cfg
        self.model, self.ops = model, model.ops
        w = model.embed_tokens.weight
        self.pool = KVPool(num_blocks, block_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, w.dtype, w.device)
        self.head = head
        self.drafter = Drafter(head, model.cos_sin, num_blocks, block_size, self.ops) if head is not None else None
        self.eos = frozenset(cfg.eos_token_ids)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 spec: TreeSpec | NgramDrafter | None = None) -> tuple[list[list[int]], Stats]:
        """Completions of prompts (one SamplingParams for all, or one each); spec None
        decodes one token per forward, the baseline."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if isinstance(spec, TreeSpec) and self.drafter is None:
            raise ValueError("a TreeSpec drafts with the EAGLE-3 head: pass head= to SpeculativeGenerator")
        seqs = [_Seq(i, list(p), len(p), sp, sp.seed if sp.seed is not None else 0)
                for i, (p, sp) in enumerate(zip(prompts, params))]
        stats = Stats()
        aux_layers = self.head.cfg.aux_layers if isinstance(spec, TreeSpec) else ()
        try:
            t0 = time.perf_counter()
            self._prefill(seqs, aux_layers)
            t1 = time.perf_counter()
            while active := [s for s in seqs if not s.done]:
                if spec is None:
                    self._plain_step(active, stats)
                else:
                    self._spec_step(active, spec, aux_layers, stats)
                for s in active:
                    if s.done:
                        self.pool.free(s.sid)
            stats.prefill_s, stats.decode_s = t1 - t0, time.perf_counter() - t1
        finally:
            for s in seqs:
                self.pool.free(s.sid)
        outs = [s.tokens[s.n_prompt :] for s in seqs]
        stats.generated = sum(map(len, outs))
        return outs, stats

    # -- pieces ------------------------------------------------------------------------------
    def _tensor(self, data, dtype=torch.int64):
        return torch.tensor(data, dtype=dtype, device=self.pool.device)

    def _append(self, s: _Seq, tokens: list[int]) -> None:
        """Append emitted tokens up to the first stop condition (as Sequence.check_stop)."""
        sp = s.params
        for t in tokens:
            s.tokens.append(t)
            if ((t in self.eos and not sp.ignore_eos) or t in sp.stop_token_ids
                    or len(s.tokens) - s.n_prompt >= sp.max_tokens):
                s.done = True
                return

    def _sample(self, logits, seqs) -> list[int]:
        """The engine's sampler: randomness is a function of (seed, position)."""
        t = self._tensor([s.params.temperature for s in seqs], torch.float32)
        k = self._tensor([s.params.top_k for s in seqs], torch.int32)
        p = self._tensor([s.params.top_p for s in seqs], torch.float32)
        return self.ops.sample(logits, t, k, p, self._tensor([s.seed for s in seqs]),
                               self._tensor([len(s.tokens) for s in seqs])).tolist()

    def _prefill(self, seqs: list[_Seq], aux_layers) -> None:
        ids, pos, slots, cu = [], [], [], [0]
        for s in seqs:
            n = len(s.tokens)
            self.pool.reserve(s.sid, n)
            ids += s.tokens
            pos += range(n)
            slots += self.pool.slots(s.sid, range(n))
            cu.append(cu[-1] + n)
        ctx = Context(slot_mapping=self._tensor(slots), num_decode_tokens=0, decode_block_tables=None,
                      decode_seq_lens=None, extend_block_tables=self.pool.block_tables([s.sid for s in seqs]),
                      extend_cu_seqlens_q=self._tensor(cu, torch.int32),
                      extend_seq_lens=self._tensor([len(s.tokens) for s in seqs], torch.int32))
        out = self.model(self._tensor(ids), self._tensor(pos), ctx, self.pool.kv_cache, aux_layers)
        hidden, aux = out if aux_layers else (out, [])
        logits = self.model.compute_logits(hidden[self._tensor(cu[1:]) - 1]).float()
        first = self._sample(logits, seqs)
        for b, s in enumerate(seqs):
            if aux_layers:
                s.state = self.drafter.new_state()
                s.state.add_features(torch.cat(aux, -1)[cu[b] : cu[b + 1]])
            self._append(s, [first[b]])

    def _plain_step(self, act: list[_Seq], stats: Stats) -> None:
        for s in act:
            self.pool.reserve(s.sid, len(s.tokens))
        sids = [s.sid for s in act]
        ctx = Context(slot_mapping=self._tensor([self.pool.slots(s.sid, [len(s.tokens) - 1])[0] for s in act]),
                      num_decode_tokens=len(act), decode_block_tables=self.pool.block_tables(sids),
                      decode_seq_lens=self._tensor([len(s.tokens) for s in act], torch.int32),
                      extend_block_tables=None, extend_cu_seqlens_q=None, extend_seq_lens=None)
        hidden = self.model(self._tensor([s.tokens[-1] for s in act]), self._tensor([len(s.tokens) - 1 for s in act]),
                            ctx, self.pool.kv_cache)
        tokens = self._sample(self.model.compute_logits(hidden).float(), act)
        for s, t in zip(act, tokens):
            self._append(s, [t])
        stats.steps += 1
        stats.seq_rounds += len(act)
        stats.emitted += len(act)

    def _spec_step(self, act: list[_Seq], spec, aux_layers, stats: Stats) -> None:
        for s in act:
            self.pool.reserve(s.sid, len(s.tokens) + spec.lookahead)
        sids = [s.sid for s in act]
        block_tables = self.pool.block_tables(sids)
        temps = [s.params.temperature for s in act]
        seeds = [s.seed for s in act]
        if isinstance(spec, TreeSpec):
            trees = self.drafter.propose([s.tokens for s in act], [s.state for s in act], block_tables, spec,
                                         temps, seeds)
        else:
            trees = [spec.propose(s.tokens) for s in act]
        ctx, ids, pos = self._tree_batch(act, trees, block_tables)
        out = self.model(ids, pos, ctx, self.pool.kv_cache, aux_layers)
        hidden, aux = out if aux_layers else (out, [])
        logits = self.model.compute_logits(hidden).float()
        roots = [len(s.tokens) - 1 for s in act]
        verdicts = verify(trees, logits, temps, [s.params.top_k for s in act], [s.params.top_p for s in act],
                          seeds, roots)
        aux = torch.cat(aux, -1) if aux_layers else None
        cu = ctx.extend_cu_seqlens_q.tolist()
        for b, (s, tree, v) in enumerate(zip(act, trees, verdicts)):
            self.pool.move(s.sid, v.kv_moves(roots[b]))
            if aux is not None:
                s.state.add_features(aux[[cu[b] + j for j in v.path]])
            self._append(s, v.tokens)
            self.pool.truncate(s.sid, len(s.tokens))  # rejected drafts' blocks go back
            stats.drafted += len(tree) - 1
            stats.accepted += v.num_accepted
            stats.emitted += len(v.tokens)
        stats.steps += 1
        stats.seq_rounds += len(act)

    def _tree_batch(self, act: list[_Seq], trees: list[DraftTree], block_tables):
        ids, pos, slots, masks = [], [], [], []
        for s, tree in zip(act, trees):
            root = len(s.tokens) - 1
            ids += tree.tokens
            pos += [root + d for d in tree.depths]
            slots += self.pool.slots(s.sid, range(root, root + len(tree)))
        ctx = tree_context(trees, [len(s.tokens) - 1 for s in act], self._tensor(slots), block_tables)
        return ctx, self._tensor(ids), self._tensor(pos)


def tree_context(trees: list[DraftTree], roots: list[int], slot_mapping, block_tables) -> Context:
    """The Context of a tree-verify forward: tree b's node i at KV slot of position
    roots[b] + i sees the roots[b] cached tokens and tree_mask[row, :len(tree b)]."""
    dev = slot_mapping.device
    max_n = max(len(t) for t in trees)
    mask = torch.cat([torch.nn.functional.pad(t.ancestor_mask(), (0, max_n - len(t))) for t in trees]).to(dev)
    cu = torch.tensor([0] + [len(t) for t in trees], device=dev).cumsum(0).to(torch.int32)
    roots_t = torch.tensor(roots, dtype=torch.int32, device=dev)
    return Context(slot_mapping=slot_mapping, num_decode_tokens=0, decode_block_tables=None, decode_seq_lens=None,
                   extend_block_tables=block_tables, extend_cu_seqlens_q=cu,
                   extend_seq_lens=roots_t + (cu[1:] - cu[:-1]), tree_mask=mask, tree_prefix_lens=roots_t)
