// The elementwise arithmetic of a decode step on a CPU whose bits must not depend on the program
// it runs in: RMSNorm, the rotary embedding (its tables and the rotation) and SiLU(gate) * up.
//
// Why not XLA's. XLA:CPU compiles with floating-point contraction on: a multiply feeding an add may
// become one fused multiply-add, and which multiply it fuses depends on how the program around it
// was fused. The same rotation x cos + r sin became fma(r, sin, x cos) in a one-step decode
// program and fma(x, cos, r sin) in a four-step one (SmolLM2, layer 0's key of the first decoded
// token), so the two programs' tokens parted after a few steps with int8 activations; its exp also
// rounds a vector's tail elements otherwise than its body. Here every result is one fixed
// expression of its inputs, whatever the shape, the row's neighbours or the caller:
//   eejax_rms_norm:  y[n, :] = w * (x[n, :] * (1 / sqrt(sum(x[n, :]^2) / D + eps)))
//                    (the sum: 8 lanes of fused multiply-adds over the row in order, then the lanes
//                    added pairwise in a fixed tree)
//   eejax_rope_tables: cos, sin [N, Dh] of positions [N] and inverse frequencies [Dh / 2]: the angle
//                    float(p) * f (one rounded product, as HF computes it), then libm's cosf / sinf
//                    (XLA's vectorised cos and sin round some elements otherwise by shape)
//   eejax_rope:      y = x * cos + rotate_half(x) * sin, each product rounded, then added
//   eejax_silu_mul:  y = g / (1 + e^-g) * u, e^x by Cephes' polynomial, 16 elements a vector and
//                    the tail as one more (-g clamped to [-87.3, 88.3]: a gate below -88 gives
//                    ~-1e-37, not -0)
//   eejax_argmax:    i[n] = the first index of x[n, :]'s largest value, a NaN the largest (jnp.argmax):
//                    one pass, each lane keeping its first largest value and where it was, then
//                    the lanes' best (XLA:CPU's two reductions over SmolLM2's 49152 logits took
//                    ~75 us a row; its variadic argmax ~245)
// This file is compiled with contraction off (-ffp-contract=off: `cpu_matmul.SOURCE_FLAGS`), so what
// is written is what runs; a fused multiply-add is one where std::fma says so.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_kernels.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 8;

float sum_of_squares(const float* x, int64_t D) {
  float lane[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes)
    for (int j = 0; j < kLanes; ++j) lane[j] = std::fma(x[d + j], x[d + j], lane[j]);
  for (int j = 0; d < D; ++d, ++j) lane[j] = std::fma(x[d], x[d], lane[j]);
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int j = 0; j < width; ++j) lane[j] = lane[j] + lane[j + width];
  return lane[0];
}

ffi::Error RmsNorm(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y,
                               float eps) {
  const int64_t D = w.element_count();
  if (D < 1 || x.element_count() % D) return ffi::Error::InvalidArgument("eejax_rms_norm: x's rows are not w's width");
  eejax::rms_norm_rows(x.typed_data(), w.typed_data(), y->typed_data(), x.element_count() / D, D, eps);
  return ffi::Error::Success();
}

ffi::Error Rope(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                            ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const int64_t tables = cos.element_count();
  if (xd.size() < 2 || tables == 0 || sin.element_count() != tables || x.element_count() % tables)
    return ffi::Error::InvalidArgument("eejax_rope: x must be [..., H, Dh] against cos and sin [..., Dh]");
  const int64_t Dh = xd.back();
  if (Dh % 2 || tables % Dh) return ffi::Error::InvalidArgument("eejax_rope: the head size must be even, the tables' too");
  eejax::rope_rows(x.typed_data(), cos.typed_data(), sin.typed_data(), y->typed_data(), x.element_count() / Dh,
                   x.element_count() / tables, Dh);
  return ffi::Error::Success();
}

ffi::Error RopeTables(ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::F32> inv_freq,
                                  ffi::ResultBuffer<ffi::F32> cos, ffi::ResultBuffer<ffi::F32> sin) {
  const int64_t N = positions.element_count(), half = inv_freq.element_count(), Dh = 2 * half;
  if (cos->element_count() != N * Dh || sin->element_count() != N * Dh)
    return ffi::Error::InvalidArgument("eejax_rope_tables: the tables must be [positions, 2 x frequencies]");
  const int32_t* p = positions.typed_data();
  const float* f = inv_freq.typed_data();
  float *c = cos->typed_data(), *s = sin->typed_data();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < half; ++j) {
      const float angle = float(p[n]) * f[j];
      c[n * Dh + j] = c[n * Dh + half + j] = std::cos(angle);
      s[n * Dh + j] = s[n * Dh + half + j] = std::sin(angle);
    }
  return ffi::Error::Success();
}

// 16 floats as one value (GCC's vector extension: the widest vectors -march=native has), so that
// every element, a row's tail included, goes through the same instructions.
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

// e^x for x in [-87.3, 88.3], within 2 ulp (Cephes' expf: x = k ln2 + r with k the nearest integer,
// e^r by a degree-7 polynomial, times 2^k; every product rounded).
inline v16 exp_of(v16 x) {
  const v16 k = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest (|k| < 2^22)
  const v16 r = (x - k * 0.693359375f) + k * 2.12194440e-4f;
  v16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  const i16 bits = (__builtin_convertvector(k, i16) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// 16 elements of SiLU(g) * u (e^-g clamped to a float's range: a gate below -88 gives ~-1e-37).
inline v16 silu_mul16(v16 g, v16 u) {
  v16 e = -g;
  e = e < -87.3f ? v16{} - 87.3f : e;
  e = e > 88.3f ? v16{} + 88.3f : e;
  return g / (1.f + exp_of(e)) * u;
}

}  // namespace

void eejax::rms_norm_rows(const float* xs, const float* ws, float* out, int64_t N, int64_t D, float eps) {
  for (int64_t n = 0; n < N; ++n) {
    const float* row = xs + n * D;
    const float inverse = 1.f / std::sqrt(sum_of_squares(row, D) / float(D) + eps);
    for (int64_t d = 0; d < D; ++d) out[n * D + d] = ws[d] * (row[d] * inverse);
  }
}

void eejax::rope_rows(const float* xs, const float* c, const float* s, float* out, int64_t N, int64_t heads, int64_t Dh) {
  const int64_t half = Dh / 2;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t at = n * Dh, row = n / heads * Dh;  // a row's H heads share its tables
    for (int64_t d = 0; d < Dh; ++d) {
      const float rotated = d < half ? -xs[at + d + half] : xs[at + d - half];
      const float a = xs[at + d] * c[row + d];
      const float b = rotated * s[row + d];
      out[at + d] = a + b;
    }
  }
}

void eejax::silu_mul_values(const float* gs, const float* us, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    v16 a, b;
    std::memcpy(&a, gs + i, sizeof a);
    std::memcpy(&b, us + i, sizeof b);
    const v16 v = silu_mul16(a, b);
    std::memcpy(out + i, &v, sizeof v);
  }
  if (i < n) {  // the tail through the same instructions, zero-padded
    v16 a{}, b{};
    std::memcpy(&a, gs + i, (n - i) * sizeof(float));
    std::memcpy(&b, us + i, (n - i) * sizeof(float));
    const v16 v = silu_mul16(a, b);
    std::memcpy(out + i, &v, (n - i) * sizeof(float));
  }
}

namespace {

// The first index of row[0..V)'s largest value, the first NaN if there is one (jnp.argmax's).
int32_t row_argmax(const float* row, int64_t V) {
  int64_t i = 0;
  float best = -INFINITY;
  int64_t at = 0;
#if defined(__AVX512F__)
  if (V >= 16) {
    __m512 lane_best = _mm512_set1_ps(-INFINITY);
    __m512i lane_at = _mm512_setzero_si512(), index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i sixteen = _mm512_set1_epi32(16);
    for (; i + 16 <= V; i += 16, index = _mm512_add_epi32(index, sixteen)) {
      const __m512 v = _mm512_loadu_ps(row + i);
      if (const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) return int32_t(i + __builtin_ctz(nan));
      const __mmask16 above = _mm512_cmp_ps_mask(v, lane_best, _CMP_GT_OQ);  // strictly: a lane keeps its first
      lane_best = _mm512_mask_mov_ps(lane_best, above, v), lane_at = _mm512_mask_mov_epi32(lane_at, above, index);
    }
    best = _mm512_reduce_max_ps(lane_best);
    const __mmask16 holding = _mm512_cmp_ps_mask(lane_best, _mm512_set1_ps(best), _CMP_EQ_OQ);
    at = _mm512_mask_reduce_min_epi32(holding, lane_at);  // the first of the lanes' first maxima
  }
#endif
  for (; i < V; ++i) {
    if (std::isnan(row[i])) return int32_t(i);
    if (row[i] > best) best = row[i], at = i;
  }
  return int32_t(at);
}

ffi::Error Argmax(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  const auto dims = x.dimensions();
  if (dims.size() < 1 || dims.back() < 1) return ffi::Error::InvalidArgument("eejax_argmax: x needs a last axis of at least one value");
  const int64_t V = dims.back(), N = x.element_count() / V;
  for (int64_t n = 0; n < N; ++n) out->typed_data()[n] = row_argmax(x.typed_data() + n * V, V);
  return ffi::Error::Success();
}

ffi::Error SiluMul(ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> u, ffi::ResultBuffer<ffi::F32> y) {
  if (g.element_count() != u.element_count()) return ffi::Error::InvalidArgument("eejax_silu_mul: gate and up differ in size");
  eejax::silu_mul_values(g.typed_data(), u.typed_data(), y->typed_data(), g.element_count());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EejaxRmsNorm, RmsNorm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(EejaxRopeTables, RopeTables,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(EejaxRope, Rope,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(EejaxSiluMul, SiluMul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(EejaxArgmax, Argmax, ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::S32>>());
