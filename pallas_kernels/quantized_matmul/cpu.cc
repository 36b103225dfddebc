// x @ dequantize(w[layer]).T for XLA:CPU on quantized weights, called through the XLA FFI
// (`cpu.py` builds and registers it). Same result as `reference.py` to float32 rounding,
// for up to kMaxRows float32 rows of x, for one weight or several that multiply the same x
// (a layer's q, k and v, its gate and up), each in its own format: one call computes them
// all, each output as a call of its own would, bit for bit.
//
// Why it exists: a decode step reads every weight once, and a quantized weight is 4-8x
// fewer bytes than its float32 copy only if nothing writes that copy. XLA:CPU dequantizes
// a layer's weights into a float buffer before its dot reads them (a write and a read of
// 4 bytes per weight, every step); here each group of packed values is widened to float
// in registers and multiplied with x at once, so a step reads the packed bytes and
// nothing else. The result is the dequantized weight's to float32 rounding: x stays float,
// or for 4-bit weights on CPUs with AVX-512 VNNI or AVX2 (without AVX-512) becomes integers
// exact to 2^-23 of each run's largest |x| (`integer_x.h`: not llama.cpp's x rounded to
// int8). Work items (blocks of output rows, of all the call's weights at once) are shared
// between the calling thread and XLA's intra-op thread pool, as in the stacked float32
// kernel. `values.h` widens the stored values and scales. Past kRowByRowRows rows
// (batched decode steps, short prefill chunks) the products are compute-bound: an item's
// 32 output rows are dequantized once into a float panel in L2 and multiply every row of x
// through `panel.h`'s register tiles (pallas_kernels/include), where XLA would write the
// whole layer dequantized to a fresh buffer and its GEMM pack it once more.
//
// Layouts (row-major; `layout.py` is the definition): x [T, D]; layer [1]; then for each
// weight values [L, F, D] int8 or float8 e4m3fn, or [L, F, D / 2] uint8 (uint4, GGUF's nibble
// order per run of 32), scales and mins [L, F, G] float32 or float16, both alike (mins [1]
// where absent; float16 where the format's own scales are: GGUF's legacy blocks, 2 bytes a
// group less to read); results out [T, F], one per weight; attributes kinds and has_mins,
// one entry per weight, and integer_x (0: float x for every weight).
//   w[f, i] = scale[f, g] * q[f, i] + min[f, g],  g = i / (D / G)
// Requirements (cpu.py routes other shapes to the reference): rows of a multiple of 32
// inputs, groups of a multiple of 32 inputs or of 16 (uint4: of 32), T at most kMaxRows.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "avx2_dots.h"
#include "integer_x.h"
#include "panel.h"  // shared with stacked_matmul (pallas_kernels/include)
#include "values.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace quantized_matmul;

// Up to this many rows of x each output row's weights are widened in registers and
// multiplied row by row; more go through dequantized panels (`panel.h`).
constexpr int64_t kRowByRowRows = 16;
constexpr int64_t kMaxRows = 256;
constexpr int kRowsPerPass = 4;  // rows of x that share one widening of the weights
// Below this many weights a call runs on the calling thread alone: waking a helper costs
// more than the half of the work it would take.
constexpr int64_t kMinParallelWeights = 1 << 18;

// One weight's part of a call.
struct Segment {
  Kind kind;
  bool half;              // scales and mins are float16 (else float32)
  const uint8_t* values;  // this layer's rows
  const void* scales;     // this layer's [F, G]
  const void* mins;       // this layer's [F, G], or null
  float* out;             // [T, F]
  int64_t num_outputs, num_groups, row_bytes;  // F, G
  std::vector<float> x_sums;  // [T, G]: each group's sum of x (what the mins multiply
                              // row by row; panels hold the mins in their weights)
};

// A block of one segment's output rows.
struct Item {
  int64_t segment, begin, end;
};

struct Work {
  const float* x;
  int64_t num_rows, dim;  // T, D
  IntegerX integer_x;  // prepared where 4-bit weights use it
  panel::XColumns columns;  // prepared for more than kRowByRowRows rows
  std::vector<Segment> segments;
  std::vector<Item> items;
  std::atomic<int64_t> next{0}, done{0};
};

// R weight rows' products with TR rows of float x from row t0 on, without their mins: the
// weights are widened group by group; each group's products with the rows of x are summed,
// then scaled. The R rows go group by group side by side (R streams for the memory, see
// `Outputs`), each summed as it would be alone.
template <Kind K, typename S, int TR, int R>
void FloatDots(const Work& p, const Segment& s, const uint8_t* const (&rows)[R],
               const S* const (&scales)[R], int64_t t0, float (&dots)[R][TR]) {
  const int64_t D = p.dim, G = s.num_groups, group = D / G;
  const float* x = p.x + t0 * D;
#ifdef JENGINE_AVX2
  // AVX2 without AVX-512: the same products in 8-lane registers (avx2_dots.h says why).
  for (int k = 0; k < R; ++k) GroupDots<K, S, TR>(rows[k], scales[k], G, group, x, D, dots[k]);
  return;
#endif
  f32x16 acc[R][TR] = {};
  if (group == kGroup) {
    // One widening per group (every GGUF format): two groups a pass, their products
    // independent of each other.
    f32x16 acc2[R][TR] = {};
    int64_t g = 0;
    for (; g + 2 <= G; g += 2) {
      const int64_t i = g * kGroup;
      for (int k = 0; k < R; ++k) {
        f32x16 a0, a1, b0, b1;
        Widen<K>(rows[k], i, a0, a1);
        Widen<K>(rows[k], i + kGroup, b0, b1);
        const float scale = Scale(scales[k], g), next_scale = Scale(scales[k], g + 1);
        for (int t = 0; t < TR; ++t) {
          const float* xt = x + t * D + i;
          acc[k][t] += (a0 * Load(xt) + a1 * Load(xt + 16)) * scale;
          acc2[k][t] += (b0 * Load(xt + 32) + b1 * Load(xt + 48)) * next_scale;
        }
      }
    }
    for (; g < G; ++g) {
      for (int k = 0; k < R; ++k) {
        f32x16 a0, a1;
        Widen<K>(rows[k], g * kGroup, a0, a1);
        const float scale = Scale(scales[k], g);
        for (int t = 0; t < TR; ++t) {
          const float* xt = x + t * D + g * kGroup;
          acc[k][t] += (a0 * Load(xt) + a1 * Load(xt + 16)) * scale;
        }
      }
    }
    for (int k = 0; k < R; ++k)
      for (int t = 0; t < TR; ++t) acc[k][t] += acc2[k][t];
  } else if (group == kGroup / 2) {
    // Groups of 16 (Q6_K): each widening of 32 inputs spans two groups.
    for (int64_t g = 0; g < G; g += 2) {
      for (int k = 0; k < R; ++k) {
        f32x16 a0, a1;
        Widen<K>(rows[k], g * 16, a0, a1);
        const float scale = Scale(scales[k], g), next_scale = Scale(scales[k], g + 1);
        for (int t = 0; t < TR; ++t) {
          const float* xt = x + t * D + g * 16;
          acc[k][t] += (a0 * Load(xt)) * scale + (a1 * Load(xt + 16)) * next_scale;
        }
      }
    }
  } else {
    for (int64_t g = 0; g < G; ++g) {
      for (int k = 0; k < R; ++k) {
        f32x16 dot[TR] = {};
        for (int64_t i = g * group; i < (g + 1) * group; i += kGroup) {
          f32x16 low, high;
          Widen<K>(rows[k], i, low, high);
          for (int t = 0; t < TR; ++t)
            dot[t] += low * Load(x + t * D + i) + high * Load(x + t * D + i + 16);
        }
        const float scale = Scale(scales[k], g);
        for (int t = 0; t < TR; ++t) acc[k][t] += dot[t] * scale;
      }
    }
  }
  for (int k = 0; k < R; ++k)
    for (int t = 0; t < TR; ++t) dots[k][t] = Sum(acc[k][t]);
}

// out[t0 + t, js[k]] for t < TR and k < R: the products (with integer x where every row
// has it), then the mins times x's group sums.
template <Kind K, typename S, int TR, int R>
void RowOutputs(const Work& p, const Segment& s, const int64_t (&js)[R], int64_t t0) {
  const int64_t G = s.num_groups;
  const uint8_t* rows[R];
  const S* scales[R];
  for (int k = 0; k < R; ++k) {
    rows[k] = s.values + js[k] * s.row_bytes;
    scales[k] = static_cast<const S*>(s.scales) + js[k] * G;
  }
  float dots[R][TR];
  if (K == kUint4 && p.integer_x.Covers(t0, TR))
    IntegerDots<S, TR, R>(p.integer_x, rows, scales, G, p.dim, t0, dots);
  else
    FloatDots<K, S, TR, R>(p, s, rows, scales, t0, dots);
  for (int k = 0; k < R; ++k)
    for (int t = 0; t < TR; ++t) {
      const float shift =
          s.mins ? MinsShift(static_cast<const S*>(s.mins) + js[k] * G, &s.x_sums[(t0 + t) * G], G)
                 : 0.0f;
      s.out[(t0 + t) * s.num_outputs + js[k]] = dots[k][t] + shift;
    }
}

// The item's rows in R parts read side by side, as in the stacked float32 kernel: one
// stream of weights does not keep a core's memory queue full. On an AMX Xeon 4-bit rows
// of 576 inputs out of memory took 36 ns each four at a time against 55 one at a time
// (one thread; 29-31 from cache either way), and a SmolLM2 Q4_1 step's products 0.86-0.91x
// the time (bench/README.md). R * TR sums stay in registers. AVX2 builds read one row at a
// time: their register files are half the size, and no AVX2 CPU was at hand to measure.
template <Kind K, typename S, int TR>
void Outputs(const Work& p, const Segment& s, const Item& item, int64_t t0) {
#ifdef JENGINE_AVX2
  constexpr int R = 1;
#else
  constexpr int R = TR == 1 ? 4 : TR == 2 ? 2 : 1;
#endif
  const int64_t part = (item.end - item.begin) / R;
  for (int64_t j = item.begin; j < item.begin + part; ++j) {
    int64_t js[R];
    for (int k = 0; k < R; ++k) js[k] = j + k * part;
    RowOutputs<K, S, TR, R>(p, s, js, t0);
  }
  for (int64_t j = item.begin + R * part; j < item.end; ++j) RowOutputs<K, S, TR, 1>(p, s, {j}, t0);
}

template <Kind K, typename S>
void RunItem(const Work& p, const Segment& s, const Item& item) {
  int64_t t = 0;
  for (; t + kRowsPerPass <= p.num_rows; t += kRowsPerPass) Outputs<K, S, 4>(p, s, item, t);
  switch (p.num_rows - t) {
    case 3: Outputs<K, S, 3>(p, s, item, t); break;
    case 2: Outputs<K, S, 2>(p, s, item, t); break;
    case 1: Outputs<K, S, 1>(p, s, item, t); break;
    default: break;
  }
}

// Many rows: the item's output rows dequantized into a panel, then every row of x.
template <Kind K, typename S>
void RunPanelItem(const Work& p, const Segment& s, const Item& item) {
  thread_local std::vector<float> rows;  // reused across calls: no fresh pages a step
  rows.resize(panel::kPanelRows * p.dim);
  Dequantize<K, S>(s.values, s.row_bytes, static_cast<const S*>(s.scales),
                   static_cast<const S*>(s.mins), s.num_groups, p.dim, item.begin, item.end,
                   rows.data());
  panel::PanelProducts(rows.data(), item.end - item.begin, p.dim, p.columns, s.out,
                       s.num_outputs, item.begin);
}

template <Kind K, typename S>
void RunAnyItem(const Work& p, const Segment& s, const Item& item) {
  if (p.num_rows > kRowByRowRows)
    RunPanelItem<K, S>(p, s, item);
  else
    RunItem<K, S>(p, s, item);
}

template <typename S>
void RunItem(const Work& p, const Segment& s, const Item& item) {
  if (s.kind == kInt8)
    RunAnyItem<kInt8, S>(p, s, item);
  else if (s.kind == kFp8)
    RunAnyItem<kFp8, S>(p, s, item);
  else
    RunAnyItem<kUint4, S>(p, s, item);
}

void Drain(Work& p) {
  const int64_t num_items = int64_t(p.items.size());
  for (;;) {
    const int64_t index = p.next.fetch_add(1, std::memory_order_relaxed);
    if (index >= num_items) return;
    const Item& item = p.items[index];
    const Segment& s = p.segments[item.segment];
    if (s.half)
      RunItem<uint16_t>(p, s, item);
    else
      RunItem<float>(p, s, item);
    p.done.fetch_add(1, std::memory_order_release);
  }
}

void Run(ffi::ThreadPool& pool, std::shared_ptr<Work> work) {
  Work& p = *work;
  int64_t total_outputs = 0;
  for (const Segment& s : p.segments) total_outputs += s.num_outputs;
  // About four items per thread over all the weights (finer items measured slower), so
  // threads that start late still get a share; at least 16 outputs each, so an item's
  // work outweighs claiming it.
  const int64_t passes = p.num_rows > kRowByRowRows ? p.num_rows : 1;  // products a weight
  const int64_t threads = total_outputs * p.dim * passes < kMinParallelWeights
                              ? 1
                              : std::max<int64_t>(1, pool.num_threads());
  const int64_t per_item = (total_outputs + 4 * threads - 1) / (4 * threads);
  const int64_t outputs_per_item =
      p.num_rows > kRowByRowRows ? panel::kPanelRows : std::max<int64_t>(16, per_item);
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
}

std::string Shape(ffi::Span<const int64_t> dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + (dims.size() == 1 ? ",)" : ")");
}

// Checks one weight's buffers against x and fills its segment; the problem, if any.
std::string AddSegment(Work& p, ffi::Span<const int64_t> x_dims, int64_t l, int64_t kind,
                       bool has_mins, ffi::AnyBuffer values, ffi::AnyBuffer scales,
                       ffi::AnyBuffer mins, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const auto v_dims = values.dimensions(), s_dims = scales.dimensions();
  const auto out_dims = out->dimensions();
  const int64_t per_byte = kind == kUint4 ? 2 : 1;
  const auto value_type = kind == kUint4  ? ffi::DataType::U8
                          : kind == kFp8 ? ffi::DataType::F8E4M3FN
                                         : ffi::DataType::S8;
  const char* problem = nullptr;
  if (kind != kInt8 && kind != kUint4 && kind != kFp8)
    problem = "kind must be 0 (int8), 1 (uint4) or 2 (fp8)";
  else if (v_dims.size() != 3 || s_dims.size() != 3)
    problem = "values must be [L, F, D or D / 2], scales [L, F, G]";
  else if (values.element_type() != value_type)
    problem = "values must be int8 (kind 0), uint8 (kind 1) or float8_e4m3fn (kind 2)";
  else if (x_dims[1] != v_dims[2] * per_byte || s_dims[0] != v_dims[0] || s_dims[1] != v_dims[1])
    problem = "x's D must match values', scales must be [L, F, G]";
  else if (s_dims[2] == 0 || x_dims[1] % kGroup || x_dims[1] % s_dims[2] ||
           ((x_dims[1] / s_dims[2]) % kGroup && x_dims[1] / s_dims[2] != kGroup / 2) ||
           (kind == kUint4 && (x_dims[1] / s_dims[2]) % kGroup))
    problem = "rows must be whole multiples of 32 inputs, groups multiples of 32 or 16 "
              "(uint4: of 32)";
  else if (scales.element_type() != ffi::DataType::F32 &&
           scales.element_type() != ffi::DataType::F16)
    problem = "scales must be float32 or float16";
  else if (has_mins && (mins.element_count() != scales.element_count() ||
                        mins.element_type() != scales.element_type()))
    problem = "mins must be shaped like scales, of their type";
  else if (out_dims.size() != 2 || out_dims[0] != x_dims[0] || out_dims[1] != v_dims[1])
    problem = "out must be [T, F]";
  if (problem)
    return std::string(problem) + "; got x " + Shape(x_dims) + ", values " + Shape(v_dims) +
           ", scales " + Shape(s_dims);
  if (l < 0 || l >= v_dims[0])
    return "layer " + std::to_string(l) + " is outside the " + std::to_string(v_dims[0]) +
           " layers";
  Segment s;
  const int64_t F = v_dims[1], G = s_dims[2];
  s.kind = Kind(kind);
  s.row_bytes = v_dims[2];
  s.values = static_cast<const uint8_t*>(values.untyped_data()) + l * F * s.row_bytes;
  s.half = scales.element_type() == ffi::DataType::F16;
  const int64_t scale_bytes = s.half ? 2 : 4;
  s.scales = static_cast<const uint8_t*>(scales.untyped_data()) + l * F * G * scale_bytes;
  s.mins = has_mins ? static_cast<const uint8_t*>(mins.untyped_data()) + l * F * G * scale_bytes
                    : nullptr;
  s.out = out->typed_data();
  s.num_outputs = F;
  s.num_groups = G;
  if (has_mins && p.num_rows <= kRowByRowRows) {
    const int64_t group = p.dim / G;
    s.x_sums.assign(p.num_rows * G, 0.0f);
    for (int64_t t = 0; t < p.num_rows; ++t)
      for (int64_t g = 0; g < G; ++g) {
        f32x16 sum = {};
        for (int64_t i = g * group; i < (g + 1) * group; i += 16) sum += Load(p.x + t * p.dim + i);
        s.x_sums[t * G + g] = Sum(sum);
      }
  }
  p.segments.push_back(std::move(s));
  return "";
}

ffi::Error QuantizedMatmuls(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::S32> layer, ffi::RemainingArgs weights,
                            ffi::RemainingRets outs, ffi::Span<const int64_t> kinds,
                            ffi::Span<const int64_t> has_mins, int64_t integer_x) {
  const auto x_dims = x.dimensions();
  auto fail = [](const std::string& problem) {
    return ffi::Error::InvalidArgument("quantized matmul: " + problem);
  };
  if (x_dims.size() != 2) return fail("x must be [T, D], got " + Shape(x_dims));
  if (x_dims[0] > kMaxRows)
    return fail("at most " + std::to_string(kMaxRows) + " rows of x, got " + Shape(x_dims));
  if (layer.element_count() != 1) return fail("layer must be one index");
  const size_t n = outs.size();
  if (n == 0 || weights.size() != 3 * n || kinds.size() != n || has_mins.size() != n)
    return fail("each weight needs values, scales, mins, a result, a kind and has_mins");
  auto work = std::make_shared<Work>();
  Work& p = *work;
  p.x = x.typed_data();
  p.num_rows = x_dims[0];
  p.dim = x_dims[1];
  const int64_t l = layer.typed_data()[0];
  for (size_t i = 0; i < n; ++i) {
    auto values = weights.get<ffi::AnyBuffer>(3 * i);
    auto scales = weights.get<ffi::AnyBuffer>(3 * i + 1);
    auto mins = weights.get<ffi::AnyBuffer>(3 * i + 2);
    auto out = outs.get<ffi::Buffer<ffi::F32>>(i);
    if (!values.has_value() || !scales.has_value() || !mins.has_value() || !out.has_value())
      return fail("each weight needs values, scales, mins and a float32 result");
    const std::string problem =
        AddSegment(p, x_dims, l, kinds[i], has_mins[i] != 0, *values, *scales, *mins, *out);
    if (!problem.empty()) return fail(problem);
  }
  if (p.num_rows == 0) return ffi::Error::Success();
  bool four_bit = false;
  for (const Segment& s : p.segments) four_bit = four_bit || s.kind == kUint4;
  if (p.num_rows > kRowByRowRows)
    p.columns.Prepare(p.x, p.num_rows, p.dim);
  else if (integer_x && four_bit)
    p.integer_x.Prepare(p.x, p.num_rows, p.dim);
  Run(pool, work);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JengineQuantizedMatmul, QuantizedMatmuls,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer, shape [1]
                                  // per weight: values (int8, uint8 or fp8), scales, and
                                  // mins (like scales, or [1])
                                  .RemainingArgs()
                                  .RemainingRets()  // per weight: out
                                  .Attr<ffi::Span<const int64_t>>("kinds")
                                  .Attr<ffi::Span<const int64_t>>("has_mins")
                                  // 1: x as integers for 4-bit weights where the CPU can
                                  .Attr<int64_t>("integer_x"));
