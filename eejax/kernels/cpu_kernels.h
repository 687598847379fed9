// What the kernel files offer one another: the pieces of a decode step that a fused decoder layer
// (cpu_layer.cc) runs in one call. Each is the very loop its own XLA handler runs, so a result has
// the same bits whichever way it is called.
#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace eejax {

// cpu_elementwise.cc (compiled with -ffp-contract=off)
// y[n, :] = w * (x[n, :] * (1 / sqrt(sum(x[n, :]^2) / D + eps))), x and y [N, D].
void rms_norm_rows(const float* x, const float* w, float* y, int64_t N, int64_t D, float eps);
// y = x * cos + rotate_half(x) * sin, x and y [N, Dh] (N = rows x heads), tables [N / heads, Dh].
void rope_rows(const float* x, const float* cos, const float* sin, float* y, int64_t N, int64_t heads, int64_t Dh);
// y = SiLU(g) * u, n values.
void silu_mul_values(const float* g, const float* u, float* y, int64_t n);

// cpu_quantized.cc: a matrix kept as its blocks (eejax/quantized.py's formats, in FORMATS' order).
enum class BlockFormat : int { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2, kInt8 = 3 };
enum class Activations : int { kFloat32 = 0, kInt8 = 1, kInt16 = 2 };
struct BlockMatrix {
  BlockFormat format;
  const void* qs;      // [R, NB, block bytes]
  const void* scales;  // [R, NB] f16 (int8: [R] f32)
  const void* mins;    // [R, NB] f16 (q4_1), else unused
  int64_t rows;        // R
  bool tiled = false;  // q4 / q8_0 rows in tiles of 16 (cpu_quantized.cc's scale_at)
};
// x [M, K] against N matrices of one format that share it -> outs[j] [M, R_j], as one
// eejax_quantized_* call computes them (the few-row loops: M <= 64).
xla::ffi::Error quantized_products(xla::ffi::ThreadPool& pool, Activations activations, const float* x, int64_t M,
                                   int64_t K, const BlockMatrix* matrices, int64_t N, float* const* outs);

// cpu_attention.cc: eejax_paged_attention's computation. q and out [B, T, Hq, Dh]; the caches
// [L, Hkv, P, S, Dh]; block_table [B, M]; positions [B, T]; kv_len [B].
struct AttentionShapes {
  int64_t B, T, Hq, Dh, L, Hkv, P, S, M;
};
void paged_attention(xla::ffi::ThreadPool& pool, const AttentionShapes& shapes, const float* q, const float* k_cache,
                     const float* v_cache, int64_t layer, const int32_t* block_table, const int32_t* positions,
                     const int32_t* kv_len, float scale, int64_t window, float* out);

}  // namespace eejax
