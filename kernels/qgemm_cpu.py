"""Block-quantized matmul on CPU with AVX-512 VNNI: y = x @ W^T, W kept in 4 or 8 bits.

The weight has GGUF's block form, blocks of 32 input columns, each with a scale d
and an offset m (both fp16, as GGUF stores them):

    W[n, 32 b + i] = d[n, b] * u[n, 32 b + i] + m[n, b]      u: 0..15 (4 bits) or -127..127 (8 bits, m = 0)

(Q4_1 is exactly this; Q4_0 is m = -8 d; Q8_0 is signed codes without m: `QWeight`
stores them as u = q + 128, m = -128 d, which is the same weight.) Activations are
quantized per block too (symmetric int16: codes q, scale dx, sx = dx * sum q), so
a block's dot product is integer work for VNNI's `vpdpwssd`:

    y[m, n] = sum_b  d[n, b] dx[m, b] * sum_i u[n, 32 b + i] q[m, 32 b + i]  +  m[n, b] sx[m, b]

int16 rather than llama.cpp's int8 activations: int8 moved SmolLM2's logits by ~3
and changed its greedy answer, int16 by ~0.01 (tests/replica/test_quant.py).

Packed layout (`pack`), what makes the kernel fast. A 512-bit register holds one
int32 lane per output row, so 16 rows (a *tile*) are computed together: for each
pair of input columns (2j, 2j + 1) of a block, one `vpdpwssd` multiplies the 16
rows' two codes by the two activations broadcast to every lane. Four tiles form a
*supertile* (64 rows); the file is supertile-major and, inside one, block-major,
so a thread streams its rows once, sequentially:

    supertile s, block b:  codes of tile 0..ts-1  |  d[ts x 16] fp16  |  m[ts x 16] fp16 (4 bits only)
    codes of one tile and block, 4 bits (256 bytes): 8 groups of 32 bytes; group j, byte 2r + e holds
        u[r, 2j + e] in its low nibble and u[r, 16 + 2j + e] in its high nibble   (r: row in the tile)
    8 bits (512 bytes): 16 groups j of 32 signed bytes, byte 2r + e = q[r, 2j + e]

The last supertile may hold fewer than 4 tiles (ts); N must be a multiple of 16.
A row's result does not depend on how many activation rows share the call (the
same per-lane operations in the same order for every tiling), so batching never
changes a seeded sample.

`qgemm_ref` is the definition in PyTorch on the unpacked codes; `qgemm_cpu`
runs the C++ kernel on packed weights (torch.utils.cpp_extension, built once per
machine) and needs AVX-512 VNNI; `available()` says whether it can run here.
`GEMM_CPP` is shared with `kernels/cpu_forward.py`, the whole decoder step.
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


def quantize_activations_ref(x: torch.Tensor):
    """Per block of 32: (codes int16 (M, K), dx (M, K/32), sx = dx * sum of codes)."""
    M, K = x.shape
    g = x.float().reshape(M, K // BLOCK, BLOCK)
    amax = g.abs().amax(-1)
    dx = amax / 32767
    inv = torch.where(amax > 0, 32767 / amax, torch.zeros_like(amax))
    q = torch.round(g * inv[..., None]).clamp(-32767, 32767)
    return q.to(torch.int16).reshape(M, K), dx, dx * q.sum(-1)


def qgemm_ref(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int) -> torch.Tensor:
    """x (M, K) float; qs (N, K * bits / 8) uint8; d, m (N, K/32) fp32 -> (M, N) fp32,
    with the activations quantized per block exactly as the kernel does."""
    q, dx, sx = quantize_activations_ref(x)
    u = unpack_codes(qs, bits).float()  # (N, K)
    N, K = u.shape
    dots = torch.einsum("mbi,nbi->mnb", q.double().reshape(-1, K // BLOCK, BLOCK),
                        u.double().reshape(N, K // BLOCK, BLOCK)).float()  # exact integer sums
    return (dots * d[None] * dx[:, None]).sum(-1) + sx @ m.T


def packable(n: int, k: int) -> bool:
    """Whether an (n, k) weight has the packed layout's shape."""
    return n % TILE == 0 and k % (2 * BLOCK) == 0


def pack(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int) -> torch.Tensor:
    """The kernel's layout (module docstring) of a weight given as qgemm_ref takes it.
    d and m must be fp16 values (GGUF's are; replica.quant's recipes round them so);
    8-bit weights must be symmetric (m = -128 d, Q8_0)."""
    u = unpack_codes(qs, bits)
    N, K = u.shape
    if not packable(N, K):
        raise ValueError(f"packed weights need rows % {TILE} == 0 and columns % {2 * BLOCK} == 0, got {N} x {K}")
    if not (torch.equal(d.half().float(), d.float()) and torch.equal(m.half().float(), m.float())):
        raise ValueError("packed weights keep scales and offsets in fp16: round them (as GGUF does) first")
    nb, T = K // BLOCK, N // TILE
    u = u.reshape(T, TILE, nb, BLOCK).permute(0, 2, 1, 3)  # (T, nb, 16 rows, 32 codes)
    if bits == 4:
        lo = u[..., :16].reshape(T, nb, TILE, 8, 2)  # (tile, block, row, j, e): column 2j + e
        hi = u[..., 16:].reshape(T, nb, TILE, 8, 2)  # column 16 + 2j + e
        codes = (lo | (hi << 4)).permute(0, 1, 3, 2, 4)  # (T, nb, j, row, e)
    elif bits == 8:
        if not torch.equal(m.float(), -128 * d.float()):
            raise ValueError("8-bit packed weights are symmetric (Q8_0): m must be -128 d")
        q = (u.to(torch.int16) - 128).to(torch.int8).view(torch.uint8)
        codes = q.reshape(T, nb, TILE, 16, 2).permute(0, 1, 3, 2, 4)
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


GEMM_CPP = r"""
#include <immintrin.h>
#include <algorithm>
#include <cstdint>

namespace qg {

// One activation row -> int16 codes, scale and scaled code sum per 32-block (K % 32 == 0).
static inline void quantize_row(const float* x, int64_t K, int16_t* q, float* dx, float* sx) {
  for (int64_t b = 0; b < K / 32; ++b) {
    __m512 a = _mm512_loadu_ps(x + 32 * b), c = _mm512_loadu_ps(x + 32 * b + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
    float d = amax / 32767.f, inv = amax > 0.f ? 32767.f / amax : 0.f;
    __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));  // round to nearest even
    __m512i qc = _mm512_cvtps_epi32(_mm512_mul_ps(c, _mm512_set1_ps(inv)));
    _mm256_storeu_si256((__m256i*)(q + 32 * b), _mm512_cvtsepi32_epi16(qa));
    _mm256_storeu_si256((__m256i*)(q + 32 * b + 16), _mm512_cvtsepi32_epi16(qc));
    dx[b] = d;
    sx[b] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc));
  }
}

// Quantized activations: M rows of K.
struct Act {
  const int16_t* q;
  const float* dx;
  const float* sx;
  int64_t M, K;
};

template <int BITS> constexpr int64_t chunk_bytes(int ts) { return ts * (BITS * 64 + 32 + (BITS == 4 ? 32 : 0)); }

// Rows [m0, m0 + MT) of x against tiles [i0, i0 + TN) of one supertile (ts tiles, at `sup`).
// y[m * ldy + n] = result (ADD: y += result). NACC int32 accumulators per (tile, row): two
// when few chains run at once, so the vpdpwssd latency stays hidden.
template <int BITS, int TN, int MT, int NACC, bool ADD>
static inline void kern(const Act& a, const uint8_t* sup, int ts, int i0, float* y, int64_t ldy, int64_t m0,
                        int64_t col0) {
  const int64_t nb = a.K / 32, cb = chunk_bytes<BITS>(ts), code_bytes = BITS * 64, kp = a.K / 2;
  const int32_t* xq = (const int32_t*)a.q;  // activation pairs (2j, 2j + 1) as one int32
  __m512 facc[TN][MT];
  for (int i = 0; i < TN; ++i)
    for (int t = 0; t < MT; ++t) facc[i][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* chunk = sup + b * cb;
    __m512i acc[TN][MT][NACC];
    for (int i = 0; i < TN; ++i)
      for (int t = 0; t < MT; ++t)
        for (int c = 0; c < NACC; ++c) acc[i][t][c] = _mm512_setzero_si512();
    if (BITS == 4) {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        for (int i = 0; i < TN; ++i) {
          __m512i z = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(chunk + (i0 + i) * code_bytes + 32 * j)));
          __m512i lo = _mm512_and_si512(z, _mm512_set1_epi16(0x0F)), hi = _mm512_srli_epi16(z, 4);
          for (int t = 0; t < MT; ++t) {
            const int32_t* xr = xq + (m0 + t) * kp + b * 16;
            acc[i][t][0] = _mm512_dpwssd_epi32(acc[i][t][0], lo, _mm512_set1_epi32(xr[j]));
            acc[i][t][NACC - 1] = _mm512_dpwssd_epi32(acc[i][t][NACC - 1], hi, _mm512_set1_epi32(xr[8 + j]));
          }
        }
      }
    } else {
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        for (int i = 0; i < TN; ++i) {
          __m512i z = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(chunk + (i0 + i) * code_bytes + 32 * j)));
          for (int t = 0; t < MT; ++t) {
            const int32_t* xr = xq + (m0 + t) * kp + b * 16;
            acc[i][t][j % NACC] = _mm512_dpwssd_epi32(acc[i][t][j % NACC], z, _mm512_set1_epi32(xr[j]));
          }
        }
      }
    }
    const uint16_t* dh = (const uint16_t*)(chunk + ts * code_bytes);
    for (int i = 0; i < TN; ++i) {
      __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dh + (i0 + i) * 16)));
      __m512 mv = BITS == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dh + (ts + i0 + i) * 16))) : dv;
      for (int t = 0; t < MT; ++t) {
        const int64_t r = (m0 + t) * nb + b;
        __m512i s = NACC == 2 ? _mm512_add_epi32(acc[i][t][0], acc[i][t][NACC - 1]) : acc[i][t][0];  // exact
        facc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dv, _mm512_set1_ps(a.dx[r])), facc[i][t]);
        if (BITS == 4) facc[i][t] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.sx[r]), facc[i][t]);
      }
    }
  }
  for (int i = 0; i < TN; ++i)
    for (int t = 0; t < MT; ++t) {
      float* out = y + (m0 + t) * ldy + col0 + (i0 + i) * 16;
      _mm512_storeu_ps(out, ADD ? _mm512_add_ps(_mm512_loadu_ps(out), facc[i][t]) : facc[i][t]);
    }
}

template <int BITS, int TN, int MT, int NACC, bool ADD>
static inline void over_tiles(const Act& a, const uint8_t* sup, int ts, float* y, int64_t ldy, int64_t m0,
                              int64_t col0) {
  int i = 0;
  for (; i + TN <= ts; i += TN) kern<BITS, TN, MT, NACC, ADD>(a, sup, ts, i, y, ldy, m0, col0);
  for (; i < ts; ++i) kern<BITS, 1, MT, 2, ADD>(a, sup, ts, i, y, ldy, m0, col0);
}

// y[:, rows of supertiles [sa, sz)] (+)= x @ W^T for a packed weight with N rows.
template <int BITS, bool ADD>
static void gemm_bits(const Act& a, const uint8_t* w, int64_t N, int64_t sa, int64_t sz, float* y, int64_t ldy) {
  const int64_t nb = a.K / 32, T = N / 16;
  for (int64_t s = sa; s < sz; ++s) {
    const int ts = (int)std::min<int64_t>(4, T - 4 * s);
    const uint8_t* sup = w + s * nb * chunk_bytes<BITS>(4);
    const int64_t col0 = s * 64;
    int64_t m = 0;
    for (; m + 4 <= a.M; m += 4) over_tiles<BITS, 2, 4, 1, ADD>(a, sup, ts, y, ldy, m, col0);
    switch (a.M - m) {
      case 3: over_tiles<BITS, 2, 3, 1, ADD>(a, sup, ts, y, ldy, m, col0); break;
      case 2: over_tiles<BITS, 4, 2, 1, ADD>(a, sup, ts, y, ldy, m, col0); break;
      case 1: over_tiles<BITS, 4, 1, 2, ADD>(a, sup, ts, y, ldy, m, col0); break;
      default: break;
    }
  }
}

static inline int64_t supertiles(int64_t N) { return (N / 16 + 3) / 4; }

static inline void gemm(const Act& a, const uint8_t* w, int64_t bits, int64_t N, int64_t sa, int64_t sz, float* y,
                        int64_t ldy, bool add) {
  if (bits == 4) (add ? gemm_bits<4, true> : gemm_bits<4, false>)(a, w, N, sa, sz, y, ldy);
  else (add ? gemm_bits<8, true> : gemm_bits<8, false>)(a, w, N, sa, sz, y, ldy);
}

}  // namespace qg
"""

_SOURCE = GEMM_CPP + r"""
#include <torch/extension.h>
#include <omp.h>

torch::Tensor qgemm(torch::Tensor x, torch::Tensor packed, int64_t N, int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "qgemm: x must be (M, K) float32");
  TORCH_CHECK(bits == 4 || bits == 8, "qgemm: bits must be 4 or 8");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 64 == 0 && N % 16 == 0, "qgemm: K % 64 and N % 16 must be 0");
  TORCH_CHECK(packed.numel() == (N / 16) * (K / 32) * (bits * 64 + 32 + (bits == 4 ? 32 : 0)),
              "qgemm: the packed weight does not have N x K");
  auto q = torch::empty({M, K}, x.options().dtype(torch::kShort));
  auto dx = torch::empty({M, K / 32}, x.options());
  auto sx = torch::empty({M, K / 32}, x.options());
  for (int64_t i = 0; i < M; ++i)
    qg::quantize_row(x.data_ptr<float>() + i * K, K, q.data_ptr<int16_t>() + i * K, dx.data_ptr<float>() + i * K / 32,
                     sx.data_ptr<float>() + i * K / 32);
  auto y = torch::empty({M, N}, x.options());
  const qg::Act a{q.data_ptr<int16_t>(), dx.data_ptr<float>(), sx.data_ptr<float>(), M, K};
  const int64_t S = qg::supertiles(N);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // A few rows take microseconds: a team's barrier would cost more than it saves (and stalls when a core is busy).
  const int threads = M < 16 ? 1 : (int)std::min<int64_t>(at::get_num_threads(), S);
#pragma omp parallel num_threads(threads)
  {
    const int nt = omp_get_num_threads(), id = omp_get_thread_num();
    qg::gemm(a, w, bits, N, S * id / nt, S * (id + 1) / nt, yp, N, false);
  }
  return y;
}
"""


def cpu_has_vnni() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return all(f" {flag}" in flags for flag in ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"))


def _extension():
    return load_cpp("edgechat_qgemm_packed", _SOURCE, ("qgemm",))


def available() -> bool:
    """An AVX-512 VNNI CPU and a C++ compiler: the kernel builds (once) and runs."""
    return cpu_has_vnni() and builds(_extension, "kernels.qgemm_cpu: the VNNI kernel", "using the reference")


def qgemm_cpu(x: torch.Tensor, packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """x (M, K) fp32 against a `pack`ed (n, K) weight -> (M, n) fp32; torch's thread count."""
    return _extension().qgemm(x, packed, n, bits)
