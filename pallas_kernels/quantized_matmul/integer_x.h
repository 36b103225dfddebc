// x as integers for `cpu.cc`'s 4-bit weights, on CPUs with AVX-512 VNNI and on CPUs with
// AVX2 but not AVX-512 (elsewhere `IntegerX::Prepare` holds no row and the kernel keeps
// float x). Included by cpu.cc only.
//
// Why: on these cores a decode step's 4-bit matmuls are bound by compute, the widening of
// every weight to float, not by the bytes read. Integer product-sum instructions multiply
// 16 or 64 weights with as many integers of x at once, so x is made integers that these
// hold exactly: each run of 32 inputs is scaled by a power of two that puts its largest |x|
// below 2^22 and rounded to integers (an error of at most 2^-23 of the run's largest |x| in
// each; float x carries 2^-24 of its own), each the sum of three signed bytes a * 2^16 +
// b * 2^8 + c. Every product, and every sum over a block of runs, is then an exact 32-bit
// integer (at most 8 * 15 * 2^22 < 2^31 in a lane), scaled once per block: the result is
// float x's to float32 rounding. This is not llama.cpp's x rounded to int8 (7 bits a run,
// which moved SmolLM2's answers: bench/README.md). A row of x holding a non-finite value
// or a run whose largest |x| is below 2^-104 keeps float x.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "values.h"

namespace quantized_matmul {

// Where x becomes integers, and how a block of runs lies (`IntegerX::pieces`):
// - CPUs with AVX-512 VNNI: a block is 4 runs, a byte product-sum instruction's 64 bytes;
//   three pieces (a, b, c) of 128 signed bytes, each [the runs' inputs 0-15 | their inputs
//   16-31] as a block's unpacked 4-bit weights lie.
// - CPUs with AVX2 but not AVX-512: a block is 1 run, multiplied through `vpmaddwd` (pairs
//   of 16-bit products) with the weights widened to 16 bits: two pieces of 32 int16s in
//   input order, a * 2^8 + b (at most 2^14 + 1 in magnitude) and c. Two multiplies for
//   each 16 weights instead of three byte ones (`vpmaddubsw` and `vpmaddwd` for each
//   piece: this CPU's one integer multiply pipe is the bound).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define JENGINE_INTEGER_X 1
constexpr int64_t kRunsPerBlock = 4, kPieceBytes = 128, kPieces = 3, kHalfBytes = 64;
#elif defined(JENGINE_AVX2)  // values.h: AVX2 and FMA without AVX-512
#define JENGINE_INTEGER_X 1
constexpr int64_t kRunsPerBlock = 1, kPieceBytes = 64, kPieces = 2, kHalfBytes = 32;
#endif
#ifdef JENGINE_INTEGER_X
constexpr int64_t kBlockBytes = kPieces * kPieceBytes;
#endif

// Rows of x as integers: per row and block of runs of 32 inputs, the pieces (above) and
// each run's scale.
struct IntegerX {
  int64_t num_blocks = 0;
  std::vector<int8_t> pieces;      // [T, blocks, kBlockBytes]
  std::vector<float> run_scales;   // [T, blocks * kRunsPerBlock]
  std::vector<uint8_t> has_row;    // [T]: row t is in pieces (else it keeps float x)

  // Whether rows t0 .. t0 + rows - 1 all have integer x.
  bool Covers(int64_t t0, int rows) const {
    if (num_blocks == 0) return false;
    for (int t = 0; t < rows; ++t)
      if (!has_row[t0 + t]) return false;
    return true;
  }

#ifdef JENGINE_INTEGER_X
  static constexpr int kBits = 22;  // |x| * scale <= 2^22: a within [-65, 65]

  void Prepare(const float* x, int64_t num_rows, int64_t dim) {
    const int64_t runs = dim / kGroup;
    num_blocks = (runs + kRunsPerBlock - 1) / kRunsPerBlock;
    pieces.assign(num_rows * num_blocks * kBlockBytes, 0);
    run_scales.assign(num_rows * num_blocks * kRunsPerBlock, 0.0f);
    has_row.assign(num_rows, 1);
    for (int64_t t = 0; t < num_rows; ++t) {
      for (int64_t r = 0; r < runs && has_row[t]; ++r) {
        const float* run = x + t * dim + r * kGroup;
        const uint32_t bits = LargestMagnitudeBits(run);
        if (bits == 0) continue;
        const int e = int(bits >> 23) - 126;  // largest < 2^e
        if (bits > 0x7F7FFFFFu || e < -104) {  // NaN, inf, or scales out of range
          has_row[t] = 0;
          break;
        }
        run_scales[t * num_blocks * kRunsPerBlock + r] = std::ldexp(1.0f, e - kBits);
        const float up = std::ldexp(1.0f, kBits - e);
        int8_t* block = pieces.data() + (t * num_blocks + r / kRunsPerBlock) * kBlockBytes +
                        (r % kRunsPerBlock) * 16;
        for (int half = 0; half < 2; ++half) Digits(run + 16 * half, up, block + half * kHalfBytes);
      }
    }
  }

 private:
  // The bits of the run's largest |x|: as integers, non-negative floats order as their
  // values do, inf and NaN above every finite one (a float max could drop a NaN).
  static uint32_t LargestMagnitudeBits(const float* run) {
#if defined(__AVX512F__)
    const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
    const __m512i first = _mm512_and_si512(_mm512_loadu_si512(run), magnitude);
    const __m512i second = _mm512_and_si512(_mm512_loadu_si512(run + 16), magnitude);
    return uint32_t(_mm512_reduce_max_epi32(_mm512_max_epi32(first, second)));
#else
    const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
    __m256i largest = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k)
      largest = _mm256_max_epi32(largest, _mm256_and_si256(_mm256_loadu_si256(
                                     reinterpret_cast<const __m256i*>(run + 8 * k)), magnitude));
    __m128i four = _mm_max_epi32(_mm256_castsi256_si128(largest),
                                 _mm256_extracti128_si256(largest, 1));
    four = _mm_max_epi32(four, _mm_shuffle_epi32(four, 0x4E));
    four = _mm_max_epi32(four, _mm_shuffle_epi32(four, 0xB1));
    return uint32_t(_mm_cvtsi128_si32(four));
#endif
  }

  // 16 inputs times `up`, rounded, as balanced digits: c and b within [-128, 127], a what is
  // left; stored as the pieces lie from `at` on (the first piece's part of this half).
  static void Digits(const float* sixteen, float up, int8_t* at) {
#if defined(__AVX512F__)
    const __m512i value =
        _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(sixteen), _mm512_set1_ps(up)));
    const __m512i c = _mm512_srai_epi32(_mm512_slli_epi32(value, 24), 24);
    const __m512i rest = _mm512_srai_epi32(_mm512_sub_epi32(value, c), 8);
    const __m512i b = _mm512_srai_epi32(_mm512_slli_epi32(rest, 24), 24);
    const __m512i a = _mm512_srai_epi32(_mm512_sub_epi32(rest, b), 8);
    const __m512i digits[3] = {a, b, c};
    for (int piece = 0; piece < 3; ++piece)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(at + piece * kPieceBytes),
                       _mm512_cvtepi32_epi8(digits[piece]));
#else
    __m256i high[2], low[2];  // a * 2^8 + b and c, of inputs 0-7 and 8-15
    for (int k = 0; k < 2; ++k) {
      const __m256i value =
          _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(sixteen + 8 * k), _mm256_set1_ps(up)));
      low[k] = _mm256_srai_epi32(_mm256_slli_epi32(value, 24), 24);
      high[k] = _mm256_srai_epi32(_mm256_sub_epi32(value, low[k]), 8);
    }
    // 16 int32s to 16 int16s in order (each fits: packing's saturation never acts).
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(at), _mm256_permute4x64_epi64(
                            _mm256_packs_epi32(high[0], high[1]), 0xD8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(at + kPieceBytes), _mm256_permute4x64_epi64(
                            _mm256_packs_epi32(low[0], low[1]), 0xD8));
#endif
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

// R rows of 4-bit weights (each dim / 2 bytes; `row_scales`: their groups of dim /
// num_groups) times TR rows of integer x from t0 on, without the mins, into `row_dots`: a
// block's 64 packed bytes widen to two vectors of bytes (low nibbles: each run's inputs
// 0-15; high: 16-31) whose lane k holds inputs of run k / 4, as the pieces lie; the three
// pieces' products chain into exact sums, scaled once per block. The R rows go block by
// block side by side (R streams for the memory: cpu.cc's `Outputs`), each summed as alone.
template <typename S, int TR, int R>
void IntegerDots(const IntegerX& x, const uint8_t* const (&rows)[R],
                 const S* const (&row_scales)[R], int64_t num_groups, int64_t dim, int64_t t0,
                 float (&row_dots)[R][TR]) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const int64_t runs = dim / kGroup, group = dim / num_groups;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 sums[R][TR];
  for (int k = 0; k < R; ++k)
    for (int t = 0; t < TR; ++t) sums[k][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.num_blocks; ++b) {
    const int64_t block_runs = std::min<int64_t>(4, runs - b * 4);
    const __mmask64 bytes = block_runs == 4 ? ~__mmask64(0) : (__mmask64(1) << (block_runs * 16)) - 1;
    // Unrolled, so that each row's sums stay in registers: GCC kept them in memory
    // otherwise, ~10% slower four rows at a time.
#pragma GCC unroll 4
    for (int k = 0; k < R; ++k) {
      const __m512i packed = _mm512_maskz_loadu_epi8(bytes, rows[k] + b * 64);
      const __m512i low = _mm512_and_si512(packed, nibble);
      const __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
      const __m128 weight_scales = BlockScales(row_scales[k], b, block_runs, group);
      for (int t = 0; t < TR; ++t) {
        const int64_t at = (t0 + t) * x.num_blocks + b;
        const int8_t* pieces = x.pieces.data() + at * kBlockBytes;
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), low, _mm512_loadu_si512(pieces));
        dot = _mm512_dpbusd_epi32(dot, high, _mm512_loadu_si512(pieces + kHalfBytes));
        for (int piece = 1; piece < 3; ++piece) {
          dot = _mm512_slli_epi32(dot, 8);
          dot = _mm512_dpbusd_epi32(dot, low, _mm512_loadu_si512(pieces + piece * kPieceBytes));
          dot = _mm512_dpbusd_epi32(dot, high,
                                    _mm512_loadu_si512(pieces + piece * kPieceBytes + kHalfBytes));
        }
        const __m128 four = _mm_mul_ps(weight_scales, _mm_loadu_ps(&x.run_scales[at * 4]));
        const __m512 lanes = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(four));
        sums[k][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), lanes, sums[k][t]);
      }
    }
  }
  for (int k = 0; k < R; ++k)
    for (int t = 0; t < TR; ++t) row_dots[k][t] = Sum(f32x16(sums[k][t]));
#elif defined(JENGINE_INTEGER_X)
  // AVX2: a run's 16 packed bytes widen to 16-bit weights, inputs 0-15 (low nibbles) and
  // 16-31 (high). `vpmaddwd` sums pairs of products into 32 bits: 2^8 * (the weights times
  // a * 2^8 + b) + (the weights times c), exact in each lane (4 inputs of the run: at most
  // 4 * 15 * 2^22 < 2^28), scaled once per run.
  // (cpu.cc passes one row at a time here: R = 1.)
  for (int k = 0; k < R; ++k) {
    const uint8_t* row = rows[k];
    const S* scales = row_scales[k];
    float (&dots)[TR] = row_dots[k];
    const int64_t runs_per_group = dim / num_groups / kGroup;  // (no division a run)
    const __m256i nibble = _mm256_set1_epi16(0x0F);
    // Even and odd runs into sums of their own: one chain of additions would wait on each.
    __m256 even[TR], odd[TR];
    for (int t = 0; t < TR; ++t) even[t] = odd[t] = _mm256_setzero_ps();
    auto add_run = [&](int64_t r, __m256 (&sums)[TR]) {
      const __m256i bytes =
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + r * 16)));
      const __m256i first = _mm256_and_si256(bytes, nibble), second = _mm256_srli_epi16(bytes, 4);
      const float weight_scale = Scale(scales, runs_per_group == 1 ? r : r / runs_per_group);
      for (int t = 0; t < TR; ++t) {
        const int64_t at = (t0 + t) * x.num_blocks + r;
        const __m256i* pieces =
            reinterpret_cast<const __m256i*>(x.pieces.data() + at * kBlockBytes);
        // Piece 0 (a * 2^8 + b) times inputs 0-15 and 16-31, then piece 1 (c).
        const __m256i high =
            _mm256_add_epi32(_mm256_madd_epi16(first, _mm256_loadu_si256(pieces)),
                             _mm256_madd_epi16(second, _mm256_loadu_si256(pieces + 1)));
        const __m256i low =
            _mm256_add_epi32(_mm256_madd_epi16(first, _mm256_loadu_si256(pieces + 2)),
                             _mm256_madd_epi16(second, _mm256_loadu_si256(pieces + 3)));
        const __m256i dot = _mm256_add_epi32(_mm256_slli_epi32(high, 8), low);
        sums[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                  _mm256_set1_ps(weight_scale * x.run_scales[at]), sums[t]);
      }
    };
    int64_t r = 0;
    for (; r + 2 <= x.num_blocks; r += 2) {
      add_run(r, even);
      add_run(r + 1, odd);
    }
    if (r < x.num_blocks) add_run(r, even);
    for (int t = 0; t < TR; ++t) dots[t] = Sum(f32x8(even[t]), f32x8(odd[t]));
  }
#endif
}

}  // namespace quantized_matmul
