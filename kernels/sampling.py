"""Token sampling on device without host synchronization.

Per row: temperature == 0 -> greedy argmax. Otherwise sample from
softmax(logits / T) restricted to the top-k logits (k == 0: off; ties with the
k-th value are all kept) and then to the nucleus (top-p == 1: off): keep token i
iff the probability mass of the kept tokens with strictly larger logits is
< top_p, which keeps the smallest high-to-low prefix whose mass reaches top_p,
always at least the top token (ties with its last value kept).

Randomness is a pure function of (seed, position) per row: the Gumbel-max trick
argmax_i(logits_i / T + g_i), g_i = -log(-log(u_i)), with u_i from a
counter-based hash of (seed, position, i): murmur3's 32-bit finalizer, computed
in uint32 in the kernel and in int64 masked to 32 bits in the reference (with
the multiply split so no int64 product overflows). So batch composition never
changes a seeded token, a resumed request continues exactly, and reference and
kernel pick the same token on the same inputs (up to an ulp of log).

Top-k/top-p in Triton without a sort: one program per row finds each threshold
exactly by bisection over the 32-bit order-preserving integer image of the fp32
logits (32 counting passes for top-k, 32 mass passes for top-p; skipped when
off), then one Gumbel-argmax pass. Rows pay only for the filters they use.
"""

import torch

from kernels._triton import tl, triton

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def _mul32(x, c: int):
    """(x * c) mod 2^32 for int64 x in [0, 2^32), with every product < 2^49."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(x):
    """murmur3 finalizer on int64 holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _row_keys(seeds, positions):
    """Two 32-bit keys per row from (seed, position), int64 (B,) each."""
    h = _fmix32((seeds & _M32) ^ _GOLDEN)
    h = _fmix32(h ^ ((seeds >> 32) & _M32))
    h = _fmix32(h ^ (positions & _M32))
    h = _fmix32(h ^ ((positions >> 32) & _M32))
    return h, _fmix32(h ^ 0x85EBCA6B)


def uniforms_ref(seeds, positions, vocab: int):
    """(B, V) fp32 in (0, 1): u[b, i] = hash(seeds[b], positions[b], i)."""
    h1, h2 = _row_keys(seeds.long(), positions.long())
    idx = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    r = _fmix32((_mul32(idx, _GOLDEN)[None, :] + h1[:, None]) & _M32)
    r = _fmix32(r ^ h2[:, None])
    return ((r >> 8).float() + 0.5) * (1.0 / (1 << 24))


def _keep_mask(logits, temperature, top_k, top_p):
    """bool (B, V): the tokens top-k then top-p keep (rows with T == 0: all)."""
    b, v = logits.shape
    x = logits.float()
    sx, _ = torch.sort(x, dim=-1, descending=True)
    k = top_k.long()
    kth = sx.gather(1, (k - 1).clamp(0, v - 1)[:, None])  # (B, 1)
    kth = torch.where((k > 0)[:, None], kth, torch.full_like(kth, float("-inf")))
    t = torch.where(temperature > 0, temperature, 1.0).float()[:, None]
    z = torch.where(sx >= kth, sx / t, float("-inf"))  # sorted, top-k applied
    e = torch.exp(z - z[:, :1])
    # mass of strictly earlier (larger) entries: exclusive cumsum by shifting
    mass_gt = torch.cat([torch.zeros_like(e[:, :1]), torch.cumsum(e, dim=-1)[:, :-1]], dim=-1)
    in_p = (mass_gt < top_p.float()[:, None] * e.sum(-1, keepdim=True)) & (sx >= kth)
    last = (in_p.sum(-1, keepdim=True) - 1).clamp_min(0)
    thr_p = sx.gather(1, last)
    thr = torch.where((top_p < 1)[:, None], torch.maximum(thr_p, kth), kth)
    return x >= thr


def probs_ref(logits, temperature, top_k, top_p):
    """(B, V) fp32: the distribution `sample` draws from (one-hot argmax where T == 0)."""
    keep = _keep_mask(logits, temperature, top_k, top_p)
    t = torch.where(temperature > 0, temperature, 1.0).float()[:, None]
    p = torch.softmax(torch.where(keep, logits.float() / t, float("-inf")), dim=-1)
    greedy = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[1]).float()
    return torch.where((temperature > 0)[:, None], p, greedy)


def sample_ref(logits, temperature, top_k, top_p, seeds, positions):
    """logits (B, V) fp32; temperature (B,) fp32; top_k (B,) int32; top_p (B,) fp32;
    seeds, positions (B,) int64 -> (B,) int64 token ids."""
    keep = _keep_mask(logits, temperature, top_k, top_p)
    t = torch.where(temperature > 0, temperature, 1.0).float()[:, None]
    u = uniforms_ref(seeds, positions, logits.shape[1])
    score = torch.where(keep, logits.float() / t - torch.log(-torch.log(u)), float("-inf"))
    return torch.where(temperature > 0, score.argmax(-1), logits.argmax(-1))


@triton.jit
def _fmix32_tl(x):
    """murmur3 finalizer on uint32 (wrapping multiplies)."""
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _order_key_tl(x):
    """fp32 -> int32 with the same order (flip the magnitude bits of negatives)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _sample_kernel(
    logits_ptr,  # (B, V) fp32 logits, row stride stride_row
    temp_ptr,  # (B,) fp32 temperature; <= 0 means greedy
    top_k_ptr,  # (B,) int32; 0 = off
    top_p_ptr,  # (B,) fp32; >= 1 = off
    seed_ptr,  # (B,) int64 per-request seed
    pos_ptr,  # (B,) int64 position of the token being sampled
    out_ptr,  # (B,) int64 sampled token ids
    stride_row,
    V,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    temp = tl.load(temp_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    sampling = temp > 0
    t = tl.where(sampling, temp, 1.0)

    # Pass 1: max and first argmax of the logits (the greedy token).
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.full([], 0, tl.int32)
    for v0 in range(0, V, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < V, other=float("-inf"))
        m = tl.max(x, axis=0)
        better = m > best  # strict: the first maximum wins, as torch.argmax
        best_i = tl.where(better, v0 + tl.argmax(x, axis=0), best_i)
        best = tl.where(better, m, best)
    token = best_i.to(tl.int64)

    thr = tl.full([], -(2**31), tl.int64)  # keep tokens with order key >= thr
    if sampling & (top_k > 0) & (top_k < V):
        # Top-k: the largest key t with count(key >= t) >= k is the k-th largest key.
        lo = tl.full([], -(2**31), tl.int64)  # count(key >= lo) = V >= k
        hi = tl.full([], 2**31, tl.int64)  # count = 0 < k
        for _ in range(32):
            mid = (lo + hi) >> 1
            count = tl.zeros([], tl.int32)
            for v0 in range(0, V, BLOCK):
                offs = v0 + tl.arange(0, BLOCK)
                x = tl.load(base + offs, mask=offs < V, other=0.0)
                count += tl.sum(((offs < V) & (_order_key_tl(x) >= mid)).to(tl.int32), axis=0)
            ok = count >= top_k
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        thr = lo

    if sampling & (top_p < 1):
        # Top-p: the smallest key t with mass(kept, key > t) < top_p * total mass.
        m_z = best / t
        total = tl.zeros([], tl.float32)
        for v0 in range(0, V, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=offs < V, other=float("-inf"))
            kept = (offs < V) & (_order_key_tl(x) >= thr)
            total += tl.sum(tl.where(kept, tl.exp(x / t - m_z), 0.0), axis=0)
        lo = thr - 1  # keeping everything would reach mass 1 > top_p: invalid
        hi = _order_key_tl(best).to(tl.int64)  # keeping only the top token is always valid
        for _ in range(32):
            mid = (lo + hi) >> 1
            mass = tl.zeros([], tl.float32)
            for v0 in range(0, V, BLOCK):
                offs = v0 + tl.arange(0, BLOCK)
                x = tl.load(base + offs, mask=offs < V, other=float("-inf"))
                key = _order_key_tl(x)
                above = (offs < V) & (key >= thr) & (key > mid)
                mass += tl.sum(tl.where(above, tl.exp(x / t - m_z), 0.0), axis=0)
            ok = mass < top_p * total
            hi = tl.where(ok, mid, hi)
            lo = tl.where(ok, lo, mid)
        thr = hi

    if sampling:
        # Gumbel-max over the kept tokens with hashed uniforms u(seed, position, i).
        seed = tl.load(seed_ptr + row)
        pos = tl.load(pos_ptr + row)
        h1 = _fmix32_tl(seed.to(tl.uint32) ^ 0x9E3779B9)
        h1 = _fmix32_tl(h1 ^ (seed >> 32).to(tl.uint32))
        h1 = _fmix32_tl(h1 ^ pos.to(tl.uint32))
        h1 = _fmix32_tl(h1 ^ (pos >> 32).to(tl.uint32))
        h2 = _fmix32_tl(h1 ^ 0x85EBCA6B)
        best_s = tl.full([], float("-inf"), tl.float32)
        for v0 in range(0, V, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=offs < V, other=float("-inf"))
            r = _fmix32_tl(offs.to(tl.uint32) * 0x9E3779B9 + h1)
            r = _fmix32_tl(r ^ h2)
            u = ((r >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            s = tl.where((offs < V) & (_order_key_tl(x) >= thr), x / t - tl.log(-tl.log(u)), float("-inf"))
            m = tl.max(s, axis=0)
            better = m > best_s
            token = tl.where(better, (v0 + tl.argmax(s, axis=0)).to(tl.int64), token)
            best_s = tl.where(better, m, best_s)
    tl.store(out_ptr + row, token)


def sample_triton(logits, temperature, top_k, top_p, seeds, positions):
    """Same contract as sample_ref; one program per row, no host synchronization."""
    b, v = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b > 0:
        block = min(4096, triton.next_power_of_2(v))
        _sample_kernel[(b,)](
            logits, temperature, top_k, top_p, seeds, positions, out, logits.stride(0), v,
            BLOCK=block, num_warps=8 if block >= 2048 else 4,
        )  # fmt: skip
    return out
