// The quantized values and scales of `cpu.cc`'s layouts, as float vectors: the widening of
// int8, uint4 (GGUF's nibble order) and fp8 e4m3fn values, float16 scales, and the float
// vector helpers both of the kernel's products use, and whole rows dequantized for panels.
// Included by cpu.cc only (its build hashes this folder's headers with it).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

// AVX2 and FMA without AVX-512: values are widened 8 to a register (`Widen8`), and
// avx2_dots.h does the row-by-row products. 16-lane vectors are two registers each there,
// and GCC moved their lanes through memory one at a time (bench/README.md).
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define JENGINE_AVX2 1
#endif

namespace quantized_matmul {

using f32x16 = float __attribute__((vector_size(64)));
using u8x16 = uint8_t __attribute__((vector_size(16)));
using i32x16 = int32_t __attribute__((vector_size(64)));
using f32x8 = float __attribute__((vector_size(32)));
using i32x8 = int32_t __attribute__((vector_size(32)));
constexpr int64_t kGroup = 32;  // inputs widened together: two vectors of 16

enum Kind : int64_t { kInt8 = 0, kUint4 = 1, kFp8 = 2 };

inline f32x16 Load(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Two halves as one vector of 16 (AVX2: two registers).
inline f32x16 Join(f32x8 low, f32x8 high) {
  return __builtin_shufflevector(low, high, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
inline i32x16 Join(i32x8 low, i32x8 high) {
  return __builtin_shufflevector(low, high, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

// 16 bytes widened to 16 int32s, as signed or unsigned bytes. On AVX2 one instruction per
// 8: GCC's own conversion of a 16-byte vector to a 64-byte one moves each byte alone there
// (a quantized decode step ran at ~1 GB/s on an AVX2 CPU, bench/README.md).
template <bool Signed>
inline i32x16 WidenBytes(u8x16 bytes) {
#if defined(__AVX512F__)
  const __m128i b = __m128i(bytes);
  return i32x16(Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif defined(__AVX2__)
  const __m128i b = __m128i(bytes), upper = _mm_unpackhi_epi64(b, b);
  if constexpr (Signed)
    return Join(i32x8(_mm256_cvtepi8_epi32(b)), i32x8(_mm256_cvtepi8_epi32(upper)));
  else
    return Join(i32x8(_mm256_cvtepu8_epi32(b)), i32x8(_mm256_cvtepu8_epi32(upper)));
#else
  using i8x16 = int8_t __attribute__((vector_size(16)));
  if constexpr (Signed)
    return __builtin_convertvector(i8x16(bytes), i32x16);
  else
    return __builtin_convertvector(bytes, i32x16);
#endif
}

// float16 bits to float32, exactly.
inline float HalfToFloat(uint16_t h) {
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  float magnitude;
  if (exponent == 0x1F) {
    const uint32_t bits = 0x7F800000u | (mantissa << 13);
    std::memcpy(&magnitude, &bits, 4);
  } else {
    magnitude = exponent ? std::ldexp(float(mantissa | 0x400), int(exponent) - 25)
                         : std::ldexp(float(mantissa), -24);
  }
  uint32_t bits;
  std::memcpy(&bits, &magnitude, 4);
  bits |= sign;
  std::memcpy(&magnitude, &bits, 4);
  return magnitude;
#endif
}

// A weight's scales and mins as stored: float32, or float16 widened as read.
template <typename S>
inline float Scale(const S* p, int64_t i) {
  if constexpr (std::is_same_v<S, float>)
    return p[i];
  else
    return HalfToFloat(p[i]);
}

#ifdef __AVX__
// 8 scales or mins from p on, in one register.
template <typename S>
inline __m256 LoadScales8(const S* p) {
  if constexpr (std::is_same_v<S, float>) {
    return _mm256_loadu_ps(p);
  } else {
#ifdef __F16C__
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    return _mm256_setr_ps(HalfToFloat(p[0]), HalfToFloat(p[1]), HalfToFloat(p[2]),
                          HalfToFloat(p[3]), HalfToFloat(p[4]), HalfToFloat(p[5]),
                          HalfToFloat(p[6]), HalfToFloat(p[7]));
#endif
  }
}
#endif

// 16 of them from p on.
template <typename S>
inline f32x16 LoadScales(const S* p) {
  if constexpr (std::is_same_v<S, float>) {
    return Load(p);
  } else {
#if defined(__AVX512F__)
    return f32x16(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__AVX__)
    return Join(f32x8(LoadScales8(p)), f32x8(LoadScales8(p + 8)));
#else
    f32x16 v;
    for (int i = 0; i < 16; ++i) v[i] = HalfToFloat(p[i]);
    return v;
#endif
  }
}

// The sum of 16 lanes [low | high], pairwise so the result does not depend on how lanes
// were filled: ((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7)), s_i the sum of lanes i
// and i + 8. In whole-vector shuffles: on AVX2 GCC moves a 16-lane vector's single lanes
// through memory.
inline float Sum(f32x8 low, f32x8 high) {
  using f32x4 = float __attribute__((vector_size(16)));
  using f32x2 = float __attribute__((vector_size(8)));
  const f32x8 s = low + high;
  const f32x4 quad =
      __builtin_shufflevector(s, s, 0, 1, 2, 3) + __builtin_shufflevector(s, s, 4, 5, 6, 7);
  const f32x2 pair =
      __builtin_shufflevector(quad, quad, 0, 1) + __builtin_shufflevector(quad, quad, 2, 3);
  return pair[0] + pair[1];
}

inline float Sum(f32x16 v) {
  return Sum(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7),
             __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
}

// A row's mins times x's group sums: sum over groups g of min[g] * sums[g], 16 groups a
// step (on AVX2 in two 8-lane registers: see Sum).
template <typename S>
float MinsShift(const S* mins, const float* sums, int64_t num_groups) {
  float shift = 0.0f;
  int64_t g = 0;
#ifdef JENGINE_AVX2
  __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();
  for (; g + 16 <= num_groups; g += 16) {
    low = _mm256_fmadd_ps(LoadScales8(mins + g), _mm256_loadu_ps(sums + g), low);
    high = _mm256_fmadd_ps(LoadScales8(mins + g + 8), _mm256_loadu_ps(sums + g + 8), high);
  }
  for (; g < num_groups; ++g) shift += Scale(mins, g) * sums[g];
  return shift + Sum(f32x8(low), f32x8(high));
#else
  f32x16 lanes = {};
  for (; g + 16 <= num_groups; g += 16) lanes += LoadScales(mins + g) * Load(sums + g);
  for (; g < num_groups; ++g) shift += Scale(mins, g) * sums[g];
  return shift + Sum(lanes);
#endif
}

// float8 e4m3fn (OCP: 4 exponent bits of bias 7, 3 mantissa bits, no infinities, NaN at
// S.1111.111) to float32, exactly: normals rebias the exponent, subnormals are m * 2^-9.
// `u`: the bytes widened to int32 lanes (16 here, 8 in avx2_dots.h); F: float lanes alike.
template <typename F, typename I>
inline F Fp8BytesToFloat(I u) {
  const I sign = (u & 0x80) << 24, exponent = (u >> 3) & 0xF, mantissa = u & 7;
  const I normal = sign | ((exponent + 120) << 23) | (mantissa << 20);
  const F small = __builtin_convertvector(mantissa, F) * (1.0f / 512.0f);
  I subnormal;
  std::memcpy(&subnormal, &small, sizeof(small));
  I bits = exponent == 0 ? subnormal | sign : normal;
  bits = (u & 0x7F) == 0x7F ? sign | 0x7FC00000 : bits;
  F out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline f32x16 Fp8ToFloat(u8x16 bytes) {
  return Fp8BytesToFloat<f32x16>(WidenBytes<false>(bytes));
}

// The 32 weights of `row` from input `i` on, as float q: two vectors of 16.
template <Kind K>
inline void Widen(const uint8_t* row, int64_t i, f32x16& low, f32x16& high) {
  if constexpr (K == kInt8) {
    u8x16 a, b;
    std::memcpy(&a, row + i, 16);
    std::memcpy(&b, row + i + 16, 16);
    low = __builtin_convertvector(WidenBytes<true>(a), f32x16);
    high = __builtin_convertvector(WidenBytes<true>(b), f32x16);
  } else if constexpr (K == kFp8) {
    u8x16 a, b;
    std::memcpy(&a, row + i, 16);
    std::memcpy(&b, row + i + 16, 16);
    low = Fp8ToFloat(a);
    high = Fp8ToFloat(b);
  } else {
    u8x16 bytes;
    std::memcpy(&bytes, row + i / 2, 16);
    low = __builtin_convertvector(WidenBytes<false>(bytes & 0x0F), f32x16);
    high = __builtin_convertvector(WidenBytes<false>(bytes >> 4), f32x16);
  }
}

#ifdef JENGINE_AVX2
// The 32 values of `row` from input `i` on as floats: q[0] inputs 0-7, ..., q[3] 24-31.
template <Kind K>
inline void Widen8(const uint8_t* row, int64_t i, __m256 (&q)[4]) {
  __m128i first, second;  // the bytes of inputs 0-15 and 16-31
  if constexpr (K == kUint4) {  // input j in the low nibble of byte j, j + 16 in its high one
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i / 2));
    const __m128i nibble = _mm_set1_epi8(0x0F);
    first = _mm_and_si128(bytes, nibble);
    second = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
  } else {
    first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i));
    second = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i + 16));
  }
  const __m128i eights[4] = {first, _mm_unpackhi_epi64(first, first), second,
                             _mm_unpackhi_epi64(second, second)};
  for (int k = 0; k < 4; ++k) {
    if constexpr (K == kFp8)
      q[k] = __m256(Fp8BytesToFloat<f32x8>(i32x8(_mm256_cvtepu8_epi32(eights[k]))));
    else if constexpr (K == kInt8)
      q[k] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eights[k]));
    else
      q[k] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eights[k]));
  }
}

#endif

// Rows [begin, end) of one weight (`values`: row_bytes a row; scales and mins [F, G], mins
// null where absent) dequantized into panel [end - begin, D] (`panel.h`'s batched
// products), as the reference computes them: q * scale, then + min.
template <Kind K, typename S>
void Dequantize(const uint8_t* values, int64_t row_bytes, const S* scales, const S* mins,
                int64_t num_groups, int64_t dim, int64_t begin, int64_t end, float* panel) {
  const int64_t group = dim / num_groups;
  for (int64_t j = begin; j < end; ++j) {
    const uint8_t* row = values + j * row_bytes;
    const S* row_scales = scales + j * num_groups;
    float* out = panel + (j - begin) * dim;
    for (int64_t i = 0; i < dim; i += kGroup) {
#ifdef JENGINE_AVX2
      __m256 q[4];  // inputs i .. i + 7, ..., i + 24 .. i + 31
      Widen8<K>(row, i, q);
      for (int k = 0; k < 4; ++k) {
        const int64_t g = (i + 8 * k) / group;
        __m256 w = _mm256_mul_ps(q[k], _mm256_set1_ps(Scale(row_scales, g)));
        if (mins) w = _mm256_add_ps(w, _mm256_set1_ps(Scale(mins + j * num_groups, g)));
        _mm256_storeu_ps(out + i + 8 * k, w);
      }
#else
      f32x16 low, high;  // inputs i .. i + 15 and i + 16 .. i + 31
      Widen<K>(row, i, low, high);
      const int64_t g_low = i / group, g_high = (i + 16) / group;
      low *= Scale(row_scales, g_low);
      high *= Scale(row_scales, g_high);
      if (mins) {
        low += Scale(mins + j * num_groups, g_low);
        high += Scale(mins + j * num_groups, g_high);
      }
      std::memcpy(out + i, &low, sizeof(low));
      std::memcpy(out + i + 16, &high, sizeof(high));
#endif
    }
  }
}

}  // namespace quantized_matmul
