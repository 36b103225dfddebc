// Float32 panels of weight rows times many rows of x, for the matmul kernels' batched
// steps (more rows than their row-by-row loops take: decode steps of many requests,
// verification, short prefill chunks). Shared by stacked_matmul/cpu.cc (float32 weights:
// a block of w[layer]'s rows read where they lie, prefetched ahead) and
// quantized_matmul/cpu.cc (a block of rows dequantized into a panel in L2); every kernel's
// build hashes this folder.
//
// Why: XLA:CPU's GEMM packs its weight operand anew on every call (13% of a batched
// decode step on SmolLM2, bench/README.md), under a layer scan after copying the layer out
// of the stacked array, and a quantized weight is first dequantized into a fresh float32
// buffer. Here a panel of kPanelRows weight rows ([rows, D]) multiplies every row of
// x by fused multiply-adds: x is transposed once per call into columns, so a vector holds
// 16 (AVX-512) or 8 rows of x at one input and a weight is broadcast against it; a tile of
// 6 weight rows x 64 rows of x (6 x 16 with AVX2) keeps 24 (12) sums in registers, over
// blocks of 64 inputs that stay in L1.
// Each output sums its blocks' chains in input order: the reference's result to float32
// rounding.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace panel {

// The widest float vector the CPU has: 16 lanes with AVX-512, else 8 (AVX2's 16
// registers; vectors twice that wide left GCC building each broadcast in memory, a lane at
// a time: 6 GFLOP/s instead of ~70 on an AVX2 machine, bench/README.md).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
using fvec = float __attribute__((vector_size(4 * kLanes)));

inline fvec Load(const float* p) {
  fvec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// A tile: 6 weight rows x kTileVectors blocks of 16 rows of x; panels of 30 rows are 5.
// - AVX-512: 4 blocks, 24 sums, 4 vectors of x and a weight, 29 of 32 registers. 4 weight
//   rows (16 sums) ran 4% slower over the shapes of the benchmark model and SmolLM2 at
//   17-128 rows (bench/README.md): a step's 4 loads of x are shared by 24 products, not 16.
// - AVX2: 1 block (2 vectors of 8), 12 sums, 15 of 16 registers. A fused multiply-add waits
//   ~4-5 cycles for its sum and two start a cycle, so 4 weight rows' 8 chains left the
//   multipliers idle part of the time: on a 2-core AVX2 EPYC the benchmark model's layer
//   matmuls at 32-128 rows of x took 0.85x the time of 4-row tiles (bench/README.md).
constexpr int64_t kPanelRows = 30;  // weight rows of a panel (a work item's)
constexpr int kTileRows = 6;        // weight rows of a tile
#ifdef __AVX512F__
constexpr int kTileVectors = 4;  // blocks of 16 rows of x in a tile
#else
constexpr int kTileVectors = 1;
#endif

inline fvec MultiplyAdd(fvec a, fvec b, fvec c) {
#if defined(__AVX512F__)
  return fvec(_mm512_fmadd_ps(__m512(a), __m512(b), __m512(c)));
#elif defined(__FMA__)
  return fvec(_mm256_fmadd_ps(__m256(a), __m256(b), __m256(c)));
#else
  return a * b + c;
#endif
}

inline fvec Broadcast(float value) {  // one broadcast from memory
#if defined(__AVX512F__)
  return fvec(_mm512_set1_ps(value));
#elif defined(__AVX__)
  return fvec(_mm256_set1_ps(value));
#else
  return fvec{} + value;
#endif
}

#if defined(__AVX__)
// out[k * out_stride + r] = in[r * in_stride + k] for r, k < 8: eight rows of eight floats
// transposed in registers.
inline void Transpose8(const float* in, int64_t in_stride, float* out, int64_t out_stride) {
  __m256 r[8], t[8];
  for (int k = 0; k < 8; ++k) r[k] = _mm256_loadu_ps(in + k * in_stride);
  for (int k = 0; k < 8; k += 2) {
    t[k] = _mm256_unpacklo_ps(r[k], r[k + 1]);
    t[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]);
  }
  for (int k = 0; k < 8; k += 4) {
    r[k] = _mm256_shuffle_ps(t[k], t[k + 2], 0x44);
    r[k + 1] = _mm256_shuffle_ps(t[k], t[k + 2], 0xEE);
    r[k + 2] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0x44);
    r[k + 3] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {
    _mm256_storeu_ps(out + k * out_stride, _mm256_permute2f128_ps(r[k], r[k + 4], 0x20));
    _mm256_storeu_ps(out + (k + 4) * out_stride, _mm256_permute2f128_ps(r[k], r[k + 4], 0x31));
  }
}
#endif

// x as columns, in chunks of kChunk rows: [padded / kChunk, D, kChunk] with padded =
// num_rows rounded up to 16 (a last chunk of fewer rows is that much narrower), the padding
// zeros. A chunk's block of 64 inputs is then 16 KB in one piece: columns of all rows in
// one [D, padded] array sit 4 * padded bytes apart and, past 64 rows, collide in L1's sets.
struct XColumns {
  static constexpr int64_t kChunk = 16 * kTileVectors;
  int64_t num_rows = 0, padded = 0, dim = 0;
  std::vector<float> data;

  // The chunk of rows from t0 on (t0 a multiple of kChunk) and its width.
  const float* Chunk(int64_t t0) const { return data.data() + t0 * dim; }
  int64_t Width(int64_t t0) const { return std::min(kChunk, padded - t0); }

  void Prepare(const float* x, int64_t rows, int64_t d) {
    num_rows = rows;
    dim = d;
    padded = (rows + 15) / 16 * 16;
    // Only the padding rows need zeros: every other entry is written below.
    data.resize(dim * padded);
    for (int64_t start = rows / kChunk * kChunk; start < padded; start += kChunk) {
      const int64_t width = Width(start);
      float* chunk = data.data() + start * dim;
      for (int64_t i = 0; i < dim; ++i)
        for (int64_t t = std::max(rows, start); t < start + width; ++t)
          chunk[i * width + t - start] = 0.0f;
    }
    int64_t t0 = 0;
#if defined(__AVX__)
    // 8 rows x 8 inputs at a time, transposed in registers: a float at a time took 22 us
    // for 64 rows of 512 inputs, more than a panel's products (bench/README.md).
    if (dim % 8 == 0)
      for (; t0 + 8 <= rows; t0 += 8) {
        const int64_t start = t0 / kChunk * kChunk, width = Width(start);
        float* chunk = data.data() + start * dim + t0 - start;
        for (int64_t i0 = 0; i0 < dim; i0 += 8)
          Transpose8(x + t0 * dim + i0, dim, chunk + i0 * width, width);
      }
#endif
    for (; t0 < rows; t0 += 16) {
      const int64_t start = t0 / kChunk * kChunk, width = Width(start);
      float* chunk = data.data() + start * dim;
      // The rows the 8 x 8 blocks left (all of them without AVX), 16 rows at a time, 16
      // inputs at a time: reads and writes stay in a few lines.
      for (int64_t i0 = 0; i0 < dim; i0 += 16)
        for (int64_t t = t0; t < std::min(rows, t0 + 16); ++t)
          for (int64_t i = i0; i < std::min(dim, i0 + 16); ++i)
            chunk[i * width + t % kChunk] = x[t * dim + i];
    }
  }
};

// sums[r, t] += panel[r, i] * x[t, i] for rows r < JR of the panel, the rows t of x in TV
// blocks of 16 from t0 on and the inputs i of [i0, i1): one block of inputs, whose
// products are chained in registers and then added to the sums (a chain over all D inputs
// measured up to 1.5e-6 of the largest output off, blocks 4x less).
template <int JR, int TV>
void Tile(const float* panel, int64_t dim, const XColumns& x, int64_t t0, int64_t i0,
          int64_t i1, float* sums) {
  constexpr int kVectors = TV * 16 / kLanes;
  fvec block[JR][kVectors] = {};
  const float* columns = x.Chunk(t0);
  const int64_t width = x.Width(t0);
  for (int64_t i = i0; i < i1; ++i) {
    // Each vector of x and each broadcast weight loaded once: a load per product (as GCC
    // folds them) measured the loads as the bound.
    fvec row[kVectors];
    for (int v = 0; v < kVectors; ++v) {
      row[v] = Load(columns + i * width + v * kLanes);
#if defined(__AVX__)
      __asm__("" : "+v"(row[v]));  // in a register: GCC would fold the load into every product
#endif
    }
    for (int r = 0; r < JR; ++r) {
      const fvec w = Broadcast(panel[r * dim + i]);
      for (int v = 0; v < kVectors; ++v) block[r][v] = MultiplyAdd(w, row[v], block[r][v]);
    }
  }
  for (int r = 0; r < JR; ++r)
    for (int v = 0; v < kVectors; ++v) {
      float* at = sums + r * x.padded + t0 + v * kLanes;
      const fvec total = Load(at) + block[r][v];
      std::memcpy(at, &total, sizeof(total));
    }
}

template <int TV>
void Tiles(const float* panel, int64_t panel_rows, int64_t dim, const XColumns& x, int64_t t0,
           int64_t i0, int64_t i1, float* sums) {
  int64_t r = 0;
  for (; r + kTileRows <= panel_rows; r += kTileRows)
    Tile<kTileRows, TV>(panel + r * dim, dim, x, t0, i0, i1, sums + r * x.padded);
  static_assert(kTileRows <= 6, "the switch below takes at most 5 rows left over");
  switch (panel_rows - r) {  // the rows left over: up to kTileRows - 1
    case 5: Tile<5, TV>(panel + r * dim, dim, x, t0, i0, i1, sums + r * x.padded); break;
    case 4: Tile<4, TV>(panel + r * dim, dim, x, t0, i0, i1, sums + r * x.padded); break;
    case 3: Tile<3, TV>(panel + r * dim, dim, x, t0, i0, i1, sums + r * x.padded); break;
    case 2: Tile<2, TV>(panel + r * dim, dim, x, t0, i0, i1, sums + r * x.padded); break;
    case 1: Tile<1, TV>(panel + r * dim, dim, x, t0, i0, i1, sums + r * x.padded); break;
    default: break;
  }
}

constexpr int64_t kBlockInputs = 64;  // inputs of a block (PanelProducts)
constexpr int64_t kAheadBlocks = 1;   // blocks of weights asked for ahead of their use

// Asks the caches (all levels) for inputs [i0, i0 + kBlockInputs) of every panel row.
inline void PrefetchBlock(const float* panel, int64_t panel_rows, int64_t dim, int64_t i0) {
  const int64_t i1 = std::min(dim, i0 + kBlockInputs);
  for (int64_t r = 0; r < panel_rows; ++r) {
    const char* begin = reinterpret_cast<const char*>(panel + r * dim + i0);
    const char* end = reinterpret_cast<const char*>(panel + r * dim + i1);
    for (const char* line = begin; line < end; line += 64) __builtin_prefetch(line, 0, 3);
    __builtin_prefetch(end - 1, 0, 3);  // a row that starts mid-line ends in one more line
  }
}

// A panel read where it lies in memory rather than from a copy: its blocks are asked for
// kAheadBlocks ahead of their products, and past its end the first ones of `next` (the
// panel this thread multiplies next, if known), so that no block waits on memory.
struct Prefetch {
  const float* next = nullptr;
  int64_t next_rows = 0;
};

// out[t, j0 + r] for every row t of x and the panel's rows r. Blocks of kBlockInputs
// inputs go over every row of x in turn, so a block of x's columns (64 x 64 floats) and of
// the panel stay in L1. The panel is [panel_rows, dim]: a dequantized copy, or with
// `prefetch` rows read where they lie. The sums are reused per thread (`thread_local`).
inline void PanelProducts(const float* panel, int64_t panel_rows, int64_t dim,
                          const XColumns& x, float* out, int64_t num_outputs, int64_t j0,
                          const Prefetch* prefetch = nullptr) {
  thread_local std::vector<float> scratch;  // reused across calls: no fresh pages a step
  scratch.assign(panel_rows * x.padded, 0.0f);
  float* sums = scratch.data();
  const int64_t num_blocks = (dim + kBlockInputs - 1) / kBlockInputs;
  auto ask = [&](int64_t block) {  // this panel's block, or past its end the next panel's
    if (block < num_blocks)
      PrefetchBlock(panel, panel_rows, dim, block * kBlockInputs);
    else if (prefetch->next && block - num_blocks < num_blocks)
      PrefetchBlock(prefetch->next, prefetch->next_rows, dim, (block - num_blocks) * kBlockInputs);
  };
  if (prefetch)  // on their way already if this thread's previous panel asked: cheap twice
    for (int64_t block = 0; block < kAheadBlocks; ++block) ask(block);
  for (int64_t i0 = 0; i0 < dim; i0 += kBlockInputs) {
    const int64_t i1 = std::min(dim, i0 + kBlockInputs);
    if (prefetch) ask(i0 / kBlockInputs + kAheadBlocks);
    for (int64_t t0 = 0; t0 < x.padded; t0 += 16 * kTileVectors) {
      switch (std::min<int64_t>(kTileVectors, (x.padded - t0) / 16)) {
        case 4: Tiles<4>(panel, panel_rows, dim, x, t0, i0, i1, sums); break;
        case 3: Tiles<3>(panel, panel_rows, dim, x, t0, i0, i1, sums); break;
        case 2: Tiles<2>(panel, panel_rows, dim, x, t0, i0, i1, sums); break;
        default: Tiles<1>(panel, panel_rows, dim, x, t0, i0, i1, sums); break;
      }
    }
  }
  for (int64_t t = 0; t < x.num_rows; ++t)
    for (int64_t r = 0; r < panel_rows; ++r) out[t * num_outputs + j0 + r] = sums[r * x.padded + t];
}

}  // namespace panel
