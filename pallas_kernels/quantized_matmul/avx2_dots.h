// A weight row's products with a few rows of float x, for CPUs with AVX2 and FMA but not
// AVX-512: `cpu.cc`'s FloatDots for groups of 32 int8 or uint4 values (Q8_0, Q4_0, Q4_1,
// Q4_K, `--quantization int8`), in the CPU's own 8-lane registers. Included by cpu.cc only
// (its build hashes this folder's headers with it).
//
// Why: FloatDots holds 16-lane vectors, each two registers on AVX2, and GCC kept those
// (and the 4 rows' two accumulators each) in memory there: a Q4_1 decode step read its
// weights at ~1.5 GB/s on an AVX2 CPU (bench/README.md). Here a group's 32 weights are
// four registers and each row of x two accumulators (the first and second 8 lanes of
// FloatDots' 16), so 4 rows fit the 16 registers. Per group and row the sums are
// FloatDots' own: (q[0:16] * x[0:16] + q[16:32] * x[16:32]) * scale, lane by lane; the
// groups chain into one accumulator (FloatDots alternates two), so results differ from an
// AVX-512 build's by float32 rounding.
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
  if constexpr (K == kInt8) {
    first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i));
    second = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i + 16));
  } else {  // uint4: input j in the low nibble of byte j, input j + 16 in its high one
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i / 2));
    const __m128i nibble = _mm_set1_epi8(0x0F);
    first = _mm_and_si128(bytes, nibble);
    second = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
  }
  const __m128i halves[4] = {first, _mm_unpackhi_epi64(first, first), second,
                             _mm_unpackhi_epi64(second, second)};
  for (int k = 0; k < 4; ++k)
    q[k] = _mm256_cvtepi32_ps(K == kInt8 ? _mm256_cvtepi8_epi32(halves[k])
                                         : _mm256_cvtepu8_epi32(halves[k]));
}

// FloatDots for groups of 32: acc[t] += sum over groups of the group's products * scale.
template <Kind K, typename S, int TR>
void GroupDots(const uint8_t* row, const S* scales, int64_t num_groups, const float* x,
               int64_t dim, f32x16 (&acc)[TR]) {
  __m256 low[TR], high[TR];  // lanes 0-7 and 8-15 of FloatDots' 16
  for (int t = 0; t < TR; ++t) low[t] = high[t] = _mm256_setzero_ps();
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t i = g * kGroup;
    __m256 q[4];
    Widen8<K>(row, i, q);
    const __m256 scale = _mm256_set1_ps(Scale(scales, g));
    for (int t = 0; t < TR; ++t) {
      const float* xt = x + t * dim + i;
      const __m256 first = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xt + 16),
                                           _mm256_mul_ps(q[0], _mm256_loadu_ps(xt)));
      const __m256 second = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xt + 24),
                                            _mm256_mul_ps(q[1], _mm256_loadu_ps(xt + 8)));
      low[t] = _mm256_fmadd_ps(first, scale, low[t]);
      high[t] = _mm256_fmadd_ps(second, scale, high[t]);
    }
  }
  for (int t = 0; t < TR; ++t) acc[t] += Join(f32x8(low[t]), f32x8(high[t]));
}

}  // namespace quantized_matmul

#endif
