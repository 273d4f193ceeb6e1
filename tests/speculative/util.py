"""Shared builders: a tiny random target (4 layers, so the head's three feature
layers are distinct), a random EAGLE-3 head for it, an oracle drafter, and the
chi-square test the losslessness checks use."""

from __future__ import annotations

import math

import kernels
import torch

from replica.config import EngineConfig
from replica.model.runner import build_model
from speculative.drafting import DraftTree
from speculative.head import Eagle3Head, HeadConfig
from tests.replica.tiny import tiny_config, tiny_weights


def tiny_target(seed: int = 0, **kw):
    cfg = tiny_config(num_layers=4, **kw)
    return build_model(cfg, EngineConfig(), tiny_weights(cfg, seed=seed), kernels.ops("cpu"), 512)


def random_head(model, draft_vocab: int = 64, seed: int = 0) -> Eagle3Head:
    """An untrained head over a random subset of the target vocabulary."""
    g = torch.Generator().manual_seed(seed)
    cfg = HeadConfig.for_target(model.cfg, draft_vocab)
    torch.manual_seed(seed)
    head = Eagle3Head(cfg, model.embed_tokens.weight)
    head.d2t.copy_(torch.randperm(model.cfg.vocab_size, generator=g)[: cfg.draft_vocab_size].sort().values)
    return head.eval()


class OracleDrafter:
    """Knows the reference continuations and drafts a tree that hides the right
    token behind a wrong sibling and sometimes corrupts it, so verification
    accepts long paths that are not the tree's first branch (exercising KV moves
    and block release)."""

    def __init__(self, references: list[list[int]], depth: int = 4, vocab: int = 97):
        self.refs, self.depth, self.vocab = references, depth, vocab

    @property
    def lookahead(self) -> int:
        return 2 * self.depth

    def propose(self, tokens) -> DraftTree:
        n = len(tokens)
        ref = next((r for r in self.refs if r[:n] == list(tokens)), None)
        truth = ref[n : n + self.depth] if ref else []
        toks, parents, node = [tokens[-1]], [-1], 0
        for d, t in enumerate(truth):
            wrong = (t + 1 + d) % self.vocab
            good = t if (n + d) % 5 else wrong  # every fifth position the oracle is wrong
            toks += [wrong, good] if d % 2 == 0 else [good, wrong]
            parents += [node, node]
            node = len(toks) - 1 if d % 2 == 0 else len(toks) - 2
        return DraftTree(toks, parents)


def chi_square_rejects(counts: dict, law: dict, z: float = 3.09) -> bool:
    """Pearson's test of counts (cell -> n) against a law (cell -> probability) at the
    0.1 % level (z: the normal quantile; Wilson-Hilferty approximation of chi2). Cells
    expecting fewer than 5 are pooled; any count in a cell the law gives 0 rejects."""
    n = sum(counts.values())
    if any(law.get(cell, 0.0) == 0.0 for cell, k in counts.items() if k):
        return True
    kept = [cell for cell, p in law.items() if p * n >= 5]
    obs = [counts.get(cell, 0) for cell in kept]
    exp = [law[cell] * n for cell in kept]
    if n - sum(exp) > 1e-6:  # the pooled rare cells
        obs.append(n - sum(obs))
        exp.append(n - sum(exp))
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(obs) - 1
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat > critical
