// Attention of a few new queries per row against one layer of the paged KV cache, on a CPU: the
// decode step's and a verify pass's attention in one call per layer, reading keys and values in
// place from their pages (XLA's jnp reference gathered the row's pages into a copy first, then ran
// half a dozen ops over it: ~6 of a SmolLM2 decode step's 12 ms at batch 1 on this 2-core CPU).
//
//   q [B, T, Hq, Dh] f32, k/v cache [L, Hkv, P, S, Dh] f32, layer s32[], block_table [B, M] s32,
//   q_positions [B, T] s32, kv_len [B] s32 -> out [B, T, Hq, Dh] f32
//
// Query (b, t, h) attends to the keys of row b at positions p < kv_len[b] and p <= q_positions[b, t]
// with KV head h / (Hq / Hkv) (GQA); a query with no key gets zeros. Each query is computed alone,
// keys in order (scores, then their max, then exp and the weighted values), so its result does not
// depend on how many queries share the call: a verify pass and a decode step agree bit for bit.
// The queries are split between the pool's threads (cpu_parts.h); a query's weighted values are
// summed in registers, and its rows are prefetched a page ahead.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_parts.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

struct Shapes {
  int64_t B, T, Hq, Dh, L, Hkv, P, S, M;
};

#if defined(__AVX2__) && defined(__FMA__)
inline float dot(const float* a, const float* b, int64_t n) {  // n % 8 == 0: 8 lanes, then their sum
  __m256 acc = _mm256_setzero_ps();
  for (int64_t d = 0; d < n; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
inline void axpy(float w, const float* x, float* y, int64_t n) {  // y += w * x, n % 8 == 0
  const __m256 wv = _mm256_set1_ps(w);
  for (int64_t d = 0; d < n; d += 8) _mm256_storeu_ps(y + d, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + d), _mm256_loadu_ps(y + d)));
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
  for (int j = 0; j < 4; ++j) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[j]), _mm256_extractf128_ps(acc[j], 1));
    const __m128 q2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
    out[j] = _mm_cvtss_f32(_mm_add_ss(q2, _mm_movehdup_ps(q2)));
  }
}

// out[0, n) = sum over keys p of w[p] * v(p)[0, n), summed in key order per lane, in registers
// (kChunk lanes at a time): the same sums as `axpy` key after key.
template <typename Row>
void weighted_values(const float* w, int64_t keys, Row v, int64_t n, float* out) {
  constexpr int64_t kChunk = 64;
  for (int64_t d0 = 0; d0 < n; d0 += kChunk) {
    const int64_t width = std::min(kChunk, n - d0), vectors = width / 8;
    __m256 acc[kChunk / 8];
    for (int64_t j = 0; j < vectors; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t p = 0; p < keys; ++p) {
      if (d0 == 0 && p + 8 < keys) prefetch_row(v(p + 8), n);
      const __m256 wp = _mm256_set1_ps(w[p]);
      const float* vp = v(p) + d0;
      for (int64_t j = 0; j < vectors; ++j) acc[j] = _mm256_fmadd_ps(wp, _mm256_loadu_ps(vp + 8 * j), acc[j]);
    }
    for (int64_t j = 0; j < vectors; ++j) _mm256_storeu_ps(out + d0 + 8 * j, acc[j]);
  }
}
#else
inline void dot4(const float* q, const float* const k[4], int64_t n, float out[4]) {
  for (int j = 0; j < 4; ++j) out[j] = dot(q, k[j], n);
}
template <typename Row>
void weighted_values(const float* w, int64_t keys, Row v, int64_t n, float* out) {
  std::fill(out, out + n, 0.f);
  for (int64_t p = 0; p < keys; ++p) axpy(w[p], v(p), out, n);
}
#endif

// Query (b, t, h) against its keys: scores, softmax in key order, weighted values. `scores`
// holds at least the query's keys.
void attend_query(const Shapes& n, const float* q, const float* k, const float* v, int64_t layer, const int32_t* table,
                  const int32_t* positions, int64_t kv_len, int64_t b, int64_t t, int64_t h, float scale, float* out,
                  std::vector<float>& scores) {
  const int64_t Dh = n.Dh, kv = h / (n.Hq / n.Hkv);
  const int64_t head_base = (layer * n.Hkv + kv) * n.P;  // page index base of this layer and head
  // as the reference's mask: keys < kv_len and <= the query's position, within the row's M pages
  const int64_t keys = std::max<int64_t>(0, std::min<int64_t>({kv_len, int64_t(positions[b * n.T + t]) + 1, n.M * n.S}));
  const float* query = q + ((b * n.T + t) * n.Hq + h) * Dh;
  float* output = out + ((b * n.T + t) * n.Hq + h) * Dh;
  auto row = [&](const float* cache, int64_t p) {  // a page id outside the cache reads the null page 0
    const int64_t page = table[b * n.M + p / n.S];
    return cache + ((head_base + (page >= 0 && page < n.P ? page : 0)) * n.S + p % n.S) * Dh;
  };
  if (keys == 0) return std::fill(output, output + Dh, 0.f);
  scores.resize(keys);
  float* s = scores.data();
  int64_t p = 0;
  for (; p + 4 <= keys; p += 4) {
    const float* kp[4] = {row(k, p), row(k, p + 1), row(k, p + 2), row(k, p + 3)};
    if (p + 16 < keys) prefetch_row(row(k, p + 16), Dh);
    float d[4];
    dot4(query, kp, Dh, d);
    for (int j = 0; j < 4; ++j) s[p + j] = d[j] * scale;
  }
  for (; p < keys; ++p) s[p] = dot(query, row(k, p), Dh) * scale;
  float best = -INFINITY, total = 0.f;
  for (p = 0; p < keys; ++p) best = std::max(best, s[p]);
  for (p = 0; p < keys; ++p) total += s[p] = std::exp(s[p] - best);
  for (p = 0; p < keys; ++p) s[p] /= total;
  weighted_values(s, keys, [&](int64_t i) { return row(v, i); }, Dh, output);
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                          ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> block_table,
                          ffi::Buffer<ffi::S32> q_positions, ffi::Buffer<ffi::S32> kv_len, ffi::ResultBuffer<ffi::F32> out,
                          float scale) {
  const auto qd = q.dimensions(), cd = k_cache.dimensions(), td = block_table.dimensions();
  if (qd.size() != 4 || cd.size() != 5 || td.size() != 2)
    return ffi::Error::InvalidArgument("eejax_paged_attention: q is 4-D, the caches 5-D, the block table 2-D");
  const Shapes n{qd[0], qd[1], qd[2], qd[3], cd[0], cd[1], cd[2], cd[3], td[1]};
  if (cd[4] != n.Dh || n.Hq % n.Hkv || td[0] != n.B)
    return ffi::Error::InvalidArgument("eejax_paged_attention: shapes do not agree");
  if (n.Dh % kLanes) return ffi::Error::InvalidArgument("eejax_paged_attention: head size must be a multiple of 8");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= n.L) return ffi::Error::InvalidArgument("eejax_paged_attention: layer out of range");
  const int64_t units = n.B * n.T * n.Hq;  // queries, in the order of q's rows
  const int64_t parts = eejax::num_parts(pool, units);
  eejax::run_parts(pool, parts, [&](int64_t i) {
    static thread_local std::vector<float> scores;  // the running thread's, kept from call to call
    for (int64_t u = units * i / parts; u < units * (i + 1) / parts; ++u) {
      const int64_t b = u / (n.T * n.Hq), t = u / n.Hq % n.T, h = u % n.Hq;
      attend_query(n, q.typed_data(), k_cache.typed_data(), v_cache.typed_data(), l, block_table.typed_data(),
                   q_positions.typed_data(), kv_len.typed_data()[b], b, t, h, scale, out->typed_data(), scores);
    }
  });
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
                                  .Attr<float>("scale"));
