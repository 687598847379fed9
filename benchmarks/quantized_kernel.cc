// The quantized products of one SmolLM2-135M decode step, timed alone on one thread and on two
// (each thread half of every matrix's rows, no XLA, no thread pool, no barriers: the best two
// cores can do): 30 layers of Q4_1 matrices (q 576x576, k and v 192x576, o 576x576, gate and up
// 1536x576, down 576x1536) and the Q8_0 head (49152x576), each with its own memory (97 MB, out of
// cache), one row of x, for each way of taking x (float32, int8, int16). Built and run by
// quantized_kernel.py; includes the kernel's source, so it times exactly the library's loops.
#include KERNEL_SOURCE

#include <chrono>
#include <cstdio>
#include <thread>

namespace {

struct Matrix {
  int64_t R, NB;
  Format format;
  std::vector<uint8_t> qs;
  std::vector<uint16_t> d, m;
};

Matrix make(int64_t R, int64_t K, Format format) {
  Matrix a{R, K / 32, format};
  a.qs.resize(R * a.NB * (format == Format::kQ8_0 ? 32 : 16));
  a.d.resize(R * a.NB);
  a.m.resize(R * a.NB);
  for (size_t i = 0; i < a.qs.size(); ++i) a.qs[i] = uint8_t(i * 7 + 3);
  for (size_t i = 0; i < a.d.size(); ++i) a.d[i] = uint16_t(0x2000 + (i & 255)), a.m[i] = uint16_t(0xa000 + (i & 255));
  return a;
}

// Rows [r0, r1) of a's product.
template <Format F, typename XQ>
void product(const Matrix& a, const float* x, float* y, int64_t r0, int64_t r1) {
  const Weights w{a.qs.data(), a.d.data(), a.m.data(), nullptr, a.R, a.NB};
  if constexpr (std::is_same_v<XQ, float>) {
    for (int64_t r = r0; r < r1; r += kRowsPerTile) float_rows<F, 1>(x, y, w, r, std::min(r1, r + kRowsPerTile));
  } else {
    QuantizedX<XQ> qx;
    quantize_x<F, XQ>(x, 1, a.NB, qx);
    for (int64_t r = r0; r < r1; r += kRowsPerTile)
      integer_rows<F, XQ, 1>(qx, 0, y, w, r, std::min(r1, r + kRowsPerTile));
  }
}

// Part `part` of `parts` of every matrix's rows.
template <typename XQ>
void step(const std::vector<Matrix>& matrices, const float* x, float* y, int part, int parts) {
  for (const Matrix& a : matrices) {
    const int64_t r0 = a.R * part / parts, r1 = a.R * (part + 1) / parts;
    if (a.format == Format::kQ4_1)
      product<Format::kQ4_1, XQ>(a, x, y, r0, r1);
    else
      product<Format::kQ8_0, XQ>(a, x, y, r0, r1);
  }
}

template <typename XQ>
void time_step(const char* name, const std::vector<Matrix>& matrices, const float* x, float* y, double blocks) {
  for (int threads = 1; threads <= 2; ++threads) {
    double best = 1e9;
    for (int repeat = 0; repeat < 7; ++repeat) {
      const auto start = std::chrono::steady_clock::now();
      if (threads == 1) {
        step<XQ>(matrices, x, y, 0, 1);
      } else {
        std::vector<float> y2(49152);
        std::thread helper([&] { step<XQ>(matrices, x, y2.data(), 1, 2); });
        step<XQ>(matrices, x, y, 0, 2);
        helper.join();
      }
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    std::printf("%-8s %6.2f ms per step on %d thread%s, %.2f ns per block of 32 and thread\n", name, best * 1e3, threads,
                threads > 1 ? "s" : "", best * threads / blocks * 1e9);
  }
}

}  // namespace

int main() {
  std::vector<Matrix> matrices;
  const std::pair<int64_t, int64_t> layer[] = {{576, 576}, {192, 576}, {192, 576}, {576, 576}, {1536, 576}, {1536, 576}, {576, 1536}};
  for (int l = 0; l < 30; ++l)
    for (const auto& [R, K] : layer) matrices.push_back(make(R, K, Format::kQ4_1));
  matrices.push_back(make(49152, 576, Format::kQ8_0));
  double blocks = 0, bytes = 0;
  for (const Matrix& a : matrices)
    blocks += double(a.R * a.NB), bytes += double(a.qs.size() + a.d.size() * 2 + (a.format == Format::kQ4_1 ? a.m.size() * 2 : 0));
  std::vector<float> x(1536), y(49152);
  for (int i = 0; i < 1536; ++i) x[i] = std::sin(i * 0.37f) * (i % 97 == 0 ? 20.f : 1.f);
  std::printf("%.1fM blocks, %.0f MB\n", blocks / 1e6, bytes / 1e6);
  time_step<float>("float32", matrices, x.data(), y.data(), blocks);
  time_step<int16_t>("int16", matrices, x.data(), y.data(), blocks);
  time_step<int8_t>("int8", matrices, x.data(), y.data(), blocks);
  return 0;
}
