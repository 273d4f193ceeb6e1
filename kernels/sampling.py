"""Token sampling on device without host synchronization.

Per row: temperature == 0 -> greedy argmax. Otherwise sample from
softmax(logits / T) restricted to the top-k logits (k == 0: off; ties with the
k-th value are all kept) and then to the nucleus (top-p == 1: off): keep token i
iff the probability mass of the kept tokens with strictly larger logits is
< top_p, which keeps the smallest high-to-low prefix whose mass reaches top_p,
always at least the top token (ties with its last value kept).

Randomness is a pure function of (seed, position) per row: the Gumbel-max trick
argmax_i(logits_i / T + g_i), g_i = -log(-log(u_i)), with u_i from a
counter-based hash of (seed, position, i): a per-row key from (seed, position),
then one xorshift-multiply mixing round over the Weyl sequence i * 0x61C88647 +
key, computed in uint32 in the kernel and in int64 masked to 32 bits in the
reference (multipliers < 2^31, so no int64 product overflows). So batch
composition never changes a seeded token, a resumed request continues exactly,
and reference and
kernel pick the same token on the same inputs (up to an ulp of log).

Top-k/top-p in Triton without a sort: one program per row finds each threshold
exactly by bisection over the 32-bit order-preserving integer image of the fp32
logits (32 counting passes for top-k, 32 mass passes for top-p; skipped when
off), then one Gumbel-argmax pass. Rows pay only for the filters they use.
"""

import torch

from kernels._triton import tl, triton

_M32 = 0xFFFFFFFF
# Multipliers below 2^31: a product with a 32-bit value stays below 2^63, so the
# int64 reference is exact and matches the kernel's wrapping uint32 multiply.
_MUL1, _MUL2 = 0x7FEB352D, 0x7B935975
_WEYL = 0x61C88647  # 2^32 / golden ratio, negated mod 2^32
# The largest uniform: (2^24 - 1 + 0.5) / 2^24 rounds to 1.0 in fp32, where the Gumbel
# noise -log(-log(u)) is +inf and that token wins whatever its logit (one step in ~340
# over a 49,152-token vocabulary). Clamped to the largest fp32 below 1.
_U_MAX = 1.0 - 2.0**-24


def _mix32(x):
    """xorshift-multiply finalizer on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _M32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _M32
    return x ^ (x >> 16)


def row_keys(seeds, positions):
    """(h1, h2) (B,) int64: the per-row keys of the token hash, from (seed, position)."""
    seeds, positions = seeds.long(), positions.long()
    h1 = _mix32((seeds & _M32) ^ 0x3C6EF372)
    h1 = _mix32(h1 ^ ((seeds >> 32) & _M32))
    h1 = _mix32(h1 ^ (positions & _M32))
    h1 = _mix32(h1 ^ ((positions >> 32) & _M32))
    return h1, _mix32(h1 ^ 0x2545F491)


def token_uniforms(index, h1, h2):
    """fp32 in (0, 1) of token ids `index` under row keys h1, h2 (broadcast together)."""
    return unit_float(_mix32((((index * _WEYL) + h1) & _M32) ^ h2))


def uniforms_ref(seeds, positions, index):
    """fp32 in (0, 1): u = hash(seed, position, token index) per row.

    seeds, positions (B,) int64; index (V,) or (B, n) int64 token ids -> (B, V) or (B, n).
    """
    h1, h2 = row_keys(seeds, positions)
    return token_uniforms(index, h1[:, None], h2[:, None])


# The Gumbel noise -log(-log(u)) of the largest uniform, plus a margin for rounding: no token's
# noise exceeds it, so a token whose logit / T trails the top logit's score by more cannot win.
_G_MAX = 16.7
assert _G_MAX > -torch.log(-torch.log(torch.tensor(_U_MAX))).item() + 1e-3


def unit_float(bits):
    """uint32 hashes (int64 tensor) -> fp32 in (0, 1): the top 24 bits, centred, never 1."""
    return (((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))).clamp_max(_U_MAX)


def _kept(x, t, top_k, top_p, width: int = 1024):
    """Token ids of each row of logits x (B, V) sorted by logit, descending (B, n),
    and how many of them top-k then top-p keep (B, 1); the kept set is every token
    whose logit is >= the last kept one (ties included), and its threshold (B, 1).

    Looks at the `width` largest logits first (enough for real LLM distributions,
    and far cheaper than sorting the vocabulary on CPU); sorts fully only when the
    kept set does not provably end inside them.
    """
    v = x.shape[1]
    k = top_k.long()[:, None]
    k_on = (k > 0) & (k < v)
    p_on = top_p.float()[:, None] < 1
    z_max = x.max(-1, keepdim=True).values / t
    c = min(v, max(width, int(torch.where(k_on, k, 0).max())))
    while True:
        if c < v:
            sx, si = torch.topk(x, c, dim=-1)  # sorted, descending
        else:
            sx, si = torch.sort(x, dim=-1, descending=True)
        kth = torch.where(k_on, sx.gather(1, (k - 1).clamp(0, c - 1)), float("-inf"))
        e = torch.where(sx >= kth, torch.exp(sx / t - z_max), 0.0)  # unnormalized probabilities
        total = e.sum(-1, keepdim=True)
        if c < v:  # rows without top-k: mass of the whole vocabulary
            total = torch.where(k_on, total, torch.exp(x / t - z_max).sum(-1, keepdim=True))
        # mass of the strictly earlier (larger) entries: an exclusive cumsum, by shifting
        mass_gt = torch.cat([torch.zeros_like(e[:, :1]), torch.cumsum(e, dim=-1)[:, :-1]], dim=-1)
        n_p = ((mass_gt < top_p.float()[:, None] * total) & (sx >= kth)).sum(-1, keepdim=True)
        thr = torch.where(p_on, sx.gather(1, (n_p - 1).clamp_min(0)), kth)  # >= kth; >= 1 token
        n_keep = (x >= thr).sum(-1, keepdim=True)
        n_k = (x >= kth).sum(-1, keepdim=True)
        if c == v or bool(((~k_on | (n_k <= c)) & (~p_on | (n_p < c)) & (n_keep <= c)).all()):
            return si, n_keep, thr
        c = v


def probs_ref(logits, temperature, top_k, top_p):
    """(B, V) fp32: the distribution `sample` draws from (one-hot argmax where T == 0)."""
    x = logits.float()
    t = torch.where(temperature > 0, temperature, 1.0).float()[:, None]
    v = x.shape[1]
    filtered = ((top_k > 0) & (top_k < v)) | (top_p < 1)
    thr = torch.full_like(x[:, :1], float("-inf"))  # unfiltered rows keep the whole vocabulary
    rows = filtered.nonzero()[:, 0]
    if rows.numel():
        thr[rows] = _kept(x[rows], t[rows], top_k[rows], top_p[rows])[2]
    p = torch.softmax(torch.where(x >= thr, x / t, float("-inf")), dim=-1)
    greedy = torch.nn.functional.one_hot(x.argmax(-1), x.shape[1]).float()
    return torch.where((temperature > 0)[:, None], p, greedy)


def _gumbel_argmax(x, t, seeds, positions):
    """argmax_i(x_i / t + g_i) over each row's whole vocabulary, hashing only the tokens
    that can win: the top logit's score s0 = x_top / t + g_top is a lower bound of the
    winner's, and a token's noise is at most _G_MAX, so only x_i / t >= s0 - _G_MAX can
    reach it (at T=0.7 over the default model's logits, a median of ~500 of 49,152). Their
    scores are computed exactly as over the whole row, and ties go to the lowest id, so
    the token is the one the full computation picks."""
    b, v = x.shape
    z = x / t
    h1, h2 = row_keys(seeds, positions)
    top = x.argmax(-1, keepdim=True)
    s0 = z.gather(1, top) - torch.log(-torch.log(token_uniforms(top, h1[:, None], h2[:, None])))
    row, col = (z >= s0 - _G_MAX).nonzero(as_tuple=True)  # row-major: ids ascending within a row
    score = z[row, col] - torch.log(-torch.log(token_uniforms(col, h1[row], h2[row])))
    best = torch.full((b,), float("-inf"), device=x.device).scatter_reduce(0, row, score, "amax")
    win = score == best[row]
    return torch.full((b,), v, device=x.device).scatter_reduce(0, row[win], col[win], "amin")


def sample_ref(logits, temperature, top_k, top_p, seeds, positions):
    """logits (B, V) fp32; temperature (B,) fp32; top_k (B,) int32; top_p (B,) fp32;
    seeds, positions (B,) int64 -> (B,) int64 token ids.

    The CPU path: it branches on the data to skip work (greedy rows, unfiltered
    rows) and hashes only the kept tokens; it picks the kernel's tokens.
    """
    x = logits.float()
    tokens = x.argmax(-1)
    v = x.shape[1]
    t = temperature.float()[:, None]
    filtered = ((top_k > 0) & (top_k < v)) | (top_p < 1)
    rows = ((temperature > 0) & ~filtered).nonzero()[:, 0]
    if rows.numel():  # softmax(x / T) over the whole vocabulary
        tokens[rows] = _gumbel_argmax(x[rows], t[rows], seeds[rows], positions[rows])
    rows = ((temperature > 0) & filtered).nonzero()[:, 0]
    if rows.numel():  # only the kept tokens: the first n_keep of each row's sorted ids
        si, n_keep, _ = _kept(x[rows], t[rows], top_k[rows], top_p[rows])
        idx = si[:, : int(n_keep.max())]
        u = uniforms_ref(seeds[rows], positions[rows], idx)
        score = x[rows].gather(1, idx) / t[rows] - torch.log(-torch.log(u))
        score = score.masked_fill(torch.arange(idx.shape[1], device=x.device) >= n_keep, float("-inf"))
        tokens[rows] = idx.gather(1, score.argmax(-1, keepdim=True))[:, 0]
    return tokens


@triton.jit
def _mix32_tl(x):
    """The reference's _mix32 on uint32 (multiplies wrap mod 2^32)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x7B935975
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
        h1 = _mix32_tl(seed.to(tl.uint32) ^ 0x3C6EF372)
        h1 = _mix32_tl(h1 ^ (seed >> 32).to(tl.uint32))
        h1 = _mix32_tl(h1 ^ pos.to(tl.uint32))
        h1 = _mix32_tl(h1 ^ (pos >> 32).to(tl.uint32))
        h2 = _mix32_tl(h1 ^ 0x2545F491)
        best_s = tl.full([], float("-inf"), tl.float32)
        for v0 in range(0, V, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=offs < V, other=float("-inf"))
            r = _mix32_tl((offs.to(tl.uint32) * 0x61C88647 + h1) ^ h2)
            u = tl.minimum(((r >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0), 0.99999994)  # unit_float
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
