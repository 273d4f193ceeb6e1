// A work-claiming thread pool for the C++ CPU step (included by cpu_forward.cpp).
//
// On a machine whose cores other processes also use (the API process once per token,
// other services), a static split with barriers (OpenMP's `parallel for`) is as slow
// as its most-descheduled thread: every barrier waits for it. Here the caller and
// the helpers *claim* chunks of a phase from an atomic counter, and the caller waits
// only for chunks a helper has already claimed, never for a helper to show up. With
// a core taken away, a step degrades to one thread's speed instead of stalling.
//
// Helpers spin briefly for the next phase (phases of a step follow each other within
// microseconds), then yield the core, then sleep on a condition variable until the
// next step: between steps they leave the cores to the API process.
//
// Helpers pay only when they get a core. The caller marks each step (`begin_step`,
// `end_step`) and judges it (`solo_would_win`): a step where the helpers did under a
// fifth of the chunks, or that the caller alone would have finished sooner (its own
// chunks' time, scaled to all the chunks, under 90 % of the step: a helper held its
// chunks while descheduled), is followed by steps on the caller alone (the helpers
// sleep, the cores go to whoever needs them): 4, then 8, ... up to 256 steps while the
// probes keep failing. On a crowded machine a step thus runs at one thread's speed,
// never below. A helper that lost its core for a while but still did its share keeps
// the steps on both (the caller waiting over a quarter of a step used to send it solo:
// beside a proxy and 16 streaming clients, that was most steps, each far slower alone).

#pragma once

#include <immintrin.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace cpupool {

class Pool {
 public:
  // helpers: threads besides the caller's own.
  explicit Pool(int helpers) {
    for (int i = 0; i < helpers; ++i) threads_.emplace_back([this, i] { loop(i + 1); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(m_);
      stop_.store(true);
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  int workers() const { return (int)threads_.size() + 1; }

  // Around every step: whether the helpers earned their keep decides the next steps' mode.
  void begin_step() {
    ++steps_;
    solo_ = solo_left_ > 0;
    if (solo_) ++solo_steps_;
    if (solo_) --solo_left_;
    chunks_ = helper_chunks_.load();
    step_chunks_ = 0;
    waited_ns_ = 0;
    step_t0_ = std::chrono::steady_clock::now();
  }
  void end_step() {
    if (threads_.empty() || solo_ || step_chunks_ < 8) return;  // one thread: nothing to judge
    const int64_t helped = helper_chunks_.load() - chunks_;
    const int64_t wall =
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - step_t0_).count();
    if (solo_would_win(step_chunks_, helped, wall, waited_ns_)) {
      solo_left_ = backoff_;
      backoff_ = std::min<int64_t>(256, 2 * backoff_);
    } else {
      backoff_ = 4;
    }
  }
  // A step on caller and helpers, judged afterwards: `chunks` in all, `helped` of them by the helpers, `wall_ns` long,
  // `waited_ns` of it the caller waiting for chunks a helper held. The caller was busy wall - waited for its
  // chunks - helped, so alone it would have taken about (wall - waited) chunks / (chunks - helped).
  static bool solo_would_win(int64_t chunks, int64_t helped, int64_t wall_ns, int64_t waited_ns) {
    if (5 * helped < chunks) return true;  // the helpers barely showed up: their cores are someone else's
    const double alone = double(wall_ns - waited_ns) * double(chunks) / double(std::max<int64_t>(1, chunks - helped));
    return alone < 0.9 * double(wall_ns);
  }
  bool solo() const { return solo_; }
  int64_t steps() const { return steps_; }
  int64_t solo_steps() const { return solo_steps_; }

  // f(chunk, worker) for chunk in [0, n); worker 0 is the caller. Returns when every chunk is done.
  void run(int64_t n, const std::function<void(int64_t, int)>& f) {
    step_chunks_ += n;
    if (threads_.empty() || n <= 1 || solo_) {
      for (int64_t c = 0; c < n; ++c) f(c, 0);
      return;
    }
    const uint64_t tag = ++tag_;
    jobs_[tag % kSlots] = {&f, n};
    done_.store(0, std::memory_order_relaxed);
    next_.store(tag << 32, std::memory_order_seq_cst);  // publishes the job (seq_cst: then reads sleeping_)
    if (sleeping_.load(std::memory_order_acquire) > 0) {
      std::lock_guard<std::mutex> lk(m_);
      cv_.notify_all();
    }
    work(0);
    if (done_.load(std::memory_order_acquire) < n) {
      const auto t0 = std::chrono::steady_clock::now();
      while (done_.load(std::memory_order_acquire) < n) _mm_pause();
      waited_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    }
  }

 private:
  struct Job {
    const std::function<void(int64_t, int)>* f;
    int64_t n;
  };
  static constexpr uint64_t kSlots = 4;

  // Claim chunks of the current job until none is left. A claim is a CAS on (job tag, index):
  // it succeeds only while that job is current, so the job's slot read before it is valid.
  void work(int worker) {
    for (;;) {
      uint64_t v = next_.load(std::memory_order_acquire);
      Job job;
      do {
        job = jobs_[(v >> 32) % kSlots];
        if ((int64_t)(v & 0xffffffffu) >= job.n) return;
      } while (!next_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel, std::memory_order_acquire));
      (*job.f)((int64_t)(v & 0xffffffffu), worker);
      if (worker) helper_chunks_.fetch_add(1, std::memory_order_relaxed);
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  bool fresh(uint64_t seen) const {  // a job newer than `seen` has chunks left
    const uint64_t v = next_.load(std::memory_order_acquire);
    return (v >> 32) != seen && (int64_t)(v & 0xffffffffu) < jobs_[(v >> 32) % kSlots].n;
  }

  void loop(int worker) {
    using clock = std::chrono::steady_clock;
    uint64_t seen = 0;
    while (!stop_.load()) {
      const auto t0 = clock::now();
      int64_t spins = 0;
      while (!fresh(seen) && !stop_.load()) {
        if (++spins < 4000) {  // tens of microseconds: the step's next phase
          _mm_pause();
          continue;
        }
        if (clock::now() - t0 < std::chrono::microseconds(300)) {  // its Python part
          sched_yield();
          continue;
        }
        std::unique_lock<std::mutex> lk(m_);  // between steps: sleep, the cores are the API process's
        sleeping_.fetch_add(1);
        cv_.wait_for(lk, std::chrono::milliseconds(50), [&] { return fresh(seen) || stop_.load(); });
        sleeping_.fetch_sub(1);
        break;
      }
      seen = next_.load(std::memory_order_acquire) >> 32;
      work(worker);
    }
  }

  std::vector<std::thread> threads_;
  std::mutex m_;
  std::condition_variable cv_;
  std::atomic<int> sleeping_{0};
  std::atomic<bool> stop_{false};
  uint64_t tag_ = 0;  // the caller's job count
  // adaptive mode (caller only)
  bool solo_ = false;
  int64_t solo_left_ = 0, backoff_ = 4, chunks_ = 0, step_chunks_ = 0, waited_ns_ = 0, steps_ = 0, solo_steps_ = 0;
  std::chrono::steady_clock::time_point step_t0_;
  std::atomic<int64_t> helper_chunks_{0};
  Job jobs_[kSlots] = {};
  alignas(64) std::atomic<uint64_t> next_{0};
  alignas(64) std::atomic<int64_t> done_{0};
};

}  // namespace cpupool
