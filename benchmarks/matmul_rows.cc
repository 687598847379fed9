// What a few-row float32 product costs per row of x (a verify pass's positions) in the library's
// loops (cpu_matmul.cc's `nn_block` and `nt_block`, included, so the loops timed are the
// library's): a layer of SmolLM2-135M's five products (576 x 576, 576 x 384, 576 x 576,
// 576 x 3072, 1536 x 576) over 30 layers, and its LM head (x @ w^T, 49152 x 576) three times,
// the weights in DRAM (~440 MB and ~340 MB), both halves of each product (split K, or split N for
// the head, as the library's two parts) on two threads. Prints each M's time against M = 1, the
// best of --repeats alternating runs. Built and run by matmul_rows.py.
#include KERNEL_SOURCE

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <thread>
#include <utility>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

// One helper thread that runs the second half of each product while the caller runs the first.
class Pair {
 public:
  Pair() : helper_([this] { serve(); }) {}
  ~Pair() {
    epoch_.store(-1, std::memory_order_release);
    helper_.join();
  }
  template <typename F>
  void run(F first, std::function<void()> second) {
    job_ = std::move(second);
    const long e = ++posted_;
    epoch_.store(e, std::memory_order_release);
    first();
    while (done_.load(std::memory_order_acquire) != e) __builtin_ia32_pause();
  }

 private:
  void serve() {
    for (long seen = 0;;) {
      long e;
      while ((e = epoch_.load(std::memory_order_acquire)) == seen) __builtin_ia32_pause();
      if (e < 0) return;
      seen = e;
      job_();
      done_.store(e, std::memory_order_release);
    }
  }
  std::function<void()> job_;
  long posted_ = 0;
  std::atomic<long> epoch_{0}, done_{0};
  std::thread helper_;
};

std::vector<float> random_floats(size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-0.5f, 0.5f);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  const int repeats = argc > 1 ? std::atoi(argv[1]) : 6;
  const std::pair<int64_t, int64_t> shapes[] = {{576, 576}, {576, 384}, {576, 576}, {576, 3072}, {1536, 576}};
  const int layers = 30, heads = 3;
  const int64_t vocab = 49152, hidden = 576;
  std::mt19937 rng(0);
  std::vector<std::vector<float>> layer_weights, head_weights;
  for (int l = 0; l < layers; ++l)
    for (auto [K, N] : shapes) layer_weights.push_back(random_floats(size_t(K * N), rng));
  for (int h = 0; h < heads; ++h) head_weights.push_back(random_floats(size_t(vocab * hidden), rng));
  const std::vector<float> x = random_floats(8 * 1536, rng);
  std::vector<float> y(8 * vocab), partial(8 * 3072);
  Pair pair;
  const int rows[] = {1, 2, 3, 4, 5, 6, 8};
  double layer_s[9], head_s[9];
  std::fill(layer_s, layer_s + 9, 1e9);
  std::fill(head_s, head_s + 9, 1e9);
  for (int rep = 0; rep < repeats; ++rep)
    for (int M : rows) {
      const Blocks<float>& f = kBlocks<float>[M - 1];
      auto start = Clock::now();
      for (size_t i = 0; i < layer_weights.size(); ++i) {
        const auto [K, N] = shapes[i % 5];
        const float* w = layer_weights[i].data();
        pair.run([&] { f.nn(x.data(), w, y.data(), K, N, 0, K / 2, 0, N); },
                 [&] { f.nn(x.data(), w, partial.data(), K, N, K / 2, K, 0, N); });
        for (int64_t j = 0; j < M * N; ++j) y[j] += partial[j];
      }
      layer_s[M] = std::min(layer_s[M], std::chrono::duration<double>(Clock::now() - start).count());
      start = Clock::now();
      for (const auto& head : head_weights) {
        const float* w = head.data();
        pair.run([&] { f.nt(x.data(), w, y.data(), hidden, vocab, 0, vocab / 2); },
                 [&] { f.nt(x.data(), w, y.data(), hidden, vocab, vocab / 2, vocab); });
      }
      head_s[M] = std::min(head_s[M], std::chrono::duration<double>(Clock::now() - start).count());
    }
  std::printf("| products | M = 1 | 2 | 3 | 4 | 5 | 6 | 8 |\n|---|---|---|---|---|---|---|---|\n");
  const std::pair<const char*, double*> lines[] = {{"a layer's five, x 30", layer_s}, {"LM head, x 3", head_s}};
  for (auto [name, s] : lines) {
    std::printf("| %s (M = 1: %.2f ms, %.1f GB/s) |", name, s[1] * 1e3,
                (s == layer_s ? 4.0 * 3538944 * layers : 4.0 * vocab * hidden * heads) / s[1] / 1e9);
    for (int M : rows) std::printf(" %.2f |", s[M] / s[1]);
    std::printf("\n");
  }
  return 0;
}
