"""Comparing two greedy decodes that may round differently (bf16 on a GPU: a CUDA graph
padded to its bucket, or a batch of another size, can pick other GEMM kernels).

Two paths computing the same function agree token for token, except where the
greedy choice is a near-tie that rounding can flip; from there on they may
diverge freely. `check_same_or_near_tie` accepts a difference only at such a tie."""

from __future__ import annotations

import torch

# bf16 keeps 8 significant bits: a logit of size s is known to about s * 2^-8 after one
# rounding, and a forward rounds many times; two logits closer than this (relative to
# the row's largest) are a tie a different kernel may break the other way.
BF16_TIE = 2.0**-5


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where the two token lists differ (a shorter list differs at its end)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_same_or_near_tie(got: list[int], want: list[int], want_logits: list[torch.Tensor], what: str,
                           rel: float = BF16_TIE) -> None:
    """got == want, or at the first difference the reference's logits (want_logits[i]:
    the logits `want[i]` was chosen from) hold both tokens within `rel` of the row's scale."""
    i = first_difference(got, want)
    if i is None:
        return
    assert i < len(want) and i < len(got), f"{what}: lengths differ ({len(got)} vs {len(want)})"
    row = want_logits[i].float()
    gap = (row[want[i]] - row[got[i]]).item()
    scale = row.abs().max().item()
    assert gap <= rel * scale, (f"{what}: token {i} is {got[i]}, the reference chose {want[i]} by a margin of "
                                f"{gap:.4g} (row scale {scale:.4g}, tie tolerance {rel * scale:.4g}): not a near-tie")
