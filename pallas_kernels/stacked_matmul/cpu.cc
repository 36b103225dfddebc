// x @ w[layer].T for XLA:CPU, called through the XLA FFI (`cpu.py` builds and registers
// it). Same inputs and outputs as `reference.py`, float32 only, a few rows of x at a time.
//
// Why it exists: under the model's layer scan XLA:CPU copies each layer's weights out of
// the stacked [L, F, D] array before its dot reads them (a read and a write of every
// weight per step), and a decode step is nothing but reading weights. Here the layer's
// rows are read where they lie, each once per step: every output is a dot product of a
// contiguous weight row with a contiguous row of x, which streams at the machine's memory
// bandwidth. Work items (blocks of output rows) are shared between the calling thread and
// XLA's intra-op thread pool.
//
// Layouts (row-major): x [T, D]; w [L, F, D]; layer [1]; out [T, F]. Requirements (cpu.py
// routes other shapes to the reference): D a multiple of 8, T at most kMaxRows.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#ifdef __FMA__
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Eight floats: GCC/Clang vector extensions, as in the attention kernel.
using v8 = float __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;
// Rows of x one call takes: past this the dot is compute-bound and XLA's GEMM, whose
// packing cost is shared by many rows, is faster (bench/README.md).
constexpr int64_t kMaxRows = 16;
// Rows of x up to which each weight row is streamed alone (`ManyRows`).
constexpr int64_t kStreamRows = 8;

inline v8 Load(const float* p) {
  v8 x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

// acc + u * w, fused into one rounding where the CPU can: every loop below sums through it,
// so an output's bits do not depend on which loop ran (GCC fuses `a += u * w` in some
// loops and not in others when left to itself).
inline v8 MulAdd(v8 acc, v8 u, v8 w) {
#ifdef __FMA__
  return v8(_mm256_fmadd_ps(__m256(u), __m256(w), __m256(acc)));
#else
  return acc + u * w;
#endif
}

inline float Sum(v8 v) {
  // Pairwise, so the result does not depend on the order lanes were filled in.
  const float a = (v[0] + v[4]) + (v[2] + v[6]), b = (v[1] + v[5]) + (v[3] + v[7]);
  return a + b;
}

struct Work {
  const float* x;
  const float* w;  // this layer's [F, D]
  float* out;
  int64_t num_rows, dim, num_outputs;  // T, D, F
  int64_t outputs_per_item, num_items;
  std::atomic<int64_t> next{0}, done{0};
};

// out[t, j + r] for r < R and every t: R weight rows stay in L1 while all of x's rows
// (two at a time) pass over them.
template <int R>
void Outputs(const Work& p, int64_t j) {
  const int64_t D = p.dim, F = p.num_outputs;
  const float* w[R];
  for (int r = 0; r < R; ++r) w[r] = p.w + (j + r) * D;
  int64_t t = 0;
  for (; t + 2 <= p.num_rows; t += 2) {
    const float *xa = p.x + t * D, *xb = xa + D;
    v8 a[R] = {}, b[R] = {};
    for (int64_t d = 0; d < D; d += kLanes) {
      const v8 u = Load(xa + d), v = Load(xb + d);
      for (int r = 0; r < R; ++r) {
        const v8 row = Load(w[r] + d);
        a[r] = MulAdd(a[r], u, row);
        b[r] = MulAdd(b[r], v, row);
      }
    }
    for (int r = 0; r < R; ++r) {
      p.out[t * F + j + r] = Sum(a[r]);
      p.out[(t + 1) * F + j + r] = Sum(b[r]);
    }
  }
  if (t < p.num_rows) {
    const float* xa = p.x + t * D;
    v8 a[R] = {};
    for (int64_t d = 0; d < D; d += kLanes) {
      const v8 u = Load(xa + d);
      for (int r = 0; r < R; ++r) a[r] = MulAdd(a[r], u, Load(w[r] + d));
    }
    for (int r = 0; r < R; ++r) p.out[t * F + j + r] = Sum(a[r]);
  }
}

// Up to kStreamRows rows of x (a single-stream decode step has one): one weight row at a
// time, read as one sequential stream, each piece of it multiplied with TR rows of x from
// t0 on (x stays in L1). `Outputs<4>` reads four weight rows side by side instead, which
// hands the hardware prefetcher four interleaved streams: for one row of x it read 16-26
// GB/s where this reads 25-40 on the same weights, and 2-8 rows of a 1408 x 512 layer take
// 88-143 us here against 140-201 (bench/README.md). Past kStreamRows the arithmetic
// dominates and sharing each load between weight rows wins again. Both sum each output in
// the same order, so results do not depend on which loop ran.
template <int TR>
void RowsOutputs(const Work& p, int64_t begin, int64_t end, int64_t t0) {
  const int64_t D = p.dim, F = p.num_outputs;
  const float* x = p.x + t0 * D;
  for (int64_t j = begin; j < end; ++j) {
    const float* w = p.w + j * D;
    v8 acc[TR] = {};
    for (int64_t d = 0; d < D; d += kLanes) {
      const v8 row = Load(w + d);
      for (int t = 0; t < TR; ++t) acc[t] = MulAdd(acc[t], Load(x + t * D + d), row);
    }
    for (int t = 0; t < TR; ++t) p.out[(t0 + t) * F + j] = Sum(acc[t]);
  }
}

void ManyRows(const Work& p, int64_t begin, int64_t end) {
  int64_t t = 0;
  for (; t + 4 <= p.num_rows; t += 4) RowsOutputs<4>(p, begin, end, t);
  switch (p.num_rows - t) {
    case 3: RowsOutputs<3>(p, begin, end, t); break;
    case 2: RowsOutputs<2>(p, begin, end, t); break;
    case 1: RowsOutputs<1>(p, begin, end, t); break;
  }
}

void Drain(Work& p) {
  for (;;) {
    const int64_t item = p.next.fetch_add(1, std::memory_order_relaxed);
    if (item >= p.num_items) return;
    const int64_t begin = item * p.outputs_per_item;
    const int64_t end = std::min(p.num_outputs, begin + p.outputs_per_item);
    if (p.num_rows <= kStreamRows) {
      ManyRows(p, begin, end);
    } else {
      int64_t j = begin;
      for (; j + 4 <= end; j += 4) Outputs<4>(p, j);
      for (; j < end; ++j) Outputs<1>(p, j);
    }
    p.done.fetch_add(1, std::memory_order_release);
  }
}

std::string Shape(ffi::Span<const int64_t> dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + (dims.size() == 1 ? ",)" : ")");
}

ffi::Error StackedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                         ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out) {
  const auto x_dims = x.dimensions(), w_dims = w.dimensions(), out_dims = out->dimensions();
  const char* problem = nullptr;
  if (x_dims.size() != 2 || w_dims.size() != 3 || out_dims.size() != 2)
    problem = "x must be [T, D], w [L, F, D], out [T, F]";
  else if (x_dims[1] != w_dims[2] || out_dims[0] != x_dims[0] || out_dims[1] != w_dims[1])
    problem = "x's D must equal w's, out must be [T, F]";
  else if (x_dims[1] % kLanes)
    problem = "D must be a multiple of 8";
  else if (x_dims[0] > kMaxRows)
    problem = "at most 16 rows of x";
  else if (layer.element_count() != 1)
    problem = "layer must be one index";
  if (problem)
    return ffi::Error::InvalidArgument("stacked matmul: " + std::string(problem) + "; got x " +
                                       Shape(x_dims) + ", w " + Shape(w_dims));
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= w_dims[0])
    return ffi::Error::InvalidArgument("stacked matmul: layer " + std::to_string(l) +
                                       " is outside w's " + std::to_string(w_dims[0]) +
                                       " layers");
  auto work = std::make_shared<Work>();
  Work& p = *work;
  p.x = x.typed_data();
  p.w = w.typed_data() + l * w_dims[1] * w_dims[2];
  p.out = out->typed_data();
  p.num_rows = x_dims[0];
  p.dim = x_dims[1];
  p.num_outputs = w_dims[1];
  if (p.num_rows == 0 || p.num_outputs == 0) return ffi::Error::Success();
  // About four items per thread, so threads that start late still get a share; at least
  // 16 outputs each, so an item's work outweighs claiming it.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per_item = (p.num_outputs + 4 * threads - 1) / (4 * threads);
  p.outputs_per_item = std::max<int64_t>(16, (per_item + 3) / 4 * 4);
  p.num_items = (p.num_outputs + p.outputs_per_item - 1) / p.outputs_per_item;
  // The pool has a thread per core; the calling thread is one of the workers.
  const int64_t helpers = std::min<int64_t>(threads, p.num_items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { Drain(*work); });
  Drain(p);
  // Every item is claimed by now; wait for the ones a helper is still working on.
  while (p.done.load(std::memory_order_acquire) < p.num_items) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JengineStackedMatmul, StackedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer, shape [1]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out
