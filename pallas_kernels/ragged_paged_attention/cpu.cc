// Ragged paged attention for XLA:CPU, called through the XLA FFI (`cpu.py` builds and
// registers it). Same inputs, outputs and promises as `reference.py`: float32 queries and
// outputs, a float32, bfloat16 or fp8 (e4m3fn, e5m2) cache.
//
// Why it exists: in XLA:CPU a page gather is an element-wise loop (~5 GB/s) and the
// reference's batched dots have two rows per kv head, so a decode step spent most of its
// attention time copying pages and dispatching tiny ops. Here each work item (one request,
// one kv head, up to 64 query rows) walks its own pages straight out of the cache, reading
// every key and value once, with an online softmax; the next page is prefetched while the
// current one is used. Work items are shared between the calling thread and XLA's
// intra-op thread pool.
//
// Layouts (row-major): q [T, N, H]; kv_cache [L, 2, K, num_blocks, S, H]; layer_window
// [2] (the layer, and its sliding window, 0 for none: an operand, so a layer scan passes
// each layer's own); kv_lens [R]; block_tables [R', P] with R' >= R; query_start_loc
// [R + 1]; out [T, N, H]. Attribute soft_cap: 0, or Gemma 2's attention logit cap.
// Kernel requirements (cpu.py routes other shapes to the reference): H and S multiples of
// 8, N a multiple of K, N / K at most 64. A narrow cache's pages are widened to float32 in
// the work item's scratch as the walk reaches them (`PageAsFloat`), exactly, as the reference
// widens the pages it gathers; what the walk computes is then the float32 cache's.
//
// No input makes it read outside a buffer: the handler rejects shapes it cannot index by
// and metadata that would send a walk outside its request (cpu.py rejects bad shapes at
// trace time already), and page ids are clamped into the cache as the reference's are.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#ifdef __F16C__
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Eight floats: GCC/Clang vector extensions, so the same source vectorizes for AVX2 and
// AVX-512 (where -march=native allows) and still compiles on other targets.
using v8 = float __attribute__((vector_size(32)));
using i8 = int32_t __attribute__((vector_size(32)));
constexpr int kLanes = 8;

// Two-vector shuffle, constant lanes: Clang lacks GCC's __builtin_shuffle, GCC < 12 lacks
// __builtin_shufflevector; both give the same instructions.
#if defined(__clang__) || __GNUC__ >= 12
#define JENGINE_SHUFFLE(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
#else
#define JENGINE_SHUFFLE(x, y, ...) __builtin_shuffle(x, y, i8{__VA_ARGS__})
#endif

// Query rows (tokens x q heads of one kv head) one work item serves.
constexpr int64_t kMaxRows = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// How far ahead of its page a work item prefetches.
constexpr int64_t kPrefetchPages = 2;

inline v8 Load(const float* p) {
  v8 x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

inline void Store(float* p, v8 x) { std::memcpy(p, &x, sizeof(x)); }

inline v8 Splat(float x) { return v8{} + x; }

// Lane i of the result is the sum of the lanes of in[i]: eight dot products finished at
// once with shuffles, instead of eight serial horizontal sums.
inline v8 TransposeSum(const v8 in[kLanes]) {
  v8 quads[4], pairs[2];
  for (int i = 0; i < 4; ++i) {
    const v8 x = in[2 * i], y = in[2 * i + 1];
    quads[i] = JENGINE_SHUFFLE(x, y, 0, 1, 2, 3, 8, 9, 10, 11) +
               JENGINE_SHUFFLE(x, y, 4, 5, 6, 7, 12, 13, 14, 15);
  }
  for (int i = 0; i < 2; ++i) {
    const v8 x = quads[2 * i], y = quads[2 * i + 1];
    pairs[i] = JENGINE_SHUFFLE(x, y, 0, 1, 4, 5, 8, 9, 12, 13) +
               JENGINE_SHUFFLE(x, y, 2, 3, 6, 7, 10, 11, 14, 15);
  }
  return JENGINE_SHUFFLE(pairs[0], pairs[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         JENGINE_SHUFFLE(pairs[0], pairs[1], 1, 3, 5, 7, 9, 11, 13, 15);
}

// exp(x) for x <= 0, Cephes' expf polynomial (about 1 ulp); lanes below -87 give 0.
inline v8 ExpNonPositive(v8 x) {
  const v8 clamped = x < -87.0f ? Splat(-87.0f) : x;
  const v8 round = Splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const v8 n = (clamped * 1.44269504088896341f + round) - round;
  const v8 r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  v8 poly = Splat(1.9875691500e-4f);
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  const v8 mantissa = poly * r * r + r + 1.0f;
  i8 bits;
  std::memcpy(&bits, &mantissa, sizeof(bits));
  bits += __builtin_convertvector(n, i8) << 23;  // times 2^n
  v8 result;
  std::memcpy(&result, &bits, sizeof(result));
  return x < -87.0f ? v8{} : result;
}

// The cache's element types the kernel reads.
enum class CacheType { kF32, kBF16, kF8E4M3FN, kF8E5M2 };

struct Problem {
  const float* q;
  const char* kv_cache;  // of `cache_type`, `cache_bytes` bytes a value
  CacheType cache_type;
  int64_t cache_bytes;
  float* out;
  const int32_t *kv_lens, *block_tables, *query_start_loc;
  int64_t num_q_heads, num_kv_heads, head_dim, num_blocks, block_size, layer, pages_per_request;
  float sm_scale;
  int64_t sliding_window;  // 0: none
  float soft_cap;          // 0: none; else scores become cap * tanh(score / cap)
};

struct WorkItem {
  int32_t request, kv_head, first_token, num_tokens;
};

// Per-thread buffers for the work items of one call, each of at most `rows` query rows:
// rows x head_dim queries and accumulators, rows x block_size scores. Sized by the call's
// items (a decode step's are a few rows) rather than kMaxRows: filling 37 KB of buffers
// per call cost more than a short walk.
struct Scratch {
  std::vector<float> q, acc, scores, row_max, denom, key_columns;
  std::vector<int64_t> row_pos;
  std::vector<float> k_page, v_page;  // a narrow cache's page, widened (empty for float32)
  Scratch(const Problem& p, int64_t rows)
      : q(rows * p.head_dim),
        acc(rows * p.head_dim),
        scores(rows * p.block_size),
        row_max(rows),
        denom(rows),
        key_columns(p.head_dim * p.block_size),
        row_pos(rows),
        k_page(p.cache_type == CacheType::kF32 ? 0 : p.head_dim * p.block_size),
        v_page(k_page.size()) {}
};

// Into L2 (locality 2): prefetching whole pages into L1 stalled on its few miss buffers.
// Decode attention, 128 requests, 8 layers (2-core CPU, best of 15-25 calls, pages laid out
// consecutively / at random): no prefetch 31-42 / 65-72 ms, the next page into L1
// 48-52 / 70 ms, two pages ahead into L2 31-37 / 45 ms (bench/README.md). A page's keys
// and values are asked for apart (`AttendPage`): 128 prefetches in one burst stalled the
// walk on the miss buffers (AMX VM, 128 requests of 224 tokens: 33.6 -> 29.8 ms a step).
// Every line, not every other: the adjacent-line prefetcher did not fill in (46 ms).
inline void Prefetch(const char* bytes, int64_t num_bytes) {
  for (int64_t i = 0; i < num_bytes; i += 64) __builtin_prefetch(bytes + i, /*rw=*/0, /*locality=*/2);
}

// A narrow page widens to float32 this many values at a time: a whole AVX-512 register
// where there is one.
#ifdef __AVX512F__
constexpr int kWideLanes = 16;
#else
constexpr int kWideLanes = 8;
#endif
using vw = float __attribute__((vector_size(4 * kWideLanes)));
using iw = int32_t __attribute__((vector_size(4 * kWideLanes)));
using u16w = uint16_t __attribute__((vector_size(2 * kWideLanes)));
using u8w = uint8_t __attribute__((vector_size(kWideLanes)));

template <typename To, typename From>
inline To BitCast(From x) {
  static_assert(sizeof(To) == sizeof(From));
  To y;
  std::memcpy(&y, &x, sizeof(y));
  return y;
}

#ifdef __F16C__
inline vw HalvesToFloats(u16w halves) {
#ifdef __AVX512F__
  return BitCast<vw>(_mm512_cvtph_ps(BitCast<__m256i>(halves)));
#else
  return BitCast<vw>(_mm256_cvtph_ps(BitCast<__m128i>(halves)));
#endif
}
#endif

// kWideLanes values of a narrow cache as float32, exactly. bfloat16 is float32's top half.
// fp8 with F16C (every x86 CPU with AVX2) goes through the hardware's half-to-single
// conversion: e5m2 is a half's top byte; e4m3fn's seven bits sit in a half's places one bit
// lower (its exponent has a bit fewer), so that half is 2^-8 of the value, subnormals
// included. Without F16C, fp8's normal numbers are their bits moved into float32's places
// with the exponent rebiased, and their subnormals (exponent 0) the mantissa times the
// smallest subnormal's scale (three times the operations: fp8 decode attention took
// 1.3-2.1x the float32 cache's time this way, 0.7-1.1x through F16C at 8-128 requests;
// bench/README.md).
// NaN and infinity (never written: writes saturate) come out as large finite numbers, or
// e5m2's as NaN and infinity, and only in slots no row sees.
template <CacheType kType>
inline vw WidenLanes(const char* p) {
  if constexpr (kType == CacheType::kBF16) {
    u16w raw;
    std::memcpy(&raw, p, sizeof(raw));
    return BitCast<vw>(__builtin_convertvector(raw, iw) << 16);
  } else {
    constexpr bool kE4M3 = kType == CacheType::kF8E4M3FN;
    u8w raw;
    std::memcpy(&raw, p, sizeof(raw));
#ifdef __F16C__
    const u16w x = __builtin_convertvector(raw, u16w);
    if constexpr (kE4M3) return HalvesToFloats(((x & 0x7F) << 7) | ((x & 0x80) << 8)) * 256.0f;
    return HalvesToFloats(x << 8);
#else
    constexpr int kMantissaBits = kE4M3 ? 3 : 2, kRebias = kE4M3 ? 120 : 112;
    constexpr float kSubnormalScale = kE4M3 ? 0x1p-9f : 0x1p-16f;
    const iw x = __builtin_convertvector(raw, iw);
    const iw magnitude = x & 0x7F;
    const vw normal = BitCast<vw>((magnitude << (23 - kMantissaBits)) + (kRebias << 23));
    const vw subnormal = __builtin_convertvector(magnitude, vw) * kSubnormalScale;
    const vw widened = magnitude >= (1 << kMantissaBits) ? normal : subnormal;
    return BitCast<vw>(BitCast<iw>(widened) | ((x & 0x80) << 24));
#endif
  }
}

template <CacheType kType>
inline void WidenPage(const char* page, int64_t count, float* widened) {
  constexpr int64_t kBytes = kType == CacheType::kBF16 ? 2 : 1;
  for (int64_t i = 0; i < count; i += kWideLanes) {
    const vw floats = WidenLanes<kType>(page + i * kBytes);
    std::memcpy(widened + i, &floats, sizeof(floats));
  }
}

// One page's keys or values ([S, H], a multiple of 64 values) as float32: the cache's own
// floats, or a narrow page widened into `widened`.
inline const float* PageAsFloat(const Problem& p, const char* page, int64_t count,
                                std::vector<float>& widened) {
  switch (p.cache_type) {
    case CacheType::kF32: return reinterpret_cast<const float*>(page);
    case CacheType::kBF16: WidenPage<CacheType::kBF16>(page, count, widened.data()); break;
    case CacheType::kF8E4M3FN: WidenPage<CacheType::kF8E4M3FN>(page, count, widened.data()); break;
    case CacheType::kF8E5M2: WidenPage<CacheType::kF8E5M2>(page, count, widened.data()); break;
  }
  return widened.data();
}

// Head-dim lanes one pass of `AccumulateValues` keeps in registers.
constexpr int64_t kAccLanes = 64;

// acc[0:W] = acc * correction + sum over s in [s_begin, s_end) of scores[s] * v[s, 0:W],
// each lane summed over s in order (as one lane at a time would), but W / 8 lanes'
// chains side by side: one lane's chain alone waited on its add's latency every key.
template <int64_t W>
inline void AccumulateValues(float* acc, const float* v, int64_t H, const float* scores,
                             int64_t s_begin, int64_t s_end, float correction) {
  constexpr int64_t kVectors = W / kLanes;
  v8 sum[kVectors];
  for (int64_t c = 0; c < kVectors; ++c) sum[c] = Load(acc + c * kLanes) * correction;
  for (int64_t s = s_begin; s < s_end; ++s) {
    const float score = scores[s];
    for (int64_t c = 0; c < kVectors; ++c) sum[c] += score * Load(v + s * H + c * kLanes);
  }
  for (int64_t c = 0; c < kVectors; ++c) Store(acc + c * kLanes, sum[c]);
}

// Vector registers the target has: how many sums `Scores` may keep in flight.
#ifdef __AVX512F__
constexpr int kVectorRegisters = 32;
#else
constexpr int kVectorRegisters = 16;
#endif

// scores[r, :] = q[r] . each key of the page, for R rows of q, eight keys at a time. Each
// head-dim step loads a piece of every key of a group once for the R rows, and the group's
// R x keys sums are independent chains: one key at a time, its sum waited on the previous
// add every step (latency-bound: 128 decodes of 224 tokens, 8 layers, 42.3 -> 35.6 ms a
// step; 24.1 -> 17.3 with every page in cache; bench/README.md). Each sum
// still adds its pieces in head-dim order, as one key at a time did.
template <int R>
inline void Scores(const float* q, const float* k, int64_t H, int64_t S, float* scores) {
  // The most keys whose sums, with the R rows of q, fit the registers (two to spare).
  constexpr int kKeys = R * (kLanes + 1) + 2 <= kVectorRegisters       ? kLanes
                        : R * (kLanes / 2 + 1) + 2 <= kVectorRegisters ? kLanes / 2
                                                                       : kLanes / 4;
  for (int64_t s0 = 0; s0 < S; s0 += kLanes) {
    v8 partial[R][kLanes];
    for (int j0 = 0; j0 < kLanes; j0 += kKeys) {
      v8 sum[R][kKeys] = {};
      for (int64_t h = 0; h < H; h += kLanes) {
        v8 rows[R];
        for (int r = 0; r < R; ++r) rows[r] = Load(q + r * H + h);
        for (int j = 0; j < kKeys; ++j) {
          const v8 piece = Load(k + (s0 + j0 + j) * H + h);
          for (int r = 0; r < R; ++r) sum[r][j] += rows[r] * piece;
        }
      }
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < kKeys; ++j) partial[r][j0 + j] = sum[r][j];
    }
    for (int r = 0; r < R; ++r) Store(scores + r * S + s0, TransposeSum(partial[r]));
  }
}

// Work items of at least this many rows (prefill tiles) score a page from its keys
// transposed (`ScoresFromColumns`); fewer rows (decode) could not repay the transpose.
constexpr int64_t kColumnRows = 8;

// `Scores` (to float32 rounding) from the page's keys transposed to [H, S]: for R rows and
// sixteen keys, each head-dim step is two loads of keys and R broadcasts of q into 2R
// accumulators, with no horizontal sums. Transposing the page costs one pass over it, which
// the rows of a prefill tile share (prefill attention 1.08-1.11x `Scores`, bench/README.md).
template <int R>
inline void ScoresFromColumns(const float* q, const float* columns, int64_t H, int64_t S,
                              float* scores) {
  int64_t s0 = 0;
  for (; s0 + 2 * kLanes <= S; s0 += 2 * kLanes) {
    v8 a[R] = {}, b[R] = {};
    for (int64_t h = 0; h < H; ++h) {
      const v8 keys_a = Load(columns + h * S + s0), keys_b = Load(columns + h * S + s0 + kLanes);
      for (int r = 0; r < R; ++r) {
        const v8 x = Splat(q[r * H + h]);
        a[r] += x * keys_a;
        b[r] += x * keys_b;
      }
    }
    for (int r = 0; r < R; ++r) {
      Store(scores + r * S + s0, a[r]);
      Store(scores + r * S + s0 + kLanes, b[r]);
    }
  }
  for (; s0 < S; s0 += kLanes) {
    v8 a[R] = {};
    for (int64_t h = 0; h < H; ++h) {
      const v8 keys = Load(columns + h * S + s0);
      for (int r = 0; r < R; ++r) a[r] += Splat(q[r * H + h]) * keys;
    }
    for (int r = 0; r < R; ++r) Store(scores + r * S + s0, a[r]);
  }
}

// Lane i of a vector: i.
constexpr i8 kLaneIndex = {0, 1, 2, 3, 4, 5, 6, 7};

// Which lanes of scores[s0:s0 + 8) lie in a row's run [s_begin, s_end) of the page: a row's
// keys on a page are one run, and the slots around it (which may hold NaN) never count.
inline i8 InRun(int64_t s0, int64_t s_begin, int64_t s_end) {
  const i8 index = kLaneIndex + int32_t(s0);
  return (index >= int32_t(s_begin)) & (index < int32_t(s_end));
}

// The largest of scores[s_begin:s_end), eight at a time. One score at a time, each compare
// waited on the previous one: 8% of cached decode attention's samples under `perf`.
inline float VisibleMax(const float* scores, int64_t s_begin, int64_t s_end) {
  v8 best = Splat(kNegInf);
  for (int64_t s0 = s_begin / kLanes * kLanes; s0 < s_end; s0 += kLanes) {
    const v8 x = Load(scores + s0);
    best = InRun(s0, s_begin, s_end) & (x > best) ? x : best;
  }
  float result = kNegInf;
  for (int i = 0; i < kLanes; ++i) result = std::max(result, best[i]);
  return result;
}

// The sum of scores[s_begin:s_end), eight lanes at a time, then the lanes' sums.
inline float VisibleSum(const float* scores, int64_t s_begin, int64_t s_end) {
  v8 sum = {};
  for (int64_t s0 = s_begin / kLanes * kLanes; s0 < s_end; s0 += kLanes)
    sum += InRun(s0, s_begin, s_end) ? Load(scores + s0) : v8{};
  float result = 0.0f;
  for (int i = 0; i < kLanes; ++i) result += sum[i];
  return result;
}

// One page of a work item's walk: scores of its rows against the page's keys, then the
// online-softmax update of the rows that see any of them. `k_ahead` and `v_ahead`: the keys
// and values of the page kPrefetchPages on (null past the walk's end), asked for in pieces
// between the page's work, each burst hidden behind work.
//
// A decode item (fewer than kColumnRows rows) has little work a page, so it asks in
// smaller pieces: half the keys before the scores and half after, and the values in one
// slice before each row's update. Whole pages of keys and then values, a burst of 64 lines
// each, left the walk waiting on the miss buffers with the page's work done (AVX-512 EPYC,
// 8 layers, cache in 2 MiB pages, pages at random: 128 decodes of 224 tokens 23.6 -> 19.6 ms
// a call, 32 of 1,024 tokens 25.3 -> 20.7; bench/README.md). Asked for inside `Scores`'
// loop instead, the pieces cost its compute a fifth (pages in cache: 7.7 -> 9.4 ms).
inline void AttendPage(const Problem& p, Scratch& scratch, int64_t rows, int64_t kv_len,
                       const float* k, const float* v, int64_t page_start,
                       const char* k_ahead, const char* v_ahead) {
  const int64_t H = p.head_dim, S = p.block_size;
  const int64_t key_bytes = H * p.cache_bytes;  // one slot's keys (or values) in the cache
  const bool in_pieces = rows < kColumnRows;
  const int64_t first_keys = in_pieces ? S / 2 : S;  // keys asked for before the scores
  if (k_ahead) Prefetch(k_ahead, first_keys * key_bytes);
  const float* q = scratch.q.data();

  // Scores of every row against all keys of the page, eight keys at a time. Keys a row
  // must not see (unused slots may hold NaN) are left out below, never multiplied in.
  // The two block loops below stay written out: folding them into one (a generic lambda
  // per block size, or one block function choosing its scores) measured 3-7% slower prefill
  // attention (bench/README.md).
  int64_t first = 0;
  float* all_scores = scratch.scores.data();
  if (rows >= kColumnRows) {
    float* columns = scratch.key_columns.data();
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < H; ++h) columns[h * S + s] = k[s * H + h];
    for (; first + 4 <= rows; first += 4)
      ScoresFromColumns<4>(q + first * H, columns, H, S, all_scores + first * S);
    switch (rows - first) {
      case 3: ScoresFromColumns<3>(q + first * H, columns, H, S, all_scores + first * S); break;
      case 2: ScoresFromColumns<2>(q + first * H, columns, H, S, all_scores + first * S); break;
      case 1: ScoresFromColumns<1>(q + first * H, columns, H, S, all_scores + first * S); break;
    }
  } else {
    for (; first + 4 <= rows; first += 4)
      Scores<4>(q + first * H, k, H, S, all_scores + first * S);
    switch (rows - first) {
      case 3: Scores<3>(q + first * H, k, H, S, all_scores + first * S); break;
      case 2: Scores<2>(q + first * H, k, H, S, all_scores + first * S); break;
      case 1: Scores<1>(q + first * H, k, H, S, all_scores + first * S); break;
    }
  }

  if (k_ahead && in_pieces)
    Prefetch(k_ahead + first_keys * key_bytes, (S - first_keys) * key_bytes);
  if (v_ahead && !in_pieces) Prefetch(v_ahead, S * key_bytes);
  for (int64_t row = 0; row < rows; ++row) {
    if (v_ahead && in_pieces)  // value rows [row * S / rows, (row + 1) * S / rows)
      Prefetch(v_ahead + row * S / rows * key_bytes,
               ((row + 1) * S / rows - row * S / rows) * key_bytes);
    // The keys a row sees form one run of this page: [s_begin, s_end).
    const int64_t pos = scratch.row_pos[row];
    const int64_t lowest = p.sliding_window > 0 ? pos - p.sliding_window + 1 : 0;
    const int64_t s_begin = std::max<int64_t>(0, lowest - page_start);
    const int64_t s_end =
        std::min<int64_t>(S, std::min<int64_t>(pos, kv_len - 1) - page_start + 1);
    if (s_end <= s_begin) continue;
    float* scores = all_scores + row * S;
    if (p.soft_cap > 0)  // Gemma 2: on the visible scores only, the rest never count
      for (int64_t s = s_begin; s < s_end; ++s)
        scores[s] = p.soft_cap * std::tanh(scores[s] / p.soft_cap);
    const float page_max = VisibleMax(scores, s_begin, s_end);
    const float old_max = scratch.row_max[row];
    const float new_max = std::max(old_max, page_max);
    for (int64_t s0 = 0; s0 < S; s0 += kLanes)
      Store(scores + s0, ExpNonPositive(Load(scores + s0) - new_max));
    const float page_sum = VisibleSum(scores, s_begin, s_end);
    const float correction = old_max == kNegInf ? 0.0f : std::exp(old_max - new_max);
    scratch.denom[row] = scratch.denom[row] * correction + page_sum;
    scratch.row_max[row] = new_max;
    float* a = scratch.acc.data() + row * H;
    int64_t h = 0;
    for (; h + kAccLanes <= H; h += kAccLanes)
      AccumulateValues<kAccLanes>(a + h, v + h, H, scores, s_begin, s_end, correction);
    for (; h < H; h += kLanes)
      AccumulateValues<kLanes>(a + h, v + h, H, scores, s_begin, s_end, correction);
  }
}

void Attend(const Problem& p, const WorkItem& item, Scratch& scratch) {
  const int64_t H = p.head_dim, S = p.block_size;
  const int64_t group = p.num_q_heads / p.num_kv_heads;
  const int64_t rows = item.num_tokens * group;  // row = token * group + q head in group
  const int32_t request_start = p.query_start_loc[item.request];
  const int32_t q_len = p.query_start_loc[item.request + 1] - request_start;
  const int32_t kv_len = p.kv_lens[item.request];
  // The first new token of a request sits at context position kv_len - q_len. Positions
  // are 64-bit: a window as wide as int32 allows must not overflow `pos - window`.
  const int64_t first_pos = int64_t(kv_len) - q_len + (item.first_token - request_start);
  const int64_t last_visible = std::min<int64_t>(first_pos + item.num_tokens - 1, kv_len - 1);

  float* q = scratch.q.data();
  float* acc = scratch.acc.data();
  for (int64_t t = 0; t < item.num_tokens; ++t) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t row = t * group + g;
      const float* src =
          p.q + ((item.first_token + t) * p.num_q_heads + item.kv_head * group + g) * H;
      for (int64_t h = 0; h < H; ++h) q[row * H + h] = src[h] * p.sm_scale;
      std::fill(acc + row * H, acc + (row + 1) * H, 0.0f);
      scratch.row_max[row] = kNegInf;
      scratch.denom[row] = 0.0f;
      scratch.row_pos[row] = first_pos + t;
    }
  }

  const int64_t page_values = S * H, page_bytes = page_values * p.cache_bytes;
  const int64_t kv_stride = p.num_kv_heads * p.num_blocks * page_bytes;  // bytes
  const char* keys =
      p.kv_cache + p.layer * 2 * kv_stride + item.kv_head * p.num_blocks * page_bytes;
  const char* values = keys + kv_stride;
  const int32_t* pages = p.block_tables + int64_t(item.request) * p.pages_per_request;
  // Out-of-range ids are clamped, as the reference's gather does; they are never visible.
  auto page_at = [&](int64_t index) {
    return std::clamp<int64_t>(pages[index], 0, p.num_blocks - 1) * page_bytes;
  };
  const int64_t first_visible =
      p.sliding_window > 0 ? std::max<int64_t>(0, first_pos - p.sliding_window + 1) : 0;
  // Inside the request's table row: kv_len <= P * S, and tokens before position 0 see nothing.
  const int64_t first_page = first_visible / S;
  const int64_t end_page = last_visible < first_visible
                               ? first_page
                               : std::min(last_visible / S + 1, p.pages_per_request);

  // Pages are scattered over the cache, so the hardware prefetcher cannot guess the next
  // one: the walk asks for the keys and values kPrefetchPages ahead of the page it uses.
  for (int64_t index = first_page; index < std::min(first_page + kPrefetchPages, end_page);
       ++index) {
    Prefetch(keys + page_at(index), page_bytes);
    Prefetch(values + page_at(index), page_bytes);
  }
  for (int64_t page_index = first_page; page_index < end_page; ++page_index) {
    const char *k_ahead = nullptr, *v_ahead = nullptr;
    if (page_index + kPrefetchPages < end_page) {
      const int64_t ahead = page_at(page_index + kPrefetchPages);
      k_ahead = keys + ahead;
      v_ahead = values + ahead;
    }
    const float* k = PageAsFloat(p, keys + page_at(page_index), page_values, scratch.k_page);
    const float* v = PageAsFloat(p, values + page_at(page_index), page_values, scratch.v_page);
    AttendPage(p, scratch, rows, kv_len, k, v, page_index * S, k_ahead, v_ahead);
  }

  for (int64_t t = 0; t < item.num_tokens; ++t) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t row = t * group + g;
      float* dst = p.out + ((item.first_token + t) * p.num_q_heads + item.kv_head * group + g) * H;
      const float denom = scratch.denom[row];
      const float scale = denom > 0 ? 1.0f / denom : 0.0f;
      for (int64_t h = 0; h < H; ++h) dst[h] = acc[row * H + h] * scale;
    }
  }
}

// Shared by the caller and the pool tasks; owned jointly, because a task the pool starts
// late may find no work left and still touch it after the caller has returned.
struct Work {
  Problem problem;
  std::vector<WorkItem> items;
  int64_t max_rows = 0;  // the most query rows of an item
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

void Drain(Work& work) {
  const int64_t total = int64_t(work.items.size());
  int64_t i = work.next.fetch_add(1);
  if (i >= total) return;
  Scratch scratch(work.problem, work.max_rows);
  for (; i < total; i = work.next.fetch_add(1)) {
    Attend(work.problem, work.items[i], scratch);
    work.done.fetch_add(1, std::memory_order_release);
  }
}

using Dims = ffi::Span<const int64_t>;

std::string Shape(Dims dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + "]";
}

// What is wrong with the shapes, if anything: every shape the walk indexes by. cpu.py
// raises the same complaints at trace time.
const char* ShapeProblem(Dims q, Dims cache, Dims kv_lens, Dims tables, Dims starts, Dims out,
                         size_t layer_values) {
  if (q.size() != 3 || !(out == q)) return "q and out must be [tokens, q heads, head dim]";
  if (cache.size() != 6 || cache[1] != 2)
    return "kv_cache must be [layers, 2 (k and v), kv heads, pages, page size, head dim]";
  if (kv_lens.size() != 1 || tables.size() != 2 || starts.size() != 1 || layer_values != 2)
    return "kv_lens must be [R], block_tables [R, P], query_start_loc [R + 1], layer and "
           "window [2]";
  if (q[2] != cache[5]) return "q's head dim must equal kv_cache's";
  if (cache[2] < 1 || q[1] < 1 || q[1] % cache[2])
    return "q heads must be a multiple of kv_cache's kv heads";
  if (q[1] / cache[2] > kMaxRows) return "at most 64 q heads per kv head";
  if (q[2] % kLanes || cache[4] % kLanes) return "head dim and page size must be multiples of 8";
  if (cache[3] < 1) return "kv_cache must hold a page";
  if (tables[0] < kv_lens[0]) return "block_tables needs a row for every request of kv_lens";
  if (starts[0] != kv_lens[0] + 1) return "query_start_loc needs one entry more than kv_lens";
  return nullptr;
}

// What is wrong with the metadata that steers the walks, if anything: any of it wrong
// would send a walk outside its request's tokens or row of the table. Page ids are not
// checked: the walk clamps them, as the reference does.
std::string MetadataProblem(const Problem& p, int64_t num_requests, int64_t num_tokens,
                            int64_t num_layers) {
  auto str = [](int64_t x) { return std::to_string(x); };
  if (p.layer < 0 || p.layer >= num_layers)
    return "layer " + str(p.layer) + " is outside the cache's " + str(num_layers) + " layers";
  const int64_t max_kv_len = p.pages_per_request * p.block_size;
  for (int64_t r = 0; r <= num_requests; ++r) {
    const int64_t start = p.query_start_loc[r], previous = r ? p.query_start_loc[r - 1] : 0;
    if (start < previous || start > num_tokens)
      return "query_start_loc must rise from >= 0 to <= " + str(num_tokens) +
             " (q's tokens); entry " + str(r) + " is " + str(start) + " after " + str(previous);
    if (r < num_requests && (p.kv_lens[r] < 0 || p.kv_lens[r] > max_kv_len))
      return "kv_lens[" + str(r) + "] = " + str(p.kv_lens[r]) + " is outside [0, " +
             str(max_kv_len) + "] (block_tables' pages per request x page size)";
  }
  return "";
}

ffi::Error RaggedPagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                ffi::AnyBuffer kv_cache, ffi::Buffer<ffi::S32> layer_window,
                                ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> block_tables,
                                ffi::Buffer<ffi::S32> query_start_loc,
                                ffi::ResultBuffer<ffi::F32> out, float sm_scale,
                                float soft_cap) {
  const Dims q_dims = q.dimensions(), cache_dims = kv_cache.dimensions();
  const Dims lens_dims = kv_lens.dimensions(), table_dims = block_tables.dimensions(),
             start_dims = query_start_loc.dimensions();
  if (const char* problem = ShapeProblem(q_dims, cache_dims, lens_dims, table_dims, start_dims,
                                         out->dimensions(), layer_window.element_count()))
    return ffi::Error::InvalidArgument(
        "ragged paged attention: " + std::string(problem) + "; got q " + Shape(q_dims) +
        ", kv_cache " + Shape(cache_dims) + ", kv_lens " + Shape(lens_dims) + ", block_tables " +
        Shape(table_dims) + ", query_start_loc " + Shape(start_dims));
  auto work = std::make_shared<Work>();
  Problem& p = work->problem;
  CacheType cache_type;
  switch (kv_cache.element_type()) {
    case ffi::DataType::F32: cache_type = CacheType::kF32; break;
    case ffi::DataType::BF16: cache_type = CacheType::kBF16; break;
    case ffi::DataType::F8E4M3FN: cache_type = CacheType::kF8E4M3FN; break;
    case ffi::DataType::F8E5M2: cache_type = CacheType::kF8E5M2; break;
    default:
      return ffi::Error::InvalidArgument(
          "ragged paged attention: kv_cache must be float32, bfloat16, float8_e4m3fn or "
          "float8_e5m2");
  }
  p = {q.typed_data(), static_cast<const char*>(kv_cache.untyped_data()), cache_type,
       int64_t(kv_cache.size_bytes() / std::max<size_t>(1, kv_cache.element_count())),
       out->typed_data(), kv_lens.typed_data(),
       block_tables.typed_data(), query_start_loc.typed_data(),
       /*num_q_heads=*/q_dims[1], /*num_kv_heads=*/cache_dims[2], /*head_dim=*/q_dims[2],
       /*num_blocks=*/cache_dims[3], /*block_size=*/cache_dims[4],
       /*layer=*/layer_window.typed_data()[0], /*pages_per_request=*/table_dims[1], sm_scale,
       /*sliding_window=*/std::max(0, layer_window.typed_data()[1]), std::max(0.0f, soft_cap)};
  const int64_t num_tokens = q_dims[0], num_requests = lens_dims[0];
  if (std::string problem = MetadataProblem(p, num_requests, num_tokens, cache_dims[0]);
      !problem.empty())
    return ffi::Error::InvalidArgument("ragged paged attention: " + problem);

  // Padding tokens (past query_start_loc[R]) and rows that see nothing come back as zeros.
  std::memset(p.out, 0, sizeof(float) * num_tokens * p.num_q_heads * p.head_dim);
  const int64_t group = p.num_q_heads / p.num_kv_heads;
  const int64_t tile_tokens = kMaxRows / group;
  for (int64_t r = 0; r < num_requests; ++r) {
    const int64_t start = p.query_start_loc[r], end = p.query_start_loc[r + 1];
    if (end <= start || p.kv_lens[r] <= 0) continue;
    for (int64_t t = start; t < end; t += tile_tokens)
      for (int64_t k = 0; k < p.num_kv_heads; ++k)
        work->items.push_back(
            {int32_t(r), int32_t(k), int32_t(t), int32_t(std::min(tile_tokens, end - t))});
    work->max_rows = std::max(work->max_rows, std::min(tile_tokens, end - start) * group);
  }

  const int64_t total = int64_t(work->items.size());
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), total) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { Drain(*work); });
  Drain(*work);
  // Every item is claimed by now; wait for the ones a helper is still working on.
  while (work->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JengineRaggedPagedAttention, RaggedPagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // kv_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer, window: [2]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap"));
