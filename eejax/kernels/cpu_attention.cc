// Attention of a few new queries per row against one layer of the paged KV cache, on a CPU: the
// decode step's and a verify pass's attention in one call per layer, reading each key and value
// once from its page (XLA's jnp reference gathered the row's pages into a copy first, then ran
// half a dozen ops over it: ~6 of a SmolLM2 decode step's 12 ms at batch 1 on this 2-core CPU).
//
//   q [B, T, Hq, Dh] f32, k/v cache [L, Hkv, P, S, Dh] f32, layer s32[], block_table [B, M] s32,
//   q_positions [B, T] s32, kv_len [B] s32 -> out [B, T, Hq, Dh] f32
//
// Query (b, t, h) attends to the keys of row b at positions p < kv_len[b] and p <= q_positions[b, t]
// with KV head h / (Hq / Hkv) (GQA); a query with no key gets zeros. Each query is computed alone,
// keys in order (scores, then their max, then exp and the weighted values), so its result does not
// depend on how many queries share the call: a verify pass and a decode step agree bit for bit.
// (row, KV head) pairs are split between the pool's threads (cpu_parts.h).

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

// One row's queries against one KV head: the T x G queries of (b, kv), each over its own keys. A
// key's row is read once for all queries that see it.
void attend_head(const Shapes& n, const float* q, const float* k, const float* v, int64_t layer, const int32_t* table,
                 const int32_t* positions, int64_t kv_len, int64_t b, int64_t kv, float scale, float* out,
                 std::vector<float>& scores) {
  const int64_t G = n.Hq / n.Hkv, Dh = n.Dh, Q = n.T * G;
  const int64_t head_base = (layer * n.Hkv + kv) * n.P;  // page index base of this layer and head
  int64_t keys_of[64], most = 0;  // keys each query sees (Q <= 64: see the caller)
  for (int64_t t = 0; t < n.T; ++t)
    for (int64_t g = 0; g < G; ++g) {
      // as the reference's mask: keys < kv_len and <= the query's position, within the row's M pages
      const int64_t visible = std::min<int64_t>({kv_len, int64_t(positions[b * n.T + t]) + 1, n.M * n.S});
      keys_of[t * G + g] = std::max<int64_t>(0, visible);
      most = std::max(most, keys_of[t * G + g]);
    }
  auto query = [&](int64_t i) { return q + ((b * n.T + i / G) * n.Hq + kv * G + i % G) * Dh; };
  auto output = [&](int64_t i) { return out + ((b * n.T + i / G) * n.Hq + kv * G + i % G) * Dh; };
  auto row = [&](const float* cache, int64_t p) {  // a page id outside the cache reads the null page 0
    const int64_t page = table[b * n.M + p / n.S];
    return cache + ((head_base + (page >= 0 && page < n.P ? page : 0)) * n.S + p % n.S) * Dh;
  };
  scores.resize(Q * std::max<int64_t>(most, 1));
  for (int64_t p = 0; p < most; ++p) {
    const float* kp = row(k, p);
    for (int64_t i = 0; i < Q; ++i)
      if (p < keys_of[i]) scores[i * most + p] = dot(query(i), kp, Dh) * scale;
  }
  for (int64_t i = 0; i < Q; ++i) {  // softmax over each query's keys, in key order
    float* s = scores.data() + i * most;
    float best = -INFINITY, total = 0.f;
    for (int64_t p = 0; p < keys_of[i]; ++p) best = std::max(best, s[p]);
    for (int64_t p = 0; p < keys_of[i]; ++p) total += s[p] = std::exp(s[p] - best);
    for (int64_t p = 0; p < keys_of[i]; ++p) s[p] /= total;
    std::fill(output(i), output(i) + Dh, 0.f);
  }
  for (int64_t p = 0; p < most; ++p) {
    const float* vp = row(v, p);
    for (int64_t i = 0; i < Q; ++i)
      if (p < keys_of[i]) axpy(scores[i * most + p], vp, output(i), Dh);
  }
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
  if (n.Dh % kLanes || n.T * (n.Hq / n.Hkv) > 64)
    return ffi::Error::InvalidArgument("eejax_paged_attention: head size must be a multiple of 8, queries per KV head <= 64");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= n.L) return ffi::Error::InvalidArgument("eejax_paged_attention: layer out of range");
  const int64_t units = n.B * n.Hkv;
  const int64_t parts = eejax::num_parts(pool, units);
  eejax::run_parts(pool, parts, [&](int64_t i) {
    std::vector<float> scores;
    for (int64_t u = units * i / parts; u < units * (i + 1) / parts; ++u) {
      const int64_t b = u / n.Hkv, kv = u % n.Hkv;
      attend_head(n, q.typed_data(), k_cache.typed_data(), v_cache.typed_data(), l, block_table.typed_data(),
                  q_positions.typed_data(), kv_len.typed_data()[b], b, kv, scale, out->typed_data(), scores);
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
