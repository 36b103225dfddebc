// x as integers for `cpu.cc`'s 4-bit weights, on CPUs with AVX-512 VNNI (elsewhere
// `IntegerX::Prepare` holds no row and the kernel keeps float x). Included by cpu.cc only.
//
// Why: on these cores a decode step's 4-bit matmuls are bound by compute, the widening of
// every weight to float, not by the bytes read. A byte product-sum instruction multiplies
// 64 weights with 64 bytes of x at once, so x is made integers that bytes hold exactly:
// each run of 32 inputs is scaled by a power of two that puts its largest |x| below 2^22
// and rounded to integers (an error of at most 2^-23 of the run's largest |x| in each;
// float x carries 2^-24 of its own), each the sum of three signed bytes a * 2^16 + b * 2^8
// + c. Every product, and every sum over a block of 4 runs, is then an exact 32-bit
// integer (at most 8 * 15 * 2^22 < 2^31 in a lane), scaled once per block: the result is
// float x's to float32 rounding. This is not llama.cpp's x rounded to int8 (7 bits a run,
// which moved SmolLM2's answers: bench/README.md). A row of x holding a non-finite value
// or a run whose largest |x| is below 2^-104 keeps float x.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "values.h"

namespace quantized_matmul {

// Rows of x as integers: per row and block of 4 runs of 32 inputs, three pieces of 128
// signed bytes (a, b, c), each laid out [the runs' inputs 0-15 | their inputs 16-31] as a
// block's unpacked 4-bit weights lie, and each run's scale.
struct IntegerX {
  int64_t num_blocks = 0;
  std::vector<int8_t> pieces;      // [T, blocks, 3, 128]
  std::vector<float> run_scales;   // [T, blocks * 4]
  std::vector<uint8_t> has_row;    // [T]: row t is in pieces (else it keeps float x)

  // Whether rows t0 .. t0 + rows - 1 all have integer x.
  bool Covers(int64_t t0, int rows) const {
    if (num_blocks == 0) return false;
    for (int t = 0; t < rows; ++t)
      if (!has_row[t0 + t]) return false;
    return true;
  }

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  static constexpr int kBits = 22;  // |x| * scale <= 2^22: a within [-65, 65]

  void Prepare(const float* x, int64_t num_rows, int64_t dim) {
    const int64_t runs = dim / kGroup;
    num_blocks = (runs + 3) / 4;
    pieces.assign(num_rows * num_blocks * 384, 0);
    run_scales.assign(num_rows * num_blocks * 4, 0.0f);
    has_row.assign(num_rows, 1);
    const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    for (int64_t t = 0; t < num_rows; ++t) {
      for (int64_t r = 0; r < runs && has_row[t]; ++r) {
        const float* run = x + t * dim + r * kGroup;
        const __m512 halves[2] = {_mm512_loadu_ps(run), _mm512_loadu_ps(run + 16)};
        const float largest = _mm512_reduce_max_ps(_mm512_max_ps(
            _mm512_and_ps(halves[0], magnitude), _mm512_and_ps(halves[1], magnitude)));
        if (largest == 0.0f) continue;
        uint32_t bits;
        std::memcpy(&bits, &largest, 4);
        const int e = int(bits >> 23) - 126;  // largest < 2^e
        if (!(largest <= 3.4028235e38f) || e < -104) {  // NaN, inf, or scales out of range
          has_row[t] = 0;
          break;
        }
        run_scales[t * num_blocks * 4 + r] = std::ldexp(1.0f, e - kBits);
        const __m512 up = _mm512_set1_ps(std::ldexp(1.0f, kBits - e));
        int8_t* block = pieces.data() + (t * num_blocks + r / 4) * 384 + (r % 4) * 16;
        for (int half = 0; half < 2; ++half) {
          // Balanced digits: c and b within [-128, 127], a what is left.
          const __m512i value = _mm512_cvtps_epi32(_mm512_mul_ps(halves[half], up));
          const __m512i c = _mm512_srai_epi32(_mm512_slli_epi32(value, 24), 24);
          const __m512i rest = _mm512_srai_epi32(_mm512_sub_epi32(value, c), 8);
          const __m512i b = _mm512_srai_epi32(_mm512_slli_epi32(rest, 24), 24);
          const __m512i a = _mm512_srai_epi32(_mm512_sub_epi32(rest, b), 8);
          int8_t* at = block + half * 64;
          _mm_storeu_si128(reinterpret_cast<__m128i*>(at), _mm512_cvtepi32_epi8(a));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(at + 128), _mm512_cvtepi32_epi8(b));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(at + 256), _mm512_cvtepi32_epi8(c));
        }
      }
    }
  }
#else
  void Prepare(const float*, int64_t, int64_t) {}
#endif
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// The weight scales of block b's `runs` runs (of 4; the rest 0), in groups of `group`.
template <typename S>
inline __m128 BlockScales(const S* scales, int64_t b, int64_t runs, int64_t group) {
  if (group == kGroup) {
    const __mmask8 mask = (1 << runs) - 1;
    if constexpr (std::is_same_v<S, float>)
      return _mm_maskz_loadu_ps(mask, scales + b * 4);
    else
      return _mm_cvtph_ps(_mm_maskz_loadu_epi16(mask, scales + b * 4));
  }
  float four[4] = {};
  for (int64_t r = 0; r < runs; ++r) four[r] = Scale(scales, (b * 4 + r) * kGroup / group);
  return _mm_loadu_ps(four);
}
#endif

// A row of 4-bit weights (`row`: dim / 2 bytes; `scales`: its groups of dim / num_groups)
// times TR rows of integer x from t0 on, without the mins, into acc: a block's 64 packed
// bytes widen to two vectors of bytes (low nibbles: each run's inputs 0-15; high: 16-31)
// whose lane k holds inputs of run k / 4, as the pieces lie; the three pieces' products
// chain into exact sums, scaled once per block.
template <typename S, int TR>
void IntegerDots(const IntegerX& x, const uint8_t* row, const S* scales, int64_t num_groups,
                 int64_t dim, int64_t t0, f32x16 (&acc)[TR]) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const int64_t runs = dim / kGroup, group = dim / num_groups;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 sums[TR];
  for (int t = 0; t < TR; ++t) sums[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.num_blocks; ++b) {
    const int64_t block_runs = std::min<int64_t>(4, runs - b * 4);
    const __mmask64 bytes = block_runs == 4 ? ~__mmask64(0) : (__mmask64(1) << (block_runs * 16)) - 1;
    const __m512i packed = _mm512_maskz_loadu_epi8(bytes, row + b * 64);
    const __m512i low = _mm512_and_si512(packed, nibble);
    const __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
    const __m128 weight_scales = BlockScales(scales, b, block_runs, group);
    for (int t = 0; t < TR; ++t) {
      const int64_t at = (t0 + t) * x.num_blocks + b;
      const int8_t* pieces = x.pieces.data() + at * 384;
      __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), low, _mm512_loadu_si512(pieces));
      dot = _mm512_dpbusd_epi32(dot, high, _mm512_loadu_si512(pieces + 64));
      for (int piece = 1; piece < 3; ++piece) {
        dot = _mm512_slli_epi32(dot, 8);
        dot = _mm512_dpbusd_epi32(dot, low, _mm512_loadu_si512(pieces + piece * 128));
        dot = _mm512_dpbusd_epi32(dot, high, _mm512_loadu_si512(pieces + piece * 128 + 64));
      }
      const __m128 four = _mm_mul_ps(weight_scales, _mm_loadu_ps(&x.run_scales[at * 4]));
      const __m512 lanes = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(four));
      sums[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), lanes, sums[t]);
    }
  }
  for (int t = 0; t < TR; ++t) acc[t] = f32x16(sums[t]);
#endif
}

}  // namespace quantized_matmul
