"""Tree-verify attention for speculative decoding (EAGLE-style token trees).

Sequence b has n_b draft tokens whose k/v sit in the pool right after its
prefix_len_b cached tokens (draft j at position prefix_len_b + j). Each draft
attends to the whole prefix and to the drafts its tree mask allows (its
ancestors and itself), so a whole tree is verified in one target forward.

tree_mask layout: bool (T, max_n), one row per packed query (the same rows as
q), column j = draft j of that query's own sequence; True = may attend. Columns
j >= n_b are ignored. The diagonal must be True (a draft sees itself). A chain
of drafts is the lower-triangular mask.

Verification queries every draft (n_b = the sequence's query count). Drafting a
tree level queries only the newest nodes: with `tree_lens`, sequence b has
tree_lens[b] drafts after its prefix and its q_len_b queries are the last q_len_b
of them (an EAGLE-2 level: earlier levels' nodes are keys, masked like the rest).

The Triton kernel is extend_attention's, with TREE=True: keys below prefix_len
need no mask, keys among the drafts use the tree mask instead of causality.
"""

import torch

from kernels.extend_attention import prefill_attention
from kernels.paged import attend_ref, gather_kv


def paged_tree_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, tree_mask, scale: float,
                             tree_lens=None):
    """q (T, H, D); block_tables (B, max_blocks) int32; cu_seqlens_q (B+1,) int32;
    prefix_lens (B,) int32; tree_mask bool (T, max_n); tree_lens (B,) int32 or None
    (= the query counts) -> (T, H, D) in q's dtype."""
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    drafts = tree_lens.tolist() if tree_lens is not None else [cu[b + 1] - cu[b] for b in range(len(cu) - 1)]
    for b, prefix in enumerate(prefix_lens.tolist()):
        start, end = cu[b], cu[b + 1]
        m, n = end - start, drafts[b]
        if m == 0:
            continue
        assert m <= n, "the queries are the last of the tree's drafts"
        k, v = gather_kv(k_cache, v_cache, block_tables[b], prefix + n)
        allowed = torch.cat(
            [torch.ones(m, prefix, dtype=torch.bool, device=q.device), tree_mask[start:end, :n].bool()], dim=1
        )  # (m, prefix + n)
        out[start:end] = attend_ref(q[start:end], k, v, allowed, scale)
    return out


def paged_tree_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, tree_mask, scale: float,
                                tree_lens=None):
    """Same contract as paged_tree_attention_ref; one launch for all sequences."""
    return prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, scale, tree_mask,
                             tree_lens)
