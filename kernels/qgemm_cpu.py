"""Block-quantized matmul on CPU with AVX-512 VNNI: y = x @ W^T, W kept in 4 or 8 bits.

The weight has GGUF's block form, blocks of 32 input columns, each with a scale d
and an offset m (both fp16, as GGUF stores them):

    W[n, 32 b + i] = d[n, b] * u[n, 32 b + i] + m[n, b]      u: 0..15 (4 bits) or -127..127 (8 bits, m = 0)

(Q4_1 is exactly this; Q4_0 is m = -8 d; Q8_0 is signed codes without m: `QWeight`
stores them as u = q + 128, m = -128 d, which is the same weight.) Activations are
quantized per block too (symmetric codes q, scale dx, sx = sum of dx q), so a block's
dot product is integer work for VNNI's `vpdpbusd` (unsigned weight bytes times signed
activation bytes, four at a time):

    y[m, n] = sum_b  d[n, b] dx[m, b] sum_i u[n, 32 b + i] q[m, 32 b + i]  +  m[n, b] sx[m, b]

(8 bits: the offset stays in the integer sum, d dx sum_i (u - 128) q, one multiply-add
less a block: `qgemm_ref` computes it that way too.)

Each row is quantized one of two ways:
  * wide (the default, every row that samples a token): int16 codes, one scale per
    block, multiplied two at a time by `vpdpwssd` against the weight bytes widened to
    int16 as they are loaded. int8 activations moved SmolLM2's logits by ~1-3 and
    changed its greedy answers; int16 moves them by ~0.01 (tests/replica/model/test_quant.py).
  * narrow (`narrow` rows: prompt rows whose only output is the KV they leave, when the
    replica is told so): int8 codes, one scale per block as llama.cpp's Q8_1 activations,
    one `vpdpbusd`: twice the multiply-adds an instruction. (A scale per 16 columns was
    more exact and cost two more instructions a block: docs/perf.md, "Prefill".) What it
    costs in quality: bench/activations.py and bench/quality.py.

Packed layout (`pack`), what makes the kernel fast. A 512-bit register holds one
int32 lane per output row, so 16 rows (a *tile*) are computed together: for each
group of four input columns (4g .. 4g + 3) of a block, one `vpdpbusd` multiplies
the 16 rows' four codes by the four activations broadcast to every lane. Four tiles
form a *supertile* (64 rows); the file is supertile-major and, inside one,
block-major, so a thread streams its rows once, sequentially:

    supertile s, block b:  codes of tile 0..ts-1  |  d[ts x 16] fp16  |  m[ts x 16] fp16 (4 bits only)
    codes of one tile and block, 4 bits (256 bytes): 4 parts k of 64 bytes; byte 4r + e of part k holds
        u[r, 8k + e] in its low nibble and u[r, 8k + 4 + e] in its high one   (r: row in the tile)
    8 bits (512 bytes): 8 groups g of 64 bytes, byte 4r + e = u[r, 4g + e]   (u = q + 128, unsigned)

The last supertile may hold fewer than 4 tiles (ts); N must be a multiple of 16.
A row's result does not depend on how many activation rows share the call (the
same per-lane operations in the same order for every tiling), so batching never
changes a seeded sample.

`qgemm_ref` is the definition in PyTorch on the unpacked codes; `qgemm_cpu`
runs the C++ kernel (kernels/csrc/qgemm.cpp over csrc/include/edgechat/qgemm.h,
which the whole step, csrc/cpu_forward.cpp, shares; built once per machine) on
packed weights and needs AVX-512 VNNI; `available()` says whether it can run here.
"""

from __future__ import annotations

import torch

from kernels.cpu_build import builds, load_cpp

BLOCK = 32
TILE, SUPER = 16, 4  # rows per tile, tiles per supertile


def unpack_codes(qs: torch.Tensor, bits: int) -> torch.Tensor:
    """(N, K) uint8 codes from the stored rows ((N, K/2) for 4 bits, GGUF's nibble order)."""
    if bits == 8:
        return qs
    N = qs.shape[0]
    blocks = qs.reshape(N, -1, BLOCK // 2)  # (N, K/32, 16)
    return torch.cat([blocks & 0xF, blocks >> 4], dim=-1).reshape(N, -1)


WIDE, NARROW = 32767, 127  # largest code of a wide (int16) and a narrow (int8) row


def quantize_activations_ref(x: torch.Tensor, narrow: torch.Tensor | None = None):
    """Codes (M, K) int32, dx (M, K/32) the block's scale, sx (M, K/32) = dx * the block's
    code sum. Rows where `narrow` (M,) bool is set are int8, the others int16."""
    M, K = x.shape
    g = x.float().reshape(M, K // BLOCK, BLOCK)
    wide = torch.ones(M, dtype=torch.bool) if narrow is None else ~narrow.bool()
    amax = g.abs().amax(-1)
    levels = torch.where(wide, WIDE, NARROW).float()[:, None]
    dx = amax / levels
    inv = torch.where(amax > 0, levels / amax, torch.zeros_like(amax))
    q = torch.round(g * inv[..., None])  # within +-levels already: |g| <= amax
    return q.to(torch.int32).reshape(M, K), dx, dx * q.sum(-1)


def qgemm_ref(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int,
              narrow: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) float; qs (N, K * bits / 8) uint8; d, m (N, K/32) fp32 -> (M, N) fp32,
    with the activations quantized exactly as the kernel does (rows in `narrow` int8)."""
    q, dx, sx = quantize_activations_ref(x, narrow)
    u = unpack_codes(qs, bits).double()  # (N, K)
    N, K = u.shape
    symmetric = bits == 8 and torch.equal(m.float(), -128 * d.float())
    if symmetric:  # the kernel's form: the offset inside the integer sums, u - 128 = the signed code
        u = u - 128
    dots = torch.einsum("mbi,nbi->mnb", q.double().reshape(-1, K // BLOCK, BLOCK),
                        u.reshape(N, K // BLOCK, BLOCK))  # exact integer sums per block
    f = (dots * dx[:, None].double()).float()  # (M, N, blocks)
    y = (f * d[None]).sum(-1)
    return y if symmetric else y + sx @ m.T


def packable(n: int, k: int) -> bool:
    """Whether an (n, k) weight has the packed layout's shape."""
    return n % TILE == 0 and k % (2 * BLOCK) == 0


def pack(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int) -> torch.Tensor:
    """The kernel's layout (module docstring) of a weight given as qgemm_ref takes it.
    d and m must be fp16 values (GGUF's are; replica.model.quant's recipes round them so);
    8-bit weights must be symmetric (m = -128 d, Q8_0)."""
    u = unpack_codes(qs, bits)
    N, K = u.shape
    if not packable(N, K):
        raise ValueError(f"packed weights need rows % {TILE} == 0 and columns % {2 * BLOCK} == 0, got {N} x {K}")
    if not (torch.equal(d.half().float(), d.float()) and torch.equal(m.half().float(), m.float())):
        raise ValueError("packed weights keep scales and offsets in fp16: round them (as GGUF does) first")
    nb, T = K // BLOCK, N // TILE
    u = u.reshape(T, TILE, nb, BLOCK).permute(0, 2, 1, 3)  # (T, nb, 16 rows, 32 codes)
    g = u.reshape(T, nb, TILE, 8, 4).permute(0, 1, 3, 2, 4)  # (tile, block, g, row, e): column 4g + e
    if bits == 4:
        codes = g[:, :, 0::2] | (g[:, :, 1::2] << 4)  # groups 2k and 2k + 1 share a byte
    elif bits == 8:
        if not torch.equal(m.float(), -128 * d.float()):
            raise ValueError("8-bit packed weights are symmetric (Q8_0): m must be -128 d")
        codes = g
    else:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    codes = codes.reshape(T, nb, -1)

    def scales(t: torch.Tensor) -> torch.Tensor:  # (N, nb) -> (T, nb, 32 bytes)
        return t.half().reshape(T, TILE, nb).permute(0, 2, 1).contiguous().view(torch.uint8)

    parts = [codes, scales(d)] + ([scales(m)] if bits == 4 else [])

    def supertiles(t0: int, count: int, ts: int) -> torch.Tensor:  # tiles t0.. as `count` supertiles of ts tiles
        return torch.cat([p[t0 : t0 + count * ts].reshape(count, ts, nb, -1).transpose(1, 2).reshape(count, nb, -1)
                          for p in parts], -1).reshape(-1)  # (supertile, block, [codes | d | m] of its tiles)

    full, rest = divmod(T, SUPER)
    out = ([supertiles(0, full, SUPER)] if full else []) + ([supertiles(full * SUPER, 1, rest)] if rest else [])
    return torch.cat(out).contiguous()


def cpu_has_vnni() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return all(f" {flag}" in flags for flag in ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"))


def _extension():
    return load_cpp("edgechat_qgemm_packed", "qgemm.cpp")


def available() -> bool:
    """An AVX-512 VNNI CPU and a C++ compiler: the kernel builds (once) and runs."""
    return cpu_has_vnni() and builds(_extension, "kernels.qgemm_cpu: the VNNI kernel", "using the reference")


def qgemm_cpu(x: torch.Tensor, packed: torch.Tensor, n: int, bits: int,
              narrow: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) fp32 against a `pack`ed (n, K) weight -> (M, n) fp32; torch's thread count.
    narrow (M,) bool: the rows quantized narrow (int8), the others wide."""
    return _extension().qgemm(x, packed, n, bits, narrow)
