// A weight row's products with a few rows of float x, for CPUs with AVX2 and FMA but not
// AVX-512: `cpu.cc`'s FloatDots for every format, in the CPU's own 8-lane registers.
// Included by cpu.cc only (its build hashes this folder's headers with it).
//
// Why: FloatDots holds 16-lane vectors, each two registers on AVX2, and GCC kept those
// (and the 4 rows' two accumulators each) in memory there: a Q4_1 decode step read its
// weights at ~1.5 GB/s on an AVX2 CPU (bench/README.md). Here a group's 32 weights are
// four registers and each row of x two accumulators (the first and second 8 lanes of
// FloatDots' 16). Per group and lane the sums are FloatDots' terms, but chained in another
// order (fused multiply-adds over a group's runs; the groups into one accumulator, where
// FloatDots alternates two), so results differ from an AVX-512 build's by float32
// rounding.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define JENGINE_AVX2_DOTS 1

#include <immintrin.h>

#include <cstdint>

#include "values.h"

namespace quantized_matmul {

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

// FloatDots: acc[t] += each group's products with row t of x, times the group's scale.
// Groups of 16 (Q6_K): a widening of 32 spans two, its lanes 0-15 the first.
template <Kind K, typename S, int TR>
void GroupDots(const uint8_t* row, const S* scales, int64_t num_groups, int64_t group,
               const float* x, int64_t dim, f32x16 (&acc)[TR]) {
  __m256 low[TR], high[TR];  // lanes 0-7 and 8-15 of FloatDots' 16
  for (int t = 0; t < TR; ++t) low[t] = high[t] = _mm256_setzero_ps();
  if (group == kGroup / 2) {
    for (int64_t g = 0; g < num_groups; g += 2) {
      __m256 q[4];
      Widen8<K>(row, g * 16, q);
      const __m256 scale = _mm256_set1_ps(Scale(scales, g));
      const __m256 next_scale = _mm256_set1_ps(Scale(scales, g + 1));
      for (int t = 0; t < TR; ++t) {
        const float* xt = x + t * dim + g * 16;
        low[t] = _mm256_fmadd_ps(_mm256_mul_ps(q[0], _mm256_loadu_ps(xt)), scale, low[t]);
        high[t] = _mm256_fmadd_ps(_mm256_mul_ps(q[1], _mm256_loadu_ps(xt + 8)), scale, high[t]);
        low[t] = _mm256_fmadd_ps(_mm256_mul_ps(q[2], _mm256_loadu_ps(xt + 16)), next_scale, low[t]);
        high[t] =
            _mm256_fmadd_ps(_mm256_mul_ps(q[3], _mm256_loadu_ps(xt + 24)), next_scale, high[t]);
      }
    }
  } else {  // a multiple of 32
    for (int64_t g = 0; g < num_groups; ++g) {
      __m256 dot_low[TR], dot_high[TR];
      for (int t = 0; t < TR; ++t) dot_low[t] = dot_high[t] = _mm256_setzero_ps();
      for (int64_t i = g * group; i < (g + 1) * group; i += kGroup) {
        __m256 q[4];
        Widen8<K>(row, i, q);
        for (int t = 0; t < TR; ++t) {
          const float* xt = x + t * dim + i;
          dot_low[t] = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xt + 16),
                                       _mm256_fmadd_ps(q[0], _mm256_loadu_ps(xt), dot_low[t]));
          dot_high[t] = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xt + 24),
                                        _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xt + 8), dot_high[t]));
        }
      }
      const __m256 scale = _mm256_set1_ps(Scale(scales, g));
      for (int t = 0; t < TR; ++t) {
        low[t] = _mm256_fmadd_ps(dot_low[t], scale, low[t]);
        high[t] = _mm256_fmadd_ps(dot_high[t], scale, high[t]);
      }
    }
  }
  for (int t = 0; t < TR; ++t) acc[t] += Join(f32x8(low[t]), f32x8(high[t]));
}

// `Dequantize` (values.h) for panels, 8 values a register: q * scale, then + min.
template <Kind K, typename S>
void Dequantize8(const uint8_t* values, int64_t row_bytes, const S* scales, const S* mins,
                 int64_t num_groups, int64_t dim, int64_t begin, int64_t end, float* panel) {
  const int64_t group = dim / num_groups;
  for (int64_t j = begin; j < end; ++j) {
    const uint8_t* row = values + j * row_bytes;
    float* out = panel + (j - begin) * dim;
    for (int64_t i = 0; i < dim; i += kGroup) {
      __m256 q[4];
      Widen8<K>(row, i, q);
      for (int k = 0; k < 4; ++k) {
        const int64_t g = j * num_groups + (i + 8 * k) / group;
        __m256 w = _mm256_mul_ps(q[k], _mm256_set1_ps(Scale(scales, g)));
        if (mins) w = _mm256_add_ps(w, _mm256_set1_ps(Scale(mins, g)));
        _mm256_storeu_ps(out + i + 8 * k, w);
      }
    }
  }
}

}  // namespace quantized_matmul

#endif
