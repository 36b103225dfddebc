// x @ w[layer].T for XLA:CPU, called through the XLA FFI (`cpu.py` builds and registers
// it). Same inputs and outputs as `reference.py`, float32 only, up to kMaxRows rows of x,
// for one weight or several that multiply the same x (a layer's q, k and v projections,
// its gate and up ones): one call computes them all, each output as a call of its own
// would, bit for bit.
//
// Why it exists: under the model's layer scan XLA:CPU copies each layer's weights out of
// the stacked [L, F, D] array before its dot reads them (a read and a write of every
// weight per step), and a decode step is nothing but reading weights. Here the layer's
// rows are read where they lie, each once per step: every output is a dot product of a
// contiguous weight row with a contiguous row of x, which streams at the machine's memory
// bandwidth. Work items (blocks of output rows) are shared between the calling thread and
// XLA's intra-op thread pool; with several weights the items of all of them are shared
// out at once, so a small projection (k, v) does not run alone on one thread and a decode
// layer hands work to the pool twice less often (bench/README.md). Past kRowByRowRows the
// products are compute-bound: items of `panel::kPanelRows` weight rows (30)
// multiply every row of x through the register tiles of `panel.h` (pallas_kernels/include),
// which XLA's GEMM would first copy out of the stack and pack anew every call.
//
// Layouts (row-major): x [T, D]; layer [1]; then the weights w_i [L, F_i, D], and the
// results out_i [T, F_i]. Requirements (cpu.py routes other shapes to the reference): D a
// multiple of 8, T at most kMaxRows.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#ifdef __FMA__
#include <immintrin.h>
#endif

#include "panel.h"  // shared with quantized_matmul (pallas_kernels/include)
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Eight floats: GCC/Clang vector extensions, as in the attention kernel.
using v8 = float __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;
// Up to this many rows of x the loops below stream weight rows where they lie; more
// multiply panels of w[layer]'s rows through `panel.h`'s tiles, up to kMaxRows (past it
// XLA's GEMM, whose packing is shared by that many rows, is as fast: bench/README.md).
constexpr int64_t kRowByRowRows = 16;
constexpr int64_t kMaxRows = 128;
// Rows of x up to which each weight row is streamed alone (`ManyRows`).
constexpr int64_t kStreamRows = 8;
// On AMD CPUs `RowsOutputs` asks for each streamed weight row kPrefetchFloats ahead, as a
// hint that the row is read once (prefetchnta): a decode step reads every weight once, and
// without the hint those reads evict from the caches what is read again (x, the KV cache,
// the host's own data). On a 2-core AVX2 EPYC the 56M model's decode matmuls alone ran
// 6.15 against 6.64 ms (median of 16, the two alternated in one process), the engine's
// single-stream decode 113.7 against 105.3 tok/s; 128 floats ahead was no faster than no
// hint, 256 or more, or a prefetch into every cache level, slower (bench/README.md). Not
// measured on Intel, whose L2 streamer the hint may keep from running ahead: off there. Off
// on AVX-512 AMD CPUs (Zen 4) too, where it cost 2-3% (below, `kOneRowStreams`).
constexpr int64_t kFloatsPerLine = 64 / sizeof(float);  // a 64-byte cache line
constexpr int64_t kPrefetchFloats = 64;
// Weight rows one row of x streams side by side (`RowsOutputs`' S). On a 2-core AVX-512
// EPYC, every decode weight of the 56M model once through this kernel, in 2 MiB pages (60
// alternated passes): 8 streams with the hint 2.70 ms, without 2.63; 4 streams without
// 2.45, 2 streams 2.46, 1 stream 2.98. The engine's decode step there: 3.56/3.53/3.12 ms
// against 3.91/3.90/3.65 (`jengine bench overhead`, alternated; bench/README.md). On AVX2
// EPYCs and the AMX Xeon, 8 (the Xeon read as fast with 4).
#ifdef __AVX512F__
constexpr int kOneRowStreams = 4;
#else
constexpr int kOneRowStreams = 8;
#endif

bool StreamHint() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__AVX512F__)
  static const bool amd = [] {
    __builtin_cpu_init();  // the kernel is a shared library: not initialized for it before
    return __builtin_cpu_is("amd") != 0;
  }();
  return amd;
#else
  return false;
#endif
}

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

// One weight's part of a call: this layer's [F, D] rows and where its outputs go.
struct Segment {
  const float* w;
  float* out;  // [T, F]
  int64_t num_outputs;  // F
};

// A block of one segment's output rows.
struct Item {
  int64_t segment, begin, end;
};

struct Work {
  const float* x;
  int64_t num_rows, dim;  // T, D
  panel::XColumns columns;  // prepared for more than kRowByRowRows rows
  std::vector<Segment> segments;
  std::vector<Item> items;
  std::atomic<int64_t> next{0}, done{0};
};

// out[t, j] for rows j of [begin, end) and every t, R weight rows at a time: they stay in
// L1 while all of x's rows (two at a time) pass over them. The R rows are row j of each of
// R parts of the range, far apart: R streams for the memory at once (see `RowsOutputs`).
template <int R>
void Outputs(const Work& p, const Segment& s, int64_t begin, int64_t end) {
  const int64_t D = p.dim, F = s.num_outputs;
  const int64_t part = (end - begin) / R;  // rows in each of the R parts
  for (int64_t j = begin; j < begin + part; ++j) {
    const float* w[R];
    for (int r = 0; r < R; ++r) w[r] = s.w + (j + r * part) * D;
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
        s.out[t * F + j + r * part] = Sum(a[r]);
        s.out[(t + 1) * F + j + r * part] = Sum(b[r]);
      }
    }
    if (t < p.num_rows) {
      const float* xa = p.x + t * D;
      v8 a[R] = {};
      for (int64_t d = 0; d < D; d += kLanes) {
        const v8 u = Load(xa + d);
        for (int r = 0; r < R; ++r) a[r] = MulAdd(a[r], u, Load(w[r] + d));
      }
      for (int r = 0; r < R; ++r) s.out[t * F + j + r * part] = Sum(a[r]);
    }
  }
  // The last rows (fewer than R), one at a time.
  if constexpr (R > 1) Outputs<1>(p, s, begin + R * part, end);
}

// Up to kStreamRows rows of x (a single-stream decode step has one): each weight row is
// read as one sequential stream, multiplied piece by piece with TR rows of x from t0 on (x
// stays in L1). One stream does not keep a core's memory queue full, so S rows are read
// side by side, row j of each of S parts of the item: on an AMX Xeon the decode matmuls
// read 20-23 GB/s with 4-8 parts against 13-15 with one. The rows must lie far apart:
// neighbouring rows read side by side gained little or lost on that Xeon, and on an AVX2
// EPYC read 16-26 GB/s against one row's 25-40 (bench/README.md). Past kStreamRows the
// arithmetic dominates, and `Outputs` shares each weight load between rows of x. Every
// loop sums each output in the same order, so results do not depend on which loop ran or
// which rows were read beside it.
template <int TR, int S>
void RowsOutputs(const Work& p, const Segment& s, int64_t begin, int64_t end, int64_t t0,
                 bool hint) {
  const int64_t D = p.dim, F = s.num_outputs;
  const float* x = p.x + t0 * D;
  const int64_t part = (end - begin) / S;  // rows in each of the S parts
  for (int64_t j = begin; j < begin + part; ++j) {
    const float* w[S];
    for (int k = 0; k < S; ++k) w[k] = s.w + (j + k * part) * D;
    v8 acc[S][TR] = {};
    for (int64_t d = 0; d < D; d += kLanes) {
      // Each 64-byte line of the S rows asked for kPrefetchFloats ahead, non-temporally.
      if (hint && d % kFloatsPerLine == 0)
        for (int k = 0; k < S; ++k) __builtin_prefetch(w[k] + d + kPrefetchFloats, 0, 0);
      for (int k = 0; k < S; ++k) {
        const v8 row = Load(w[k] + d);
        for (int t = 0; t < TR; ++t) acc[k][t] = MulAdd(acc[k][t], Load(x + t * D + d), row);
      }
    }
    for (int k = 0; k < S; ++k)
      for (int t = 0; t < TR; ++t) s.out[(t0 + t) * F + j + k * part] = Sum(acc[k][t]);
  }
  // The last rows (fewer than S), one at a time.
  if constexpr (S > 1) RowsOutputs<TR, 1>(p, s, begin + S * part, end, t0, hint);
}

// S * TR sums, with TR rows of x and a weight vector, stay within 16 vector registers.
void ManyRows(const Work& p, const Segment& s, int64_t begin, int64_t end) {
  const bool hint = StreamHint();
  int64_t t = 0;
  for (; t + 4 <= p.num_rows; t += 4) RowsOutputs<4, 2>(p, s, begin, end, t, hint);
  switch (p.num_rows - t) {
    case 3: RowsOutputs<3, 2>(p, s, begin, end, t, hint); break;
    case 2: RowsOutputs<2, 4>(p, s, begin, end, t, hint); break;
    case 1: RowsOutputs<1, kOneRowStreams>(p, s, begin, end, t, hint); break;
  }
}

// Panels (more than kRowByRowRows rows of x): each thread claims one item ahead, so that the
// next item's first weights are on their way while this one's last blocks are multiplied.
void DrainPanels(Work& p) {
  const int64_t num_items = int64_t(p.items.size());
  auto claim = [&] { return p.next.fetch_add(1, std::memory_order_relaxed); };
  auto rows = [&](const Item& item) { return p.segments[item.segment].w + item.begin * p.dim; };
  for (int64_t index = claim(), following; index < num_items; index = following) {
    const Item& item = p.items[index];
    const Segment& s = p.segments[item.segment];
    following = claim();
    panel::Prefetch prefetch;
    if (following < num_items) {
      const Item& next = p.items[following];
      prefetch = {rows(next), next.end - next.begin};
    }
    // The weight rows are read where they lie, each block asked for while the one before
    // is multiplied: copied into L2 first (one sequential read, then the products), the
    // copy took a third as long as the products and overlapped nothing (bench/README.md).
    panel::PanelProducts(rows(item), item.end - item.begin, p.dim, p.columns, s.out,
                         s.num_outputs, item.begin, &prefetch);
    p.done.fetch_add(1, std::memory_order_release);
  }
}

void Drain(Work& p) {
  if (p.num_rows > kRowByRowRows) return DrainPanels(p);
  const int64_t num_items = int64_t(p.items.size());
  for (;;) {
    const int64_t index = p.next.fetch_add(1, std::memory_order_relaxed);
    if (index >= num_items) return;
    const Item& item = p.items[index];
    const Segment& s = p.segments[item.segment];
    if (p.num_rows <= kStreamRows) {
      ManyRows(p, s, item.begin, item.end);
    } else {
      Outputs<4>(p, s, item.begin, item.end);
    }
    p.done.fetch_add(1, std::memory_order_release);
  }
}

std::string Shape(ffi::Span<const int64_t> dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + (dims.size() == 1 ? ",)" : ")");
}

ffi::Error StackedMatmuls(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                          ffi::Buffer<ffi::S32> layer, ffi::RemainingArgs weights,
                          ffi::RemainingRets outs) {
  const auto x_dims = x.dimensions();
  auto fail = [&](const std::string& problem) {
    return ffi::Error::InvalidArgument("stacked matmul: " + problem + "; got x " +
                                       Shape(x_dims));
  };
  if (x_dims.size() != 2) return fail("x must be [T, D]");
  if (x_dims[1] % kLanes) return fail("D must be a multiple of 8");
  if (x_dims[0] > kMaxRows) return fail("at most " + std::to_string(kMaxRows) + " rows of x");
  if (layer.element_count() != 1) return fail("layer must be one index");
  if (weights.size() == 0 || weights.size() != outs.size())
    return fail("one result per weight, and at least one weight");
  const int64_t l = layer.typed_data()[0];
  auto work = std::make_shared<Work>();
  Work& p = *work;
  p.x = x.typed_data();
  p.num_rows = x_dims[0];
  p.dim = x_dims[1];
  int64_t total_outputs = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    auto w = weights.get<ffi::Buffer<ffi::F32>>(i);
    auto out = outs.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !out.has_value()) return fail("weights and results must be float32");
    const auto w_dims = w->dimensions(), out_dims = (*out)->dimensions();
    if (w_dims.size() != 3 || w_dims[2] != x_dims[1])
      return fail("w must be [L, F, D] with x's D, got w " + Shape(w_dims));
    if (out_dims.size() != 2 || out_dims[0] != x_dims[0] || out_dims[1] != w_dims[1])
      return fail("out must be [T, F], got " + Shape(out_dims) + " for w " + Shape(w_dims));
    if (l < 0 || l >= w_dims[0])
      return fail("layer " + std::to_string(l) + " is outside w's " + std::to_string(w_dims[0]) +
                  " layers");
    p.segments.push_back({w->typed_data() + l * w_dims[1] * w_dims[2], (*out)->typed_data(),
                          w_dims[1]});
    total_outputs += w_dims[1];
  }
  if (p.num_rows == 0 || total_outputs == 0) return ffi::Error::Success();
  // About four items per thread over all the weights (finer items measured slower), so
  // threads that start late still get a share; at least 16 outputs each, so an item's
  // work outweighs claiming it.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per_item = (total_outputs + 4 * threads - 1) / (4 * threads);
  const int64_t outputs_per_item = p.num_rows > kRowByRowRows
                                       ? panel::kPanelRows
                                       : std::max<int64_t>(16, (per_item + 3) / 4 * 4);
  if (p.num_rows > kRowByRowRows) p.columns.Prepare(p.x, p.num_rows, p.dim);
  for (int64_t i = 0; i < int64_t(p.segments.size()); ++i)
    for (int64_t begin = 0; begin < p.segments[i].num_outputs; begin += outputs_per_item)
      p.items.push_back({i, begin, std::min(p.segments[i].num_outputs, begin + outputs_per_item)});
  const int64_t num_items = int64_t(p.items.size());
  // The pool has a thread per core; the calling thread is one of the workers.
  const int64_t helpers = std::min<int64_t>(threads, num_items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { Drain(*work); });
  Drain(p);
  // Every item is claimed by now; wait for the ones a helper is still working on.
  while (p.done.load(std::memory_order_acquire) < num_items) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JengineStackedMatmul, StackedMatmuls,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer, shape [1]
                                  .RemainingArgs()                // the weights
                                  .RemainingRets());              // their results
