"""Prompt-lookup (n-gram) drafting: code edits, refactors, quoting and
autocomplete repeat spans of their own context, and the context predicts them.

Find the most recent earlier occurrence of the sequence's last n tokens (n from
max_n down to min_n) and propose the k tokens that followed it. No model and no
state: the drafts are a pure function of the token ids, picked
deterministically, so verification treats them as point-mass proposals (lossless
at any temperature, see speculative.verify).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from speculative.drafting import DraftTree, chain


def lookup(tokens, k: int, max_n: int = 4, min_n: int = 2) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the longest suffix
    n-gram (max_n >= n >= min_n); [] when no suffix of length min_n recurs."""
    ids = np.asarray(tokens, dtype=np.int64)
    L = len(ids)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(ids[: L - 1], n)  # starts 0 .. L-1-n
        hits = np.flatnonzero((windows == ids[L - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the latest match, continued
            return ids[start : start + k].tolist()
    return []


@dataclass(frozen=True)
class NgramDrafter:
    k: int = 5  # draft tokens per round at most
    max_n: int = 4
    min_n: int = 2

    def __post_init__(self):
        if not 1 <= self.min_n <= self.max_n or self.k < 1:
            raise ValueError(f"NgramDrafter needs 1 <= min_n <= max_n and k >= 1, got {self}")

    @property
    def lookahead(self) -> int:
        return self.k

    def propose(self, tokens) -> DraftTree:
        """A chain rooted at the newest token (possibly with no drafts)."""
        return chain(int(tokens[-1]), lookup(tokens, self.k, self.max_n, self.min_n))
