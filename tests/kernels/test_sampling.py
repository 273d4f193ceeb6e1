"""Sampling: Triton and reference pick identical tokens, seeded randomness is a
function of (seed, position) only, greedy is argmax, and frequencies follow the
filtered distribution (chi-square with fixed seeds: deterministic, not flaky)."""

import math

import pytest
import torch

from kernels.sampling import probs_ref, sample_ref, uniforms_ref, unit_float
from tests.kernels.pool import DEVICES, triton_ops


def batch(b, v, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, v, generator=g) * 3
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.0, 1.0, 1.5, 0.5, 1.0, 1.0, 0.0, 2.0, 1.0])[:b]
    top_k = torch.tensor([0, 0, 0, 5, 50, 1, 0, 10, v, v + 5, 3, 0], dtype=torch.int32)[:b]
    top_p = torch.tensor([1.0, 1.0, 0.9, 1.0, 0.8, 1.0, 0.5, 0.95, 0.3, 1.0, 0.5, 0.0])[:b]
    seeds = torch.tensor([3, -1, 2**40 + 7, 0, 11, 12, 13, 14, 15, 16, 17, 2**62])[:b]
    positions = torch.arange(b, dtype=torch.int64) * 37 + 5
    return [x.to(device) for x in (logits, temperature, top_k, top_p, seeds, positions)]


def chi_square_ok(counts, probs, n):
    """Pearson chi-square against `probs` at p = 1e-4 (cells with expected < 5 pooled)."""
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = (((obs - exp) ** 2)[keep] / exp[keep]).sum().item()
    df = max(int(keep.sum()) - 1, 1)
    z = 3.719  # one-sided normal quantile for 1e-4; Wilson-Hilferty for the chi-square quantile
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < crit, stat, crit


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [1000, 5000])  # 5000: two 4096-wide blocks per pass
def test_triton_matches_reference(device, vocab):
    args = batch(12, vocab, device)
    out = triton_ops(device).sample(*args)
    assert out.dtype == torch.int64
    assert torch.equal(out.cpu(), sample_ref(*[a.cpu() for a in args]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["triton", "ref"])
def test_seeded_tokens_independent_of_batch(device, impl):
    sample = triton_ops(device).sample if impl == "triton" else sample_ref
    if impl == "ref" and device == "cuda":
        pytest.skip("reference runs on CPU")
    args = batch(8, 300, device)
    together = sample(*args)
    for i in range(8):
        alone = sample(*[a[i : i + 1] for a in args])
        assert alone.item() == together[i].item()
    perm = torch.tensor([5, 2, 7, 0, 1, 6, 3, 4], device=device)
    assert torch.equal(sample(*[a[perm] for a in args]), together[perm])
    # a different position (the next token) changes the draw
    later = list(args)
    later[5] = args[5] + 1
    assert not torch.equal(sample(*later)[args[1] > 0], together[args[1] > 0])


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax(device):
    logits, _, top_k, top_p, seeds, positions = batch(12, 700, device, seed=3)
    logits[0, 10] = logits[0, 20] = logits[0].max() + 1  # a tie: the first index wins
    temperature = torch.zeros(12, device=device)
    expected = logits.argmax(-1)
    assert expected[0].item() == 10
    assert torch.equal(triton_ops(device).sample(logits, temperature, top_k, top_p, seeds, positions), expected)
    assert torch.equal(sample_ref(logits.cpu(), temperature.cpu(), top_k.cpu(), top_p.cpu(), seeds.cpu(),
                                  positions.cpu()), expected.cpu())  # fmt: skip


def test_filter_semantics():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 5))
    temperature = torch.ones(5)
    top_k = torch.tensor([0, 0, 0, 2, 0], dtype=torch.int32)
    top_p = torch.tensor([0.6, 0.5, 0.81, 1.0, 0.0])
    support = probs_ref(logits, temperature, top_k, top_p) > 0
    assert support.tolist() == [
        [True, True, False, False],  # mass before token 1 is 0.5 < 0.6: keep; 0.8 >= 0.6: stop
        [True, False, False, False],  # {0} already reaches 0.5
        [True, True, True, False],
        [True, True, False, False],  # top-2
        [True, False, False, False],  # top_p 0: at least the top token
    ]
    tied = torch.tensor([[2.0, 1.0, 1.0, 0.0]])  # ties with the k-th value are kept
    assert (probs_ref(tied, torch.ones(1), torch.tensor([2], dtype=torch.int32), torch.ones(1)) > 0).tolist() == [
        [True, True, True, False]
    ]


def test_uniforms_are_uniform():
    u = uniforms_ref(torch.arange(64), torch.full((64,), 9), torch.arange(4096)).flatten()
    assert 0 < u.min() and u.max() < 1
    counts = torch.histc(u, bins=64, min=0, max=1)
    ok, stat, crit = chi_square_ok(counts, torch.full((64,), 1 / 64), u.numel())
    assert ok, (stat, crit)


def test_the_largest_hash_is_not_a_uniform_of_one():
    # (2^24 - 1 + 0.5) / 2^24 rounds to 1.0 in fp32, where the Gumbel noise is +inf.
    u = unit_float(torch.tensor([0xFFFFFFFF, 0xFFFFFEFF, 0], dtype=torch.int64))
    g = -torch.log(-torch.log(u))
    assert u.max() < 1 and torch.isfinite(g).all() and g[0] >= g[1]


def test_an_impossible_token_is_never_sampled_over_a_real_vocabulary():
    """One token holds all the mass (the others are 30 nats below). With a uniform of 1.0
    reachable, one step in ~340 over 49,152 tokens sampled a random one: ~12 of these
    4,000 draws."""
    v, n = 49152, 4000
    logits = torch.full((1, v), -30.0)
    logits[0, 7] = 0.0
    for start in range(0, n, 200):
        b = 200
        tokens = sample_ref(logits.expand(b, v), torch.ones(b), torch.zeros(b, dtype=torch.int32), torch.ones(b),
                            torch.arange(start, start + b) * 7919, torch.arange(start, start + b))
        assert (tokens == 7).all(), tokens[tokens != 7]


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 8, 1.0), (1.3, 0, 0.7), (1.0, 12, 0.9)])
def test_reference_frequencies_match_probs(temperature, top_k, top_p):
    n, v = 20000, 40
    logits = (torch.randn(1, v, generator=torch.Generator().manual_seed(5)) * 1.5).expand(n, v)
    args = (torch.full((n,), temperature), torch.full((n,), top_k, dtype=torch.int32), torch.full((n,), top_p))
    tokens = sample_ref(logits, *args, torch.arange(n), torch.full((n,), 123))
    probs = probs_ref(logits[:1], *(a[:1] for a in args))[0]
    counts = torch.bincount(tokens, minlength=v).float()
    assert counts[probs == 0].sum() == 0  # never a filtered-out token
    ok, stat, crit = chi_square_ok(counts, probs, n)
    assert ok, (stat, crit)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_frequencies_match_probs(device):
    """Unfiltered rows only (the interpreter is slow); filtered rows are covered by
    token-for-token identity with the reference above."""
    n, v = 300, 5
    logits = torch.randn(1, v, generator=torch.Generator().manual_seed(6)).expand(n, v).contiguous().to(device)
    temperature = torch.full((n,), 0.8, device=device)
    top_k = torch.zeros(n, dtype=torch.int32, device=device)
    top_p = torch.ones(n, device=device)
    tokens = triton_ops(device).sample(logits, temperature, top_k, top_p, torch.arange(n, device=device),
                                       torch.full((n,), 7, device=device))  # fmt: skip
    probs = probs_ref(logits[:1].cpu(), temperature[:1].cpu(), top_k[:1].cpu(), top_p[:1].cpu())[0]
    ok, stat, crit = chi_square_ok(torch.bincount(tokens.cpu(), minlength=v).float(), probs, n)
    assert ok, (stat, crit)


def test_candidate_shortcut_matches_full_sort():
    """The reference's top-`width` shortcut keeps exactly what a full sort keeps,
    including when it must fall back (flat rows, ties at the boundary)."""
    from kernels.sampling import _kept

    g = torch.Generator().manual_seed(8)
    x = torch.cat([torch.randn(6, 300, generator=g) * 6, torch.randn(6, 300, generator=g) * 0.1])
    x[0, :20] = x[0].max() + 1  # a 20-way tie at the top
    t = torch.rand(12, 1, generator=g) + 0.3
    top_k = torch.tensor([0, 5, 0, 30, 3, 0, 0, 5, 0, 30, 3, 299], dtype=torch.int32)
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.2, 0.99, 0.9, 1.0, 0.5, 0.95, 0.2, 0.7])
    _, n_full, thr_full = _kept(x, t, top_k, top_p, width=300)
    assert n_full[0].item() >= 20
    shortcut = 0
    for i in range(12):  # row by row, so one flat row does not send the batch to the full sort
        si, n_fast, thr_fast = _kept(x[i : i + 1], t[i : i + 1], top_k[i : i + 1], top_p[i : i + 1], width=8)
        assert thr_fast.item() == thr_full[i].item() and n_fast.item() == n_full[i].item()
        shortcut += si.shape[1] < 300
    assert shortcut >= 4


def test_unfiltered_rows_hash_only_tokens_that_can_win():
    """The Gumbel-max over the whole vocabulary, computed only for the tokens within the
    noise's range of the top score, picks exactly the token the full computation picks:
    peaked and flat rows, temperatures from 0.2 to 5, duplicate logits, a real-sized
    vocabulary; where one token stands out, a small share of the vocabulary is hashed."""
    from kernels import sampling

    def full(logits, temperature, seeds, positions):
        u = uniforms_ref(seeds, positions, torch.arange(logits.shape[1]))
        return (logits / temperature[:, None] - torch.log(-torch.log(u))).argmax(-1)

    def sampled(logits, temperature, seeds, positions):
        hashed = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sampling, "token_uniforms", lambda i, *k: hashed.append(i.numel()) or token_uniforms(i, *k))
            b = len(logits)
            out = sample_ref(logits, temperature, torch.zeros(b, dtype=torch.int32), torch.ones(b), seeds, positions)
        return out, sum(hashed)

    token_uniforms = sampling.token_uniforms
    g = torch.Generator().manual_seed(8)
    for v, b in ((49152, 24), (1000, 64)):
        logits = torch.randn(b, v, generator=g) * torch.rand(b, 1, generator=g) * 8
        logits[::5] = torch.randn(1, v, generator=g) * 0.01  # flat rows: every token is a candidate
        logits[1::7, : v // 2] = logits[1::7, v // 2 :]  # every logit twice
        temperature = torch.rand(b, generator=g) * 4.8 + 0.2
        seeds, positions = torch.randint(0, 2**40, (b,), generator=g), torch.arange(b) * 13
        assert torch.equal(sampled(logits, temperature, seeds, positions)[0], full(logits, temperature, seeds, positions))
        peaked = torch.randn(b, v, generator=g)
        peaked[torch.arange(b), torch.randint(0, v, (b,), generator=g)] += 18
        t = torch.full((b,), 0.7)
        tokens, hashed = sampled(peaked, t, seeds, positions)
        assert torch.equal(tokens, full(peaked, t, seeds, positions)) and hashed < b * v / 50
