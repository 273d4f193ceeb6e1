// Block-quantized matmul y = x W^T on AVX-512 VNNI, W in 4 or 8 bits, in the packed layout that
// kernels/qgemm_cpu.py's `pack` writes and its docstring draws (tiles of 16 output rows, one int32 lane each, four
// input columns a lane; supertiles of 4 tiles, block-major). Each activation row is quantized per 32-block either
// *wide* (int16 codes, multiplied as pairs by vpdpwssd: the weight bytes widened to int16 as they are loaded) or
// *narrow* (int8 codes, multiplied four at a time by vpdpbusd, unsigned weight bytes x signed activation bytes: twice
// the multiply-adds an instruction; llama.cpp's Q8_1 activations have the same form), one scale per block either way.
// `qgemm_ref` there is the definition. Used by qgemm.cpp (one matmul) and cpu_forward.cpp (the whole step).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "edgechat/vmath.h"

namespace qg {

constexpr float kWide = 32767.f;
constexpr float kNarrow = 127.f;

// What a matmul does with its result y: store it, add it to y, or (gate/up with rows interleaved by 32: tiles 0, 1
// of a supertile gate columns, 2, 3 the same up columns) store silu(gate) up, 32 columns a supertile, so the
// (M, 2 I) gate/up product is never written to memory and read back.
enum Out { kStore, kAdd, kGlu };

// One activation row of K (K % 32 == 0) -> codes at q (2K bytes), the scale dx, the code sum sq and the scaled
// code sum sx = dx sq of each 32-block. Narrow: K int8 codes in column order.
// Wide: K int16 codes, each 8 columns stored as the pairs the kernel multiplies, (0, 2), (1, 3), (4, 6), (5, 7).
static inline void quantize_row(const float* x, int64_t K, int8_t* q, float* dx, int32_t* sq, float* sx, bool wide) {
  const __m512i pairs = _mm512_set_epi16(31, 29, 30, 28, 27, 25, 26, 24, 23, 21, 22, 20, 19, 17, 18, 16,  //
                                         15, 13, 14, 12, 11, 9, 10, 8, 7, 5, 6, 4, 3, 1, 2, 0);
  for (int64_t b = 0; b < K / 32; ++b) {
    const __m512 a = _mm512_loadu_ps(x + 32 * b), c = _mm512_loadu_ps(x + 32 * b + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));  // one reduction
    const float levels = wide ? kWide : kNarrow, d = amax / levels, inv = amax > 0.f ? levels / amax : 0.f;
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));  // round to nearest even
    const __m512i qc = _mm512_cvtps_epi32(_mm512_mul_ps(c, _mm512_set1_ps(inv)));
    if (wide) {
      const __m512i codes =
          _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtsepi32_epi16(qa)), _mm512_cvtsepi32_epi16(qc), 1);
      _mm512_storeu_si512(q + 64 * b, _mm512_permutexvar_epi16(pairs, codes));
    } else {
      _mm_storeu_si128((__m128i*)(q + 32 * b), _mm512_cvtsepi32_epi8(qa));
      _mm_storeu_si128((__m128i*)(q + 32 * b + 16), _mm512_cvtsepi32_epi8(qc));
    }
    dx[b] = d;
    sq[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc));
    sx[b] = d * (float)sq[b];
  }
}

// Outlier columns of narrow rows, kept out of their int8 blocks: row m's n values at x + m stride, against the exact
// weight columns at w + (n / 16) n 16 for output columns [n, n + 16) (16 outputs of column j at a time).
struct Outliers {
  const float* x = nullptr;
  const float* w = nullptr;
  int64_t n = 0, stride = 0;
};

// Quantized activations: M rows of K, row m's codes at q + 2 K m, its per-block values at dx, sq, sx + (K / 32) m.
// wide[m] says how row m was quantized (nullptr: every row wide); `out`: the narrow rows' outlier columns, if any.
struct Act {
  const int8_t* q;
  const float* dx;
  const int32_t* sq;
  const float* sx;
  int64_t M, K;
  const uint8_t* wide = nullptr;
  Outliers out{};
  bool is_wide(int64_t m) const { return !wide || wide[m]; }
  // Rows [m0, m1) alone.
  Act rows(int64_t m0, int64_t m1) const {
    Outliers o = out;
    if (o.x) o.x += m0 * o.stride;
    const int64_t nb = K / 32;
    return {q + 2 * K * m0, dx + nb * m0, sq + nb * m0, sx + nb * m0, m1 - m0, K, wide ? wide + m0 : nullptr, o};
  }
};

template <int BITS>
constexpr int64_t chunk_bytes(int ts) {
  return ts * (BITS * 64 + 32 + (BITS == 4 ? 32 : 0));
}

// Tile codes for input columns 8k + 4h .. 8k + 4h + 3 of a block (h = 0, 1) as 64 unsigned bytes, four columns a
// row lane (byte 4r + e = u[r, 8k + 4h + e]). 4 bits: the low (h = 0) or high nibbles of the part's 64 bytes.
template <int BITS>
static inline __m512i bytes(const uint8_t* tile, int k, int h) {
  if (BITS == 4) {
    const __m512i z = _mm512_loadu_si512(tile + 64 * k);
    return _mm512_and_si512(h ? _mm512_srli_epi16(z, 4) : z, _mm512_set1_epi8(0x0F));
  }
  return _mm512_loadu_si512(tile + 128 * k + 64 * h);
}

// The same part as int16 pairs for vpdpwssd: lane r holds row r's codes of columns 8k + (0, 2), (1, 3), (4, 6) or
// (5, 7) for h = 0..3 (the two 16-bit words of lane r are bytes (4r, 4r + 1) and (4r + 2, 4r + 3), so each pair is a
// mask or a shift of them away).
template <int BITS>
static inline __m512i pair(const uint8_t* tile, int k, int h) {
  if (BITS == 4) {
    const __m512i z = _mm512_loadu_si512(tile + 64 * k), nib = _mm512_set1_epi16(0x000F);
    switch (h) {
      case 0: return _mm512_and_si512(z, nib);
      case 1: return _mm512_and_si512(_mm512_srli_epi16(z, 8), nib);
      case 2: return _mm512_and_si512(_mm512_srli_epi16(z, 4), nib);
      default: return _mm512_srli_epi16(z, 12);
    }
  }
  const __m512i w = _mm512_loadu_si512(tile + 128 * k + 64 * (h / 2));
  return h % 2 ? _mm512_srli_epi16(w, 8) : _mm512_and_si512(w, _mm512_set1_epi16(0x00FF));
}

// Rows [m0, m0 + MT) of x, all wide or all narrow (WIDE), against tiles [i0, i0 + TN) of one supertile (ts tiles, at
// `sup`). y[m * ldy + n] = result (kAdd: y += result; kGlu: tiles i0 and i0 + 2, see Out). One int32 accumulator per
// (tile, row) for a block, two for a wide row running alone (so the vpdpwssd latency stays hidden; their sum is exact).
// Per block, every lane does y += s * (d * dx) + m * sx, s the block's integer sum, whatever the tiling: a row's result
// never depends on its batch. 8 bits (u = code + 128, m = -128 d): the offset leaves the integer sum, s = sum (u - 128)
// x = sum u x - 128 sq, the accumulator starting at -128 sq, so a block costs one multiply-add less.
template <int BITS, int TN, int MT, bool WIDE, int OUT>
static inline void kern(const Act& a, const uint8_t* sup, int ts, int i0, float* y, int64_t ldy, int64_t m0,
                        int64_t col0) {
  const int64_t nb = a.K / 32, cb = chunk_bytes<BITS>(ts), code_bytes = BITS * 64, row = a.K / 2;
  const int32_t* xq = (const int32_t*)a.q;  // a row is K / 2 int32: 4 int8 codes or 2 int16 codes each
  // the supertile's tile of accumulator i; kGlu: (gate, up) pairs, (i0, i0 + 2) then (i0 + 1, i0 + 3) for TN = 4
  auto tile = [i0](int i) { return OUT == kGlu ? i0 + (i % 2) * 2 + i / 2 : i0 + i; };
  __m512 facc[TN][MT];
  for (int i = 0; i < TN; ++i)
    for (int t = 0; t < MT; ++t) facc[i][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* chunk = sup + b * cb;
    __m512i acc[TN][MT][2];
    for (int t = 0; t < MT; ++t) {
      const __m512i start = BITS == 8 ? _mm512_set1_epi32(-128 * a.sq[(m0 + t) * nb + b]) : _mm512_setzero_si512();
      for (int i = 0; i < TN; ++i) acc[i][t][0] = start, acc[i][t][1] = _mm512_setzero_si512();
    }
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      if (WIDE) {
        for (int h = 0; h < 4; ++h)
          for (int i = 0; i < TN; ++i) {
            const __m512i p = pair<BITS>(chunk + tile(i) * code_bytes, k, h);
            for (int t = 0; t < MT; ++t) {
              const int c = MT == 1 ? h & 1 : 0;
              const int32_t* xr = xq + (m0 + t) * row + b * 16 + 4 * k;
              acc[i][t][c] = _mm512_dpwssd_epi32(acc[i][t][c], p, _mm512_set1_epi32(xr[h]));
            }
          }
      } else {
        for (int h = 0; h < 2; ++h)
          for (int i = 0; i < TN; ++i) {
            const __m512i w = bytes<BITS>(chunk + tile(i) * code_bytes, k, h);
            for (int t = 0; t < MT; ++t) {
              const int32_t* xr = xq + (m0 + t) * row + b * 8 + 2 * k;
              acc[i][t][0] = _mm512_dpbusd_epi32(acc[i][t][0], w, _mm512_set1_epi32(xr[h]));
            }
          }
      }
    }
    const uint16_t* dh = (const uint16_t*)(chunk + ts * code_bytes);
    for (int i = 0; i < TN; ++i) {
      const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dh + tile(i) * 16)));
      const __m512 mv = BITS == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dh + (ts + tile(i)) * 16)))
                                  : _mm512_setzero_ps();  // 8 bits: the offset is in s
      for (int t = 0; t < MT; ++t) {
        const int64_t r = (m0 + t) * nb + b;
        const __m512i s = WIDE && MT == 1 ? _mm512_add_epi32(acc[i][t][0], acc[i][t][1]) : acc[i][t][0];  // exact
        facc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dv, _mm512_set1_ps(a.dx[r])), facc[i][t]);
        if (BITS == 4) facc[i][t] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.sx[r]), facc[i][t]);
      }
    }
  }
  for (int t = 0; t < MT; ++t) {
    __m512 v[TN];
    for (int i = 0; i < TN; ++i) {
      v[i] = OUT == kAdd ? _mm512_add_ps(_mm512_loadu_ps(y + (m0 + t) * ldy + col0 + tile(i) * 16), facc[i][t])
                         : facc[i][t];
      if (!WIDE && a.out.n) {  // then y += sum_j x[col j] W[:, col j], j in order
        const float* xo = a.out.x + (m0 + t) * a.out.stride;
        const float* wo = a.out.w + (col0 + tile(i) * 16) * a.out.n;
        for (int64_t j = 0; j < a.out.n; ++j)
          v[i] = _mm512_fmadd_ps(_mm512_set1_ps(xo[j]), _mm512_loadu_ps(wo + 16 * j), v[i]);
      }
    }
    if (OUT == kGlu)  // accumulators 2p, 2p + 1: 16 gate and up columns -> act columns col0 / 2 + 16 (i0 + p)
      for (int p = 0; p < TN / 2; ++p)
        _mm512_storeu_ps(y + (m0 + t) * ldy + col0 / 2 + (i0 + p) * 16, vmath::silu_mul(v[2 * p], v[2 * p + 1]));
    else
      for (int i = 0; i < TN; ++i) _mm512_storeu_ps(y + (m0 + t) * ldy + col0 + tile(i) * 16, v[i]);
  }
}

template <int BITS, int TN, int MT, bool WIDE, int OUT>
static inline void over_tiles(const Act& a, const uint8_t* sup, int ts, float* y, int64_t ldy, int64_t m0,
                              int64_t col0) {
  if constexpr (OUT == kGlu) {  // (gate, up) tile pairs (0, 2) and (1, 3) of a whole supertile, TN / 2 at a time
    static_assert(TN == 2 || TN == 4, "SwiGLU takes gate tiles with their up tiles");
    for (int i = 0; i < 4; i += TN) kern<BITS, TN, MT, WIDE, OUT>(a, sup, ts, i / 2, y, ldy, m0, col0);
  } else {
    int i = 0;
    for (; i + TN <= ts; i += TN) kern<BITS, TN, MT, WIDE, OUT>(a, sup, ts, i, y, ldy, m0, col0);
    for (; i < ts; ++i) kern<BITS, 1, MT, WIDE, OUT>(a, sup, ts, i, y, ldy, m0, col0);
  }
}

// Rows [m0, m1), all of one kind, against one supertile: as many rows at a time as the registers hold (int32 and fp32
// accumulators per (tile, row)); narrow rows six at a time against two tiles (each broadcast activation feeds two
// vpdpbusd: 2 x 6 was 6 % faster than 1 x 8 on Zen 4, 4 x 3 and 2 x 7 slower).
template <int BITS, bool WIDE, int OUT>
static inline void rows_of_kind(const Act& a, const uint8_t* sup, int ts, float* y, int64_t ldy, int64_t m0, int64_t m1,
                                int64_t col0) {
  int64_t m = m0;
  if (WIDE) {
    for (; m + 4 <= m1; m += 4) over_tiles<BITS, 2, 4, WIDE, OUT>(a, sup, ts, y, ldy, m, col0);
  } else {
    for (; m + 6 <= m1; m += 6) over_tiles<BITS, 2, 6, WIDE, OUT>(a, sup, ts, y, ldy, m, col0);
    for (; m + 4 <= m1; m += 4) over_tiles<BITS, 2, 4, WIDE, OUT>(a, sup, ts, y, ldy, m, col0);
  }
  switch (m1 - m) {
    case 3: over_tiles<BITS, 2, 3, WIDE, OUT>(a, sup, ts, y, ldy, m, col0); break;
    case 2: over_tiles<BITS, WIDE ? 2 : 4, 2, WIDE, OUT>(a, sup, ts, y, ldy, m, col0); break;
    case 1: over_tiles<BITS, 4, 1, WIDE, OUT>(a, sup, ts, y, ldy, m, col0); break;
    default: break;
  }
}

// A packed weight: its bytes and bits (4 or 8).
struct Packed {
  const uint8_t* w;
  int64_t bits;
};

// y[:, rows of supertiles [sa, sz)] (+)= x @ W^T (OUT) for a packed weight with N rows. Each supertile meets the
// activation rows run by run (consecutive rows of one kind) while its weights are in cache.
template <int BITS, int OUT>
static void gemm_bits(const Act& a, const uint8_t* w, int64_t N, int64_t sa, int64_t sz, float* y, int64_t ldy) {
  const int64_t nb = a.K / 32, T = N / 16;
  for (int64_t s = sa; s < sz; ++s) {
    const int ts = (int)std::min<int64_t>(4, T - 4 * s);
    const uint8_t* sup = w + s * nb * chunk_bytes<BITS>(4);
    const int64_t col0 = s * 64;
    for (int64_t m = 0; m < a.M;) {
      const bool wide = a.is_wide(m);
      int64_t e = m + 1;
      while (e < a.M && a.is_wide(e) == wide) ++e;
      if (wide)
        rows_of_kind<BITS, true, OUT>(a, sup, ts, y, ldy, m, e, col0);
      else
        rows_of_kind<BITS, false, OUT>(a, sup, ts, y, ldy, m, e, col0);
      m = e;
    }
  }
}

static inline int64_t supertiles(int64_t N) { return (N / 16 + 3) / 4; }

template <int OUT>
static void gemm_out(const Act& a, Packed w, int64_t N, int64_t sa, int64_t sz, float* y, int64_t ldy) {
  (w.bits == 4 ? gemm_bits<4, OUT> : gemm_bits<8, OUT>)(a, w.w, N, sa, sz, y, ldy);
}

// kGlu: N % 64 == 0 (whole supertiles), y the (M, N / 2) product at stride ldy.
static inline void gemm(const Act& a, Packed w, int64_t N, int64_t sa, int64_t sz, float* y, int64_t ldy, Out out) {
  (out == kAdd ? gemm_out<kAdd> : out == kGlu ? gemm_out<kGlu> : gemm_out<kStore>)(a, w, N, sa, sz, y, ldy);
}

}  // namespace qg
