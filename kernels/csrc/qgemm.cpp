// One block-quantized matmul for kernels/qgemm_cpu.py's `qgemm_cpu`: x's rows quantized (wide, or narrow where
// `narrow` says), then the weight's supertiles split among OpenMP threads (edgechat/qgemm.h).
#include "edgechat/qgemm.h"

#include <omp.h>
#include <torch/extension.h>

torch::Tensor qgemm(torch::Tensor x, torch::Tensor packed, int64_t N, int64_t bits,
                    c10::optional<torch::Tensor> narrow) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "qgemm: x must be (M, K) float32");
  TORCH_CHECK(bits == 4 || bits == 8, "qgemm: bits must be 4 or 8");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 64 == 0 && N % 16 == 0, "qgemm: K % 64 and N % 16 must be 0");
  TORCH_CHECK(packed.numel() == (N / 16) * (K / 32) * (bits * 64 + 32 + (bits == 4 ? 32 : 0)),
              "qgemm: the packed weight does not have N x K");
  auto wide = torch::ones({M}, x.options().dtype(torch::kByte));
  if (narrow.has_value()) {
    TORCH_CHECK(narrow->dim() == 1 && narrow->size(0) == M, "qgemm: narrow must be (M,)");
    wide = narrow->logical_not().to(torch::kByte).contiguous();
  }
  auto q = torch::empty({M, 2 * K}, x.options().dtype(torch::kChar));
  auto dx = torch::empty({M, K / 32}, x.options());
  auto sx = torch::empty({M, K / 32}, x.options());
  auto sq = torch::empty({M, K / 32}, x.options().dtype(torch::kInt));
  const uint8_t* wp = wide.data_ptr<uint8_t>();
  for (int64_t i = 0; i < M; ++i)
    qg::quantize_row(x.data_ptr<float>() + i * K, K, q.data_ptr<int8_t>() + i * 2 * K,
                     dx.data_ptr<float>() + i * K / 32, sq.data_ptr<int32_t>() + i * K / 32,
                     sx.data_ptr<float>() + i * K / 32, wp[i]);
  auto y = torch::empty({M, N}, x.options());
  const qg::Act a{q.data_ptr<int8_t>(), dx.data_ptr<float>(), sq.data_ptr<int32_t>(), sx.data_ptr<float>(), M, K, wp};
  const int64_t S = qg::supertiles(N);
  const qg::Packed w{packed.data_ptr<uint8_t>(), bits};
  float* yp = y.data_ptr<float>();
  // A few rows take microseconds: a team's barrier would cost more than it saves (and stalls when a core is busy).
  const int threads = M < 16 ? 1 : (int)std::min<int64_t>(at::get_num_threads(), S);
#pragma omp parallel num_threads(threads)
  {
    const int nt = omp_get_num_threads(), id = omp_get_thread_num();
    qg::gemm(a, w, N, S * id / nt, S * (id + 1) / nt, yp, N, qg::kStore);
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("qgemm", torch::wrap_pybind_function(qgemm), "qgemm"); }
