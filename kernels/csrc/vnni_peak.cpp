// The machine's roofline. peak_macs, for bench/prefill.py: independent chains of one dot-product
// instruction on registers (no memory traffic), on `threads` OpenMP threads at once. vpdpbusd is int8 x
// int8 (64 multiply-adds per 512-bit instruction), vpdpwssd int16 x int16 pairs (32), what
// kernels/qgemm.h uses. read_bandwidth, for bench/engine.py: the rate at which `threads` threads
// stream a buffer far larger than the caches (the floor under a decode step's KV reads).
#include <c10/util/Exception.h>  // TORCH_CHECK; no tensor here, so not torch/extension.h (45 s of CPU to build, 16 without)
#include <immintrin.h>
#include <omp.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace {

constexpr int kChains = 16;  // more than latency x throughput, so the instruction's throughput is what is timed

// 16 independent accumulators in zmm0..zmm15, the operands in zmm16/zmm17: written in assembly so that no
// compiler keeps an accumulator in memory.
#define EC_CHAINS(OP)                                                                                            \
  OP " %%zmm16, %%zmm17, %%zmm0\n\t" OP " %%zmm16, %%zmm17, %%zmm1\n\t" OP " %%zmm16, %%zmm17, %%zmm2\n\t" OP    \
     " %%zmm16, %%zmm17, %%zmm3\n\t" OP " %%zmm16, %%zmm17, %%zmm4\n\t" OP " %%zmm16, %%zmm17, %%zmm5\n\t" OP    \
     " %%zmm16, %%zmm17, %%zmm6\n\t" OP " %%zmm16, %%zmm17, %%zmm7\n\t" OP " %%zmm16, %%zmm17, %%zmm8\n\t" OP    \
     " %%zmm16, %%zmm17, %%zmm9\n\t" OP " %%zmm16, %%zmm17, %%zmm10\n\t" OP " %%zmm16, %%zmm17, %%zmm11\n\t" OP  \
     " %%zmm16, %%zmm17, %%zmm12\n\t" OP " %%zmm16, %%zmm17, %%zmm13\n\t" OP " %%zmm16, %%zmm17, %%zmm14\n\t" OP \
     " %%zmm16, %%zmm17, %%zmm15\n\t"

#define EC_CLOBBER                                                                                                    \
  "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", \
      "xmm14", "xmm15", "xmm16", "xmm17"

template <bool BYTES>
void run(int64_t iters) {
  __asm__ volatile("vpxord %%zmm16, %%zmm16, %%zmm16\n\tvpternlogd $0xff, %%zmm17, %%zmm17, %%zmm17" ::: EC_CLOBBER);
  for (int64_t i = 0; i < iters; ++i) {
    if (BYTES)
      __asm__ volatile(EC_CHAINS("vpdpbusd")::: EC_CLOBBER);
    else
      __asm__ volatile(EC_CHAINS("vpdpwssd")::: EC_CLOBBER);
  }
}

}  // namespace

// Multiply-adds per second of `kind` ("dpbusd" or "dpwssd") on `threads` threads running together.
double peak_macs(const std::string& kind, int64_t iters, int64_t threads) {
  const bool bytes = kind == "dpbusd";
  TORCH_CHECK(bytes || kind == "dpwssd", "peak_macs: kind is dpbusd or dpwssd");
  double seconds = 0.0;
#pragma omp parallel num_threads(threads)
  {
    run<true>(iters / 16 + 1);  // warm the unit (and the clock) before timing
#pragma omp barrier
    const auto t0 = std::chrono::steady_clock::now();
    if (bytes)
      run<true>(iters);
    else
      run<false>(iters);
#pragma omp barrier
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
#pragma omp critical
    {
      if (dt > seconds) seconds = dt;
    }
  }
  const double per_instr = bytes ? 64.0 : 32.0;
  return (double)threads * iters * kChains * per_instr / seconds;
}

// Bytes per second `threads` threads read together, each streaming its share of `bytes` (rounded to 4 KB
// shares) from memory with 512-bit loads in address order, the best of `reps` passes (the buffer is
// written once first, so its pages exist).
double read_bandwidth(int64_t bytes, int64_t threads, int64_t reps) {
  TORCH_CHECK(bytes >= 4096 * threads && threads >= 1 && reps >= 1,
              "read_bandwidth: a share of 4 KB a thread at least");
  const int64_t share = bytes / threads / 4096 * 4096;
  std::vector<char> buf((size_t)(share * threads), 1);
  double best = 0.0;
  for (int64_t r = 0; r < reps; ++r) {
    double seconds = 0.0;
    float sink = 0.f;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
      const char* p = buf.data() + share * omp_get_thread_num();
      __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
#pragma omp barrier
      const auto t0 = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < share; i += 128) {
        s0 = _mm512_add_ps(s0, _mm512_loadu_ps((const float*)(p + i)));
        s1 = _mm512_add_ps(s1, _mm512_loadu_ps((const float*)(p + i + 64)));
      }
#pragma omp barrier
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      sink += _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
#pragma omp critical
      {
        if (dt > seconds) seconds = dt;
      }
    }
    TORCH_CHECK(std::isfinite(sink), "read_bandwidth: the buffer read back non-finite");  // keeps the loads
    best = std::max(best, (double)(share * threads) / seconds);
  }
  return best;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("peak_macs", &peak_macs, "multiply-adds per second of one VNNI instruction on registers");
  m.def("read_bandwidth", &read_bandwidth, "bytes per second threads stream from memory together");
}
