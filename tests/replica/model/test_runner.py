"""replica.model.runner's pure planning helpers, and its CPU KV pool."""

import ctypes
import os

import kernels
from replica.config import EngineConfig
from replica.model.plan import StepPlan
from replica.model.runner import Runner, narrow_rows
from tests.replica.tiny import tiny_config, tiny_weights


def test_narrow_rows_are_prompt_tokens_that_sample_nothing():
    # one tree (3 nodes), one decode, then extends: C finishes its prompt (sampled), D is a
    # middle chunk, E resumes (prompt 3, then generated tokens: the prompt's last token stays
    # wide as when it sampled), F asked for prompt logprobs
    p = StepPlan(input_ids=[0] * 24, starts=[9, 5, 0, 4, 0, 0], num_tokens=[3, 1, 5, 4, 6, 5],
                 block_tables=[[0]] * 6, sample_rows=[2, 4, 5], num_decodes=1, trees=[[-1, 0, 0]],
                 prompt_lens=[9, 5, 5, 20, 3, 5], extra_logits=[20, 21])
    cu = [0, 3, 4, 9, 13, 19, 24]
    got = narrow_rows(p, cu)
    assert got == ([False] * 3 + [False]  # tree nodes and the decode sample
                   + [True] * 4 + [False]  # C: its last token samples
                   + [True] * 4  # D: every token narrow
                   + [True] * 2 + [False] * 4  # E: the prompt's last and the generated tokens stay wide
                   + [True, False, False, True, False])  # F: its logprob positions (20, 21) and last token wide


def test_only_prompts_from_the_threshold_on_have_narrow_rows():
    p = StepPlan(input_ids=[0] * 9, starts=[0, 0], num_tokens=[4, 5], block_tables=[[0]] * 2, sample_rows=[0, 1],
                 num_decodes=0, prompt_lens=[4, 5])
    assert narrow_rows(p, [0, 4, 9], 5) == [False] * 4 + [True] * 4 + [False]
    assert narrow_rows(p, [0, 4, 9], 6) == [False] * 9


def test_int8_decodes_make_decode_rows_and_recomputed_generated_tokens_narrow():
    # two decodes, then B resumes (prompt 3 + 3 generated tokens, its last sampling as a decode
    # would), C a resume's middle chunk (prompt 2, positions 1..4: the prompt's last stays wide, as
    # when it sampled)
    p = StepPlan(input_ids=[0] * 12, starts=[7, 4, 0, 1], num_tokens=[1, 1, 6, 4], block_tables=[[0]] * 4,
                 sample_rows=[0, 1, 2], num_decodes=2, prompt_lens=[5, 3, 3, 2])
    cu = [0, 1, 2, 8, 12]
    assert narrow_rows(p, cu, None, decodes=True) == (
        [True, True] + [False] * 3 + [True] * 3 + [False] + [True] * 3)
    # with int8 prompts as well, B's prompt rows but its last go narrow too
    assert narrow_rows(p, cu, 0, decodes=True)[2:8] == [True, True, False, True, True, True]
    # a step with drafts keeps every row but the prompts' int16, and so does decodes=False
    trees = StepPlan(input_ids=[0] * 4, starts=[7, 4], num_tokens=[3, 1], block_tables=[[0]] * 2, sample_rows=[1],
                     num_decodes=1, trees=[[-1, 0, 0]], prompt_lens=[5, 3])
    assert narrow_rows(trees, [0, 3, 4], None, decodes=True) == [False] * 4
    assert narrow_rows(p, cu, None) == [False] * 12


def resident_fraction(t) -> float:
    """The fraction of the pages under tensor t that are in memory (mincore(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = os.sysconf("SC_PAGE_SIZE")
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    vec = ctypes.create_string_buffer((length + page - 1) // page)
    assert libc.mincore(start, length, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw) / len(vec.raw)


def test_the_cpu_kv_pool_is_resident_once_allocated():
    """allocate_kv touches every page of the CPU pool (torch.empty may hand over unmapped pages):
    no step pays a page fault for the first store into a block (a 256-token prompt's KV was ~1,500)."""
    cfg = tiny_config(vocab_size=96, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, num_layers=3)
    r = Runner(EngineConfig(quantization="int4", num_blocks=8192, cpu_threads=1, max_num_seqs=4,
                            max_num_batched_tokens=64), cfg, tiny_weights(cfg, seed=3), ops=kernels.ops("cpu"))
    r.allocate_kv()
    assert r.kv_cache.numel() * r.kv_cache.element_size() > 32 << 20
    assert resident_fraction(r.kv_cache) == 1.0


def test_device_tree_masks_are_the_host_ancestor_masks():
    """ancestor_masks (a verify plan's device trees) equals ancestor_mask row by row, for random
    trees of every shape up to 33 nodes, the depth bound exact (squaring must reach the deepest)."""
    import random

    import torch

    from replica.model.runner import ancestor_mask, ancestor_masks, tree_depths

    rng = random.Random(0)
    for n in (1, 2, 3, 9, 17, 33):
        trees = [[-1] + [rng.randrange(max(0, i - rng.choice((1, i))), i) for i in range(1, n)] for _ in range(12)]
        depth = max(max(tree_depths(p)) for p in trees)
        got = ancestor_masks(torch.tensor(trees), depth)
        assert all(torch.equal(got[b], ancestor_mask(p)) for b, p in enumerate(trees))
    chain = list(range(-1, 32))  # depth 32: five squarings
    assert torch.equal(ancestor_masks(torch.tensor([chain]), 32)[0], ancestor_mask(chain))
