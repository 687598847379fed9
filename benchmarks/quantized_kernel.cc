// The quantized products of one SmolLM2-135M decode step, timed alone on one thread and on two
// (each thread half of every matrix's rows, no XLA, no thread pool, no barriers: the best two
// cores can do): 30 layers of Q4_1 matrices (q 576x576, k and v 192x576, o 576x576, gate and up
// 1536x576, down 576x1536) and the Q8_0 head (49152x576), each with its own memory (97 MB, out of
// cache), 1 to 16 rows of x, for each way of taking x (float32, int8, int16), and int16's floor on
// registers. Built and run by quantized_kernel.py; includes the kernel's source, so it times
// exactly the library's loops.
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

// Rows [r0, r1) of a's product for M rows of x (K apart; y rows R apart), looped as
// QuantizedMatmul loops: tiles of kRowsPerTile weight rows, groups of at most kGroup rows of x.
template <Format F, typename XQ>
void product(const Matrix& a, const float* x, int64_t M, float* y, int64_t r0, int64_t r1) {
  const Weights w{a.qs.data(), a.d.data(), a.m.data(), nullptr, a.R, a.NB};
  const int64_t K = a.NB * 32;
  const int group = std::is_same_v<XQ, float> ? kGroup : kIntegerGroup;
  QuantizedX<std::conditional_t<std::is_same_v<XQ, float>, int8_t, XQ>> qx;
  if constexpr (!std::is_same_v<XQ, float>) quantize_x<F, XQ>(x, M, a.NB, qx);
  for (int64_t t = r0; t < r1; t += kRowsPerTile)
    for (int64_t m = 0; m < M; m += group) {
      const int g = int(std::min<int64_t>(group, M - m));
      const int64_t t1 = std::min(r1, t + kRowsPerTile);
      if constexpr (std::is_same_v<XQ, float>)
        float_group<F>(g, x + m * K, y + m * a.R, w, t, t1);
      else
        integer_group<F, XQ>(g, qx, m, y + m * a.R, w, t, t1);
    }
}

// Part `part` of `parts` of every matrix's rows.
template <typename XQ>
void step(const std::vector<Matrix>& matrices, const float* x, int64_t M, float* y, int part, int parts) {
  for (const Matrix& a : matrices) {
    const int64_t r0 = a.R * part / parts, r1 = a.R * (part + 1) / parts;
    if (a.format == Format::kQ4_1)
      product<Format::kQ4_1, XQ>(a, x, M, y, r0, r1);
    else
      product<Format::kQ8_0, XQ>(a, x, M, y, r0, r1);
  }
}

// One step's products for M rows of x (1: a decode step; 5: a draft:4 verify pass; 8: a batch),
// on one thread and on two; the best of 7 runs.
template <typename XQ>
double time_step(const char* name, const std::vector<Matrix>& matrices, const float* x, int64_t M, double blocks, double one_row) {
  std::vector<float> y(M * 49152), y2(M * 49152);
  double best[2] = {1e9, 1e9};
  for (int threads = 1; threads <= 2; ++threads)
    for (int repeat = 0; repeat < 7; ++repeat) {
      const auto start = std::chrono::steady_clock::now();
      if (threads == 1) {
        step<XQ>(matrices, x, M, y.data(), 0, 1);
      } else {
        std::thread helper([&] { step<XQ>(matrices, x, M, y2.data(), 1, 2); });
        step<XQ>(matrices, x, M, y.data(), 0, 2);
        helper.join();
      }
      best[threads - 1] = std::min(best[threads - 1], std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  std::printf("| %s | %lld | %.2f | %.2f | %.2f | %.2f |\n", name, (long long)M, best[0] * 1e3, best[1] * 1e3,
              best[0] / M / blocks * 1e9, one_row > 0 ? best[1] / one_row : 1.0);
  return best[1];
}

template <typename XQ>
void time_rows(const char* name, const std::vector<Matrix>& matrices, const float* x, const std::vector<int64_t>& rows, double blocks) {
  double one_row = 0;
  for (int64_t M : rows) {
    const double t = time_step<XQ>(name, matrices, x, M, blocks, one_row);
    if (M == 1) one_row = t;
  }
}

#if EEJAX_VNNI256
// The least a row of int16 x can cost per block on this core, whatever the loop around it: a pair of
// 4-bit blocks against one row of x is four vpdpwssd (64 products), a cvt, the scale's multiply and
// the accumulating FMA (paired_rows' instructions per row of x), here on registers alone, 8
// independent rows, no loads and no weight decoding. ns per block and row, one thread.
double int16_floor() {
  constexpr int kRows = 8;
  const int64_t pairs = 1 << 22;
  __m256i w[4], x[kRows];
  __m256 acc[kRows], scale = _mm256_set1_ps(1e-9f), dx = _mm256_set1_ps(0.5f);
  for (int i = 0; i < 4; ++i) w[i] = _mm256_set1_epi16(short(3 + i));
  for (int m = 0; m < kRows; ++m) x[m] = _mm256_set1_epi16(short(m + 1)), acc[m] = _mm256_setzero_ps();
  const auto start = std::chrono::steady_clock::now();
  for (int64_t k = 0; k < pairs; ++k) {
    for (int m = 0; m < kRows; ++m) {
      __m256i s = _mm256_madd_epi16(w[0], x[m]);
      for (int i = 1; i < 4; ++i) s = _mm256_dpwssd_epi32(s, w[i], x[m]);
      acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(scale, dx), _mm256_cvtepi32_ps(s), acc[m]);
    }
    __asm__ volatile("" : "+x"(w[0]), "+x"(w[1]), "+x"(w[2]), "+x"(w[3]), "+x"(dx));  // a new pair each time
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  float sink = 0.f;
  for (int m = 0; m < kRows; ++m) sink += sum8(acc[m]);
  if (sink == 1234.5f) std::printf(" ");
  return seconds / (2.0 * pairs * kRows) * 1e9;
}
#endif

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
  const std::vector<int64_t> rows = {1, 2, 5, 8, 16};
  std::vector<float> x(16 * 1536);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(i * 0.37f) * (i % 97 == 0 ? 20.f : 1.f);
  std::printf("%.1fM blocks, %.0f MB\n\n", blocks / 1e6, bytes / 1e6);
  std::printf("| x | rows | ms on 1 thread | ms on 2 threads | ns per block and row (1 thread) | 2 threads vs 1 row |\n|---|---|---|---|---|---|\n");
  time_rows<float>("float32", matrices, x.data(), {1, 5}, blocks);
  time_rows<int16_t>("int16", matrices, x.data(), rows, blocks);
  time_rows<int8_t>("int8", matrices, x.data(), rows, blocks);
#if EEJAX_VNNI256
  const double floor = int16_floor();
  std::printf("\nint16's floor on this core: %.2f ns per block and row of x (vpdpwssd, cvt, scale, FMA on registers);\n"
              "a step's products for M rows on 2 threads take at least M x %.2f ms beyond their weights' decoding\n",
              floor, floor * blocks / 2 * 1e-6);
#endif
  return 0;
}
