// Block-quantized matmul y = x W^T on AVX-512 VNNI, W in 4 or 8 bits: int16 activation codes per 32-block,
// weights in the packed layout that kernels/qgemm_cpu.py's `pack` writes and its docstring draws (tiles of 16
// output rows, one int32 lane each; supertiles of 4 tiles, block-major). `qgemm_ref` there is the definition.
// Used by qgemm.cpp (one matmul) and cpu_forward.cpp (the whole step).
#pragma once

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

template <int BITS>
constexpr int64_t chunk_bytes(int ts) {
  return ts * (BITS * 64 + 32 + (BITS == 4 ? 32 : 0));
}

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
          __m512i z =
              _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(chunk + (i0 + i) * code_bytes + 32 * j)));
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
          __m512i z =
              _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(chunk + (i0 + i) * code_bytes + 32 * j)));
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
  if (bits == 4)
    (add ? gemm_bits<4, true> : gemm_bits<4, false>)(a, w, N, sa, sz, y, ldy);
  else
    (add ? gemm_bits<8, true> : gemm_bits<8, false>)(a, w, N, sa, sz, y, ldy);
}

}  // namespace qg
