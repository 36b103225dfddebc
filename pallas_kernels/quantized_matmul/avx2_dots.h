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

#include <cstdint>

#include "values.h"

#ifdef JENGINE_AVX2  // defined by values.h

namespace quantized_matmul {

// FloatDots: dots[t] = the sum of each group's products with row t of x, times the group's
// scale. Groups of 16 (Q6_K): a widening of 32 spans two, its lanes 0-15 the first.
template <Kind K, typename S, int TR>
void GroupDots(const uint8_t* row, const S* scales, int64_t num_groups, int64_t group,
               const float* x, int64_t dim, float (&dots)[TR]) {
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
  for (int t = 0; t < TR; ++t) dots[t] = Sum(f32x8(low[t]), f32x8(high[t]));
}

}  // namespace quantized_matmul

#endif
