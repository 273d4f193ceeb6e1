// The EAGLE-3 draft head's step in one call on CPU (speculative/head.py has the math): `DraftHead` holds the
// head's fp32 weights and runs a step's T entries -- a commit chunk from the target's features, or a draft level's
// nodes -- from fc to the draft logits, in phases shared out by the work-claiming pool (edgechat/pool.h):
//
//     g = fc(aux)                        (a commit; a draft level passes its parents' o as g)
//     z = [norm(E x) ; norm(g)]
//     qkv = z Wqkv^T, RoPE, k and v into the head's paged layer
//     attention (edgechat/attention.h), u = g + attn Wo^T
//     o = u + down(silu(gate(norm(u))) * up(norm(u)))
//     logp = log_softmax(norm(o) Wlm^T)
//
// The first three lines run for every row: its k and v are what a commit keeps. The rest runs only for the rows
// asked (`out_rows`): a commit's newest entry per sequence, whose o seeds the draft; a draft level's every node.
//
// The draft distribution comes out normalized: what the Drafter ranks (EAGLE-2 scores are sums of log q) and
// samples from (softmax(logp / T) = softmax(logits / T)). In PyTorch that log-softmax is one more op, and a
// costly one here: torch splits it over its OpenMP threads, whose barrier waits for a core that the pools'
// helpers (this one's and the target step's) have just been spinning on -- 7 ms a call on the busy 2-core VM,
// against 0.06 ms with one torch thread.
//
// kernels/cpu_draft.py binds it and states its contract. The matmul weights are held in fp16 (the norms and the
// embedding in fp32) and widened exactly as they are loaded: the head is ~7 M parameters, and a batch-1 step
// streams all of them, ~14 MB in fp16 (28 in fp32: 1.1 ms a step at the two cores' read rate, a third of a
// chain-3 round's draft). Activations and sums are fp32: the results match the PyTorch head with its weights
// rounded to fp16 to float rounding (no activation quantization as the target's qgemm has).
//
// The matmuls are x W^T with W row-major (out, in): a worker takes a run of output rows and computes, for 4 rows
// and 4 tokens at a time, 16-lane partial sums over the input, then each (token, row)'s 16 lanes added in a fixed
// order. A row's result so never depends on the other rows of its step nor on the thread count (per-row
// arithmetic only, -ffp-contract=off as kernels/cpu_build.py builds), as in cpu_forward.cpp.
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "edgechat/attention.h"
#include "edgechat/pool.h"
#include "edgechat/rows.h"

namespace {

constexpr int64_t kSplitRows = 16;       // from this many rows on, the per-row phases are shared out too
constexpr int64_t kChunksPerWorker = 8;  // a matmul's output rows in about this many claims per thread
constexpr int64_t kTokenBlock = 32;      // tokens per pass over a run of weight rows (their x stays in L2)

inline __mmask16 tail(int64_t r) { return r >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << r) - 1); }

// y[j ldy + i] (+)= x_j . W_i for MR fp16 weight rows (K apart) and MT tokens (ldx apart), any K.
template <int MR, int MT>
void tile(const float* x, int64_t ldx, const uint16_t* W, int64_t K, float* y, int64_t ldy, bool add) {
  __m512 acc[MR][MT];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < MT; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = tail(K - k);
    __m512 w[MR];
    for (int i = 0; i < MR; ++i) w[i] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, W + i * K + k));
    for (int j = 0; j < MT; ++j) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + j * ldx + k);
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_fmadd_ps(w[i], xv, acc[i][j]);
    }
  }
  for (int j = 0; j < MT; ++j)
    for (int i = 0; i < MR; ++i) {
      const float s = _mm512_reduce_add_ps(acc[i][j]);
      y[j * ldy + i] = add ? y[j * ldy + i] + s : s;
    }
}

using TileFn = void (*)(const float*, int64_t, const uint16_t*, int64_t, float*, int64_t, bool);
constexpr TileFn kTiles[4][4] = {{tile<1, 1>, tile<1, 2>, tile<1, 3>, tile<1, 4>},
                                 {tile<2, 1>, tile<2, 2>, tile<2, 3>, tile<2, 4>},
                                 {tile<3, 1>, tile<3, 2>, tile<3, 3>, tile<3, 4>},
                                 {tile<4, 1>, tile<4, 2>, tile<4, 3>, tile<4, 4>}};

// y[:, n0:n1] (+)= x W[n0:n1]^T for T tokens of K (x dense), y with row stride ldy.
void matmul_rows(const float* x, int64_t T, int64_t K, const uint16_t* W, int64_t n0, int64_t n1, float* y, int64_t ldy,
                 bool add) {
  for (int64_t t0 = 0; t0 < T; t0 += kTokenBlock) {
    const int64_t t1 = std::min(T, t0 + kTokenBlock);
    for (int64_t n = n0; n < n1; n += 4) {
      const int mr = (int)std::min<int64_t>(4, n1 - n);
      for (int64_t t = t0; t < t1; t += 4) {
        const int mt = (int)std::min<int64_t>(4, t1 - t);
        kTiles[mr - 1][mt - 1](x + t * K, K, W + n * K, K, y + t * ldy + n, ldy, add);
      }
    }
  }
}

using rowops::rms_norm_row;
using rowops::rotate;

// x <- x - max - log(sum exp(x - max)) over n values.
inline void log_softmax_row(float* x, int64_t n) {
  __m512 mv = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < n; i += 16) mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(mv, tail(n - i), x + i));
  const float mx = _mm512_reduce_max_ps(mv);
  __m512 sv = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail(n - i);
    const __m512 e = attn::exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), _mm512_set1_ps(mx)));
    sv = _mm512_add_ps(sv, _mm512_maskz_mov_ps(m, e));
  }
  const float shift = mx + std::log(_mm512_reduce_add_ps(sv));
  for (int64_t i = 0; i < n; ++i) x[i] -= shift;
}

// One attention work item: an out row's heads (every kv head's) over one chunk of its token's keys.
struct Item {
  int64_t t, i0, i1;
};

}  // namespace

class DraftHead {
 public:
  // shape = (hidden, heads, kv_heads, head_dim, intermediate, draft_vocab); weights = fc (h, 3h), input norm (h),
  // hidden norm (h), qkv (q; k; v rows, 2h), o (h, H D), post-attention norm (h), gate; up (2I, h), down (h, I),
  // final norm (h), lm_head (V, h): the matmuls' (fc, qkv, o, gate; up, down, lm_head) fp16, the norms fp32.
  DraftHead(std::vector<int64_t> shape, double eps, torch::Tensor embed, torch::Tensor cos_sin,
            std::vector<torch::Tensor> weights, int64_t threads)
      : eps_((float)eps),
        embed_(embed.contiguous()),
        cos_sin_(cos_sin.contiguous()),
        pool_(std::make_unique<cpupool::Pool>((int)std::max<int64_t>(0, threads - 1))) {
    TORCH_CHECK(shape.size() == 6, "DraftHead: shape is (hidden, heads, kv_heads, head_dim, intermediate, vocab)");
    h_ = shape[0];
    H_ = shape[1];
    Hkv_ = shape[2];
    D_ = shape[3];
    I_ = shape[4];
    V_ = shape[5];
    TORCH_CHECK(H_ % Hkv_ == 0 && (D_ == 16 || D_ == 32 || D_ == 64 || D_ == 128),
                "DraftHead: heads must be a multiple of kv_heads and head_dim 16, 32, 64 or 128");
    TORCH_CHECK(weights.size() == 10, "DraftHead: ten weight tensors");
    const int64_t qkv = (H_ + 2 * Hkv_) * D_;
    const std::vector<std::vector<int64_t>> want = {{h_, 3 * h_}, {h_},         {h_},     {qkv, 2 * h_}, {h_, H_ * D_},
                                                    {h_},         {2 * I_, h_}, {h_, I_}, {h_},          {V_, h_}};
    for (size_t i = 0; i < weights.size(); ++i) {
      const auto dtype = want[i].size() == 2 ? torch::kHalf : torch::kFloat;  // matmuls fp16, norms fp32
      TORCH_CHECK(weights[i].scalar_type() == dtype && weights[i].sizes().vec() == want[i], "DraftHead: weight ", i,
                  " must be ", dtype, " of shape ", want[i], ", got ", weights[i].scalar_type(), " ",
                  weights[i].sizes());
      w_.push_back(weights[i].contiguous());
    }
    TORCH_CHECK(embed_.scalar_type() == torch::kFloat && embed_.dim() == 2 && embed_.size(1) == h_,
                "DraftHead: embed must be fp32 (vocab, hidden)");
    TORCH_CHECK(cos_sin_.scalar_type() == torch::kFloat && cos_sin_.size(1) == D_,
                "DraftHead: cos_sin must be fp32 (positions, head_dim)");
  }

  int64_t threads() const { return pool_->workers(); }

  // inp (T, 3h): target features, fused by fc; (T, h): g itself. Keys: token j of sequence e (rows
  // cu[e] .. cu[e+1]) reads its sequence's block table row; without tree_mask it is a causal chunk whose
  // sequence then holds lens[e] entries; with it (T, E) the token sees the lens[e] committed entries and the
  // draft entries lens[e] + c (c < tree_n[e]) its mask row allows. k, v go to `slots` (-1: not stored) of kv
  // (2, blocks, page, Hkv, D), fp32 or fp16. Returns {o (R, h), logp (R, V): log q} of rows out_rows (R).
  std::vector<torch::Tensor> forward(torch::Tensor ids, torch::Tensor inp, torch::Tensor positions, torch::Tensor slots,
                                     torch::Tensor tables, torch::Tensor cu, torch::Tensor lens,
                                     c10::optional<torch::Tensor> tree_mask, c10::optional<torch::Tensor> tree_n,
                                     torch::Tensor kv, torch::Tensor out_rows) {
    ids = ids.contiguous();
    inp = inp.contiguous();
    positions = positions.contiguous();
    slots = slots.contiguous();
    tables = tables.contiguous();
    cu = cu.contiguous();
    lens = lens.contiguous();
    out_rows = out_rows.contiguous();
    const int64_t T = ids.size(0), R = out_rows.size(0);
    TORCH_CHECK(ids.scalar_type() == torch::kLong && positions.scalar_type() == torch::kLong &&
                    slots.scalar_type() == torch::kLong && out_rows.scalar_type() == torch::kLong,
                "DraftHead: ids, positions, slots and out_rows are int64");
    TORCH_CHECK(
        tables.scalar_type() == torch::kInt && cu.scalar_type() == torch::kInt && lens.scalar_type() == torch::kInt,
        "DraftHead: tables, cu and lens are int32");
    TORCH_CHECK(inp.scalar_type() == torch::kFloat && inp.dim() == 2 && inp.size(0) == T &&
                    (inp.size(1) == h_ || inp.size(1) == 3 * h_),
                "DraftHead: inp must be fp32 (T, hidden) or (T, 3 hidden)");
    TORCH_CHECK(positions.size(0) == T && slots.size(0) == T, "DraftHead: one position and slot per token");
    TORCH_CHECK(kv.is_contiguous() && (kv.scalar_type() == torch::kHalf || kv.scalar_type() == torch::kFloat) &&
                    kv.dim() == 5 && kv.size(0) == 2 && kv.size(3) == Hkv_ && kv.size(4) == D_,
                "DraftHead: kv must be a contiguous fp16 or fp32 (2, blocks, page, Hkv, D)");
    const int64_t page = kv.size(2);
    TORCH_CHECK(page > 0 && (page & (page - 1)) == 0, "DraftHead: the page size must be a power of two");
    std::vector<torch::Tensor> keep;
    const std::vector<attn::Keys> keys = key_sets(T, tables, cu, lens, tree_mask, tree_n, keep);
    const int64_t* orp = out_rows.data_ptr<int64_t>();
    for (int64_t r = 0; r < R; ++r) TORCH_CHECK(orp[r] >= 0 && orp[r] < T, "DraftHead: out row out of range");
    std::vector<Item> items;  // (out row r, chunk of its token's keys); r's chunks are items [first[r], first[r+1])
    std::vector<int64_t> first(R + 1, 0);
    for (int64_t r = 0; r < R; ++r) {
      first[r] = items.size();
      const attn::Keys& k = keys[orp[r]];
      for (int64_t i0 = 0; i0 < k.size(); i0 += attn::kChunk)
        items.push_back({r, i0, std::min<int64_t>(k.size(), i0 + attn::kChunk)});
    }
    first[R] = items.size();

    auto opts = embed_.options();
    const int64_t qkv_n = (H_ + 2 * Hkv_) * D_;
    auto g = inp.size(1) == h_ ? inp : torch::empty({T, h_}, opts);
    auto z = torch::empty({T, 2 * h_}, opts);
    auto qkv = torch::empty({T, qkv_n}, opts);
    auto attn = torch::empty({R, H_ * D_}, opts);
    auto o = torch::empty({R, h_}, opts);  // u, then o
    auto xn = torch::empty({R, h_}, opts);
    auto gu = torch::empty({R, 2 * I_}, opts);
    auto act = torch::empty({R, I_}, opts);
    auto logits = torch::empty({R, V_}, opts);
    const int W = pool_->workers();
    const int64_t G = H_ / Hkv_, part = H_ * (D_ + 2);  // an item's partials: every head's acc[D], m, l
    std::vector<std::vector<float>> scores(W, std::vector<float>(H_ * attn::kChunk));
    std::vector<float> parts(items.size() * part);

    const int64_t* idp = ids.data_ptr<int64_t>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* slp = slots.data_ptr<int64_t>();
    float* gp = g.data_ptr<float>();
    float* zp = z.data_ptr<float>();
    float* qkvp = qkv.data_ptr<float>();
    float* ap = attn.data_ptr<float>();
    float* op = o.data_ptr<float>();
    float* xnp = xn.data_ptr<float>();
    float* gup = gu.data_ptr<float>();
    float* actp = act.data_ptr<float>();
    const float* emb = embed_.data_ptr<float>();
    const float* cs = cos_sin_.data_ptr<float>();
    const int64_t cs_stride = cos_sin_.size(1), half = D_ / 2, vocab = embed_.size(0);
    for (int64_t t = 0; t < T; ++t) TORCH_CHECK(idp[t] >= 0 && idp[t] < vocab, "DraftHead: token id out of range");
    const bool f16 = kv.scalar_type() == torch::kHalf;
    const int64_t esize = f16 ? 2 : 4, pool = kv.size(1) * page * Hkv_ * D_;
    char* kc = (char*)kv.data_ptr();
    char* vc = kc + pool * esize;
    const float scale = 1.f / std::sqrt((float)D_);
    auto wp = [&](int i) { return w_[i].data_ptr<float>(); };                                        // a norm
    auto wh = [&](int i) { return reinterpret_cast<const uint16_t*>(w_[i].data_ptr<at::Half>()); };  // a matmul

    // y (+)= x W^T over N output rows, shared out in runs of rows.
    auto matmul = [&](const float* x, int64_t M, int64_t K, const uint16_t* Wt, int64_t N, float* y, bool add) {
      int64_t per = std::max<int64_t>(16, N / (kChunksPerWorker * W));
      per = (per + 3) / 4 * 4;
      pool_->run((N + per - 1) / per,
                 [&](int64_t c, int) { matmul_rows(x, M, K, Wt, c * per, std::min(N, c * per + per), y, N, add); });
    };
    auto rows = [&](int64_t n, const std::function<void(int64_t, int)>& f) {
      if (n < kSplitRows)
        for (int64_t t = 0; t < n; ++t) f(t, 0);
      else
        pool_->run(n, f);
    };

    pool_->begin_step();
    if (inp.size(1) == 3 * h_) matmul(inp.data_ptr<float>(), T, 3 * h_, wh(0), h_, gp, false);  // g = fc(aux)
    rows(T, [&](int64_t t, int) {  // z = [norm(E x) ; norm(g)]
      rms_norm_row(emb + idp[t] * h_, wp(1), h_, eps_, zp + t * 2 * h_);
      rms_norm_row(gp + t * h_, wp(2), h_, eps_, zp + t * 2 * h_ + h_);
    });
    matmul(zp, T, 2 * h_, wh(3), qkv_n, qkvp, false);
    // RoPE on q and k heads; k and v into the head's layer as it stores them (slot -1: not stored)
    rows(T, [&](int64_t t, int) {
      float* row = qkvp + t * qkv_n;
      const float* c = cs + pos[t] * cs_stride;
      for (int64_t hh = 0; hh < H_ + Hkv_; ++hh) rotate(row + hh * D_, c, half);
      if (slp[t] < 0) return;
      const int64_t at = slp[t] * Hkv_ * D_;
      const float* k = row + H_ * D_;
      const float* v = row + (H_ + Hkv_) * D_;
      if (f16) {
        attn::store_heads((uint16_t*)kc + at, k, Hkv_, D_);
        attn::store_heads((uint16_t*)vc + at, v, Hkv_, D_);
      } else {
        attn::store_heads((float*)kc + at, k, Hkv_, D_);
        attn::store_heads((float*)vc + at, v, Hkv_, D_);
      }
    });
    // attention of the out rows: chunk partials per row, then merged per (row, kv head) into its G heads' outputs
    const attn::Cache cache{kc, vc, page, Hkv_, D_, f16 ? attn::Kind::f16 : attn::Kind::f32};
    pool_->run(items.size(), [&](int64_t i, int w) {
      const Item& it = items[i];
      attn::partial_any(keys[orp[it.t]], it.i0, it.i1, qkvp + orp[it.t] * qkv_n, (int)G, scale, cache, scores[w].data(),
                        parts.data() + i * part);
    });
    rows(R * Hkv_, [&](int64_t j, int) {  // j = r * Hkv + kv head
      const int64_t r = j / Hkv_, kh = j % Hkv_;
      attn::merge(parts.data() + first[r] * part + kh * G * (D_ + 2), first[r + 1] - first[r], part, (int)G, D_,
                  ap + j * G * D_);
    });
    for (int64_t r = 0; r < R; ++r) std::memcpy(op + r * h_, gp + orp[r] * h_, h_ * sizeof(float));
    if (R) {
      matmul(ap, R, H_ * D_, wh(4), h_, op, true);  // u = g + attn Wo^T
      rows(R, [&](int64_t r, int) { rms_norm_row(op + r * h_, wp(5), h_, eps_, xnp + r * h_); });
      matmul(xnp, R, h_, wh(6), 2 * I_, gup, false);
      rows(R, [&](int64_t r, int) {  // act = silu(gate) up = gate / (1 + e^-gate) up
        const float* gr = gup + r * 2 * I_;
        float* ar = actp + r * I_;
        for (int64_t i = 0; i < I_; ++i) ar[i] = gr[i] / (1.f + std::exp(-gr[i])) * gr[I_ + i];
      });
      matmul(actp, R, I_, wh(7), h_, op, true);  // o = u + act Wdown^T
      rows(R, [&](int64_t r, int) { rms_norm_row(op + r * h_, wp(8), h_, eps_, xnp + r * h_); });
      matmul(xnp, R, h_, wh(9), V_, logits.data_ptr<float>(), false);
    }
    rows(R, [&](int64_t r, int) { log_softmax_row(logits.data_ptr<float>() + r * V_, V_); });
    pool_->end_step();
    return {o, logits};
  }

 private:
  // The keys each token's query sees (attn::Keys), from the step's attention metadata.
  std::vector<attn::Keys> key_sets(int64_t T, const torch::Tensor& tables, const torch::Tensor& cu,
                                   const torch::Tensor& lens, const c10::optional<torch::Tensor>& tree_mask,
                                   const c10::optional<torch::Tensor>& tree_n, std::vector<torch::Tensor>& keep) {
    std::vector<attn::Keys> keys(T);
    const int32_t* cup = cu.data_ptr<int32_t>();
    const int32_t* lnp = lens.data_ptr<int32_t>();
    const int64_t B = cu.size(0) - 1;
    TORCH_CHECK(B >= 0 && lens.size(0) == B && tables.dim() == 2 && tables.size(0) == B && cup[0] == 0 && cup[B] == T,
                "DraftHead: cu (B + 1) must cover the step's tokens; lens and tables one row per sequence");
    const int32_t* tb = tables.data_ptr<int32_t>();
    const int64_t width = tables.size(1);
    if (tree_mask.has_value()) {
      TORCH_CHECK(tree_n.has_value(), "DraftHead: a tree step needs each sequence's draft entry count");
      const torch::Tensor mk = tree_mask->contiguous(), nt = tree_n->contiguous();
      keep.push_back(mk);  // the Keys' tables point into tensors the caller holds; these stay alive with keep
      keep.push_back(nt);
      TORCH_CHECK(mk.scalar_type() == torch::kBool && mk.dim() == 2 && mk.size(0) == T &&
                      nt.scalar_type() == torch::kInt && nt.size(0) == B,
                  "DraftHead: tree_mask is bool (T, E), tree_n int32 (B)");
      const int64_t E = mk.size(1);
      for (int64_t e = 0; e < B; ++e) {
        const int32_t n = nt.data_ptr<int32_t>()[e];
        TORCH_CHECK(n <= E && cup[e + 1] - cup[e] <= n, "DraftHead: a level's queries are among its tree's entries");
        for (int32_t j = cup[e]; j < cup[e + 1]; ++j) {
          attn::Keys& k = keys[j];
          k.table = tb + e * width;
          k.plain = lnp[e];
          const bool* row = mk.data_ptr<bool>() + j * E;
          for (int32_t c = 0; c < n; ++c)
            if (row[c]) k.extra.push_back(lnp[e] + c);
        }
      }
      return keys;
    }
    for (int64_t e = 0; e < B; ++e) {
      const int32_t n = cup[e + 1] - cup[e], total = lnp[e];
      TORCH_CHECK(total >= n, "DraftHead: a chunk is longer than its sequence");
      for (int32_t j = 0; j < n; ++j) {  // causal: token j of the chunk sees the entries before it and itself
        keys[cup[e] + j].table = tb + e * width;
        keys[cup[e] + j].plain = total - n + j + 1;
      }
    }
    return keys;
  }

  float eps_;
  int64_t h_, H_, Hkv_, D_, I_, V_;
  torch::Tensor embed_, cos_sin_;
  std::vector<torch::Tensor> w_;
  std::unique_ptr<cpupool::Pool> pool_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<DraftHead>(m, "DraftHead")
      .def(pybind11::init<std::vector<int64_t>, double, torch::Tensor, torch::Tensor, std::vector<torch::Tensor>,
                          int64_t>())
      .def("forward", &DraftHead::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("threads", &DraftHead::threads);
}
