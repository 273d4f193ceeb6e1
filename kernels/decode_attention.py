"""Paged decode attention: one query token per sequence over its cached keys.

Decode reads the whole KV cache of every sequence once per step and does almost
no arithmetic per byte, so it is bound by HBM bandwidth. At batch 1 with a long
context a kernel with one program per (sequence, kv head) would use a handful of
SMs; flash-decoding splits each sequence's keys into chunks processed in
parallel (partial softmax per split), then a small kernel merges the splits with
their log-sum-exps. The G = H / Hkv query heads sharing a kv head are processed
together so each key is read from memory once. `FusedDecodeAttention` (chosen by
kernels.ops(..., fused_decode=True)) folds the merge into the split kernel: the last
program of a row to finish merges it, one launch a layer instead of two.
"""

import torch
import torch.nn.functional as F

from kernels._triton import dot_dtype, dot_precision, tl, triton
from kernels.paged import dequantize_kv_ref


def paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale: float):
    """q (B, H, D); caches (num_blocks, block_size, Hkv, D); block_tables (B, max_blocks)
    int32; seq_lens (B,) int32 -> (B, H, D) in q's dtype. A row with seq_len 0 (CUDA-graph
    padding) attends to nothing and gets zeros.

    Batched: gathers every sequence's blocks into a padded (B, Hkv, L, D), masks
    the padding, and runs PyTorch's fused SDPA in fp32 (GQA inside SDPA).
    """
    block_size = k_cache.shape[1]
    n_blocks = -(-int(seq_lens.max()) // block_size)
    if n_blocks == 0:
        return torch.zeros_like(q)
    ids = block_tables[:, :n_blocks].long().clamp_min(0)  # padding entries may be -1
    k = dequantize_kv_ref(k_cache[ids].flatten(1, 2).transpose(1, 2))  # (B, Hkv, L, D)
    v = dequantize_kv_ref(v_cache[ids].flatten(1, 2).transpose(1, 2))
    valid = torch.arange(k.shape[2], device=q.device) < seq_lens[:, None]  # (B, L)
    o = F.scaled_dot_product_attention(
        q.float()[:, :, None, :], k, v, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True
    )  # (B, H, 1, D)
    return torch.where((seq_lens > 0)[:, None, None], o[:, :, 0], 0.0).to(q.dtype)


@triton.jit
def _attend_split(
    q_ptr,  # (B, H, D) queries
    k_cache_ptr,  # (num_blocks, PAGE, Hkv, D) key pool
    v_cache_ptr,  # (num_blocks, PAGE, Hkv, D) value pool, same strides
    block_tables_ptr,  # (B, max_blocks) int32 pool block of each page of each sequence
    seq_lens_ptr,  # (B,) int32 number of keys per sequence
    scale_log2e,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    NUM_SPLITS,
    b,
    kvh,
    split,
    G: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One split of one (sequence, kv head): its G query heads' unnormalized output acc
    (BLOCK_G, BLOCK_D), running max m_i and sum l_i (BLOCK_G,) over its key range."""
    seq_len = tl.load(seq_lens_ptr + b)
    # This split's key range: the sequence's tiles divided evenly among the splits.
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), NUM_SPLITS)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * G + g
    gd_mask = (g < G)[:, None] & (d < D)[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gd_mask, other=0.0)
    q = q.to(DOT_DTYPE)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        p_mask = pos < end
        block = tl.load(bt_row + pos // PAGE, mask=p_mask, other=0).to(tl.int64)
        off = block * stride_cb + (pos % PAGE) * stride_cs + kvh * stride_ch  # (BLOCK_N,)
        kv_mask = p_mask[:, None] & (d < D)[None, :]
        k = tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e  # (BLOCK_G, BLOCK_N)
        s = tl.where(p_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _decode_split_kernel(
    q_ptr,  # (B, H, D) queries
    k_cache_ptr,  # (num_blocks, PAGE, Hkv, D) key pool
    v_cache_ptr,  # (num_blocks, PAGE, Hkv, D) value pool, same strides
    block_tables_ptr,  # (B, max_blocks) int32 pool block of each page of each sequence
    seq_lens_ptr,  # (B,) int32 number of keys per sequence
    mid_o_ptr,  # (B, H, NUM_SPLITS, D) fp32 out: each split's normalized partial output
    mid_lse_ptr,  # (B, H, NUM_SPLITS) fp32 out: each split's log2-sum-exp2 of scores
    scale_log2e,  # softmax scale * log2(e): scores in the exp2 domain
    stride_qb,
    stride_qh,
    stride_cb,  # cache stride between blocks
    stride_cs,  # cache stride between slots of a block
    stride_ch,  # cache stride between kv heads
    stride_bt,
    NUM_SPLITS,
    G: tl.constexpr,  # query heads per kv head
    D: tl.constexpr,
    PAGE: tl.constexpr,  # block_size of the pool
    BLOCK_G: tl.constexpr,  # G padded to a tl.dot-friendly power of two (>= 16)
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,  # keys per iteration
    DOT_DTYPE: tl.constexpr,  # operand dtype of tl.dot
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    acc, m_i, l_i = _attend_split(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, scale_log2e,
        stride_qb, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, NUM_SPLITS, b, kvh, split,
        G, D, PAGE, BLOCK_G, BLOCK_D, BLOCK_N, DOT_DTYPE, DOT_PRECISION,
    )  # fmt: skip
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * G + g
    gd_mask = (g < G)[:, None] & (d < D)[None, :]
    # An empty split (short sequence) writes lse = -inf and zeros: weight 0 in the merge.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    row = (b * (G * tl.num_programs(1)) + heads) * NUM_SPLITS + split  # (BLOCK_G,) index into (B, H, S)
    tl.store(mid_o_ptr + row[:, None] * D + d[None, :], acc / l_safe[:, None], mask=gd_mask)
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    tl.store(mid_lse_ptr + row, lse, mask=g < G)


@triton.jit
def _decode_merge_kernel(
    mid_o_ptr,  # (B, H, NUM_SPLITS, D) fp32 partial outputs
    mid_lse_ptr,  # (B, H, NUM_SPLITS) fp32 partial log2-sum-exp2
    out_ptr,  # (B, H, D) output, contiguous
    NUM_SPLITS,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)  # flattened (b, h)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(mid_lse_ptr + bh * NUM_SPLITS + s, mask=s < NUM_SPLITS, other=float("-inf"))
    m = tl.max(lse, axis=0)  # finite: split 0 is never empty when seq_len >= 1
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    w = w / tl.maximum(tl.sum(w, axis=0), 1e-30)  # seq_len 0 (graph padding): zeros, not NaN
    o_mask = (s < NUM_SPLITS)[:, None] & (d < D)[None, :]
    o = tl.load(mid_o_ptr + (bh * NUM_SPLITS + s)[:, None] * D + d[None, :], mask=o_mask, other=0.0)
    out = tl.sum(o * w[:, None], axis=0)
    tl.store(out_ptr + bh * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


def _num_splits(q, n_kv_programs: int, max_tiles: int) -> int:
    """Enough splits for ~4 programs per SM on the device, never more than the tiles
    the block table can address. On CPU (interpreter) pretend 4 SMs."""
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
    return max(1, min(triton.cdiv(4 * sms, n_kv_programs), max_tiles, 64))


def _decode(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits):
    b, h, d = q.shape
    _, page, hkv, _ = k_cache.shape
    g = h // hkv
    assert h % hkv == 0 and q.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    out = torch.empty((b, h, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    mid_o = torch.empty((b, h, num_splits, d), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((b, h, num_splits), dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(d))
    _decode_split_kernel[(b, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, mid_o, mid_lse, scale * 1.4426950408889634,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        num_splits, G=g, D=d, PAGE=page, BLOCK_G=max(16, triton.next_power_of_2(g)), BLOCK_D=block_d,
        BLOCK_N=64 if block_d <= 128 else 32, DOT_DTYPE=dot_dtype(q.dtype), DOT_PRECISION=dot_precision(q.dtype),
        num_warps=4, num_stages=2,
    )  # fmt: skip
    _decode_merge_kernel[(b * h,)](
        mid_o, mid_lse, out, num_splits, D=d,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)), BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
    return out


def paged_decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale: float):
    """Same contract as paged_decode_attention_ref. Grid (B, Hkv, splits) then (B*H,).

    The split count depends only on shapes and the device (never on seq_lens), so the
    launch is CUDA-graph safe; each sequence divides its own keys among the splits.
    """
    page = k_cache.shape[1]
    max_tiles = triton.cdiv(block_tables.shape[1] * page, 64)
    splits = _num_splits(q, q.shape[0] * k_cache.shape[2], max_tiles)
    return _decode(q, k_cache, v_cache, block_tables, seq_lens, scale, splits)


# The merge folded into the split kernel (kernels.ops(..., fused_decode=True)): one launch a
# layer instead of two. Each (sequence, kv head) row's programs write their partials as above,
# then take a ticket from the row's arrival counter; the last to arrive merges the row's
# partials into the output and sets the counter back to 0, so the counters are zero again
# at the end of every launch (CUDA-graph replays included) and need zeroing only once.
# With one split (large batch) the program writes its output directly, no partials at all.


@triton.jit
def _decode_fused_kernel(
    q_ptr,  # (B, H, D) queries
    k_cache_ptr,  # (num_blocks, PAGE, Hkv, D) key pool
    v_cache_ptr,  # (num_blocks, PAGE, Hkv, D) value pool, same strides
    block_tables_ptr,  # (B, max_blocks) int32 pool block of each page of each sequence
    seq_lens_ptr,  # (B,) int32 number of keys per sequence
    mid_o_ptr,  # (B, H, NUM_SPLITS, D) fp32 scratch: each split's normalized partial output
    mid_lse_ptr,  # (B, H, NUM_SPLITS) fp32 scratch: each split's log2-sum-exp2 of scores
    counter_ptr,  # (>= B * Hkv,) int32 arrivals per (sequence, kv head); 0 on entry, 0 on exit
    out_ptr,  # (B, H, D) output, contiguous
    scale_log2e,  # softmax scale * log2(e): scores in the exp2 domain
    stride_qb,
    stride_qh,
    stride_cb,  # cache stride between blocks
    stride_cs,  # cache stride between slots of a block
    stride_ch,  # cache stride between kv heads
    stride_bt,
    NUM_SPLITS,
    G: tl.constexpr,  # query heads per kv head
    D: tl.constexpr,
    PAGE: tl.constexpr,  # block_size of the pool
    BLOCK_G: tl.constexpr,  # G padded to a tl.dot-friendly power of two (>= 16)
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,  # keys per iteration
    ONE_SPLIT: tl.constexpr,  # NUM_SPLITS == 1: no partials, no counter
    DOT_DTYPE: tl.constexpr,  # operand dtype of tl.dot
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    acc, m_i, l_i = _attend_split(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, scale_log2e,
        stride_qb, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, NUM_SPLITS, b, kvh, split,
        G, D, PAGE, BLOCK_G, BLOCK_D, BLOCK_N, DOT_DTYPE, DOT_PRECISION,
    )  # fmt: skip
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = (b * (G * tl.num_programs(1)) + kvh * G + g).to(tl.int64)  # (BLOCK_G,) flattened (b, h)
    gd_mask = (g < G)[:, None] & (d < D)[None, :]
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    if ONE_SPLIT:  # seq_len 0 (graph padding): acc is 0, so zeros
        tl.store(out_ptr + heads[:, None] * D + d[None, :], (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty),
                 mask=gd_mask)
    else:
        row = heads * NUM_SPLITS + split  # (BLOCK_G,) index into (B, H, S)
        tl.store(mid_o_ptr + row[:, None] * D + d[None, :], acc / l_safe[:, None], mask=gd_mask)
        tl.store(mid_lse_ptr + row, tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")), mask=g < G)
        # The barrier: every thread's partials are stored before the one thread's ticket; release:
        # they are visible before it; acquire: the last program sees every other split's
        # partials (read past L1, ".cg"). (The interpreter runs programs in turn.)
        tl.debug_barrier()
        counter = counter_ptr + b * tl.num_programs(1) + kvh
        ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if ticket == NUM_SPLITS - 1:
            m = tl.full([BLOCK_G], float("-inf"), tl.float32)
            w_sum = tl.zeros([BLOCK_G], tl.float32)
            out = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
            for s in range(0, NUM_SPLITS):  # online merge: out = sum_s 2^(lse_s - m) o_s / sum_s 2^(lse_s - m)
                lse = tl.load(mid_lse_ptr + heads * NUM_SPLITS + s, mask=g < G, other=float("-inf"),
                              cache_modifier=".cg")
                o = tl.load(mid_o_ptr + (heads * NUM_SPLITS + s)[:, None] * D + d[None, :], mask=gd_mask,
                            other=0.0, cache_modifier=".cg")
                m_new = tl.maximum(m, lse)
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far: weights 0, not NaN
                alpha = tl.exp2(m - m_ref)
                w = tl.exp2(lse - m_ref)
                w_sum = w_sum * alpha + w
                out = out * alpha[:, None] + o * w[:, None]
                m = m_new
            out = out / tl.maximum(w_sum, 1e-30)[:, None]  # seq_len 0 (graph padding): zeros, not NaN
            tl.store(out_ptr + heads[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=gd_mask)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch


def _decode_fused(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, counters):
    b, h, d = q.shape
    _, page, hkv, _ = k_cache.shape
    g = h // hkv
    assert h % hkv == 0 and q.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    assert counters.dtype == torch.int32 and counters.numel() >= b * hkv
    out = torch.empty((b, h, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    one = num_splits == 1
    mid_o = out if one else torch.empty((b, h, num_splits, d), dtype=torch.float32, device=q.device)
    mid_lse = out if one else torch.empty((b, h, num_splits), dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(d))
    _decode_fused_kernel[(b, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, mid_o, mid_lse, counters, out, scale * 1.4426950408889634,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        num_splits, G=g, D=d, PAGE=page, BLOCK_G=max(16, triton.next_power_of_2(g)), BLOCK_D=block_d,
        BLOCK_N=64 if block_d <= 128 else 32, ONE_SPLIT=one, DOT_DTYPE=dot_dtype(q.dtype),
        DOT_PRECISION=dot_precision(q.dtype), num_warps=4, num_stages=2,
    )  # fmt: skip
    return out


class FusedDecodeAttention:
    """paged_decode_attention_triton's contract (its reference: paged_decode_attention_ref)
    in one launch, grid (B, Hkv, splits), the same split count.

    Holds the arrival counters, one int32 per (sequence, kv head), per device: zeroed once
    when first needed (outside graph capture: the graphs' warm-up runs each bucket eagerly,
    largest first) and zero again after every launch. Invariant: the launches that share
    an instance run one at a time (the engine's one stream), which every layer of a model
    and every graph of a Runner do.
    """

    def __init__(self, min_counters: int = 4096):
        self._min = min_counters
        self._counters: dict[torch.device, torch.Tensor] = {}

    def counters(self, device: torch.device, n: int) -> torch.Tensor:
        c = self._counters.get(device)
        if c is None or c.numel() < n:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"FusedDecodeAttention: {n} counters needed first during CUDA-graph capture; "
                                   "run the largest batch eagerly before capturing")
            c = self._counters[device] = torch.zeros(max(n, self._min), dtype=torch.int32, device=device)
        return c

    def __call__(self, q, k_cache, v_cache, block_tables, seq_lens, scale: float):
        if k_cache.dtype == torch.int8:
            raise ValueError("paged decode attention (Triton): an int8 KV pool (the C++ CPU step's) is not "
                             "served by the Triton kernels; use a bf16/fp16/fp32 pool")
        page, hkv = k_cache.shape[1], k_cache.shape[2]
        splits = _num_splits(q, q.shape[0] * hkv, triton.cdiv(block_tables.shape[1] * page, 64))
        return _decode_fused(q, k_cache, v_cache, block_tables, seq_lens, scale, splits,
                             self.counters(q.device, q.shape[0] * hkv))


def bench(batch: int = 1, context: int = 4096, heads: int = 32, kv_heads: int = 8, head_dim: int = 128) -> None:
    """GB/s (KV bytes read) of split + merge against the fused launch, bf16, on a GPU
    (python -m kernels.decode_attention)."""
    lens = [context] * batch
    page = 16
    blocks = batch * context // page
    k_cache = torch.randn(blocks, page, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(batch, -1)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    kv_bytes = 2 * batch * context * kv_heads * head_dim * 2
    fused = FusedDecodeAttention()
    for name, fn in (("split + merge", paged_decode_attention_triton), ("fused", fused)):
        ms = triton.testing.do_bench(lambda fn=fn: fn(q, k_cache, v_cache, block_tables, seq_lens, head_dim**-0.5))
        print(f"{name}: batch {batch}, context {context}: {ms * 1e3:.1f} us, {kv_bytes / ms / 1e6:.0f} GB/s")


if __name__ == "__main__":
    for b in (1, 8, 64):
        bench(batch=b)
