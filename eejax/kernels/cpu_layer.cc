// A Llama decoder layer's decode step in one call on a CPU, over weights kept as their blocks:
//   x = RMSNorm(h); q, k, v = x's products; q, k rotated; k, v written into the paged cache;
//   h += o(attention over the cache); x = RMSNorm(h); h += down(SiLU(gate(x)) * up(x))
// for the few rows of a decode step, a verify pass or a batch (N = B x T <= 64).
//
// Each piece is the loop its own handler runs (cpu_kernels.h): RMSNorm, the rotation and SiLU x up
// from cpu_elementwise.cc, the products from cpu_quantized.cc (matrices of one format that share
// an input in one call, as `cpu_matmul.rows_products` groups them), the attention from
// cpu_attention.cc, and the residual adds are single float additions, as XLA's. So the layer's
// bits are those of the same layer run op by op, which the tests check; what the call saves is the
// ~15 small XLA ops a layer between the products (their compile time: ~40% of the step program's).
//
//   h [N, D], cos/sin [N, Dh], attn_norm/mlp_norm [D] or a stack's [L, D] (then every matrix's
//   buffers are stacks too, read at the layer), k/v cache [L, Hkv, P, S, Dh] (written in
//   place: the results alias them), layer s32[], pages/slots [B, T] (where each new token's K/V
//   goes; an index past the cache is dropped, a negative one counts from the end, as jnp's
//   .at[].set), block_table [B, M], positions [B, T], kv_len [B], then the seven matrices q, k, v,
//   o, gate, up, down as three buffers each (qs, scales, mins) -> h [N, D], k and v cache.
//   Attributes: eps, scale (attention), window (0: none), activations (cpu_kernels.h's
//   Activations), formats (matrix j's BlockFormat in bits [4j, 4j + 3), bit 4j + 3 set where it is tiled).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMatrices = 7;  // q, k, v, o, gate, up, down
enum Matrix { kQ, kK, kV, kO, kGate, kUp, kDown };

struct Scratch {  // the calling thread's buffers, kept from call to call
  std::vector<float> x, q, k, v, qr, kr, attn, gate, up, act, down;
};

// Products of x [M, K] by matrices `which` (each its output), grouped as `rows_products` groups
// them: all in one call when they share a format, else one call each.
ffi::Error products(ffi::ThreadPool& pool, eejax::Activations a, const float* x, int64_t M, int64_t K,
                    const eejax::BlockMatrix* ms, std::initializer_list<int> which, float* const* outs) {
  eejax::BlockMatrix group[kMatrices];
  int n = 0;
  bool shared = true;
  for (int j : which) shared &= ms[j].format == ms[*which.begin()].format, group[n++] = ms[j];
  if (shared) return eejax::quantized_products(pool, a, x, M, K, group, n, outs);
  for (int i = 0; i < n; ++i)
    if (auto e = eejax::quantized_products(pool, a, x, M, K, group + i, 1, outs + i); e.failure()) return e;
  return ffi::Error::Success();
}

// Writes rows [N, H, Dh] of one layer's new keys or values at (pages, slots) of cache [L, H, P, S, Dh].
void write_cache(float* cache, const float* rows, int64_t layer, const int32_t* pages, const int32_t* slots, int64_t N,
                 int64_t H, int64_t P, int64_t S, int64_t Dh) {
  for (int64_t n = 0; n < N; ++n) {
    int64_t page = pages[n], slot = slots[n];
    page += page < 0 ? P : 0, slot += slot < 0 ? S : 0;
    if (page < 0 || page >= P || slot < 0 || slot >= S) continue;
    for (int64_t h = 0; h < H; ++h)
      std::memcpy(cache + (((layer * H + h) * P + page) * S + slot) * Dh, rows + (n * H + h) * Dh, Dh * sizeof(float));
  }
}

ffi::Error CpuLayer(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> h, ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                    ffi::Buffer<ffi::F32> attn_norm, ffi::Buffer<ffi::F32> mlp_norm, ffi::Buffer<ffi::F32> k_cache,
                    ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> pages,
                    ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> block_table, ffi::Buffer<ffi::S32> positions,
                    ffi::Buffer<ffi::S32> kv_len, ffi::RemainingArgs weights, ffi::ResultBuffer<ffi::F32> h_out,
                    ffi::ResultBuffer<ffi::F32> k_out, ffi::ResultBuffer<ffi::F32> v_out, float eps, float scale,
                    int64_t window, int64_t activations, int64_t formats) {
  const auto hd = h.dimensions(), cd = k_cache.dimensions(), pd = positions.dimensions(), td = block_table.dimensions();
  if (hd.size() != 2 || cd.size() != 5 || pd.size() != 2 || td.size() != 2 || cos.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("eejax_cpu_layer: h and the tables are 2-D, the caches 5-D, positions and the block table 2-D");
  const int64_t N = hd[0], D = hd[1], Dh = cos.dimensions()[1];
  const eejax::AttentionShapes n{pd[0], pd[1], 0, Dh, cd[0], cd[1], cd[2], cd[3], td[1]};
  if (n.B * n.T != N || cd[4] != Dh || td[0] != n.B || pages.element_count() != N || slots.element_count() != N ||
      kv_len.element_count() != n.B || cos.dimensions()[0] != N || D % 32 || Dh % 8)
    return ffi::Error::InvalidArgument("eejax_cpu_layer: shapes do not agree");
  if (weights.size() != 3 * kMatrices) return ffi::Error::InvalidArgument("eejax_cpu_layer: give 7 matrices, three buffers each");
  const int64_t l = layer.typed_data()[0];
  // The weights come as the layer's own buffers or as the whole stack's, [L, ...] (the stacked
  // layout's loop: read at layer l in place, where slicing would copy the layer's weights a step).
  const int64_t stacked = attn_norm.dimensions().size() == 2 ? attn_norm.dimensions()[0] : 0;
  if ((stacked && (l < 0 || l >= stacked || mlp_norm.dimensions().size() != 2)) ||
      attn_norm.element_count() != size_t(std::max<int64_t>(stacked, 1) * D) || mlp_norm.element_count() != attn_norm.element_count())
    return ffi::Error::InvalidArgument("eejax_cpu_layer: the norms are not D values each, or not one stack that holds the layer");
  // Layer l's part of a stack's buffer (a buffer with no values, an absent mins, as it is).
  const auto at_layer = [&](const ffi::AnyBuffer& b) {
    const auto* base = static_cast<const uint8_t*>(b.untyped_data());
    return stacked && b.element_count() ? base + l * (b.size_bytes() / stacked) : base;
  };
  eejax::BlockMatrix ms[kMatrices];
  int64_t cols[kMatrices];  // each matrix's values a row
  for (int j = 0; j < kMatrices; ++j) {
    auto qs = weights.get<ffi::AnyBuffer>(3 * j), scales = weights.get<ffi::AnyBuffer>(3 * j + 1),
         mins = weights.get<ffi::AnyBuffer>(3 * j + 2);
    if (!qs || !scales || !mins || qs->dimensions().size() != 3 + (stacked ? 1 : 0) ||
        (stacked && (qs->dimensions()[0] != stacked || scales->dimensions().size() == 0 || scales->dimensions()[0] != stacked ||
                     (mins->element_count() && (mins->dimensions().size() == 0 || mins->dimensions()[0] != stacked)))))
      return ffi::Error::InvalidArgument("eejax_cpu_layer: bad weight buffers (each a layer's, or each a stack of as many layers as the norms)");
    const auto format = eejax::BlockFormat((formats >> (4 * j)) & 7);
    const bool tiled = (formats >> (4 * j)) & 8;  // cpu_layer.py: the format's index, plus 8 where tiled
    const int64_t* qd = qs->dimensions().begin() + (stacked ? 1 : 0);  // one layer's [R, NB, block bytes]
    const bool nibbles = format == eejax::BlockFormat::kQ4_0 || format == eejax::BlockFormat::kQ4_1;
    ms[j] = {format, at_layer(*qs), at_layer(*scales), at_layer(*mins), qd[0], tiled};
    cols[j] = qd[1] * qd[2] * (nibbles ? 2 : 1);
  }
  const int64_t Rq = ms[kQ].rows, Rk = ms[kK].rows, I = ms[kGate].rows;
  if (Rq % Dh || Rk % Dh || ms[kV].rows != Rk || ms[kO].rows != D || ms[kUp].rows != I || ms[kDown].rows != D)
    return ffi::Error::InvalidArgument("eejax_cpu_layer: the matrices' rows do not make a layer");
  for (int j = 0; j < kMatrices; ++j)  // each row as wide as its input
    if (cols[j] != (j == kO ? Rq : j == kDown ? I : D))
      return ffi::Error::InvalidArgument("eejax_cpu_layer: a matrix's rows are not as wide as its input");
  const int64_t Hq = Rq / Dh, Hkv = Rk / Dh;
  if (Hkv != n.Hkv || Hq % Hkv || l < 0 || l >= n.L) return ffi::Error::InvalidArgument("eejax_cpu_layer: heads or layer do not fit the cache");
  const auto a = eejax::Activations(activations);

  static thread_local Scratch s;
  for (auto* buffer : {&s.x, &s.down}) buffer->resize(N * D);
  for (auto* buffer : {&s.q, &s.qr, &s.attn}) buffer->resize(N * Rq);
  for (auto* buffer : {&s.k, &s.kr, &s.v}) buffer->resize(N * Rk);
  for (auto* buffer : {&s.gate, &s.up, &s.act}) buffer->resize(N * I);
  float *k_cached = k_out->typed_data(), *v_cached = v_out->typed_data(), *out = h_out->typed_data();
  const float* hs = h.typed_data();

  const float* norms[] = {attn_norm.typed_data() + (stacked ? l * D : 0), mlp_norm.typed_data() + (stacked ? l * D : 0)};
  eejax::rms_norm_rows(hs, norms[0], s.x.data(), N, D, eps);
  {
    float* outs[] = {s.q.data(), s.k.data(), s.v.data()};
    if (auto e = products(pool, a, s.x.data(), N, D, ms, {kQ, kK, kV}, outs); e.failure()) return e;
  }
  eejax::rope_rows(s.q.data(), cos.typed_data(), sin.typed_data(), s.qr.data(), N * Hq, Hq, Dh);
  eejax::rope_rows(s.k.data(), cos.typed_data(), sin.typed_data(), s.kr.data(), N * Hkv, Hkv, Dh);
  write_cache(k_cached, s.kr.data(), l, pages.typed_data(), slots.typed_data(), N, Hkv, n.P, n.S, Dh);
  write_cache(v_cached, s.v.data(), l, pages.typed_data(), slots.typed_data(), N, Hkv, n.P, n.S, Dh);
  eejax::AttentionShapes shapes = n;
  shapes.Hq = Hq;
  eejax::paged_attention(pool, shapes, s.qr.data(), k_cached, v_cached, l, block_table.typed_data(), positions.typed_data(),
                         kv_len.typed_data(), scale, window, s.attn.data());
  {
    float* outs[] = {out};  // o, then h + o in place
    if (auto e = products(pool, a, s.attn.data(), N, Rq, ms, {kO}, outs); e.failure()) return e;
  }
  for (int64_t i = 0; i < N * D; ++i) out[i] = hs[i] + out[i];
  eejax::rms_norm_rows(out, norms[1], s.x.data(), N, D, eps);
  {
    float* outs[] = {s.gate.data(), s.up.data()};
    if (auto e = products(pool, a, s.x.data(), N, D, ms, {kGate, kUp}, outs); e.failure()) return e;
  }
  eejax::silu_mul_values(s.gate.data(), s.up.data(), s.act.data(), N * I);
  {
    float* outs[] = {s.down.data()};
    if (auto e = products(pool, a, s.act.data(), N, I, ms, {kDown}, outs); e.failure()) return e;
  }
  for (int64_t i = 0; i < N * D; ++i) out[i] = out[i] + s.down[i];
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EejaxCpuLayer, CpuLayer,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // h
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cos
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sin
                                  .Arg<ffi::Buffer<ffi::F32>>()  // attn_norm
                                  .Arg<ffi::Buffer<ffi::F32>>()  // mlp_norm
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k cache
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_len
                                  .RemainingArgs()               // the matrices
                                  .Ret<ffi::Buffer<ffi::F32>>()  // h
                                  .Ret<ffi::Buffer<ffi::F32>>()  // k cache
                                  .Ret<ffi::Buffer<ffi::F32>>()  // v cache
                                  .Attr<float>("eps")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("activations")
                                  .Attr<int64_t>("formats"));
