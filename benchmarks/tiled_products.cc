// int16 products by 4-bit weights in 16-row tiles (the library's TiledProducts loop, `tiled_group`),
// against the library's loops on the GGUF rows of the same weights: the few-row loops (decode,
// verify, batches, before tiles) and the prefill GEMM, whose bits the tiled loop gives; and where the
// CPU has AMX and Linux grants it, the same sums by AMX tiles (not in the library). SmolLM2-135M's 30
// layers of Q4_1 matrices (each its own memory, 65 MB), paired rounds. Built and run by
// tiled_products.py; includes eejax/kernels/cpu_quantized.cc, so both sides are the library's code.
//
// The layout (quantized.py's `tile`): tile t (weight rows 16t..16t+15), block b: four vectors of 16
// dwords, vector k holding bytes 4k..4k+3 of each row's 16 bytes of nibbles (lane n: row 16t + n),
// then the 16 rows' d and m (f16). Masked and shifted, the eight vectors are the block's values as
// bytes, four per lane: an AMX B tile's rows as they stand.
#include KERNEL_SOURCE

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>

namespace {

struct Matrix {
  int64_t R, NB;
  std::vector<uint8_t> qs;
  std::vector<uint16_t> d, m;
};

Matrix make(int64_t R, int64_t K, uint32_t seed) {
  Matrix a{R, K / 32};
  a.qs.resize(R * a.NB * 16), a.d.resize(R * a.NB), a.m.resize(R * a.NB);
  uint32_t s = seed;
  auto next = [&] { return s = s * 1664525u + 1013904223u; };
  for (auto& q : a.qs) q = uint8_t(next() >> 24);
  for (size_t i = 0; i < a.d.size(); ++i) a.d[i] = uint16_t(0x2000 + (next() >> 24)), a.m[i] = uint16_t(0xa000 + (next() >> 24));
  return a;
}

// The tiled layout (above): q [T][NB][4][16] dwords, d and m [T][NB][16]. R is a multiple of 16 here.
struct Tiled {
  int64_t R, NB, T;
  std::vector<uint32_t> q;
  std::vector<uint16_t> d, m;
};

Tiled tile(const Matrix& a) {
  Tiled t{a.R, a.NB, a.R / 16};
  t.q.resize(t.T * t.NB * 64), t.d.resize(t.T * t.NB * 16), t.m.resize(t.T * t.NB * 16);
  for (int64_t r = 0; r < a.R; ++r)
    for (int64_t b = 0; b < a.NB; ++b) {
      const int64_t tb = r / 16 * t.NB + b, n = r % 16;
      for (int k = 0; k < 4; ++k) std::memcpy(&t.q[(tb * 4 + k) * 16 + n], &a.qs[(r * a.NB + b) * 16 + 4 * k], 4);
      t.d[tb * 16 + n] = a.d[r * a.NB + b], t.m[tb * 16 + n] = a.m[r * a.NB + b];
    }
  return t;
}

// x [M, K] as the tiled loop takes it: quantized as the library quantizes it, split into bytes.
struct X {
  QuantizedX<int16_t> q;
  SplitX split;
};

X split(const float* x, int64_t M, int64_t NB) {
  X out;
  size_x(M, NB, out.q, /*paired=*/false);
  quantize_blocks<Format::kQ4_1, int16_t>(x, NB, out.q, 0, M * NB);
  split_blocks(out.q, out.split, M * NB);
  return out;
}

Weights weights(const Tiled& t) { return Weights{reinterpret_cast<const uint8_t*>(t.q.data()), t.d.data(), t.m.data(), nullptr, t.R, t.NB, true}; }

// The library's tiled loop over tiles [t0, t1), every group of x's rows.
void tiled(const Tiled& t, const X& x, int64_t M, float* y, int64_t t0, int64_t t1) {
  const Weights w = weights(t);
  for (int64_t tile = t0; tile < t1; ++tile)
    for (int64_t m = 0; m < M; m += kIntegerGroup)
      tiled_group<Format::kQ4_1, false>(int(std::min<int64_t>(kIntegerGroup, M - m)), x.q, x.split, m, y, w, tile, tile + 1);
}

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
struct __attribute__((packed)) TileConfig {
  uint8_t palette, start, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

void amx_config(int M) {
  TileConfig c{};
  c.palette = 1;
  for (int i = 0; i < 2; ++i) c.rows[i] = M, c.colsb[i] = 64;  // the block's sums: hi, lo (M x 16 int32)
  for (int i = 2; i < 4; ++i) c.rows[i] = M, c.colsb[i] = 32;  // x's block: hi, lo (M x 32 bytes)
  c.rows[4] = 8, c.colsb[4] = 64;                              // the weights' block (8 x 16 rows' 4 values)
  __asm__ volatile("" : : "r"(&c) : "memory");  // GCC 12 drops the stores to c: it does not see ldtilecfg read them
  _tile_loadconfig(&c);
}

// The same with AMX (M <= 16 rows, configured by amx_config(M)): per tile-block, the weights stored
// as a B tile, two tile products, the sums stored and read back for the float part.
void amx(const Tiled& w, const X& x, int64_t M, float* y, int64_t t0, int64_t t1) {
  const __m512i nibble = _mm512_set1_epi8(15);
  alignas(64) uint8_t B[512];
  alignas(64) int32_t ch[16 * 16], cl[16 * 16];
  for (int64_t t = t0; t < t1; ++t) {
    __m512 acc[16];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < w.NB; ++b) {
      const int64_t tb = t * w.NB + b;
      for (int k = 0; k < 4; ++k) {
        const __m512i v = _mm512_loadu_si512(w.q.data() + tb * 64 + 16 * k);
        _mm512_store_si512(B + 64 * k, _mm512_and_si512(v, nibble));
        _mm512_store_si512(B + 64 * (4 + k), _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
      }
      _tile_loadd(4, B, 64);
      _tile_loadd(2, x.split.hi.data() + b * 32, w.NB * 32);  // row m of x's block b: NB * 32 bytes apart
      _tile_loadd(3, x.split.lo.data() + b * 32, w.NB * 32);
      _tile_zero(0);
      _tile_zero(1);
      _tile_dpbsud(0, 2, 4);
      _tile_dpbuud(1, 3, 4);
      _tile_stored(0, ch, 64);
      _tile_stored(1, cl, 64);
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.d.data() + tb * 16)));
      const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.m.data() + tb * 16)));
      for (int m = 0; m < M; ++m) {
        const __m512i isum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(ch + 16 * m), 8), _mm512_load_si512(cl + 16 * m));
        const int64_t at = m * w.NB + b;
        acc[m] = add_block<Format::kQ4_1>(acc[m], isum, d, mn, x.q.dx[at], x.q.offset[at]);  // the library's order
      }
    }
    for (int m = 0; m < M; ++m) _mm512_storeu_ps(y + m * w.R + t * 16, acc[m]);
  }
}
bool amx_ready() { return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0; }
#else
bool amx_ready() { return false; }
void amx_config(int) {}
void amx(const Tiled&, const X&, int64_t, float*, int64_t, int64_t) {}
#endif

// The library's loops on the GGUF layout, rows [r0, r1): the few-row loops (decode, verify, batch) or
// the prefill GEMM (panels of kPanelRows), each with x quantized as the library does.
void library(const Matrix& a, const float* x, int64_t M, float* y, bool panel, int64_t r0, int64_t r1) {
  const Weights w{a.qs.data(), a.d.data(), a.m.data(), nullptr, a.R, a.NB};
  static thread_local QuantizedX<int16_t> qx;
  if (panel) {
    size_x(M, a.NB, qx, false);
    quantize_blocks<Format::kQ4_1, int16_t>(x, a.NB, qx, 0, M * a.NB);
    static thread_local Panel p;
    for (int64_t r = r0; r < r1; r += kPanelRows) {
      pack_panel<Format::kQ4_1>(w, r, p);
      for (int64_t m = 0; m < M; m += kPanelGroup)
        panel_group<Format::kQ4_1>(int(std::min<int64_t>(kPanelGroup, M - m)), qx, m, p, w, y, r, std::min<int64_t>(kPanelRows, r1 - r));
    }
    return;
  }
  quantize_x<Format::kQ4_1, int16_t>(x, M, a.NB, qx);
  for (int64_t t = r0; t < r1; t += kRowsPerTile)
    for (int64_t m = 0; m < M; m += kIntegerGroup)
      integer_group<Format::kQ4_1, int16_t>(int(std::min<int64_t>(kIntegerGroup, M - m)), qx, m, y + m * a.R, w, t, std::min(r1, t + kRowsPerTile));
}

// What one step's products cost, on `threads` threads (each a half of every matrix's rows, in tiles
// of 32 rows: the panels' size), x quantized in each call as the library does.
struct Step {
  const std::vector<Matrix>& mats;
  const std::vector<Tiled>& tiles;
  const float* x;
  int64_t M;

  void run(int path, int threads) const {  // path 0: library few-row loops, 1: library GEMM, 2: tiles, 3: AMX
    auto part = [&](int i) {
      std::vector<float> y(M * 1536);
      for (size_t j = 0; j < mats.size(); ++j) {
        const int64_t pieces = mats[j].R / 32, r0 = pieces * i / threads * 32, r1 = pieces * (i + 1) / threads * 32;
        if (path < 2) {
          library(mats[j], x, M, y.data(), path == 1, r0, r1);
        } else {
          const X sx = split(x, M, mats[j].NB);
          if (path == 2)
            tiled(tiles[j], sx, M, y.data(), r0 / 16, r1 / 16);
          else
            amx(tiles[j], sx, M, y.data(), r0 / 16, r1 / 16);
        }
      }
    };
    if (threads == 1) return part(0);
    std::thread helper([&] {
      if (path == 3) amx_config(int(M));
      part(1);
    });
    part(0);
    helper.join();
  }
};

double seconds(const Step& s, int path, int threads) {
  const auto start = std::chrono::steady_clock::now();
  s.run(path, threads);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 9;
  const bool with_amx = amx_ready();
  const std::pair<int64_t, int64_t> layer[] = {{576, 576}, {192, 576}, {192, 576}, {576, 576}, {1536, 576}, {1536, 576}, {576, 1536}};
  std::vector<Matrix> mats;
  std::vector<Tiled> tiles;
  for (int l = 0; l < 30; ++l)
    for (const auto& [R, K] : layer) mats.push_back(make(R, K, uint32_t(mats.size() + 1))), tiles.push_back(tile(mats.back()));
  std::vector<float> x(256 * 1536);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(i * 0.37f) * (i % 97 == 0 ? 20.f : 1.f);

  // Bits: the tiled loop (and AMX) against the library's prefill GEMM, every shape, 1..64 rows.
  int differ = 0, differ_amx = 0, differ_few = 0, products = 0;
  for (int s = 0; s < 7; ++s)
    for (int64_t M : {1, 2, 3, 5, 8, 9, 16, 64}) {
      const Matrix& a = mats[s];
      std::vector<float> gemm(M * a.R), few(M * a.R), y(M * a.R), ya(M * a.R);
      library(a, x.data(), M, gemm.data(), true, 0, a.R);
      library(a, x.data(), M, few.data(), false, 0, a.R);
      const X sx = split(x.data(), M, a.NB);
      tiled(tiles[s], sx, M, y.data(), 0, tiles[s].T);
      differ += std::memcmp(gemm.data(), y.data(), gemm.size() * 4) != 0;
      differ_few += std::memcmp(gemm.data(), few.data(), gemm.size() * 4) != 0;
      if (with_amx && M <= 16) {
        amx_config(int(M));
        amx(tiles[s], sx, M, ya.data(), 0, tiles[s].T);
        differ_amx += std::memcmp(gemm.data(), ya.data(), gemm.size() * 4) != 0;
      }
      ++products;
    }
  std::printf("bits against the library's prefill GEMM, %d products (7 shapes x 1-64 rows): tiled %d differ%s; "
              "the library's few-row loops %d differ\n\n",
              products, differ, with_amx ? (", AMX " + std::to_string(differ_amx)).c_str() : "", differ_few);

  std::printf("A step's Q4_1 products (30 layers, 65 MB), medians of %d paired rounds, ms:\n\n", rounds);
  std::printf("| rows of x | threads | library | its loop | tiled | tiled vs library |%s\n|---|---|---|---|---|---|%s\n",
              with_amx ? " AMX | AMX vs library |" : "", with_amx ? "---|---|" : "");
  for (int64_t M : {1, 2, 5, 8, 16, 64, 256})
    for (int threads : {1, 2}) {
      const Step s{mats, tiles, x.data(), M};
      const int lib = M > 16 ? 1 : 0;  // 64 and 256 rows: a prompt's, which the library's GEMM takes
      const bool amx_too = with_amx && M <= 16;
      if (amx_too) amx_config(int(M));
      std::vector<double> a, b, c, ratio, ratio_amx;
      s.run(lib, threads), s.run(2, threads);
      for (int r = 0; r < rounds; ++r) {
        double tl, tt;  // the order alternating
        if (r % 2) tl = seconds(s, lib, threads), tt = seconds(s, 2, threads);
        else tt = seconds(s, 2, threads), tl = seconds(s, lib, threads);
        const double ta = amx_too ? seconds(s, 3, threads) : 0;
        a.push_back(tl), b.push_back(tt), c.push_back(ta), ratio.push_back(tl / tt);
        if (amx_too) ratio_amx.push_back(tl / ta);
      }
      std::printf("| %lld | %d | %.2f | %s | %.2f | **%.2fx** |", (long long)M, threads, median(a) * 1e3, lib ? "GEMM" : "few-row",
                  median(b) * 1e3, median(ratio));
      if (with_amx) amx_too ? std::printf(" %.2f | %.2fx |", median(c) * 1e3, median(ratio_amx)) : std::printf(" | |");
      std::printf("\n");
    }
  return 0;
}
