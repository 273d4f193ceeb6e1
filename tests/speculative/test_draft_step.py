"""The EAGLE-3 head's step as one C++ call (kernels/cpu_draft.py) against the PyTorch
head with the kernel set's paged attention (the reference): the same outputs, logits
and head KV within float rounding for commit chunks (several sequences of different
lengths, some past one attention chunk, over an existing prefix) and draft levels
under ancestor masks; the same drafts (chains, trees, sampled chains); a row's result
independent of its batch; and the engine's greedy output with the C++ head is the
plain output. Tiny target with head_dim 16 (the C++ attention's smallest). The heads' matmul
weights are fp16 values (`fp16_weights`), as the C++ step holds them; one test shows that
it does hold them so."""

import dataclasses

import pytest
import torch

import kernels
from kernels.cpu_draft import fp16_weights
from replica.config import EngineConfig
from replica.engine.llm_engine import LLMEngine
from speculative.drafting import Drafter
from speculative.head import save_head
from speculative.tree_spec import TreeSpec
from tests.replica.tiny import tiny_config, tiny_weights
from tests.speculative.util import random_head, tiny_target
from wire import protocol as P

SHAPE = dict(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96)  # head_dim 16
OPS = kernels.ops("cpu")
pytestmark = pytest.mark.skipif(not OPS.cpu_draft, reason="the C++ head step does not build here")


@pytest.fixture(scope="module")
def target():
    return tiny_target(**SHAPE)


def head_for(model, seed=0):
    """A random head whose matmul weights are fp16 values, as the C++ step holds them."""
    head = random_head(model, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # larger than nn.Linear's init, so the attention and norms matter
        for p in head.parameters():
            p.mul_(1 + torch.rand(p.shape, generator=g))
    fp16_weights(head)
    return head


def drafters(model, head, blocks=96):
    """(C++, reference) drafters over two pools of the same shape."""
    pools = [torch.zeros(2, blocks, 16, *head.kv_shape()) for _ in range(2)]
    cpp = Drafter(head, model.cos_sin, pools[0], OPS)
    ref = Drafter(head, model.cos_sin, pools[1], dataclasses.replace(OPS, cpu_draft=False))
    assert cpp.cpp is not None and ref.cpp is None
    return cpp, ref


def close(a, b, tol=2e-5):
    """Equal within float rounding, relative to the values' scale."""
    scale = b.abs().max().clamp_min(1.0)
    err = (a - b).abs().max() / scale
    assert err < tol, f"max error {err:.2e} of scale {scale:.2f}"


def commit_both(cpp, ref, prompts, chunks, seed=0):
    """Commit each prompt in `chunks` pieces (features random) through both drafters."""
    g = torch.Generator().manual_seed(seed)
    h = cpp.head.cfg.hidden_size
    width = max(-(-(len(p) + 24) // 16) for p in prompts)
    tables = torch.randperm(len(prompts) * width, generator=g).to(torch.int32).view(len(prompts), width)
    states = [[d.new_state() for _ in prompts] for d in (cpp, ref)]
    outs = []
    for c in range(chunks):
        toks = [p[: len(p) * (c + 1) // chunks] for p in prompts]
        for i, t in enumerate(toks):
            n = len(t) - states[0][i].length - states[0][i].pending
            aux = torch.randn(n, 3 * h, generator=g)
            for st in states:
                st[i].add_features(aux)
        outs.append([d._commit(toks, st, tables)[:2] for d, st in zip((cpp, ref), states)])  # (o, log q)
    return tables, outs


def test_commit_chunks_match_the_torch_head(target):
    head = head_for(target)
    cpp, ref = drafters(target, head)
    prompts = [list(range(3, 8)), [(7 * i) % 97 for i in range(300)], [(5 * i + 1) % 97 for i in range(41)]]
    tables, outs = commit_both(cpp, ref, prompts, chunks=2)  # the second chunk attends to the first's entries
    for (o_c, lg_c), (o_r, lg_r) in outs:
        assert o_c.shape == o_r.shape == (3, 64) and lg_c.shape == lg_r.shape == (3, 64)
        close(o_c, o_r)
        close(lg_c, lg_r)
    close(cpp.kv, ref.kv)  # the committed entries' keys and values, at the same slots


def test_tree_levels_under_ancestor_masks_match_the_torch_head(target):
    head = head_for(target, seed=3)
    cpp, ref = drafters(target, head)
    prompts = [[(3 * i + 2) % 97 for i in range(17)], [(11 * i) % 97 for i in range(270)]]
    tables, outs = commit_both(cpp, ref, prompts, chunks=1, seed=3)
    B, K, h = 2, 3, head.cfg.hidden_size
    lens = torch.tensor([len(p) for p in prompts])
    E = 2 * K
    anc = torch.zeros(B, E, E, dtype=torch.bool)
    anc[:, range(E), range(E)] = True  # level 1: entries 0..2, each itself only
    anc[0, 3, 0] = anc[0, 4, 0] = anc[0, 5, 2] = True  # level 2: children of entries 0, 0 and 2
    anc[1, 3, 1] = anc[1, 4, 2] = anc[1, 5, 1] = True
    g = torch.Generator().manual_seed(5)
    o = outs[0][1][0]  # the reference commit's newest outputs
    tok = torch.randint(0, 97, (B, K), generator=g)
    for level, e0 in ((1, 0), (2, K)):
        g_in = o[:, None].expand(B, K, h) if level == 1 else o_r
        o_c, lg_c = cpp._step(tok, g_in, lens, level, e0, anc, tables)
        o_r, lg_r = ref._step(tok, g_in, lens, level, e0, anc, tables)
        assert o_c.shape == (B, K, h) and lg_c.shape == (B, K, head.cfg.draft_vocab_size)
        close(o_c, o_r)
        close(lg_c, lg_r)
        tok = torch.randint(0, 97, (B, K), generator=g)
    close(cpp.kv, ref.kv)


def test_a_rows_result_does_not_depend_on_its_batch(target):
    head = head_for(target, seed=4)
    prompt = [(13 * i + 5) % 97 for i in range(33)]
    other = [(3 * i) % 97 for i in range(290)]
    aux = torch.randn(len(prompt), 3 * head.cfg.hidden_size, generator=torch.Generator().manual_seed(9))
    results = []
    for batch in ([prompt], [other, prompt]):
        d = drafters(target, head)[0]
        states = [d.new_state() for _ in batch]
        for st, p in zip(states, batch):
            st.add_features(aux[: len(p) - 1] if p is prompt else torch.randn(len(p) - 1, aux.shape[1]))
        tables = torch.arange(len(batch) * 20, dtype=torch.int32).view(len(batch), 20)
        o, logits = d._commit(batch, states, tables)[:2]
        results.append((o[-1], logits[-1]))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("spec", [TreeSpec.chain(3), TreeSpec(depth=5, top_k=4, budget=16),
                                  TreeSpec(depth=4, top_k=3, budget=12), TreeSpec.chain(4, sample=True)])
def test_drafts_are_the_torch_drafts(target, spec):
    head = head_for(target, seed=1)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [(7 * i + 3) % 97 for i in range(60)], [(2 * i) % 97 for i in range(21)]]
    g = torch.Generator().manual_seed(7)
    feats = [torch.randn(len(p), 3 * head.cfg.hidden_size, generator=g) for p in prompts]
    tables = torch.arange(3 * 8, dtype=torch.int32).view(3, 8)
    trees = []
    for d in drafters(target, head):
        states = []
        for p, f in zip(prompts, feats):
            st = d.new_state()
            st.add_features(f[: len(p) - 1])
            states.append(st)
        trees.append(d.propose(prompts, states, tables, spec, [0.7] * 3, [11, 12, 13]))
    cpp, ref = trees
    assert [(t.tokens, t.parents) for t in cpp] == [(t.tokens, t.parents) for t in ref]
    if spec.sample:
        for a, b in zip(cpp, ref):
            close(a.q, b.q)


def test_engine_greedy_output_with_the_cpp_head_is_the_plain_output(target, tmp_path):
    cfg = tiny_config(num_layers=4, **SHAPE)
    w = tiny_weights(cfg)
    head = str(save_head(head_for(target, seed=2), tmp_path / "head"))
    prompts = {"a": [(5 * i + 1) % 97 for i in range(37)], "b": [3, 1, 4, 1, 5], "c": list(range(10, 30))}
    out = {}
    for name, kw in {"plain": {}, "chain": dict(speculative="eagle3", spec_head=head, spec_depth=3),
                     "tree": dict(speculative="eagle3", spec_head=head, spec_depth=4, spec_top_k=3,
                                  spec_budget=10)}.items():
        eng = LLMEngine(EngineConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=40,
                                     spec_max_batch=4, **kw), cfg, w)
        if name != "plain":
            assert eng.speculator.drafter.cpp is not None
        for k, p in prompts.items():
            assert eng.add(P.Generate(id=k, prompt_ids=p, sampling=P.SamplingParams(
                max_tokens=16, temperature=0.0, ignore_eos=True))) is None
        toks = {}
        while eng.has_work():
            for m in eng.step():
                toks.setdefault(m.id, []).extend(m.ids)
        out[name] = toks
        if name != "plain":
            assert eng.stats.drafted > 0
    assert out["chain"] == out["plain"] and out["tree"] == out["plain"]


def test_the_cpp_step_holds_its_matmul_weights_in_fp16(target):
    """Against a head whose weights are not fp16 values, the C++ step computes the head with them
    rounded: the same as the PyTorch head after fp16_weights, and not the unrounded one."""
    head = random_head(target, seed=3)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(1e-3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(4)))
    cpp, ref = drafters(target, head)  # the C++ step takes its snapshot of the weights here
    prompts = [list(range(3, 23)), list(range(7, 40))]
    _, unrounded = commit_both(cpp, ref, prompts, 1)
    fp16_weights(head)  # now the reference head computes with the weights the C++ step holds
    _, rounded = commit_both(cpp, drafters(target, head)[1], prompts, 1)
    (o_cpp, lp_cpp), (o_ref, lp_ref) = rounded[0][0][:2], rounded[0][1][:2]
    close(o_cpp, o_ref)
    close(lp_cpp, lp_ref)
    (_, lp_cpp), (_, lp_ref) = unrounded[0][0][:2], unrounded[0][1][:2]
    assert (lp_cpp - lp_ref).abs().max() > 1e-5
