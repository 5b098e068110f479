// What the CPU kernels share: whether this build has AVX2+FMA (and AVX-512), a horizontal sum,
// e^x in eight and in sixteen lanes, and bfloat16 <-> float32 conversions.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

#include <unistd.h>

namespace pagedserve {

// e^x for x in [kExpLow, kExpHigh] (clamped to it outside: 0 below, e^kExpHigh above): x = n ln2 + r,
// |r| <= ln2/2, e^r by a degree-6 polynomial (Taylor coefficients, highest first; relative error
// ~2e-7), 2^n put into the exponent bits. ln2 is split in a part exact in float and a correction, so
// that r keeps its low bits. Used by the attention's softmax, SiLU and the sampler's log-sum-exp.
constexpr float kExpLow = -87.3f, kExpHigh = 88.0f;
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};

// bfloat16 is held as its 16 bits (the high half of a float32). Rounding to it is to nearest, ties to
// even, and a NaN stays a quiet NaN, as torch's conversion does, so a kernel's bfloat16 output is
// the one torch would write for the same float32 value.
using bf16 = uint16_t;

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

template <typename T> inline T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
template <> inline bf16 from_float<bf16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if (x != x) return 0x7FC0;
  return static_cast<bf16>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// x rounded to T and widened back: what a torch operation writing T hands to the next one
template <typename T> inline float rounded(float x) { return to_float(from_float<T>(x)); }

// Every cache line of [p, p + bytes) asked for, into all levels: a walk's row some rows ahead of its use. A
// prefetch never faults: asking past the end of a tensor is harmless.
inline void ask_lines(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b, 0, 3);
}

// Cache lines asked for into L2 ahead of their use, a few at each of a loop's `steps` steps: a panel's tiles
// ask for the thread's next panel while they run over this one from L2, so that the memory keeps reading
// (the hardware's streamer fetches only a little ahead of a tile) and the next panel's first tile does not
// wait on it. A prefetch never faults: asking past the end of a tensor is harmless.
class Ahead {
 public:
  Ahead() = default;
  // tile `t` of `tiles` over a panel asks for its share of the `bytes` at `next`, in order, over `steps` steps
  Ahead(const void* next, int64_t bytes, int64_t t, int64_t tiles, int64_t steps)
      : line_(static_cast<const char*>(next) + bytes / 64 * t / tiles * 64),
        lines_(bytes / 64 * (t + 1) / tiles - bytes / 64 * t / tiles), steps_(steps) {}
  inline void step() {
    for (owed_ += lines_; owed_ >= steps_; owed_ -= steps_, line_ += 64) __builtin_prefetch(line_, 0, 2);
  }

 private:
  const char* line_ = nullptr;
  int64_t lines_ = 0, steps_ = 1;
  int64_t owed_ = 0;   // lines x steps taken, less steps x lines asked for
};

// The rows of tile t when `rows` are split into `tiles` tiles of near-equal size (the first ones a row more)
inline int64_t tile_share(int64_t rows, int64_t tiles, int64_t t) { return rows / tiles + (t < rows % tiles ? 1 : 0); }

// The bytes of the thread's next panel that a panel's `tiles` tiles ask for ahead: all of them where there
// are several tiles but few enough that the memory's reads bound them rather than their arithmetic (with
// more, the hardware's streamer keeps up), and two panels fit in L2 (else the next one evicts this one,
// which the later tiles read again); else none.
constexpr int64_t kAheadTiles = 4;
inline int64_t ahead_bytes(int64_t panel_bytes, int64_t tiles) {
  static const int64_t l2 = [] {
    const long size = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return size > 0 ? static_cast<int64_t>(size) : int64_t{1} << 20;
  }();
  return tiles > 1 && tiles <= kAheadTiles && 2 * panel_bytes <= l2 ? panel_bytes : 0;
}

// How oneDNN's bfloat16 GEMM sums an output over K on AVX512-BF16 without AMX (its brgemm matmul,
// the route of torch's `F.linear` in bfloat16; v3.12's blocking for a row-major x): K in chunks of
// this many inputs, each chunk's float32 sum from zero over the input pairs front to back as
// VDPBF16PS takes them, the chunks' sums added front to back in float32, one rounding at the end.
// The chunks are of 512 inputs for a call of one row, whatever K; of two rows or more, of 1024 past
// 1024 inputs. It does not depend on the threads. The bfloat16 kernels sum in this order so that
// their outputs are `F.linear`'s bit for bit, each row as in the call that transformers makes for it
// (a generated token's alone: `one_row` says which rows those are).
inline int64_t onednn_bf16_chunk(int64_t K, bool one_row = false) { return K > 1024 && !one_row ? 1024 : 512; }
constexpr int64_t kOneRowChunk = 512;   // every chunk boundary of either kind lies on a multiple of this

// Whether row r's running chunk ends before input pair j (a multiple of kOneRowChunk / 2): always at a
// boundary of the many-row chunks, and at every one for a row of a one-row call.
inline bool chunk_ends(int64_t j, int64_t K, const bool* one_row, int64_t r) {
  return j % (onednn_bf16_chunk(K) / 2) == 0 || (one_row != nullptr && one_row[r]);
}

}  // namespace pagedserve

#if defined(__AVX512F__)
#define PAGEDSERVE_AVX512 1
#include <immintrin.h>

namespace pagedserve {

inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(kExpLow);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(kExpHigh));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~underflow), p, _mm512_castsi512_ps(bits));
}

// sixteen values of a float32 or bfloat16 row as float32, and back (rounded as from_float does)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
// sixteen values rounded to T and widened back, as `rounded` does one
template <typename T> inline __m512 rounded16(__m512 v);
template <> inline __m512 rounded16<float>(__m512 v) { return v; }
template <> inline __m512 rounded16<bf16>(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  return _mm512_mask_mov_ps(_mm512_castsi512_ps(r), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), v);
}
inline void store16(bf16* p, __m512 v) {
#if defined(__AVX512BF16__)
  const __m256bh packed = _mm512_cvtneps_pbh(v);
  std::memcpy(p, &packed, 32);
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
#endif
}

}  // namespace pagedserve
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDSERVE_AVX2 1

namespace pagedserve {

// the sum of the eight lanes of v
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp16's arithmetic in eight lanes
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(kExpLow);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(kExpHigh));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

// The eight running sums of one output of a bfloat16 dot product in the order of torch's own GEMM
// (bf16_dots_linear.cpp: sum v of every 64-block's inputs 8v .. 8v + 7), halved as torch halves them, then the
// lanes: the output before its rounding to bfloat16. Its kernels and the greedy head's exact logits both fold so.
inline float torch_dots_fold(const __m256* s) {
  __m256 a[4];
  for (int v = 0; v < 4; ++v) a[v] = _mm256_add_ps(s[v], s[v + 4]);
  a[0] = _mm256_add_ps(a[0], a[2]);
  a[1] = _mm256_add_ps(a[1], a[3]);
  __m256 t = _mm256_add_ps(a[0], a[1]);
  t = _mm256_add_ps(t, _mm256_permute2f128_ps(t, t, 0x1));   // lane l + l+4
  t = _mm256_add_ps(t, _mm256_shuffle_ps(t, t, 0x4E));       // + l+2
  t = _mm256_add_ps(t, _mm256_shuffle_ps(t, t, 0xB1));       // + l+1
  return _mm256_cvtss_f32(t);
}

// load16, rounded16 and store16 in eight lanes
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
// v rounded to bfloat16 (nearest, ties to even) in the high half of each lane; a NaN is the caller's
inline __m256 round_bf16_finite8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
template <typename T> inline __m256 rounded8(__m256 v);
template <> inline __m256 rounded8<float>(__m256 v) { return v; }
template <> inline __m256 rounded8<bf16>(__m256 v) {
  return _mm256_blendv_ps(round_bf16_finite8(v), v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(bf16* p, __m256 v) {
  // a NaN becomes the quiet NaN 0x7FC0, as from_float writes it
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  const __m256i r = _mm256_castps_si256(_mm256_blendv_ps(round_bf16_finite8(v), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan));
  const __m256i high = _mm256_srli_epi32(r, 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

}  // namespace pagedserve
#endif

namespace pagedserve {

// The largest of n float32 or bfloat16 values (as float32), and whether any is NaN (the largest is then
// meaningless): the first pass of the greedy log-sum-exp and of the sampler over a row of logits
template <typename T>
inline float row_max(const T* x, int64_t n, bool& nan) {
  float m = -std::numeric_limits<float>::infinity();
  nan = false;
  int64_t i = 0;
#if defined(PAGEDSERVE_AVX512)
  __m512 mx = _mm512_set1_ps(m);
  __mmask16 unordered = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load16(x + i);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mx = _mm512_max_ps(mx, v);
  }
  m = _mm512_reduce_max_ps(mx);
  nan = unordered != 0;
#elif defined(PAGEDSERVE_AVX2)
  __m256 mx = _mm256_set1_ps(m), unordered = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8(x + i);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mx = _mm256_max_ps(mx, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  for (const float v : lanes) m = v > m ? v : m;
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; i < n; ++i) {
    const float xi = to_float(x[i]);
    nan |= xi != xi;
    m = xi > m ? xi : m;
  }
  return m;
}

}  // namespace pagedserve
