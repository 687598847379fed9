// Few-row float32 matrix products on a CPU, streamed by every thread of XLA's intra-op pool.
//
// A decode step of a few rows is a chain of products of x [M, K] by weights, and its time is the
// time to read them. XLA:CPU's one-row products run mostly on one core (README's decode profile),
// which streams about two thirds of what both cores of a 2-core machine read together. These
// handlers split each weight between the pool's threads instead:
//   eejax_matmul_nn:  y[M, N] = x[M, K] @ w[K, N]    (a layer's Linear; w row-major)
//   eejax_matmul_nt:  y[M, N] = x[M, K] @ w[N, K]^T  (the LM head tied to the embedding)
// nn splits K (each part sums its rows of w into its own partial [M, N]; the parts are added in
// a fixed order, so a result does not depend on which thread ran which part), or N when N is
// large; nt splits N (`run_parts`, cpu_parts.h).
// Built at first use by eejax/kernels/cpu_matmul.py (g++ -O3 -march=native); more than kMaxRows
// rows are refused (the caller keeps XLA's product for them).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_parts.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxRows = 8;
constexpr int64_t kSplitColumnsAbove = 8192;  // nn: split N, not K, for wider outputs (an untied head)
// A part reads at least this many weights (128 KiB of float32, ~5 us of streaming): handing a
// smaller product's parts to helpers costs more than it saves. Counted in weights, not rows x
// weights, so that the parts, and with them a split-K sum's order, do not depend on M: a verify
// pass and a decode step agree bit for bit.
constexpr int64_t kMinWeightsPerPart = 32768;

// GCC's vector extension: 16 floats, compiled to the widest vectors -march=native has.
typedef float v16 __attribute__((vector_size(64)));
inline v16 load(const float* p) {
  v16 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, v16 v) { __builtin_memcpy(p, &v, sizeof v); }

// bfloat16 weights (XLA passes them as uint16): the top half of a float32, widened exactly.
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
inline v16 load(const uint16_t* p) {
  u16x16 half;
  __builtin_memcpy(&half, p, sizeof half);
  const u32x16 wide = __builtin_convertvector(half, u32x16) << 16;
  v16 v;
  __builtin_memcpy(&v, &wide, sizeof v);
  return v;
}
inline float scalar(float w) { return w; }
inline float scalar(uint16_t w) {
  const uint32_t wide = uint32_t(w) << 16;
  float f;
  __builtin_memcpy(&f, &wide, sizeof f);
  return f;
}

// p[m, n0:n1] = x[m, k0:k1] @ w[k0:k1, n0:n1] for M rows of x (K apart) into p (N apart). R rows of
// w per pass over the columns, so each element of p is loaded and stored once per R rows. Each
// element is summed in order of k with one fused multiply-add per k, whatever M and R: a row's
// result does not depend on how many rows came with it.
//
// While a pass reads R rows, it prefetches the next pass's R rows into L2. A pass over a layer's
// narrow weight (N = 576: 36 lines a row) starts R short streams that the hardware prefetcher
// learns only as they end; one row of x at a time outruns that, but with 5 rows the loads wait on
// memory (a 576x576 product at M = 5 took 1.62x its M = 1 time, 1.13x with the prefetch; a layer's
// five products, both cores, weights in DRAM, `benchmarks/matmul_rows.py`: M = 5 1.40x -> 1.10x,
// M = 8 1.8x -> 1.3x, M = 1 the same; docs/results/cpu-2026-11.md).
template <int M, int R, typename W>
void nn_block(const float* x, const W* w, float* p, int64_t K, int64_t N, int64_t k0, int64_t k1, int64_t n0,
              int64_t n1) {
  for (int m = 0; m < M; ++m) std::memset(p + m * N + n0, 0, (n1 - n0) * sizeof(float));
  const int64_t nv = n0 + (n1 - n0) / 16 * 16;
  int64_t k = k0;
  for (; k + R <= k1; k += R) {
    const W* wk = w + k * N;
    float a[M][R];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) a[m][r] = x[m * K + k + r];
    const bool ahead = k + 2 * R <= k1;  // a next pass to prefetch
    for (int64_t n = n0; n < nv; n += 16) {
      v16 rows[R];
      for (int r = 0; r < R; ++r) rows[r] = load(wk + r * N + n);
      if (ahead)
        for (int r = 0; r < R; ++r) __builtin_prefetch(wk + (R + r) * N + n, /*rw=*/0, /*locality=*/2);
      for (int m = 0; m < M; ++m) {
        v16 s = load(p + m * N + n);
        for (int r = 0; r < R; ++r) s += a[m][r] * rows[r];
        store(p + m * N + n, s);
      }
    }
    for (int64_t n = nv; n < n1; ++n)
      for (int m = 0; m < M; ++m) {
        float s = p[m * N + n];
        for (int r = 0; r < R; ++r) s += a[m][r] * scalar(wk[r * N + n]);
        p[m * N + n] = s;
      }
  }
  for (; k < k1; ++k)
    for (int m = 0; m < M; ++m)
      for (int64_t n = n0; n < n1; ++n) p[m * N + n] += x[m * K + k] * scalar(w[k * N + n]);
}

// y[m, n] = x[m] . w[n] for n in [n0, n1): each row of w is read once, in order, for all M rows
// of x (one stream: 27 GB/s on one core at M = 1), and the row two ahead is prefetched into L2 as
// it goes (the LM head, 49152x576, both cores, `benchmarks/matmul_rows.py`: M = 1 0.78-0.81x its
// time without, M = 5 1.75x -> 1.0x of that M = 1, M = 8 1.95x -> 1.2x).
template <int M, typename W>
void nt_block(const float* x, const W* w, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t kv = K / 32 * 32;
  constexpr int64_t kLine = 64 / sizeof(W);  // weights in a cache line
  for (int64_t n = n0; n < n1; ++n) {
    const W* wn = w + n * K;
    const W* next = n + 2 < n1 ? wn + 2 * K : wn;
    v16 acc[M][2] = {};
    for (int64_t k = 0; k < kv; k += 32) {
      for (int64_t j = 0; j < 32; j += kLine) __builtin_prefetch(next + k + j, /*rw=*/0, /*locality=*/2);
      const v16 w0 = load(wn + k), w1 = load(wn + k + 16);
      for (int m = 0; m < M; ++m) {
        acc[m][0] += load(x + m * K + k) * w0;
        acc[m][1] += load(x + m * K + k + 16) * w1;
      }
    }
    for (int m = 0; m < M; ++m) {
      const v16 both = acc[m][0] + acc[m][1];
      float s = 0.f;
      for (int j = 0; j < 16; ++j) s += both[j];
      for (int64_t k = kv; k < K; ++k) s += x[m * K + k] * scalar(wn[k]);
      y[m * N + n] = s;
    }
  }
}

// The block functions for M = 1..kMaxRows rows and weights of type W, picked once per call.
template <typename W>
struct Blocks {
  void (*nn)(const float*, const W*, float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);
  void (*nt)(const float*, const W*, float*, int64_t, int64_t, int64_t, int64_t);
};

template <typename W, int M>
constexpr Blocks<W> blocks_for() {
  return {&nn_block<M, 8, W>, &nt_block<M, W>};
}

template <typename W>
constexpr Blocks<W> kBlocks[kMaxRows] = {blocks_for<W, 1>(), blocks_for<W, 2>(), blocks_for<W, 3>(),
                                         blocks_for<W, 4>(), blocks_for<W, 5>(), blocks_for<W, 6>(),
                                         blocks_for<W, 7>(), blocks_for<W, 8>()};

template <typename W>
struct Job {
  bool transposed;
  bool split_k;
  const float* x;
  const W* w;
  float* y;
  int64_t M, K, N, parts;
  std::vector<float> partial;  // split_k: parts 1.. write [parts - 1, M, N] here; part 0 writes y

  void run_part(int64_t i) {
    const int64_t lo = (split_k ? K : N) * i / parts, hi = (split_k ? K : N) * (i + 1) / parts;
    const Blocks<W>& f = kBlocks<W>[M - 1];
    if (transposed) {
      f.nt(x, w, y, K, N, lo, hi);
    } else if (split_k) {
      f.nn(x, w, i == 0 ? y : partial.data() + (i - 1) * M * N, K, N, lo, hi, 0, N);
    } else {
      f.nn(x, w, y, K, N, 0, K, lo, hi);
    }
  }
};

template <typename W, ffi::DataType T>
ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<T> w, ffi::ResultBuffer<ffi::F32> y,
                  bool transposed) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("eejax_matmul: x and w must be 2-D");
  const int64_t M = xd[0], K = xd[1], N = transposed ? wd[0] : wd[1];
  if ((transposed ? wd[1] : wd[0]) != K) return ffi::Error::InvalidArgument("eejax_matmul: x and w do not contract");
  if (M < 1 || M > kMaxRows) return ffi::Error::InvalidArgument("eejax_matmul: x must have 1 to 8 rows");
  Job<W> job;
  job.transposed = transposed;
  job.split_k = !transposed && N <= kSplitColumnsAbove;
  job.x = x.typed_data();
  job.w = reinterpret_cast<const W*>(w.typed_data());
  job.y = y->typed_data();
  job.M = M, job.K = K, job.N = N;
  const int64_t units = job.split_k ? K : N;
  job.parts = eejax::num_parts(pool, std::min(units, (K * N + kMinWeightsPerPart - 1) / kMinWeightsPerPart));
  if (job.split_k && job.parts > 1) job.partial.resize((job.parts - 1) * M * N);
  eejax::run_parts(pool, job.parts, [&job](int64_t i) { job.run_part(i); });
  if (job.split_k) {
    float* out = job.y;
    for (int64_t i = 0; i + 1 < job.parts; ++i) {
      const float* p = job.partial.data() + i * M * N;
#pragma GCC ivdep
      for (int64_t j = 0; j < M * N; ++j) out[j] += p[j];
    }
  }
  return ffi::Error::Success();
}

template <typename W, ffi::DataType T, bool kTransposed>
ffi::Error Handler(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<T> w, ffi::ResultBuffer<ffi::F32> y) {
  return Matmul<W, T>(pool, x, w, y, kTransposed);
}

// out[i] = table[clamp(ids[i])]: rows of a bf16 table copied as they are. XLA:CPU converts the
// whole bf16 table to float32 to gather a few rows of it (an embedding lookup per decode step).
ffi::Error TakeRows(ffi::Buffer<ffi::BF16> table, ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::BF16> out) {
  const auto td = table.dimensions();
  if (td.size() != 2) return ffi::Error::InvalidArgument("eejax_take_rows: the table must be 2-D");
  const int64_t V = td[0], D = td[1], n = ids.element_count();
  const uint16_t* rows = table.typed_data();
  const int32_t* id = ids.typed_data();
  uint16_t* dst = out->typed_data();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = std::clamp<int64_t>(id[i], 0, V - 1);  // as jnp indexing clamps
    std::memcpy(dst + i * D, rows + row * D, D * sizeof(uint16_t));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EejaxTakeRowsBf16, TakeRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());

// float32 or bfloat16 weights (x and y float32), x @ w or x @ w^T.
#define EEJAX_MATMUL_HANDLER(name, W, T, transposed)                                                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (Handler<W, T, transposed>), ffi::Ffi::Bind()                      \
                                                                       .Ctx<ffi::ThreadPool>()           \
                                                                       .Arg<ffi::Buffer<ffi::F32>>()     \
                                                                       .Arg<ffi::Buffer<T>>()            \
                                                                       .Ret<ffi::Buffer<ffi::F32>>())

EEJAX_MATMUL_HANDLER(EejaxMatmulNN, float, ffi::F32, false);
EEJAX_MATMUL_HANDLER(EejaxMatmulNT, float, ffi::F32, true);
EEJAX_MATMUL_HANDLER(EejaxMatmulNNBf16, uint16_t, ffi::BF16, false);
EEJAX_MATMUL_HANDLER(EejaxMatmulNTBf16, uint16_t, ffi::BF16, true);
