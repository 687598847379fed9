// How close the library's tiled loop (cpu_quantized.cc's `tiled_group`) runs to the core's multiply-add
// bound at several rows of x, where a verify pass and a batch sit. One thread: first this core's peak
// rate of independent `vpdpbusd` (zmm), then the tiled loop over a 65 MB Q4_1 matrix (SmolLM2-135M's
// layers' bytes; 576 values a row) at 1..8 rows of int16 and of int8 x. A row of x costs 16 `vpdpbusd`
// per tile-block with int16 x (high and low byte) and 8 with int8: M rows' count at the peak, against
// the time at M rows, is the fraction of the multiply-add bound the loop reaches (one row: memory-bound). Built and run by
// vnni_bound.py; includes eejax/kernels/cpu_quantized.cc, so the loop timed is the library's.
#include KERNEL_SOURCE

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Independent vpdpbusd per second on this thread: 12 accumulator chains (longer than the latency),
// written out in assembly so that the compiler keeps them in registers.
double vnni_peak() {
  const long n = 100000000;
  const auto start = std::chrono::steady_clock::now();
  asm volatile(
      "vpxord %%zmm0, %%zmm0, %%zmm0\n"
      "vpternlogd $0xff, %%zmm1, %%zmm1, %%zmm1\n"
      "mov %0, %%rcx\n"
      "1:\n"
      "vpdpbusd %%zmm1, %%zmm1, %%zmm2\n vpdpbusd %%zmm1, %%zmm1, %%zmm3\n vpdpbusd %%zmm1, %%zmm1, %%zmm4\n"
      "vpdpbusd %%zmm1, %%zmm1, %%zmm5\n vpdpbusd %%zmm1, %%zmm1, %%zmm6\n vpdpbusd %%zmm1, %%zmm1, %%zmm7\n"
      "vpdpbusd %%zmm1, %%zmm1, %%zmm8\n vpdpbusd %%zmm1, %%zmm1, %%zmm9\n vpdpbusd %%zmm1, %%zmm1, %%zmm10\n"
      "vpdpbusd %%zmm1, %%zmm1, %%zmm11\n vpdpbusd %%zmm1, %%zmm1, %%zmm12\n vpdpbusd %%zmm1, %%zmm1, %%zmm13\n"
      "dec %%rcx\n"
      "jnz 1b\n"
      :
      : "r"(n)
      : "rcx", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12",
        "xmm13", "cc");
  return 12.0 * n / seconds_since(start);
}

template <typename XQ>
double median_ms(const Weights& w, int64_t tiles, int M, int repeats, std::mt19937& rng) {
  const int64_t NB = w.NB;
  std::normal_distribution<float> normal;
  std::vector<float> x(M * NB * 32), y(M * w.R);
  for (auto& v : x) v = normal(rng);
  QuantizedX<int16_t> qx;
  SplitX split;
  size_x(M, NB, qx, false);
  quantize_blocks<Format::kQ4_1, XQ, int16_t>(x.data(), NB, qx, 0, M * NB);
  constexpr bool kBytesX = std::is_same_v<XQ, int8_t>;
  split_blocks(qx, split, M * NB, kBytesX);
  std::vector<double> ms;
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    tiled_group<Format::kQ4_1, kBytesX>(M, qx, split, 0, y.data(), w, 0, tiles);
    ms.push_back(1e3 * seconds_since(start));
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int repeats = argc > 1 ? std::atoi(argv[1]) : 9;
  const int64_t K = 576, NB = K / 32, R = 180224, tiles = R / 16;  // 65 MB of Q4_1 blocks
  std::mt19937 rng(7);
  std::vector<uint8_t> qs(R * NB * 16);
  std::vector<uint16_t> d(R * NB), m(R * NB);
  for (auto& q : qs) q = uint8_t(rng());
  for (size_t i = 0; i < d.size(); ++i) d[i] = uint16_t(0x2000 + (rng() & 255)), m[i] = uint16_t(0xa000 + (rng() & 255));
  const Weights w{qs.data(), d.data(), m.data(), nullptr, R, NB, true};
  const double peak = vnni_peak();
  std::printf("one thread: vpdpbusd (zmm) peak %.2f G/s; tiled Q4_1 loop over %.0f MB, median of %d runs\n\n", peak / 1e9,
              (qs.size() + 4.0 * d.size()) / 1e6, repeats);
  std::printf("| x | rows | ms | its vpdpbusd at the peak, ms | of the bound |\n|---|---|---|---|---|\n");
  for (int bytes = 0; bytes < 2; ++bytes) {
    const double per_row_ops = double(tiles) * NB * (bytes ? 8 : 16);
    for (int M : {1, 2, 3, 5, 8}) {
      const double t = bytes ? median_ms<int8_t>(w, tiles, M, repeats, rng) : median_ms<int16_t>(w, tiles, M, repeats, rng);
      const double bound = 1e3 * M * per_row_ops / peak;
      std::printf("| %s | %d | %.2f | %.2f | %.0f%% |\n", bytes ? "int8" : "int16", M, t, bound, 100 * bound / t);
    }
  }
}
