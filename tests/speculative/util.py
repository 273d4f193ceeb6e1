"""Shared builders: a tiny random target (4 layers, so the head's three feature
layers are distinct), a random EAGLE-3 head for it, and an oracle drafter."""

from __future__ import annotations

import kernels
import torch

from replica.config import EngineConfig
from replica.runner import build_model
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
