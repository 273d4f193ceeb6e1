"""Draft trees: structure invariants of DraftTree, TreeSpec limits, and the
EAGLE-2 trees and chains the head drafts (tiny random target and head)."""

import pytest
import torch

from kernels.paged import attend_ref, gather_kv
from replica.model.runner import ancestor_mask
from speculative.drafting import DraftTree, Drafter, chain
from speculative.tree_spec import TreeSpec
from tests.speculative.util import random_head, tiny_target


def test_tree_depths_children_and_ancestor_mask():
    t = DraftTree([9, 1, 2, 3, 4], [-1, 0, 0, 1, 3])
    assert t.depths == [0, 1, 1, 2, 3]
    assert t.children() == [[1, 2], [3], [], [4], []]
    m = ancestor_mask(t.parents)  # the tree-attention mask the Runner builds from a plan's parents
    assert m.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]]
    c = chain(5, [6, 7])
    assert c.parents == [-1, 0, 1] and torch.equal(ancestor_mask(c.parents), torch.ones(3, 3, dtype=torch.bool).tril())
    with pytest.raises(ValueError):
        DraftTree([1, 2], [0, -1])
    with pytest.raises(ValueError):
        DraftTree([1, 2, 3], [-1, 2, 0])  # a parent after its child


def test_tree_spec_limits():
    assert TreeSpec.chain(5) == TreeSpec(depth=5, top_k=1, budget=5)
    assert TreeSpec(depth=6, top_k=8, budget=64).lookahead == 64
    assert TreeSpec(depth=6, top_k=4, budget=16).lookahead == 20  # the head's 4 x 5 draft entries
    with pytest.raises(ValueError):
        TreeSpec(depth=3, top_k=2, budget=11)  # only 2 + 2 * 4 = 10 candidates
    with pytest.raises(ValueError):
        TreeSpec(depth=3, top_k=2, budget=6, sample=True)


def run_drafter(spec, prompts, seed=0, drafter_class=Drafter):
    """Draft for prompts whose target features are random (seeded)."""
    model = tiny_target()
    head = random_head(model, seed=seed)
    drafter = drafter_class(head, model.cos_sin, torch.zeros(2, 64, 16, *head.kv_shape()), model.ops)
    g = torch.Generator().manual_seed(seed)
    states = []
    for p in prompts:
        st = drafter.new_state()
        st.add_features(torch.randn(len(p) - 1, 3 * model.cfg.hidden_size, generator=g))
        states.append(st)
    width = max(-(-(len(p) + spec.lookahead) // 16) for p in prompts)
    tables = torch.arange(len(prompts) * width, dtype=torch.int32).view(len(prompts), width)  # disjoint blocks
    return drafter, head, states, tables, drafter.propose(prompts, states, tables, spec, [0.7] * len(prompts),
                                                          list(range(len(prompts))))


@pytest.mark.parametrize("spec", [TreeSpec.chain(4), TreeSpec(depth=4, top_k=3, budget=12),
                                  TreeSpec(depth=5, top_k=4, budget=20)])
def test_eagle2_trees_are_ancestor_closed_and_ordered(spec):
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], list(range(20, 57))]
    drafter, head, states, _, trees = run_drafter(spec, prompts)
    allowed = set(head.d2t.tolist())
    for p, tree, st in zip(prompts, trees, states):
        assert len(tree) == spec.budget + 1 and tree.tokens[0] == p[-1]
        assert st.length == len(p) and st.pending == 0  # the pending entries were committed
        assert max(tree.depths) <= spec.depth and tree.depths == sorted(tree.depths)
        assert set(tree.tokens[1:]) <= allowed
        for kids in tree.children():
            assert len(kids) <= spec.top_k
            assert len({tree.tokens[c] for c in kids}) == len(kids)  # siblings are distinct
        if spec.top_k == 1:
            assert tree.parents == list(range(-1, spec.depth))


def test_sampled_chains_record_q_and_are_reproducible():
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6]]
    *_, greedy = run_drafter(TreeSpec.chain(3), prompts)
    *_, sampled = run_drafter(TreeSpec.chain(3, sample=True), prompts)
    tree = sampled[0]
    assert greedy[0].q is None and tree.q.shape == (4, 97)
    for i in range(1, 4):  # each draft was drawn from the q recorded for it
        assert tree.q[i, tree.tokens[i]] > 0 and torch.allclose(tree.q[i].sum(), torch.tensor(1.0))
    *_, again = run_drafter(TreeSpec.chain(3, sample=True), prompts)
    assert again[0].tokens == tree.tokens  # hashed draws: reproducible


def test_head_state_must_stay_in_step():
    prompts = [[3, 1, 4, 1, 5]]
    drafter, head, states, tables, _ = run_drafter(TreeSpec.chain(2), prompts)
    with pytest.raises(RuntimeError, match="out of step"):
        drafter.propose([prompts[0] + [7]], states, tables, TreeSpec.chain(2))  # no features for the new token


class DenseDrafter(Drafter):
    """Each drafting level's attention written out per sequence over a dense mask: the
    committed prefix plus the scratch entries anc allows (what kernels.ops' tree
    attention computes in one call)."""

    def _step(self, tok, g, lens, level, e0, anc, block_tables, live=None):
        assert live is None, "no graph padding here"
        B, K = tok.shape
        scratch = lens[:, None] + e0 + torch.arange(K)
        slots = self._slots(block_tables, torch.arange(B)[:, None].expand(B, K).flatten(), scratch.flatten())

        def attend(q, k, v):
            self.ops.store_kvcache(k, v, self.k_cache, self.v_cache, slots)
            out = torch.empty_like(q)
            for b, n in enumerate(lens.tolist()):
                kk, vv = gather_kv(self.k_cache, self.v_cache, block_tables[b], n + e0 + K)
                allowed = torch.cat([torch.ones(K, n, dtype=torch.bool), anc[b, e0 : e0 + K, : e0 + K]], 1)
                out[b * K : (b + 1) * K] = attend_ref(q[b * K : (b + 1) * K], kk, vv, allowed, self.scale)
            return out

        pos = (lens - 1 + level)[:, None].expand(B, K)
        o = self.head(tok.flatten(), g.flatten(0, 1), pos.flatten(), self.cos_sin, attend).view(B, K, -1)
        return o, self.head.logits(o).float().log_softmax(-1)


@pytest.mark.parametrize("spec", [TreeSpec(depth=4, top_k=3, budget=12), TreeSpec.chain(3, sample=True)])
def test_drafting_levels_attend_through_the_tree_attention_op(spec):
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], list(range(20, 57))]
    *_, trees = run_drafter(spec, prompts)
    *_, dense = run_drafter(spec, prompts, drafter_class=DenseDrafter)
    assert [(t.tokens, t.parents) for t in trees] == [(t.tokens, t.parents) for t in dense]
