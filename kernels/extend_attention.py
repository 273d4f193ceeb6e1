"""Extend (chunked prefill) attention over the paged cache with a cached prefix.

A step may prefill chunks of several prompts at once, each continuing a prefix
already in the pool (prefix-cache hits, earlier chunks). Queries of all
sequences are packed into one (T, H, D) tensor delimited by cu_seqlens_q; query i
of sequence b sits at position seq_len_b - q_len_b + i and attends causally to
keys [0, that position]. All keys, the new ones included, are read from the pool
(store_kvcache ran first), so one launch covers every sequence whatever its
prefix length.

The Triton kernel is shared with tree_attention.py (TREE=True swaps the causal
rule among the new tokens for the draft tree mask). Grid: (query tiles, H); the
tiles of all sequences are numbered consecutively and each program finds its
sequence by binary search over the per-sequence tile counts, so the grid depends
only on shapes (CUDA-graph safe) and no program is spent on another sequence's
padding. Keys below the tile's first query position need no mask and run in a
separate unmasked loop.
"""

import torch

from kernels._triton import dot_dtype, dot_precision, tl, triton
from kernels.paged import attend_ref, gather_kv


def paged_extend_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale: float):
    """q (T, H, D); block_tables (B, max_blocks) int32; cu_seqlens_q (B+1,) int32;
    seq_lens (B,) int32 = prefix + new tokens -> (T, H, D) in q's dtype."""
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b, length in enumerate(lens):
        start, end = cu[b], cu[b + 1]
        if end == start:
            continue
        k, v = gather_kv(k_cache, v_cache, block_tables[b], length)
        q_pos = torch.arange(length - (end - start), length, device=q.device)
        allowed = torch.arange(length, device=q.device)[None, :] <= q_pos[:, None]  # (M, L)
        out[start:end] = attend_ref(q[start:end], k, v, allowed, scale)
    return out


@triton.jit
def _tile_step(
    q, acc, m_i, l_i,  # (BLOCK_M, BLOCK_D) queries in DOT_DTYPE; running output, max, sum
    k_cache_ptr,  # (num_blocks, PAGE, Hkv, D) key pool
    v_cache_ptr,  # value pool, same strides
    bt_row,  # this sequence's row of the block table
    mask_ptr,  # (T, max_n) uint8 tree mask (TREE only)
    n0, kvh, d, q_pos, rows, row_valid, prefix, end,
    scale_log2e, stride_cb, stride_cs, stride_ch, stride_mask,
    MASKED: tl.constexpr, TREE: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One BLOCK_N tile of keys [n0, n0 + BLOCK_N) folded into the online softmax."""
    key = n0 + tl.arange(0, BLOCK_N)
    k_mask = key < end
    block = tl.load(bt_row + key // PAGE, mask=k_mask, other=0).to(tl.int64)
    off = block * stride_cb + (key % PAGE) * stride_cs + kvh * stride_ch
    kv_mask = k_mask[:, None] & (d < D)[None, :]
    k = tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e  # (BLOCK_M, BLOCK_N)
    if MASKED:
        if TREE:
            j = key - prefix  # draft index of the key
            t_mask = row_valid[:, None] & ((j >= 0) & k_mask)[None, :]
            tree = tl.load(mask_ptr + rows[:, None] * stride_mask + j[None, :], mask=t_mask, other=0)
            allowed = ((key < prefix)[None, :] | (tree != 0)) & k_mask[None, :]
        else:
            allowed = (key[None, :] <= q_pos[:, None]) & k_mask[None, :]
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: no NaN
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _prefill_kernel(
    q_ptr,  # (T, H, D) packed queries of all sequences
    k_cache_ptr,  # (num_blocks, PAGE, Hkv, D) key pool
    v_cache_ptr,  # value pool, same strides
    block_tables_ptr,  # (B, max_blocks) int32
    cu_q_ptr,  # (B+1,) int32 query offsets: sequence b owns rows [cu_q[b], cu_q[b+1])
    tile_cu_ptr,  # (B+1,) int32 cumulative count of BLOCK_M query tiles per sequence
    lens_ptr,  # (B,) int32: total keys (extend) or prefix lengths (TREE)
    tree_lens_ptr,  # (B,) int32 drafts after the prefix, queries being the last of them (TREE_LENS only)
    mask_ptr,  # (T, max_n) uint8 tree mask (TREE only)
    out_ptr,  # (T, H, D) output, contiguous
    scale_log2e,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_mask,
    B,
    SEARCH_STEPS,  # ceil(log2(B))
    G: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TREE: tl.constexpr,
    TREE_LENS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // G
    # Sequence of this tile: the largest b with tile_cu[b] <= tile.
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + B
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        go = tl.load(tile_cu_ptr + mid) <= tile
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    b = lo
    idle = tile >= tl.load(tile_cu_ptr + B)  # grid is an upper bound on the tile count
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.where(idle, 0, tl.load(cu_q_ptr + b + 1) - q_start)
    if TREE:
        prefix = tl.load(lens_ptr + b)
        if TREE_LENS:
            kv_len = prefix + tl.where(idle, 0, tl.load(tree_lens_ptr + b))
        else:
            kv_len = prefix + q_len
    else:
        kv_len = tl.load(lens_ptr + b)
        prefix = kv_len - q_len
    m0 = (tile - tl.load(tile_cu_ptr + b)) * BLOCK_M
    i = m0 + tl.arange(0, BLOCK_M)  # query index within its sequence
    row_valid = i < q_len
    q_pos = prefix + i  # position of each query (extend; TREE masks by tree_mask instead)
    rows = (q_start + i).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    q_mask = row_valid[:, None] & (d < D)[None, :]
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :], mask=q_mask, other=0.0)
    q = q.to(DOT_DTYPE)

    if TREE:
        shared_end = prefix  # every draft sees the whole prefix
        end = kv_len
    else:
        shared_end = prefix + m0  # the tile's first query sees keys [0, prefix + m0]
        end = tl.minimum(kv_len, prefix + m0 + BLOCK_M)
    end = tl.where(q_len > m0, end, 0)  # idle tile: no keys
    unmasked_end = (tl.minimum(shared_end, end) // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(0, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _tile_step(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row, mask_ptr, n0, kvh, d, q_pos, rows, row_valid,
            prefix, end, scale_log2e, stride_cb, stride_cs, stride_ch, stride_mask,
            False, TREE, PAGE, BLOCK_N, D, DOT_DTYPE, DOT_PRECISION,
        )  # fmt: skip
    for n0 in range(unmasked_end, end, BLOCK_N):
        acc, m_i, l_i = _tile_step(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row, mask_ptr, n0, kvh, d, q_pos, rows, row_valid,
            prefix, end, scale_log2e, stride_cb, stride_cs, stride_ch, stride_mask,
            True, TREE, PAGE, BLOCK_N, D, DOT_DTYPE, DOT_PRECISION,
        )  # fmt: skip
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(out_ptr + rows[:, None] * (tl.num_programs(1) * D) + h * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=q_mask)  # fmt: skip


def prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, lens, scale, tree_mask=None, tree_lens=None):
    """Launch _prefill_kernel: extend when tree_mask is None (lens = seq_lens), tree
    attention otherwise (lens = prefix_lens; tree_lens: see tree_attention.py)."""
    t, h, d = q.shape
    _, page, hkv, _ = k_cache.shape
    b = cu_seqlens_q.shape[0] - 1
    assert h % hkv == 0 and q.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    if t == 0 or b == 0:
        return out
    # Tile height from the mean query length (shapes only): short drafts, long prefills.
    block_m = 16 if t <= 16 * b else 32 if t <= 32 * b else 64
    block_d = max(16, triton.next_power_of_2(d))
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    tile_cu = torch.zeros(b + 1, dtype=torch.int32, device=q.device)
    tile_cu[1:] = torch.cumsum((q_lens + block_m - 1) // block_m, 0)
    if tree_mask is None:
        mask, stride_mask = q, 0  # unused
    else:
        assert tree_mask.dtype == torch.bool and tree_mask.shape[0] == t and tree_mask.stride(1) == 1
        mask, stride_mask = tree_mask.view(torch.uint8), tree_mask.stride(0)
    grid = (triton.cdiv(t, block_m) + b, h)  # >= the total tile count sum(cdiv(q_len_b, block_m))
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, tile_cu, lens, lens if tree_lens is None else tree_lens, mask,
        out, scale * 1.4426950408889634,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        stride_mask, b, (b - 1).bit_length(),
        G=h // hkv, D=d, PAGE=page, BLOCK_M=block_m, BLOCK_N=64 if block_d <= 128 else 32, BLOCK_D=block_d,
        TREE=tree_mask is not None, TREE_LENS=tree_lens is not None, DOT_DTYPE=dot_dtype(q.dtype),
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=4, num_stages=2,
    )  # fmt: skip
    return out


def paged_extend_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale: float):
    """Same contract as paged_extend_attention_ref; one launch for all sequences."""
    return prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale)
