"""Block-quantized matmul on CPU with AVX-512 VNNI: y = x @ W^T, W kept in 4 or 8 bits.

Decode reads every weight once per token, so its time is the bytes read; at 4
bits that is an eighth of fp32. The weight is stored the way GGUF stores it, in
blocks of 32 input columns, each with a float scale d and offset m:

    W[n, 32 b + i] = d[n, b] * u[n, 32 b + i] + m[n, b]      u unsigned: 0..15 or 0..255

(Q4_1 is exactly this; Q4_0 is m = -8 d; Q8_0 is u = q + 128, m = -128 d.) The
activations are quantized per block too (symmetric int16, scale dx, sum of codes
sx), so one block's dot product is integer work for VNNI's `vpdpwssd` (32
int16 products per instruction):

    y[m, n] = sum_b  d[n, b] dx[m, b] * sum_i u[n, 32 b + i] q[m, 32 b + i]  +  m[n, b] dx[m, b] sx[m, b]

llama.cpp rounds activations to int8 (Q8_1) for `vpdpbusd`'s 64 products; on
SmolLM2 that moves logits by up to ~3 and changes the greedy answer, int16 by
~0.01 (tests/replica/test_quant.py). At batch 1 the step is bound by the weight
bytes, not by these instructions, so the wider activations cost nothing there.

4-bit rows store block b's 32 codes in 16 bytes, code i in the low nibble of byte
i and code i + 16 in the high nibble (GGUF's order). `qgemm_ref` is the
definition in PyTorch; `qgemm_cpu` compiles the C++ once per machine
(torch.utils.cpp_extension, cached under ~/.cache/torch_extensions) and needs a
CPU with AVX-512 VNNI; `available()` says whether it can run here.
"""

from __future__ import annotations

import torch

from kernels.cpu_build import load_cpp

BLOCK = 32


def unpack_codes(qs: torch.Tensor, bits: int) -> torch.Tensor:
    """(N, K) uint8 codes from the stored rows ((N, K/2) for 4 bits)."""
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


_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>

// One row of x -> int16 codes, scale and scaled code sum per 32-block (K % 32 == 0).
static void quantize_row(const float* x, int64_t K, int16_t* q, float* dx, float* sx) {
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

// The 32 unsigned codes of block b of one weight row, widened to int16, in the activations' order.
template <int BITS>
static inline __m512i load_codes(const uint8_t* row, int64_t b) {
  if (BITS == 8) return _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(row + 32 * b)));
  __m128i v = _mm_loadu_si128((const __m128i*)(row + 16 * b));
  const __m128i lo4 = _mm_set1_epi8(0x0F);
  __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), lo4), _mm_and_si128(v, lo4));  // [lo | hi]
  return _mm512_cvtepu8_epi16(u);
}

// Rows [m0, m0 + MT) of the output for weight rows [n0, n1).
template <int BITS, int MT>
static void tile(const int16_t* q, const float* dx, const float* sx, const uint8_t* w, const float* d,
                 const float* mo, float* y, int64_t K, int64_t N, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t nb = K / 32, row_bytes = K * BITS / 8;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    const float* dn = d + n * nb;
    const float* mn = mo + n * nb;
    __m512 acc[MT];
    float off[MT];
    for (int t = 0; t < MT; ++t) { acc[t] = _mm512_setzero_ps(); off[t] = 0.f; }
    for (int64_t b = 0; b < nb; ++b) {
      __m512i u = load_codes<BITS>(row, b);
      for (int t = 0; t < MT; ++t) {
        const int64_t r = (m0 + t) * nb + b;
        __m512i xv = _mm512_loadu_si512(q + (m0 + t) * K + 32 * b);
        __m512i dot = _mm512_dpwssd_epi32(_mm512_setzero_si512(), u, xv);  // 16 lanes, 2 products each
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(dn[b] * dx[r]), acc[t]);
        off[t] += mn[b] * sx[r];
      }
    }
    for (int t = 0; t < MT; ++t) y[(m0 + t) * N + n] = _mm512_reduce_add_ps(acc[t]) + off[t];
  }
}

template <int BITS>
static void run(const int16_t* q, const float* dx, const float* sx, const uint8_t* w, const float* d,
                const float* mo, float* y, int64_t M, int64_t K, int64_t N) {
  // Split the weight rows among threads; each thread streams its rows once per 4 rows of x.
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) tile<BITS, 4>(q, dx, sx, w, d, mo, y, K, N, m, n0, n1);
    for (; m < M; ++m) tile<BITS, 1>(q, dx, sx, w, d, mo, y, K, N, m, n0, n1);
  });
}

torch::Tensor qgemm(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m, int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "qgemm: x must be (M, K) float32");
  TORCH_CHECK(bits == 4 || bits == 8, "qgemm: bits must be 4 or 8");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0);
  TORCH_CHECK(K % 32 == 0 && qs.size(1) == K * bits / 8 && d.size(1) == K / 32, "qgemm: shapes do not match");
  auto q = torch::empty({M, K}, x.options().dtype(torch::kShort));
  auto dx = torch::empty({M, K / 32}, x.options());
  auto sx = torch::empty({M, K / 32}, x.options());
  for (int64_t i = 0; i < M; ++i)
    quantize_row(x.data_ptr<float>() + i * K, K, q.data_ptr<int16_t>() + i * K, dx.data_ptr<float>() + i * K / 32,
                 sx.data_ptr<float>() + i * K / 32);
  auto y = torch::empty({M, N}, x.options());
  auto f = bits == 4 ? run<4> : run<8>;
  f(q.data_ptr<int16_t>(), dx.data_ptr<float>(), sx.data_ptr<float>(), qs.data_ptr<uint8_t>(), d.data_ptr<float>(),
    m.data_ptr<float>(), y.data_ptr<float>(), M, K, N);
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
    return load_cpp("edgechat_qgemm", _SOURCE, ("qgemm",))


def available() -> bool:
    """An AVX-512 VNNI CPU and a C++ compiler: the kernel builds (once) and runs."""
    if not cpu_has_vnni():
        return False
    try:
        _extension()
    except (RuntimeError, OSError, ImportError) as e:  # no compiler or headers: the caller falls back
        import sys

        print(f"kernels.qgemm_cpu: the VNNI kernel did not build ({e}); using the reference", file=sys.stderr)
        return False
    return True


def qgemm_cpu(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int) -> torch.Tensor:
    """Same contract as qgemm_ref (K a multiple of 64)."""
    return _extension().qgemm(x, qs, d, m, bits)
