// x @ dequantize(w[layer]).T for XLA:CPU on quantized weights, called through the XLA FFI
// (`cpu.py` builds and registers it). Same result as `reference.py` to float32 rounding,
// for a few float32 rows of x at a time.
//
// Why it exists: a decode step reads every weight once, and a quantized weight is 2-8x
// fewer bytes than its float32 copy only if nothing writes that copy. XLA:CPU dequantizes
// a layer's weights into a float buffer before its dot reads them (a write and a read of
// 4 bytes per weight, every step); here each group of packed values is widened in
// registers, scaled, and multiplied with x at once, so the step reads the packed bytes
// and nothing else. Work items (blocks of output rows) are shared between the calling
// thread and XLA's intra-op thread pool, as in the stacked float32 kernel.
//
// Layouts (row-major; `layout.py` is the definition): x [T, D]; values [L, F, D] int8 or
// [L, F, D / 2] uint8 (uint4, GGUF's nibble order per group of 32); scales and mins
// [L, F, G] float32 or float16; layer [1]; out [T, F].
//   w[f, i] = scale[f, g] * (q[f, i] - zero_point) + min[f, g],  g = i / (D / G)
// Requirements (cpu.py routes other shapes to the reference): D a multiple of 32, groups
// of a multiple of 32 inputs (uint4: exactly 32), T at most kMaxRows.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using f32x16 = float __attribute__((vector_size(64)));
using u8x16 = uint8_t __attribute__((vector_size(16)));
using i32x16 = int32_t __attribute__((vector_size(64)));
constexpr int64_t kGroup = 32;  // inputs widened together: two vectors of 16
constexpr int64_t kMaxRows = 16;
constexpr int kRowsPerPass = 4;  // rows of x that share one widening of the weights

enum Kind : int64_t { kInt8 = 0, kUint4 = 1 };

inline f32x16 LoadF(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float Sum(f32x16 v) {
  // Pairwise, so the result does not depend on how lanes were filled.
  float s[8];
  for (int i = 0; i < 8; ++i) s[i] = v[i] + v[i + 8];
  return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

// IEEE half -> float, exactly (subnormals, infinities and NaN included).
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F,
                 mantissa = h & 0x3FF;
  uint32_t bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000 | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else {
    float value = float(mantissa) * (1.0f / 16777216.0f);  // mantissa * 2^-24
    std::memcpy(&bits, &value, 4);
    bits |= sign;
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

template <typename Scale>
inline float ToFloat(Scale s) {
  if constexpr (std::is_same_v<Scale, float>) {
    return s;
  } else {
#ifdef __F16C__
    return _cvtsh_ss(s);
#else
    return HalfToFloat(s);
#endif
  }
}

struct Work {
  const float* x;
  const uint8_t* values;  // this layer's rows
  const void* scales;     // this layer's [F, G]
  const void* mins;       // this layer's [F, G], or null
  float* out;
  int64_t num_rows, dim, num_outputs, num_groups, row_bytes;  // T, D, F, G
  float zero_point;
  bool shifted;  // whether weights have a part independent of q (mins, a zero point)
  std::vector<float> x_sums;  // [T, G]: each group's sum of x (for mins and zero points)
  // With quantized activations: x as int8 per group of 32, and each group's scale.
  bool int_dot = false;
  std::vector<int8_t> x_quants;  // [T, D]
  std::vector<float> x_scales;   // [T, G]
  int64_t outputs_per_item, num_items;
  std::atomic<int64_t> next{0}, done{0};
};

// The 32 weights of row `row` from input `i` on, widened to float: two vectors.
template <Kind K>
inline void Widen(const uint8_t* row, int64_t i, f32x16& low, f32x16& high) {
  if constexpr (K == kInt8) {
    // Signed bytes as unsigned ones offset by 128 (exact): GCC widens unsigned byte
    // vectors with one instruction, signed ones one value at a time.
    u8x16 a, b;
    const uint8_t* src = row + i;
    std::memcpy(&a, src, 16);
    std::memcpy(&b, src + 16, 16);
    low = __builtin_convertvector(__builtin_convertvector(a ^ 0x80, i32x16), f32x16) - 128.0f;
    high = __builtin_convertvector(__builtin_convertvector(b ^ 0x80, i32x16), f32x16) - 128.0f;
  } else {
    u8x16 bytes;
    std::memcpy(&bytes, row + i / 2, 16);
    low = __builtin_convertvector(__builtin_convertvector(bytes & 0x0F, i32x16), f32x16);
    high = __builtin_convertvector(__builtin_convertvector(bytes >> 4, i32x16), f32x16);
  }
}

// Row `row`'s scales as float32 into `scales`, and, where the format has them, its shifts
// (min - zero_point * scale: the part of each weight that does not depend on q) into
// `shifts`.
template <typename Scale>
void RowScales(const Work& p, int64_t row, float* scales, float* shifts) {
  const int64_t G = p.num_groups;
  const Scale* src = static_cast<const Scale*>(p.scales) + row * G;
  int64_t g = 0;
#ifdef __F16C__
  if constexpr (!std::is_same_v<Scale, float>)
    for (; g + 8 <= G; g += 8)
      _mm256_storeu_ps(scales + g, _mm256_cvtph_ps(_mm_loadu_si128(
                                       reinterpret_cast<const __m128i*>(src + g))));
#endif
  for (; g < G; ++g) scales[g] = ToFloat(src[g]);
  if (!p.shifted) return;
  const Scale* mins = p.mins ? static_cast<const Scale*>(p.mins) + row * G : nullptr;
  for (g = 0; g < G; ++g) shifts[g] = -p.zero_point * scales[g];
  if (mins)
    for (g = 0; g < G; ++g) shifts[g] += ToFloat(mins[g]);
}

// The shifts' part of an output: the sum over groups of shift * (the group's sum of x).
inline float ShiftPart(const Work& p, const float* shifts, int64_t t) {
  if (!p.shifted) return 0.0f;
  const int64_t G = p.num_groups;
  const float* sums = p.x_sums.data() + t * G;
  float acc[8] = {};
  int64_t g = 0;
  for (; g + 8 <= G; g += 8)
    for (int k = 0; k < 8; ++k) acc[k] += shifts[g + k] * sums[g + k];
  for (; g < G; ++g) acc[g & 7] += shifts[g] * sums[g];
  return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

// out[t0 + t, j] for t < TR: row j's weights are widened group by group, and each
// group's products with TR rows of x are summed, then scaled. `scratch`: 2 * G floats.
template <Kind K, typename Scale, int TR>
void Outputs(const Work& p, int64_t j, int64_t t0, float* scratch) {
  const int64_t D = p.dim, G = p.num_groups, group = D / G;
  float* scales = scratch;
  float* shifts = scratch + G;
  RowScales<Scale>(p, j, scales, shifts);
  const uint8_t* row = p.values + j * p.row_bytes;
  const float* x = p.x + t0 * D;
  f32x16 acc[TR] = {};
  for (int64_t g = 0; g < G; ++g) {
    f32x16 dot[TR] = {};
    for (int64_t i = g * group; i < (g + 1) * group; i += kGroup) {
      f32x16 low, high;
      Widen<K>(row, i, low, high);
      for (int t = 0; t < TR; ++t)
        dot[t] += low * LoadF(x + t * D + i) + high * LoadF(x + t * D + i + 16);
    }
    for (int t = 0; t < TR; ++t) acc[t] += dot[t] * scales[g];
  }
  for (int t = 0; t < TR; ++t)
    p.out[(t0 + t) * p.num_outputs + j] = Sum(acc[t]) + ShiftPart(p, shifts, t0 + t);
}

// The integer dot product of one group of 32 weights (row `row`, inputs from `i`) with
// a group of quantized x, as 8 partial sums (lane k: inputs 4k..4k+3), in float.
using f32x8 = float __attribute__((vector_size(32)));

template <Kind K>
inline f32x8 GroupDot(const uint8_t* row, int64_t i, const int8_t* xq) {
#ifdef __AVX2__
  __m256i w, x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  if constexpr (K == kInt8) {
    w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i));
    // maddubs multiplies unsigned by signed bytes: |w| times x with w's sign.
    x = _mm256_sign_epi8(x, w);
    w = _mm256_sign_epi8(w, w);
  } else {
    const __m128i bytes =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i / 2));
    const __m128i nibble = _mm_set1_epi8(0x0F);
    w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble),
                         _mm_and_si128(bytes, nibble));
  }
  const __m256i sums =
      _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
  return f32x8(_mm256_cvtepi32_ps(sums));
#else
  f32x8 lanes;
  for (int k = 0; k < 8; ++k) {
    int32_t sum = 0;
    for (int m = 4 * k; m < 4 * k + 4; ++m) {
      int32_t q;
      if constexpr (K == kInt8) {
        q = int8_t(row[i + m]);
      } else {
        const uint8_t byte = row[i / 2 + (m & 15)];
        q = m < 16 ? byte & 0x0F : byte >> 4;
      }
      sum += q * xq[m];
    }
    lanes[k] = float(sum);
  }
  return lanes;
#endif
}

// As `Outputs`, with x quantized to int8 per group of 32: each group's integer dot
// product, times the weight's and x's scales (llama.cpp's way on CPU).
template <Kind K, typename Scale, int TR>
void OutputsIntDot(const Work& p, int64_t j, int64_t t0, float* scratch) {
  const int64_t D = p.dim, G = p.num_groups;
  float* scales = scratch;
  float* shifts = scratch + G;
  RowScales<Scale>(p, j, scales, shifts);
  const uint8_t* row = p.values + j * p.row_bytes;
  const int8_t* xq = p.x_quants.data() + t0 * D;
  const float* x_scales = p.x_scales.data() + t0 * G;
  f32x8 acc[TR] = {};
  for (int64_t g = 0; g < G; ++g)
    for (int t = 0; t < TR; ++t)
      acc[t] += GroupDot<K>(row, g * kGroup, xq + t * D + g * kGroup) *
                (scales[g] * x_scales[t * G + g]);
  for (int t = 0; t < TR; ++t) {
    const f32x8 v = acc[t];
    const float sum = ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
    p.out[(t0 + t) * p.num_outputs + j] = sum + ShiftPart(p, shifts, t0 + t);
  }
}

template <Kind K, typename Scale, int TR>
void Rows(const Work& p, int64_t begin, int64_t end, int64_t t0, float* scratch) {
  for (int64_t j = begin; j < end; ++j) {
    if (p.int_dot)
      OutputsIntDot<K, Scale, TR>(p, j, t0, scratch);
    else
      Outputs<K, Scale, TR>(p, j, t0, scratch);
  }
}

template <Kind K, typename Scale>
void Drain(Work& p) {
  std::vector<float> scratch(2 * p.num_groups);
  for (;;) {
    const int64_t item = p.next.fetch_add(1, std::memory_order_relaxed);
    if (item >= p.num_items) return;
    const int64_t begin = item * p.outputs_per_item;
    const int64_t end = std::min(p.num_outputs, begin + p.outputs_per_item);
    float* s = scratch.data();
    int64_t t = 0;
    for (; t + kRowsPerPass <= p.num_rows; t += kRowsPerPass) Rows<K, Scale, 4>(p, begin, end, t, s);
    switch (p.num_rows - t) {
      case 3: Rows<K, Scale, 3>(p, begin, end, t, s); break;
      case 2: Rows<K, Scale, 2>(p, begin, end, t, s); break;
      case 1: Rows<K, Scale, 1>(p, begin, end, t, s); break;
      default: break;
    }
    p.done.fetch_add(1, std::memory_order_release);
  }
}

std::string Shape(ffi::Span<const int64_t> dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + (dims.size() == 1 ? ",)" : ")");
}

template <Kind K, typename Scale>
ffi::Error Run(ffi::ThreadPool pool, std::shared_ptr<Work> work) {
  Work& p = *work;
  // About four items per thread, so threads that start late still get a share; at least
  // 16 outputs each, so an item's work outweighs claiming it.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per_item = (p.num_outputs + 4 * threads - 1) / (4 * threads);
  p.outputs_per_item = std::max<int64_t>(16, (per_item + 3) / 4 * 4);
  p.num_items = (p.num_outputs + p.outputs_per_item - 1) / p.outputs_per_item;
  const int64_t helpers = getenv("QM_SINGLE") ? 0 : std::min<int64_t>(threads, p.num_items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { Drain<K, Scale>(*work); });
  Drain<K, Scale>(p);
  while (p.done.load(std::memory_order_acquire) < p.num_items) std::this_thread::yield();
  return ffi::Error::Success();
}

ffi::Error QuantizedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer values,
                           ffi::AnyBuffer scales, ffi::AnyBuffer mins, ffi::Buffer<ffi::S32> layer,
                           ffi::ResultBuffer<ffi::F32> out, int64_t kind, int64_t zero_point,
                           bool has_mins, bool quantize_activations) {
  const auto x_dims = x.dimensions(), v_dims = values.dimensions(), s_dims = scales.dimensions();
  const char* problem = nullptr;
  const int64_t per_byte = kind == kUint4 ? 2 : 1;
  const auto value_type = kind == kUint4 ? ffi::DataType::U8 : ffi::DataType::S8;
  if (kind != kInt8 && kind != kUint4)
    problem = "kind must be 0 (int8) or 1 (uint4)";
  else if (x_dims.size() != 2 || v_dims.size() != 3 || s_dims.size() != 3)
    problem = "x must be [T, D], values [L, F, D or D / 2], scales [L, F, G]";
  else if (values.element_type() != value_type)
    problem = "values must be int8 (kind 0) or uint8 (kind 1)";
  else if (scales.element_type() != ffi::DataType::F32 && scales.element_type() != ffi::DataType::F16)
    problem = "scales must be float32 or float16";
  else if (x_dims[1] != v_dims[2] * per_byte || s_dims[0] != v_dims[0] || s_dims[1] != v_dims[1])
    problem = "x's D must match values', scales must be [L, F, G]";
  else if (x_dims[1] % kGroup || s_dims[2] == 0 || x_dims[1] % s_dims[2] ||
           (x_dims[1] / s_dims[2]) % kGroup || (kind == kUint4 && x_dims[1] / s_dims[2] != kGroup))
    problem = "groups must be whole multiples of 32 inputs (uint4: exactly 32)";
  else if (x_dims[0] > kMaxRows)
    problem = "at most 16 rows of x";
  else if (layer.element_count() != 1)
    problem = "layer must be one index";
  else if (has_mins && (mins.element_type() != scales.element_type() ||
                        mins.element_count() != scales.element_count()))
    problem = "mins must be like scales";
  if (problem)
    return ffi::Error::InvalidArgument("quantized matmul: " + std::string(problem) + "; got x " +
                                       Shape(x_dims) + ", values " + Shape(v_dims) + ", scales " +
                                       Shape(s_dims));
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= v_dims[0])
    return ffi::Error::InvalidArgument("quantized matmul: layer " + std::to_string(l) +
                                       " is outside the " + std::to_string(v_dims[0]) + " layers");
  auto work = std::make_shared<Work>();
  Work& p = *work;
  const int64_t F = v_dims[1], G = s_dims[2];
  const int64_t scale_bytes = scales.element_type() == ffi::DataType::F32 ? 4 : 2;
  p.x = x.typed_data();
  p.row_bytes = v_dims[2];
  p.values = static_cast<const uint8_t*>(values.untyped_data()) + l * F * p.row_bytes;
  p.scales = static_cast<const uint8_t*>(scales.untyped_data()) + l * F * G * scale_bytes;
  p.mins = has_mins ? static_cast<const uint8_t*>(mins.untyped_data()) + l * F * G * scale_bytes
                    : nullptr;
  p.out = out->typed_data();
  p.num_rows = x_dims[0];
  p.dim = x_dims[1];
  p.num_outputs = F;
  p.num_groups = G;
  p.zero_point = float(zero_point);
  if (p.num_rows == 0 || F == 0) return ffi::Error::Success();
  p.shifted = has_mins || zero_point;
  if (p.shifted) {
    const int64_t group = p.dim / G;
    p.x_sums.assign(p.num_rows * G, 0.0f);
    for (int64_t t = 0; t < p.num_rows; ++t)
      for (int64_t g = 0; g < G; ++g) {
        f32x16 sum = {};
        for (int64_t i = g * group; i < (g + 1) * group; i += 16) sum += LoadF(p.x + t * p.dim + i);
        p.x_sums[t * G + g] = Sum(sum);
      }
  }
  if (quantize_activations) {
    if (p.dim / G != kGroup)
      return ffi::Error::InvalidArgument(
          "quantized matmul: quantized activations need groups of 32 inputs");
    p.int_dot = true;
    p.x_quants.resize(p.num_rows * p.dim);
    p.x_scales.resize(p.num_rows * G);
    for (int64_t t = 0; t < p.num_rows; ++t)
      for (int64_t g = 0; g < G; ++g) {
        const float* x = p.x + t * p.dim + g * kGroup;
        float amax = 0.0f;
        for (int m = 0; m < kGroup; ++m) amax = std::max(amax, std::abs(x[m]));
        const float scale = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        p.x_scales[t * G + g] = scale;
        int32_t sum = 0;
        for (int m = 0; m < kGroup; ++m) {
          const int8_t q = int8_t(std::nearbyint(x[m] * inverse));
          p.x_quants[t * p.dim + g * kGroup + m] = q;
          sum += q;
        }
        // The shifts multiply the quantized x too: the product is that of the
        // dequantized weight with the dequantized x (`reference.py`).
        if (p.shifted) p.x_sums[t * G + g] = float(sum) * scale;
      }
  }
  const bool half = scale_bytes == 2;
  if (kind == kInt8) return half ? Run<kInt8, uint16_t>(pool, work) : Run<kInt8, float>(pool, work);
  return half ? Run<kUint4, uint16_t>(pool, work) : Run<kUint4, float>(pool, work);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JengineQuantizedMatmul, QuantizedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::AnyBuffer>()          // values
                                  .Arg<ffi::AnyBuffer>()          // scales
                                  .Arg<ffi::AnyBuffer>()          // mins (like scales, or [1])
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer, shape [1]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<int64_t>("kind")
                                  .Attr<int64_t>("zero_point")
                                  .Attr<bool>("has_mins")
                                  .Attr<bool>("quantize_activations"));
