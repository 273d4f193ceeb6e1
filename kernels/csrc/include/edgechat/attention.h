// Paged attention for the C++ CPU step (included by cpu_forward.cpp).
//
// Decode reads every cached key and value once per layer. At 2,000 tokens of context
// that is ~46 KB a token in fp32, as many bytes a step as the weights, so the pool is
// kept in fp16 (half those bytes; fp32 still served) or in 8 bits (a quarter, plus a
// scale): keys and values are rounded on store (`store_heads`: fp16 to nearest even, as
// torch's `.half()`; int8 as below) and widened while loaded (`load16`), everything else
// in fp32. The int8 pool (`Kind::i8`) keeps each (token, kv head) row as its D codes
// followed by its fp32 scale, D + 4 bytes (`kScaleBytes`; kernels/paged.py's
// `quantize_kv_ref` is the definition): scale = max |x| / 127, code = round(x 127 / max |x|),
// so x ~ code scale to 1/254 of the row's largest. Attention never dequantizes a row: the
// key scale multiplies the row's score (q . code) ks, the value scale the probability weight
// (e vs) code. The scale sits beside its codes, so block copies, prefix sharing and moves of
// a slot carry it with them (the pool is one tensor, its last dimension D + 4). The work is
// split for both cores and for one pass over memory:
//
//   * an item is (token, chunk of 256 keys), every kv head's: the G query heads of a kv head
//     share each key and value row it reads, converted once; 16 rows at a time are first
//     read whole in address order (`touch`): by kv head, 128 B of each 384 B row in turn, the
//     pool streamed at ~10 GB/s on a Zen 4 core, in address order at ~15;
//   * scores of 16 keys at a time: per key and head a 16-lane product q . k, then the 16
//     keys' vectors summed across lanes together (`sum16`, 3 ops a key instead of ~9);
//   * per item and head: max m, sum l and unnormalized sum acc of exp(s - m) v;
//   * the chunks of a (token, kv head) merge as out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c.
//
// Chunk edges depend only on the token's own key count, never on the batch, so a
// row's result does not depend on what else the step holds. `Keys` describes which
// positions a query sees: [0, plain) of its sequence (a decode row; a prefill token's
// causal prefix), then `extra` positions (a draft tree's prefix is `plain`, its
// allowed nodes the extras). The pool is (blocks, page, Hkv, D) (D + 4 bytes in int8), read
// through the sequence's block table. `exp512` is edgechat/vmath.h's.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "edgechat/vmath.h"

namespace attn {

using vmath::exp512;

// 16 pool elements as fp32: fp32 as is, fp16 (its bits in a uint16_t) widened exactly, int8 codes
// as their integer values (the row's scale applied by the caller).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}

// An int8 row's D codes are followed by its fp32 scale (unaligned: rows are D + 4 bytes).
constexpr int64_t kScaleBytes = 4;
// Pool elements per (token, kv head) row: D, or D codes and the scale's 4 bytes in int8.
template <typename E>
constexpr int64_t row_elems(int64_t D) {
  return std::is_same_v<E, int8_t> ? D + kScaleBytes : D;
}
// The scale of a row (1 outside int8, where the elements are the values).
template <typename E>
inline float row_scale(const E* row, int64_t D) {
  if constexpr (std::is_same_v<E, int8_t>) {
    float s;
    std::memcpy(&s, row + D, sizeof s);
    return s;
  } else {
    return 1.f;
  }
}

// A token's Hkv rows of D keys or values (src: Hkv D floats, D a multiple of 16) into the
// pool: fp32 as is; fp16 rounded to nearest even; int8 as codes round(x 127 / max |x|) (to
// nearest even) and scale max |x| / 127 per row, a row of zeros as zeros and scale 0.
inline void store_heads(float* dst, const float* src, int64_t Hkv, int64_t D) {
  std::memcpy(dst, src, Hkv * D * sizeof(float));
}
inline void store_heads(uint16_t* dst, const float* src, int64_t Hkv, int64_t D) {
  for (int64_t i = 0; i < Hkv * D; i += 16)
    _mm256_storeu_si256((__m256i*)(dst + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store_heads(int8_t* dst, const float* src, int64_t Hkv, int64_t D) {
  for (int64_t h = 0; h < Hkv; ++h, src += D, dst += D + kScaleBytes) {
    __m512 mx = _mm512_setzero_ps();
    for (int64_t i = 0; i < D; i += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(src + i)));
    const float amax = _mm512_reduce_max_ps(mx), inv = amax > 0.f ? 127.f / amax : 0.f, scale = amax / 127.f;
    for (int64_t i = 0; i < D; i += 16) {  // |x inv| <= 127 (to an ulp): rounds into [-127, 127]
      const __m512i c = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_loadu_ps(src + i), _mm512_set1_ps(inv)),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_storeu_si128((__m128i*)(dst + i), _mm512_cvtepi32_epi8(c));
    }
    std::memcpy(dst + D, &scale, sizeof scale);
  }
}

// out[l] = the sum of a[kSlot[l]]'s 16 lanes: a transposed reduction of 16 vectors in 15 adds
// and 30 shuffles. Store key l's vector at a[kSlot[l]] (kSlot is its own inverse) and lane l is key l's.
constexpr int kSlot[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
inline __m512 sum16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // b_i: 8 lanes of a_i, then 8 of a_{i+8}
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], 0x44), _mm512_shuffle_f32x4(a[i], a[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)  // c_i: 4 lanes each of a_i, a_{i+8}, a_{i+4}, a_{i+12}
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 4], 0x88), _mm512_shuffle_f32x4(b[i], b[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i) {  // d_i per 128 bits: 2 lanes of c_i, 2 of c_{i+2}
    const __m512d x = _mm512_castps_pd(c[i]), y = _mm512_castps_pd(c[i + 2]);
    d[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

struct Keys {
  const int32_t* table = nullptr;
  int32_t plain = 0;
  std::vector<int32_t> extra;
  int64_t size() const { return plain + (int64_t)extra.size(); }
  int64_t pos(int64_t i) const { return i < plain ? i : extra[i - plain]; }
};

constexpr int64_t kChunk = 256;

enum class Kind { f32, f16, i8 };

// One layer's K and V pools, (blocks, page, Hkv, row_elems(D)) each, of `kind`; page a power of two.
struct Cache {
  const void* k;
  const void* v;
  int64_t page, Hkv, D;
  Kind kind;
};

// s[g kChunk + j] = scale q_g . k_j for GB heads (q: GB rows of D = 16 NV) and the m <= 16 keys
// at element offsets off[0, m) of kb; in int8, scale ks_j q_g . code_j.
template <int NV, int GB, typename E>
inline void scores16(const int64_t* off, int64_t m, const float* q, float scale, const E* kb, float* s) {
  constexpr int64_t D = 16 * NV;
  alignas(64) float ks[16];  // the keys' scales times `scale` (int8)
  __m512 qv[GB][NV];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NV; ++c) qv[g][c] = _mm512_loadu_ps(q + g * D + 16 * c);
  __m512 a[GB][16];
  for (int64_t j = 0; j < m; ++j) {
    const E* k = kb + off[j];
    if constexpr (std::is_same_v<E, int8_t>) ks[j] = row_scale(k, D) * scale;
    __m512 kv[NV];
    for (int c = 0; c < NV; ++c) kv[c] = load16(k + 16 * c);
    for (int g = 0; g < GB; ++g) {
      __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
      for (int c = 1; c < NV; ++c) acc = _mm512_fmadd_ps(qv[g][c], kv[c], acc);
      a[g][kSlot[j]] = acc;
    }
  }
  for (int64_t j = m; j < 16; ++j)
    for (int g = 0; g < GB; ++g) a[g][kSlot[j]] = _mm512_setzero_ps();
  const __mmask16 keep = (__mmask16)((1u << m) - 1);
  __m512 sv = _mm512_set1_ps(scale);
  if constexpr (std::is_same_v<E, int8_t>) sv = _mm512_maskz_load_ps(keep, ks);
  for (int g = 0; g < GB; ++g) _mm512_mask_storeu_ps(s + g * kChunk, keep, _mm512_mul_ps(sum16(a[g]), sv));
}

// acc_g += sum_j e[g kChunk + j] v_j for GB heads (acc: GB rows, D + 2 floats apart) and the
// m <= 16 values at element offsets off[0, m) of vb; in int8, (e vs_j) code_j.
template <int NV, int GB, typename E>
inline void values16(const int64_t* off, int64_t m, const float* e, const E* vb, float* acc) {
  constexpr int64_t D = 16 * NV;
  __m512 av[GB][NV];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NV; ++c) av[g][c] = _mm512_loadu_ps(acc + g * (D + 2) + 16 * c);
  for (int64_t j = 0; j < m; ++j) {
    const E* v = vb + off[j];
    const float vs = row_scale(v, D);
    __m512 vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = load16(v + 16 * c);
    for (int g = 0; g < GB; ++g) {
      const __m512 w = _mm512_set1_ps(std::is_same_v<E, int8_t> ? e[g * kChunk + j] * vs : e[g * kChunk + j]);
      for (int c = 0; c < NV; ++c) av[g][c] = _mm512_fmadd_ps(w, vv[c], av[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + g * (D + 2) + 16 * c, av[g][c]);
}

// All Hkv kv heads of a token, G query heads each (q: Hkv G rows of D, kv head-major), over keys
// [i0, i1) (at most kChunk): one pass over the keys, then one over the values, 16 keys at a time.
// Each 16 rows are first touched whole, in address order (every kv head's part: a block's rows
// are one contiguous run of memory), then every head block works on them from L1. Heads go in
// blocks of up to 4 (2 at D = 128: the accumulators stay in registers). The arithmetic is a
// (token, kv head)'s alone, in the same order whatever the batch. out: per head acc[D], m, l;
// sc: Hkv G kChunk floats.
template <int NV, typename E>
void partial_heads(const Keys& keys, int64_t i0, int64_t i1, const float* q, int G, float scale, const Cache& pool,
                   float* sc, float* out) {
  constexpr int64_t D = 16 * NV;
  constexpr int kMaxGB = NV <= 4 ? 4 : 2;
  int64_t off[kChunk];  // element offset of each key's pool row (its block from the table)
  const int64_t n = i1 - i0, shift = __builtin_ctzll(pool.page), mask = pool.page - 1;  // page: a power of two
  constexpr int64_t RD = row_elems<E>(D);  // a (token, kv head) row's elements
  const int64_t Hkv = pool.Hkv, row = Hkv * RD, bytes = row * (int64_t)sizeof(E);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = keys.pos(i0 + i);
    off[i] = (((int64_t)keys.table[p >> shift] << shift) + (p & mask)) * row;
  }
  const E* kp = (const E*)pool.k;
  const E* vp = (const E*)pool.v;
  // Rows [i, i + m) of base, whole, in address order: a demand load of each cache line. The
  // kernels below take a kv head's 128 B of each row in turn; asked for in that order the
  // lines came in at ~10 GB/s, in this one at ~15 (a hardware prefetcher follows it).
  auto touch = [&](const E* base, int64_t i, int64_t m) {
    uint32_t x = 0;
    for (int64_t j = 0; j < m; ++j) {
      const char* r = (const char*)(base + off[i + j]);
      for (int64_t b = 0; b < bytes; b += 64) x |= *(const volatile uint32_t*)(r + b);
    }
    asm volatile("" ::"r"(x));
  };
  // per head block (kvh, first head h, heads gb)
  auto each = [&](auto&& f) {
    for (int64_t kvh = 0; kvh < Hkv; ++kvh)
      for (int g = 0; g < G;) {
        const int gb = std::min(kMaxGB, G - g);
        f(kvh, kvh * G + g, gb);
        g += gb;
      }
  };
  for (int64_t i = 0; i < n; i += 16) {  // scores
    const int64_t m = std::min<int64_t>(16, n - i);
    touch(kp, i, m);
    each([&](int64_t kvh, int64_t h, int gb) {
      const E* kb = kp + kvh * RD;
      const float* qh = q + h * D;
      float* s = sc + h * kChunk + i;
      switch (gb) {
        case 4: scores16<NV, (kMaxGB >= 4 ? 4 : 1), E>(off + i, m, qh, scale, kb, s); break;
        case 3: scores16<NV, (kMaxGB >= 3 ? 3 : 1), E>(off + i, m, qh, scale, kb, s); break;
        case 2: scores16<NV, 2, E>(off + i, m, qh, scale, kb, s); break;
        default: scores16<NV, 1, E>(off + i, m, qh, scale, kb, s); break;
      }
    });
  }
  for (int64_t h = 0; h < Hkv * G; ++h) {  // e = exp(s - m) in place, l = sum e; acc = 0
    float* s = sc + h * kChunk;
    float* o = out + h * (D + 2);
    __m512 mv = _mm512_set1_ps(-INFINITY);  // the scores' max, 16 at a time (a scalar loop was a chain of compares)
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 k = (__mmask16)(n - i >= 16 ? 0xffffu : (1u << (n - i)) - 1);
      mv = _mm512_mask_max_ps(mv, k, mv, _mm512_maskz_loadu_ps(k, s + i));
    }
    const float mx = _mm512_reduce_max_ps(mv);
    __m512 l = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 k = (__mmask16)(n - i >= 16 ? 0xffffu : (1u << (n - i)) - 1);
      const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), _mm512_set1_ps(mx)));
      _mm512_mask_storeu_ps(s + i, k, e);
      l = _mm512_add_ps(l, _mm512_maskz_mov_ps(k, e));
    }
    for (int64_t c = 0; c < D; ++c) o[c] = 0.f;
    o[D] = mx;
    o[D + 1] = _mm512_reduce_add_ps(l);
  }
  for (int64_t i = 0; i < n; i += 16) {  // acc = sum_j e_j v_j
    const int64_t m = std::min<int64_t>(16, n - i);
    touch(vp, i, m);
    each([&](int64_t kvh, int64_t h, int gb) {
      const E* vb = vp + kvh * RD;
      const float* e = sc + h * kChunk + i;
      float* o = out + h * (D + 2);
      switch (gb) {
        case 4: values16<NV, (kMaxGB >= 4 ? 4 : 1), E>(off + i, m, e, vb, o); break;
        case 3: values16<NV, (kMaxGB >= 3 ? 3 : 1), E>(off + i, m, e, vb, o); break;
        case 2: values16<NV, 2, E>(off + i, m, e, vb, o); break;
        default: values16<NV, 1, E>(off + i, m, e, vb, o); break;
      }
    });
  }
}

template <typename E>
void partial_dim(const Keys& keys, int64_t i0, int64_t i1, const float* q, int G, float scale, const Cache& pool,
                 float* sc, float* out) {
  switch (pool.D) {
    case 64: partial_heads<4, E>(keys, i0, i1, q, G, scale, pool, sc, out); break;
    case 128: partial_heads<8, E>(keys, i0, i1, q, G, scale, pool, sc, out); break;
    case 32: partial_heads<2, E>(keys, i0, i1, q, G, scale, pool, sc, out); break;
    default: partial_heads<1, E>(keys, i0, i1, q, G, scale, pool, sc, out); break;  // D checked by the caller
  }
}

// A token's Hkv G heads (q: Hkv G rows of D) over keys [i0, i1) of `keys` (at most kChunk).
// out: per head acc[D], m, l; sc: scratch of Hkv G kChunk floats.
inline void partial_any(const Keys& keys, int64_t i0, int64_t i1, const float* q, int G, float scale, const Cache& pool,
                        float* sc, float* out) {
  switch (pool.kind) {
    case Kind::f16: partial_dim<uint16_t>(keys, i0, i1, q, G, scale, pool, sc, out); break;
    case Kind::i8: partial_dim<int8_t>(keys, i0, i1, q, G, scale, pool, sc, out); break;
    default: partial_dim<float>(keys, i0, i1, q, G, scale, pool, sc, out); break;
  }
}

// Prompt rows in blocks (a prefill's narrow rows, cpu_forward.cpp): nq consecutive tokens of one sequence, token tq
// seeing keys [0, plain0 + tq), against one chunk of keys [c0, c0 + n) (every row's own chunk: a row whose keys end
// inside it stops there). Per kv head, its G query heads of the nq tokens are the block's rows, one fp32 lane each
// (R = 16 RV lanes; padding lanes see no key), so a key row is converted once for every row and no sum crosses lanes:
//   * scores S[j][r] = scale ks_j sum_d q_r[d] k_j[d], over d in order, 8 keys at a time (q transposed, k_j[d]
//     broadcast): a row's lane, its arithmetic alone;
//   * m_r = max_j S, e = exp(S - m_r), l_r = sum_j e in key order; past a row's keys e is 0 (masked), so a key beyond
//     its end adds exactly nothing;
//   * acc_r = sum_j (e vs_j) v_j in key order, RB rows at a time.
// Where the CPU has AVX512_BF16 (kBlockBf16) both sums run on bf16 pairs, two dimensions (scores) or two keys (values)
// a 32-bit lane: q, k, e vs and v rounded to bf16, products exact and summed in fp32 (half the instructions; the
// prompt's narrow rows already run their matmuls on int8 activations). m, e and l stay fp32.
// A row's result therefore depends on its own keys alone, not on the block it shares (its arithmetic is not the
// one-token kernel's: the step uses one kernel per row kind). Writes each row's acc[D], m, l per head at out[tq] (its
// part for this chunk; nullptr where the row has no key in it or its keys are this chunk alone); where final[tq], the
// row's keys are this chunk alone and its heads' outputs acc / l go there (what merge would write for one part).
constexpr int kBlockLanes = 48;  // a block's rows (tokens x G) fit 3 vectors

inline int64_t block_scratch_floats(int64_t D) {
  return D * kBlockLanes + 2 * kChunk * D + kChunk * kBlockLanes + 2 * kChunk;
}

template <int NV, int RB>
inline void block_values(const float* e, int64_t R, int64_t r0, int64_t n, const float* vf, float* acc) {
  constexpr int64_t D = 16 * NV;
  __m512 a[RB][NV];
  for (int b = 0; b < RB; ++b)
    for (int c = 0; c < NV; ++c) a[b][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    __m512 v[NV];
    for (int c = 0; c < NV; ++c) v[c] = _mm512_loadu_ps(vf + j * D + 16 * c);
    for (int b = 0; b < RB; ++b) {
      const __m512 w = _mm512_set1_ps(e[j * R + r0 + b]);
      for (int c = 0; c < NV; ++c) a[b][c] = _mm512_fmadd_ps(w, v[c], a[b][c]);
    }
  }
  for (int b = 0; b < RB; ++b)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + (r0 + b) * D + 16 * c, a[b][c]);
}

#if defined(__AVX512BF16__)
// With AVX512_BF16 the block's two products run on bf16 pairs (vdpbf16ps: 32 multiply-adds an instruction, fp32
// sums): q and k rounded to bf16 for the scores, e and v for the values; the softmax (m, e, l) stays fp32.
constexpr bool kBlockBf16 = true;

// Lanes 2i and 2i + 1 of the result: a[i], b[i] (32 bf16, a's element i then b's, i = 0..15).
inline __m512i bf16_zip(__m512 a, __m512 b) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,  //
                                       23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

// acc_r += sum over key pairs p of e[2p][r] v[2p] + e[2p + 1][r] v[2p + 1], RB rows at a time: eb (pairs x R) and vb
// (pairs x D) hold each pair's two bf16 in one 32-bit lane.
template <int NV, int RB>
inline void block_values_bf16(const uint32_t* eb, int64_t R, int64_t r0, int64_t pairs, const uint32_t* vb,
                              float* acc) {
  constexpr int64_t D = 16 * NV;
  __m512 a[RB][NV];
  for (int b = 0; b < RB; ++b)
    for (int c = 0; c < NV; ++c) a[b][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i v[NV];
    for (int c = 0; c < NV; ++c) v[c] = _mm512_loadu_si512(vb + p * D + 16 * c);
    for (int b = 0; b < RB; ++b) {
      const __m512i w = _mm512_set1_epi32((int32_t)eb[p * R + r0 + b]);
      for (int c = 0; c < NV; ++c) a[b][c] = _mm512_dpbf16_ps(a[b][c], (__m512bh)v[c], (__m512bh)w);
    }
  }
  for (int b = 0; b < RB; ++b)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + (r0 + b) * D + 16 * c, a[b][c]);
}
#else
constexpr bool kBlockBf16 = false;
#endif

template <int NV, int RV, typename E>
void block_heads(const int32_t* table, int64_t plain0, int nq, int64_t c0, int64_t n, const float* q, int64_t q_stride,
                 int G, float scale, const Cache& pool, float* scratch, float* const* out, float* const* final) {
  constexpr int64_t D = 16 * NV, R = 16 * RV, RD = row_elems<E>(D);
  constexpr int RB = NV >= 8 ? 3 : NV == 4 ? 6 : 8;  // value rows at a time: RB NV accumulators in registers
  const int64_t rows = (int64_t)nq * G, Hkv = pool.Hkv, shift = __builtin_ctzll(pool.page), mask = pool.page - 1;
  float* qt = scratch;                    // D x R: the rows' queries, transposed
  float* kf = qt + D * kBlockLanes;       // n (rounded up to 8) x D keys as fp32
  float* vf = kf + kChunk * D;            // n x D values as fp32
  float* sc = vf + kChunk * D;            // n x R scores, then e vs
  float* ks = sc + kChunk * kBlockLanes;  // per key: scale ks_j
  float* vs = ks + kChunk;                // per key: vs_j
  const E* kp = (const E*)pool.k;
  const E* vp = (const E*)pool.v;
  const int64_t n8 = (n + 7) / 8 * 8;
  alignas(64) int32_t lim[R];  // keys a row has in the chunk (0 for padding lanes)
  for (int64_t r = 0; r < R; ++r) lim[r] = r < rows ? (int32_t)std::clamp<int64_t>(plain0 + r / G - c0, 0, n) : 0;
  for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
    for (int64_t r = 0; r < R; ++r) {
      const float* qr = r < rows ? q + (r / G) * q_stride + (kvh * G + r % G) * D : nullptr;
#if defined(__AVX512BF16__)  // qt as (D / 2) x R pairs (q[2i], q[2i + 1]) in bf16
      alignas(64) uint32_t pr[D / 2];
      for (int c = 0; c < NV; ++c)
        _mm256_store_si256((__m256i*)pr + c,
                           qr ? (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(qr + 16 * c)) : _mm256_setzero_si256());
      for (int64_t i = 0; i < D / 2; ++i) ((uint32_t*)qt)[i * R + r] = pr[i];
#else
      for (int64_t d = 0; d < D; ++d) qt[d * R + r] = qr ? qr[d] : 0.f;
#endif
    }
    for (int64_t j = 0; j < n8; ++j) {
      if (j >= n) {
        for (int c = 0; c < NV; ++c) {  // a padding key: zeros (its scores are never read; v's pair needs them)
#if defined(__AVX512BF16__)
          _mm256_storeu_si256((__m256i*)(kf + j * D / 2) + c, _mm256_setzero_si256());
#else
          _mm512_storeu_ps(kf + j * D + 16 * c, _mm512_setzero_ps());
#endif
          _mm512_storeu_ps(vf + j * D + 16 * c, _mm512_setzero_ps());
        }
        ks[j] = 0.f;
        continue;
      }
      const int64_t p = c0 + j, at = (((int64_t)table[p >> shift] << shift) + (p & mask)) * Hkv * RD + kvh * RD;
      const E* k = kp + at;
      const E* v = vp + at;
      for (int c = 0; c < NV; ++c) {
#if defined(__AVX512BF16__)  // key j as D bf16 (pairs of dimensions), at kf + j D / 2 floats
        _mm256_storeu_si256((__m256i*)(kf + j * D / 2) + c, (__m256i)_mm512_cvtneps_pbh(load16(k + 16 * c)));
#else
        _mm512_storeu_ps(kf + j * D + 16 * c, load16(k + 16 * c));
#endif
        _mm512_storeu_ps(vf + j * D + 16 * c, load16(v + 16 * c));
      }
      ks[j] = row_scale(k, D) * scale;
      vs[j] = row_scale(v, D);
    }
    __m512i lv[RV];
    __m512 mx[RV], l[RV];
    for (int rv = 0; rv < RV; ++rv) {
      lv[rv] = _mm512_load_si512((const void*)(lim + 16 * rv));
      mx[rv] = _mm512_set1_ps(-INFINITY);
      l[rv] = _mm512_setzero_ps();
    }
    for (int64_t j = 0; j < n8; j += 8) {  // scores, 8 keys x RV lane vectors
      __m512 a[8][RV];
      for (int k = 0; k < 8; ++k)
        for (int rv = 0; rv < RV; ++rv) a[k][rv] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
      const uint32_t* kb = (const uint32_t*)kf;
      for (int64_t i = 0; i < D / 2; ++i) {
        __m512i qv[RV];
        for (int rv = 0; rv < RV; ++rv) qv[rv] = _mm512_loadu_si512((const uint32_t*)qt + i * R + 16 * rv);
        for (int k = 0; k < 8; ++k) {
          const __m512i kv = _mm512_set1_epi32((int32_t)kb[(j + k) * (D / 2) + i]);
          for (int rv = 0; rv < RV; ++rv) a[k][rv] = _mm512_dpbf16_ps(a[k][rv], (__m512bh)qv[rv], (__m512bh)kv);
        }
      }
#else
      for (int64_t d = 0; d < D; ++d) {
        __m512 qv[RV];
        for (int rv = 0; rv < RV; ++rv) qv[rv] = _mm512_loadu_ps(qt + d * R + 16 * rv);
        for (int k = 0; k < 8; ++k) {
          const __m512 kv = _mm512_set1_ps(kf[(j + k) * D + d]);
          for (int rv = 0; rv < RV; ++rv) a[k][rv] = _mm512_fmadd_ps(kv, qv[rv], a[k][rv]);
        }
      }
#endif
      for (int k = 0; k < 8 && j + k < n; ++k)
        for (int rv = 0; rv < RV; ++rv) {  // lanes whose keys end before key j + k: -inf
          const __mmask16 in = _mm512_cmpgt_epi32_mask(lv[rv], _mm512_set1_epi32((int32_t)(j + k)));
          const __m512 s =
              _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), in, _mm512_mul_ps(a[k][rv], _mm512_set1_ps(ks[j + k])));
          _mm512_storeu_ps(sc + (j + k) * R + 16 * rv, s);
          mx[rv] = _mm512_max_ps(mx[rv], s);
        }
    }
    for (int64_t j = 0; j < n; ++j)  // e = exp(s - m) (0 past a row's keys), l = sum e; stored e vs
      for (int rv = 0; rv < RV; ++rv) {
        const __mmask16 in = _mm512_cmpgt_epi32_mask(lv[rv], _mm512_set1_epi32((int32_t)j));
        float* s = sc + j * R + 16 * rv;
        const __m512 e = _mm512_maskz_mov_ps(in, exp512(_mm512_sub_ps(_mm512_loadu_ps(s), mx[rv])));
        l[rv] = _mm512_add_ps(l[rv], e);
        _mm512_storeu_ps(s, std::is_same_v<E, int8_t> ? _mm512_mul_ps(e, _mm512_set1_ps(vs[j])) : e);
      }
    float* acc = kf;  // the keys are done with: rows x D sums
    int64_t r0 = 0;
#if defined(__AVX512BF16__)
    // key pairs (2p, 2p + 1) zipped in place: e over sc, v over vf (pair p's lanes overwrite rows < 2p + 2 only after
    // reading them); an odd n's last pair has key n (its v row zeroed above, its e 0)
    const int64_t pairs = (n + 1) / 2;
    uint32_t* eb = (uint32_t*)sc;
    uint32_t* vb = (uint32_t*)vf;
    for (int64_t p = 0; p < pairs; ++p) {
      for (int rv = 0; rv < RV; ++rv) {
        const __m512 e1 = 2 * p + 1 < n ? _mm512_loadu_ps(sc + (2 * p + 1) * R + 16 * rv) : _mm512_setzero_ps();
        _mm512_storeu_si512(eb + p * R + 16 * rv, bf16_zip(_mm512_loadu_ps(sc + 2 * p * R + 16 * rv), e1));
      }
      for (int c = 0; c < NV; ++c) {
        const __m512 v0 = _mm512_loadu_ps(vf + 2 * p * D + 16 * c), v1 = _mm512_loadu_ps(vf + (2 * p + 1) * D + 16 * c);
        _mm512_storeu_si512(vb + p * D + 16 * c, bf16_zip(v0, v1));
      }
    }
    for (; r0 + RB <= rows; r0 += RB) block_values_bf16<NV, RB>(eb, R, r0, pairs, vb, acc);
    for (; r0 < rows; ++r0) block_values_bf16<NV, 1>(eb, R, r0, pairs, vb, acc);
#else
    for (; r0 + RB <= rows; r0 += RB) block_values<NV, RB>(sc, R, r0, n, vf, acc);
    for (; r0 < rows; ++r0) block_values<NV, 1>(sc, R, r0, n, vf, acc);
#endif
    alignas(64) float ms[R], ls[R];
    for (int rv = 0; rv < RV; ++rv) {
      _mm512_store_ps(ms + 16 * rv, mx[rv]);
      _mm512_store_ps(ls + 16 * rv, l[rv]);
    }
    for (int64_t r = 0; r < rows; ++r) {
      if (!lim[r]) continue;
      if (final[r / G]) {  // merge's one-part case: (0 + 1 acc) / (0 + 1 l), exactly acc / l
        float* o = final[r / G] + (kvh * G + r % G) * D;
        const __m512 lv = _mm512_set1_ps(ls[r]);
        for (int c = 0; c < NV; ++c)
          _mm512_storeu_ps(o + 16 * c, _mm512_div_ps(_mm512_loadu_ps(acc + r * D + 16 * c), lv));
        continue;
      }
      if (!out[r / G]) continue;
      float* o = out[r / G] + (kvh * G + r % G) * (D + 2);
      std::memcpy(o, acc + r * D, D * sizeof(float));
      o[D] = ms[r];
      o[D + 1] = ls[r];
    }
  }
}

template <int NV, typename E>
void block_rv(const int32_t* table, int64_t plain0, int nq, int64_t c0, int64_t n, const float* q, int64_t q_stride,
              int G, float scale, const Cache& pool, float* scratch, float* const* out, float* const* final) {
  const int64_t rows = (int64_t)nq * G;
  if (rows <= 16)
    block_heads<NV, 1, E>(table, plain0, nq, c0, n, q, q_stride, G, scale, pool, scratch, out, final);
  else if (rows <= 32)
    block_heads<NV, 2, E>(table, plain0, nq, c0, n, q, q_stride, G, scale, pool, scratch, out, final);
  else
    block_heads<NV, 3, E>(table, plain0, nq, c0, n, q, q_stride, G, scale, pool, scratch, out, final);
}

template <typename E>
void block_dim(const int32_t* table, int64_t plain0, int nq, int64_t c0, int64_t n, const float* q, int64_t q_stride,
               int G, float scale, const Cache& pool, float* scratch, float* const* out, float* const* final) {
  switch (pool.D) {
    case 64: block_rv<4, E>(table, plain0, nq, c0, n, q, q_stride, G, scale, pool, scratch, out, final); break;
    case 128: block_rv<8, E>(table, plain0, nq, c0, n, q, q_stride, G, scale, pool, scratch, out, final); break;
    case 32: block_rv<2, E>(table, plain0, nq, c0, n, q, q_stride, G, scale, pool, scratch, out, final); break;
    default: block_rv<1, E>(table, plain0, nq, c0, n, q, q_stride, G, scale, pool, scratch, out, final); break;
  }
}

// The block's rows (nq * G <= kBlockLanes) over keys [c0, c0 + n) (n <= kChunk); q: token 0's query row, the next
// token's q_stride floats on; scratch: block_scratch_floats(D); out and final: per token, as block_heads says.
inline void block_any(const int32_t* table, int64_t plain0, int nq, int64_t c0, int64_t n, const float* q,
                      int64_t q_stride, int G, float scale, const Cache& pool, float* scratch, float* const* out,
                      float* const* final) {
  switch (pool.kind) {
    case Kind::f16:
      block_dim<uint16_t>(table, plain0, nq, c0, n, q, q_stride, G, scale, pool, scratch, out, final);
      break;
    case Kind::i8: block_dim<int8_t>(table, plain0, nq, c0, n, q, q_stride, G, scale, pool, scratch, out, final); break;
    default: block_dim<float>(table, plain0, nq, c0, n, q, q_stride, G, scale, pool, scratch, out, final); break;
  }
}

// parts: nchunks partials of G heads, `stride` floats apart; out: G rows of D (the heads' outputs).
inline void merge(const float* parts, int64_t nchunks, int64_t stride, int G, int64_t D, float* out) {
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
