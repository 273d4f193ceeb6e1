// Vector math on 16 fp32 lanes shared by the CPU kernels: `exp512` (attention's softmax, SiLU) is exp to about 2 ulp:
// 2^n by `scalef`, 2^f for |f| <= 1/2 by its degree-6 Taylor polynomial; `silu_mul` is SwiGLU's silu(g) u.
#pragma once

#include <immintrin.h>

namespace vmath {

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

// silu(g) u = g / (1 + e^-g) u
inline __m512 silu_mul(__m512 g, __m512 u) {
  const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g)));
  return _mm512_mul_ps(_mm512_div_ps(g, den), u);
}

}  // namespace vmath
