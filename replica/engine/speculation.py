"""Speculative decoding inside continuous batching: the engine's side of speculative/.

The Speculator drafts and accepts; the Runner runs every forward. A speculating step:

  1. `draft(batch)`: a tree per speculating decode (rows [0, batch.num_spec)) rooted at
     its newest token x_{n-1} (EAGLE-3 chains or EAGLE-2 trees, on the device as
     speculative.drafting.Drafts; n-gram lookup as host trees);
  2. the engine plans the step with the trees (replica.model.plan: device trees by
     placeholders, `draft_rows`) and the Runner verifies them in one forward with every
     other row (prefill chunks, plain decodes), sampling after every node the token plain
     decoding would emit there;
  3. `accept(batch, trees, plan, out)`: per sequence the longest accepted path plus a
     bonus token, and the KV moves that make the accepted nodes contiguous (slot n-1+k
     for depth k). The engine has the Runner move them, appends the tokens (stop checks
     per token) and truncates the blocks past the new length, so rejected drafts' slots
     go back to the pool.

One host read per step. With device drafts, acceptance, the KV moves and the head's
features are tensor work (`_accept_drafts`), and a single copy brings back what the host
needs: the accepted counts, the tokens to emit and the plain rows' tokens; host data
(block tables, token ids, lengths) goes up with non-blocking copies. Host trees (n-gram)
read the sampled tokens once. Grammar-constrained rows and tensor parallelism read the
device drafts first (masks and the broadcast plan are host data), a second read.

Graphs. Where the Runner's decode steps replay graphs (CUDA; graph_mode "buffers" runs the
same padded path eagerly on CPU), so do the head's draft levels, one replay a round per
(batch bucket, shape), its commit (the head over the verified tokens' features, right-aligned
in a power-of-two number of slots a row, up to 8; more commit eagerly)
(replica.model.spec_draft_graphs), and a verify whose every row is a device tree
(replica.model.spec_graphs, T = budget + 1 tokens a row, captured at start for each T
`verify_nodes` names). A verify beside prefill chunks or plain rows runs eagerly.

EAGLE-3 keeps a HeadState per sequence fed with the target's features (residual
streams after head.cfg.aux_layers) of every token the target computes -- prefill
chunks and plain decodes included (`feed`) -- so the head stays in step when
speculation pauses. A state out of step (a new or preempted sequence) restarts at
the tokens already in the KV cache (`Drafter.new_state(cached=...)`): drafts may be
worse for a round, output never changes. The head's KV layer lives in the Runner's
pool (`Runner.draft_kv`, bound with `bind_kv`).

Acceptance. Deterministic drafts (n-gram, top-k trees, greedy chains): a draft is
kept iff it equals the token the Runner's sampler drew after its parent -- argmax
for greedy rows, u(seed, position of the token) for the others
(speculative.verify.accept_greedy). That keeps child x with probability p(x), as
rejection sampling with a point-mass proposal does, and the output is token for
token the non-speculative output: a seeded request does not depend on the batch it
ran in nor on the draft depth that batch got. Sampled drafts (cfg.spec_sample:
EAGLE-3 chains drawn from the head's q at the request's temperature): multi-round
rejection sampling, keep x with probability min(1, p(x)/q(x)), else draw from
(p - q)+ (speculative.verify.accept_sampling): lossless and reproducible per seed,
but not the plain decoder's tokens.

Policy (what a step of b decoding sequences drafts), in order:
  * EAGLE-3 with cfg.spec_policy "auto" and a policy.json beside the head measured
    on this device type (`bench/speculative.py --write-policy`, which times this
    engine): the fastest measured configuration for b, none where plain decoding
    measured faster;
  * otherwise the taper: full depth (cfg.spec_depth) at batch 1, tapering
    linearly to one draft token at cfg.spec_max_batch, off above.
Either way, never more draft tokens than the step's token budget allows for every
decode (the depth shrinks until b x (1 + drafts) fits, else plain decoding).
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch

from replica.config import EngineConfig, ModelConfig
from replica.model.plan import StepPlan, slot
from replica.model.spec_draft_graphs import DraftGraphs
from speculative.cache import head_dir
from speculative.drafting import DraftTree, Drafter, Drafts, upload
from speculative.tree_spec import TreeSpec
from speculative.loading import load_head
from speculative.ngram import NgramDrafter
from speculative.policy import SpecPolicy
from speculative.verify import (Verdict, accept_greedy, accept_greedy_rows, accept_sampling, accept_sampling_chains,
                                target_probs)

log = logging.getLogger("replica.engine.speculation")


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
    """`speculative="auto"`: EAGLE-3 only where the head's policy, measured on this device
    type, speculates at some batch size (speculative.policy.auto_choice); "taper" or a policy
    folder named in cfg.spec_policy is the operator's explicit choice for a head that is there."""
    from speculative.cache import TRAIN_HINT, has_head
    from speculative.policy import auto_choice

    path = cfg.spec_head or head_dir(model_cfg.name)
    if cfg.spec_policy == "auto":
        kind, why = auto_choice(path, cfg.device.split(":")[0])
        log.info("speculative decoding %s: %s", "on" if kind == "eagle3" else "off", why)
        return kind
    if not has_head(path):
        log.info("speculative decoding off: no EAGLE-3 head in %s (train one: %s)", path, TRAIN_HINT)
        return "off"
    policy = measured_policy(cfg, path)
    if policy is not None and all(spec is None for _, spec in policy.rules):
        log.info("speculative decoding off: the policy in %s (measured on %s) never speculates", cfg.spec_policy,
                 policy.measured_on or policy.device)
        return "off"
    return "eagle3"


class Speculator:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, embed_weight: torch.Tensor, ops):
        """embed_weight: the target's embedding (an EAGLE-3 head shares it)."""
        self.kind, self.ops, self.block_size = cfg.speculative, ops, cfg.block_size
        self.model_cfg = model_cfg
        self.max_batch = cfg.spec_max_batch
        self.threads = cfg.engine_threads()  # the C++ head step's, as the target step's
        self.sample = cfg.spec_sample
        self.head = self.drafter = self.policy = None
        self.aux_layers: tuple[int, ...] = ()  # the target features the head reads (Runner.allocate_kv)
        self.keep_hidden = False  # (the aux-feature hook interface: the head needs no final hidden states)
        self.kv_shape: tuple[int, int] | None = None  # (Hkv, D) of the head's KV layer
        if self.kind == "eagle3":
            path = cfg.spec_head or head_dir(model_cfg.name)
            self.policy = measured_policy(cfg, path)
            self.head = load_head(path, model_cfg, embed_weight)
            self.aux_layers = tuple(self.head.cfg.aux_layers)
            self.kv_shape = self.head.kv_shape()
            TreeSpec(depth=cfg.spec_depth, top_k=cfg.spec_top_k, budget=cfg.spec_budget)  # ValueError if impossible
        if self.policy is not None:  # measured: it says where speculation stops paying
            self.max_batch = cfg.max_num_seqs
        self._specs = [None] + [self._for_batch(cfg, b) for b in range(1, self.max_batch + 1)]

    def bind_kv(self, kv: torch.Tensor, cos_sin: torch.Tensor, graphs=None) -> None:
        """The head's KV layer in the Runner's pool, and the target's rotary table (the head's
        own instead where its config has another rope: a published head's). graphs: the
        Runner's decode graphs (replica.model.graphs.DecodeGraphs) or None; with them the
        draft loop runs through DraftGraphs too, captured where they are."""
        own = self.head.cfg.rope_table(self.model_cfg, cos_sin.shape[0])
        table = cos_sin if own is None else own.to(cos_sin.device)
        # The head rotates q/k with the table in its own dtype, so a bf16 head stays bf16
        # (drafts only; the target keeps its fp32 table).
        dtype = self.head.fc.weight.dtype
        self.drafter = Drafter(self.head, table.to(dtype), kv, self.ops, self.threads)
        if graphs is not None:
            c = self.head.cfg
            self.drafter.graphs = DraftGraphs(c.hidden_size, c.draft_vocab_size, dtype, kv.device, graphs.buckets[-1],
                                              graphs.max_blocks, capture=bool(graphs.graphs))

    # -- draft shape per batch size -----------------------------------------------------------
    def _shape(self, cfg: EngineConfig, depth: int):
        if self.kind == "ngram":
            return NgramDrafter(k=depth)
        k = cfg.spec_top_k
        full = cfg.spec_budget or cfg.spec_depth
        budget = min(max(depth, round(full * depth / cfg.spec_depth)), k + (depth - 1) * k * k)
        return TreeSpec(depth=depth, top_k=k, budget=budget, sample=self.sample and k == 1)

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
        if spec is not None:
            spec = dataclasses.replace(spec, sample=self.sample and spec.top_k == 1)
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

    def verify_nodes(self) -> list[int]:
        """The tokens per row of every verify the head's drafts may make (budget + 1 per shape)."""
        return sorted({spec.budget + 1 for spec in self._specs if isinstance(spec, TreeSpec)})

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

    def feed(self, batch, out) -> None:
        """A plain step's features: out.aux (T, 3h), rows in batch order (before num_computed moves on)."""
        if out.aux is None:
            return
        off = 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            self._sync(seq, seq.num_computed).add_features(out.aux[off : off + n])
            off += n

    # -- the speculating step -----------------------------------------------------------------
    def draft(self, batch) -> Drafts | list[DraftTree]:
        """Draft trees for the speculating rows, rows [0, batch.num_spec): the head's on the
        device (Drafts), a host drafter's (n-gram, an oracle) as host trees."""
        seqs, spec = batch.seqs[: batch.num_spec], batch.spec
        if not isinstance(spec, TreeSpec):
            return [spec.propose(s.token_ids) for s in seqs]
        states = [self._sync(s, s.num_computed) for s in seqs]
        width = max(len(s.block_table) for s in seqs)
        tables = upload([s.block_table + [0] * (width - len(s.block_table)) for s in seqs], torch.int32,
                        self.drafter.k_cache.device)
        return self.drafter.draft([s.token_ids for s in seqs], states, tables, spec,
                                  [s.sampling.temperature for s in seqs], [s.seed for s in seqs])

    def accept(self, batch, trees: Drafts | list[DraftTree], plan: StepPlan, out) -> tuple[list, object, object]:
        """After the verify forward: per row (tokens to append, accepted draft tokens
        among them) -- a speculating row its accepted drafts + the bonus token, a plain
        row its sampled token, or [] when its chunk stops short of the sequence's end --
        and the KV moves (source slots, destination slots) the Runner must make: lists of
        slots for host trees, tensors on the device for Drafts (`_accept_drafts`).
        num_computed, token ids and blocks are left to the engine."""
        if isinstance(trees, Drafts):
            return self._accept_drafts(batch, trees, plan, out)
        S, seqs = len(trees), batch.seqs
        cu = [0]
        for n in plan.num_tokens:
            cu.append(cu[-1] + n)
        tokens = out.tokens.tolist()
        # Sampled drafts: rejection sampling against the target's sampling distribution p
        # at each node (one target_probs call for all of them); the others: the sampler's token.
        sampled = [i for i, t in enumerate(trees) if t.q is not None and seqs[i].sampling.temperature > 0]
        p = self._target_probs(out.logits, plan, [r for i in sampled for r in range(cu[i], cu[i + 1])])
        verdicts: list[Verdict] = []
        for i, tree in enumerate(trees):
            if sampled and sampled[0] == i:
                sampled.pop(0)
                verdicts.append(accept_sampling(tree, p[: len(tree)], seqs[i].seed, seqs[i].num_computed))
                p = p[len(tree) :]
            else:
                verdicts.append(accept_greedy(tree, tokens[cu[i] : cu[i + 1]]))

        # Accepted node path[k] was written at the slot of position root + path[k]; it belongs at root + k.
        src, dst = [], []
        for seq, v in zip(seqs, verdicts):
            for a, b in v.kv_moves(seq.num_computed):
                src.append(slot(seq.block_table, a, self.block_size))
                dst.append(slot(seq.block_table, b, self.block_size))

        if out.aux is not None:
            for i, seq in enumerate(seqs):
                if i < S:  # the accepted path's features, root first (entries n .. n + accepted)
                    seq.draft_state.add_features(out.aux[[cu[i] + j for j in verdicts[i].path]])
                else:
                    self._sync(seq, seq.num_computed).add_features(out.aux[cu[i] : cu[i + 1]])

        results = [(v.tokens, v.num_accepted) for v in verdicts] + [([], 0)] * (len(seqs) - S)
        for i, tok in zip(plan.sample_rows, tokens[cu[S]:]):
            results[i] = ([tok], 0)
        return results, src, dst

    def _accept_drafts(self, batch, drafts: Drafts, plan: StepPlan, out) -> tuple[list, torch.Tensor, torch.Tensor]:
        """`accept` for device trees, reading the host once: acceptance, the accepted nodes'
        KV moves and the head's features stay on the device; one copy brings back the
        accepted counts, the tokens they emit and the plain rows' tokens."""
        S, n, d, seqs, dev = len(drafts), drafts.nodes, drafts.depth, batch.seqs, out.tokens.device
        target = out.tokens[: S * n].view(S, n).long()  # the token plain decoding would emit after each node
        accepted, path, emitted = accept_greedy_rows(drafts.tokens, drafts.parents, target, d)
        hot = [i for i in range(S) if seqs[i].sampling.temperature > 0] if drafts.q is not None else []
        if hot:  # sampled drafts: rejection sampling against the target's law at each node
            idx = upload(hot, torch.int64, dev)
            p = self._target_probs(out.logits, plan, [i * n + j for i in hot for j in range(n)]).view(len(hot), n, -1)
            verdict = accept_sampling_chains(drafts.tokens[idx], drafts.q[idx], p,
                                             upload([seqs[i].seed for i in hot], torch.int64, dev),
                                             drafts.lens[idx] - 1)
            accepted, path, emitted = (x.index_copy(0, idx, v) for x, v in zip((accepted, path, emitted), verdict))
        # Accepted node path[k] was written at the slot of position root + path[k]; it belongs at
        # root + k. Past the accepted ones every slot moves onto itself (a fixed number of moves).
        k = torch.arange(d + 1, device=dev)
        root = (drafts.lens - 1)[:, None]
        src = self._slots(drafts.block_tables, root + torch.where(k <= accepted[:, None], path, k))
        dst = self._slots(drafts.block_tables, root + k)
        host = torch.cat([accepted, emitted.flatten().long(), out.tokens[S * n :].long()]).tolist()  # the one read
        counts, emitted, plain = host[:S], host[S : S * (d + 2)], host[S * (d + 2) :]

        results = [(emitted[i * (d + 1) : i * (d + 1) + a + 1], a) for i, a in enumerate(counts)]
        results += [([], 0)] * (len(seqs) - S)
        for i, tok in zip(plan.sample_rows, plain):
            results[i] = ([tok], 0)
        if out.aux is not None:  # the accepted path's features, root first (entries n .. n + accepted)
            aux = out.aux[: S * n].view(S, n, -1)
            kept = aux.gather(1, path[..., None].expand(S, d + 1, aux.shape[-1]))
            for i, a in enumerate(counts):
                seqs[i].draft_state.add_features(kept[i, : a + 1])
            off = S * n
            for seq, m in zip(seqs[S:], plan.num_tokens[S:]):
                self._sync(seq, seq.num_computed).add_features(out.aux[off : off + m])
                off += m
        return results, src.flatten(), dst.flatten()

    def _slots(self, tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(B, k) pool slots of each row's positions (B, k), its block table a row of tables."""
        bs = self.block_size
        return tables.gather(1, positions // bs).long() * bs + positions % bs

    @staticmethod
    def _target_probs(logits: torch.Tensor, plan: StepPlan, rows: list[int]) -> torch.Tensor | None:
        """(len(rows), V): the distributions the sampler draws logits rows `rows` from."""
        if not rows:
            return None
        ps, dev = [plan.sampling[r] for r in rows], logits.device
        temp = upload([p.temperature for p in ps], torch.float32, dev)
        top_k = upload([p.top_k for p in ps], torch.int64, dev)
        top_p = upload([p.top_p for p in ps], torch.float32, dev)
        return target_probs(logits[upload(rows, torch.int64, dev)], temp, top_k, top_p)
