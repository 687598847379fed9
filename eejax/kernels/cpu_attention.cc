// Attention of a few new queries per row against one layer of the paged KV cache, on a CPU: the
// decode step's and a verify pass's attention in one call per layer, reading keys and values in
// place from their pages (XLA's jnp reference gathered the row's pages into a copy first, then ran
// half a dozen ops over it: ~6 of a SmolLM2 decode step's 12 ms at batch 1 on this 2-core CPU).
//
//   q [B, T, Hq, Dh] f32, k/v cache [L, Hkv, P, S, Dh] f32, layer s32[], block_table [B, M] s32,
//   q_positions [B, T] s32, kv_len [B] s32 -> out [B, T, Hq, Dh] f32
//
// Query (b, t, h) attends to the keys of row b at positions p < kv_len[b] and p <= q_positions[b, t]
// with KV head h / (Hq / Hkv) (GQA); a query with no key gets zeros. Each query's sums run in the
// same order whatever else the call holds (its scores key by key, the softmax 8 keys a vector,
// its weighted values per lane in key order), so its result does not depend on how many queries
// share the call: a verify pass and a decode step agree bit for bit. The queries are split
// between the pool's threads (cpu_parts.h); a thread takes its queries in runs of the heads of
// one KV head, which read each key and value row once (from memory, then from L1) and sum their
// weighted values in registers; rows are prefetched a page ahead.

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
inline float horizontal_sum(__m256 v) {  // lanes summed in a fixed order
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
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

// outs[g][0, n) = sum over keys p of w[g * stride + p] * v(p)[0, n) for each of `heads` heads
// that share the values, summed in key order per lane, in registers (at most kAccumulators
// vectors at a time): each head's sums are those of one head alone, key after key. The group
// reads each value row once.
constexpr int kAccumulators = 12;
template <typename Row>
void weighted_values(const float* w, int64_t stride, int heads, int64_t keys, Row v, int64_t n, float* const* outs) {
  const int64_t per_head = std::max<int64_t>(1, std::min<int64_t>(n / 8, kAccumulators / heads));
  for (int64_t d0 = 0; d0 < n; d0 += 8 * per_head) {
    const int64_t vectors = std::min(8 * per_head, n - d0) / 8;
    __m256 acc[kAccumulators];
    for (int64_t j = 0; j < heads * vectors; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t p = 0; p < keys; ++p) {
      if (d0 == 0 && p + 8 < keys) prefetch_row(v(p + 8), n);
      const float* vp = v(p) + d0;
      for (int g = 0; g < heads; ++g) {
        const __m256 wp = _mm256_set1_ps(w[g * stride + p]);
        for (int64_t j = 0; j < vectors; ++j)
          acc[g * vectors + j] = _mm256_fmadd_ps(wp, _mm256_loadu_ps(vp + 8 * j), acc[g * vectors + j]);
      }
    }
    for (int g = 0; g < heads; ++g)
      for (int64_t j = 0; j < vectors; ++j) _mm256_storeu_ps(outs[g] + d0 + 8 * j, acc[g * vectors + j]);
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
template <typename Row>
void weighted_values(const float* w, int64_t stride, int heads, int64_t keys, Row v, int64_t n, float* const* outs) {
  for (int g = 0; g < heads; ++g) {
    std::fill(outs[g], outs[g] + n, 0.f);
    for (int64_t p = 0; p < keys; ++p) axpy(w[g * stride + p], v(p), outs[g], n);
  }
}
inline void softmax(float* s, int64_t keys) {
  float best = -INFINITY, total = 0.f;
  for (int64_t p = 0; p < keys; ++p) best = std::max(best, s[p]);
  for (int64_t p = 0; p < keys; ++p) total += s[p] = std::exp(s[p] - best);
  for (int64_t p = 0; p < keys; ++p) s[p] /= total;
}
#endif

// A part reads at least this many cached values (keys and values, 128 KiB of float32): handing a
// smaller call's queries to helpers costs more than it saves. Each query is one part's whole, so
// the parts never change a result.
constexpr int64_t kMinValuesPerPart = 32768;

// Queries (b, t, h0 .. h0 + heads - 1), heads of one KV head, against their keys: scores, softmax,
// weighted values. Each query's sums are those it would have alone; the group reads each key
// and value row once. `scores` holds at least heads x keys.
constexpr int kMaxGroup = 8;
void attend_queries(const Shapes& n, const float* q, const float* k, const float* v, int64_t layer,
                    const int32_t* table, const int32_t* positions, int64_t kv_len, int64_t b, int64_t t, int64_t h0,
                    int heads, float scale, float* out, std::vector<float>& scores) {
  const int64_t Dh = n.Dh, kv = h0 / (n.Hq / n.Hkv);
  const int64_t head_base = (layer * n.Hkv + kv) * n.P;  // page index base of this layer and head
  // as the reference's mask: keys < kv_len and <= the query's position, within the row's M pages
  const int64_t keys = std::max<int64_t>(0, std::min<int64_t>({kv_len, int64_t(positions[b * n.T + t]) + 1, n.M * n.S}));
  const float* queries[kMaxGroup];
  float* outputs[kMaxGroup];
  for (int g = 0; g < heads; ++g) {
    queries[g] = q + ((b * n.T + t) * n.Hq + h0 + g) * Dh;
    outputs[g] = out + ((b * n.T + t) * n.Hq + h0 + g) * Dh;
  }
  auto row = [&](const float* cache, int64_t p) {  // a page id outside the cache reads the null page 0
    const int64_t page = table[b * n.M + p / n.S];
    return cache + ((head_base + (page >= 0 && page < n.P ? page : 0)) * n.S + p % n.S) * Dh;
  };
  if (keys == 0) {
    for (int g = 0; g < heads; ++g) std::fill(outputs[g], outputs[g] + Dh, 0.f);
    return;
  }
  scores.resize(heads * keys);
  float* s = scores.data();
  int64_t p = 0;
  for (; p + 4 <= keys; p += 4) {
    const float* kp[4] = {row(k, p), row(k, p + 1), row(k, p + 2), row(k, p + 3)};
    if (p + 16 < keys) prefetch_row(row(k, p + 16), Dh);
    for (int g = 0; g < heads; ++g) {
      float d[4];
      dot4(queries[g], kp, Dh, d);
      for (int j = 0; j < 4; ++j) s[g * keys + p + j] = d[j] * scale;
    }
  }
  for (; p < keys; ++p)
    for (int g = 0; g < heads; ++g) s[g * keys + p] = dot(queries[g], row(k, p), Dh) * scale;
  for (int g = 0; g < heads; ++g) softmax(s + g * keys, keys);
  weighted_values(s, keys, heads, keys, [&](int64_t i) { return row(v, i); }, Dh, outputs);
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
  const int64_t units = n.B * n.T * n.Hq, group = n.Hq / n.Hkv;  // queries, in the order of q's rows
  int64_t values = 0;  // cached keys and values read (a KV head's queries share them), at most
  for (int64_t b = 0; b < n.B; ++b)
    values += std::clamp<int64_t>(kv_len.typed_data()[b], 0, n.M * n.S) * n.T * n.Hkv * 2 * n.Dh;
  const int64_t parts = eejax::num_parts(pool, std::clamp<int64_t>((values + kMinValuesPerPart - 1) / kMinValuesPerPart, 1, std::max<int64_t>(1, units)));
  eejax::run_parts(pool, parts, [&](int64_t i) {
    static thread_local std::vector<float> scores;  // the running thread's, kept from call to call
    // this part's queries, in runs of at most kMaxGroup heads of one KV head
    for (int64_t u = units * i / parts, end = units * (i + 1) / parts, heads; u < end; u += heads) {
      const int64_t b = u / (n.T * n.Hq), t = u / n.Hq % n.T, h = u % n.Hq;
      heads = std::min<int64_t>({end - u, group - h % group, kMaxGroup});
      attend_queries(n, q.typed_data(), k_cache.typed_data(), v_cache.typed_data(), l, block_table.typed_data(),
                     q_positions.typed_data(), kv_len.typed_data()[b], b, t, h, int(heads), scale, out->typed_data(),
                     scores);
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
