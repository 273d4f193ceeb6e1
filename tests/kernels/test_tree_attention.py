"""Tree-verify attention (prefix + draft tree mask) against its reference."""

import pytest
import torch

import kernels
from kernels.extend_attention import paged_extend_attention_ref
from kernels.tree_attention import paged_tree_attention_ref
from tests.kernels.pool import ATTENTION_TOL, DEVICES, DTYPES, assert_close, cu_seqlens, make_pool, triton_ops


def random_tree_mask(n_drafts, max_n, gen):
    """Rows per packed query: a random tree (each draft's parent precedes it); the
    mask of a draft is its ancestors and itself."""
    rows = []
    for n in n_drafts:
        anc = torch.zeros(max(n, 1), max_n, dtype=torch.bool)
        for j in range(n):
            parent = int(torch.randint(0, j, (1,), generator=gen)) if j > 0 else -1
            if parent >= 0:
                anc[j] = anc[parent]
            anc[j, j] = True
        rows.append(anc[:n])
    return torch.cat(rows)


# (prefix length, drafts) per sequence: empty prefix, prefixes at/across block and
# tile boundaries, a single draft, no drafts, a wide tree.
CASES = [(0, 4), (16, 7), (63, 1), (70, 0), (129, 20), (5, 16)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (3, 1), (8, 1)])  # GQA ratios 1, 3, 8
def test_matches_reference(device, dtype, heads, kv_heads):
    gen = torch.Generator().manual_seed(1)
    prefix = [p for p, _ in CASES]
    n_drafts = [n for _, n in CASES]
    k_cache, v_cache, block_tables = make_pool([p + n for p, n in CASES], kv_heads, 32, 16, dtype, device)
    q = torch.randn(sum(n_drafts), heads, 32, generator=gen).to(dtype).to(device)
    cu = cu_seqlens(n_drafts, device)
    prefix_lens = torch.tensor(prefix, dtype=torch.int32, device=device)
    tree_mask = random_tree_mask(n_drafts, max(n_drafts), gen).to(device)
    out = triton_ops(device).paged_tree_attention(q, k_cache, v_cache, block_tables, cu, prefix_lens, tree_mask, 0.2)
    ref = paged_tree_attention_ref(q, k_cache, v_cache, block_tables, cu, prefix_lens, tree_mask, 0.2)
    assert_close(out, ref, dtype, ATTENTION_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_chain_mask_is_extend(device):
    """A chain (lower-triangular mask) is ordinary causal extend attention."""
    prefix, n_drafts = [3, 40], [5, 8]
    lens = [p + n for p, n in zip(prefix, n_drafts)]
    k_cache, v_cache, block_tables = make_pool(lens, 1, 16, 16, torch.float32, device)
    q = torch.randn(sum(n_drafts), 3, 16, device=device)
    cu = cu_seqlens(n_drafts, device)
    tree_mask = torch.cat([torch.tril(torch.ones(n, 8, dtype=torch.bool), 0) for n in n_drafts]).to(device)
    out = triton_ops(device).paged_tree_attention(
        q, k_cache, v_cache, block_tables, cu, torch.tensor(prefix, dtype=torch.int32, device=device), tree_mask, 0.25
    )
    ref = paged_extend_attention_ref(
        q, k_cache, v_cache, block_tables, cu, torch.tensor(lens, dtype=torch.int32, device=device), 0.25
    )
    assert_close(out, ref, torch.float32, ATTENTION_TOL)


@pytest.mark.parametrize("device", ["ref"] + DEVICES)
def test_queries_can_be_the_newest_drafts(device):
    """With tree_lens, a sequence's queries are the last of its drafts (a drafting level):
    they see what the same rows see when every draft is queried."""
    impl, device = ("ref", "cpu") if device == "ref" else ("triton", device)
    ops = kernels.ops(device, impl=impl)
    gen = torch.Generator().manual_seed(2)
    prefix, n_drafts, n_new = [9, 0, 40], [12, 5, 3], [4, 5, 1]
    k_cache, v_cache, block_tables = make_pool([p + n for p, n in zip(prefix, n_drafts)], 1, 16, 16, torch.float32,
                                               device)
    q = torch.randn(sum(n_drafts), 3, 16, generator=gen).to(device)
    mask = random_tree_mask(n_drafts, max(n_drafts), gen).to(device)
    prefix_t = torch.tensor(prefix, dtype=torch.int32, device=device)
    full = ops.paged_tree_attention(q, k_cache, v_cache, block_tables, cu_seqlens(n_drafts, device), prefix_t, mask,
                                    0.25)
    starts = cu_seqlens(n_drafts, "cpu").tolist()
    rows = torch.tensor([r for b, m in enumerate(n_new) for r in range(starts[b + 1] - m, starts[b + 1])])
    newest = ops.paged_tree_attention(q[rows], k_cache, v_cache, block_tables, cu_seqlens(n_new, device), prefix_t,
                                      mask[rows], 0.25, torch.tensor(n_drafts, dtype=torch.int32, device=device))
    assert_close(newest, full[rows], torch.float32, ATTENTION_TOL)
