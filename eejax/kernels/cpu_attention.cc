// Attention of a few new queries per row against one layer of the paged KV cache, on a CPU: the
// decode step's and a verify pass's attention in one call per layer, reading keys and values in
// place from their pages (XLA's jnp reference gathered the row's pages into a copy first, then ran
// half a dozen ops over it: ~6 of a SmolLM2 decode step's 12 ms at batch 1 on this 2-core CPU).
//
//   q [B, T, Hq, Dh] f32, k/v cache [L, Hkv, P, S, Dh] f32, layer s32[], block_table [B, M] s32,
//   q_positions [B, T] s32, kv_len [B] s32 -> out [B, T, Hq, Dh] f32
//
// Query (b, t, h) attends to the keys of row b at positions p < kv_len[b] and p <= q_positions[b, t]
// (and, with a window W > 0, p > q_positions[b, t] - W) with KV head h / (Hq / Hkv) (GQA); a query
// with no key gets zeros. Each query's sums run in the
// same order whatever else the call holds (its scores key by key, the softmax 8 keys a vector,
// its weighted values per lane in key order), so its result does not depend on how many queries
// share the call: a verify pass, a decode step and a prefill agree bit for bit. The queries go
// in tiles of a row's consecutive positions times the heads of one KV head (up to 32 queries: a
// prefill's tile reads each key and value row once for all of them, from memory, then from L1),
// split between the pool's threads (cpu_parts.h). Scores go 4 queries x 4 keys a block (2 or 3
// left over in one more), weighted values 3 queries x 64 values in registers (5 with AVX-512: a
// verify of up to 5 positions reads each value row once a head); rows are prefetched a page ahead.
// With AVX-512 the same sums run in 16-lane vectors (two keys' 8-lane score sums a vector, 16
// values' weighted sums a vector): a query's result is the same bits, from about half the
// instructions.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_parts.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

using Shapes = eejax::AttentionShapes;

#if defined(__AVX2__) && defined(__FMA__)
inline float horizontal_sum(__m256 v) {  // lanes summed in a fixed order
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
// out[i] = horizontal_sum(v[i]) for 8 vectors, the same adds in the same order, done 8 at a time:
// each vector's halves added, then lanes 0 + 2 and 1 + 3, then those two.
inline void horizontal_sums(const __m256 v[8], float out[8]) {
  __m256 h[4];  // h[i]: v[2i]'s halves added (low 128 bits), v[2i + 1]'s (high)
  for (int i = 0; i < 4; ++i)
    h[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20), _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
  __m256 q[2];  // per 128 bits: lanes 0 + 2 and 1 + 3 of h[2i] (lanes 0, 1) and h[2i + 1] (lanes 2, 3)
  for (int i = 0; i < 2; ++i)
    q[i] = _mm256_add_ps(_mm256_shuffle_ps(h[2 * i], h[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(h[2 * i], h[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // lanes: v0 v2 v4 v6 | v1 v3 v5 v7
  const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(q[0], q[1], _MM_SHUFFLE(2, 0, 2, 0)), _mm256_shuffle_ps(q[0], q[1], _MM_SHUFFLE(3, 1, 3, 1)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, r);
  for (int i = 0; i < 4; ++i) out[2 * i] = lanes[i], out[2 * i + 1] = lanes[4 + i];
}
inline float dot(const float* a, const float* b, int64_t n) {  // n % 8 == 0: 8 lanes, then their sum
  __m256 acc = _mm256_setzero_ps();
  for (int64_t d = 0; d < n; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  return horizontal_sum(acc);
}
constexpr int64_t kLanes = 8;
#else
inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}
inline void axpy(float w, const float* x, float* y, int64_t n) {
  for (int64_t d = 0; d < n; ++d) y[d] += w * x[d];
}
constexpr int64_t kLanes = 1;
#endif

// Asks for a key's or value's row ahead of its use: the hardware's prefetcher stops at each 4 KiB
// page, and a cache page's rows are that long (16 keys of 64 floats).
inline void prefetch_row(const float* row, int64_t n) {
  for (int64_t d = 0; d < n; d += 16) __builtin_prefetch(row + d);
}

// Scores of one query against keys [p, p + 4): four dots at once (one query load for four keys,
// four independent chains), each summed exactly as `dot` sums it.
#if defined(__AVX2__) && defined(__FMA__)
inline void dot4(const float* q, const float* const k[4], int64_t n, float out[4]) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t d = 0; d < n; d += 8) {
    const __m256 qd = _mm256_loadu_ps(q + d);
    for (int j = 0; j < 4; ++j) acc[j] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k[j] + d), acc[j]);
  }
  for (int j = 0; j < 4; ++j) out[j] = horizontal_sum(acc[j]);
}

// Scores of Q queries against keys [p, p + 4) at once (Q query loads and four key loads feed 4Q
// chains), each summed exactly as `dot` sums it: out[i][j] = q[i] . k[j].
template <int Q>
inline void dots(const float* const* q, const float* const k[4], int64_t n, float out[][4]) {
  __m256 acc[Q][4];
  for (int i = 0; i < Q; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < n; d += 8) {
    __m256 kd[4];
    for (int j = 0; j < 4; ++j) kd[j] = _mm256_loadu_ps(k[j] + d);
    for (int i = 0; i < Q; ++i) {
      const __m256 qd = _mm256_loadu_ps(q[i] + d);
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_fmadd_ps(qd, kd[j], acc[i][j]);
    }
  }
  static_assert(Q % 2 == 0);
  for (int i = 0; i < Q; i += 2) horizontal_sums(&acc[i][0], &out[i][0]);
}
#if defined(__AVX512F__) && defined(__AVX512DQ__)
// Keys a and b's values [d, d + 8) in one 16-lane vector (a's in the low half).
inline __m512 key_pair(const float* a, const float* b, int64_t d) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a + d)), _mm256_loadu_ps(b + d), 1);
}

// `dot4` with two keys a 16-lane vector, as `dots16` (the same sums).
inline void dot4_16(const float* q, const float* const k[4], int64_t n, float out[4]) {
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t d = 0; d < n; d += 8) {
    const __m512 qd = _mm512_broadcast_f32x8(_mm256_loadu_ps(q + d));
    for (int j = 0; j < 2; ++j) acc[j] = _mm512_fmadd_ps(qd, key_pair(k[2 * j], k[2 * j + 1], d), acc[j]);
  }
  for (int j = 0; j < 2; ++j) {
    out[2 * j] = horizontal_sum(_mm512_castps512_ps256(acc[j]));
    out[2 * j + 1] = horizontal_sum(_mm512_extractf32x8_ps(acc[j], 1));
  }
}
// `dots` with two keys a 16-lane vector (keys 2j and 2j + 1 in its halves): each key's 8 lanes take
// the same FMAs in the same order as in `dots`, with half the instructions.
template <int Q>
inline void dots16(const float* const* q, const float* const k[4], int64_t n, float out[][4]) {
  __m512 acc[Q][2];
  for (int i = 0; i < Q; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t d = 0; d < n; d += 8) {
    __m512 kd[2];
    for (int j = 0; j < 2; ++j) kd[j] = key_pair(k[2 * j], k[2 * j + 1], d);
    for (int i = 0; i < Q; ++i) {
      const __m512 qd = _mm512_broadcast_f32x8(_mm256_loadu_ps(q[i] + d));
      for (int j = 0; j < 2; ++j) acc[i][j] = _mm512_fmadd_ps(qd, kd[j], acc[i][j]);
    }
  }
  static_assert(Q % 2 == 0);
  for (int i = 0; i < Q; i += 2) {
    __m256 halves[8];  // query i's keys 0..3, then query i + 1's, as `dots` holds them
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 2; ++j) {
        halves[4 * h + 2 * j] = _mm512_castps512_ps256(acc[i + h][j]);
        halves[4 * h + 2 * j + 1] = _mm512_extractf32x8_ps(acc[i + h][j], 1);
      }
    horizontal_sums(halves, &out[i][0]);
  }
}
#endif

// A vector of 8 or 16 floats and the operations the weighted values take on it.
struct Lanes8 {
  using V = __m256;
  static constexpr int kLanes = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V broadcast(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
};
#if defined(__AVX512F__)
struct Lanes16 {
  using V = __m512;
  static constexpr int kLanes = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V broadcast(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
};
#endif

// outs[g][d0, d0 + lanes x V) = sum over keys lo[g] <= p < keys[g] of w[g * stride + p] * v(p)[...]
// for G queries (keys[] not decreasing), in registers: one value load feeds G FMAs. Each value's
// sum is one chain of FMAs in key order, whatever the vector's width (L: `Lanes8`, `Lanes16`).
template <typename L, int G, int V, typename Row>
inline void values_block(const float* w, int64_t stride, const int64_t* lo, const int64_t* keys, Row v, int64_t d0, bool prefetch,
                         int64_t n, float* const* outs) {
  typename L::V acc[G][V];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < V; ++j) acc[g][j] = L::zero();
  int first = 0;  // queries [0, first) have summed all their keys
  int64_t start = lo[0];
  for (int g = 1; g < G; ++g) start = std::min(start, lo[g]);
  for (int64_t p = start; p < keys[G - 1]; ++p) {
    if (prefetch && p + 8 < keys[G - 1]) prefetch_row(v(p + 8), n);
    while (keys[first] <= p) ++first;
    const float* vp = v(p) + d0;
    typename L::V wp[G];
    for (int g = 0; g < G; ++g) wp[g] = L::broadcast(w[g * stride + p]);
    for (int j = 0; j < V; ++j) {
      const typename L::V vd = L::load(vp + L::kLanes * j);
      for (int g = 0; g < G; ++g)
        if (g >= first && p >= lo[g]) acc[g][j] = L::fmadd(wp[g], vd, acc[g][j]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < V; ++j) L::store(outs[g] + d0 + L::kLanes * j, acc[g][j]);
}

// outs[g][0, n) = sum over keys lo[g] <= p < keys[g] of w[g * stride + p] * v(p)[0, n) for each of
// `queries` queries that share the values (keys[] not decreasing), summed in key order per lane:
// each query's sums are those of one query alone, key after key. 64 values of a row at a time,
// in registers: 5 queries x 4 vectors of 16 with AVX-512 (one pass over the values for a verify
// of up to 5 positions), else 3 queries x 8 vectors of 8; a head size not a multiple of 64 goes 8
// values and 3 queries at a time.
template <typename Row>
void weighted_values(const float* w, int64_t stride, int queries, const int64_t* lo, const int64_t* keys, Row v, int64_t n,
                     float* const* outs) {
#if defined(__AVX512F__)
  using Wide = Lanes16;  // 64 values: 4 vectors
  constexpr int kVectors = 4, kWideGroup = 5;
#else
  using Wide = Lanes8;  // 64 values: 8 vectors
  constexpr int kVectors = 8, kWideGroup = 3;
#endif
  const bool wide = n % 64 == 0;
  const int most = wide ? kWideGroup : 3;
  for (int g = 0; g < queries; g += most) {
    const int group = std::min(most, queries - g);
    const float* wg = w + g * stride;
    auto pass = [&](auto block, int64_t step) {
      for (int64_t d0 = 0; d0 < n; d0 += step) block(wg, stride, lo + g, keys + g, v, d0, d0 == 0, n, outs + g);
    };
    if (wide) {
#if defined(__AVX512F__)
      if (group == 5) pass(values_block<Wide, 5, kVectors, Row>, 64);
      else if (group == 4) pass(values_block<Wide, 4, kVectors, Row>, 64);
      else
#endif
      if (group == 3) pass(values_block<Wide, 3, kVectors, Row>, 64);
      else if (group == 2) pass(values_block<Wide, 2, kVectors, Row>, 64);
      else pass(values_block<Wide, 1, kVectors, Row>, 64);
    } else {
      if (group == 3) pass(values_block<Lanes8, 3, 1, Row>, 8);
      else if (group == 2) pass(values_block<Lanes8, 2, 1, Row>, 8);
      else pass(values_block<Lanes8, 1, 1, Row>, 8);
    }
  }
}

// e^x for x <= 0 (a score minus its row's largest), 8 lanes, within ~2 ulp: x = k ln2 + r with
// |r| <= ln2 / 2 (ln2 in two parts), e^r by Cephes' degree-7 polynomial, times 2^k; e^x for
// x < -87.3 (below float's normal range) is taken at -87.3 (~1e-38).
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.33654f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

// s[0, keys) -> their softmax: e^(s - max) over the sum, 8 keys at a time (the last < 8 through
// a padded vector); the sum's lanes in key order, then across lanes in a fixed order.
inline void softmax(float* s, int64_t keys) {
  const int64_t whole = keys / 8 * 8;
  __m256 top = _mm256_set1_ps(-INFINITY);
  for (int64_t p = 0; p < whole; p += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(s + p));
  float best = -INFINITY;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  for (float x : lanes) best = std::max(best, x);
  for (int64_t p = whole; p < keys; ++p) best = std::max(best, s[p]);
  const __m256 bestv = _mm256_set1_ps(best);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t p = 0; p < whole; p += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + p), bestv));
    _mm256_storeu_ps(s + p, e);
    sum = _mm256_add_ps(sum, e);
  }
  float total = horizontal_sum(sum);
  if (whole < keys) {
    alignas(32) float tail[8];
    for (int64_t j = 0; j < 8; ++j) tail[j] = whole + j < keys ? s[whole + j] : best;
    _mm256_store_ps(tail, exp_nonpositive(_mm256_sub_ps(_mm256_load_ps(tail), bestv)));
    for (int64_t p = whole; p < keys; ++p) total += s[p] = tail[p - whole];
  }
  const __m256 totalv = _mm256_set1_ps(total);
  for (int64_t p = 0; p < whole; p += 8) _mm256_storeu_ps(s + p, _mm256_div_ps(_mm256_loadu_ps(s + p), totalv));
  for (int64_t p = whole; p < keys; ++p) s[p] /= total;
}
#else
inline void dot4(const float* q, const float* const k[4], int64_t n, float out[4]) {
  for (int j = 0; j < 4; ++j) out[j] = dot(q, k[j], n);
}
template <int Q>
inline void dots(const float* const* q, const float* const k[4], int64_t n, float out[][4]) {
  for (int i = 0; i < Q; ++i) dot4(q[i], k, n, out[i]);
}
template <typename Row>
void weighted_values(const float* w, int64_t stride, int queries, const int64_t* lo, const int64_t* keys, Row v, int64_t n,
                     float* const* outs) {
  for (int g = 0; g < queries; ++g) {
    std::fill(outs[g], outs[g] + n, 0.f);
    for (int64_t p = lo[g]; p < keys[g]; ++p) axpy(w[g * stride + p], v(p), outs[g], n);
  }
}
inline void softmax(float* s, int64_t keys) {
  float best = -INFINITY, total = 0.f;
  for (int64_t p = 0; p < keys; ++p) best = std::max(best, s[p]);
  for (int64_t p = 0; p < keys; ++p) total += s[p] = std::exp(s[p] - best);
  for (int64_t p = 0; p < keys; ++p) s[p] /= total;
}
#endif

// Scores of one query, or of four, against four keys: two keys a 16-lane vector where the CPU has
// AVX-512 (`dot4_16`, `dots16`: the same sums in the same order, half the instructions).
inline void scores_of_one(const float* q, const float* const k[4], int64_t n, float out[4]) {
#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX2__) && defined(__FMA__)
  dot4_16(q, k, n, out);
#else
  dot4(q, k, n, out);
#endif
}
template <int Q>
inline void scores_of(const float* const* q, const float* const k[4], int64_t n, float out[][4]) {
#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX2__) && defined(__FMA__)
  dots16<Q>(q, k, n, out);
#else
  dots<Q>(q, k, n, out);
#endif
}
// Scores of `count` (1..4) queries against four keys in one pass over the keys: three go as four,
// the third query's pointer taken twice (its second scores dropped; each query's sums are its own).
inline void scores_of_up_to_four(const float* const* q, int count, const float* const k[4], int64_t n, float out[][4]) {
  if (count == 1) return scores_of_one(q[0], k, n, out[0]);
  if (count == 2) return scores_of<2>(q, k, n, out);
  const float* four[4] = {q[0], q[1], q[2], q[count == 4 ? 3 : 2]};
  float scores[4][4];
  scores_of<4>(four, k, n, scores);
  std::copy(&scores[0][0], &scores[0][0] + 4 * count, &out[0][0]);
}

// A part reads at least this many cached values (keys and values, 32 KiB of float32): handing a
// smaller call's queries to helpers costs more than it saves (a decode step's attention at batch 1
// waits on memory for its rows: ~5 us a KV head at 70 keys on one thread). Each query is one
// part's whole, so the parts never change a result.
constexpr int64_t kMinValuesPerPart = 8192;

// Queries (b, t, h) for t in [t0, t0 + positions) and h in [h0, h0 + heads), heads of one KV head,
// against their keys: scores, softmax, weighted values. Each query's sums are those it would have
// alone; the tile reads each key and value row once (queries at later positions see more keys).
// `scores` holds at least positions x heads x keys.
constexpr int kMaxGroup = 8;     // heads of a KV head per tile
constexpr int kMaxQueries = 32;  // queries per tile (positions x heads)
void attend_queries(const Shapes& n, const float* q, const float* k, const float* v, int64_t layer,
                    const int32_t* table, const int32_t* positions, int64_t kv_len, int64_t b, int64_t t0, int64_t tiles,
                    int64_t h0, int heads, float scale, int64_t window, float* out, std::vector<float>& scores) {
  const int64_t Dh = n.Dh, kv = h0 / (n.Hq / n.Hkv);
  const int64_t head_base = (layer * n.Hkv + kv) * n.P;  // page index base of this layer and head
  const int queries = int(tiles) * heads;
  const float* qs[kMaxQueries];
  float* outputs[kMaxQueries];
  int64_t keys[kMaxQueries], first_key[kMaxQueries];
  int order[kMaxQueries];  // the queries by their number of keys (stable)
  for (int i = 0; i < queries; ++i) {
    const int64_t t = t0 + i / heads, h = h0 + i % heads;
    qs[i] = q + ((b * n.T + t) * n.Hq + h) * Dh;
    outputs[i] = out + ((b * n.T + t) * n.Hq + h) * Dh;
    // as the reference's mask: keys < kv_len and <= the query's position, within the row's M pages
    keys[i] = std::max<int64_t>(0, std::min<int64_t>({kv_len, int64_t(positions[b * n.T + t]) + 1, n.M * n.S}));
    first_key[i] = window > 0 ? std::max<int64_t>(0, int64_t(positions[b * n.T + t]) - window + 1) : 0;
    order[i] = i;
  }
  std::stable_sort(order, order + queries, [&](int a, int c) { return keys[a] < keys[c]; });
  const float* sq[kMaxQueries];
  float* souts[kMaxQueries];
  int64_t skeys[kMaxQueries], slo[kMaxQueries];
  int live = 0;  // queries with at least one key, in `order`
  for (int i = 0; i < queries; ++i) {
    const int j = order[i];
    if (keys[j] <= first_key[j]) {
      std::fill(outputs[j], outputs[j] + Dh, 0.f);
      continue;
    }
    sq[live] = qs[j], souts[live] = outputs[j], skeys[live] = keys[j], slo[live] = first_key[j], ++live;
  }
  if (live == 0) return;
  auto row = [&](const float* cache, int64_t p) {  // a page id outside the cache reads the null page 0
    const int64_t page = table[b * n.M + p / n.S];
    return cache + ((head_base + (page >= 0 && page < n.P ? page : 0)) * n.S + p % n.S) * Dh;
  };
  const int64_t most = skeys[live - 1];
  scores.resize(live * most);
  float* s = scores.data();
  int whole = 0;  // queries [whole, live) have keys [p, p + 4)
  int64_t p = *std::min_element(slo, slo + live) / 4 * 4;  // scores below a query's first key go unused
  for (; p + 4 <= most; p += 4) {
    const float* kp[4] = {row(k, p), row(k, p + 1), row(k, p + 2), row(k, p + 3)};
    if (p + 16 < most) prefetch_row(row(k, p + 16), Dh);
    while (whole < live && skeys[whole] < p + 4) ++whole;
    for (int g = whole; g < live; g += 4) {
      const int count = std::min(4, live - g);
      float d[4][4];
      scores_of_up_to_four(sq + g, count, kp, Dh, d);
      for (int i = 0; i < count; ++i)
        for (int j = 0; j < 4; ++j) s[(g + i) * most + p + j] = d[i][j] * scale;
    }
    for (int g = 0; g < whole; ++g)  // a query whose keys end inside these four: key by key, as alone
      for (int64_t j = p; j < skeys[g]; ++j) s[g * most + j] = dot(sq[g], kp[j - p], Dh) * scale;
  }
  for (int g = 0; g < live; ++g)
    for (int64_t j = std::max(p, skeys[g] / 4 * 4); j < skeys[g]; ++j) s[g * most + j] = dot(sq[g], row(k, j), Dh) * scale;
  for (int g = 0; g < live; ++g) softmax(s + g * most + slo[g], skeys[g] - slo[g]);
  weighted_values(s, most, live, slo, skeys, [&](int64_t i) { return row(v, i); }, Dh, souts);
}

}  // namespace

void eejax::paged_attention(ffi::ThreadPool& pool, const AttentionShapes& n, const float* q, const float* k_cache,
                            const float* v_cache, int64_t layer, const int32_t* block_table, const int32_t* positions,
                            const int32_t* kv_len, float scale, int64_t window, float* out) {
  // Work in tiles: a row's consecutive positions times heads of one KV head (at most kMaxGroup
  // heads and kMaxQueries queries), in the order (row, positions, heads).
  int64_t values = 0;  // cached keys and values read (a KV head's queries share them), at most
  for (int64_t b = 0; b < n.B; ++b)
    values += std::clamp<int64_t>(kv_len[b], 0, n.M * n.S) * n.T * n.Hkv * 2 * n.Dh;
  // Fewer tiles of a KV head's heads than twice the threads (a decode step at batch 1: one a KV
  // head) and more than one part's work: a tile per head instead, which the threads can share
  // evenly. Each reads its KV head's keys and values (from memory once, then from the caches); a
  // query's sums are the same.
  const int64_t group = n.Hq / n.Hkv, threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t wanted = (values + kMinValuesPerPart - 1) / kMinValuesPerPart;  // parts, at most
  auto tiles = [&](int64_t heads) {
    const int64_t span = std::max<int64_t>(1, kMaxQueries / heads);
    return n.B * ((n.T + span - 1) / span) * n.Hkv * ((group + heads - 1) / heads);
  };
  int64_t heads = std::min<int64_t>(group, kMaxGroup);
  if (wanted > 1 && tiles(heads) < 2 * threads) heads = 1;
  const int64_t chunks_per_kv = (group + heads - 1) / heads, chunks = n.Hkv * chunks_per_kv;  // runs of heads
  const int64_t span = std::max<int64_t>(1, kMaxQueries / heads), spans = (n.T + span - 1) / span;
  const int64_t units = n.B * spans * chunks;
  const int64_t parts = eejax::num_parts(pool, std::clamp<int64_t>(wanted, 1, std::max<int64_t>(1, units)));
  eejax::run_parts(pool, parts, [&](int64_t i) {
    static thread_local std::vector<float> scores;  // the running thread's, kept from call to call
    for (int64_t u = units * i / parts; u < units * (i + 1) / parts; ++u) {
      const int64_t b = u / (spans * chunks), t0 = u / chunks % spans * span, c = u % chunks;
      const int64_t h0 = c / chunks_per_kv * group + c % chunks_per_kv * heads;
      const int64_t h1 = std::min(h0 + heads, (c / chunks_per_kv + 1) * group);
      attend_queries(n, q, k_cache, v_cache, layer, block_table,
                     positions, kv_len[b], b, t0, std::min(span, n.T - t0), h0, int(h1 - h0),
                     scale, window, out, scores);
    }
  });
}

namespace {

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                          ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> block_table,
                          ffi::Buffer<ffi::S32> q_positions, ffi::Buffer<ffi::S32> kv_len, ffi::ResultBuffer<ffi::F32> out,
                          float scale, int64_t window) {
  const auto qd = q.dimensions(), cd = k_cache.dimensions(), td = block_table.dimensions();
  if (qd.size() != 4 || cd.size() != 5 || td.size() != 2)
    return ffi::Error::InvalidArgument("eejax_paged_attention: q is 4-D, the caches 5-D, the block table 2-D");
  const Shapes n{qd[0], qd[1], qd[2], qd[3], cd[0], cd[1], cd[2], cd[3], td[1]};
  if (cd[4] != n.Dh || n.Hq % n.Hkv || td[0] != n.B)
    return ffi::Error::InvalidArgument("eejax_paged_attention: shapes do not agree");
  if (n.Dh % kLanes) return ffi::Error::InvalidArgument("eejax_paged_attention: head size must be a multiple of 8");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= n.L) return ffi::Error::InvalidArgument("eejax_paged_attention: layer out of range");
  eejax::paged_attention(pool, n, q.typed_data(), k_cache.typed_data(), v_cache.typed_data(), l, block_table.typed_data(),
                         q_positions.typed_data(), kv_len.typed_data(), scale, window, out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EejaxPagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window"));
