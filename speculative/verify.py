"""Verification: which drafted tokens the target keeps, and the token after them.

The target scored every tree node in one forward; row i of its logits is the
target's next-token distribution p_i after the path root..i. The engine's
Speculator (replica/engine/speculation.py) applies these rules per sequence.

Deterministic drafts (`accept_greedy`): from the root, step to the child whose
token is the token the target emits after the node (its argmax at temperature 0,
the engine's seeded draw otherwise); the first node without one ends the path and
that token is the bonus token. Output == plain decoding, token for token.

Sampling: multi-round rejection sampling (SpecInfer, arXiv 2305.09781; one child
is Leviathan et al. / Chen et al. 2023). At a node with target distribution p,
try its children x_1, x_2, ... in order, child i drawn from proposal q_i:

    accept x_i with probability min(1, p(x_i) / q_i(x_i));  else  p <- (p - q_i)+ / |(p - q_i)+|

and when every child is rejected draw the bonus token from the final p. Each
round emits exactly p:  P(x) = min(p, q_i)(x) + (1 - Σ min(p, q_i)) (p - q_i)+(x) / Σ (p - q_i)+
= min(p, q_i)(x) + (p - q_i)+(x) = p(x), because 1 - Σ min(p, q) = Σ (p - q)+.
A child picked deterministically (the tree's top-k, an n-gram) has q_i = δ(x_i):
accept with probability p(x_i), else zero p(x_i) and renormalize.

Randomness is kernels.sampling's hashed uniforms u(seed, position, i), with a
stream id in the position's high 32 bits: stream 0 is the plain sampler's (the
final draw, so with nothing rejected it is the token plain sampling would pick),
ACCEPT_STREAM + r the accept test of the r-th child tried, DRAFT_STREAM the
drafter's own draws. Each position is decided in exactly one round, so no
uniform is used twice: a speculative run is reproducible and batch-independent.

On the device (`accept_greedy_rows`, `accept_sampling_chains`): the same rules for a
batch of trees of n nodes each (speculative.drafting.Drafts), as tensor ops in a fixed
number of steps (the depth), so nothing reads the host; each returns (accepted (B,),
path (B, depth + 1), tokens (B, depth + 1)): path[:, k] the node accepted at depth k and
tokens[:, k] the token emitted after it, for k <= accepted (past it, path repeats its last
node). Verdict-for-verdict the functions below (tests/speculative/test_verify.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.sampling import uniforms_ref

ACCEPT_STREAM = 1
DRAFT_STREAM = 1 << 30


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor):
    """(B, V) fp32: the law the sampler draws each row from (kernels.sampling.probs_ref's: top-k,
    then top-p, of softmax(logits / T); one-hot argmax at T == 0), over the whole vocabulary
    sorted, so no step depends on the data: nothing reads the host. (probs_ref looks at the
    largest 1,024 logits first and picks its rows on the host; the same law, rounded alike
    where the vocabulary is at most that wide.)"""
    x = logits.float()
    v = x.shape[1]
    t = torch.where(temperature > 0, temperature, 1.0).float()[:, None]
    k = top_k.long()[:, None]
    k_on, p_on = (k > 0) & (k < v), top_p.float()[:, None] < 1
    sx = torch.sort(x, dim=-1, descending=True).values
    kth = torch.where(k_on, sx.gather(1, (k - 1).clamp(0, v - 1)), float("-inf"))
    e = torch.where(sx >= kth, torch.exp(sx / t - x.max(-1, keepdim=True).values / t), 0.0)  # unnormalised
    mass_gt = torch.cat([torch.zeros_like(e[:, :1]), torch.cumsum(e, dim=-1)[:, :-1]], dim=-1)  # strictly larger
    n_p = ((mass_gt < top_p.float()[:, None] * e.sum(-1, keepdim=True)) & (sx >= kth)).sum(-1, keepdim=True)
    thr = torch.where(p_on, sx.gather(1, (n_p - 1).clamp_min(0)), kth)
    thr = torch.where(k_on | p_on, thr, float("-inf"))
    p = torch.softmax(torch.where(x >= thr, x / t, float("-inf")), dim=-1)
    greedy = torch.nn.functional.one_hot(x.argmax(-1), v).float()
    return torch.where((temperature > 0)[:, None], p, greedy)


def hashed_uniforms(seeds: torch.Tensor, positions: torch.Tensor, streams, n: int) -> torch.Tensor:
    """(B, n) uniforms in (0, 1), a pure function of (seed, position, stream, index);
    streams: an int or a (B,) tensor, each in [0, 2^31)."""
    return uniforms_ref(seeds.long(), positions.long() | (streams << 32), torch.arange(n, device=positions.device))


def gumbel_draw(p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """(B,) tokens x ~ p (B, V) by Gumbel-max: argmax log p - log(-log u)."""
    u = hashed_uniforms(seeds, positions, stream, p.shape[-1])
    return (p.float().log() - (-u.log()).log()).argmax(-1)


@dataclass
class Verdict:
    """One sequence's round: path[k] is the node accepted at depth k (path[0] = root),
    tokens[k] the token emitted after it (accepted drafts, then the bonus token)."""

    path: list[int]
    tokens: list[int]

    @property
    def num_accepted(self) -> int:
        return len(self.path) - 1

    def kv_moves(self, root_pos: int) -> list[tuple[int, int]]:
        """The target wrote node j's KV at root_pos + j; the kept path must end up
        contiguous, node path[k] at root_pos + k. Positions from root_pos + len(path)
        on are released (their slots are free once these moves are done)."""
        return [(root_pos + j, root_pos + k) for k, j in enumerate(self.path) if j != k]


def accept_greedy(tree, target: list[int]) -> Verdict:
    """target[i]: the token the target emits after node i (its argmax, or the seeded draw)."""
    children = tree.children()
    node, path, tokens = 0, [0], []
    while True:
        best = target[node]
        tokens.append(best)
        nxt = next((c for c in children[node] if tree.tokens[c] == best), None)
        if nxt is None:
            return Verdict(path, tokens)
        path.append(nxt)
        node = nxt


def accept_sampling(tree, p: torch.Tensor, seed: int, root_pos: int) -> Verdict:
    """p (n, V): the target's sampling distribution at each node (probs_ref rows).
    The token decided at node i sits at position root_pos + depth(i) + 1."""
    children = tree.children()
    seed_t = torch.tensor([seed], device=p.device)
    node, path, tokens = 0, [0], []
    while True:
        dist = p[node].float().clone()
        pos_t = torch.tensor([root_pos + tree.depths[node] + 1], device=p.device)
        kids = children[node]
        ranks = torch.arange(len(kids), device=p.device)
        u = hashed_uniforms(seed_t.expand(len(kids)), pos_t.expand(len(kids)), ACCEPT_STREAM + ranks, 1)[:, 0].tolist()
        accepted = None
        for r, c in enumerate(kids):
            x = tree.tokens[c]
            qx = 1.0 if tree.q is None else float(tree.q[c, x])
            if u[r] * qx < float(dist[x]):  # accept with probability min(1, p(x) / q(x))
                accepted = c
                break
            resid = dist.clone()
            if tree.q is None:
                resid[x] = 0.0  # (p - δ_x)+
            else:
                resid = (resid - tree.q[c].float()).clamp_min(0.0)  # (p - q)+
            mass = resid.sum()
            # mass == 0 only when p == q up to rounding (then acceptance was certain): keep p.
            if mass > 0:
                dist = resid / mass
        if accepted is None:
            tokens.append(int(gumbel_draw(dist[None], seed_t, pos_t)[0]))
            return Verdict(path, tokens)
        path.append(accepted)
        tokens.append(tree.tokens[accepted])
        node = accepted


def accept_greedy_rows(tokens: torch.Tensor, parents: torch.Tensor, target: torch.Tensor, depth: int):
    """`accept_greedy` for B trees at once: tokens, parents, target (B, n) on the device."""
    B, n = tokens.shape
    nodes = torch.arange(n, device=tokens.device)
    node = torch.zeros(B, dtype=torch.long, device=tokens.device)
    alive = torch.ones(B, dtype=torch.bool, device=tokens.device)
    path = [node]
    for _ in range(depth):  # the first child (in node order) whose token is the target's
        match = (parents == node[:, None]) & (tokens == target.gather(1, node[:, None]))
        first = torch.where(match, nodes, n).amin(1)
        alive = alive & (first < n)
        node = torch.where(alive, first, node)
        path.append(node)
    path = torch.stack(path, 1)  # (B, depth + 1)
    accepted = (path[:, 1:] != path[:, :-1]).sum(1)
    return accepted, path, target.gather(1, path)


def accept_sampling_chains(tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor, seeds: torch.Tensor,
                           root_pos: torch.Tensor):
    """`accept_sampling` for B chains at once: tokens (B, d + 1) (the root first), q (B, d + 1, V)
    the laws the drafts were drawn from, p (B, d + 1, V) the target's at each node, seeds and
    root_pos (B,). Node k's child x_{k+1} is kept with probability min(1, p_k(x) / q_{k+1}(x))
    (uniform u(seed, root_pos + k + 1, ACCEPT_STREAM)); at the first rejection the bonus token is
    drawn from (p_k - q_{k+1})+ normalised (p_k where that is zero), past the last node from p_d."""
    B, n = tokens.shape
    d, dev = n - 1, tokens.device
    x = tokens[:, 1:]  # (B, d)
    pos = root_pos[:, None] + 1 + torch.arange(n, device=dev)  # (B, n): the position decided at node k
    u = hashed_uniforms(seeds[:, None].expand(B, d).flatten(), pos[:, :d].flatten(), ACCEPT_STREAM, 1).view(B, d)
    qx = q[:, 1:].gather(2, x[..., None])[..., 0]
    px = p[:, :d].float().gather(2, x[..., None])[..., 0]
    keep = u.double() * qx.double() < px.double()  # as accept_sampling compares them (Python floats)
    accepted = keep.long().cumprod(1).sum(1)  # (B,): up to the first rejection
    m = accepted[:, None, None].expand(B, 1, p.shape[-1])
    dist = p.float().gather(1, m)[:, 0]  # (B, V): p at the last accepted node
    resid = (dist - q.float().gather(1, (m + 1).clamp_max(d))[:, 0]).clamp_min(0.0)  # (p - q)+
    mass = resid.sum(-1, keepdim=True)
    dist = torch.where((accepted < d)[:, None] & (mass > 0), resid / mass, dist)
    bonus = gumbel_draw(dist, seeds, pos.gather(1, accepted[:, None])[:, 0])
    nodes = torch.arange(n, device=dev)
    out = torch.where(nodes == accepted[:, None], bonus[:, None], torch.cat([x, x[:, :1]], 1))
    return accepted, nodes.expand(B, n), out
