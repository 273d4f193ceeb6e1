"""Prompt-lookup drafting."""

import pytest

from speculative.ngram import NgramDrafter, lookup


def test_longest_suffix_match_proposes_what_followed_it():
    ids = [1, 2, 3, 4, 5, 6, 9, 9, 3, 4, 5]
    assert lookup(ids, k=3, max_n=3, min_n=1) == [6, 9, 9]  # "3 4 5" recurs: continue it
    assert lookup(ids, k=10, max_n=3, min_n=1) == [6, 9, 9, 3, 4, 5]  # up to the end of the context


def test_latest_match_wins_and_longer_ngrams_first():
    ids = [7, 8, 1, 7, 8, 2, 5, 8, 3, 7, 8]
    assert lookup(ids, k=1, max_n=2, min_n=1) == [2]  # "7 8" last seen before 2
    assert lookup([5, 8, 3, 9, 9, 8], k=1, max_n=2, min_n=1) == [3]  # no "9 8" bigram: unigram "8"


def test_no_match_no_drafts():
    assert lookup([1, 2, 3, 4], k=4) == []
    assert lookup([1], k=4) == []
    assert lookup([4, 4], k=3, min_n=1) == [4]
    tree = NgramDrafter(k=4).propose([1, 2, 3, 4])
    assert tree.tokens == [4] and tree.parents == [-1]


def test_drafter_returns_a_chain():
    code = "def f(x):\n    return x + 1\n\ndef g(x):\n    return x".split()
    ids = [hash(w) % 1000 for w in code]
    tree = NgramDrafter(k=3, max_n=3, min_n=1).propose(ids)
    assert tree.tokens[0] == ids[-1] and tree.parents == list(range(-1, len(tree) - 1)) and len(tree) == 4
    with pytest.raises(ValueError):
        NgramDrafter(min_n=3, max_n=2)
