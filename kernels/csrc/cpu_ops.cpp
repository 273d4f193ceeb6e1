// The decode step's small ops for CPU in fp32, one call each (kernels/cpu_ops.py binds them beside the references):
// fused add + RMSNorm, rotate-half RoPE in place, SiLU * up, KV slot stores and paged decode attention.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <vector>

// (out, x + residual) with out = rms_norm(x + residual) * w; residual may be undefined.
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual_opt, torch::Tensor w,
                                        double eps) {
  x = x.contiguous();
  const bool has_res = residual_opt.has_value();
  torch::Tensor residual = has_res ? residual_opt->contiguous() : x;
  const int64_t T = x.size(0), N = x.size(1);
  auto out = torch::empty_like(x);
  auto res_out = has_res ? torch::empty_like(x) : x;
  const float* wp = w.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x.data_ptr<float>() + t * N;
    float* o = out.data_ptr<float>() + t * N;
    float* h = has_res ? res_out.data_ptr<float>() + t * N : nullptr;
    float ss = 0.f;
    if (has_res) {
      const float* r = residual.data_ptr<float>() + t * N;
      for (int64_t i = 0; i < N; ++i) {
        h[i] = xr[i] + r[i];
        ss += h[i] * h[i];
      }
      xr = h;
    } else {
      for (int64_t i = 0; i < N; ++i) ss += xr[i] * xr[i];
    }
    const float inv = 1.f / std::sqrt(ss / N + (float)eps);
    for (int64_t i = 0; i < N; ++i) o[i] = xr[i] * inv * wp[i];
  }
  return {out, res_out};
}

// Rotate-half RoPE in place on (T, heads, D) views with unit last stride.
static void rotate(torch::Tensor x, const int64_t* pos, const float* cs, int64_t cs_stride) {
  const int64_t T = x.size(0), H = x.size(1), half = x.size(2) / 2;
  const int64_t st = x.stride(0), sh = x.stride(1);
  float* base = x.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cs + pos[t] * cs_stride;
    const float* s = c + half;
    for (int64_t h = 0; h < H; ++h) {
      float* p = base + t * st + h * sh;
      for (int64_t i = 0; i < half; ++i) {
        const float a = p[i], b = p[i + half];
        p[i] = a * c[i] - b * s[i];
        p[i + half] = b * c[i] + a * s[i];
      }
    }
  }
}

void apply_rotary(torch::Tensor q, torch::Tensor k, torch::Tensor positions, torch::Tensor cos_sin) {
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && cos_sin.stride(1) == 1, "rotary: last dim must be contiguous");
  auto pos = positions.contiguous();
  rotate(q, pos.data_ptr<int64_t>(), cos_sin.data_ptr<float>(), cos_sin.stride(0));
  rotate(k, pos.data_ptr<int64_t>(), cos_sin.data_ptr<float>(), cos_sin.stride(0));
}

torch::Tensor silu_and_mul(torch::Tensor x) {
  x = x.contiguous();
  const int64_t T = x.size(0), I = x.size(1) / 2;
  auto out = torch::empty({T, I}, x.options());
  for (int64_t t = 0; t < T; ++t) {
    const float* g = x.data_ptr<float>() + t * 2 * I;
    const float* u = g + I;
    float* o = out.data_ptr<float>() + t * I;
    for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  }
  return out;
}

// k, v (T, Hkv, D) views -> pool slots; slot -1 is skipped (padding).
void store_kvcache(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor slots) {
  const int64_t T = k.size(0), Hkv = k.size(1), D = k.size(2);
  auto sl = slots.contiguous();
  const int64_t* s = sl.data_ptr<int64_t>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    if (s[t] < 0) continue;
    for (int64_t h = 0; h < Hkv; ++h) {
      const float* ks = k.data_ptr<float>() + t * k.stride(0) + h * k.stride(1);
      const float* vs = v.data_ptr<float>() + t * v.stride(0) + h * v.stride(1);
      float* kd = kc + (s[t] * Hkv + h) * D;
      float* vd = vc + (s[t] * Hkv + h) * D;
      for (int64_t i = 0; i < D; ++i) {
        kd[i] = ks[i];
        vd[i] = vs[i];
      }
    }
  }
}

// q (B, H, D); caches (blocks, page, Hkv, D); block_tables (B, W) int32; seq_lens (B,) int32 -> (B, H, D).
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t page = k_cache.size(1), Hkv = k_cache.size(2), G = H / Hkv;
  TORCH_CHECK(D <= 256 && G <= 16 && q.stride(2) == 1, "paged_decode_attention: head_dim <= 256, G <= 16");
  auto bt = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::zeros({B, H, D}, q.options());
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t w0, int64_t w1) {
    float acc[16][256], mx[16], den[16];
    std::vector<float> sc;  // (L, G) scores, then their exps
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / Hkv, kvh = w % Hkv, L = lens.data_ptr<int32_t>()[b];
      if (L == 0) continue;  // padding row: zeros
      const int32_t* table = bt.data_ptr<int32_t>() + b * bt.size(1);
      const float* qb = q.data_ptr<float>() + b * q.stride(0) + kvh * G * q.stride(1);
      sc.resize(L * G);
      for (int g = 0; g < G; ++g) {
        mx[g] = -INFINITY;
        den[g] = 0.f;
        for (int64_t i = 0; i < D; ++i) acc[g][i] = 0.f;
      }
      for (int64_t p = 0; p < L; ++p) {  // scores: each key read once for the G heads
        const float* __restrict__ kp = kc + (((int64_t)table[p / page] * page + p % page) * Hkv + kvh) * D;
        for (int g = 0; g < G; ++g) {
          const float* __restrict__ qg = qb + g * q.stride(1);
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t i = 0; i < D; ++i) s += qg[i] * kp[i];
          s *= (float)scale;
          sc[p * G + g] = s;
          mx[g] = s > mx[g] ? s : mx[g];
        }
      }
      for (int64_t p = 0; p < L; ++p)
        for (int g = 0; g < G; ++g) {
          sc[p * G + g] = std::exp(sc[p * G + g] - mx[g]);
          den[g] += sc[p * G + g];
        }
      for (int64_t p = 0; p < L; ++p) {  // weighted values: each value read once
        const float* __restrict__ vp = vc + (((int64_t)table[p / page] * page + p % page) * Hkv + kvh) * D;
        for (int g = 0; g < G; ++g) {
          const float e = sc[p * G + g];
          float* __restrict__ a = acc[g];
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) a[i] += e * vp[i];
        }
      }
      for (int g = 0; g < G; ++g) {
        float* o = out.data_ptr<float>() + (b * H + kvh * G + g) * D;
        for (int64_t i = 0; i < D; ++i) o[i] = acc[g][i] / den[g];
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", torch::wrap_pybind_function(add_rms_norm), "add_rms_norm");
  m.def("apply_rotary", torch::wrap_pybind_function(apply_rotary), "apply_rotary");
  m.def("silu_and_mul", torch::wrap_pybind_function(silu_and_mul), "silu_and_mul");
  m.def("store_kvcache", torch::wrap_pybind_function(store_kvcache), "store_kvcache");
  m.def("paged_decode_attention", torch::wrap_pybind_function(paged_decode_attention), "paged_decode_attention");
}
