// Products of a few float32 rows by a quantized weight matrix kept as its blocks, on a CPU:
//   y[m, r] = x[m] . dequantize(row r)      x [M, K] f32, R rows of K weights -> y [M, R] f32
// A row is K / 32 blocks (eejax/quantized.py): q4_0 / q4_1 (16 bytes of nibbles, value j low and
// value j + 16 high; an f16 scale d [and min m] per block), q8_0 (32 int8 and an f16 d), int8 (32-value
// pieces of a row, one f32 scale per row).
//
// Three ways to take the dot product of a block, each a handler per format:
//   float ("F32"): the block is dequantised in registers exactly as a dequantising conversion
//     computes it in float32 (d * (q - 8), d * q + m, d * q: d * q is exact), then multiplied by x as
//     the float32 kernel does: the product equals the float32 model's up to summation order.
//   int8 ("Q8", llama.cpp's method): each 32-value block of x is quantized to int8 with its own
//     scale (dx = max |x| / 127), the block's dot product is summed in integers (AVX2's
//     maddubs / madd), then scaled once by d * dx; the minimum (q4_1) or the -8 offset (q4_0)
//     is added per block from x's float sums. About 3x fewer instructions per block than float,
//     at the price of rounding x to 8 bits.
//   int16 ("Q16"): the same with x rounded to 16 bits (dx = max |x| / 32767; madd on weights
//     widened to int16): x's rounding 256x finer than int8's. 4-bit blocks go two to a vector
//     (x laid out to match), so each pair costs one conversion and one scaling.
// A prefill's many rows of x (more than kMaxVectorRows) with integer activations take a GEMM
// instead, where AVX-512 VNNI is (`panel_rows`): 32 weight rows decoded once into int16 pairs laid
// across a vector's lanes, and each 32-value block's products summed by vpdpwssd in int32 lanes, one
// lane per weight row, for 6 rows of x at a time; about twice the multiply-adds per cycle of a
// float32 GEMM (XLA's, which the float32 activations' prefill keeps).
// Rows of x go in groups of at most 4 (accumulators in registers); weight rows in tiles of 16,
// so a tile is read from memory once and from L1 by the later groups; the rows are split between
// the pool's threads (cpu_parts.h). With AVX2, FMA and F16C (this project's machines) the blocks
// are decoded with intrinsics (GCC's vector extensions scalarised the byte widening: 20x slower);
// elsewhere a portable loop computes the same sums.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_parts.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define EEJAX_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define EEJAX_VNNI512 1
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define EEJAX_VNNI256 1  // vpdpwssd / vpdpbusd on 256-bit vectors
#endif
#endif

namespace ffi = xla::ffi;

namespace {

enum class Format { kQ4_0, kQ4_1, kQ8_0, kInt8 };

template <Format F>
constexpr bool kNibbles = F == Format::kQ4_0 || F == Format::kQ4_1;
template <Format F>
constexpr int64_t kBlockBytes = kNibbles<F> ? 16 : 32;
template <Format F>
constexpr bool kTileable = kNibbles<F> || F == Format::kQ8_0;  // kept in tiles of 16 rows where integer x takes them
template <Format F>
constexpr int64_t kTileWords = kBlockBytes<F> / 4;  // four-byte words of a row's block
constexpr int kGroup = 4;            // rows of float x per pass over a weight row
constexpr int kIntegerGroup = 8;     // rows of integer x per pass (one block decoded for all of them)
constexpr int64_t kMaxBlocks = 512;  // blocks per row the integer paths' per-row scales hold (K <= 16384)
constexpr int64_t kRowsPerTile = 16;  // weight rows whose blocks stay in L1 while every group of x passes
constexpr int64_t kMinBlocksPerPart = 4096;

// An IEEE half as a float (F16C's instruction where there is one: a _Float16 conversion is a
// libgcc call without AVX512-FP16).
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal
    int shift = 0;
    uint32_t m = mantissa;
    while (!(m & 0x400)) m <<= 1, ++shift;
    bits = sign | ((113 - shift) << 23) | ((m & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// The integer value of weight j (0..31) of a block, before its scale (q4_0's -8 included).
template <Format F>
inline int value(const uint8_t* block, int j) {
  if constexpr (kNibbles<F>) {
    const int q = j < 16 ? block[j] & 15 : block[j - 16] >> 4;
    return F == Format::kQ4_0 ? q - 8 : q;
  } else {
    return int8_t(block[j]);
  }
}

// What one matrix and one call share.
struct Weights {
  const uint8_t* qs;
  const uint16_t* d;       // per block (not int8)
  const uint16_t* mins;    // per block (q4_1)
  const float* row_scale;  // per row (int8)
  int64_t R, NB;
  bool tiled = false;  // q4 / q8_0 rows in tiles of 16 (eejax/quantized.py's `tile`; the tiled loop below)
};

// A matrix's buffers as `Weights`: qs; scales (f16 per block, or int8's f32 per row); mins (q4_1).
inline Weights weights_of(bool int8, bool q4_1, const void* qs, const void* scales, const void* mins, int64_t R,
                          int64_t NB, bool tiled = false) {
  return Weights{static_cast<const uint8_t*>(qs), int8 ? nullptr : static_cast<const uint16_t*>(scales),
                 q4_1 ? static_cast<const uint16_t*>(mins) : nullptr, int8 ? static_cast<const float*>(scales) : nullptr,
                 R, NB, tiled};
}

// Where row r's block b and its scales are: in tiles of 16 rows (`tiled`), tile r / 16 holds per block
// kTileWords vectors of 16 dwords (4 for q4's 16 bytes, 8 for q8_0's 32), vector k bytes 4k..4k+3 of
// each of its rows' block (lane r % 16), and the 16 rows' d (and m) side by side; otherwise GGUF's rows.
inline int64_t scale_at(const Weights& w, int64_t r, int64_t b) {
  return w.tiled ? (r / 16 * w.NB + b) * 16 + r % 16 : r * w.NB + b;
}

// A tiled matrix's first dword of row r's block b (the next ones are 16 dwords apart).
template <Format F>
inline const uint32_t* tile_word(const Weights& w, int64_t r, int64_t b) {
  return reinterpret_cast<const uint32_t*>(w.qs) + (r / 16 * w.NB + b) * 16 * kTileWords<F> + r % 16;
}

inline float finish(float sum, const Weights& w, int64_t r, bool int8) { return int8 ? sum * w.row_scale[r] : sum; }

// ---- float: dequantise in registers ----------------------------------------------------------------

#if EEJAX_AVX2
inline float sum8(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

// Block b of a row as four vectors of 8 floats (values 0-7, 8-15, 16-23, 24-31), dequantised.
template <Format F>
inline void dequantize_block(const Weights& w, int64_t r, int64_t b, __m256 out[4]) {
  const uint8_t* block = w.qs + (r * w.NB + b) * kBlockBytes<F>;
  if constexpr (kNibbles<F>) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block));
    const __m128i nibble = _mm_set1_epi8(15);
    const __m128i low = _mm_and_si128(bytes, nibble), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(low));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8)));
    out[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high));
    out[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(high, 8)));
    const __m256 scale = _mm256_set1_ps(half_to_float(w.d[r * w.NB + b]));
    if constexpr (F == Format::kQ4_0) {
      const __m256 eight = _mm256_set1_ps(8.f);
      for (int i = 0; i < 4; ++i) out[i] = _mm256_mul_ps(scale, _mm256_sub_ps(out[i], eight));
    } else {
      const __m256 min = _mm256_set1_ps(half_to_float(w.mins[r * w.NB + b]));
      for (int i = 0; i < 4; ++i) out[i] = _mm256_fmadd_ps(scale, out[i], min);  // d * q exact: one rounding
    }
  } else {
    for (int i = 0; i < 4; ++i)
      out[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 8 * i))));
    if constexpr (F == Format::kQ8_0) {
      const __m256 scale = _mm256_set1_ps(half_to_float(w.d[r * w.NB + b]));
      for (int i = 0; i < 4; ++i) out[i] = _mm256_mul_ps(scale, out[i]);
    }
  }
}

// y[m, r] for G (<= kGroup) rows of x (K apart; y rows R apart) and weight rows [r, r + NR). Two
// accumulators per row of x and weight row, whatever G and NR: a row's sums run in the same order
// alone (a decode step) as in a group (a verify pass), so the two agree bit for bit.
template <Format F, int G, int NR>
inline void float_tile(const float* x, float* y, const Weights& w, int64_t r) {
  constexpr int A = 2;
  const int64_t K = w.NB * 32;
  __m256 acc[NR][G][A];
  for (int n = 0; n < NR; ++n)
    for (int m = 0; m < G; ++m)
      for (int a = 0; a < A; ++a) acc[n][m][a] = _mm256_setzero_ps();
  for (int64_t b = 0; b < w.NB; ++b)
    for (int n = 0; n < NR; ++n) {
      __m256 v[4];
      dequantize_block<F>(w, r + n, b, v);
      for (int m = 0; m < G; ++m)
        for (int i = 0; i < 4; ++i)
          acc[n][m][i % A] = _mm256_fmadd_ps(v[i], _mm256_loadu_ps(x + m * K + b * 32 + 8 * i), acc[n][m][i % A]);
    }
  for (int n = 0; n < NR; ++n)
    for (int m = 0; m < G; ++m)
      y[m * w.R + r + n] = finish(sum8(_mm256_add_ps(acc[n][m][0], acc[n][m][1])), w, r + n, F == Format::kInt8);
}

template <Format F, int G>
void float_rows(const float* x, float* y, const Weights& w, int64_t r0, int64_t r1) {
  constexpr int NR = G == 1 ? 2 : 1;  // one row of x: two weight rows at a time (more independent chains)
  int64_t r = r0;
  for (; r + NR <= r1; r += NR) float_tile<F, G, NR>(x, y, w, r);
  for (; r < r1; ++r) float_tile<F, G, 1>(x, y, w, r);
}
#else
template <Format F, int G>
void float_rows(const float* x, float* y, const Weights& w, int64_t r0, int64_t r1) {
  const int64_t K = w.NB * 32;
  for (int64_t r = r0; r < r1; ++r)
    for (int m = 0; m < G; ++m) {
      float s = 0.f;
      for (int64_t b = 0; b < w.NB; ++b) {
        const uint8_t* block = w.qs + (r * w.NB + b) * kBlockBytes<F>;
        const float d = F == Format::kInt8 ? 1.f : half_to_float(w.d[r * w.NB + b]);
        const float mn = F == Format::kQ4_1 ? half_to_float(w.mins[r * w.NB + b]) : 0.f;
        for (int j = 0; j < 32; ++j) s += (F == Format::kQ4_1 ? d * value<F>(block, j) + mn : d * value<F>(block, j)) * x[m * K + b * 32 + j];
      }
      y[m * w.R + r] = finish(s, w, r, F == Format::kInt8);
    }
}
#endif

// ---- integer activations: x quantized per block ----------------------------------------------------

// x's rows as integer blocks (XQ = int8_t or int16_t): xq [M, stride], dx [M, NB] (x ~ dx * xq, dx = max
// |x| / the type's largest value), and per block the term that the weights' offset multiplies:
// q4_1 the float sum of x (times m), q4_0 -8 * dx * sum(xq) (times d).
//
// int16 x against 4-bit weights is laid out in pairs of blocks, as the products read it (two
// blocks per vector; see integer_rows): for blocks b = 2k, 2k + 1 the 64 values of pair k are
// x_b[0:8] x_b+1[0:8], x_b[8:16] x_b+1[8:16], x_b[16:24] x_b+1[16:24], x_b[24:32] x_b+1[24:32],
// an odd last block paired with zeros. Where AVX-512 VNNI is, pairs go two by two (kPairsPerLoad):
// chunk i of pairs 2k and 2k + 1 side by side, so that one 512-bit load holds both (the products
// read two pairs per vector there). Otherwise a row is its blocks in order.
template <Format F, typename XQ>
constexpr bool kPaired = kNibbles<F> && std::is_same_v<XQ, int16_t>;
#if EEJAX_VNNI512
constexpr int64_t kPairsPerLoad = 2;
#else
constexpr int64_t kPairsPerLoad = 1;
#endif

template <typename XQ>
struct QuantizedX {
  std::vector<XQ> xq;
  std::vector<float> dx, offset;
  std::vector<float> dx_pairs;  // paired layout: [M, pairs, 8], pair k's dx spread as its sums lie (spread_pairs)
  int64_t stride = 0;  // xq values per row of x
  bool paired = false;

  // Where value j of block b of row m is (values 8i..8i+7 of a block are together in either layout).
  int64_t at(int64_t m, int64_t b, int j) const {
    constexpr int64_t P = kPairsPerLoad;
    return paired ? m * stride + b / (2 * P) * (64 * P) + j / 8 * (16 * P) + b / 2 % P * 16 + b % 2 * 8 + j % 8
                  : m * stride + b * 32 + j;
  }
};

// Sizes `out` for M rows of NB blocks (its buffers are reused from call to call: no allocation once
// grown); `paired`: the 4-bit int16 layout above, else blocks in order.
template <typename Store>
void size_x(int64_t M, int64_t NB, QuantizedX<Store>& out, bool paired) {
  out.paired = paired;
  out.stride = out.paired ? ((NB + 1) / 2 + kPairsPerLoad - 1) / kPairsPerLoad * (64 * kPairsPerLoad) : NB * 32;
  out.xq.resize(M * out.stride), out.dx.resize(M * NB), out.offset.resize(M * NB);
  if (out.paired && NB % 2)  // the zeros an odd last block is paired with
    for (int64_t m = 0; m < M; ++m)
      for (int j = 0; j < 32; ++j) out.xq[out.at(m, NB, j)] = 0;
}

// out[i] = the float sum of block i of x for i in [i0, i1), each in value order (int8 activations'
// results move with its last bit); eight blocks' sums side by side, so that their adds need not wait
// on one another (one block's 32 adds in a row waited ~100 cycles).
inline void block_sums(const float* x, int64_t i0, int64_t i1, float* out) {
  int64_t i = i0;
  for (; i + 8 <= i1; i += 8) {
    float sums[8] = {};
    for (int j = 0; j < 32; ++j)
      for (int c = 0; c < 8; ++c) sums[c] += x[(i + c) * 32 + j];
    std::memcpy(out + i, sums, sizeof sums);
  }
  for (; i < i1; ++i) {
    float sum = 0.f;
    for (int j = 0; j < 32; ++j) sum += x[i * 32 + j];
    out[i] = sum;
  }
}

// Rounds blocks [i0, i1) of x (block i: row i / NB, block i % NB) into `out`, sized by `size_x`.
// XQ gives the levels (int8_t: 127, int16_t: 32767); Store holds them (int16_t for a GEMM's int8
// x: the same values, the same sums).
template <Format F, typename XQ, typename Store = XQ>
void quantize_blocks(const float* x, int64_t NB, QuantizedX<Store>& out, int64_t i0, int64_t i1) {
  constexpr float kLevels = std::numeric_limits<XQ>::max();
  if constexpr (F == Format::kQ4_1) block_sums(x, i0, i1, out.offset.data());
  for (int64_t i = i0; i < i1; ++i) {
    const float* v = x + i * 32;
    const int64_t m = i / NB, b = i % NB;
    Store* eighths[4];  // where values 8i..8i+7 go
    for (int e = 0; e < 4; ++e) eighths[e] = out.xq.data() + out.at(m, b, 8 * e);
    auto q = [&](int j) -> Store& { return eighths[j / 8][j % 8]; };
    float amax = 0.f;
    int isum = 0;
#if EEJAX_AVX2
    __m256 block[4], most = _mm256_setzero_ps();
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int j = 0; j < 4; ++j) block[j] = _mm256_loadu_ps(v + 8 * j), most = _mm256_max_ps(most, _mm256_and_ps(block[j], magnitude));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, most);
    for (float lane : lanes) amax = std::max(amax, lane);
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? kLevels / amax : 0.f);
    __m256i rounded[4], total = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {  // nearest, ties to even (the default rounding mode, as nearbyint)
      rounded[j] = _mm256_cvtps_epi32(_mm256_mul_ps(block[j], inv));
      total = _mm256_add_epi32(total, rounded[j]);
    }
    alignas(32) int32_t ints[32];
    for (int j = 0; j < 4; ++j) _mm256_store_si256(reinterpret_cast<__m256i*>(ints + 8 * j), rounded[j]);
    for (int j = 0; j < 32; ++j) q(j) = Store(ints[j]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(ints), total);
    for (int j = 0; j < 8; ++j) isum += ints[j];
#else
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float inv = amax > 0.f ? kLevels / amax : 0.f;
    for (int j = 0; j < 32; ++j) {
      const int r = int(std::nearbyint(v[j] * inv));
      q(j) = Store(r);
      isum += r;
    }
#endif
    const float dx = amax / kLevels;
    out.dx[i] = dx;
    if constexpr (F != Format::kQ4_1) out.offset[i] = F == Format::kQ4_0 ? -8.f * dx * float(isum) : 0.f;  // q4_1: block_sums
  }
}

// Per-block values v [NB] spread over the paired layout's vectors: out [pairs, 8], pair k's lanes 0-3
// v[2k] and lanes 4-7 v[2k + 1] (0 past NB), as a PairDot's sums lie.
inline void spread_pairs(const float* v, int64_t NB, float* out) {
  int64_t k = 0;
#if EEJAX_AVX2
  for (; 2 * k + 8 <= NB; k += 4) {  // 8 blocks: 4 pairs
    const __m256 eight = _mm256_loadu_ps(v + 2 * k);
    for (int i = 0; i < 4; ++i)
      _mm256_storeu_ps(out + 8 * (k + i), _mm256_permutevar8x32_ps(eight, _mm256_setr_epi32(2 * i, 2 * i, 2 * i, 2 * i, 2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1)));
  }
#endif
  for (; k < (NB + 1) / 2; ++k) {
    const float lo = v[2 * k], hi = 2 * k + 1 < NB ? v[2 * k + 1] : 0.f;
    for (int l = 0; l < 4; ++l) out[8 * k + l] = lo, out[8 * k + 4 + l] = hi;
  }
}

// All of x's M rows, in the products' layout for XQ.
template <Format F, typename XQ>
void quantize_x(const float* x, int64_t M, int64_t NB, QuantizedX<XQ>& out) {
  size_x(M, NB, out, kPaired<F, XQ>);
  quantize_blocks<F, XQ>(x, NB, out, 0, M * NB);
  if (out.paired) {
    const int64_t spread = (NB + 1) / 2 * 8;
    out.dx_pairs.resize(M * spread);
    for (int64_t m = 0; m < M; ++m) spread_pairs(out.dx.data() + m * NB, NB, out.dx_pairs.data() + m * spread);
  }
}

#if EEJAX_AVX2
// acc + a * b (int16 lanes) with each pair of products summed into an int32 lane: one vpdpwssd where
// there is VNNI, else madd and add. The same integers either way (no sum here can overflow).
inline __m256i madd_add(__m256i acc, __m256i a, __m256i b) {
#if EEJAX_VNNI256
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

// u (unsigned bytes) * s (signed bytes) with each four products summed into an int32 lane: vpdpbusd,
// else maddubs and madd (maddubs' int16 pair sums stay below 2 * 128 * 127 here: no saturation).
inline __m256i dot_bytes(__m256i u, __m256i s) {
#if EEJAX_VNNI256
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// A block's weights ready for integer products against x's type, and the product: 32 weight-x
// products summed to 8 int32 lanes. q4 weights are unsigned nibbles (q4_0's -8 is in the offset
// term), q8 and int8 signed. Every sum fits int32 (int16: 32 * 128 * 32767 < 2^31).
template <Format F, typename XQ>
struct BlockDot;

template <Format F>
struct BlockDot<F, int8_t> {  // llama.cpp's: maddubs multiplies unsigned by signed bytes
  __m256i wq;
  explicit BlockDot(const uint8_t* block) {
    if constexpr (kNibbles<F>) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block));
      wq = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), _mm256_set1_epi8(15));
    } else {
      wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block));
    }
  }
  __m256i dot(const int8_t* xq) const {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
    if constexpr (kNibbles<F>)  // signed weights below: their magnitude times x with their sign
      return dot_bytes(wq, x);
    else
      return dot_bytes(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(x, wq));
  }
};

template <Format F>
struct BlockDot<F, int16_t> {  // 8-bit weights widened to int16, multiplied pairwise by madd (4-bit: PairDot)
  static_assert(!kNibbles<F>);
  __m256i w0, w1;
  explicit BlockDot(const uint8_t* block)
      : w0(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)))),
        w1(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16)))) {}
  __m256i dot(const int16_t* xq) const {
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16));
    return madd_add(_mm256_madd_epi16(w0, x0), w1, x1);
  }
};

// The weights' per-block offsets (q4_1: m, q4_0: d) against x's offset terms, 8 blocks at a time.
template <Format F>
inline float offset_sum(const Weights& w, int64_t r, const float* offset) {
  if constexpr (!kNibbles<F>) return 0.f;
  const uint16_t* o = (F == Format::kQ4_1 ? w.mins : w.d) + r * w.NB;
  __m256 acc = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= w.NB; b += 8)
    acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + b))),
                          _mm256_loadu_ps(offset + b), acc);
  float s = sum8(acc);
  for (; b < w.NB; ++b) s += half_to_float(o[b]) * offset[b];
  return s;
}

// Pair k of a 4-bit row (blocks 2k, 2k + 1; `whole`: else block 2k alone) as int16, in x's paired
// layout: values 0-7, 8-15, 16-23, 24-31 of both blocks (in-lane unpacks, no lane crossing).
struct PairDot {
  __m256i w[4];
  PairDot(const uint8_t* pair, bool whole) {
    const __m256i bytes = whole ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair))
                                : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair)));
    const __m256i nibble = _mm256_set1_epi8(15), zero = _mm256_setzero_si256();
    const __m256i lo = _mm256_and_si256(bytes, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
    w[0] = _mm256_unpacklo_epi8(lo, zero), w[1] = _mm256_unpackhi_epi8(lo, zero);
    w[2] = _mm256_unpacklo_epi8(hi, zero), w[3] = _mm256_unpackhi_epi8(hi, zero);
  }
  // Lanes 0-3: block 2k's products summed in fours; lanes 4-7: block 2k + 1's. x: the pair's first
  // chunk; its chunks are 16 * kPairsPerLoad values apart.
  __m256i dot(const int16_t* x) const {
    constexpr int64_t step = 16 * kPairsPerLoad;
    __m256i s = _mm256_madd_epi16(w[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
    for (int i = 1; i < 4; ++i) s = madd_add(s, w[i], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + step * i)));
    return s;
  }
};

#if EEJAX_VNNI512
// Row r's blocks, d and m asked for ahead of their use (a decode step's rows, kAheadRows ahead): a
// row's streams are short (SmolLM2's q4_1: 360 + 36 + 36 bytes), and the hardware's stream
// prefetch did not keep enough loads in flight (1.10-1.21x a batch-1 decode on an Intel AMX host).
constexpr int64_t kAheadRows = 4;
template <Format F>
inline void prefetch_row(const Weights& w, int64_t r) {
  const auto* qs = reinterpret_cast<const char*>(w.qs + r * w.NB * kBlockBytes<F>);
  for (int64_t i = 0; i < w.NB * kBlockBytes<F>; i += 64) _mm_prefetch(qs + i, _MM_HINT_T0);
  if constexpr (F != Format::kInt8) _mm_prefetch(reinterpret_cast<const char*>(w.d + r * w.NB), _MM_HINT_T0);
  if constexpr (F == Format::kQ4_1) _mm_prefetch(reinterpret_cast<const char*>(w.mins + r * w.NB), _MM_HINT_T0);
}

// A vector's high 256 bits (AVX-512F's 64-bit lane move: no AVX-512DQ needed).
inline __m256 high_half(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

// Pairs k and k + 1 of a 4-bit row (`whole`: else pair k + 1 is one block) as int16 in one vector
// each chunk: pair k in the low 256 bits, pair k + 1 in the high, each laid out as PairDot's.
struct TwoPairDot {
  __m512i w[4];
  TwoPairDot(const uint8_t* pairs, bool whole) {
    const __m512i bytes = whole ? _mm512_loadu_si512(pairs) : _mm512_maskz_loadu_epi8((1ull << 48) - 1, pairs);
    const __m512i nibble = _mm512_set1_epi8(15), zero = _mm512_setzero_si512();
    const __m512i lo = _mm512_and_si512(bytes, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
    w[0] = _mm512_unpacklo_epi8(lo, zero), w[1] = _mm512_unpackhi_epi8(lo, zero);
    w[2] = _mm512_unpacklo_epi8(hi, zero), w[3] = _mm512_unpackhi_epi8(hi, zero);
  }
  // Lanes 0-7: PairDot's lanes for pair k; lanes 8-15: pair k + 1's (the same integers: sums exact).
  __m512i dot(const int16_t* x) const {
    __m512i s = _mm512_madd_epi16(w[0], _mm512_loadu_si512(x));
    for (int i = 1; i < 4; ++i) s = _mm512_dpwssd_epi32(s, w[i], _mm512_loadu_si512(x + 32 * i));
    return s;
  }
};
#endif

// 4-bit weights against int16 x, two blocks per vector (half the conversions and scalings): pair k's
// scales are its weights' d spread (per weight row) times x's dx spread (per call), the same
// products d * dx as the unpaired path's.
#if EEJAX_VNNI512
// Where AVX-512 VNNI is, two pairs a vector: pair k's lanes in the low half (accumulator 0's chain
// below), pair k + 1's in the high (accumulator 1's): each lane computes what the 256-bit loop
// computes. A pair's d spread is a permutation of the row's d in registers.
template <Format F, int G>
void paired_rows(const QuantizedX<int16_t>& qx, int64_t m0, float* y, const Weights& w, int64_t r0, int64_t r1) {
  const int64_t NB = w.NB, pairs = (NB + 1) / 2;
  alignas(32) float d[kMaxBlocks + 8];  // the row's d, then zeros to the next 8 (an odd last block's partner)
  const float* dx = qx.dx_pairs.data() + m0 * pairs * 8;
  const int16_t* xq0 = qx.xq.data() + m0 * qx.stride;
  const __m512i two_pairs = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m256i one_pair = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  for (int64_t r = r0; r < r1; ++r) {
    if (r + kAheadRows < r1) prefetch_row<F>(w, r + kAheadRows);
    const uint16_t* dr = w.d + r * NB;
    int64_t b = 0;
    for (; b + 8 <= NB; b += 8) _mm256_store_ps(d + b, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dr + b))));
    if (b < NB) _mm256_store_ps(d + b, _mm256_cvtph_ps(_mm_maskz_loadu_epi16(__mmask8((1u << (NB - b)) - 1), dr + b)));
    const uint8_t* row = w.qs + r * NB * kBlockBytes<F>;
    __m512 both[G];
    for (int m = 0; m < G; ++m) both[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 2 <= pairs; k += 2) {
      const TwoPairDot wq(row + k * 2 * kBlockBytes<F>, 2 * k + 3 < NB);
      const __m512 dk = _mm512_permutexvar_ps(two_pairs, _mm512_castps128_ps512(_mm_loadu_ps(d + 2 * k)));
      for (int m = 0; m < G; ++m)
        both[m] = _mm512_fmadd_ps(_mm512_mul_ps(dk, _mm512_loadu_ps(dx + m * pairs * 8 + 8 * k)),
                                  _mm512_cvtepi32_ps(wq.dot(xq0 + m * qx.stride + k * 64)), both[m]);
    }
    __m256 acc[G][2];
    for (int m = 0; m < G; ++m) acc[m][0] = _mm512_castps512_ps256(both[m]), acc[m][1] = high_half(both[m]);
    if (k < pairs) {  // the last pair alone (into accumulator 0), as the 256-bit loop takes it
      const PairDot wq(row + k * 2 * kBlockBytes<F>, 2 * k + 1 < NB);
      const __m256 dk = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(d + 2 * k)), one_pair);
      for (int m = 0; m < G; ++m)
        acc[m][0] = _mm256_fmadd_ps(_mm256_mul_ps(dk, _mm256_loadu_ps(dx + m * pairs * 8 + 8 * k)),
                                    _mm256_cvtepi32_ps(wq.dot(xq0 + m * qx.stride + k * 64)), acc[m][0]);
    }
    for (int m = 0; m < G; ++m)
      y[m * w.R + r] = sum8(_mm256_add_ps(acc[m][0], acc[m][1])) + offset_sum<F>(w, r, qx.offset.data() + (m0 + m) * NB);
  }
}
#else
template <Format F, int G>
void paired_rows(const QuantizedX<int16_t>& qx, int64_t m0, float* y, const Weights& w, int64_t r0, int64_t r1) {
  const int64_t NB = w.NB, pairs = (NB + 1) / 2;
  alignas(32) float d[kMaxBlocks], spread[kMaxBlocks / 2 * 8 + 8];
  const float* dx = qx.dx_pairs.data() + m0 * pairs * 8;
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* dr = w.d + r * NB;
    int64_t b = 0;
    for (; b + 8 <= NB; b += 8) _mm256_store_ps(d + b, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dr + b))));
    for (; b < NB; ++b) d[b] = half_to_float(dr[b]);
    spread_pairs(d, NB, spread);
    __m256 acc[G][2];
    for (int m = 0; m < G; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    const int16_t* xq0 = qx.xq.data() + m0 * qx.stride;
    const uint8_t* row = w.qs + r * NB * kBlockBytes<F>;
    auto pair = [&](int64_t k, int a) {  // `a`: which accumulator (two chains hide the FMA's latency)
      const PairDot wq(row + k * 2 * kBlockBytes<F>, 2 * k + 1 < NB);
      const __m256 dk = _mm256_load_ps(spread + 8 * k);
      for (int m = 0; m < G; ++m)
        acc[m][a] = _mm256_fmadd_ps(_mm256_mul_ps(dk, _mm256_loadu_ps(dx + m * pairs * 8 + 8 * k)),
                                    _mm256_cvtepi32_ps(wq.dot(xq0 + m * qx.stride + k * 64)), acc[m][a]);
    };
    int64_t k = 0;
    for (; k + 2 <= pairs; k += 2) pair(k, 0), pair(k + 1, 1);
    if (k < pairs) pair(k, 0);
    for (int m = 0; m < G; ++m) {
      const float s = sum8(_mm256_add_ps(acc[m][0], acc[m][1])) + offset_sum<F>(w, r, qx.offset.data() + (m0 + m) * NB);
      y[m * w.R + r] = s;
    }
  }
}
#endif

// Every other pairing of weights and x: a block per vector, its scale d * dx per row of x.
template <Format F, typename XQ, int G>
void block_rows(const QuantizedX<XQ>& qx, int64_t m0, float* y, const Weights& w, int64_t r0, int64_t r1) {
  alignas(32) float scale[G][kMaxBlocks + 8];  // d * dx per block of this row, for each row of x (rows padded to stay 32-byte aligned)
  for (int64_t r = r0; r < r1; ++r) {
#if EEJAX_VNNI512
    if (r + kAheadRows < r1) prefetch_row<F>(w, r + kAheadRows);
#endif
    for (int m = 0; m < G; ++m) {
      const float* dx = qx.dx.data() + (m0 + m) * w.NB;
      int64_t b = 0;
      if constexpr (F == Format::kInt8) {
        std::memcpy(scale[m], dx, w.NB * sizeof(float));
      } else {
        const uint16_t* d = w.d + r * w.NB;
        for (; b + 8 <= w.NB; b += 8)
          _mm256_store_ps(scale[m] + b, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + b))),
                                                      _mm256_loadu_ps(dx + b)));
#if EEJAX_VNNI512
        if (b < w.NB) {  // the same products, the last few blocks in one masked vector
          const __mmask8 tail = __mmask8((1u << (w.NB - b)) - 1);
          _mm256_mask_storeu_ps(scale[m] + b, tail, _mm256_mul_ps(_mm256_cvtph_ps(_mm_maskz_loadu_epi16(tail, d + b)), _mm256_maskz_loadu_ps(tail, dx + b)));
        }
#else
        for (; b < w.NB; ++b) scale[m][b] = half_to_float(d[b]) * dx[b];
#endif
      }
    }
    __m256 acc[G][2];
    for (int m = 0; m < G; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    const XQ* xq0 = qx.xq.data() + m0 * qx.stride;
    const uint8_t* row = w.qs + r * w.NB * kBlockBytes<F>;
    auto block = [&](int64_t b, int a) {
      const BlockDot<F, XQ> wq(row + b * kBlockBytes<F>);
      for (int m = 0; m < G; ++m)
        acc[m][a] = _mm256_fmadd_ps(_mm256_broadcast_ss(scale[m] + b), _mm256_cvtepi32_ps(wq.dot(xq0 + m * qx.stride + b * 32)), acc[m][a]);
    };
    int64_t b = 0;
#if EEJAX_VNNI512
    if constexpr (std::is_same_v<XQ, int16_t>) {
      // Two blocks a vector: block b's eight sums in the low half (accumulator 0's chain), block
      // b + 1's in the high (accumulator 1's). A block's 32 products go pairwise to 16 lanes; lane l
      // plus lane l + 8 is the 256-bit loop's lane l (the same integers).
      __m512 both[G];
      for (int m = 0; m < G; ++m) both[m] = _mm512_setzero_ps();
      const __m512i two_blocks = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
      for (; b + 2 <= w.NB; b += 2) {
        const __m512i wa = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * 32)));
        const __m512i wb = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * 32 + 32)));
        for (int m = 0; m < G; ++m) {
          const XQ* x = xq0 + m * qx.stride + b * 32;
          const __m512i sa = _mm512_madd_epi16(wa, _mm512_loadu_si512(x)), sb = _mm512_madd_epi16(wb, _mm512_loadu_si512(x + 32));
          const __m512i sums = _mm512_add_epi32(_mm512_shuffle_i64x2(sa, sb, 0x44), _mm512_shuffle_i64x2(sa, sb, 0xEE));
          const __m512 scales = _mm512_permutexvar_ps(two_blocks, _mm512_castps128_ps512(_mm_loadu_ps(scale[m] + b)));
          both[m] = _mm512_fmadd_ps(scales, _mm512_cvtepi32_ps(sums), both[m]);
        }
      }
      for (int m = 0; m < G; ++m) acc[m][0] = _mm512_castps512_ps256(both[m]), acc[m][1] = high_half(both[m]);
    }
#endif
    for (; b + 2 <= w.NB; b += 2) block(b, 0), block(b + 1, 1);
    if (b < w.NB) block(b, 0);
    for (int m = 0; m < G; ++m) {
      const int64_t row = m0 + m;
      const float s = sum8(_mm256_add_ps(acc[m][0], acc[m][1])) + offset_sum<F>(w, r, qx.offset.data() + row * w.NB);
      y[m * w.R + r] = finish(s, w, r, F == Format::kInt8);
    }
  }
}

template <Format F, typename XQ, int G>
void integer_rows(const QuantizedX<XQ>& qx, int64_t m0, float* y, const Weights& w, int64_t r0, int64_t r1) {
  if constexpr (kPaired<F, XQ>)
    paired_rows<F, G>(qx, m0, y, w, r0, r1);
  else
    block_rows<F, XQ, G>(qx, m0, y, w, r0, r1);
}
#else
template <Format F, typename XQ, int G>
void integer_rows(const QuantizedX<XQ>& qx, int64_t m0, float* y, const Weights& w, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r)
    for (int m = 0; m < G; ++m) {
      const int64_t row = m0 + m;
      float s = 0.f;
      for (int64_t b = 0; b < w.NB; ++b) {
        const uint8_t* block = w.qs + (r * w.NB + b) * kBlockBytes<F>;
        int isum = 0;
        for (int j = 0; j < 32; ++j)
          isum += (F == Format::kQ4_0 ? value<F>(block, j) + 8 : value<F>(block, j)) * qx.xq[qx.at(row, b, j)];
        const float d = F == Format::kInt8 ? 1.f : half_to_float(w.d[r * w.NB + b]);
        s += d * qx.dx[row * w.NB + b] * float(isum);
        if constexpr (kNibbles<F>)
          s += half_to_float((F == Format::kQ4_1 ? w.mins : w.d)[r * w.NB + b]) * qx.offset[row * w.NB + b];
      }
      y[m * w.R + r] = finish(s, w, r, F == Format::kInt8);
    }
}
#endif

// ---- a prefill's products: a GEMM over panels of 32 weight rows (AVX-512 VNNI) ------------------

constexpr int64_t kMaxVectorRows = 64;  // more rows of x than this (a prefill) take the GEMM where there is one

#if EEJAX_VNNI512
constexpr int64_t kPanelRows = 32;  // weight rows per panel: two vectors of int32 lanes
constexpr int kPanelGroup = 6;      // rows of x per pass over a panel (24 accumulators: 2-4% faster than 4)

// 32 weight rows decoded for integer products: pairs [NB][16][32] (int32 lane i of pair p of block b
// holds row i's values 2p and 2p + 1 as int16: what vpdpwssd multiplies by a broadcast pair of x),
// with each block's scale [NB][32] (int8 per channel: 1) and q4_1's minimum [NB][32]. Rows past R
// are zeros. q4_0's values carry their -8 (signed), so only q4_1 has an offset term.
struct Panel {
  std::vector<int32_t> pairs;
  std::vector<float> scale, min;
};

// Block b of row r as 32 int16 values in order (the weight values before their scale).
template <Format F>
inline __m512i block_values(const Weights& w, int64_t r, int64_t b) {
  const uint8_t* block = w.qs + (r * w.NB + b) * kBlockBytes<F>;
  alignas(32) uint32_t gathered[8];
  if (kTileable<F> && w.tiled) {  // the row's dwords of the block, 16 lanes apart
    const uint32_t* word = tile_word<F>(w, r, b);
    for (int k = 0; k < kTileWords<F>; ++k) gathered[k] = word[16 * k];
    block = reinterpret_cast<const uint8_t*>(gathered);
  }
  if constexpr (kNibbles<F>) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block)), nibble = _mm_set1_epi8(15);
    const __m256i values = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble), _mm_and_si128(bytes, nibble));
    const __m512i wide = _mm512_cvtepu8_epi16(values);
    return F == Format::kQ4_0 ? _mm512_sub_epi16(wide, _mm512_set1_epi16(8)) : wide;
  } else {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)));
  }
}

// r[i] (16 vectors of 16 int32) transposed in place: lane i of r[j] becomes lane j of r[i].
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  for (int i = 0; i < 16; i += 4)  // r[i + c], 128-bit lane L: column 4L + c of rows i..i + 3
    for (int k = 0; k < 2; ++k)
      r[i + 2 * k] = _mm512_unpacklo_epi64(t[i + k], t[i + k + 2]), r[i + 2 * k + 1] = _mm512_unpackhi_epi64(t[i + k], t[i + k + 2]);
  // Lane L of r[4g + c] goes to lane g of column 4L + c: a 4x4 transpose of 128-bit lanes.
  for (int i = 0; i < 4; ++i)
    for (int k = 0; k < 2; ++k) {
      const int a = i + 8 * k, b = a + 4;  // rows a (0-3, 8-11) and a + 4
      t[a] = _mm512_shuffle_i32x4(r[a], r[b], 0x88), t[b] = _mm512_shuffle_i32x4(r[a], r[b], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    const int a = i, b = i + 8;
    r[a] = _mm512_shuffle_i32x4(t[a], t[b], 0x88), r[b] = _mm512_shuffle_i32x4(t[a], t[b], 0xdd);
  }
}

template <Format F>
void pack_panel(const Weights& w, int64_t r0, Panel& p) {
  const int64_t NB = w.NB;
  p.pairs.resize(NB * 16 * kPanelRows), p.scale.resize(NB * kPanelRows), p.min.resize(NB * kPanelRows);
  for (int64_t half = 0; half < kPanelRows; half += 16)
    for (int64_t b = 0; b < NB; ++b) {
      __m512i rows[16];  // rows half.. half + 15: their 16 pairs, then each pair's 16 rows
      for (int64_t i = 0; i < 16; ++i)
        rows[i] = r0 + half + i < w.R ? block_values<F>(w, r0 + half + i, b) : _mm512_setzero_si512();
      transpose16(rows);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(p.pairs.data() + (b * 16 + j) * kPanelRows + half, rows[j]);
    }
  for (int64_t i = 0; i < kPanelRows; ++i) {
    const int64_t r = r0 + i;
    const bool real = r < w.R;
    for (int64_t b = 0; b < NB; ++b) {
      p.scale[b * kPanelRows + i] = !real ? 0.f : F == Format::kInt8 ? 1.f : half_to_float(w.d[scale_at(w, r, b)]);
      p.min[b * kPanelRows + i] = real && F == Format::kQ4_1 ? half_to_float(w.mins[scale_at(w, r, b)]) : 0.f;
    }
  }
}

// acc plus one block of 16 weight rows (lanes) against one row of x, in the one order every int16
// loop over whole-block sums uses (the GEMM's panels, the tiled loop): q4_1's m * sum(x), then the
// block's integer sums times d * dx. That both call this is what gives a row the same bits in each.
template <Format F>
inline __m512 add_block(__m512 acc, __m512i sums, __m512 scale, __m512 min, float dx, float offset) {
  if constexpr (F == Format::kQ4_1) acc = _mm512_fmadd_ps(min, _mm512_set1_ps(offset), acc);
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(scale, _mm512_set1_ps(dx)), acc);
}

// y[m, r0 + i] for G rows of x from m0 and the panel's rows i < valid: per block, the integer sums in
// int32 lanes (one per weight row), then scaled by d * dx and added, with q4_1's m * sum(x), in block
// order. xq is blocks in order (not paired), int16 whatever x's levels.
template <Format F, int G>
void panel_rows(const QuantizedX<int16_t>& qx, int64_t m0, const Panel& p, const Weights& w, float* y, int64_t r0, int64_t valid) {
  const int64_t NB = w.NB;
  __m512 acc[G][2];
  for (int m = 0; m < G; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < NB; ++b) {
    __m512i sums[G][2];
    for (int m = 0; m < G; ++m) sums[m][0] = sums[m][1] = _mm512_setzero_si512();
    const int32_t* pairs = p.pairs.data() + b * 16 * kPanelRows;
#pragma GCC unroll 4
    for (int j = 0; j < 16; ++j) {
      const __m512i w0 = _mm512_loadu_si512(pairs + j * kPanelRows), w1 = _mm512_loadu_si512(pairs + j * kPanelRows + 16);
      for (int m = 0; m < G; ++m) {
        int32_t two;
        std::memcpy(&two, qx.xq.data() + (m0 + m) * qx.stride + b * 32 + 2 * j, sizeof two);
        const __m512i x = _mm512_set1_epi32(two);
        sums[m][0] = _mm512_dpwssd_epi32(sums[m][0], x, w0);
        sums[m][1] = _mm512_dpwssd_epi32(sums[m][1], x, w1);
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m512 scale = _mm512_loadu_ps(p.scale.data() + b * kPanelRows + 16 * h);
      const __m512 min = _mm512_loadu_ps(p.min.data() + b * kPanelRows + 16 * h);
      for (int m = 0; m < G; ++m) {
        const int64_t at = (m0 + m) * NB + b;
        acc[m][h] = add_block<F>(acc[m][h], sums[m][h], scale, min, qx.dx[at], qx.offset[at]);
      }
    }
  }
  for (int h = 0; h < 2; ++h) {
    const int64_t from = 16 * h, n = std::clamp<int64_t>(valid - from, 0, 16);
    if (!n) continue;
    const __mmask16 mask = __mmask16((1u << n) - 1);
    __m512 row_scale = _mm512_set1_ps(1.f);
    if constexpr (F == Format::kInt8) row_scale = _mm512_maskz_loadu_ps(mask, w.row_scale + r0 + from);
    for (int m = 0; m < G; ++m)
      _mm512_mask_storeu_ps(y + (m0 + m) * w.R + r0 + from, mask, _mm512_mul_ps(acc[m][h], row_scale));
  }
}

template <Format F, int G = kPanelGroup>
void panel_group(int g, const QuantizedX<int16_t>& qx, int64_t m0, const Panel& p, const Weights& w, float* y, int64_t r0, int64_t valid) {
  if constexpr (G > 1)
    if (g < G) return panel_group<F, G - 1>(g, qx, m0, p, w, y, r0, valid);
  panel_rows<F, G>(qx, m0, p, w, y, r0, valid);
}
#endif

// Groups of rows: G = 1..kGroup picked at run time.
template <Format F, int G = kGroup>
void float_group(int g, const float* x, float* y, const Weights& w, int64_t r0, int64_t r1) {
  if constexpr (G > 1)
    if (g < G) return float_group<F, G - 1>(g, x, y, w, r0, r1);
  float_rows<F, G>(x, y, w, r0, r1);
}

template <Format F, typename XQ, int G = kIntegerGroup>
void integer_group(int g, const QuantizedX<XQ>& qx, int64_t m0, float* y, const Weights& w, int64_t r0, int64_t r1) {
  if constexpr (G > 1)
    if (g < G) return integer_group<F, XQ, G - 1>(g, qx, m0, y, w, r0, r1);
  integer_rows<F, XQ, G>(qx, m0, y, w, r0, r1);
}

constexpr int64_t kMaxMatrices = 8;

#if EEJAX_VNNI512
// A prefill's product (M > kMaxVectorRows): x quantized once (int16 storage, x's own levels), the
// matrices' panels split between the threads; each thread decodes a panel once and passes every
// group of x's rows over it.
template <Format F, typename XQ>
ffi::Error PanelMatmul(ffi::ThreadPool& pool, const float* xs, int64_t M, int64_t N, const Weights* ws, float* const* outs,
                       const int64_t* starts) {
  static thread_local QuantizedX<int16_t> caller_qx;
  auto& qx = caller_qx;
  const int64_t NB = ws[0].NB, blocks = M * NB;
  size_x(M, NB, qx, /*paired=*/false);
  const int64_t rounding = eejax::num_parts(pool, (blocks + kMinBlocksPerPart - 1) / kMinBlocksPerPart);
  eejax::run_parts(pool, rounding, [&](int64_t i) { quantize_blocks<F, XQ, int16_t>(xs, NB, qx, blocks * i / rounding, blocks * (i + 1) / rounding); });
  int64_t first_panel[kMaxMatrices + 1] = {0};  // matrix j's panels are [first_panel[j], first_panel[j + 1])
  for (int64_t j = 0; j < N; ++j) first_panel[j + 1] = first_panel[j] + (starts[j + 1] - starts[j] + kPanelRows - 1) / kPanelRows;
  const int64_t panels = first_panel[N];
  const int64_t parts = eejax::num_parts(pool, panels);
  eejax::run_parts(pool, parts, [&](int64_t i) {
    static thread_local Panel panel;  // this thread's, reused
    for (int64_t t = panels * i / parts; t < panels * (i + 1) / parts; ++t) {
      const int64_t j = std::upper_bound(first_panel, first_panel + N + 1, t) - first_panel - 1;
      const Weights& w = ws[j];
      const int64_t r0 = (t - first_panel[j]) * kPanelRows;
      pack_panel<F>(w, r0, panel);
      for (int64_t m = 0; m < M; m += kPanelGroup)
        panel_group<F>(int(std::min<int64_t>(kPanelGroup, M - m)), qx, m, panel, w, outs[j], r0, std::min(kPanelRows, w.R - r0));
    }
  });
  return ffi::Error::Success();
}
#endif

#if EEJAX_VNNI512
// ---- integer x by q4 and q8_0 weights in tiles of 16 rows: decode steps, verify passes, batches ----
//
// A tile's block is kTileWords vectors of 16 dwords (scale_at), one lane per weight row; as bytes,
// eight vectors: q4's four masked and four shifted (vector k values 4k..4k+3 of each row for k < 4,
// 16 + 4(k - 4).. for k >= 4), q8_0's eight as they are (values 4k..4k+3). x's block, held as int16
// (int8 activations' values too, as the GEMM holds them), splits exactly into a signed high byte and an
// unsigned low one (x = 256 hi + lo), so four values of x cost two vpdpbusd for the 16 rows: lo
// (unsigned) times the weights as signed bytes; hi (signed) times them as unsigned bytes, q4's nibbles
// as they are, q8_0's with 128 added (w ^ 0x80), which adds 128 * sum(hi) to be taken back. 256 * hi
// + lo is then the block's exact integer sum (q4_0's -8 times sum(x) taken back too). Each block is
// scaled and added in block order as the GEMM's panel_rows adds it (q4_1's m * sum(x), then sum * (d *
// dx)): a row's bits are the same alone, in a verify, in a batch and prefilled. A block is decoded
// once for up to kIntegerGroup rows of x. int8 activations' x fits a signed byte: one vpdpbusd per four
// values, the weights the unsigned operand (q8_0's with 128 added, 128 * sum(x) taken back) and x the
// signed one; the same exact integer sums, so the same bits, for half the multiply-adds (1.2x faster
// at 3 rows, 1.5x at 5-8 rows on one Zen 4 core, 2026-12-01).

// x's blocks split into bytes: hi [M, NB, 32] (xq >> 8), lo (xq & 255); per block [M, NB] the sums of
// xq and of hi. x of int8 activations (`bytes`): hi holds xq itself, lo and hi_sum stay empty.
struct SplitX {
  std::vector<int8_t> hi;
  std::vector<uint8_t> lo;
  std::vector<int32_t> sum, hi_sum;
};

// qx's first `blocks` blocks (blocks in order, int16) into `out`, sized for them here; `bytes`: every
// value fits a signed byte (int8 activations), kept whole in hi.
inline void split_blocks(const QuantizedX<int16_t>& qx, SplitX& out, int64_t blocks, bool bytes = false) {
  out.hi.resize(blocks * 32), out.sum.resize(blocks);
  if (!bytes) out.lo.resize(blocks * 32), out.hi_sum.resize(blocks);
  for (int64_t i = 0; i < blocks; ++i) {
    const __m512i v = _mm512_loadu_si512(qx.xq.data() + i * 32), hi = bytes ? v : _mm512_srai_epi16(v, 8), one = _mm512_set1_epi16(1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.hi.data() + i * 32), _mm512_cvtepi16_epi8(hi));
    out.sum[i] = _mm512_reduce_add_epi32(_mm512_madd_epi16(v, one));
    if (bytes) continue;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.lo.data() + i * 32), _mm512_cvtepi16_epi8(_mm512_and_si512(v, _mm512_set1_epi16(255))));
    out.hi_sum[i] = _mm512_reduce_add_epi32(_mm512_madd_epi16(hi, one));
  }
}

inline int32_t dword_at(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

constexpr int64_t kTileAhead = 4;  // tile-blocks prefetched ahead (8 and 16 measured no different, 2026-12-01)
// y[m, 16t..16t + 15] for G rows of x from m0 (y rows R apart) and tiles [t0, t1) of a tiled matrix;
// `Bytes`: x split as int8 activations' (`split_blocks`).
template <Format F, int G, bool Bytes>
void tiled_rows(const QuantizedX<int16_t>& qx, const SplitX& x, int64_t m0, float* y, const Weights& w, int64_t t0, int64_t t1) {
  static_assert(kTileable<F>);
  constexpr int64_t kBytes = 16 * kBlockBytes<F>;  // a tile's block
  const int64_t NB = w.NB, last = w.R / 16 * NB;
  const auto* q = reinterpret_cast<const uint32_t*>(w.qs);
  const __m512i nibble = _mm512_set1_epi8(15), top = _mm512_set1_epi8(char(0x80));
  for (int64_t t = t0; t < t1; ++t) {
    __m512 acc[G];
    for (int m = 0; m < G; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < NB; ++b) {
      const int64_t tb = t * NB + b;
      if (tb + kTileAhead < last)  // the stream prefetch alone lagged
        for (int64_t i = 0; i < kBytes; i += 64)
          _mm_prefetch(reinterpret_cast<const char*>(w.qs) + (tb + kTileAhead) * kBytes + i, _MM_HINT_T0);
      __m512i wb[8], wu[8];  // the weights as signed bytes (times lo) and as unsigned ones (times hi, or int8 x)
      if constexpr (kNibbles<F>) {
        for (int k = 0; k < 4; ++k) {
          const __m512i v = _mm512_loadu_si512(q + tb * 64 + 16 * k);
          wb[k] = wu[k] = _mm512_and_si512(v, nibble), wb[4 + k] = wu[4 + k] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        }
      } else {
        for (int k = 0; k < 8; ++k) wb[k] = _mm512_loadu_si512(q + tb * 128 + 16 * k), wu[k] = _mm512_xor_si512(wb[k], top);
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.d + tb * 16)));
      __m512 mn = _mm512_setzero_ps();
      if constexpr (F == Format::kQ4_1) mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.mins + tb * 16)));
      for (int m = 0; m < G; ++m) {
        const int64_t at = (m0 + m) * NB + b;
        const int8_t* hi = x.hi.data() + at * 32;
        __m512i sum;
        if constexpr (Bytes) {  // x itself times the unsigned weights: q8_0's 128 * sum(x) taken back below
          __m512i s0 = _mm512_setzero_si512(), s1 = s0;
          for (int k = 0; k < 8; k += 2) {
            s0 = _mm512_dpbusd_epi32(s0, wu[k], _mm512_set1_epi32(dword_at(hi + 4 * k)));
            s1 = _mm512_dpbusd_epi32(s1, wu[k + 1], _mm512_set1_epi32(dword_at(hi + 4 * k + 4)));
          }
          sum = _mm512_add_epi32(s0, s1);
          if constexpr (F == Format::kQ8_0) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(x.sum[at] * 128));
        } else {
          const uint8_t* lo = x.lo.data() + at * 32;
          __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0;
          for (int k = 0; k < 8; k += 2) {
            h0 = _mm512_dpbusd_epi32(h0, wu[k], _mm512_set1_epi32(dword_at(hi + 4 * k)));
            h1 = _mm512_dpbusd_epi32(h1, wu[k + 1], _mm512_set1_epi32(dword_at(hi + 4 * k + 4)));
            l0 = _mm512_dpbusd_epi32(l0, _mm512_set1_epi32(dword_at(lo + 4 * k)), wb[k]);
            l1 = _mm512_dpbusd_epi32(l1, _mm512_set1_epi32(dword_at(lo + 4 * k + 4)), wb[k + 1]);
          }
          sum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(h0, h1), 8), _mm512_add_epi32(l0, l1));
          if constexpr (F == Format::kQ8_0) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(x.hi_sum[at] * 32768));  // 256 * 128 * sum(hi)
        }
        if constexpr (F == Format::kQ4_0) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(8 * x.sum[at]));
        acc[m] = add_block<F>(acc[m], sum, d, mn, qx.dx[at], qx.offset[at]);
      }
    }
    for (int m = 0; m < G; ++m) _mm512_storeu_ps(y + (m0 + m) * w.R + t * 16, acc[m]);
  }
}

template <Format F, bool Bytes, int G = kIntegerGroup>
void tiled_group(int g, const QuantizedX<int16_t>& qx, const SplitX& x, int64_t m0, float* y, const Weights& w, int64_t t0, int64_t t1) {
  if constexpr (G > 1)
    if (g < G) return tiled_group<F, Bytes, G - 1>(g, qx, x, m0, y, w, t0, t1);
  tiled_rows<F, G, Bytes>(qx, x, m0, y, w, t0, t1);
}

// M rows of x against N tiled matrices: x quantized once (XQ's levels, int16 storage, as the GEMM
// takes it) and split, the matrices' tiles one range that the threads split.
template <Format F, typename XQ>
ffi::Error TiledProducts(ffi::ThreadPool& pool, const float* xs, int64_t M, int64_t N, const Weights* ws, float* const* outs) {
  static thread_local QuantizedX<int16_t> caller_qx;  // this caller's, reused (references: the parts capture them)
  static thread_local SplitX caller_split;
  auto& qx = caller_qx;
  auto& sx = caller_split;
  const int64_t NB = ws[0].NB, blocks = M * NB;
  size_x(M, NB, qx, /*paired=*/false);
  quantize_blocks<F, XQ, int16_t>(xs, NB, qx, 0, blocks);
  constexpr bool kBytesX = std::is_same_v<XQ, int8_t>;  // int8 activations: x fits a signed byte
  split_blocks(qx, sx, blocks, kBytesX);
  int64_t first_tile[kMaxMatrices + 1] = {0};  // matrix j's tiles are [first_tile[j], first_tile[j + 1])
  for (int64_t j = 0; j < N; ++j) first_tile[j + 1] = first_tile[j] + ws[j].R / 16;
  const int64_t tiles = first_tile[N];
  const int64_t work = tiles * 16 * NB * ((M + kIntegerGroup - 1) / kIntegerGroup);
  const int64_t parts = eejax::num_parts(pool, std::min(tiles, (work + kMinBlocksPerPart - 1) / kMinBlocksPerPart));
  eejax::run_parts(pool, parts, [&](int64_t i) {
    const int64_t lo = tiles * i / parts, hi = tiles * (i + 1) / parts;
    for (int64_t j = 0; j < N; ++j) {
      const int64_t t0 = std::max(lo, first_tile[j]) - first_tile[j], t1 = std::min(hi, first_tile[j + 1]) - first_tile[j];
      for (int64_t t = t0; t < t1; ++t)  // a tile's blocks stay in L1 while every group of x passes
        for (int64_t m = 0; m < M; m += kIntegerGroup)
          tiled_group<F, kBytesX>(int(std::min<int64_t>(kIntegerGroup, M - m)), qx, sx, m, outs[j], ws[j], t, t + 1);
    }
  });
  return ffi::Error::Success();
}
#endif

// x [M, K] against N matrices (ws; matrix j's rows are [starts[j], starts[j + 1]) of all rows) ->
// outs[j] [M, R_j]: an eejax_quantized_* call's work once its buffers are read.
template <Format F, typename XQ>
ffi::Error Products(ffi::ThreadPool& pool, const float* xs, int64_t M, int64_t K, int64_t N, const Weights* ws,
                    float* const* outs, const int64_t* starts, bool gemm) {
  const int64_t R = starts[N], NB = K / 32;
  if (M < 1 || R < 1) return ffi::Error::Success();
  constexpr bool kInteger = !std::is_same_v<XQ, float>;
  if (kInteger && NB > kMaxBlocks) return ffi::Error::InvalidArgument("eejax_quantized: rows longer than 16384");
  for (int64_t j = 0; j < N; ++j)
    if (ws[j].tiled != ws[0].tiled || (ws[j].tiled && ws[j].R % 16))
      return ffi::Error::InvalidArgument("eejax_quantized: tiled and untiled matrices in one call, or a tile short of 16 rows");
#if EEJAX_VNNI512
  if constexpr (kInteger)
    if (M > kMaxVectorRows || gemm) return PanelMatmul<F, XQ>(pool, xs, M, N, ws, outs, starts);
  if constexpr (kTileable<F> && kInteger)
    if (ws[0].tiled) return TiledProducts<F, XQ>(pool, xs, M, N, ws, outs);
#endif
  if (ws[0].tiled)
    return ffi::Error::InvalidArgument("eejax_quantized: tiled weights take integer x on a CPU with AVX-512 VNNI");
  // This caller's buffers, reused from call to call. A reference, which the parts capture: in a
  // helper's thread the name would be the helper's own.
  static thread_local QuantizedX<std::conditional_t<kInteger, XQ, int8_t>> caller_qx;
  auto& qx = caller_qx;
  if constexpr (kInteger) quantize_x<F, XQ>(xs, M, NB, qx);
  // A part is at least kMinBlocksPerPart blocks of work: waking a helper costs more than a small product.
  const int group = kInteger ? kIntegerGroup : kGroup;
  const int64_t work = R * NB * ((M + group - 1) / group);
  const int64_t parts = eejax::num_parts(pool, std::min((R + kRowsPerTile - 1) / kRowsPerTile, (work + kMinBlocksPerPart - 1) / kMinBlocksPerPart));
  eejax::run_parts(pool, parts, [&](int64_t i) {
    const int64_t lo = R * i / parts, hi = R * (i + 1) / parts;
    for (int64_t j = 0; j < N; ++j) {  // the part's rows of matrix j
      const Weights& w = ws[j];
      const int64_t r0 = std::max(lo, starts[j]) - starts[j], r1 = std::min(hi, starts[j + 1]) - starts[j];
      for (int64_t t = r0; t < r1; t += kRowsPerTile)
        for (int64_t m = 0; m < M; m += group) {
          const int g = int(std::min<int64_t>(group, M - m));
          const int64_t t1 = std::min(r1, t + kRowsPerTile);
          if constexpr (kInteger)
            integer_group<F, XQ>(g, qx, m, outs[j] + m * w.R, w, t, t1);
          else
            float_group<F>(g, xs + m * K, outs[j] + m * w.R, w, t, t1);
        }
    }
  });
  return ffi::Error::Success();
}

// x [M, K] f32 against N matrices that share it (a layer's q, k and v; its gate and up), each
// given as three buffers: qs [R, NB, block bytes]; scales [R, NB] f16 (int8: [R, 1] f32); mins
// [R, NB] f16 (q4_1; else any buffer) -> N results y [M, R]. One call: x is quantized once and
// the matrices' rows are one range that the threads split. XQ: how x is taken (float: as it is;
// int8_t, int16_t: quantized per block). `gemm` (a prefill's product, integer x, where the GEMM is
// built): the GEMM at any number of rows, so that a prompt's rows get the same bits whether the
// prompt is prefilled alone, in a batch or in chunks (the few-row loops sum in another order).
template <Format F, typename XQ>
ffi::Error QuantizedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs args, ffi::RemainingRets rets,
                           bool gemm, bool tiled) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("eejax_quantized: x must be 2-D");
  const int64_t M = xd[0], K = xd[1], N = int64_t(rets.size());
  if (N < 1 || N > kMaxMatrices || int64_t(args.size()) != 3 * N)
    return ffi::Error::InvalidArgument("eejax_quantized: give 1 to 8 matrices, three buffers each, one result each");
  if (K % 32) return ffi::Error::InvalidArgument("eejax_quantized: x's rows must be whole blocks of 32");
  Weights ws[kMaxMatrices];
  float* outs[kMaxMatrices];
  int64_t starts[kMaxMatrices + 1] = {0};  // matrix j's rows are [starts[j], starts[j + 1]) of all rows
  for (int64_t j = 0; j < N; ++j) {
    auto qs = args.get<ffi::AnyBuffer>(3 * j), scales = args.get<ffi::AnyBuffer>(3 * j + 1),
         mins = args.get<ffi::AnyBuffer>(3 * j + 2);
    auto y = rets.get<ffi::Buffer<ffi::F32>>(j);
    if (!qs || !scales || !mins || !y) return ffi::Error::InvalidArgument("eejax_quantized: bad buffers");
    const auto qd = qs->dimensions();
    if (qd.size() != 3 || qd[1] * qd[2] * (kNibbles<F> ? 2 : 1) != K)
      return ffi::Error::InvalidArgument("eejax_quantized: x and the blocks do not contract");
    ws[j] = weights_of(F == Format::kInt8, F == Format::kQ4_1, qs->untyped_data(), scales->untyped_data(),
                       mins->untyped_data(), qd[0], K / 32, tiled && kTileable<F>);
    outs[j] = (*y)->typed_data();
    starts[j + 1] = starts[j] + qd[0];
  }
  return Products<F, XQ>(pool, x.typed_data(), M, K, N, ws, outs, starts, gemm);
}

// qs, scales, mins (as above) -> the rows [R, K] as float32, exactly as `quantized.dequantize_rows`
// computes them (a prefill's product: XLA's GEMM over them; XLA's own dequantisation took ~7x longer).
template <Format F>
ffi::Error Dequantize(ffi::ThreadPool pool, ffi::AnyBuffer qs, ffi::AnyBuffer scales, ffi::AnyBuffer mins,
                      ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = qs.dimensions();
  if (qd.size() != 3) return ffi::Error::InvalidArgument("eejax_dequantize: qs must be 3-D");
  const int64_t R = qd[0], NB = qd[1] * qd[2] * (kNibbles<F> ? 2 : 1) / 32, K = NB * 32;
  const Weights w = weights_of(F == Format::kInt8, F == Format::kQ4_1, qs.untyped_data(), scales.untyped_data(),
                               mins.untyped_data(), R, NB);
  float* y = out->typed_data();
  const int64_t parts = eejax::num_parts(pool, std::min((R + kRowsPerTile - 1) / kRowsPerTile, (R * NB + kMinBlocksPerPart - 1) / kMinBlocksPerPart));
  eejax::run_parts(pool, parts, [&](int64_t i) {
    for (int64_t r = R * i / parts; r < R * (i + 1) / parts; ++r)
      for (int64_t b = 0; b < NB; ++b) {
        float* dst = y + r * K + b * 32;
#if EEJAX_AVX2
        __m256 v[4];
        dequantize_block<F>(w, r, b, v);
        const __m256 row_scale = _mm256_set1_ps(F == Format::kInt8 ? w.row_scale[r] : 1.f);
        for (int j = 0; j < 4; ++j) _mm256_storeu_ps(dst + 8 * j, F == Format::kInt8 ? _mm256_mul_ps(row_scale, v[j]) : v[j]);
#else
        const uint8_t* block = w.qs + (r * NB + b) * kBlockBytes<F>;
        const float d = F == Format::kInt8 ? w.row_scale[r] : half_to_float(w.d[r * NB + b]);
        const float mn = F == Format::kQ4_1 ? half_to_float(w.mins[r * NB + b]) : 0.f;
        for (int j = 0; j < 32; ++j) {
          const float q = float(value<F>(block, j));
          dst[j] = F == Format::kQ4_1 ? d * q + mn : d * q;
        }
#endif
      }
  });
  return ffi::Error::Success();
}

}  // namespace

ffi::Error eejax::quantized_products(ffi::ThreadPool& pool, Activations activations, const float* x, int64_t M, int64_t K,
                                     const BlockMatrix* matrices, int64_t N, float* const* outs) {
  if (N < 1 || N > kMaxMatrices || K % 32) return ffi::Error::InvalidArgument("eejax: 1 to 8 matrices of whole blocks");
  Weights ws[kMaxMatrices];
  int64_t starts[kMaxMatrices + 1] = {0};
  const BlockFormat format = matrices[0].format;
  for (int64_t j = 0; j < N; ++j) {
    const BlockMatrix& m = matrices[j];
    if (m.format != format) return ffi::Error::InvalidArgument("eejax: matrices in one product call share a format");
    if (m.tiled != matrices[0].tiled) return ffi::Error::InvalidArgument("eejax: tiled and untiled matrices in one product call");
    ws[j] = weights_of(format == BlockFormat::kInt8, format == BlockFormat::kQ4_1, m.qs, m.scales, m.mins, m.rows, K / 32,
                       m.tiled && format != BlockFormat::kInt8);
    starts[j + 1] = starts[j] + m.rows;
  }
  auto run = [&](auto format_tag) -> ffi::Error {
    constexpr Format F = decltype(format_tag)::value;
    switch (activations) {
      case Activations::kFloat32:
        return Products<F, float>(pool, x, M, K, N, ws, outs, starts, false);
      case Activations::kInt8:
        return Products<F, int8_t>(pool, x, M, K, N, ws, outs, starts, false);
      case Activations::kInt16:
        return Products<F, int16_t>(pool, x, M, K, N, ws, outs, starts, false);
    }
    return ffi::Error::InvalidArgument("eejax: unknown activations");
  };
  switch (format) {
    case BlockFormat::kQ4_0:
      return run(std::integral_constant<Format, Format::kQ4_0>{});
    case BlockFormat::kQ4_1:
      return run(std::integral_constant<Format, Format::kQ4_1>{});
    case BlockFormat::kQ8_0:
      return run(std::integral_constant<Format, Format::kQ8_0>{});
    case BlockFormat::kInt8:
      return run(std::integral_constant<Format, Format::kInt8>{});
  }
  return ffi::Error::InvalidArgument("eejax: unknown block format");
}

#define EEJAX_DEQUANTIZE_HANDLER(name, format)                                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, Dequantize<format>, ffi::Ffi::Bind()             \
                                                              .Ctx<ffi::ThreadPool>()  \
                                                              .Arg<ffi::AnyBuffer>()   \
                                                              .Arg<ffi::AnyBuffer>()   \
                                                              .Arg<ffi::AnyBuffer>()   \
                                                              .Ret<ffi::Buffer<ffi::F32>>())

EEJAX_DEQUANTIZE_HANDLER(EejaxDequantizeQ4_0, Format::kQ4_0);
EEJAX_DEQUANTIZE_HANDLER(EejaxDequantizeQ4_1, Format::kQ4_1);
EEJAX_DEQUANTIZE_HANDLER(EejaxDequantizeQ8_0, Format::kQ8_0);
EEJAX_DEQUANTIZE_HANDLER(EejaxDequantizeInt8, Format::kInt8);

#define EEJAX_QUANTIZED_HANDLER(name, format, activations)                                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (QuantizedMatmul<format, activations>), ffi::Ffi::Bind() \
                                                                             .Ctx<ffi::ThreadPool>() \
                                                                             .Arg<ffi::Buffer<ffi::F32>>() \
                                                                             .RemainingArgs()        \
                                                                             .RemainingRets()        \
                                                                             .Attr<bool>("gemm")     \
                                                                             .Attr<bool>("tiled"))

#define EEJAX_QUANTIZED_HANDLERS(format_name, format)                          \
  EEJAX_QUANTIZED_HANDLER(EejaxQuantized##format_name##F32, format, float);   \
  EEJAX_QUANTIZED_HANDLER(EejaxQuantized##format_name##Q8, format, int8_t);   \
  EEJAX_QUANTIZED_HANDLER(EejaxQuantized##format_name##Q16, format, int16_t)

EEJAX_QUANTIZED_HANDLERS(Q4_0, Format::kQ4_0);
EEJAX_QUANTIZED_HANDLERS(Q4_1, Format::kQ4_1);
EEJAX_QUANTIZED_HANDLERS(Q8_0, Format::kQ8_0);
EEJAX_QUANTIZED_HANDLERS(Int8, Format::kInt8);
