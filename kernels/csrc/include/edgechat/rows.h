// Per-row helpers of the C++ CPU steps (cpu_forward.cpp: the target's decoder step; cpu_draft.cpp: the EAGLE-3
// head's step), shared so both compute a norm and a rotation with the same operations in the same order.
#pragma once

#include <cmath>
#include <cstdint>

namespace rowops {

// out = x / sqrt(mean(x^2) + eps) * w over n values.
inline void rms_norm_row(const float* x, const float* w, int64_t n, float eps, float* out) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / n + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
}

// Rotate-half RoPE of one head in place: cs holds the position's cos then sin, half values each.
inline void rotate(float* p, const float* cs, int64_t half) {
  const float* c = cs;
  const float* s = cs + half;
  for (int64_t i = 0; i < half; ++i) {
    const float a = p[i], b = p[i + half];
    p[i] = a * c[i] - b * s[i];
    p[i + half] = b * c[i] + a * s[i];
  }
}

}  // namespace rowops
