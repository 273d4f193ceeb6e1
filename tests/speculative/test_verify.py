"""Acceptance rules: greedy walks, KV moves, and losslessness of rejection
sampling on a synthetic target/draft pair (chi-square, fixed seeds), with the
biased rules the test must catch."""

import itertools
import random

import pytest
import torch

from speculative.drafting import DraftTree, chain
from speculative.verify import ACCEPT_STREAM, Verdict, accept_greedy, accept_sampling, gumbel_draw, hashed_uniforms
from tests.speculative.util import chi_square_rejects


def test_greedy_takes_the_longest_matching_path_whatever_its_branch():
    #        0:root(7)
    #       /         \
    #   1:(3)        2:(4)
    #   /   \          |
    # 3:(5) 4:(6)    5:(1)
    tree = DraftTree([7, 3, 4, 5, 6, 1], [-1, 0, 0, 1, 1, 2])
    # target: after root -> 4, after node 2 -> 1, after node 5 -> 9 (bonus)
    v = accept_greedy(tree, [4, 0, 1, 0, 0, 9])
    assert v.path == [0, 2, 5] and v.tokens == [4, 1, 9] and v.num_accepted == 2
    assert v.kv_moves(100) == [(102, 101), (105, 102)]
    v = accept_greedy(tree, [3, 6, 0, 0, 8, 0])
    assert v.path == [0, 1, 4] and v.tokens == [3, 6, 8] and v.kv_moves(0) == [(4, 2)]
    v = accept_greedy(tree, [2, 0, 0, 0, 0, 0])  # nothing accepted: the bonus is the target's argmax
    assert v == Verdict([0], [2]) and v.kv_moves(5) == []


# -- losslessness -------------------------------------------------------------------------------
V, L = 4, 2  # synthetic vocabulary, tokens per sample (their joint law: V**L cells)
g = torch.Generator().manual_seed(11)


def random_rows():
    x = -torch.rand(V, V, generator=g).log()  # Dirichlet(1) rows, sharpened
    return x**2 / (x**2).sum(-1, keepdim=True)


P = random_rows()  # target: a Markov chain p(x | last)
Q = random_rows()  # draft: a different one
ROOT = 2


Q_ROWS = Q.tolist()


def sampled_chain(tokens, seed, depth=2):
    """Drafts x_k ~ Q(. | x_{k-1}), independent of the verifier's uniforms."""
    rng = random.Random(seed * 1000 + len(tokens))
    drafts, qs, last = [], [torch.zeros(V)], tokens[-1]
    for k in range(depth):
        x = rng.choices(range(V), weights=Q_ROWS[last])[0]
        drafts.append(x)
        qs.append(Q[last])
        last = x
    return chain(tokens[-1], drafts, q=torch.stack(qs))


def topk_tree(tokens, seed):
    """Deterministic tree: the root's two most likely drafts, each with its best child."""
    last = tokens[-1]
    a, b = Q[last].topk(2).indices.tolist()
    return DraftTree([last, a, b, int(Q[a].argmax()), int(Q[b].argmax())], [-1, 0, 0, 1, 2])


def target_probs(tree):
    return P[torch.tensor(tree.tokens)]  # row i: the target's distribution after node i


def lossless(tree, seed, root):
    return accept_sampling(tree, target_probs(tree), seed, root)


def always_accept(tree, seed, root):
    """Biased: keep every draft of the first branch."""
    path = [0]
    kids = tree.children()
    while kids[path[-1]]:
        path.append(kids[path[-1]][0])
    p = target_probs(tree)[path[-1]]
    bonus = int(gumbel_draw(p[None], torch.tensor([seed]), torch.tensor([root + len(path)]))[0])
    return Verdict(path, [tree.tokens[i] for i in path[1:]] + [bonus])


def no_residual(tree, seed, root):
    """Biased: accept with min(1, p/q) but, on rejection, draw from p instead of (p - q)+."""
    p = target_probs(tree)
    path, tokens = [0], []
    for i in range(1, len(tree)):
        x, pos = tree.tokens[i], torch.tensor([root + i])
        u = float(hashed_uniforms(torch.tensor([seed]), pos, ACCEPT_STREAM, 1)[0, 0])
        if u * float(tree.q[i, x]) >= float(p[i - 1, x]):
            return Verdict(path, tokens + [int(gumbel_draw(p[i - 1][None], torch.tensor([seed]), pos)[0])])
        path.append(i)
        tokens.append(x)
    bonus = gumbel_draw(p[-1][None], torch.tensor([seed]), torch.tensor([root + len(tree)]))
    return Verdict(path, tokens + [int(bonus[0])])


def emitted_counts(draft, rule, n_samples) -> dict:
    """{tokens emitted after the root, first L: count} over n_samples seeds."""
    counts: dict = {}
    for seed in range(n_samples):
        tokens = [ROOT]
        while len(tokens) < 1 + L:
            tree = draft(tokens, seed)
            tokens += rule(tree, seed, len(tokens) - 1).tokens
        cell = tuple(tokens[1 : 1 + L])
        counts[cell] = counts.get(cell, 0) + 1
    return counts


def target_law() -> dict:
    """The target's joint law of L tokens after ROOT."""
    law = {}
    for cell in itertools.product(range(V), repeat=L):
        p, last = 1.0, ROOT
        for t in cell:
            p, last = p * float(P[last, t]), t
        law[cell] = p
    return law


N = 2000


@pytest.mark.parametrize("draft", [sampled_chain, topk_tree])
def test_rejection_sampling_is_lossless(draft):
    assert not chi_square_rejects(emitted_counts(draft, lossless, N), target_law())


@pytest.mark.parametrize("rule", [always_accept, no_residual])
def test_the_chi_square_check_catches_a_biased_rule(rule):
    assert chi_square_rejects(emitted_counts(sampled_chain, rule, N), target_law())


def test_sampling_is_reproducible_and_uses_the_plain_samplers_stream_when_nothing_is_drafted():
    tree = sampled_chain([ROOT], seed=5)
    assert lossless(tree, 5, 0) == lossless(tree, 5, 0)
    # A lone root: the bonus draw is the plain sampler's Gumbel-max on u(seed, position).
    from kernels.sampling import sample_ref

    logits = torch.randn(1, 50, generator=g)
    p = torch.softmax(logits, -1)
    for seed in range(20):
        v = accept_sampling(DraftTree([1], [-1]), p, seed, 7)
        ref = sample_ref(logits, torch.tensor([1.0]), torch.tensor([0]), torch.tensor([1.0]), torch.tensor([seed]),
                         torch.tensor([8]))
        assert v.tokens == [int(ref[0])]


def random_tree(rng: random.Random, n: int, vocab: int) -> DraftTree:
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    return DraftTree([rng.randrange(vocab) for _ in range(n)], parents)


def test_greedy_on_the_device_is_the_host_walk():
    """accept_greedy_rows: the verdict of accept_greedy for every tree of a batch (small vocab:
    long paths, branches taken off the first child), in (accepted, path, tokens) form."""
    from speculative.verify import accept_greedy_rows

    rng = random.Random(3)
    for n in (1, 2, 5, 11):
        trees = [random_tree(rng, n, 3) for _ in range(40)]
        target = [[rng.randrange(3) for _ in range(n)] for _ in trees]
        depth = max(max(t.depths) for t in trees)
        acc, path, toks = accept_greedy_rows(torch.tensor([t.tokens for t in trees]),
                                             torch.tensor([t.parents for t in trees]), torch.tensor(target), depth)
        for b, tree in enumerate(trees):
            v = accept_greedy(tree, target[b])
            a = int(acc[b])
            assert a == v.num_accepted and path[b, : a + 1].tolist() == v.path and toks[b, : a + 1].tolist() == v.tokens
        assert acc.max() >= 2 or n < 5


def test_rejection_sampling_on_the_device_is_the_host_rule():
    """accept_sampling_chains: accept_sampling's verdict on sampled chains of each depth, seeds
    and roots apart, the bonus draws included (from the residual and past the last node)."""
    from speculative.verify import accept_sampling_chains

    g = torch.Generator().manual_seed(0)
    V, B = 6, 64
    for d in (1, 3):
        p = torch.softmax(torch.randn(B, d + 1, V, generator=g) * 1.5, -1)
        q = torch.softmax(torch.randn(B, d + 1, V, generator=g) * 1.5, -1)
        q[:, 0] = 0
        tokens = torch.cat([torch.zeros(B, 1, dtype=torch.long), torch.multinomial(q[:, 1:].flatten(0, 1), 1,
                                                                                   generator=g).view(B, d)], 1)
        seeds, roots = torch.arange(B) * 7 + 1, torch.arange(B) % 5 + 3
        acc, path, toks = accept_sampling_chains(tokens, q, p, seeds, roots)
        seen = set()
        for b in range(B):
            v = accept_sampling(chain(0, tokens[b, 1:].tolist(), q=q[b]), p[b], int(seeds[b]), int(roots[b]))
            a = int(acc[b])
            assert a == v.num_accepted and path[b, : a + 1].tolist() == v.path and toks[b, : a + 1].tolist() == v.tokens
            seen.add(a)
        assert seen == set(range(d + 1))  # every outcome, the bonus past the last node too


def test_target_probs_is_the_samplers_law_without_host_reads():
    """target_probs (rejection sampling's p on the device) equals kernels.sampling.probs_ref:
    exactly where the vocabulary is at most 1,024 wide (the same sort), to rounding beyond it;
    greedy, top-k, top-p, both and neither, rows side by side."""
    from kernels.sampling import probs_ref
    from speculative.verify import target_probs

    g = torch.Generator().manual_seed(1)
    temp = torch.tensor([0.0, 0.7, 1.0, 1.3, 0.9, 1.0])
    top_k = torch.tensor([0, 0, 5, 0, 40, 1])
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.5, 0.8, 1.0])
    for v, exact in ((97, True), (1024, True), (5000, False)):
        logits = torch.randn(6, v, generator=g) * 3
        got, ref = target_probs(logits, temp, top_k, top_p), probs_ref(logits, temp, top_k, top_p)
        assert torch.equal(got, ref) if exact else torch.allclose(got, ref, atol=1e-6)
        assert torch.equal(got > 0, ref > 0)  # the same kept set
