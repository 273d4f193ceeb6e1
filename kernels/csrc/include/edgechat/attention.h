// Paged attention for the C++ CPU step (included by cpu_forward.cpp).
//
// Decode at batch 1 reads every cached key and value once per layer: at a few
// hundred tokens of context that is ~20 MB a step in fp32, a fifth of the weights,
// so the work is split for both cores and for one pass over memory:
//
//   * an item is (token, kv head, chunk of 256 keys): the G query heads of the kv
//     head share each key and value row it reads;
//   * per item and head: max m, sum l and unnormalized sum acc of exp(s - m) v;
//   * the chunks of a (token, kv head) merge as out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c.
//
// Chunk edges depend only on the token's own key count, never on the batch, so a
// row's result does not depend on what else the step holds. `Keys` describes which
// positions a query sees: [0, plain) of its sequence (a decode row; a prefill token's
// causal prefix), then `extra` positions (a draft tree's prefix is `plain`, its
// allowed nodes the extras). The pool is (blocks, page, Hkv, D) fp32, read through
// the sequence's block table. `exp512` (also the step's SiLU) is exp on 16 lanes
// to about 2 ulp: 2^n by `scalef`, 2^f for |f| <= 1/2 by its degree-6 Taylor polynomial.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace attn {

inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3f)), _mm512_set1_ps(-87.3f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));  // x log2(e)
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));  // (t - n) ln 2
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

struct Keys {
  const int32_t* table = nullptr;
  int32_t plain = 0;
  std::vector<int32_t> extra;
  int64_t size() const { return plain + (int64_t)extra.size(); }
  int64_t pos(int64_t i) const { return i < plain ? i : extra[i - plain]; }
};

constexpr int64_t kChunk = 256;

struct Cache {
  const float* k;
  const float* v;
  int64_t page, Hkv;
  const float* row(const float* base, const Keys& keys, int64_t i, int64_t kvh) const {
    const int64_t p = keys.pos(i);
    return base + (((int64_t)keys.table[p / page] * page + p % page) * Hkv + kvh) * (NV * 16);
  }
  int64_t NV;  // head_dim / 16
};

// G heads (q: G rows of D = 16 NV) over keys [i0, i1) of one kv head. out: per head acc[D], m, l.
// sc: scratch of G * kChunk floats.
template <int NV>
void partial(const Keys& keys, int64_t i0, int64_t i1, const float* q, int G, int64_t kvh, float scale,
             const Cache& pool, float* sc, float* out) {
  const int64_t n = i1 - i0, D = 16 * NV;
  for (int g = 0; g < G; ++g) {
    __m512 qv[NV];
    for (int c = 0; c < NV; ++c) qv[c] = _mm512_loadu_ps(q + g * D + 16 * c);
    float* s = sc + g * kChunk;
    for (int64_t i = 0; i < n; ++i) {
      const float* k = pool.row(pool.k, keys, i0 + i, kvh);
      if (g == 0 && i + 4 < n) {
        const char* ahead = (const char*)pool.row(pool.k, keys, i0 + i + 4, kvh);
        for (int c = 0; c < NV; c += 4) _mm_prefetch(ahead + 64 * c, _MM_HINT_T0);
      }
      __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
      for (int c = 1; c < NV; ++c) acc = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + 16 * c), acc);
      s[i] = _mm512_reduce_add_ps(acc) * scale;
    }
    float m = -INFINITY;
    for (int64_t i = 0; i < n; ++i) m = s[i] > m ? s[i] : m;
    __m512 lsum = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + i), _mm512_set1_ps(m)));
      _mm512_storeu_ps(s + i, e);
      lsum = _mm512_add_ps(lsum, e);
    }
    if (i < n) {
      const __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
      const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), _mm512_set1_ps(m)));
      _mm512_mask_storeu_ps(s + i, k, e);
      lsum = _mm512_add_ps(lsum, _mm512_maskz_mov_ps(k, e));
    }
    __m512 acc[NV];
    for (int c = 0; c < NV; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const float* v = pool.row(pool.v, keys, i0 + j, kvh);
      if (g == 0 && j + 4 < n) {
        const char* ahead = (const char*)pool.row(pool.v, keys, i0 + j + 4, kvh);
        for (int c = 0; c < NV; c += 4) _mm_prefetch(ahead + 64 * c, _MM_HINT_T0);
      }
      const __m512 e = _mm512_set1_ps(s[j]);
      for (int c = 0; c < NV; ++c) acc[c] = _mm512_fmadd_ps(e, _mm512_loadu_ps(v + 16 * c), acc[c]);
    }
    float* o = out + g * (D + 2);
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + 16 * c, acc[c]);
    o[D] = m;
    o[D + 1] = _mm512_reduce_add_ps(lsum);
  }
}

inline void partial_any(const Keys& keys, int64_t i0, int64_t i1, const float* q, int G, int64_t kvh, float scale,
                        const Cache& pool, float* sc, float* out) {
  switch (pool.NV) {
    case 4: partial<4>(keys, i0, i1, q, G, kvh, scale, pool, sc, out); break;
    case 8: partial<8>(keys, i0, i1, q, G, kvh, scale, pool, sc, out); break;
    case 2: partial<2>(keys, i0, i1, q, G, kvh, scale, pool, sc, out); break;
    default: partial<1>(keys, i0, i1, q, G, kvh, scale, pool, sc, out); break;  // NV checked by the caller
  }
}

// parts: nchunks consecutive partials of G heads; out: G rows of D (the heads' outputs).
inline void merge(const float* parts, int64_t nchunks, int G, int64_t D, float* out) {
  const int64_t stride = G * (D + 2);
  for (int g = 0; g < G; ++g) {
    float* o = out + g * D;
    if (nchunks == 0) {
      for (int64_t c = 0; c < D; ++c) o[c] = 0.f;
      continue;
    }
    float M = -INFINITY;
    for (int64_t c = 0; c < nchunks; ++c) M = std::max(M, parts[c * stride + g * (D + 2) + D]);
    float den = 0.f;
    for (int64_t c = 0; c < D; ++c) o[c] = 0.f;
    for (int64_t ch = 0; ch < nchunks; ++ch) {
      const float* p = parts + ch * stride + g * (D + 2);
      const float w = nchunks == 1 ? 1.f : std::exp(p[D] - M);
      den += w * p[D + 1];
      for (int64_t c = 0; c < D; ++c) o[c] += w * p[c];
    }
    for (int64_t c = 0; c < D; ++c) o[c] /= den;
  }
}

}  // namespace attn
