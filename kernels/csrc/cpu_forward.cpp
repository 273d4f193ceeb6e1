// A Llama-family decoder step in one call on CPU: `Decoder` holds the packed weights and runs a step's T tokens,
// embedding to final norm, in phases shared out by the work-claiming pool (edgechat/pool.h): qkv matmul, RoPE and
// KV store, paged attention (edgechat/attention.h), o, gate/up + SwiGLU, down. kernels/cpu_forward.py binds it and
// states its contract (the same math as replica.model.LlamaModel; a row's result independent of its batch).
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "edgechat/attention.h"
#include "edgechat/pool.h"
#include "edgechat/qgemm.h"
#include "edgechat/rows.h"

namespace {

struct QMat {
  torch::Tensor w;  // packed (kernels/qgemm_cpu.py)
  int64_t N, K, bits;
  qg::Packed packed() const { return {w.data_ptr<uint8_t>(), bits}; }
};

// One attention work item: every kv head's heads of one token t over chunk c of its keys (kChunk keys from c kChunk),
// through attn::partial_any, its partials to slot first[t] + c; or (`block`) rows [t, t + n), consecutive prompt
// tokens of one sequence, over every chunk of their keys in turn through attn::block_any, each row's chunks merged in
// the worker's scratch and the heads' outputs written (no slot, nothing left to merge).
struct Work {
  int64_t t, n, c;
  bool block;
};

struct AttentionPlan {
  std::vector<Work> work;
  std::vector<int64_t> first;                // T + 1: row t's partial slots are [first[t], first[t + 1])
  std::vector<uint8_t> direct;               // rows a block writes whole: nothing to merge
  int64_t block_chunks = 0, block_rows = 0;  // the most chunks a block spans, the most rows it holds
  // floats of a worker's scratch for a block (kernel scratch, then its rows' chunk partials)
  int64_t block_scratch(int64_t H, int64_t D) const {
    return attn::block_scratch_floats(D) + block_rows * block_chunks * H * (D + 2);
  }
};

// Rows where blocked[t] (prompt rows that see plain keys only) go in blocks of up to kBlockLanes / G consecutive
// tokens of one sequence, the heaviest blocks first; every other row alone, per chunk, in row order. Partial slots
// only for rows that are not direct.
AttentionPlan plan_attention(const std::vector<attn::Keys>& keys, const std::vector<uint8_t>& blocked, int64_t G) {
  const int64_t T = keys.size(), nq_max = attn::kBlockLanes / G;
  auto chunks = [&](int64_t t) { return (keys[t].size() + attn::kChunk - 1) / attn::kChunk; };
  AttentionPlan p;
  p.first.assign(T + 1, 0);
  p.direct.assign(T, 0);
  std::vector<Work> single;
  for (int64_t t = 0; t < T;) {
    int64_t n = 1;
    const bool block = nq_max >= 1 && blocked[t] && keys[t].extra.empty();
    if (block)
      while (t + n < T && n < nq_max && blocked[t + n] && keys[t + n].extra.empty() &&
             keys[t + n].table == keys[t].table && keys[t + n].plain == keys[t].plain + n)
        ++n;
    if (block) {
      for (int64_t r = t; r < t + n; ++r) p.direct[r] = 1;
      p.work.push_back({t, n, 0, true});
      p.block_chunks = std::max(p.block_chunks, chunks(t + n - 1));
      p.block_rows = std::max(p.block_rows, n);
    } else {
      for (int64_t c = 0; c < chunks(t); ++c) single.push_back({t, 1, c, false});
    }
    t += n;
  }
  for (int64_t t = 0; t < T; ++t) p.first[t + 1] = p.first[t] + (p.direct[t] ? 0 : chunks(t));
  if (p.work.empty()) {  // a decode step: nothing blocked
    p.work = std::move(single);
    return p;
  }
  auto cost = [&](const Work& w) { return w.n * keys[w.t + w.n - 1].size(); };  // row-keys
  std::stable_sort(p.work.begin(), p.work.end(), [&](const Work& a, const Work& b) { return cost(a) > cost(b); });
  p.work.insert(p.work.end(), single.begin(), single.end());
  return p;
}

// The pool's element kind from its dtype: fp16, int8 codes with their scales, else fp32.
attn::Kind pool_kind(torch::ScalarType t) {
  return t == torch::kHalf ? attn::Kind::f16 : t == torch::kChar ? attn::Kind::i8 : attn::Kind::f32;
}

// Row t's (not direct) kv head kh: its chunks' partials merged into its G heads' outputs at out + (t H + kh G) D.
void merge_row(const AttentionPlan& p, const float* parts, int64_t part, int64_t t, int64_t kh, int64_t H, int64_t G,
               int64_t D, float* out) {
  attn::merge(parts + p.first[t] * part + kh * G * (D + 2), p.first[t + 1] - p.first[t], part, (int)G, (int)D,
              out + (t * H + kh * G) * D);
}

// Work item w: a token's partials for one chunk at parts[(first[t] + c) part] (part: every head's acc[D], m, l), or a
// block's heads' outputs at out + t' H D for its rows t'. scratch: the worker's, p.block_scratch(H, D) floats for a
// block.
void attend(const AttentionPlan& p, const Work& w, const std::vector<attn::Keys>& keys, const float* q,
            int64_t q_stride, int64_t G, float scale, const attn::Cache& cache, float* scratch, float* parts,
            int64_t part, float* out) {
  if (!w.block) {
    const int64_t i0 = w.c * attn::kChunk;
    attn::partial_any(keys[w.t], i0, std::min(keys[w.t].size(), i0 + attn::kChunk), q + w.t * q_stride, (int)G, scale,
                      cache, scratch, parts + (p.first[w.t] + w.c) * part);
    return;
  }
  const int64_t H = part / (cache.D + 2), D = cache.D, last = keys[w.t + w.n - 1].size();
  const int64_t nch = (last + attn::kChunk - 1) / attn::kChunk;
  float* local = scratch + attn::block_scratch_floats(D);  // row r's chunk c: local + (r nch + c) part
  auto chunks = [&](int64_t r) { return (keys[w.t + r].size() + attn::kChunk - 1) / attn::kChunk; };
  float* partial[attn::kBlockLanes];
  float* final[attn::kBlockLanes];
  for (int64_t c = 0; c < nch; ++c) {
    const int64_t i0 = c * attn::kChunk;
    for (int64_t r = 0; r < w.n; ++r) {  // a one-chunk row's outputs directly (merge's one-part case)
      const bool one = chunks(r) == 1;
      partial[r] = keys[w.t + r].size() > i0 && !one ? local + (r * nch + c) * part : nullptr;
      final[r] = one && c == 0 ? out + (w.t + r) * H * D : nullptr;
    }
    attn::block_any(keys[w.t].table, keys[w.t].plain, (int)w.n, i0, std::min(attn::kChunk, last - i0),
                    q + w.t * q_stride, q_stride, (int)G, scale, cache, scratch, partial, final);
  }
  for (int64_t r = 0; r < w.n; ++r)
    if (chunks(r) == 0)  // no keys: zeros, as merge writes
      std::fill(out + (w.t + r) * H * D, out + (w.t + r + 1) * H * D, 0.f);
    else if (chunks(r) > 1)
      for (int64_t kh = 0; kh < cache.Hkv; ++kh)
        attn::merge(local + r * nch * part + kh * G * (D + 2), chunks(r), part, (int)G, D,
                    out + (w.t + r) * H * D + kh * G * D);
}

// Quantized activations of the next matmul (qg::Act's layout), and a scratch row for the norm.
struct Buf {
  std::vector<int8_t> q;
  std::vector<float> dx, sx, row;
  std::vector<int32_t> sq;
  qg::Act act(int64_t M, int64_t K, const uint8_t* wide) const {
    return {q.data(), dx.data(), sq.data(), sx.data(), M, K, wide};
  }
  void quantize(const float* x, int64_t t, int64_t K, bool wide) {
    const int64_t o = t * K / 32;
    qg::quantize_row(x, K, q.data() + t * 2 * K, dx.data() + o, sq.data() + o, sx.data() + o, wide);
  }
  void reserve(int64_t M, int64_t K) {
    if ((int64_t)q.size() < 2 * M * K) {
      q.resize(2 * M * K);
      dx.resize(M * K / 32);
      sq.resize(M * K / 32);
      sx.resize(M * K / 32);
    }
    if ((int64_t)row.size() < K) row.resize(K);
  }
};

constexpr int64_t kSplitRows = 16;       // from this many tokens on, the activation prep is shared out too
constexpr int64_t kChunksPerWorker = 8;  // a matmul's supertiles in about this many claims per thread
constexpr size_t kMaxOutliers = 16;      // outlier columns a matmul's narrow rows may keep in fp32
constexpr int64_t kMinRowBlock = 32;     // a matmul's rows are split into blocks of at least this many
constexpr int64_t kRowsPerClaim = 4;     // rows a claim of a per-row phase takes (activation prep, RoPE and KV store)

using rowops::rms_norm_row;
using rowops::rotate;

}  // namespace

class Decoder {
 public:
  Decoder(std::vector<int64_t> shape, double eps, torch::Tensor embed, torch::Tensor cos_sin, torch::Tensor final_norm,
          std::vector<torch::Tensor> norms, std::vector<torch::Tensor> biases, std::vector<torch::Tensor> packed,
          std::vector<int64_t> bits, torch::Tensor head, int64_t head_bits, int64_t threads)
      : eps_((float)eps),
        embed_(embed.contiguous()),
        cos_sin_(cos_sin.contiguous()),
        final_norm_(final_norm.contiguous()),
        pool_(std::make_unique<cpupool::Pool>((int)std::max<int64_t>(0, threads - 1))) {
    TORCH_CHECK(shape.size() == 6, "Decoder: shape is (hidden, heads, kv_heads, head_dim, intermediate, layers)");
    h_ = shape[0];
    H_ = shape[1];
    Hkv_ = shape[2];
    D_ = shape[3];
    I_ = shape[4];
    L_ = shape[5];
    TORCH_CHECK(h_ % 64 == 0 && (H_ * D_) % 64 == 0 && I_ % 64 == 0 && H_ % Hkv_ == 0,
                "Decoder: hidden, heads * head_dim and intermediate must be multiples of 64");
    TORCH_CHECK(D_ == 16 || D_ == 32 || D_ == 64 || D_ == 128, "Decoder: head_dim must be 16, 32, 64 or 128");
    TORCH_CHECK((int64_t)norms.size() == 2 * L_ && (int64_t)packed.size() == 4 * L_ && (int64_t)bits.size() == 4 * L_ &&
                    (int64_t)biases.size() == L_,
                "Decoder: per-layer tensors do not match the layer count");
    const int64_t qkv = (H_ + 2 * Hkv_) * D_;
    const int64_t N[4] = {qkv, h_, 2 * I_, h_}, K[4] = {h_, H_ * D_, h_, I_};
    for (int64_t l = 0; l < L_; ++l) {
      norms_.push_back(norms[2 * l].contiguous());
      norms_.push_back(norms[2 * l + 1].contiguous());
      biases_.push_back(biases[l]);
      for (int k = 0; k < 4; ++k) mats_.push_back({packed[4 * l + k].contiguous(), N[k], K[k], bits[4 * l + k]});
    }
    head_ = {head.contiguous(), embed_.size(0), h_, head_bits};
  }

  int64_t threads() const { return pool_->workers(); }
  // Phase timing for benches (bench/prefill.py): while on, each forward adds its phases' wall time, summed over
  // the layers: qkv (norm, activation prep, matmul), RoPE and KV store, attention partials, their merge, o, gate/up
  // with SwiGLU, down. Off (the default) it costs a test per phase.
  void set_timing(bool on) {
    timing_ = on;
    phase_s_.fill(0.0);
    timed_steps_ = 0;
  }
  // {steps timed, then each phase's total ms}
  std::vector<double> phase_ms() const {
    std::vector<double> out{(double)timed_steps_};
    for (double s : phase_s_) out.push_back(s * 1e3);
    return out;
  }
  // Calibration for narrow rows' outlier columns: while on, every step records each matmul input's largest |x|
  // per column (its rows prepared one at a time); column_amax() returns them, 4 a layer (qkv, o, gate/up, down).
  void set_calibration(bool on) {
    calibrating_ = on;
    col_amax_.assign(mats_.size(), {});
    for (size_t i = 0; i < mats_.size(); ++i) col_amax_[i].assign(mats_[i].K, 0.f);
  }
  std::vector<torch::Tensor> column_amax() const {
    std::vector<torch::Tensor> out;
    for (const auto& a : col_amax_) out.push_back(torch::tensor(a));
    return out;
  }
  // Per matmul: the input columns a narrow row keeps out of its int8 blocks and those columns of the weight,
  // exact, (len(cols), N) fp32 in the packed weight's row order (empty: none).
  void set_outliers(std::vector<std::vector<int64_t>> cols, std::vector<torch::Tensor> w) {
    TORCH_CHECK(cols.size() == mats_.size() && w.size() == mats_.size(), "set_outliers: one entry per matmul");
    outliers_.assign(mats_.size(), {});
    for (size_t i = 0; i < mats_.size(); ++i) {
      for (int64_t c : cols[i]) TORCH_CHECK(c >= 0 && c < mats_[i].K, "set_outliers: column out of range");
      TORCH_CHECK(cols[i].size() <= kMaxOutliers, "set_outliers: at most ", kMaxOutliers, " columns");
      TORCH_CHECK(cols[i].empty() || (w[i].dim() == 2 && w[i].size(0) == (int64_t)cols[i].size() &&
                                      w[i].size(1) == mats_[i].N && w[i].scalar_type() == torch::kFloat),
                  "set_outliers: weight columns must be (len(cols), N) fp32");
      const int64_t n = cols[i].size(), N = mats_[i].N;
      std::vector<float> wt(n * N);
      if (n) {
        const auto src = w[i].contiguous();
        const float* p = src.data_ptr<float>();
        for (int64_t j = 0; j < n; ++j)
          for (int64_t c = 0; c < N; ++c) wt[((c / 16) * n + j) * 16 + c % 16] = p[j * N + c];
      }
      outliers_[i] = {cols[i], std::move(wt)};
    }
  }
  // (steps, steps run on the caller alone since the pool judged its helpers not worth it)
  std::vector<int64_t> pool_stats() const { return {pool_->steps(), pool_->solo_steps()}; }

  // Returns {hidden (T, h) after the final norm} (+ {aux (T, len(aux_layers) * h)}: the
  // residual stream after each aux layer, what an EAGLE-3 head reads).
  std::vector<torch::Tensor> forward(torch::Tensor ids, torch::Tensor positions, torch::Tensor slots,
                                     int64_t num_decode, c10::optional<torch::Tensor> dec_tables,
                                     c10::optional<torch::Tensor> dec_lens, c10::optional<torch::Tensor> ext_tables,
                                     c10::optional<torch::Tensor> ext_cu, c10::optional<torch::Tensor> ext_lens,
                                     c10::optional<torch::Tensor> tree_mask, c10::optional<torch::Tensor> tree_prefix,
                                     torch::Tensor kv, std::vector<int64_t> aux_layers,
                                     c10::optional<torch::Tensor> narrow, c10::optional<torch::Tensor> out_rows) {
    const int64_t T = ids.size(0);
    int64_t Tn = T;  // rows a phase computes: T, in the last layer only out_rows' (see `outs` below)
    // each row's activations wide (int16) or, where `narrow` says, narrow (int8): edgechat/qgemm.h
    std::vector<uint8_t> wide(T, 1);
    if (narrow.has_value() && narrow->numel()) {
      TORCH_CHECK(narrow->dim() == 1 && narrow->size(0) == T, "Decoder: narrow must be (T,)");
      const auto n = narrow->to(torch::kBool).contiguous();
      for (int64_t t = 0; t < T; ++t) wide[t] = !n.data_ptr<bool>()[t];
    }
    // the pool's elements: fp16 (its bits), fp32, or int8 rows of D codes and a 4-byte scale
    const attn::Kind kind = pool_kind(kv.scalar_type());
    const int64_t rd = kind == attn::Kind::i8 ? D_ + attn::kScaleBytes : D_;  // elements a (token, kv head)
    TORCH_CHECK(kv.is_contiguous() && (kind != attn::Kind::f32 || kv.scalar_type() == torch::kFloat) && kv.dim() == 6 &&
                    kv.size(0) == L_ && kv.size(4) == Hkv_ && kv.size(5) == rd,
                "Decoder: kv must be a contiguous fp16 or fp32 (L, 2, blocks, page, Hkv, D), or int8 "
                "(L, 2, blocks, page, Hkv, D + 4)");
    ids = ids.contiguous();
    positions = positions.contiguous();
    slots = slots.contiguous();
    std::vector<torch::Tensor> keep;  // contiguous copies that the Keys' tables point into
    // Every block a table names and every slot written must lie in the pool: checked here, on the calling thread
    // (a failed check inside a pool worker would end the process instead of raising); tokens() checks the tables.
    const std::vector<attn::Keys> keys = tokens(T, num_decode, dec_tables, dec_lens, ext_tables, ext_cu, ext_lens,
                                                tree_mask, tree_prefix, kv.size(2), keep);
    for (int64_t t = 0; t < T; ++t)
      TORCH_CHECK(slots.data_ptr<int64_t>()[t] < kv.size(2) * kv.size(3), "Decoder: slot ",
                  slots.data_ptr<int64_t>()[t], " is past the pool's end");
    // attention work: a prompt's narrow rows in blocks of tokens, every other row alone (plan_attention)
    const int64_t G = H_ / Hkv_, part = H_ * (D_ + 2);  // a row's partials per chunk: every head's acc[D], m, l
    std::vector<uint8_t> blocked(T, 0);
    for (int64_t t = num_decode; t < T; ++t) blocked[t] = !wide[t];
    const AttentionPlan plan = plan_attention(keys, blocked, G);
    const bool any_block = !plan.work.empty() && plan.work.front().block;
    std::vector<int64_t> to_merge;  // rows whose heads' outputs are merged from their parts
    for (int64_t t = 0; t < T; ++t)
      if (!plan.direct[t]) to_merge.push_back(t);
    const AttentionPlan* plan_now = &plan;
    AttentionPlan plan_last;           // the last layer's, when only `outs` go on
    std::vector<attn::Keys> keys_now;  // the last layer's rows' keys then (empty: `keys`)

    auto opts = embed_.options();
    auto x = torch::empty({T, h_}, opts);
    auto hidden = torch::empty({T, h_}, opts);
    const int64_t qkv_n = (H_ + 2 * Hkv_) * D_, kmax = std::max(std::max(h_, I_), H_ * D_);
    auto qkv = torch::empty({T, qkv_n}, opts);
    auto attn = torch::empty({T, H_ * D_}, opts);
    auto act = torch::empty({T, I_}, opts);
    const int64_t n_aux = aux_layers.size();
    auto aux = torch::empty({T, n_aux * h_}, opts);
    std::vector<int64_t> aux_slot(L_, -1);
    for (int64_t i = 0; i < n_aux; ++i) {
      TORCH_CHECK(aux_layers[i] >= 0 && aux_layers[i] < L_, "Decoder: aux layer out of range");
      aux_slot[aux_layers[i]] = i;
    }
    // rows whose final hidden state is read (out_rows, ascending, distinct), when fewer than T and the last layer's
    // residual is no aux output (and not while calibrating, which records every row's inputs): then `prune`
    std::vector<int64_t> outs;
    bool prune = false;
    if (out_rows.has_value() && !calibrating_ && aux_slot[L_ - 1] < 0) {
      const auto o = out_rows->to(torch::kLong).contiguous();
      outs.assign(o.data_ptr<int64_t>(), o.data_ptr<int64_t>() + o.numel());
      std::sort(outs.begin(), outs.end());
      outs.erase(std::unique(outs.begin(), outs.end()), outs.end());
      for (int64_t t : outs) TORCH_CHECK(t >= 0 && t < T, "Decoder: out_rows names row ", t, " of ", T);
      prune = (int64_t)outs.size() < T;
    }
    Buf act_q;
    act_q.reserve(T, kmax);
    const int W = pool_->workers();
    std::vector<std::vector<float>> scores(
        W, std::vector<float>(std::max(H_ * attn::kChunk, any_block ? plan.block_scratch(H_, D_) : 0)));
    std::vector<float> parts(plan.first[T] * part);
    std::vector<Buf> rows(W);
    for (auto& r : rows) r.reserve(0, kmax);

    const int64_t* idp = ids.data_ptr<int64_t>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* slp = slots.data_ptr<int64_t>();
    float* xp = x.data_ptr<float>();
    float* qkvp = qkv.data_ptr<float>();
    float* ap = attn.data_ptr<float>();
    float* actp = act.data_ptr<float>();
    // `pool` elements per layer's K (or V)
    const int64_t page = kv.size(3), pool = kv.size(2) * page * Hkv_ * rd, esize = kv.element_size();
    const float* emb = embed_.data_ptr<float>();
    const float* cs = cos_sin_.data_ptr<float>();
    const int64_t cs_stride = cos_sin_.size(1), half = D_ / 2;
    const float scale = 1.f / std::sqrt((float)D_);

    // f(row, worker) for rows [0, n), kRowsPerClaim rows a claim: a claim is an atomic both cores write, and one a
    // row made nearly 90 % of a 256-token prompt's claims
    auto rows_in_claims = [&](int64_t n, const std::function<void(int64_t, int)>& f) {
      pool_->run((n + kRowsPerClaim - 1) / kRowsPerClaim, [&](int64_t c, int w) {
        for (int64_t t = c * kRowsPerClaim; t < std::min(n, (c + 1) * kRowsPerClaim); ++t) f(t, w);
      });
    };
    // Norm (optional) and quantize the T rows of src for matmul mi; a narrow row's outlier columns go to xo and
    // are zeroed where the row is quantized from (the norm's scratch row, or src itself: without a norm src is the
    // attention output or the SwiGLU product, read by nothing after this matmul).
    const bool any_narrow = std::find(wide.begin(), wide.end(), 0) != wide.end();
    std::vector<float> xo(any_narrow ? T * kMaxOutliers : 0);
    auto prep = [&](const float* src, int64_t K, const float* norm_w, int64_t mi) -> qg::Act {
      const std::vector<int64_t>* cols = mi < (int64_t)outliers_.size() ? &outliers_[mi].cols : nullptr;
      auto one = [&](int64_t t, int w) {
        float* row = const_cast<float*>(src) + t * K;
        if (norm_w) {
          rms_norm_row(row, norm_w, K, eps_, rows[w].row.data());
          row = rows[w].row.data();
        }
        if (calibrating_)
          for (int64_t c = 0; c < K; ++c) col_amax_[mi][c] = std::max(col_amax_[mi][c], std::fabs(row[c]));
        if (!wide[t] && cols)
          for (size_t j = 0; j < cols->size(); ++j) {
            xo[t * kMaxOutliers + j] = row[(*cols)[j]];
            row[(*cols)[j]] = 0.f;
          }
        act_q.quantize(row, t, K, wide[t]);
      };
      if (Tn < kSplitRows || calibrating_)
        for (int64_t t = 0; t < Tn; ++t) one(t, 0);
      else
        rows_in_claims(Tn, one);
      qg::Act a = act_q.act(Tn, K, wide.data());
      if (any_narrow && cols && !cols->empty())
        a.out = {xo.data(), outliers_[mi].w.data(), (int64_t)cols->size(), (int64_t)kMaxOutliers};
      return a;
    };
    // y (+)= a W^T over every supertile, shared out in chunks of supertiles and, for a prompt's many rows, of rows too
    // (a matmul of 9 supertiles on 2 threads would otherwise wait on the one with 5). Narrow rows' outlier columns
    // ride in a.out (prep), added by the kernel; then(sa, sz, t0, t1) finishes a chunk.
    auto matmul = [&](const qg::Act& a, int64_t mi, float* y, qg::Out out,
                      const std::function<void(int64_t, int64_t, int64_t, int64_t)>& then) {
      if (Tn == 0) return;
      const QMat& m = mats_[mi];
      const int64_t S = qg::supertiles(m.N), per = std::max<int64_t>(1, S / (kChunksPerWorker * W));
      const int64_t cols = (S + per - 1) / per, want = kChunksPerWorker * W;
      // row blocks: a multiple of 8 rows (the narrow kernel's tile), at least kMinRowBlock, enough chunks in all
      const int64_t blocks =
          W > 1 && cols < want ? std::max<int64_t>(1, std::min((want + cols - 1) / cols, Tn / kMinRowBlock)) : 1;
      const int64_t rb = blocks == 1 ? Tn : ((Tn + blocks - 1) / blocks + 7) / 8 * 8;
      const int64_t nrb = (Tn + rb - 1) / rb;
      const qg::Packed w = m.packed();
      const int64_t ldy = out == qg::kGlu ? m.N / 2 : m.N;
      pool_->run(cols * nrb, [&](int64_t c, int) {
        const int64_t sa = (c / nrb) * per, sz = std::min(S, sa + per), t0 = (c % nrb) * rb, t1 = std::min(Tn, t0 + rb);
        qg::gemm(a.rows(t0, t1), w, m.N, sa, sz, y + t0 * ldy, ldy, out);
        if (then) then(sa, sz, t0, t1);
      });
    };

    pool_->begin_step();
    for (int64_t t = 0; t < T; ++t) std::memcpy(xp + t * h_, emb + idp[t] * h_, h_ * sizeof(float));

    std::chrono::steady_clock::time_point tick{};  // read only while timing
    auto mark = [&](int phase) {                   // the time since the last mark goes to `phase`
      if (!timing_) return;
      const auto t = std::chrono::steady_clock::now();
      phase_s_[phase] += std::chrono::duration<double>(t - tick).count();
      tick = t;
    };
    if (timing_) ++timed_steps_, tick = std::chrono::steady_clock::now();
    for (int64_t l = 0; l < L_; ++l) {
      char* kc = (char*)kv.data_ptr() + 2 * l * pool * esize;
      char* vc = kc + pool * esize;
      // qkv = norm(x) Wqkv^T (+ bias)
      const float* bias = biases_[l].numel() ? biases_[l].data_ptr<float>() : nullptr;
      matmul(prep(xp, h_, norms_[2 * l].data_ptr<float>(), 4 * l), 4 * l, qkvp, qg::kStore,
             [&](int64_t sa, int64_t sz, int64_t t0, int64_t t1) {
               if (!bias) return;
               for (int64_t t = t0; t < t1; ++t)
                 for (int64_t c = sa * 64; c < std::min(sz * 64, qkv_n); ++c) qkvp[t * qkv_n + c] += bias[c];
             });
      mark(0);
      // RoPE on q and k heads; k and v into the pool as it stores them (slot -1: padding, not stored)
      auto rope_store = [&](int64_t t) {
        float* row = qkvp + t * qkv_n;
        const float* c = cs + pos[t] * cs_stride;
        for (int64_t hh = 0; hh < H_ + Hkv_; ++hh) rotate(row + hh * D_, c, half);
        if (slp[t] < 0) return;
        const int64_t at = slp[t] * Hkv_ * rd;  // element offset of the slot's rows
        const float* k = row + H_ * D_;
        const float* v = row + (H_ + Hkv_) * D_;
        auto store = [&](auto* pool_k, auto* pool_v) {
          attn::store_heads(pool_k + at, k, Hkv_, D_);
          attn::store_heads(pool_v + at, v, Hkv_, D_);
        };
        switch (kind) {
          case attn::Kind::f16: store((uint16_t*)kc, (uint16_t*)vc); break;
          case attn::Kind::i8: store((int8_t*)kc, (int8_t*)vc); break;
          default: store((float*)kc, (float*)vc); break;
        }
      };
      rows_in_claims(T, [&](int64_t t, int) { rope_store(t); });
      mark(1);
      if (l == L_ - 1 && prune) {
        // The last layer's KV is stored; past it only the rows whose final hidden state is read go on (llama.cpp's
        // inp_out_ids): the others' attention, o and MLP outputs would reach nothing. Rows move up in place
        // (outs ascending), with their kind and keys, and are computed exactly as in place.
        Tn = outs.size();
        std::vector<attn::Keys> kept(Tn);
        std::vector<uint8_t> kept_blocked(Tn);
        for (int64_t i = 0; i < Tn; ++i) {
          const int64_t t = outs[i];
          if (t != i) {
            std::memcpy(qkvp + i * qkv_n, qkvp + t * qkv_n, qkv_n * sizeof(float));
            std::memcpy(xp + i * h_, xp + t * h_, h_ * sizeof(float));
          }
          wide[i] = wide[t];
          kept[i] = keys[t];
          kept_blocked[i] = blocked[t];
        }
        keys_now = std::move(kept);
        plan_last = plan_attention(keys_now, kept_blocked, G);
        plan_now = &plan_last;
        to_merge.clear();
        for (int64_t t = 0; t < Tn; ++t)
          if (!plan_last.direct[t]) to_merge.push_back(t);
      }
      // attention: chunk partials per token, then merged per (token, kv head) into its G heads' outputs
      const attn::Cache cache{kc, vc, page, Hkv_, D_, kind};
      pool_->run(plan_now->work.size(), [&](int64_t i, int w) {
        attend(*plan_now, plan_now->work[i], keys_now.empty() ? keys : keys_now, qkvp, qkv_n, G, scale, cache,
               scores[w].data(), parts.data(), part, ap);
      });
      mark(2);
      auto merge = [&](int64_t i, int) {  // i = (index into to_merge) * Hkv + kv head
        merge_row(*plan_now, parts.data(), part, to_merge[i / Hkv_], i % Hkv_, H_, G, D_, ap);
      };
      const int64_t n_merge = (int64_t)to_merge.size() * Hkv_;
      if ((int64_t)to_merge.size() < kSplitRows)
        for (int64_t i = 0; i < n_merge; ++i) merge(i, 0);
      else
        pool_->run(n_merge, merge);
      mark(3);
      // x += attn Wo^T
      matmul(prep(ap, H_ * D_, nullptr, 4 * l + 1), 4 * l + 1, xp, qg::kAdd, nullptr);
      mark(4);
      // act = silu(gate) * up in the kernel's store (gate/up rows interleaved by 32: qg::kGlu)
      matmul(prep(xp, h_, norms_[2 * l + 1].data_ptr<float>(), 4 * l + 2), 4 * l + 2, actp, qg::kGlu, nullptr);
      mark(5);
      // x += act Wdown^T
      matmul(prep(actp, I_, nullptr, 4 * l + 3), 4 * l + 3, xp, qg::kAdd, nullptr);
      mark(6);
      if (aux_slot[l] >= 0)
        for (int64_t t = 0; t < T; ++t)
          std::memcpy(aux.data_ptr<float>() + t * n_aux * h_ + aux_slot[l] * h_, xp + t * h_, h_ * sizeof(float));
    }
    if (prune) hidden.zero_();  // rows not in out_rows: zeros
    for (int64_t t = 0; t < Tn; ++t)
      rms_norm_row(xp + t * h_, final_norm_.data_ptr<float>(), h_, eps_,
                   hidden.data_ptr<float>() + (prune ? outs[t] : t) * h_);
    pool_->end_step();
    if (n_aux) return {hidden, aux};
    return {hidden};
  }

  // (R, h) final hidden states -> (R, vocab) logits through the packed head.
  torch::Tensor logits(torch::Tensor hidden) {
    hidden = hidden.contiguous();
    TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == h_ && hidden.scalar_type() == torch::kFloat,
                "Decoder.logits: hidden must be (R, hidden) fp32");
    const int64_t R = hidden.size(0), V = head_.N;
    auto y = torch::empty({R, V}, hidden.options());
    Buf b;
    b.reserve(R, h_);
    for (int64_t r = 0; r < R; ++r) b.quantize(hidden.data_ptr<float>() + r * h_, r, h_, true);
    const qg::Act a = b.act(R, h_, nullptr);
    const int64_t S = qg::supertiles(V), per = std::max<int64_t>(1, S / (kChunksPerWorker * pool_->workers()));
    float* yp = y.data_ptr<float>();
    pool_->run((S + per - 1) / per, [&](int64_t c, int) {
      qg::gemm(a, head_.packed(), V, c * per, std::min(S, c * per + per), yp, V, qg::kStore);
    });
    return y;
  }

 private:
  // The keys each token's query sees (attn::Keys), from the step's attention metadata.
  std::vector<attn::Keys> tokens(int64_t T, int64_t nd, const c10::optional<torch::Tensor>& dec_tables,
                                 const c10::optional<torch::Tensor>& dec_lens,
                                 const c10::optional<torch::Tensor>& ext_tables,
                                 const c10::optional<torch::Tensor>& ext_cu,
                                 const c10::optional<torch::Tensor>& ext_lens,
                                 const c10::optional<torch::Tensor>& tree_mask,
                                 const c10::optional<torch::Tensor>& tree_prefix, int64_t blocks,
                                 std::vector<torch::Tensor>& keep) {
    std::vector<attn::Keys> keys(T);
    auto hold = [&](const torch::Tensor& t) {
      keep.push_back(t.contiguous());
      return keep.back();
    };
    auto table = [&](const torch::Tensor& t) {  // a block table, every entry checked against the pool
      const auto& tb = hold(t);
      const int32_t* p = tb.data_ptr<int32_t>();
      for (int64_t i = 0; i < tb.numel(); ++i)
        TORCH_CHECK(p[i] >= 0 && p[i] < blocks, "Decoder: a block table names block ", p[i], " of ", blocks);
      return tb;
    };
    if (nd > 0) {
      TORCH_CHECK(dec_tables.has_value() && dec_lens.has_value(), "Decoder: decode rows need tables and lengths");
      auto tb = table(*dec_tables);
      auto ln = hold(*dec_lens);
      for (int64_t b = 0; b < nd; ++b) {
        keys[b].table = tb.data_ptr<int32_t>() + b * tb.size(1);
        keys[b].plain = ln.data_ptr<int32_t>()[b];  // 0: a padding row, attends to nothing
      }
    }
    if (nd == T) return keys;
    TORCH_CHECK(ext_tables.has_value() && ext_cu.has_value(), "Decoder: extend rows need tables and cu_seqlens");
    auto tb = table(*ext_tables);
    auto cu = hold(*ext_cu);
    const int32_t* cup = cu.data_ptr<int32_t>();
    const int64_t B = cu.size(0) - 1;
    TORCH_CHECK(nd + cup[B] == T, "Decoder: cu_seqlens do not cover the step's tokens");
    if (tree_mask.has_value()) {  // node j of sequence e: the prefix, then the nodes its mask row allows
      TORCH_CHECK(nd == 0 && tree_prefix.has_value(), "Decoder: a tree step has only tree rows and their prefixes");
      auto mk = hold(*tree_mask);
      auto pf = hold(*tree_prefix);
      const int64_t width = mk.size(1);
      for (int64_t e = 0; e < B; ++e) {
        const int32_t prefix = pf.data_ptr<int32_t>()[e];
        for (int32_t j = cup[e]; j < cup[e + 1]; ++j) {
          attn::Keys& k = keys[j];
          k.table = tb.data_ptr<int32_t>() + e * tb.size(1);
          k.plain = prefix;
          const bool* row = mk.data_ptr<bool>() + j * width;
          for (int32_t n = 0; n < cup[e + 1] - cup[e]; ++n)
            if (row[n]) k.extra.push_back(prefix + n);
        }
      }
      return keys;
    }
    TORCH_CHECK(ext_lens.has_value(), "Decoder: extend rows need their lengths");
    auto ln = hold(*ext_lens);
    for (int64_t e = 0; e < B; ++e) {
      const int32_t n = cup[e + 1] - cup[e], total = ln.data_ptr<int32_t>()[e];
      for (int32_t j = 0; j < n; ++j) {  // causal: token j of the chunk sees the cache and chunk tokens <= j
        keys[nd + cup[e] + j].table = tb.data_ptr<int32_t>() + e * tb.size(1);
        keys[nd + cup[e] + j].plain = total - n + j + 1;
      }
    }
    return keys;
  }

  float eps_;
  int64_t h_, H_, Hkv_, D_, I_, L_;
  torch::Tensor embed_, cos_sin_, final_norm_;
  std::vector<torch::Tensor> norms_, biases_;
  std::vector<QMat> mats_;
  QMat head_;
  std::unique_ptr<cpupool::Pool> pool_;
  bool timing_ = false;
  std::array<double, 7> phase_s_{};
  int64_t timed_steps_ = 0;
  // Narrow rows' outlier columns per matmul (4 a layer): their values leave the int8 blocks and meet the
  // exact weight columns in fp32, w[((n / 16) n_cols + j) 16 + n % 16] = W[n, cols[j]] (each 16 outputs' weights
  // in one run: rows of (n_cols, N) would be 4 KB multiples apart and share L1 sets). col_amax_: each matmul
  // input's largest |x| per column while calibrating (every row of every step so far).
  struct Outliers {
    std::vector<int64_t> cols;
    std::vector<float> w;
  };
  std::vector<Outliers> outliers_;
  bool calibrating_ = false;
  std::vector<std::vector<float>> col_amax_;
};

// Attention of nq consecutive prompt tokens of one sequence over one layer's pool, on the calling thread (tests and
// benches of the step's two kernels): q (nq, H, D) fp32; k, v (blocks, page, Hkv, D) fp16 or fp32, or int8 (..., D +
// 4); table: the sequence's blocks (int32); token i sees keys [0, plain0 + i). blocked: the kernel of the step's narrow
// rows (attn::block_any), else the one-token kernel. Returns (nq, H, D).
torch::Tensor prompt_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor table, int64_t plain0,
                               bool blocked) {
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  table = table.contiguous();
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && k.sizes() == v.sizes() && q.scalar_type() == torch::kFloat,
              "prompt_attention: q (nq, H, D) fp32, k and v (blocks, page, Hkv, D)");
  const int64_t nq = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(2), page = k.size(1);
  const attn::Kind kind = pool_kind(k.scalar_type());
  TORCH_CHECK((D == 16 || D == 32 || D == 64 || D == 128) && H % Hkv == 0 && (page & (page - 1)) == 0 &&
                  k.size(3) == (kind == attn::Kind::i8 ? D + attn::kScaleBytes : D) &&
                  table.scalar_type() == torch::kInt && table.numel() * page >= plain0 + nq - 1,
              "prompt_attention: shapes do not match");
  for (int64_t i = 0; i < table.numel(); ++i)
    TORCH_CHECK(table.data_ptr<int32_t>()[i] >= 0 && table.data_ptr<int32_t>()[i] < k.size(0),
                "prompt_attention: the table names a block past the pool");
  std::vector<attn::Keys> keys(nq);
  for (int64_t i = 0; i < nq; ++i) {
    keys[i].table = table.data_ptr<int32_t>();
    keys[i].plain = plain0 + i;
  }
  const int64_t G = H / Hkv, part = H * (D + 2);
  const AttentionPlan plan = plan_attention(keys, std::vector<uint8_t>(nq, blocked), G);
  std::vector<float> scratch(std::max(H * attn::kChunk, plan.block_scratch(H, D)));
  std::vector<float> parts(plan.first[nq] * part);
  const attn::Cache cache{k.data_ptr(), v.data_ptr(), page, Hkv, D, kind};
  auto out = torch::empty_like(q);
  for (const Work& w : plan.work)
    attend(plan, w, keys, q.data_ptr<float>(), H * D, G, 1.f / std::sqrt((float)D), cache, scratch.data(), parts.data(),
           part, out.data_ptr<float>());
  for (int64_t t = 0; t < nq; ++t)
    for (int64_t kh = 0; kh < Hkv && !plan.direct[t]; ++kh)
      merge_row(plan, parts.data(), part, t, kh, H, G, D, out.data_ptr<float>());
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Decoder>(m, "Decoder")
      .def(pybind11::init<std::vector<int64_t>, double, torch::Tensor, torch::Tensor, torch::Tensor,
                          std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<int64_t>, torch::Tensor, int64_t, int64_t>())
      .def("forward", &Decoder::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("logits", &Decoder::logits, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("threads", &Decoder::threads)
      .def("pool_stats", &Decoder::pool_stats)
      .def("set_timing", &Decoder::set_timing)
      .def("phase_ms", &Decoder::phase_ms)
      .def("set_calibration", &Decoder::set_calibration)
      .def("column_amax", &Decoder::column_amax)
      .def("set_outliers", &Decoder::set_outliers);
  m.def("prompt_attention", &prompt_attention);
  m.def("solo_would_win", &cpupool::Pool::solo_would_win);
  m.attr("block_bf16") = attn::kBlockBf16;
}
