"""The shape of a speculation round (a chain or an EAGLE-2 tree), without torch: the
policy (speculative/policy.py) and the launcher read it; drafting (speculative/drafting.py)
builds the trees."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TreeSpec:
    depth: int  # draft tokens on the longest path
    top_k: int = 1  # children per expanded node, and nodes expanded per level
    budget: int = 0  # draft tokens kept after reranking (0: depth, i.e. a chain)
    sample: bool = False  # chains only: draw drafts from the head's q at the request's temperature

    def __post_init__(self):
        if self.budget == 0:
            object.__setattr__(self, "budget", self.depth)
        if self.depth < 1 or self.top_k < 1:
            raise ValueError(f"TreeSpec needs depth >= 1 and top_k >= 1, got {self}")
        if not self.depth <= self.budget <= self.num_candidates:
            raise ValueError(f"budget must be in [depth, {self.num_candidates}] for depth {self.depth}, "
                             f"top_k {self.top_k}; got {self.budget}")
        if self.sample and self.top_k != 1:
            raise ValueError("sampled drafts are for chains (top_k = 1); trees pick their top-k deterministically")

    @classmethod
    def chain(cls, k: int, sample: bool = False) -> TreeSpec:
        return cls(depth=k, top_k=1, budget=k, sample=sample)

    @property
    def num_candidates(self) -> int:
        return self.top_k + (self.depth - 1) * self.top_k**2

    @property
    def lookahead(self) -> int:
        """Positions past the newest token a round writes: the target's drafts at
        n .. n-1+budget, the head's draft entries at n .. n-1+top_k*(depth-1)."""
        return max(self.budget, self.top_k * (self.depth - 1))
