"""Speculative decoding inside continuous batching (the engine's side of speculative/).

A speculating step runs ONE target forward over every row of the batch:

  * speculating decodes (first): the drafter proposes a tree rooted at the newest
    token x_{n-1}; node i sits at position n-1 + depth(i) and KV slot n-1 + i and
    attends to the n-1 cached tokens plus its ancestors (the tree mask);
  * every other row (prefill chunk, plain decode) is a chain: token j of a chunk
    starting at `start` attends to the `start` cached tokens and to tokens <= j,
    which is causal attention written as a tree mask.

Then verification keeps, per sequence, the longest accepted path plus a bonus token;
the accepted nodes' KV moves down to be contiguous (slot n-1 + k for depth k), and
the engine appends the tokens (stop checks per token) and truncates the blocks
past the new length, so rejected drafts' slots go back to the pool.

EAGLE-3 keeps a HeadState per sequence fed with the target's features (residual
streams after head.cfg.aux_layers) of every token the target computes -- prefill
chunks and plain decodes included -- so the head stays in step when speculation
pauses. A state out of step (a new or preempted sequence) restarts at the tokens
already in the KV cache (`Drafter.new_state(cached=...)`): drafts may be worse for a
round, output never changes.

Acceptance (`_target_tokens`): the token the target emits after node i is drawn
exactly as plain decoding draws it -- argmax for greedy rows, the engine's sampler
with u(seed, position of the token) for the others -- and a draft is kept iff it
equals that token (speculative.verify.accept_greedy). For the deterministic drafts
served here (n-gram, top-k trees) this keeps child x with probability p(x), as
rejection sampling with a point-mass proposal does, and the output is token for
token the non-speculative output: a seeded request does not depend on the batch
it ran in nor on the draft depth that batch got.

Policy (what a step of b decoding sequences drafts), in order:
  * EAGLE-3 with cfg.spec_policy "auto" and a policy.json beside the head measured
    on this device type (`bench/speculative.py --write-policy`): the fastest
    measured configuration for b, none where plain decoding measured faster;
  * otherwise the taper: full depth (cfg.spec_depth) at batch 1, tapering
    linearly to one draft token at cfg.spec_max_batch, off above.
Either way, never more draft tokens than the step's token budget allows for every
decode (the depth shrinks until b x (1 + drafts) fits, else plain decoding).
"""

from __future__ import annotations

import logging
import math

import torch

from replica.config import EngineConfig, ModelConfig
from replica.model import Context
from replica.scheduler import Batch
from speculative.drafting import Drafter, TreeSpec
from speculative.head import head_dir, load_head
from speculative.ngram import NgramDrafter
from speculative.policy import SpecPolicy
from speculative.verify import accept_greedy

log = logging.getLogger("replica.speculation")


def measured_policy(cfg: EngineConfig, head_path) -> SpecPolicy | None:
    """The policy the engine follows: cfg.spec_policy "auto" -> policy.json beside the head
    when measured on this device type, "taper" -> none, a folder -> the one there (it must fit)."""
    if cfg.spec_policy == "taper":
        return None
    folder = head_path if cfg.spec_policy == "auto" else cfg.spec_policy
    policy = SpecPolicy.load(folder)
    if policy is None:
        if cfg.spec_policy != "auto":
            raise FileNotFoundError(f"no speculation policy in {folder}: write one with "
                                    f"`python bench/speculative.py --write-policy --head {folder}`")
        return None
    device = torch.device(cfg.device).type
    if policy.device != device:
        if cfg.spec_policy != "auto":
            raise ValueError(f"the policy in {folder} was measured on {policy.device}, not {device}")
        log.info("ignoring %s: measured on %s, serving on %s; using the taper", folder, policy.device, device)
        return None
    log.info("speculation policy from %s (%s): %s", folder, policy.measured_on, policy.rules)
    return policy


def auto_kind(cfg: EngineConfig, model_cfg: ModelConfig) -> str:
    """`speculative="auto"`: EAGLE-3 when a head for the model is there, unless the policy
    measured on this device type says plain decoding wins at every batch size."""
    from speculative.cache import TRAIN_HINT, has_head

    path = cfg.spec_head or head_dir(model_cfg.name)
    if not has_head(path):
        log.info("speculative decoding off: no EAGLE-3 head in %s (train one: %s)", path, TRAIN_HINT)
        return "off"
    policy = measured_policy(cfg, path)
    if policy is not None and all(spec is None for _, spec in policy.rules):
        log.info("speculative decoding off: the policy in %s (measured on %s) never speculates", path,
                 policy.measured_on or policy.device)
        return "off"
    return "eagle3"


class Speculator:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, model, ops, num_blocks: int):
        self.kind, self.ops = cfg.speculative, ops
        self.max_batch = cfg.spec_max_batch
        self.head = self.drafter = self.policy = None
        self.aux_layers: tuple[int, ...] = ()
        if self.kind == "eagle3":
            path = cfg.spec_head or head_dir(model_cfg.name)
            self.policy = measured_policy(cfg, path)
            self.head = load_head(path, model_cfg, model.embed_tokens.weight)
            # The head rotates q/k with the table as given: in its own dtype, so a bf16 head stays bf16
            # (drafts only; the target keeps its fp32 table).
            cos_sin = model.cos_sin.to(self.head.fc.weight.dtype)
            self.drafter = Drafter(self.head, cos_sin, num_blocks, cfg.block_size, ops)
            self.aux_layers = tuple(self.head.cfg.aux_layers)
        if self.kind == "eagle3":  # raises ValueError, naming the bounds, on an impossible tree shape
            TreeSpec(depth=cfg.spec_depth, top_k=cfg.spec_top_k, budget=cfg.spec_budget)
        if self.policy is not None:  # measured: it says where speculation stops paying
            self.max_batch = cfg.max_num_seqs
        self._specs = [None] + [self._for_batch(cfg, b) for b in range(1, self.max_batch + 1)]

    # -- draft shape per batch size -----------------------------------------------------------
    def _shape(self, cfg: EngineConfig, depth: int):
        if self.kind == "ngram":
            return NgramDrafter(k=depth)
        k = cfg.spec_top_k
        full = cfg.spec_budget or cfg.spec_depth
        budget = min(max(depth, round(full * depth / cfg.spec_depth)), k + (depth - 1) * k * k)
        return TreeSpec(depth=depth, top_k=k, budget=budget)

    def _for_batch(self, cfg: EngineConfig, batch: int):
        if self.policy is not None:
            return self._fit(cfg, batch, self.policy.for_batch(batch))
        depth = math.ceil(cfg.spec_depth * (self.max_batch + 1 - batch) / self.max_batch)
        while depth >= 1:
            spec = self._shape(cfg, depth)
            if batch * (1 + self.draft_tokens(spec)) <= cfg.max_num_batched_tokens:
                return spec
            depth -= 1
        return None

    def _fit(self, cfg: EngineConfig, batch: int, spec: TreeSpec | None) -> TreeSpec | None:
        """`spec`, made shallower (and its budget smaller) until `batch` trees fit the step's token budget."""
        while spec is not None and batch * (1 + spec.budget) > cfg.max_num_batched_tokens:
            if spec.depth == 1:
                return None
            depth = spec.depth - 1
            budget = min(spec.budget - 1, spec.top_k + (depth - 1) * spec.top_k ** 2)
            spec = TreeSpec(depth=depth, top_k=spec.top_k, budget=max(depth, budget), sample=spec.sample)
        return spec

    def spec_for(self, num_decodes: int):
        """The draft shape when num_decodes sequences decode; None: decode plainly."""
        return self._specs[num_decodes] if 0 < num_decodes <= self.max_batch else None

    @staticmethod
    def draft_tokens(spec) -> int:
        """Draft tokens per speculating sequence (its tree has one more node, the root)."""
        return spec.budget if isinstance(spec, TreeSpec) else spec.k

    # -- EAGLE-3 head state -------------------------------------------------------------------
    def _sync(self, seq, start: int):
        """Before a forward computing seq's tokens from position `start`: entries
        [0, start] of the head must be committed or pending."""
        st = seq.draft_state
        if st is None or st.length + st.pending != start + 1:
            seq.draft_state = st = self.drafter.new_state(cached=start)
        return st

    def feed(self, batch: Batch, aux: torch.Tensor) -> None:
        """A plain step's features: aux (T, 3h), rows in batch order (before num_computed moves on)."""
        off = 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            self._sync(seq, seq.num_computed).add_features(aux[off : off + n])
            off += n

    # -- the speculating step -----------------------------------------------------------------
    @torch.inference_mode()
    def step(self, runner, batch: Batch) -> list[tuple[list[int], int]]:
        """Draft, verify in one forward, move the accepted KV. Per row: (tokens to
        append, accepted draft tokens among them). A speculating row gets its
        accepted drafts + the bonus token; a plain row its sampled token, or []
        when its chunk does not reach the end of the sequence. num_computed,
        token ids and blocks are left to the engine."""
        S, spec, seqs = batch.num_spec, batch.spec, batch.seqs
        dev = runner.device
        tables = runner.block_tables([s.block_table for s in seqs])
        if isinstance(spec, TreeSpec):
            states = [self._sync(s, s.num_computed) for s in seqs[:S]]
            trees = self.drafter.propose([s.token_ids for s in seqs[:S]], states, tables[:S], spec)
        else:
            trees = [spec.propose(s.token_ids) for s in seqs[:S]]

        ids, pos, slots, cu, prefix, masks = [], [], [], [0], [], []
        bs = runner.block_size
        for i, (seq, n) in enumerate(zip(seqs, batch.num_tokens)):
            start, table = seq.num_computed, seq.block_table
            if i < S:
                tree = trees[i]
                ids += tree.tokens
                pos += [start + d for d in tree.depths]
                masks.append(tree.ancestor_mask())
                n = len(tree)
            else:
                ids += seq.token_ids[start : start + n]
                pos += range(start, start + n)
                masks.append(torch.ones(n, n, dtype=torch.bool).tril())
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            cu.append(cu[-1] + n)
            prefix.append(start)
        mask = torch.zeros(cu[-1], max(m.shape[0] for m in masks), dtype=torch.bool)
        for i, m in enumerate(masks):
            mask[cu[i] : cu[i + 1], : m.shape[0]] = m
        cu_t = torch.tensor(cu, dtype=torch.int32, device=dev)
        prefix_t = torch.tensor(prefix, dtype=torch.int32, device=dev)
        ctx = Context(slot_mapping=torch.tensor(slots, device=dev), num_decode_tokens=0, decode_block_tables=None,
                      decode_seq_lens=None, extend_block_tables=tables, extend_cu_seqlens_q=cu_t,
                      extend_seq_lens=prefix_t + (cu_t[1:] - cu_t[:-1]), tree_mask=mask.to(dev),
                      tree_prefix_lens=prefix_t)
        out = runner.model(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), ctx, runner.kv_cache,
                           self.aux_layers)
        hidden, aux = (out[0], torch.cat(out[1], -1)) if self.aux_layers else (out, None)

        # Logits: every node of the trees, then the last token of plain rows that sample.
        sampling = [i for i in range(S, len(seqs)) if prefix[i] + batch.num_tokens[i] == len(seqs[i])]
        rows = list(range(cu[S])) + [cu[i + 1] - 1 for i in sampling]
        logits = runner.model.compute_logits(hidden[torch.tensor(rows, device=dev)]).float()
        target = self._target_tokens(runner, logits[: cu[S]], trees, seqs[:S], prefix[:S], cu)
        verdicts = [accept_greedy(t, target[cu[i] : cu[i + 1]]) for i, t in enumerate(trees)]
        sampled = runner.sample(logits[cu[S]:], [seqs[i] for i in sampling]).tolist() if sampling else []

        # Accepted node path[k] was written at slot root + path[k]; it belongs at root + k.
        src, dst = [], []
        for i, v in enumerate(verdicts):
            table, root = seqs[i].block_table, prefix[i]
            for a, b in v.kv_moves(root):
                src.append(table[a // bs] * bs + a % bs)
                dst.append(table[b // bs] * bs + b % bs)
        runner.move_kv(src, dst)

        if aux is not None:
            for i, seq in enumerate(seqs):
                if i < S:  # the accepted path's features, root first (entries n .. n + accepted)
                    seq.draft_state.add_features(aux[[cu[i] + j for j in verdicts[i].path]])
                else:
                    self._sync(seq, prefix[i]).add_features(aux[cu[i] : cu[i + 1]])

        results = [(v.tokens, v.num_accepted) for v in verdicts] + [([], 0)] * (len(seqs) - S)
        for i, tok in zip(sampling, sampled):
            results[i] = ([tok], 0)
        return results

    def _target_tokens(self, runner, logits, trees, seqs, roots, cu) -> list[int]:
        """The token plain decoding would emit after each tree node (rows packed as the trees)."""
        tokens = logits.argmax(-1)
        hot = [i for i, s in enumerate(seqs) if s.sampling.temperature > 0]
        if hot:
            rows, temps, top_ks, top_ps, seeds, pos = [], [], [], [], [], []
            for i in hot:
                sp, tree = seqs[i].sampling, trees[i]
                rows += range(cu[i], cu[i + 1])
                temps += [sp.temperature] * len(tree)
                top_ks += [sp.top_k] * len(tree)
                top_ps += [sp.top_p] * len(tree)
                seeds += [seqs[i].seed] * len(tree)
                pos += [roots[i] + d + 1 for d in tree.depths]  # the position of the token drawn
            dev = logits.device

            def t(x, dtype):
                return torch.tensor(x, dtype=dtype, device=dev)

            idx = t(rows, torch.int64)
            tokens[idx] = self.ops.sample(logits[idx], t(temps, torch.float32), t(top_ks, torch.int32),
                                          t(top_ps, torch.float32), t(seeds, torch.int64), t(pos, torch.int64))
        return tokens.tolist()
