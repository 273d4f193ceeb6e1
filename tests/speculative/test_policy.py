"""Speculation by batch size: the fastest measured configuration wins."""

from speculative.tree_spec import TreeSpec
from speculative.policy import SpecPolicy


def test_policy_from_measured_rates_and_roundtrip(tmp_path):
    tree, chain = TreeSpec(depth=5, top_k=4, budget=16), TreeSpec.chain(3)
    rates = {1: {None: 10.0, chain: 17.0, tree: 21.0}, 4: {None: 30.0, chain: 36.0, tree: 29.0},
             16: {None: 90.0, chain: 60.0, tree: 41.0}}
    policy = SpecPolicy.from_rates(rates, "cuda", "NVIDIA H100")
    assert [policy.for_batch(b) for b in (1, 2, 3, 4, 8, 15, 16, 64)] == [tree] * 3 + [chain] * 3 + [None] * 2
    assert policy.save(tmp_path).name == "policy.json"
    assert SpecPolicy.load(tmp_path) == policy and policy.device == "cuda"
    assert SpecPolicy.load(tmp_path / "none") is None
    close = SpecPolicy.from_rates({1: {None: 34.6, chain: 34.8}, 4: {None: 30.0, chain: 31.6}})
    assert close.rules == ((1, None), (4, chain))  # +0.6 %: noise, plain decoding; +5.3 %: speculate


def test_a_policy_in_words():
    tree, chain = TreeSpec(depth=5, top_k=4, budget=16), TreeSpec.chain(3)
    assert SpecPolicy(((1, tree), (4, chain), (16, None))).describe() == \
        "on at batch 1-3 (tree of 16, depth 5), on at batch 4-15 (chain of 3), off from 16"
    assert SpecPolicy(((1, TreeSpec.chain(2, sample=True)), (2, None))).describe() == \
        "on at batch 1 (chain of 2, sampled drafts), off from 2"
    assert SpecPolicy(((1, None), (4, chain))).describe() == "off at batch 1-3, on from batch 4 (chain of 3)"
    assert SpecPolicy(((1, None), (16, None))).describe() == "off at every batch size measured"
