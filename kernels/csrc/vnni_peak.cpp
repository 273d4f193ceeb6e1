// The machine's VNNI peak, for bench/prefill.py: independent chains of one dot-product instruction on
// registers (no memory traffic), on `threads` OpenMP threads at once. vpdpbusd is int8 x int8 (64
// multiply-adds per 512-bit instruction), vpdpwssd int16 x int16 pairs (32), what kernels/qgemm.h uses.
#include <immintrin.h>
#include <omp.h>
#include <torch/extension.h>

#include <chrono>
#include <cstdint>
#include <string>

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("peak_macs", &peak_macs, "multiply-adds per second of one VNNI instruction on registers");
}
