// Paged decode attention for CPU: one query token per sequence, read straight from the block pool.
//
// The torch reference (ops/reference.py) first gathers each sequence's blocks into a padded
// contiguous tensor, then runs SDPA over it: the context is read, written and read again. Here
// each (sequence, KV head) work item walks its block table once: the scores of the `group`
// query heads that share the KV head, a softmax in float32, then the weighted sum of the value
// rows. Work items are spread over torch's own intra-op thread pool (at::parallel_for).
//
// A sliding window W (> 0) keeps only the last W positions of the context (the query's own
// included, as transformers' masks do); a soft-cap c (> 0) maps each scaled score s to
// c * tanh(s / c) before the softmax (Gemma 2). 0 turns either off. Attention chunks of C (> 0)
// positions keep only the query's own chunk (Llama 4). Optional per-query-head float32 arrays:
// ALiBi slopes m_h add m_h * (key position - query position) to the (capped) scores (BLOOM, MPT,
// Falcon), and sinks s_h join the softmax's denominator as a logit with no value row (GPT-OSS).
//
// Layouts (float32, or bfloat16 for query, out and caches alike: the arithmetic stays float32 and
// the output is rounded once): query/out [tokens, heads, head_dim] with head_dim contiguous;
// k_cache/v_cache [blocks, block_size, kv_heads, head_dim] contiguous; per row r of the call:
// tokens int64 [R] (its query token), block_tables int32 [R, max_blocks] and seq_lens int32 [R]
// (the positions it attends to, its own included).
//
// With AVX-512 and head_dim 32, 64, 80, 96 or 128, an item keeps its query heads and their output
// sums in sixteen-lane registers while it walks the context (decode_avx512: per position, each key
// and value row is loaded once for up to four query heads). Measured against the AVX2 path below
// on SmolLM2's shapes (9 heads, 3 KV heads, head_dim 64), 2 threads: a decode step of 64 sequences
// at context 128, 26.9 against 32.2 ms over 30 layers; prompt rows (one row per query token, see
// ops/attention.py), 10 prompts of 51 tokens 0.32 against 0.66 ms a layer, one of 128 0.32 against
// 0.60. The AVX-512 walk asks for the rows of the blocks ahead and of the walk after it (blocks sit
// anywhere in the pool, where the hardware cannot guess them; see BlockSpan). Otherwise, with AVX2+FMA
// (and head_dim a multiple of 8) the dot products, exponentials and value sums are vectorized by hand in
// eight lanes (up to four query heads' dots per key row, dots4; up to three query heads' value sums in
// registers, value_sums8, in torch's SDPA steps too), and the walks ask for the next block's rows once,
// one block ahead; without, plain loops do the same arithmetic.
#include "aten.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

// MKL's tile order for the SDPA rows (below, AVX-512 builds), chosen once per process (set_sdpa_tile_order)
std::atomic<bool> g_tile_order{false};

#ifdef PAGEDSERVE_AVX2
using pagedserve::hsum8;

// <a, b> over n floats, n a multiple of 8; two accumulators to halve the FMA dependency chain
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), acc1);
  }
  if (d < n) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc0);
  return hsum8(_mm256_add_ps(acc0, acc1));
}

// y += w * x over n floats, n a multiple of 8
inline void axpy(float w, const float* x, float* y, int64_t n) {
  const __m256 wv = _mm256_set1_ps(w);
  for (int64_t d = 0; d < n; d += 8)
    _mm256_storeu_ps(y + d, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + d), _mm256_loadu_ps(y + d)));
}

// in place: s[p] = exp(s[p] - m); returns the sum
inline float exp_shifted_sum(float* s, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 total = _mm256_setzero_ps();
  int64_t p = 0;
  for (; p + 8 <= n; p += 8) {
    const __m256 e = pagedserve::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + p), mv));
    _mm256_storeu_ps(s + p, e);
    total = _mm256_add_ps(total, e);
  }
  float sum = hsum8(total);
  for (; p < n; ++p) { s[p] = std::exp(s[p] - m); sum += s[p]; }
  return sum;
}
#endif

inline float dot_scalar(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
  for (int64_t d = 0; d < n; ++d) acc += a[d] * b[d];
  return acc;
}

inline void axpy_scalar(float w, const float* x, float* y, int64_t n) {
  for (int64_t d = 0; d < n; ++d) y[d] += w * x[d];
}

inline float exp_shifted_sum_scalar(float* s, int64_t n, float m) {
  float sum = 0.f;
  for (int64_t p = 0; p < n; ++p) { s[p] = std::exp(s[p] - m); sum += s[p]; }
  return sum;
}

// The AVX2 helpers when the build has them and head_dim is a multiple of 8, else the scalar loops.
template <bool kVector>
inline float dot_any(const float* a, const float* b, int64_t n) {
#ifdef PAGEDSERVE_AVX2
  if (kVector) return dot(a, b, n);
#endif
  return dot_scalar(a, b, n);
}

template <bool kVector>
inline void axpy_any(float w, const float* x, float* y, int64_t n) {
#ifdef PAGEDSERVE_AVX2
  if (kVector) return axpy(w, x, y, n);
#endif
  axpy_scalar(w, x, y, n);
}

template <bool kVector>
inline float exp_shifted_sum_any(float* s, int64_t n, float m) {
#ifdef PAGEDSERVE_AVX2
  if (kVector) return exp_shifted_sum(s, n, m);
#endif
  return exp_shifted_sum_scalar(s, n, m);
}

using pagedserve::bf16;

// a row of n values as float32: the row itself, or its conversion into `buf`
inline const float* as_float(const float* row, float*, int64_t) { return row; }
inline const float* as_float(const bf16* row, float* buf, int64_t n) {
  int64_t i = 0;
#ifdef PAGEDSERVE_AVX2
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(buf + i, pagedserve::load8(row + i));
#endif
  for (; i < n; ++i) buf[i] = pagedserve::to_float(row[i]);
  return buf;
}

// One block of a walk over positions [begin, len) of a sequence: its rows in `cache` (`rows`, slot 0; a row
// holds every KV head), how many (`n`), the first at or past `begin` (`first`: a window may start inside
// the block), and where to ask for the next block's rows (`next`, already `offset` into each row, and
// `later` rows of it; none where offset < 0 or this block is the last). The next block sits anywhere in
// the pool, where the hardware's prefetcher cannot guess it: a walk asks for the part of its rows it reads
// while this block is worked on, row i of the next block beside row i of this one (ask_row), so that the
// requests trickle out as the walk goes instead of queueing all at once behind the core's few outstanding
// misses. Into L2 (locality 2): asked into L1, a 64-row walk over a shuffled pool was no faster than with
// no prefetch at all. The AVX-512 walks (walk_context) ask for every row twice, two blocks ahead and again
// one block ahead: faster than asking once at either distance, where a third request, three blocks ahead,
// was slower (bench/kernels_ab.py); a core may drop a prefetch it has no room for, and the second request
// is a second chance.
template <typename T>
struct BlockSpan {
  const T* rows;
  const T* next;
  int64_t n, first, later;
};

// The first block of the walk that comes after this one (the values after the keys, the next head's or
// row's keys after the values): its first `n` rows, already at the walk's offset. A walk's last blocks
// ask for them, so that no walk starts on rows nobody asked for.
template <typename T>
struct Then {
  const T* rows = nullptr;
  int64_t n = 0;
};

// The block at p0, and where to ask ahead while it is walked: `ahead` blocks further on, or, where that
// would be one past the walk's last block, the first block of the walk after it (`then`)
template <typename T>
inline BlockSpan<T> block_span(const T* cache, const int32_t* table, int64_t p0, int64_t begin, int64_t len,
                               int64_t block_size, int64_t slot_stride, int64_t offset, Then<T> then = {},
                               int64_t ahead = 1) {
  const int64_t block = p0 / block_size, target = block + ahead, blocks = (len + block_size - 1) / block_size;
  const bool ask = offset >= 0 && target < blocks;
  const bool ask_then = offset >= 0 && target == blocks && then.rows != nullptr;
  return {cache + static_cast<int64_t>(table[block]) * block_size * slot_stride,
          ask ? cache + static_cast<int64_t>(table[target]) * block_size * slot_stride + offset
              : (ask_then ? then.rows : nullptr),
          std::min(block_size, len - p0), std::max<int64_t>(0, begin - p0),
          ask ? std::min(block_size, len - target * block_size) : (ask_then ? then.n : 0)};
}

// where a walk over positions [begin, len) of `cache` at `offset` into each row starts: its first block's rows
template <typename T>
inline Then<T> walk_start(const T* cache, const int32_t* table, int64_t begin, int64_t len, int64_t block_size,
                          int64_t slot_stride, int64_t offset) {
  const int64_t p0 = begin / block_size * block_size;
  return {cache + static_cast<int64_t>(table[p0 / block_size]) * block_size * slot_stride + offset,
          std::min(block_size, len - p0)};
}

// asks for `values` values of row i of the span's next block (a cache line at a time). The span is taken by
// value: through a const reference GCC 12 dropped every prefetch of the file (none left in its assembly)
template <typename T>
inline void ask_row(BlockSpan<T> span, int64_t i, int64_t slot_stride, int64_t values) {
  if (i < span.later)
    for (int64_t f = 0; f < values; f += 64 / static_cast<int64_t>(sizeof(T)))
      __builtin_prefetch(span.next + i * slot_stride + f, 0, 2);
}

// fn(p - begin, row) for every position begin <= p < len of a sequence, `row` its slot's row (all KV
// heads) in `cache`; blocks wholly before `begin` are not touched
template <typename T, typename Fn>
inline void walk_context(const T* cache, const int32_t* table, int64_t begin, int64_t len,
                         int64_t block_size, int64_t slot_stride, Fn fn, int64_t prefetch_offset = -1,
                         int64_t prefetch_values = 0, Then<T> then = {}) {
  for (int64_t p0 = begin / block_size * block_size; p0 < len; p0 += block_size) {
    const BlockSpan<T> span = block_span(cache, table, p0, begin, len, block_size, slot_stride, prefetch_offset, then);
    const BlockSpan<T> far = block_span(cache, table, p0, begin, len, block_size, slot_stride, prefetch_offset, then, 2);
    for (int64_t i = 0; i < span.n; ++i) {
      ask_row(far, i, slot_stride, prefetch_values);
      ask_row(span, i, slot_stride, prefetch_values);
      if (i >= span.first) fn(p0 + i - begin, span.rows + i * slot_stride);
    }
  }
}

struct Shape {
  int64_t block_size, kv_heads, head_dim, group, max_blocks, slot_stride;
  int64_t q_tok, q_head, o_tok, o_head;
  float scale;
  int64_t window;   // 0: none
  float softcap;    // 0: none
  int64_t chunk;    // 0: none
  const float* alibi = nullptr;   // [heads] slopes, or none
  const float* sinks = nullptr;   // [heads] logits, or none
  // bfloat16 in torch's SDPA order (see below): per row the keys of transformers' call, and torch's lanes
  const int32_t* ends = nullptr;
  int64_t lanes = 0;              // 0: this kernel's own order
  // and, where given, per row the query rows of torch's call that computes it (1 for a decode row; 0: this
  // kernel's order for that row): then q.k and the weighted values add in the order of MKL's product
  const int32_t* qrows = nullptr;
  int block_shift = -1;           // log2(block_size) where that is a power of two
  int64_t threads = 1;            // torch's threads at the call (they decide torch's products, sdpa_packs)
};

// the first position a query at `last` sees: within its window and its chunk
inline int64_t first_visible(const Shape& sh, int64_t last) {
  int64_t begin = sh.window > 0 ? std::max<int64_t>(0, last + 1 - sh.window) : 0;
  if (sh.chunk > 0) begin = std::max(begin, last / sh.chunk * sh.chunk);
  return begin;
}

// The scores of query head `head` over positions begin .. begin + len - 1 (the query at begin + len - 1)
// become probabilities up to a common factor, in place: soft-cap, ALiBi, then exp(s - max); returns
// 1 / the softmax's denominator, the sink's term included.
template <typename ExpSum>
inline float finish_scores(const Shape& sh, float* s, int64_t len, int64_t head, ExpSum exp_sum) {
  if (sh.softcap > 0.f) {
    const float inv_cap = 1.f / sh.softcap;
    for (int64_t i = 0; i < len; ++i) s[i] = sh.softcap * std::tanh(s[i] * inv_cap);
  }
  if (sh.alibi != nullptr) {
    const float slope = sh.alibi[head];
    for (int64_t i = 0; i < len; ++i) s[i] += slope * static_cast<float>(i - (len - 1));
  }
  float m = *std::max_element(s, s + len);
  if (sh.sinks != nullptr) m = std::max(m, sh.sinks[head]);
  float sum = exp_sum(s, len, m);
  if (sh.sinks != nullptr) sum += std::exp(sh.sinks[head] - m);
  return 1.f / sum;
}

// --- bfloat16 as transformers computes it on a CPU -------------------------------------------------
// In bfloat16, transformers' SDPA on a CPU runs torch's flash-attention kernel, whose weights differ from
// the exactly rounded ones in one bfloat16 step in about a third of the outputs: it rounds the softmax's
// numerators to bfloat16 before they weigh the value rows, and takes them from a fast exponential. Where
// the caller asks (Shape::ends), a row follows the same steps, so that a served bfloat16 model gives
// transformers' results, not merely close ones: the scores q.k in float32, times the scale; per block of
// 512 of the call's keys (transformers' call: a prompt's length for a prompt row, the context for a decode
// row) the running maximum; exp(s - max) by the fast exponential for whole vectors of `lanes` keys and
// by expf for the rest of the block; their sum (lane_sum), then the rest in order; an earlier block's
// sums and weighted values rescaled by exp(old max - new max); the numerators rounded to bfloat16; the
// output multiplied by 1 / sum. The float32 sums of the two products (q.k, and the weighted values)
// add in MKL's order where the caller gives Shape::qrows (below), else in this kernel's: then rarely a
// different rounded result.
constexpr int64_t kSdpaBlock = 512;

// bits of the float32 constants of torch's fast exponential (Vectorized<float>::fexp_u20, after Malossi
// et al., "Fast Exponential Computation on SIMD Architectures"): 2^(x log2 e), the fraction's power of
// two corrected by a cubic, the result written straight into the exponent and mantissa bits
inline float float_of_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
const float kFastLog2e = float_of_bits(0x3fb8aa3bu), kFastLow = float_of_bits(0xc2aeac50u),
            kFastHigh = float_of_bits(0x42b17218u);
constexpr float kFast0 = 0.00010703434948458272f, kFast1 = 0.30354260500649682f, kFast2 = -0.22433836478672356f,
                kFast3 = -0.079204240219773236f, kTwo23 = 8388608.0f, kTwo23x127 = 8388608.0f * 127.0f;

inline float fast_exp(float x) {
  if (x < kFastLow) return 0.f;
  if (x > kFastHigh) return std::numeric_limits<float>::infinity();
  if (x != x) return x;
  const float y = x * kFastLog2e;
  const float f = y - std::floor(y);
  float r = std::fma(f, kFast3, kFast2);
  r = std::fma(f, r, kFast1);
  r = std::fma(f, r, kFast0);
  const float t = std::fma(kTwo23, y - r, kTwo23x127);
  return float_of_bits(static_cast<uint32_t>(static_cast<int32_t>(t)));   // truncated, as cvttps does
}

#ifdef PAGEDSERVE_AVX512
// the same, sixteen at once (each lane's value equals fast_exp's)
inline __m512 fast_exp16(__m512 x) {
  const __mmask16 low = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kFastLow), _CMP_LT_OS);
  const __mmask16 high = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kFastHigh), _CMP_GT_OS);
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(kFastLog2e));
  const __m512 f = _mm512_sub_ps(y, _mm512_roundscale_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
  __m512 r = _mm512_fmadd_ps(f, _mm512_set1_ps(kFast3), _mm512_set1_ps(kFast2));
  r = _mm512_fmadd_ps(f, r, _mm512_set1_ps(kFast1));
  r = _mm512_fmadd_ps(f, r, _mm512_set1_ps(kFast0));
  const __m512 t = _mm512_fmadd_ps(_mm512_set1_ps(kTwo23), _mm512_sub_ps(y, r), _mm512_set1_ps(kTwo23x127));
  __m512i bits = _mm512_cvttps_epi32(t);
  bits = _mm512_mask_mov_epi32(bits, low, _mm512_setzero_si512());
  bits = _mm512_mask_mov_epi32(bits, high, _mm512_set1_epi32(0x7F800000));
  return _mm512_castsi512_ps(bits);
}
#elif defined(PAGEDSERVE_AVX2)
// the same, eight at once (each lane as fast_exp16's)
inline __m256 fast_exp8(__m256 x) {
  const __m256 low = _mm256_cmp_ps(x, _mm256_set1_ps(kFastLow), _CMP_LT_OS);
  const __m256 high = _mm256_cmp_ps(x, _mm256_set1_ps(kFastHigh), _CMP_GT_OS);
  const __m256 y = _mm256_mul_ps(x, _mm256_set1_ps(kFastLog2e));
  const __m256 f = _mm256_sub_ps(y, _mm256_round_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
  __m256 r = _mm256_fmadd_ps(f, _mm256_set1_ps(kFast3), _mm256_set1_ps(kFast2));
  r = _mm256_fmadd_ps(f, r, _mm256_set1_ps(kFast1));
  r = _mm256_fmadd_ps(f, r, _mm256_set1_ps(kFast0));
  const __m256 t = _mm256_fmadd_ps(_mm256_set1_ps(kTwo23), _mm256_sub_ps(y, r), _mm256_set1_ps(kTwo23x127));
  __m256 bits = _mm256_castsi256_ps(_mm256_cvttps_epi32(t));
  bits = _mm256_andnot_ps(low, bits);
  return _mm256_blendv_ps(bits, _mm256_castsi256_ps(_mm256_set1_epi32(0x7F800000)), high);
}
#endif

// The passes of one block over a row's scores, sixteen at a time where the build has AVX-512 and eight
// where it has AVX2, the same values every way (elementwise, or a maximum).

// in place: s[i] *= scale for i < n; returns their maximum
inline float scale_and_max(float* s, int64_t n, float scale) {
  float max = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#ifdef PAGEDSERVE_AVX512
  __m512 vmax = _mm512_set1_ps(max);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(s + i), _mm512_set1_ps(scale));
    _mm512_storeu_ps(s + i, v);
    vmax = _mm512_max_ps(vmax, v);
  }
  max = _mm512_reduce_max_ps(vmax);
#elif defined(PAGEDSERVE_AVX2)
  __m256 vmax = _mm256_set1_ps(max);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(scale));
    _mm256_storeu_ps(s + i, v);
    vmax = _mm256_max_ps(vmax, v);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, vmax);
  max = *std::max_element(lanes, lanes + 8);
#endif
  for (; i < n; ++i) {
    s[i] *= scale;
    max = std::max(max, s[i]);
  }
  return max;
}

// in place: s[i] = fast_exp(s[i] - m) for i < n
inline void fast_exp_shifted(float* s, int64_t n, float m) {
  int64_t i = 0;
#ifdef PAGEDSERVE_AVX512
  const __m512 mv = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(s + i, fast_exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), mv)));
#elif defined(PAGEDSERVE_AVX2)
  const __m256 mv = _mm256_set1_ps(m);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(s + i, fast_exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv)));
#endif
  for (; i < n; ++i) s[i] = fast_exp(s[i] - m);
}

// the sum of s[0 .. n) (whole vectors of `lanes`) as torch's built kernel adds it: two vector sums, the
// even vectors in one and the odd ones in the other, then added together; then their lanes pairwise,
// halving. (Read from torch's results: one running vector sum gives other bits once there are three
// vectors or more, tests/kernels/test_sdpa_order.py.)
inline float lane_sum(const float* s, int64_t n, int64_t lanes) {
  float lane[2][16] = {{0.f}};
  int64_t i = 0;
#ifdef PAGEDSERVE_AVX512
  if (lanes == 16) {
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
    for (; i + 32 <= n; i += 32) {
      even = _mm512_add_ps(even, _mm512_loadu_ps(s + i));
      odd = _mm512_add_ps(odd, _mm512_loadu_ps(s + i + 16));
    }
    _mm512_storeu_ps(lane[0], even);
    _mm512_storeu_ps(lane[1], odd);
  }
#elif defined(PAGEDSERVE_AVX2)
  if (lanes == 8) {
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
      even = _mm256_add_ps(even, _mm256_loadu_ps(s + i));
      odd = _mm256_add_ps(odd, _mm256_loadu_ps(s + i + 8));
    }
    _mm256_storeu_ps(lane[0], even);
    _mm256_storeu_ps(lane[1], odd);
  }
#endif
  for (; i < n; ++i) lane[(i / lanes) % 2][i % lanes] += s[i];
  for (int64_t k = 0; k < lanes; ++k) lane[0][k] += lane[1][k];
  for (int64_t half = lanes / 2; half >= 1; half /= 2)
    for (int64_t k = 0; k < half; ++k) lane[0][k] += lane[0][k + half];
  return lane[0][0];
}

// in place: s[i] rounded to bfloat16 for i < n
inline void round_to_bf16(float* s, int64_t n) {
  int64_t i = 0;
#ifdef PAGEDSERVE_AVX512
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(s + i, pagedserve::rounded16<pagedserve::bf16>(_mm512_loadu_ps(s + i)));
#elif defined(PAGEDSERVE_AVX2)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(s + i, pagedserve::rounded8<pagedserve::bf16>(_mm256_loadu_ps(s + i)));
#endif
  for (; i < n; ++i) s[i] = pagedserve::rounded<pagedserve::bf16>(s[i]);
}

// One query head's scores q.k over positions 0 .. len - 1 of a call of `end` keys become its bfloat16
// numerators, in place, in torch's steps (above); rescale[b] is what block b (b >= 1) multiplies the
// value sums of the blocks before it by. Returns 1 / the denominator.
inline float sdpa_weights(float* s, int64_t len, int64_t end, float scale, int64_t lanes, float* rescale) {
  float max = -std::numeric_limits<float>::infinity(), sum = 0.f;
  for (int64_t n = 0, b = 0; n < len; n += kSdpaBlock, ++b) {
    const int64_t stop = std::min(n + kSdpaBlock, len);    // what this row sees of the block
    // the whole vectors of the call's block take the fast exponential, the rest expf
    const int64_t fast_end = std::min(stop, n + std::min(kSdpaBlock, end - n) / lanes * lanes);
    const float new_max = std::max(max, scale_and_max(s + n, stop - n, scale));
    fast_exp_shifted(s + n, fast_end - n, new_max);
    float block_sum = lane_sum(s + n, fast_end - n, lanes);
    for (int64_t i = fast_end; i < stop; ++i) {
      s[i] = std::exp(s[i] - new_max);
      block_sum += s[i];
    }
    const float factor = std::exp(max - new_max);   // 0 for the first block
    const float carried = factor * sum;
    sum = block_sum + carried;
    rescale[b] = factor;
    max = new_max;
    round_to_bf16(s + n, stop - n);
  }
  return 1.f / sum;
}

// whether a row of this call is computed in torch's SDPA order
template <typename T>
inline bool sdpa_order(const Shape& sh) {
  return std::is_same<T, pagedserve::bf16>::value && sh.ends != nullptr && sh.lanes > 0 && sh.window == 0 &&
         sh.softcap == 0.f && sh.chunk == 0 && sh.alibi == nullptr && sh.sinks == nullptr;
}

#ifdef PAGEDSERVE_AVX2
// The weighted sums of the value rows (float32, or bfloat16 widened) for G query heads that share KV head
// h, dimensions [d0, d0 + 8 S): G * S eight-lane sums in registers while the walk goes, each value loaded
// once for the G heads. Per output the same FMAs in the same order as axpy's (over the positions in order),
// so the same bits. The walk goes block by block here (block_span, ask_row) rather than through
// walk_context: with the sums captured by its lambda, GCC stored every one of them to the stack at each
// position. With `rescale` (torch's SDPA steps), head g's sums are multiplied by rescale[g][b] before the
// first position of each block b >= 1 of kSdpaBlock, as the walk in memory does. out[g][0 .. 8 S) = the
// sums * inv_sum[g], rounded to T.
// `ahead`: ask for the next block's part of the rows this walk reads (the first walk over them).
template <int G, int S, typename T>
void value_sums8(const Shape& sh, const T* vc, const int32_t* table, int64_t begin, int64_t full_len,
                 int64_t h, int64_t d0, const float* const* w, const float* inv_sum, const float* const* rescale,
                 bool ahead, T* const* out) {
  __m256 acc[G][S];
  for (int g = 0; g < G; ++g)
    for (int s = 0; s < S; ++s) acc[g][s] = _mm256_setzero_ps();
  const int64_t bs = sh.block_size, stride = sh.slot_stride, offset = h * sh.head_dim + d0;
  for (int64_t p0 = begin / bs * bs; p0 < full_len; p0 += bs) {
    const BlockSpan<T> span = block_span(vc, table, p0, begin, full_len, bs, stride, ahead ? offset : -1);
    const T* block = span.rows + offset;
    for (int64_t i = 0; i < span.n; ++i) {
      ask_row(span, i, stride, 8 * S);
      if (i < span.first) continue;
      const int64_t p = p0 + i - begin;
      if (rescale != nullptr && p > 0 && p % kSdpaBlock == 0)
        for (int g = 0; g < G; ++g) {
          const __m256 factor = _mm256_set1_ps(rescale[g][p / kSdpaBlock]);
          for (int s = 0; s < S; ++s) acc[g][s] = _mm256_mul_ps(acc[g][s], factor);
        }
      const T* v = block + i * stride;
      __m256 wv[G];
      for (int g = 0; g < G; ++g) wv[g] = _mm256_set1_ps(w[g][p]);
      for (int s = 0; s < S; ++s) {
        const __m256 x = pagedserve::load8(v + 8 * s);
        for (int g = 0; g < G; ++g) acc[g][s] = _mm256_fmadd_ps(wv[g], x, acc[g][s]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m256 inv = _mm256_set1_ps(inv_sum[g]);
    for (int s = 0; s < S; ++s) pagedserve::store8(out[g] + 8 * s, _mm256_mul_ps(acc[g][s], inv));
  }
}

// value_sums8 of G heads over dimensions [d0, d0 + 8 S), S = min(kMaxS, what is left)
template <int G, int kMaxS, typename T>
void value_sums8_upto(int64_t slices, const Shape& sh, const T* vc, const int32_t* table, int64_t begin,
                      int64_t full_len, int64_t h, int64_t d0, const float* const* w, const float* inv_sum,
                      const float* const* rescale, bool ahead, T* const* out) {
  if constexpr (kMaxS > 1) {
    if (slices < kMaxS) {
      value_sums8_upto<G, kMaxS - 1>(slices, sh, vc, table, begin, full_len, h, d0, w, inv_sum, rescale, ahead, out);
      return;
    }
  }
  value_sums8<G, kMaxS>(sh, vc, table, begin, full_len, h, d0, w, inv_sum, rescale, ahead, out);
}

// The item's value sums, head_dim a multiple of 8: for each KV head, its query heads three at a time
// (the last group may hold two or one): three or two walk 32 dimensions together (up to twelve sums in
// registers), one alone walks 64. w[j] (j the item's query head), inv_sum[j], rescale[j] (or none);
// out[j] the output of query head j.
template <typename T>
void values8(const Shape& sh, const T* vc, const int32_t* table, int64_t begin, int64_t full_len, int64_t h0,
             int64_t h1, const float* const* w, const float* inv_sum, const float* const* rescale, T* const* out) {
  const int64_t G = sh.group, D = sh.head_dim;
  for (int64_t h = h0; h < h1; ++h)
    for (int64_t j0 = (h - h0) * G; j0 < (h - h0 + 1) * G;) {
      const int64_t heads = std::min<int64_t>(3, (h - h0 + 1) * G - j0), width = heads == 1 ? 64 : 32;
      const float* const* rj = rescale != nullptr ? rescale + j0 : nullptr;
      for (int64_t d0 = 0; d0 < D; d0 += width) {
        T* o[3];
        for (int64_t g = 0; g < heads; ++g) o[g] = out[j0 + g] + d0;
        const int64_t slices = std::min(width, D - d0) / 8;
        const bool ahead = j0 == (h - h0) * G;
        switch (heads) {
          case 1: value_sums8_upto<1, 8>(slices, sh, vc, table, begin, full_len, h, d0, w + j0, inv_sum + j0, rj, ahead, o); break;
          case 2: value_sums8_upto<2, 4>(slices, sh, vc, table, begin, full_len, h, d0, w + j0, inv_sum + j0, rj, ahead, o); break;
          default: value_sums8_upto<3, 4>(slices, sh, vc, table, begin, full_len, h, d0, w + j0, inv_sum + j0, rj, ahead, o); break;
        }
      }
      j0 += heads;
    }
}

// <q_i, k> for C <= 4 query heads q[0 .. C) at once, as dot() computes each (dimension blocks of 8
// alternating between two sums, added, then hsum8's tree), so the same bits: each of k's blocks is loaded
// (and widened) once for the C heads, their FMA chains are in flight together and their horizontal sums
// share the shuffles. Returns the C dots in order (the lanes past C hold copies).
template <int C, typename T>
inline __m128 dots4(const float* const* q, const T* k, int64_t D) {
  __m256 a[4], b[4];
  for (int c = 0; c < C; ++c) a[c] = b[c] = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    const __m256 ka = pagedserve::load8(k + d), kb = pagedserve::load8(k + d + 8);
    for (int c = 0; c < C; ++c) a[c] = _mm256_fmadd_ps(_mm256_loadu_ps(q[c] + d), ka, a[c]);
    for (int c = 0; c < C; ++c) b[c] = _mm256_fmadd_ps(_mm256_loadu_ps(q[c] + d + 8), kb, b[c]);
  }
  if (d < D) {
    const __m256 ka = pagedserve::load8(k + d);
    for (int c = 0; c < C; ++c) a[c] = _mm256_fmadd_ps(_mm256_loadu_ps(q[c] + d), ka, a[c]);
  }
  __m256 v[4];
  for (int c = 0; c < 4; ++c) v[c] = c < C ? _mm256_add_ps(a[c], b[c]) : v[0];
  // hsum8: the low half plus the high half; lanes 0 + 2 and 1 + 3; then those two
  const __m256 u01 = _mm256_add_ps(_mm256_permute2f128_ps(v[0], v[1], 0x20), _mm256_permute2f128_ps(v[0], v[1], 0x31));
  const __m256 u23 = _mm256_add_ps(_mm256_permute2f128_ps(v[2], v[3], 0x20), _mm256_permute2f128_ps(v[2], v[3], 0x31));
  const __m256 t = _mm256_add_ps(_mm256_shuffle_ps(u01, u23, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(u01, u23, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(t, t, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(t, t, _MM_SHUFFLE(3, 1, 3, 1)));
  // r = dots 0, 2, 0, 2 | 1, 3, 1, 3
  return _mm_unpacklo_ps(_mm256_castps256_ps128(r), _mm256_extractf128_ps(r, 1));
}

// scores[j * len + p] = scale * <q_j, k_p> (without the scale where `scaled` is false) for the item's query
// heads j over its context, up to four heads of a KV head at a time (dots4). The walk goes position by
// position, all of the item's heads of a row together, so that the row is read front to back: taking four
// positions of one head at a time (four rows' dots sharing the shuffles) was faster with K in cache but up
// to 1.3x slower from memory. It asks for the next block's rows of the item's heads as it goes (ask_row).
template <typename T>
void key_scores8(const Shape& sh, const T* kc, const int32_t* table, int64_t begin, int64_t full_len, int64_t h0,
                 int64_t h1, const float* const* qj, bool scaled, float* scores, int64_t len) {
  const int64_t bs = sh.block_size, stride = sh.slot_stride, D = sh.head_dim, G = sh.group;
  const int64_t offset = h0 * D, values = (h1 - h0) * D;
  const __m128 scale4 = _mm_set1_ps(sh.scale);
  for (int64_t p0 = begin / bs * bs; p0 < full_len; p0 += bs) {
    const BlockSpan<T> span = block_span(kc, table, p0, begin, full_len, bs, stride, offset);
    for (int64_t i = 0; i < span.n; ++i) {
      ask_row(span, i, stride, values);
      if (i < span.first) continue;
      const int64_t p = p0 + i - begin;
      for (int64_t h = h0; h < h1; ++h) {
        const T* k = span.rows + i * stride + h * D;
        // the query heads of KV head h, four at a time
        for (int64_t j = (h - h0) * G; j < (h - h0 + 1) * G; j += 4) {
          const int64_t c = std::min<int64_t>(4, (h - h0 + 1) * G - j);
          const __m128 dots = c == 4 ? dots4<4>(qj + j, k, D) : c == 3 ? dots4<3>(qj + j, k, D)
                            : c == 2 ? dots4<2>(qj + j, k, D) : dots4<1>(qj + j, k, D);
          alignas(16) float out[4];
          _mm_store_ps(out, scaled ? _mm_mul_ps(scale4, dots) : dots);
          for (int64_t g = 0; g < c; ++g) scores[(j + g) * len + p] = out[g];
        }
      }
    }
  }
}
#endif

// One item: token row `tok`, KV heads [h0, h1). `scores` and `acc` are the calling thread's
// scratch buffers. A position's K (or V) row holds every KV head side by side, so walking the
// heads of a position together reads the block front to back.
template <bool kVector, typename T>
void decode_one(const Shape& sh, const T* q, const T* kc, const T* vc, T* o,
                const int32_t* table, int64_t full_len, int64_t end, int64_t tok, int64_t h0, int64_t h1,
                std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t bs = sh.block_size, D = sh.head_dim, G = sh.group;
  const bool sdpa = sdpa_order<T>(sh);   // (then begin is 0: no window, no chunk)
  const int64_t nq = (h1 - h0) * G;           // query heads of this item
  // the query sits at full_len - 1; with a window or a chunk it sees positions [begin, full_len) only
  const int64_t begin = first_visible(sh, full_len - 1);
  const int64_t len = full_len - begin;       // positions attended, indexed from `begin`
  scores.resize(nq * len);
  const T* qh = q + tok * sh.q_tok + h0 * G * sh.q_head;
  // the item's query heads as float32 (copied only for bfloat16), and a row buffer for K/V rows
  std::vector<float> qf(std::is_same<T, float>::value ? 0 : nq * D), row_f(D);
  std::vector<const float*> qj(nq);
  for (int64_t j = 0; j < nq; ++j) qj[j] = as_float(qh + j * sh.q_head, qf.data() + j * D, D);
  // scores[j * len + p] = scale * <q_j, k_p>, for the item's query heads j
#ifdef PAGEDSERVE_AVX2
  if (kVector) key_scores8(sh, kc, table, begin, full_len, h0, h1, qj.data(), !sdpa, scores.data(), len);
  else
#endif
  walk_context(kc, table, begin, full_len, bs, sh.slot_stride, [&](int64_t p, const T* row) {
    for (int64_t h = h0; h < h1; ++h) {
      const float* k = as_float(row + h * D, row_f.data(), D);
      for (int64_t j = (h - h0) * G; j < (h - h0 + 1) * G; ++j)
        scores[j * len + p] = sdpa ? dot_any<kVector>(qj[j], k, D) : sh.scale * dot_any<kVector>(qj[j], k, D);
    }
  }, h0 * D, (h1 - h0) * D);
  float inv_sum[64];
  const int64_t blocks = sdpa ? (len + kSdpaBlock - 1) / kSdpaBlock : 0;
  std::vector<float> rescale(nq * blocks);
  for (int64_t j = 0; j < nq; ++j)
    inv_sum[j] = sdpa ? sdpa_weights(scores.data() + j * len, len, end, sh.scale, sh.lanes, rescale.data() + j * blocks)
                      : finish_scores(sh, scores.data() + j * len, len, h0 * G + j, exp_shifted_sum_any<kVector>);
#ifdef PAGEDSERVE_AVX2
  if (kVector) {
    const float* wj[64];
    const float* rj[64];
    T* oj[64];
    for (int64_t j = 0; j < nq; ++j) {
      wj[j] = scores.data() + j * len;
      rj[j] = rescale.data() + j * blocks;
      oj[j] = o + tok * sh.o_tok + (h0 * G + j) * sh.o_head;
    }
    values8(sh, vc, table, begin, full_len, h0, h1, wj, inv_sum, sdpa ? rj : nullptr, oj);
    return;
  }
#endif
  acc.assign(nq * D, 0.f);   // (the value sums in memory: the path above keeps them in registers)
  walk_context(vc, table, begin, full_len, bs, sh.slot_stride, [&](int64_t p, const T* row) {
    if (sdpa && p > 0 && p % kSdpaBlock == 0)
      for (int64_t j = 0; j < nq; ++j)
        for (int64_t d = 0; d < D; ++d) acc[j * D + d] *= rescale[j * blocks + p / kSdpaBlock];
    for (int64_t h = h0; h < h1; ++h) {
      const float* v = as_float(row + h * D, row_f.data(), D);
      for (int64_t j = (h - h0) * G; j < (h - h0 + 1) * G; ++j)
        axpy_any<kVector>(scores[j * len + p], v, acc.data() + j * D, D);
    }
  });
  for (int64_t j = 0; j < nq; ++j) {
    T* oj = o + tok * sh.o_tok + (h0 * G + j) * sh.o_head;
    const float* aj = acc.data() + j * D;
    for (int64_t d = 0; d < D; ++d) oj[d] = pagedserve::from_float<T>(aj[d] * inv_sum[j]);
  }
}

#ifdef PAGEDSERVE_AVX512
// in place: s[p] = exp(s[p] - m) over n floats; returns the sum
inline float exp_shifted_sum16(float* s, int64_t n, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 total = _mm512_setzero_ps();
  int64_t p = 0;
  for (; p + 16 <= n; p += 16) {
    const __m512 e = pagedserve::exp16(_mm512_sub_ps(_mm512_loadu_ps(s + p), mv));
    _mm512_storeu_ps(s + p, e);
    total = _mm512_add_ps(total, e);
  }
  if (p < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - p)) - 1u);
    const __m512 e = _mm512_maskz_mov_ps(tail, pagedserve::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + p), mv)));
    _mm512_mask_storeu_ps(s + p, tail, e);
    total = _mm512_add_ps(total, e);
  }
  return _mm512_reduce_add_ps(total);
}

// --- the two products in MKL's order -----------------------------------------------------------------
// torch's flash attention takes q.k and the weighted values from MKL's cblas_gemm_bf16bf16f32, whose
// float32 sums add in an order of their own that depends on the product's shape. Where a start-up check
// (ops/sdpa_order.py) finds that this order gives torch's bits, the kernel follows it. Read from MKL on
// an AMD Zen 4 (its AVX2 path) term by term, for torch's calls: q.k of a call of n query rows over a
// block of m keys, per key: for n = 1 (a decode row) four chains over the dimensions mod 4, added as
// (0 + 2) + (1 + 3) ("chains of four"); for n of 2 or 3, or m under 12, the same for all but the last
// m mod 4 keys, which take eight chains, added as ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)); otherwise
// one sequential sum over the dimensions. The weighted values, per output: for n = 1, the keys in groups
// of four, each group added as (0 + 2) + (1 + 3) and then to the running sum, the last m mod 4 keys
// one by one from the last; otherwise one sequential sum over the keys (masked keys add zeros). The
// products of two bfloat16 values are exact in float32, so an FMA adds exactly what MKL adds.
constexpr int64_t kMklSeqRows = 4, kMklSeqKeys = 12;
// On a CPU with AMX tiles MKL takes other orders, read term by term from its cblas_gemm_bf16bf16f32 on an Intel
// Xeon with AMX ("the tile order"). A call of two or more query rows: the sum over k (q.k's dimensions, or the
// weighted values' keys) goes in groups of 32 from the first; in each group the even and the odd terms are two
// sequential sums, added together, and that to the running sum. A decode row (one query row): q.k in 16 lanes,
// lane i adding dimensions 2i + 1 and then 2i of each group of 32 in turn; lane i + 8 added to lane i, and the
// eight lanes then pairwise ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)); the weighted values per group of 8
// keys, from zero, keys 2j + 1 and then 2j, each group's sum added to the running sum. Chosen once per process
// by the start-up check (set_sdpa_tile_order), as MKL's own choice is per CPU.
constexpr int64_t kTileGroup = 32;
static_assert(kSdpaBlock % kTileGroup == 0, "a block of torch's keys holds whole groups");

// Where bfloat16 can pack (AMX tiles), torch's flash attention takes a call's products from oneDNN's brgemm on
// weights packed once instead of MKL's GEMM, when the call has 64 query rows and 64 keys or more and its products
// outweigh the packing (torch's own test, below, with transformers' KV heads as they are: enable_gqa). brgemm
// sums the weighted values' keys (the call's keys, rounded up to even) in groups of the largest even divisor of
// that count up to 32 (read from torch's cpublas::brgemm on an Intel Xeon with AMX: bench/mkl_order.py
// --brgemm), each group in the tile order; MKL's groups of 32 otherwise. (q.k sums a head's dimensions, in the
// same groups of 32 for head sizes that are multiples of 32, as SmolLM2's 64; other sizes are not followed.)
inline bool sdpa_packs(const Shape& sh, int64_t qsize, int64_t kvsize) {
  if (qsize < 64 || kvsize < 64) return false;
  const int64_t split = qsize >= 768 ? 256 : qsize >= 192 ? 64 : 32;   // torch's query rows per item
  const int64_t slices = (qsize + split - 1) / split;
  const int64_t per_thread = (sh.kv_heads * sh.group * slices + sh.threads - 1) / sh.threads;
  const double products = static_cast<double>(per_thread) * split * std::min(qsize, kvsize) * sh.head_dim;
  return products / (static_cast<double>(sh.kv_heads) * kvsize * sh.head_dim) >= 4.0;
}

// brgemm's group of keys for a block of `keys` keys (above)
inline int64_t brgemm_group(int64_t keys) {
  const int64_t even = keys + keys % 2;
  int64_t g = kTileGroup;
  while (even % g != 0) g -= 2;
  return g;
}

// dimensions d of q.k summed in `chains` chains over d mod chains, the chains then added pairwise as
// MKL does (chains 4: (0 + 2) + (1 + 3); 8: ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7))); 1: sequential
template <typename T>
inline float dot_chains(const float* q, const T* k, int64_t D, int chains) {
  float c[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int64_t d = 0; d < D; ++d) c[d % chains] = std::fma(q[d], pagedserve::to_float(k[d]), c[d % chains]);
  if (chains == 1) return c[0];
  if (chains == 4) return (c[0] + c[2]) + (c[1] + c[3]);
  return ((c[0] + c[4]) + (c[2] + c[6])) + ((c[1] + c[5]) + (c[3] + c[7]));
}

// q.k summed in MKL's tile order (above)
template <typename T>
inline float dot_tiles(const float* q, const T* k, int64_t D) {
  float total = 0.f;
  for (int64_t g = 0; g < D; g += kTileGroup) {
    float even = 0.f, odd = 0.f;
    for (int64_t d = g; d < std::min(D, g + kTileGroup); d += 2) {
      even = std::fma(q[d], pagedserve::to_float(k[d]), even);
      if (d + 1 < D) odd = std::fma(q[d + 1], pagedserve::to_float(k[d + 1]), odd);
    }
    total += even + odd;
  }
  return total;
}

// the row of position p of head h in `cache`
template <typename T>
inline const T* position_row(const Shape& sh, const T* cache, const int32_t* table, int64_t p, int64_t h) {
  // (a shift and a mask where the block size is a power of two: a division per key costs as much as its reads)
  const int64_t block = sh.block_shift >= 0 ? p >> sh.block_shift : p / sh.block_size;
  const int64_t slot = sh.block_shift >= 0 ? p & (sh.block_size - 1) : p % sh.block_size;
  return cache + (static_cast<int64_t>(table[block]) * sh.block_size + slot) * sh.slot_stride + h * sh.head_dim;
}

#ifdef PAGEDSERVE_AVX512
// quarter u of query vector v of each head, broadcast to four slots (see chains4_group)
template <int NV, int C>
struct QuarterQueries {
  __m512 q[C][NV][4];
  explicit QuarterQueries(const __m512 (&qv)[C][NV]) {
    for (int c = 0; c < C; ++c)
      for (int v = 0; v < NV; ++v) {
        q[c][v][0] = _mm512_shuffle_f32x4(qv[c][v], qv[c][v], 0x00);
        q[c][v][1] = _mm512_shuffle_f32x4(qv[c][v], qv[c][v], 0x55);
        q[c][v][2] = _mm512_shuffle_f32x4(qv[c][v], qv[c][v], 0xAA);
        q[c][v][3] = _mm512_shuffle_f32x4(qv[c][v], qv[c][v], 0xFF);
      }
  }
};

// out[c * stride + i] = <q_c, k_i> for the first n (1..4) of four key rows, in MKL's chains of four: the rows'
// 128-bit quarters transposed, so that quarter u of vector v of every key sits in that key's slot of one
// register, each of the slot's four lanes carrying one chain (d mod 4) of the key
template <int NV, int C, typename T>
inline void chains4_group(const QuarterQueries<NV, C>& qb, const T* const (&rows)[4], int64_t n, float* out,
                          int64_t stride) {
  const __m512i firsts = _mm512_set_epi32(15, 14, 13, 11, 10, 9, 7, 6, 5, 3, 2, 1, 12, 8, 4, 0);
  __m512 x[NV][4];
  for (int v = 0; v < NV; ++v) {
    const __m512 a = pagedserve::load16(rows[0] + 16 * v), b = pagedserve::load16(rows[1] + 16 * v);
    const __m512 c = pagedserve::load16(rows[2] + 16 * v), d = pagedserve::load16(rows[3] + 16 * v);
    const __m512 ab_lo = _mm512_shuffle_f32x4(a, b, 0x44), ab_hi = _mm512_shuffle_f32x4(a, b, 0xEE);
    const __m512 cd_lo = _mm512_shuffle_f32x4(c, d, 0x44), cd_hi = _mm512_shuffle_f32x4(c, d, 0xEE);
    x[v][0] = _mm512_shuffle_f32x4(ab_lo, cd_lo, 0x88);
    x[v][1] = _mm512_shuffle_f32x4(ab_lo, cd_lo, 0xDD);
    x[v][2] = _mm512_shuffle_f32x4(ab_hi, cd_hi, 0x88);
    x[v][3] = _mm512_shuffle_f32x4(ab_hi, cd_hi, 0xDD);
  }
  for (int c = 0; c < C; ++c) {
    __m512 acc = _mm512_mul_ps(qb.q[c][0][0], x[0][0]);
    for (int v = 0; v < NV; ++v)
      for (int u = (v == 0 ? 1 : 0); u < 4; ++u) acc = _mm512_fmadd_ps(qb.q[c][v][u], x[v][u], acc);
    const __m512 pairs = _mm512_add_ps(acc, _mm512_permute_ps(acc, 0x4E));      // (0 + 2), (1 + 3)
    const __m512 sums = _mm512_add_ps(pairs, _mm512_permute_ps(pairs, 0xB1));   // their sum in lane 0
    alignas(16) float four[4];
    _mm_store_ps(four, _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, sums)));
    for (int64_t i = 0; i < n; ++i) out[c * stride + i] = four[i];
  }
}

// chains of four for keys [p0, p1) (prompt rows: short contexts, just written)
template <int NV, int C, typename T>
void chains4_scores(const Shape& sh, const QuarterQueries<NV, C>& qb, const T* kc, const int32_t* table, int64_t h,
                    int64_t p0, int64_t p1, int64_t len, float* scores) {
  for (int64_t p = p0; p < p1; p += 4) {
    const int64_t n = std::min<int64_t>(4, p1 - p);
    const T* rows[4];
    for (int64_t i = 0; i < 4; ++i) rows[i] = position_row(sh, kc, table, p + std::min(i, n - 1), h);
    chains4_group<NV, C, T>(qb, rows, n, scores + p, len);
  }
}

// the 16 x 16 matrix of 32-bit words r[row][column] transposed in place: r[column][row]
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {   // within each 128-bit lane: rows 2k, 2k + 1 interleaved
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 4; ++g) {       // u[4g + c], lane L: column 4L + c of rows 4g .. 4g + 3
    r[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    r[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    r[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    r[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {       // the 128-bit lanes of u[c], u[4 + c], u[8 + c], u[12 + c] transposed
    const __m512i ab_lo = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), ab_hi = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i cd_lo = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
    const __m512i cd_hi = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    t[c] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0xDD);
    t[8 + c] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0xDD);
  }
  for (int j = 0; j < 16; ++j) r[j] = t[j];
}

// scores[c * len + p] = <q_c, k_p> summed over the dimensions in order, for bfloat16 keys of [p0, p1): sixteen
// keys at a time, one per lane, their rows' 32-bit words (pairs of dimensions) transposed 16 at a time.
// Returns where it stopped (p0 for float32 keys or an odd NV: the rest is the caller's).
template <int NV, int C, typename T>
int64_t seq_scores_bf16(const Shape& sh, const float (&qf)[C][16 * NV], const T* kc, const int32_t* table,
                        int64_t h, int64_t p0, int64_t p1, int64_t len, float* scores, bool tiles) {
  if constexpr (!std::is_same<T, pagedserve::bf16>::value || NV % 2 != 0) {
    return p0;
  } else {
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int64_t p = p0; p < p1; p += 16) {
      const int64_t n = std::min<int64_t>(16, p1 - p);
      const T* rows[16];
      for (int64_t i = 0; i < 16; ++i) rows[i] = position_row(sh, kc, table, p + std::min(i, n - 1), h);
      __m512 acc[C], odds[C];
      for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
      for (int half = 0; half < NV / 2; ++half) {   // 32 dimensions: 16 words of every row
        __m512i words[16];
        for (int i = 0; i < 16; ++i) words[i] = _mm512_loadu_si512(rows[i] + 32 * half);
        transpose16(words);
        // the tile order: the group's even and odd dimensions in sums of their own (`evens` in acc's place)
        __m512 evens[C];
        for (int c = 0; c < C; ++c) evens[c] = odds[c] = _mm512_setzero_ps();
        __m512 (&even_sum)[C] = tiles ? evens : acc;
        __m512 (&odd_sum)[C] = tiles ? odds : acc;
        for (int j = 0; j < 16; ++j) {
          const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(words[j], 16));
          const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(words[j], high));
          for (int c = 0; c < C; ++c) {
            even_sum[c] = _mm512_fmadd_ps(_mm512_set1_ps(qf[c][32 * half + 2 * j]), even, even_sum[c]);
            odd_sum[c] = _mm512_fmadd_ps(_mm512_set1_ps(qf[c][32 * half + 2 * j + 1]), odd, odd_sum[c]);
          }
        }
        if (tiles)
          for (int c = 0; c < C; ++c) acc[c] = _mm512_add_ps(acc[c], _mm512_add_ps(evens[c], odds[c]));
      }
      const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1u);
      for (int c = 0; c < C; ++c) _mm512_mask_storeu_ps(scores + c * len + p, keep, acc[c]);
    }
    return p1;
  }
}

// scores[c * len + p] = <q_c, k_p> for p in [0, len) as MKL's tile order adds a decode row's (above), for
// bfloat16 keys and an even NV; false (nothing done) otherwise. Sixteen keys at a time: each key's 16 lanes,
// then the keys' lanes transposed so that the lane sums run across 16 keys at once.
template <int NV, int C, typename T>
bool pair_lane_scores(const Shape& sh, const __m512 (&qv)[C][NV], const T* kc, const int32_t* table, int64_t h,
                      int64_t len, float* scores) {
  if constexpr (!std::is_same<T, pagedserve::bf16>::value || NV % 2 != 0) {
    return false;
  } else {
    const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    __m512 q_even[C][NV / 2], q_odd[C][NV / 2];   // lane i: dimension 32 g + 2i (+ 1)
    for (int c = 0; c < C; ++c)
      for (int g = 0; g < NV / 2; ++g) {
        q_even[c][g] = _mm512_permutex2var_ps(qv[c][2 * g], evens, qv[c][2 * g + 1]);
        q_odd[c][g] = _mm512_permutex2var_ps(qv[c][2 * g], odds, qv[c][2 * g + 1]);
      }
    for (int64_t p = 0; p < len; p += 16) {
      const int64_t n = std::min<int64_t>(16, len - p);
      const T* rows[16];
      for (int64_t i = 0; i < 16; ++i) rows[i] = position_row(sh, kc, table, p + std::min(i, n - 1), h);
      for (int c = 0; c < C; ++c) {
        __m512i lanes[16];
        for (int i = 0; i < 16; ++i) {
          __m512 acc = _mm512_setzero_ps();
          for (int g = 0; g < NV / 2; ++g) {
            const __m512i words = _mm512_loadu_si512(rows[i] + 32 * g);
            acc = _mm512_fmadd_ps(q_odd[c][g], _mm512_castsi512_ps(_mm512_and_si512(words, high)), acc);
            acc = _mm512_fmadd_ps(q_even[c][g], _mm512_castsi512_ps(_mm512_slli_epi32(words, 16)), acc);
          }
          lanes[i] = _mm512_castps_si512(acc);
        }
        transpose16(lanes);   // lanes[j]: lane j of the 16 keys
        __m512 w[8];
        for (int j = 0; j < 8; ++j)
          w[j] = _mm512_add_ps(_mm512_castsi512_ps(lanes[j]), _mm512_castsi512_ps(lanes[j + 8]));
        const __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(w[0], w[1]), _mm512_add_ps(w[2], w[3])),
                                         _mm512_add_ps(_mm512_add_ps(w[4], w[5]), _mm512_add_ps(w[6], w[7])));
        _mm512_mask_storeu_ps(scores + c * len + p, static_cast<__mmask16>((1u << n) - 1u), sum);
      }
    }
    return true;
  }
}

// The item's scores q.k (unscaled) in MKL's order for a row of a call of `qrows` query rows over `end`
// keys (blocks of kSdpaBlock, as torch splits them).
template <int NV, int C, typename T>
void mkl_scores(const Shape& sh, const __m512 (&qv)[C][NV], const T* kc, const int32_t* table, int64_t h,
                int64_t len, int64_t end, int64_t qrows, float* scores) {
  constexpr int64_t D = 16 * NV;
  float qf[C][D];
  for (int c = 0; c < C; ++c)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(qf[c] + 16 * v, qv[c][v]);
  for (int64_t b0 = 0; b0 < len; b0 += kSdpaBlock) {
    const int64_t m = std::min(kSdpaBlock, end - b0), stop = std::min(len, b0 + kSdpaBlock);
    const bool tiles = g_tile_order.load(std::memory_order_relaxed) && qrows >= 2;
    if (tiles || (qrows >= kMklSeqRows && m >= kMklSeqKeys)) {
      const int64_t vec_end = seq_scores_bf16<NV, C, T>(sh, qf, kc, table, h, b0, stop, len, scores, tiles);
      for (int64_t p = vec_end; p < stop; ++p) {
        const T* k = position_row(sh, kc, table, p, h);
        for (int c = 0; c < C; ++c) scores[c * len + p] = tiles ? dot_tiles(qf[c], k, D) : dot_chains(qf[c], k, D, 1);
      }
      continue;
    }
    const int64_t fours = qrows == 1 ? stop : std::min(stop, b0 + m - m % 4);
    chains4_scores<NV, C, T>(sh, QuarterQueries<NV, C>(qv), kc, table, h, b0, fours, len, scores);
    for (int64_t p = fours; p < stop; ++p) {
      const T* k = position_row(sh, kc, table, p, h);
      for (int c = 0; c < C; ++c) scores[c * len + p] = dot_chains(qf[c], k, D, 8);
    }
  }
}

// acc[c] += the weighted value rows of four keys at scores[c * stride + i] as MKL adds them for a decode row
// (a call of one query row): (0 + 2) + (1 + 3), then to the running sum
template <int NV, int C, typename T>
inline void values4_group(const T* const (&rows)[4], const float* w, int64_t stride, __m512 (&acc)[C][NV]) {
  for (int v = 0; v < NV; ++v) {
    const __m512 r0 = pagedserve::load16(rows[0] + 16 * v), r1 = pagedserve::load16(rows[1] + 16 * v);
    const __m512 r2 = pagedserve::load16(rows[2] + 16 * v), r3 = pagedserve::load16(rows[3] + 16 * v);
    for (int c = 0; c < C; ++c) {
      const float* wc = w + c * stride;
      const __m512 even = _mm512_fmadd_ps(_mm512_set1_ps(wc[2]), r2, _mm512_mul_ps(_mm512_set1_ps(wc[0]), r0));
      const __m512 odd = _mm512_fmadd_ps(_mm512_set1_ps(wc[3]), r3, _mm512_mul_ps(_mm512_set1_ps(wc[1]), r1));
      acc[c][v] = _mm512_add_ps(acc[c][v], _mm512_add_ps(even, odd));
    }
  }
}
#endif

// One item of up to C query heads that share a KV head, head_dim = 16 NV: the queries and the
// output accumulators stay in registers while the item walks the context. Per position: the key
// row is loaded once for the C heads (NV loads, C * NV FMAs, C lane sums), the value row once
// (NV loads, C * NV FMAs).
template <int NV, int C, typename T>
void decode_heads16(const Shape& sh, const T* q, const T* kc, const T* vc, T* o,
                    const int32_t* table, int64_t begin, int64_t full_len, int64_t end, int64_t qrows, int64_t tok,
                    int64_t h, int64_t j0, float* scores, float* rescale, Then<T> then) {
  const int64_t len = full_len - begin;
  const bool sdpa = sdpa_order<T>(sh);   // (then begin is 0)
  // the values' first block, asked for at the keys' last
  const Then<T> values = walk_start(vc, table, begin, full_len, sh.block_size, sh.slot_stride, h * sh.head_dim);
  // the scale goes into the query, or after the dot products in torch's SDPA order
  const __m512 qscale = _mm512_set1_ps(sdpa ? 1.f : sh.scale);
  __m512 qv[C][NV];
  for (int c = 0; c < C; ++c) {
    const T* qh = q + tok * sh.q_tok + (h * sh.group + j0 + c) * sh.q_head;
    for (int v = 0; v < NV; ++v) qv[c][v] = _mm512_mul_ps(pagedserve::load16(qh + 16 * v), qscale);
  }
  // scores[c * len + p] = <scale * q_c, k_p>
  const bool mkl = sdpa && qrows > 0;
  const T* group[4];   // MKL's order for a decode row: keys four at a time, as the walk (and its prefetch) goes
  // a decode row in the tile order: its scores, and below its weighted values in groups of 8 keys
  const bool tile_row = mkl && qrows == 1 && g_tile_order.load(std::memory_order_relaxed) &&
                        pair_lane_scores<NV, C, T>(sh, qv, kc, table, h, len, scores);
  if (tile_row) {
    // (scored above)
  } else if (mkl && qrows == 1) {
    const QuarterQueries<NV, C> qb(qv);
    walk_context(kc, table, begin, full_len, sh.block_size, sh.slot_stride, [&](int64_t p, const T* row) {
      group[p % 4] = row + h * sh.head_dim;
      if (p % 4 == 3) chains4_group<NV, C, T>(qb, group, 4, scores + p - 3, len);
    }, h * sh.head_dim, sh.head_dim, values);
    if (len % 4 != 0) {
      for (int64_t i = len % 4; i < 4; ++i) group[i] = group[len % 4 - 1];
      chains4_group<NV, C, T>(qb, group, len % 4, scores + len - len % 4, len);
    }
  } else if (mkl) {
    mkl_scores<NV, C, T>(sh, qv, kc, table, h, len, end, qrows, scores);
  } else walk_context(kc, table, begin, full_len, sh.block_size, sh.slot_stride, [&](int64_t p, const T* row) {
    const T* k = row + h * sh.head_dim;
    __m512 kv[NV];
    for (int v = 0; v < NV; ++v) kv[v] = pagedserve::load16(k + 16 * v);
    for (int c = 0; c < C; ++c) {
      __m512 d = _mm512_mul_ps(qv[c][0], kv[0]);
      for (int v = 1; v < NV; ++v) d = _mm512_fmadd_ps(qv[c][v], kv[v], d);
      scores[c * len + p] = _mm512_reduce_add_ps(d);
    }
  }, h * sh.head_dim, sh.head_dim, values);
  float inv_sum[C];
  const int64_t blocks = (len + kSdpaBlock - 1) / kSdpaBlock;
  for (int c = 0; c < C; ++c)
    inv_sum[c] = sdpa ? sdpa_weights(scores + c * len, len, end, sh.scale, sh.lanes, rescale + c * blocks)
                      : finish_scores(sh, scores + c * len, len, h * sh.group + j0 + c, exp_shifted_sum16);
  __m512 acc[C][NV];
  for (int c = 0; c < C; ++c)
    for (int v = 0; v < NV; ++v) acc[c][v] = _mm512_setzero_ps();
  // acc[c] += w * v for one key, in order; with MKL's order for a decode row (one query row), per block of
  // kSdpaBlock keys groups of four, then the block's last keys one by one from its last (only the last
  // block has any)
  // sum[c] += w * v for key p (acc, or a group's sum in the tile order)
  const auto add_to = [&](__m512 (&sum)[C][NV], int64_t p, const T* val) {
    __m512 vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = pagedserve::load16(val + 16 * v);
    for (int c = 0; c < C; ++c) {
      const __m512 w = _mm512_set1_ps(scores[c * len + p]);
      for (int v = 0; v < NV; ++v) sum[c][v] = _mm512_fmadd_ps(w, vv[v], sum[c][v]);
    }
  };
  const auto add_one = [&](int64_t p, const T* val) { add_to(acc, p, val); };
  const bool fours = mkl && qrows == 1 && !tile_row;
  const int64_t tail_from = fours ? len - (len % kSdpaBlock) % 4 : len;
  const T* tail[4];
  // MKL's tile order (two or more query rows): per group of kTileGroup keys, the even and the odd keys' sums;
  // brgemm's groups in the call's last block of keys where torch packs (sdpa_packs: a prompt's call, as many
  // query rows as keys; qrows is the rows of torch's block of them)
  const bool tiles = mkl && qrows >= 2 && g_tile_order.load(std::memory_order_relaxed);
  const int64_t last_block = (end - 1) / kSdpaBlock;
  const int64_t last_group = tiles && sdpa_packs(sh, end, end) ? brgemm_group(end - last_block * kSdpaBlock)
                                                               : kTileGroup;
  __m512 group_sum[2][C][NV];
  int64_t next_at = 0;   // the next key's place in its group (the walk goes through the keys in order)
  walk_context(vc, table, begin, full_len, sh.block_size, sh.slot_stride, [&](int64_t p, const T* row) {
    if (sdpa && p > 0 && p % kSdpaBlock == 0)
      for (int c = 0; c < C; ++c) {
        const __m512 factor = _mm512_set1_ps(rescale[c * blocks + p / kSdpaBlock]);
        for (int v = 0; v < NV; ++v) acc[c][v] = _mm512_mul_ps(acc[c][v], factor);
      }
    const T* val = row + h * sh.head_dim;
    if (tile_row) {   // keys 2j + 1 then 2j, into a group sum of 8 keys (group_sum[0])
      if (p % 8 == 0)
        for (int c = 0; c < C; ++c)
          for (int v = 0; v < NV; ++v) group_sum[0][c][v] = _mm512_setzero_ps();
      if (p % 2 == 1) {
        add_to(group_sum[0], p, val);
        add_to(group_sum[0], p - 1, tail[0]);
      } else if (p + 1 == len) {
        add_to(group_sum[0], p, val);
      } else {
        tail[0] = val;
      }
      if (p % 8 == 7 || p + 1 == len)
        for (int c = 0; c < C; ++c)
          for (int v = 0; v < NV; ++v) acc[c][v] = _mm512_add_ps(acc[c][v], group_sum[0][c][v]);
    } else if (tiles) {
      // (groups start even: a group's even keys are the even p)
      int64_t at = p % kTileGroup, size = kTileGroup;
      if (last_group != kTileGroup) {
        size = p / kSdpaBlock == last_block ? last_group : kTileGroup;
        at = p % kSdpaBlock == 0 ? 0 : next_at;
        next_at = at + 1 == size ? 0 : at + 1;
      }
      if (at == 0)
        for (int c = 0; c < C; ++c)
          for (int v = 0; v < NV; ++v) group_sum[0][c][v] = group_sum[1][c][v] = _mm512_setzero_ps();
      add_to(group_sum[p % 2], p, val);
      // the group ends at its last key (a block of kSdpaBlock holds whole groups) or the row's last (later keys
      // add zeros)
      if (at == size - 1 || p + 1 == len)
        for (int c = 0; c < C; ++c)
          for (int v = 0; v < NV; ++v)
            acc[c][v] = _mm512_add_ps(acc[c][v], _mm512_add_ps(group_sum[0][c][v], group_sum[1][c][v]));
    } else if (!fours) {
      add_one(p, val);
    } else if (p >= tail_from) {
      tail[p - tail_from] = val;
    } else {
      group[p % 4] = val;
      if (p % 4 == 3) values4_group<NV, C, T>(group, scores + p - 3, len, acc);
    }
  }, h * sh.head_dim, sh.head_dim, then);
  for (int64_t p = len - 1; p >= tail_from; --p) add_one(p, tail[p - tail_from]);
  for (int c = 0; c < C; ++c) {
    T* oc = o + tok * sh.o_tok + (h * sh.group + j0 + c) * sh.o_head;
    const __m512 inv = _mm512_set1_ps(inv_sum[c]);
    for (int v = 0; v < NV; ++v) pagedserve::store16(oc + 16 * v, _mm512_mul_ps(acc[c][v], inv));
  }
}

template <int NV, typename T>
void decode_item16(const Shape& sh, const T* q, const T* kc, const T* vc, T* o,
                   const int32_t* table, int64_t full_len, int64_t end, int64_t qrows, int64_t tok, int64_t h0,
                   int64_t h1,
                   std::vector<float>& scores, Then<T> then) {
  constexpr int kChunk = NV <= 4 ? 4 : 2;   // query heads per pass: C * NV accumulators in registers
  const int64_t begin = first_visible(sh, full_len - 1);
  const int64_t len = full_len - begin, blocks = (len + kSdpaBlock - 1) / kSdpaBlock;
  // the scores of a pass, then (torch's SDPA order) each block's rescaling factors
  scores.resize(kChunk * (len + blocks));
  for (int64_t h = h0; h < h1; ++h)
    for (int64_t j = 0; j < sh.group;) {
      const int64_t c = std::min<int64_t>(kChunk, sh.group - j);
      float* sc = scores.data();
      float* sf = sc + kChunk * len;
      // the keys walked after this pass: this head's again (more query heads), the next head's, or the next item's
      const int64_t next_h = j + c < sh.group ? h : h + 1;
      const Then<T> after = next_h < h1
          ? walk_start(kc, table, begin, full_len, sh.block_size, sh.slot_stride, next_h * sh.head_dim) : then;
      switch (c) {
        case 1: decode_heads16<NV, 1, T>(sh, q, kc, vc, o, table, begin, full_len, end, qrows, tok, h, j, sc, sf, after); break;
        case 2: decode_heads16<NV, 2, T>(sh, q, kc, vc, o, table, begin, full_len, end, qrows, tok, h, j, sc, sf, after); break;
        case 3: decode_heads16<NV, 3, T>(sh, q, kc, vc, o, table, begin, full_len, end, qrows, tok, h, j, sc, sf, after); break;
        default: decode_heads16<NV, kChunk, T>(sh, q, kc, vc, o, table, begin, full_len, end, qrows, tok, h, j, sc, sf, after); break;
      }
      j += c;
    }
}

// the AVX-512 path for head_dim 16 NV (NV = 1..8); false: not handled here
template <typename T>
bool decode_avx512(const Shape& sh, const T* q, const T* kc, const T* vc, T* o,
                   const int32_t* table, int64_t full_len, int64_t end, int64_t qrows, int64_t tok, int64_t h0,
                   int64_t h1,
                   std::vector<float>& scores, Then<T> then) {
  switch (sh.head_dim) {
    case 32: decode_item16<2, T>(sh, q, kc, vc, o, table, full_len, end, qrows, tok, h0, h1, scores, then); return true;
    case 64: decode_item16<4, T>(sh, q, kc, vc, o, table, full_len, end, qrows, tok, h0, h1, scores, then); return true;
    case 80: decode_item16<5, T>(sh, q, kc, vc, o, table, full_len, end, qrows, tok, h0, h1, scores, then); return true;
    case 96: decode_item16<6, T>(sh, q, kc, vc, o, table, full_len, end, qrows, tok, h0, h1, scores, then); return true;
    case 128: decode_item16<8, T>(sh, q, kc, vc, o, table, full_len, end, qrows, tok, h0, h1, scores, then); return true;
    default: return false;
  }
}
#endif

// every row's items over torch's thread pool
template <typename T>
void run_rows(const Shape& sh, const T* q, const T* kc, const T* vc, T* o, const int32_t* tables,
              const int32_t* lens, const int64_t* toks, int64_t num_rows) {
  const bool vector = sh.head_dim % 8 == 0;
  // whole rows per item when there are enough rows to keep every thread busy; else one KV head
  const int64_t heads_per_item = num_rows >= 4 * at::get_num_threads() ? sh.kv_heads : 1;
  const int64_t items_per_row = sh.kv_heads / heads_per_item, items = num_rows * items_per_row;
  // each thread a contiguous range of items of about equal work, not of equal count: an item's work grows
  // with its row's context, and a step's rows come oldest first, with the longest contexts
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  std::vector<int64_t> bounds(parts + 1, items);
  bounds[0] = 0;
  {
    // an item's work in positions: its context, and a fixed part for the rest
    const auto work = [&](int64_t item) -> int64_t { return lens[item / items_per_row] + 16; };
    int64_t total = 0;
    for (int64_t item = 0; item < items; ++item) total += work(item);
    // an item goes to the part that holds its middle: part p's items are those whose middle lies in
    // [p, p + 1) of total / parts
    int64_t done = 0, part = 1;
    for (int64_t item = 0; item < items && part < parts; ++item) {
      const int64_t w = work(item);
      while (part < parts && (2 * done + w) * parts >= 2 * total * part) bounds[part++] = item;
      done += w;
    }
  }
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> scores, acc;
    for (int64_t item = bounds[p0]; item < bounds[p1]; ++item) {
      const int64_t r = item / items_per_row, h0 = (item % items_per_row) * heads_per_item;
      const int64_t tok = toks[r], len = lens[r], end = sh.ends != nullptr ? sh.ends[r] : len;
      const int32_t* table = tables + r * sh.max_blocks;
#ifdef PAGEDSERVE_AVX512
      // -1: a prompt's row alone in torch's block, whose products are a decode row's unless torch packs the call
      // (then the tile order's, as for two or more rows)
      const int64_t qrows = sh.qrows == nullptr ? 0
                            : sh.qrows[r] >= 0 ? sh.qrows[r]
                            : g_tile_order.load(std::memory_order_relaxed) && sdpa_packs(sh, end, end) ? 2 : 1;
      // the keys the thread's next item starts on
      Then<T> then;
      if (item + 1 < bounds[p1]) {
        const int64_t r2 = (item + 1) / items_per_row, len2 = lens[r2];
        then = walk_start(kc, tables + r2 * sh.max_blocks, first_visible(sh, len2 - 1), len2, sh.block_size,
                          sh.slot_stride, ((item + 1) % items_per_row) * heads_per_item * sh.head_dim);
      }
      if (decode_avx512(sh, q, kc, vc, o, table, len, end, qrows, tok, h0, h0 + heads_per_item, scores, then)) continue;
#endif
      if (vector) decode_one<true>(sh, q, kc, vc, o, table, len, end, tok, h0, h0 + heads_per_item, scores, acc);
      else decode_one<false>(sh, q, kc, vc, o, table, len, end, tok, h0, h0 + heads_per_item, scores, acc);
    }
  });
}

}  // namespace

void set_sdpa_tile_order(bool on) { g_tile_order.store(on); }
bool sdpa_tile_order() { return g_tile_order.load(); }

void paged_decode(at::Tensor out, at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
                  at::Tensor block_tables, at::Tensor seq_lens, at::Tensor tokens, double scale,
                  int64_t window, double softcap, c10::optional<at::Tensor> sinks,
                  c10::optional<at::Tensor> alibi, int64_t chunk, c10::optional<at::Tensor> ends,
                  int64_t lanes, c10::optional<at::Tensor> qrows) {
  const auto dtype = query.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && k_cache.scalar_type() == dtype &&
              v_cache.scalar_type() == dtype && out.scalar_type() == dtype,
              "paged_decode: float32 or bfloat16, the same for query, out and caches");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "paged_decode: caches must be contiguous and alike");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(), "block_tables: int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens: int32");
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.is_contiguous() && tokens.dim() == 1, "tokens: int64 [R]");
  TORCH_CHECK(seq_lens.size(0) == tokens.size(0) && block_tables.size(0) == tokens.size(0),
              "paged_decode: one block table and one length per row");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out: [tokens, heads, head_dim]");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(query.size(2) == k_cache.size(3) && query.size(1) % k_cache.size(2) == 0, "query/cache shapes");
  TORCH_CHECK(query.size(1) <= 64, "paged_decode: at most 64 query heads");
  TORCH_CHECK(window >= 0 && softcap >= 0 && chunk >= 0, "paged_decode: window, softcap and chunk must be >= 0 (0: none)");
  for (const auto* per_head : {&sinks, &alibi})
    if (per_head->has_value())
      TORCH_CHECK((*per_head)->scalar_type() == at::kFloat && (*per_head)->is_contiguous() &&
                  (*per_head)->dim() == 1 && (*per_head)->size(0) == query.size(1),
                  "paged_decode: sinks and ALiBi slopes are float32 [heads]");
  Shape sh;
  sh.block_size = k_cache.size(1);
  sh.kv_heads = k_cache.size(2);
  sh.head_dim = k_cache.size(3);
  sh.group = query.size(1) / sh.kv_heads;
  sh.max_blocks = block_tables.size(1);
  sh.slot_stride = sh.kv_heads * sh.head_dim;
  if ((sh.block_size & (sh.block_size - 1)) == 0)
    for (sh.block_shift = 0; (int64_t{1} << sh.block_shift) < sh.block_size; ++sh.block_shift) {}
  sh.q_tok = query.stride(0);
  sh.q_head = query.stride(1);
  sh.o_tok = out.stride(0);
  sh.o_head = out.stride(1);
  sh.scale = static_cast<float>(scale);
  sh.window = window;
  sh.softcap = static_cast<float>(softcap);
  sh.chunk = chunk;
  sh.threads = at::get_num_threads();
  if (sinks.has_value()) sh.sinks = sinks->data_ptr<float>();
  if (alibi.has_value()) sh.alibi = alibi->data_ptr<float>();
  TORCH_CHECK(lanes == 0 || lanes == 8 || lanes == 16, "paged_decode: lanes 0, 8 or 16");
  if (ends.has_value()) {
    TORCH_CHECK(ends->scalar_type() == at::kInt && ends->is_contiguous() && ends->dim() == 1 &&
                ends->size(0) == tokens.size(0), "paged_decode: ends is int32 [R]");
    sh.ends = ends->data_ptr<int32_t>();
    sh.lanes = lanes;
  }
  if (qrows.has_value()) {
    TORCH_CHECK(ends.has_value() && qrows->scalar_type() == at::kInt && qrows->is_contiguous() &&
                qrows->dim() == 1 && qrows->size(0) == tokens.size(0),
                "paged_decode: qrows is int32 [R], and needs ends");
    sh.qrows = qrows->data_ptr<int32_t>();
  }
  const int64_t num_rows = tokens.size(0), num_blocks = k_cache.size(0), num_tokens = query.size(0);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* toks = tokens.data_ptr<int64_t>();
  // validate every index before any thread reads through it
  for (int64_t r = 0; r < num_rows; ++r) {
    TORCH_CHECK(toks[r] >= 0 && toks[r] < num_tokens, "paged_decode: token row ", toks[r], " out of range");
    const int64_t len = lens[r];
    const int64_t used = (len + sh.block_size - 1) / sh.block_size;
    TORCH_CHECK(len >= 1 && used <= sh.max_blocks, "paged_decode: row ", r, " has bad length ", len);
    TORCH_CHECK(sh.ends == nullptr || sh.ends[r] >= len, "paged_decode: row ", r, " ends before its length");
    TORCH_CHECK(sh.qrows == nullptr || sh.qrows[r] >= -1, "paged_decode: row ", r, " has query rows below -1");
    for (int64_t b = 0; b < used; ++b) {
      const int32_t blk = tables[r * sh.max_blocks + b];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "paged_decode: block id ", blk, " out of range");
    }
  }
  if (dtype == at::kFloat)
    run_rows(sh, query.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), out.data_ptr<float>(),
             tables, lens, toks, num_rows);
  else
    run_rows(sh, reinterpret_cast<const bf16*>(query.data_ptr<at::BFloat16>()),
             reinterpret_cast<const bf16*>(k_cache.data_ptr<at::BFloat16>()),
             reinterpret_cast<const bf16*>(v_cache.data_ptr<at::BFloat16>()),
             reinterpret_cast<bf16*>(out.data_ptr<at::BFloat16>()), tables, lens, toks, num_rows);
}
