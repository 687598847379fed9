// Splitting a kernel's work between the calling thread and the threads of XLA's intra-op pool
// (shared by cpu_matmul.cc and cpu_quantized.cc).
//
// Parts are claimed from an atomic counter by the calling thread and by helpers on the pool; the
// caller claims what no helper has started, so it never waits for a helper that is queued behind
// busy threads (no deadlock when the pool is busy), and a helper that comes after every part is
// claimed has nothing to do. A call's state is shared, so it outlives the call.
//
// Helpers linger. Waking a sleeping pool thread takes longer on a VM than a part of a decode
// step's product takes (~10-40 us), so the caller often ran every part itself: a helper spins for
// linger_ns() after its last part, watching the board where each call posts its parts, and the
// next call finds it awake (a call schedules a new helper only when none lingers). A lingering
// helper holds its pool thread and a core for at most that long past the last product.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>  // std::this_thread::yield
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace eejax {

constexpr int64_t kMaxParts = 8;
constexpr int kSpins = 2000;  // pauses before a waiting caller sleeps (~10-50 us)
// How long a helper lingers: $EEJAX_CPU_LINGER_US microseconds (default 200; 0: helpers return at
// once, for a machine whose cores other processes need), read once.
inline int64_t linger_ns() {
  static const int64_t ns = [] {
    const char* text = std::getenv("EEJAX_CPU_LINGER_US");
    return text && *text ? std::max<int64_t>(0, std::atoll(text)) * 1000 : int64_t(200'000);
  }();
  return ns;
}

inline void pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

// The number of parts for `units` of work on `pool`: one per thread, at most kMaxParts and `units`.
inline int64_t num_parts(xla::ffi::ThreadPool& pool, int64_t units) {
  return std::clamp<int64_t>(std::max<int64_t>(1, pool.num_threads()), 1, std::min<int64_t>(kMaxParts, units));
}

// One call's parts.
struct Call {
  int64_t parts = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  virtual ~Call() = default;
  virtual void run(int64_t i) = 0;

  void claim() {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < parts;) {
      run(i);
      done.fetch_add(1, std::memory_order_release);
      done.notify_all();  // no system call unless the caller sleeps
    }
  }
};

// Where calls post their parts for lingering helpers.
struct Board {
  std::mutex mutex;
  std::shared_ptr<Call> call;        // the latest call (guarded by mutex)
  std::atomic<uint64_t> posted{0};   // calls posted so far
  std::atomic<int64_t> lingering{0};  // helpers spinning on the board

  void post(std::shared_ptr<Call> c) {
    std::lock_guard<std::mutex> lock(mutex);
    call = std::move(c);
    posted.fetch_add(1, std::memory_order_release);
  }

  std::shared_ptr<Call> latest() {
    std::lock_guard<std::mutex> lock(mutex);
    return call;
  }

  // A helper: claims the latest call's parts, then every later call's, until none came for kLingerNs.
  void help() {
    lingering.fetch_add(1, std::memory_order_acq_rel);
    uint64_t seen = posted.load(std::memory_order_acquire);
    if (auto c = latest()) c->claim();
    auto quiet_since = std::chrono::steady_clock::now();
    for (int64_t spins = 0;; ++spins) {
      const uint64_t now_posted = posted.load(std::memory_order_acquire);
      if (now_posted != seen) {
        seen = now_posted;
        if (auto c = latest()) c->claim();
        quiet_since = std::chrono::steady_clock::now();
        continue;
      }
      pause();
      if (spins % 64 == 0 && std::chrono::steady_clock::now() - quiet_since > std::chrono::nanoseconds(linger_ns()))
        break;
    }
    lingering.fetch_sub(1, std::memory_order_acq_rel);
  }
};

// Never destroyed: a helper may still be lingering on it while the process exits.
inline Board& board = *new Board;

// Runs run(i) for every part i in [0, parts), on this thread and the pool's, and returns when all
// have run.
template <typename Run>
void run_parts(xla::ffi::ThreadPool& pool, int64_t parts, Run run) {
  struct Parts : Call {
    Run fn;
    explicit Parts(Run r) : fn(std::move(r)) {}
    void run(int64_t i) override { fn(i); }
  };
  auto call = std::make_shared<Parts>(std::move(run));
  call->parts = parts;
  if (parts > 1) {
    board.post(call);
    for (int64_t i = board.lingering.load(std::memory_order_acquire); i < parts - 1; ++i)
      pool.Schedule([] { board.help(); });
  }
  call->claim();
  // Every part is claimed: wait for those other threads are running. Spin briefly (a part takes
  // microseconds), then sleep on the counter, so that a caller whose helper was preempted (more
  // threads than cores: another process, test workers) gives its core back instead of spinning.
  for (int spins = 0; spins < kSpins && call->done.load(std::memory_order_acquire) < parts; ++spins) pause();
  for (int64_t seen; (seen = call->done.load(std::memory_order_acquire)) < parts;) call->done.wait(seen);
}

}  // namespace eejax
