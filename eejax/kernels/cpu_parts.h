// Splitting a kernel's work between the calling thread and the threads of XLA's intra-op pool
// (shared by cpu_matmul.cc and cpu_quantized.cc).
//
// Parts are claimed from an atomic counter by the calling thread and by the tasks it schedules on
// the pool; the caller claims what no task has started, so it never waits for a task that is
// queued behind busy threads (no deadlock when the pool is busy), and a task that starts after
// every part is claimed returns at once (its state is shared, so it outlives the call).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>  // std::this_thread::yield
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace eejax {

constexpr int64_t kMaxParts = 8;
constexpr int kSpins = 2000;  // pauses before a waiting caller sleeps (~10-50 us)

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

// Runs run(i) for every part i in [0, parts), on this thread and the pool's, and returns when all
// have run.
template <typename Run>
void run_parts(xla::ffi::ThreadPool& pool, int64_t parts, Run run) {
  struct State {
    Run run;
    int64_t parts;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    State(Run r, int64_t p) : run(std::move(r)), parts(p) {}
    void claim() {
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < parts;) {
        run(i);
        done.fetch_add(1, std::memory_order_release);
        done.notify_all();  // no system call unless the caller sleeps
      }
    }
  };
  auto state = std::make_shared<State>(std::move(run), parts);
  for (int64_t i = 1; i < parts; ++i) pool.Schedule([state] { state->claim(); });
  state->claim();
  // Every part is claimed: wait for those other threads are running. Spin briefly (a part takes
  // microseconds), then sleep on the counter, so that a caller whose helper was preempted (more
  // threads than cores: another process, test workers) gives its core back instead of spinning.
  for (int spins = 0; spins < kSpins && state->done.load(std::memory_order_acquire) < parts; ++spins) pause();
  for (int64_t seen; (seen = state->done.load(std::memory_order_acquire)) < parts;) state->done.wait(seen);
}

}  // namespace eejax
