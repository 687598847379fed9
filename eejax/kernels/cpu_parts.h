// Splitting a kernel's work between the calling thread and the threads of XLA's intra-op pool
// (shared by cpu_matmul.cc and cpu_quantized.cc).
//
// Parts are claimed from an atomic counter by the calling thread and by helpers on the pool; the
// caller claims what no helper has started, so it never waits for a helper that is queued behind
// busy threads (no deadlock when the pool is busy), and a helper that comes after every part is
// claimed has nothing to do. The counter lives on a board that outlives every call, so a late
// helper's claim is safe after the call returned.
//
// Helpers linger. Waking a sleeping pool thread takes longer on a VM than a part of a decode
// step's product takes (~10-40 us), so the caller often ran every part itself: a helper spins for
// linger_ns() after its last part, watching the board where each call posts its parts, and the
// next call finds it awake. A lingering helper holds its pool thread and a core for at most that
// long past the last product.
//
// Helpers are counted from when they are scheduled, not from when they start: at most parts - 1
// (the pool's threads less the caller's) are scheduled or lingering at once. Counted from their
// start, a call that came before its helper started scheduled another, two helpers could spin
// beside the caller on two cores, and the caller lost its core for a scheduler's slice (traced:
// a 4.6 ms stall in a 135M decode step, its next layers at half speed); counted from their
// schedule, decode programs ran 4-9% faster (medians of alternating runs, 2 cores).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
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

// One call's work: run(i) runs part i. It lives on the caller's stack; a helper reaches it only
// through a part it claimed, and the caller returns only when every claimed part has run.
struct Call {
  virtual void run(int64_t i) = 0;

 protected:
  ~Call() = default;
};

// Where a call posts its parts for lingering helpers: one ticket word that a part is claimed from
// by one atomic add, so a helper's pickup touches the ticket's cache line and the call, nothing
// else (no lock, no reference count, no allocation). One call at a time owns the board; a call
// that finds it owned (two kernels running at once, or a part that splits its own work) runs its
// parts on its own thread.
struct Board {
  // Bits [32, 64): the call's number; [16, 32): its parts; [0, 16): the next part to claim. Adds
  // past the last part are harmless: a call's parts are claimed once each, whoever adds.
  alignas(64) std::atomic<uint64_t> ticket{0};
  std::atomic<Call*> call{nullptr};  // the call the ticket numbers (set before the ticket)
  // Bits [32, 64): the call's number; [0, 32): the parts helpers have finished.
  alignas(64) std::atomic<uint64_t> done{0};
  alignas(64) std::atomic<bool> owned{false};
  std::atomic<int64_t> helpers{0};  // helpers scheduled on the pool or spinning on the board
  uint64_t calls = 0;                 // calls posted so far (written by the owner)

  static int64_t part_of(uint64_t t) { return int64_t(t & 0xffff); }
  static int64_t parts_of(uint64_t t) { return int64_t((t >> 16) & 0xffff); }

  // Posts `parts` parts of c, if no other call owns the board (else false).
  bool post(Call* c, int64_t parts) {
    if (owned.exchange(true, std::memory_order_acquire)) return false;
    const uint64_t number = ++calls;
    done.store(number << 32, std::memory_order_relaxed);
    call.store(c, std::memory_order_relaxed);
    ticket.store(number << 32 | uint64_t(parts) << 16, std::memory_order_release);
    return true;
  }

  // Claims and runs the current call's parts until none is left; the parts it ran (a helper's
  // are counted in `done` as they finish).
  int64_t claim(bool helper) {
    int64_t ran = 0;
    for (uint64_t t; part_of(t = ticket.fetch_add(1, std::memory_order_acq_rel)) < parts_of(t); ++ran) {
      call.load(std::memory_order_acquire)->run(part_of(t));
      if (helper) {
        done.fetch_add(1, std::memory_order_release);
        done.notify_all();  // no system call unless the caller sleeps
      }
    }
    return ran;
  }

  // The owner, after its own claims: waits for the `expected` parts helpers are running, then
  // frees the board. Spins briefly (a part takes microseconds), then sleeps on the counter, so that
  // a caller whose helper was preempted (more threads than cores: another process, test workers)
  // gives its core back instead of spinning.
  void finish(int64_t expected) {
    const auto finished = [](uint64_t d) { return int64_t(d & 0xffffffff); };
    for (int spins = 0; spins < kSpins && finished(done.load(std::memory_order_acquire)) < expected; ++spins) pause();
    for (uint64_t seen; finished(seen = done.load(std::memory_order_acquire)) < expected;) done.wait(seen);
    owned.store(false, std::memory_order_release);
  }

  // A helper: claims the current call's parts, then every later call's, until none came for
  // linger_ns().
  void help() {
    uint64_t seen = ~uint64_t(0);  // the number of the last call looked at
    auto quiet_since = std::chrono::steady_clock::now();
    for (int64_t spins = 0;; ++spins) {
      const uint64_t t = ticket.load(std::memory_order_acquire);
      if (t >> 32 != seen) {
        seen = t >> 32;
        if (part_of(t) < parts_of(t)) claim(/*helper=*/true);
        quiet_since = std::chrono::steady_clock::now();
        continue;
      }
      pause();
      if (spins % 64 == 0 && std::chrono::steady_clock::now() - quiet_since > std::chrono::nanoseconds(linger_ns()))
        break;
    }
    helpers.fetch_sub(1, std::memory_order_acq_rel);
  }

  // Counts one more helper if fewer than `most` are scheduled or lingering (then the caller
  // schedules it).
  bool add_helper(int64_t most) {
    for (int64_t h = helpers.load(std::memory_order_acquire); h < most;)
      if (helpers.compare_exchange_weak(h, h + 1, std::memory_order_acq_rel)) return true;
    return false;
  }
};

// Never destroyed: a helper may still be lingering on it while the process exits.
inline Board& board = *new Board;

// Runs run(i) for every part i in [0, parts), on this thread and the pool's, and returns when all
// have run.
template <typename Run>
void run_parts(xla::ffi::ThreadPool& pool, int64_t parts, Run run) {
  struct Parts final : Call {
    Run& fn;
    explicit Parts(Run& r) : fn(r) {}
    void run(int64_t i) override { fn(i); }
  } call(run);
  if (parts <= 1 || !board.post(&call, parts)) {
    for (int64_t i = 0; i < parts; ++i) run(i);
    return;
  }
  while (board.add_helper(parts - 1)) pool.Schedule([] { board.help(); });
  board.finish(parts - board.claim(/*helper=*/false));
}

}  // namespace eejax
