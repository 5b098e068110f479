// y[M, N] = x[M, K] . W[N, K]^T where W's float32 values are those of small integer codes with a
// float16 scale (and minimum) per 32 inputs, the two GGUF formats the default model's file uses:
//   Q4_1: W[n, k] = scale * code + min, code in 0..15, rounded after the product and after the sum;
//   Q8_0: W[n, k] = scale * code, code in -128..127, rounded after the product;
// which is how transformers expands them to float32. ops/quantized.py finds the codes of a model's
// float32 weights and checks that they give back every weight bit for bit; this kernel then reads
// 5 (Q4_1) or 8.5 (Q8_0) bits per weight instead of 32: the codes and, as in the file, float16 scales
// and minimums (each exactly a float16 value: ops/quantized.py finds them among float16 candidates).
//
// Layout (ops/quantized.py packs it): output rows in groups of 16. Q4_1: for group g and the input
// pair (2j, 2j+1), 16 bytes: byte l holds the code of (row 16g + l, input 2j) in its low nibble and
// that of input 2j + 1 in its high nibble. Q8_0: for group g and input k, 16 signed bytes, one per
// row. Scales (and minimums): for group g and block b of 32 inputs, 16 float16 values, one per row.
//
// A thread takes a panel of up to 48 output rows, expands its weights to float32 once into a buffer
// laid out input by input (48 floats per input), then runs every 8-row tile of x over the buffer with
// 8 x 3 sixteen-lane accumulators: per input, 3 loads of weights and 8 broadcasts of x feed 24 FMAs.
// Up to 16 rows skip the buffer: each group's weights are expanded in registers and used at once.
// Each output is the FMA chain over k = 0..K-1 in order, whatever the number of rows or the path.
// Without AVX-512 (AVX2 and F16C), the same in eight-lane registers: up to 8 rows in registers, more
// through a panel of two groups expanded 128 inputs at a time (an L1-sized buffer; the running sums wait
// in memory between chunks, so the chains and their bits are the same).
//
// bfloat16 x and y (a bfloat16 model whose weights are these codes expanded, then rounded to
// bfloat16): the expansion rounds each weight to bfloat16 as well, so the kernel multiplies the
// model's very bfloat16 weights by bfloat16 inputs; each product is exact in float32 and the sum is
// float32, as in oneDNN's bfloat16 GEMM. y is rounded once at the end. Where the CPU has AVX512-BF16,
// up to 8 rows pair the rounded weights and sum with its dot product in oneDNN's order (simd.h), as
// pagedserve_kernels/cpu/bf16_linear.cpp does: `F.linear`'s bits. Elsewhere (more rows, or no AVX512-BF16) the
// FMA chain over k in order: an output can be one bfloat16 step from `F.linear`'s where the float32
// sum sits by a rounding boundary.
#include "aten.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "simd.h"

// Without AVX-512, the same kernel in eight-lane AVX2 registers (F16C widens the float16 scales): each
// 16-row group is two registers, rows 0-7 and 8-15, and every output is the same FMA chain over k.
#if !defined(PAGEDSERVE_AVX512) && defined(PAGEDSERVE_AVX2) && defined(__F16C__)
#define PAGEDSERVE_CODES_AVX2 1
#endif

// the expansion must round after the product and after the sum, as torch's separate ops do. Q4_1's
// product scale * code is exact in float32 (a float16 scale's 11 significant bits times a 4-bit code),
// so one FMA of it and the minimum, rounding once after the sum, gives the same bits.
#pragma GCC optimize("fp-contract=off")

namespace {

constexpr int64_t kGroup = 16;                 // output rows per group of the layout
constexpr int64_t kPanelGroups = 3;            // groups per panel: 48 output rows
constexpr int64_t kPanel = kGroup * kPanelGroups;
constexpr int64_t kTileRows = 8;               // rows of x per register tile
constexpr int64_t kBlock = 32;                 // inputs per scale and minimum

struct Weights {
  const void* codes;      // Q4_1: uint8 [groups, K / 2, 16]; Q8_0: int8 [groups, K, 16]
  const at::Half* scales; // [groups, K / 32, 16]
  const at::Half* mins;   // [groups, K / 32, 16]; null for Q8_0
  int64_t K;
};

#ifdef PAGEDSERVE_AVX512
// sixteen float16 scales (or minimums) as float32: exact
inline __m512 load_half16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// sixteen expanded weights rounded to T (rounded16's values): with AVX512-BF16, by the conversion
// instruction and back. It treats a subnormal float32 as zero where rounded16 would round it, but no
// weight is subnormal: Q8_0's scale * code is 0 or at least 2^-24 in magnitude (a float16 scale
// times an integer), and Q4_1's scale * code + min, a sum of two such float32 values, is 0 or a
// multiple of a float32 ulp at 2^-24, at least 2^-47.
template <typename T> inline __m512 weight16(__m512 v) { return pagedserve::rounded16<T>(v); }
// float(c & 15) for each lane's 32-bit code c: VPERMPS reads only an index's low 4 bits, so one
// table lookup stands for the mask and the conversion (one instruction fewer per 16 weights)
inline __m512 low_nibble_float(__m512i c) {
  const __m512 values = _mm512_set_ps(15.f, 14.f, 13.f, 12.f, 11.f, 10.f, 9.f, 8.f, 7.f, 6.f, 5.f, 4.f, 3.f, 2.f, 1.f, 0.f);
  return _mm512_permutexvar_ps(c, values);
}

#if defined(__AVX512BF16__)
template <> inline __m512 weight16<pagedserve::bf16>(__m512 v) {
  const __m256bh narrow = _mm512_cvtneps_pbh(v);
  __m256i bits;
  std::memcpy(&bits, &narrow, 32);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
#endif
#endif

#ifdef PAGEDSERVE_CODES_AVX2
// eight float16 scales (or minimums) as float32: exact
inline __m256 load_half8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// the codes of eight rows (bytes p[0..7]) in 32-bit lanes: Q4_1's two nibbles, or Q8_0's signed byte
inline __m256i codes8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i codes8(const int8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
// Q4_1's weights of the low and the high nibbles: scale * code + min, one rounding (see expand_q4)
inline __m256 low_weights8(__m256i both, __m256 d, __m256 m) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(both, _mm256_set1_epi32(15))), d, m);
}
inline __m256 high_weights8(__m256i both, __m256 d, __m256 m) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(both, 4)), d, m);
}
template <typename T> inline __m256 weight8(__m256 v) { return pagedserve::rounded8<T>(v); }
#endif

// the buffer of one thread, at least `floats` long, 64-byte aligned: the tiles' 32- and 64-byte loads
// from it never straddle two cache lines
float* thread_buffer(int64_t floats) {
  thread_local std::unique_ptr<float, decltype(&std::free)> buf(nullptr, &std::free);
  thread_local int64_t size = 0;
  if (size < floats) {
    const int64_t bytes = (sizeof(float) * floats + 63) / 64 * 64;   // aligned_alloc takes whole alignments
    buf.reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
    size = floats;
  }
  return buf.get();
}

// the panel's buffer: 48 floats per input
float* panel_buffer(int64_t K) { return thread_buffer(K * kPanel); }

using pagedserve::bf16;
using pagedserve::rounded;

// the float32 weights of groups [g0, g0 + groups) into buf[k * 48 + 16 * v + lane], rounded to T
template <typename T>
void expand_q4(const Weights& w, int64_t g0, int64_t groups, float* buf) {
  const int64_t K = w.K, pairs = K / 2, blocks = K / kBlock;
  for (int64_t v = 0; v < groups; ++v) {
    const uint8_t* codes = static_cast<const uint8_t*>(w.codes) + (g0 + v) * pairs * kGroup;
    const at::Half* scales = w.scales + (g0 + v) * blocks * kGroup;
    const at::Half* mins = w.mins + (g0 + v) * blocks * kGroup;
    float* out = buf + v * kGroup;
#ifdef PAGEDSERVE_AVX512
    for (int64_t b = 0; b < blocks; ++b) {
      const __m512 d = load_half16(scales + b * kGroup), m = load_half16(mins + b * kGroup);
      for (int64_t j = b * kBlock / 2; j < (b + 1) * kBlock / 2; ++j) {
        const __m512i both = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j * kGroup)));
        const __m512 lo = low_nibble_float(both);
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(both, 4));
        _mm512_store_ps(out + (2 * j) * kPanel, weight16<T>(_mm512_fmadd_ps(lo, d, m)));
        _mm512_store_ps(out + (2 * j + 1) * kPanel, weight16<T>(_mm512_fmadd_ps(hi, d, m)));
      }
    }
#else
    for (int64_t j = 0; j < pairs; ++j) {
      const int64_t b = 2 * j / kBlock;
      for (int64_t l = 0; l < kGroup; ++l) {
        const uint8_t c = codes[j * kGroup + l];
        const float d = static_cast<float>(scales[b * kGroup + l]), m = static_cast<float>(mins[b * kGroup + l]);
        const float lo = static_cast<float>(c & 15) * d, hi = static_cast<float>(c >> 4) * d;
        out[(2 * j) * kPanel + l] = rounded<T>(lo + m);
        out[(2 * j + 1) * kPanel + l] = rounded<T>(hi + m);
      }
    }
#endif
  }
}

template <typename T>
void expand_q8(const Weights& w, int64_t g0, int64_t groups, float* buf) {
  const int64_t K = w.K, blocks = K / kBlock;
  for (int64_t v = 0; v < groups; ++v) {
    const int8_t* codes = static_cast<const int8_t*>(w.codes) + (g0 + v) * K * kGroup;
    const at::Half* scales = w.scales + (g0 + v) * blocks * kGroup;
    float* out = buf + v * kGroup;
    for (int64_t b = 0; b < blocks; ++b) {
#ifdef PAGEDSERVE_AVX512
      const __m512 d = load_half16(scales + b * kGroup);
      for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k) {
        const __m512i c = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * kGroup)));
        _mm512_store_ps(out + k * kPanel, weight16<T>(_mm512_mul_ps(_mm512_cvtepi32_ps(c), d)));
      }
#else
      for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k)
        for (int64_t l = 0; l < kGroup; ++l)
          out[k * kPanel + l] = rounded<T>(static_cast<float>(codes[k * kGroup + l]) * static_cast<float>(scales[b * kGroup + l]));
#endif
    }
  }
}

#ifdef PAGEDSERVE_CODES_AVX2
// The float32 weights of groups [g0, g0 + groups) and inputs [k0, k1) (whole blocks of 32), rounded to T,
// into buf[(k - k0) * stride + 16 v + lane]: the panel's expansion, one chunk of the inputs at a time
template <typename T>
void expand_chunk8(const Weights& w, int64_t g0, int64_t groups, int64_t k0, int64_t k1, float* buf, int64_t stride) {
  const int64_t K = w.K, blocks = K / kBlock;
  for (int64_t v = 0; v < groups; ++v)
    for (int h = 0; h < 2; ++h) {   // rows 0-7, then 8-15
      const int64_t lane0 = (g0 + v) * blocks * kGroup + 8 * h;   // this half's first scale (and minimum)
      const uint8_t* q4 = static_cast<const uint8_t*>(w.codes) + (g0 + v) * (K / 2) * kGroup + 8 * h;
      const int8_t* q8 = static_cast<const int8_t*>(w.codes) + (g0 + v) * K * kGroup + 8 * h;
      float* out = buf + v * kGroup + 8 * h - k0 * stride;
      for (int64_t b = k0 / kBlock; b < k1 / kBlock; ++b) {
        const __m256 d = load_half8(w.scales + lane0 + b * kGroup);
        if (w.mins != nullptr) {
          const __m256 m = load_half8(w.mins + lane0 + b * kGroup);
          for (int64_t j = b * kBlock / 2; j < (b + 1) * kBlock / 2; ++j) {
            const __m256i both = codes8(q4 + j * kGroup);
            _mm256_storeu_ps(out + (2 * j) * stride, weight8<T>(low_weights8(both, d, m)));
            _mm256_storeu_ps(out + (2 * j + 1) * stride, weight8<T>(high_weights8(both, d, m)));
          }
        } else {
          for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k)
            _mm256_storeu_ps(out + k * stride, weight8<T>(_mm256_mul_ps(_mm256_cvtepi32_ps(codes8(q8 + k * kGroup)), d)));
        }
      }
    }
}
#endif

template <typename T>
void expand(const Weights& w, int64_t g0, int64_t groups, float* buf) {
#ifdef PAGEDSERVE_CODES_AVX2
  expand_chunk8<T>(w, g0, groups, 0, w.K, buf, kPanel);
#else
  if (w.mins != nullptr) expand_q4<T>(w, g0, groups, buf);
  else expand_q8<T>(w, g0, groups, buf);
#endif
}

#ifdef PAGEDSERVE_AVX512
// y[m0 .. m0 + R, n0 .. n0 + 16 V] from the expanded panel; ahead: lines to ask for over the inputs (simd.h)
template <int R, int V, typename T>
void tile(const float* x, const float* buf, T* y, int64_t m0, int64_t n0, int64_t K, int64_t N,
          pagedserve::Ahead ahead) {
  __m512 acc[R][V];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < V; ++v) acc[i][v] = _mm512_setzero_ps();
  const float* xr = x + m0 * K;
  for (int64_t k = 0; k < K; ++k) {
    __m512 w[V];
    for (int v = 0; v < V; ++v) w[v] = _mm512_load_ps(buf + k * kPanel + v * kGroup);
    ahead.step();
    for (int i = 0; i < R; ++i) {
      const __m512 xb = _mm512_set1_ps(pagedserve::to_float(xr[i * K + k]));
      for (int v = 0; v < V; ++v) acc[i][v] = _mm512_fmadd_ps(xb, w[v], acc[i][v]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < V; ++v) pagedserve::store16(y + (m0 + i) * N + n0 + v * kGroup, acc[i][v]);
}

template <int V, typename T>
void tile_rows(int64_t rows, const float* x, const float* buf, T* y, int64_t m0, int64_t n0, int64_t K, int64_t N,
               pagedserve::Ahead ahead) {
  switch (rows) {
    case 1: tile<1, V, T>(x, buf, y, m0, n0, K, N, ahead); break;
    case 2: tile<2, V, T>(x, buf, y, m0, n0, K, N, ahead); break;
    case 3: tile<3, V, T>(x, buf, y, m0, n0, K, N, ahead); break;
    case 4: tile<4, V, T>(x, buf, y, m0, n0, K, N, ahead); break;
    case 5: tile<5, V, T>(x, buf, y, m0, n0, K, N, ahead); break;
    case 6: tile<6, V, T>(x, buf, y, m0, n0, K, N, ahead); break;
    case 7: tile<7, V, T>(x, buf, y, m0, n0, K, N, ahead); break;
    default: tile<8, V, T>(x, buf, y, m0, n0, K, N, ahead); break;
  }
}
#endif

#ifdef PAGEDSERVE_CODES_AVX2
// The AVX2 panel: two groups (32 outputs, 4 registers) at a time, their weights expanded a chunk of
// kChunk8 inputs at a time into a buffer that stays in L1 (16 KB), every row of x run over each chunk.
// Between chunks the running sums wait in a float32 buffer, so each output is still the one FMA chain
// over k in order. A whole-K panel (up to 295 KB for SmolLM2) was read from L2 by every tile of rows.
constexpr int64_t kChunk8 = 128;
constexpr int64_t kWide8 = 2 * kGroup;

// acc[m0 .. m0 + R, c .. c + 8 V] += x[m0 .. m0 + R, k0 .. k1] . the chunk's weights of columns c .. c + 8 V
// (acc starts at 0 at k0 = 0), buf and acc offset by c
template <int R, int V = 2>
void chunk_tile8(const float* x, const float* buf, float* acc, int64_t m0, int64_t k0, int64_t k1, int64_t K) {
  __m256 a[R][V];
  if (k0 == 0) {
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < V; ++v) a[i][v] = _mm256_setzero_ps();
  } else {
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < V; ++v) a[i][v] = _mm256_loadu_ps(acc + (m0 + i) * kWide8 + 8 * v);
  }
  const float* xr = x + m0 * K + k0;
  const int64_t n = k1 - k0;
  for (int64_t k = 0; k < n; ++k) {
    __m256 wv[V];
    for (int v = 0; v < V; ++v) wv[v] = _mm256_loadu_ps(buf + k * kWide8 + 8 * v);
    for (int i = 0; i < R; ++i) {
      const __m256 xb = _mm256_set1_ps(xr[i * K + k]);
      for (int v = 0; v < V; ++v) a[i][v] = _mm256_fmadd_ps(xb, wv[v], a[i][v]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(acc + (m0 + i) * kWide8 + 8 * v, a[i][v]);
}

// every row of x over one group's columns (two registers) of a chunk: 6 rows a tile, 12 accumulators,
// two weights and a broadcast in the sixteen registers, then the last rows
void chunk_rows8(const float* x, const float* buf, float* acc, int64_t M, int64_t k0, int64_t k1, int64_t K) {
  int64_t m0 = 0;
  for (; m0 + 6 <= M; m0 += 6) chunk_tile8<6>(x, buf, acc, m0, k0, k1, K);
  switch (M - m0) {
    case 1: chunk_tile8<1>(x, buf, acc, m0, k0, k1, K); break;
    case 2: chunk_tile8<2>(x, buf, acc, m0, k0, k1, K); break;
    case 3: chunk_tile8<3>(x, buf, acc, m0, k0, k1, K); break;
    case 4: chunk_tile8<4>(x, buf, acc, m0, k0, k1, K); break;
    case 5: chunk_tile8<5>(x, buf, acc, m0, k0, k1, K); break;
    default: break;
  }
}

// every row of x over the columns of groups [0, groups), two groups at a time, each chunk of inputs
// [k0, k1) taken from chunk(g0, count, k0, k1, buf): a pointer to its weights, kWide8 floats per input
// (the codes expanded into buf, or a panel laid out once at start)
template <typename T, typename Chunk>
void chunked_rows8(const float* x, T* y, int64_t M, int64_t K, int64_t groups, Chunk chunk) {
  const int64_t N = groups * kGroup;
  at::parallel_for(0, (groups + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
    float* const buf = thread_buffer(kChunk8 * kWide8 + M * kWide8);   // a chunk's weights, then the sums
    float* const acc = buf + kChunk8 * kWide8;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t g0 = 2 * p, count = std::min<int64_t>(2, groups - g0);
      for (int64_t k0 = 0; k0 < K; k0 += kChunk8) {
        const int64_t k1 = std::min(K, k0 + kChunk8);
        const float* weights = chunk(g0, count, k0, k1, buf);
        for (int64_t v = 0; v < count; ++v)
          chunk_rows8(x, weights + v * kGroup, acc + v * kGroup, M, k0, k1, K);
      }
      for (int64_t m = 0; m < M; ++m)
        for (int64_t u = 0; u < 2 * count; ++u)
          pagedserve::store8(y + m * N + g0 * kGroup + 8 * u, _mm256_loadu_ps(acc + m * kWide8 + 8 * u));
    }
  });
}

template <typename T>
void panel_rows8(const Weights& w, const float* x, T* y, int64_t M, int64_t groups) {
  chunked_rows8(x, y, M, w.K, groups, [&](int64_t g0, int64_t count, int64_t k0, int64_t k1, float* buf) {
    expand_chunk8<T>(w, g0, count, k0, k1, buf, kWide8);
    return static_cast<const float*>(buf);
  });
}
#endif

// every row of x against the panel's `groups` groups, expanded in buf. next: the thread's next panel laid
// out at start (panel_pack), which the tiles ask for while they run over this one (simd.h: where it pays),
// or nullptr
template <typename T>
void panel_product(const float* x, const float* buf, T* y, int64_t M, int64_t n0, int64_t groups, int64_t K,
                   int64_t N, const float* next = nullptr) {
#ifdef PAGEDSERVE_AVX512
  const int64_t tiles = (M + kTileRows - 1) / kTileRows;
  const int64_t bytes = next != nullptr ? pagedserve::ahead_bytes(K * kPanel * 4, tiles) : 0;
  // tiles of near-equal rows: each asks for an equal share of the next panel, over as many FMAs as the others
  for (int64_t m0 = 0, t = 0; t < tiles; ++t) {
    const int64_t rows = pagedserve::tile_share(M, tiles, t);
    const pagedserve::Ahead ahead(next, bytes, t, tiles, K);
    if (groups == 3) tile_rows<3, T>(rows, x, buf, y, m0, n0, K, N, ahead);
    else if (groups == 2) tile_rows<2, T>(rows, x, buf, y, m0, n0, K, N, ahead);
    else tile_rows<1, T>(rows, x, buf, y, m0, n0, K, N, ahead);
    m0 += rows;
  }
#else
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < groups * kGroup; ++c) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc = std::fma(pagedserve::to_float(x[m * K + k]), buf[k * kPanel + c], acc);
      y[m * N + n0 + c] = pagedserve::from_float<T>(acc);
    }
#endif
}

// checks the codes' shapes against x's K and returns the weights' view (Q4_1 when mins is given)
Weights coded_weights(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                      int64_t K) {
  const bool q4 = mins.has_value();
  TORCH_CHECK(K % kBlock == 0, "coded_linear: K a multiple of 32");
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == kGroup && codes.is_contiguous() &&
              codes.scalar_type() == (q4 ? at::kByte : at::kChar) && codes.size(1) == (q4 ? K / 2 : K),
              q4 ? "coded_linear: Q4_1 codes [N / 16, K / 2, 16] uint8" : "coded_linear: Q8_0 codes [N / 16, K, 16] int8");
  std::vector<at::Tensor> floats{scales};
  if (q4) floats.push_back(*mins);
  for (const auto& t : floats)
    TORCH_CHECK(t.scalar_type() == at::kHalf && t.is_contiguous() && t.dim() == 3 && t.size(0) == codes.size(0) &&
                t.size(1) == K / kBlock && t.size(2) == kGroup, "coded_linear: scales, mins [N / 16, K / 32, 16] float16");
  return Weights{codes.data_ptr(), scales.data_ptr<at::Half>(), q4 ? mins->data_ptr<at::Half>() : nullptr, K};
}

// A few rows of x against groups of 16 output rows, the weights expanded in registers and used at once:
// no panel buffer to write and read back, which a step of a few rows cannot amortize. The FMA chains go
// this way for up to kChainRows rows (with more, the panel's tiles were as fast, even against two tiles
// of rows over each group's expansion), the bfloat16 dot product for up to kDirectRows.
constexpr int kDirectRows = 8;
#ifdef PAGEDSERVE_AVX512
constexpr int kChainRows = 16;
#else
constexpr int kChainRows = 8;   // AVX2: sixteen registers, two for every group a row meets
#endif

#if defined(PAGEDSERVE_AVX512) || defined(PAGEDSERVE_CODES_AVX2)
// asks for block b's scales (and minimums, unless null) of groups g + G .. g + 2G - 1, scales and mins at
// group g: the direct path reads them next (expand_pairs says why)
template <int G>
inline void ask_next_scales(const at::Half* scales, const at::Half* mins, int64_t b, int64_t blocks) {
  for (int v = 0; v < G; ++v) {
    __builtin_prefetch(scales + ((v + G) * blocks + b) * kGroup, 0, 3);
    if (mins != nullptr) __builtin_prefetch(mins + ((v + G) * blocks + b) * kGroup, 0, 3);
  }
}
#endif

#ifdef PAGEDSERVE_AVX512
// Groups side by side in the direct path: one output's sum is a chain of dependent FMAs (the order over k
// is fixed, so it cannot be split), and one row against one group leaves a single chain in flight,
// bound by the FMA's latency rather than its throughput. G groups keep G * M independent chains.
template <int M> constexpr int direct_groups() { return M == 1 ? 4 : M == 2 ? 2 : M <= 4 ? 3 : M <= 8 ? 2 : 1; }
// The tiles' order keeps three sums a row and group (the even inputs', the odd ones', the chunks' before), where
// the dot product keeps two: fewer groups side by side, so that they stay in the 32 registers
template <int M> constexpr int tile_groups() { return M == 1 ? 4 : M <= 4 ? 2 : 1; }

// fn(j, even, odd) for every input pair j of groups g .. g + G - 1, in order, where even[v] and odd[v]
// are group g + v's 16 rows' float32 weights of inputs 2j and 2j + 1; the expansion is the panel's
// (expand_q4, expand_q8) before any rounding to T. Paired: the codes are in the pair order of
// ops/quantized.py's Codes.paired_order, and even[v] holds rows 0-7 and odd[v] rows 8-15 of the group,
// each row's two inputs side by side (lane 2r + e: row r, input 2j + e), the order VDPBF16PS takes.
// It asks for groups g + G .. g + 2G - 1 at the same place as it reads (a prefetch never faults, so
// asking past the last group is harmless): the next call reads them, and each group's short run of
// codes is too brief for the hardware's streamer to get ahead.
template <int G, bool Paired = false, typename Fn>
inline void expand_pairs(const Weights& w, int64_t g, Fn fn) {
  const int64_t K = w.K, blocks = K / kBlock;
  const at::Half* scales = w.scales + g * blocks * kGroup;
  // Paired: the scales (and minimums) of lane 2r + e are row r's for even, row 8 + r's for odd
  const __m512i low_rows = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i high_rows = _mm512_add_epi32(low_rows, _mm512_set1_epi32(8));
  const auto spread = [&](__m512& lo, __m512& hi, __m512 v) {
    lo = Paired ? _mm512_permutexvar_ps(low_rows, v) : v;
    hi = Paired ? _mm512_permutexvar_ps(high_rows, v) : v;
  };
  __m512 even[G], odd[G], d[G], d_odd[G];
  if (w.mins != nullptr) {
    const uint8_t* codes = static_cast<const uint8_t*>(w.codes) + g * (K / 2) * kGroup;
    const at::Half* mins = w.mins + g * blocks * kGroup;
    __m512 m[G], m_odd[G];
    for (int64_t b = 0; b < blocks; ++b) {
      for (int v = 0; v < G; ++v) {
        spread(d[v], d_odd[v], load_half16(scales + (v * blocks + b) * kGroup));
        spread(m[v], m_odd[v], load_half16(mins + (v * blocks + b) * kGroup));
      }
      ask_next_scales<G>(scales, mins, b, blocks);
      for (int64_t j = b * kBlock / 2; j < (b + 1) * kBlock / 2; ++j) {
        if (j % 4 == 0)
          for (int v = 0; v < G; ++v) __builtin_prefetch(codes + ((v + G) * (K / 2) + j) * kGroup, 0, 3);
        for (int v = 0; v < G; ++v) {
          const __m512i both = _mm512_cvtepu8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (v * (K / 2) + j) * kGroup)));
          even[v] = _mm512_fmadd_ps(low_nibble_float(both), d[v], m[v]);
          odd[v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(both, 4)), d_odd[v], m_odd[v]);
        }
        fn(j, even, odd);
      }
    }
  } else {
    const int8_t* codes = static_cast<const int8_t*>(w.codes) + g * K * kGroup;
    for (int64_t b = 0; b < blocks; ++b) {
      for (int v = 0; v < G; ++v) spread(d[v], d_odd[v], load_half16(scales + (v * blocks + b) * kGroup));
      ask_next_scales<G>(scales, nullptr, b, blocks);
      for (int64_t j = b * kBlock / 2; j < (b + 1) * kBlock / 2; ++j) {
        if (j % 2 == 0)
          for (int v = 0; v < G; ++v) __builtin_prefetch(codes + ((v + G) * K + 2 * j) * kGroup, 0, 3);
        for (int v = 0; v < G; ++v) {
          const int8_t* c = codes + (v * K + 2 * j) * kGroup;
          even[v] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)))), d[v]);
          odd[v] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + kGroup)))), d_odd[v]);
        }
        fn(j, even, odd);
      }
    }
  }
}

// The weights rounded to T, and the same FMA chain over k in order as the panel's tiles: the same bits.
template <typename T, int M, int G>
void direct_group(const Weights& w, int64_t g, const float* x, T* y, int64_t N) {
  const int64_t K = w.K;
  __m512 acc[M][G];
  for (int r = 0; r < M; ++r)
    for (int v = 0; v < G; ++v) acc[r][v] = _mm512_setzero_ps();
  expand_pairs<G>(w, g, [&](int64_t j, __m512* even, __m512* odd) {
    for (int v = 0; v < G; ++v) {
      even[v] = weight16<T>(even[v]);
      odd[v] = weight16<T>(odd[v]);
    }
    for (int r = 0; r < M; ++r) {
      const __m512 x0 = _mm512_set1_ps(pagedserve::to_float(x[r * K + 2 * j]));
      for (int v = 0; v < G; ++v) acc[r][v] = _mm512_fmadd_ps(x0, even[v], acc[r][v]);
    }
    for (int r = 0; r < M; ++r) {
      const __m512 x1 = _mm512_set1_ps(pagedserve::to_float(x[r * K + 2 * j + 1]));
      for (int v = 0; v < G; ++v) acc[r][v] = _mm512_fmadd_ps(x1, odd[v], acc[r][v]);
    }
  });
  for (int r = 0; r < M; ++r)
    for (int v = 0; v < G; ++v) pagedserve::store16(y + r * N + (g + v) * kGroup, acc[r][v]);
}

#elif defined(PAGEDSERVE_CODES_AVX2)
// as with AVX-512, G groups keep 2 G M chains in flight, M G accumulator pairs of the 16 registers
template <int M> constexpr int direct_groups() { return M == 1 ? 3 : 1; }

// expand_pairs in eight lanes: fn(j, even, odd), where even[2 v + h] holds rows 8h .. 8h + 7 of group g + v
// for input 2j, odd[2 v + h] for input 2j + 1 (not rounded to T)
template <int G, typename Fn>
inline void expand_pairs8(const Weights& w, int64_t g, Fn fn) {
  const int64_t K = w.K, blocks = K / kBlock;
  const at::Half* scales = w.scales + g * blocks * kGroup;
  __m256 even[2 * G], odd[2 * G], d[2 * G];
  if (w.mins != nullptr) {
    const uint8_t* codes = static_cast<const uint8_t*>(w.codes) + g * (K / 2) * kGroup;
    const at::Half* mins = w.mins + g * blocks * kGroup;
    __m256 m[2 * G];
    for (int64_t b = 0; b < blocks; ++b) {
      for (int u = 0; u < 2 * G; ++u) {
        d[u] = load_half8(scales + ((u / 2) * blocks + b) * kGroup + 8 * (u % 2));
        m[u] = load_half8(mins + ((u / 2) * blocks + b) * kGroup + 8 * (u % 2));
      }
      ask_next_scales<G>(scales, mins, b, blocks);
      for (int64_t j = b * kBlock / 2; j < (b + 1) * kBlock / 2; ++j) {
        if (j % 4 == 0)
          for (int v = 0; v < G; ++v) __builtin_prefetch(codes + ((v + G) * (K / 2) + j) * kGroup, 0, 3);
        for (int u = 0; u < 2 * G; ++u) {
          const __m256i both = codes8(codes + ((u / 2) * (K / 2) + j) * kGroup + 8 * (u % 2));
          even[u] = low_weights8(both, d[u], m[u]);
          odd[u] = high_weights8(both, d[u], m[u]);
        }
        fn(j, even, odd);
      }
    }
  } else {
    const int8_t* codes = static_cast<const int8_t*>(w.codes) + g * K * kGroup;
    for (int64_t b = 0; b < blocks; ++b) {
      for (int u = 0; u < 2 * G; ++u) d[u] = load_half8(scales + ((u / 2) * blocks + b) * kGroup + 8 * (u % 2));
      ask_next_scales<G>(scales, nullptr, b, blocks);
      for (int64_t j = b * kBlock / 2; j < (b + 1) * kBlock / 2; ++j) {
        if (j % 2 == 0)
          for (int v = 0; v < G; ++v) __builtin_prefetch(codes + ((v + G) * K + 2 * j) * kGroup, 0, 3);
        for (int u = 0; u < 2 * G; ++u) {
          const int8_t* c = codes + ((u / 2) * K + 2 * j) * kGroup + 8 * (u % 2);
          even[u] = _mm256_mul_ps(_mm256_cvtepi32_ps(codes8(c)), d[u]);
          odd[u] = _mm256_mul_ps(_mm256_cvtepi32_ps(codes8(c + kGroup)), d[u]);
        }
        fn(j, even, odd);
      }
    }
  }
}

// direct_group in eight lanes: the same FMA chains, so the same bits as the panel's tiles
template <typename T, int M, int G>
void direct_group(const Weights& w, int64_t g, const float* x, T* y, int64_t N) {
  const int64_t K = w.K;
  __m256 acc[M][2 * G];
  for (int r = 0; r < M; ++r)
    for (int u = 0; u < 2 * G; ++u) acc[r][u] = _mm256_setzero_ps();
  expand_pairs8<G>(w, g, [&](int64_t j, __m256* even, __m256* odd) {
    for (int u = 0; u < 2 * G; ++u) {
      even[u] = weight8<T>(even[u]);
      odd[u] = weight8<T>(odd[u]);
    }
    for (int r = 0; r < M; ++r) {
      const __m256 x0 = _mm256_set1_ps(x[r * K + 2 * j]);
      for (int u = 0; u < 2 * G; ++u) acc[r][u] = _mm256_fmadd_ps(x0, even[u], acc[r][u]);
    }
    for (int r = 0; r < M; ++r) {
      const __m256 x1 = _mm256_set1_ps(x[r * K + 2 * j + 1]);
      for (int u = 0; u < 2 * G; ++u) acc[r][u] = _mm256_fmadd_ps(x1, odd[u], acc[r][u]);
    }
  });
  for (int r = 0; r < M; ++r)
    for (int u = 0; u < 2 * G; ++u) pagedserve::store8(y + r * N + g * kGroup + 8 * u, acc[r][u]);
}
#endif

#if defined(PAGEDSERVE_AVX512) || defined(PAGEDSERVE_CODES_AVX2)
// fn(std::integral_constant<int, G>, g) over groups [g0, g1) of the direct path: G (direct_groups<M>() unless
// given) groups at a time while that many remain, then the rest side by side (a thread's share of the groups
// need not be a multiple of G, and one group alone leaves a single chain in flight)
template <int M, int G = direct_groups<M>(), typename Fn>
inline void direct_groups_in(int64_t g0, int64_t g1, Fn fn) {
  int64_t g = g0;
  for (; g + G <= g1; g += G) fn(std::integral_constant<int, G>{}, g);
  const int64_t rest = g1 - g;
  if constexpr (G > 3) if (rest == 3) return fn(std::integral_constant<int, 3>{}, g);
  if constexpr (G > 2) if (rest == 2) return fn(std::integral_constant<int, 2>{}, g);
  if (rest == 1) fn(std::integral_constant<int, 1>{}, g);
}

// fn(std::integral_constant<int, M>{}) for a row count M known only at run time, 1 <= M <= N: each count
// its own instance of the direct path, whose registers are sized by it
template <typename Fn, int... Ms>
inline void with_rows_in(int64_t M, Fn& fn, std::integer_sequence<int, Ms...>) {
  (void)((M == Ms + 1 ? (fn(std::integral_constant<int, Ms + 1>{}), true) : false) || ...);
}
template <int N, typename Fn>
inline void with_rows(int64_t M, Fn fn) {
  with_rows_in(M, fn, std::make_integer_sequence<int, N>{});
}
#endif

#if defined(PAGEDSERVE_AVX512) && defined(__AVX512BF16__)
#define PAGEDSERVE_CODES_BF16_DOT 1
// bfloat16 x and y, M <= kDirectRows: the weights of inputs 2j and 2j + 1 rounded to bfloat16, paired
// lane by lane (W[l, 2j] in the low half, W[l, 2j + 1] in the high one) and multiplied by x's pairs with
// VDPBF16PS, one instruction for two inputs. Summed in oneDNN's order (pagedserve::onednn_bf16_chunk),
// as pagedserve_kernels/cpu/bf16_linear.cpp sums: `F.linear`'s bits for the same bfloat16 weights, so a row's
// result does not depend on which of the two routes its step took.
inline __m512bh pair_bf16(__m512 even, __m512 odd) {
  // cvtne2ps: odd's 16 values in the high 256 bits, even's in the low; then interleave the halves
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, even);
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return (__m512bh)_mm512_permutexvar_epi16(order, both);
}

// Where oneDNN's GEMM takes AMX tiles (an Intel Xeon with AMX), it sums a call of up to 32 rows otherwise: per
// group of 32 inputs from the first, the even inputs' and the odd inputs' products in two sequential sums, added
// together and then to the running sum, whatever the rows (read against `F.linear` on SmolLM2's shapes; the
// same order as MKL's with AMX tiles, pagedserve_kernels/cpu/paged_decode.cpp). Set once at start where a check
// finds `F.linear` summing so (ops/linear.py, onednn_tile_order): the codes' few rows then sum in it too.
std::atomic<bool> g_bf16_tiles{false};
constexpr int64_t kTilePairs = 16;   // input pairs in a group of the tile order

template <int M, int G, bool Paired, bool Tiles>
void direct_group_dot(const Weights& w, int64_t g, const bf16* x, bf16* y, const bool* one_row, int64_t N) {
  const int64_t K = w.K, step = pagedserve::kOneRowChunk / 2;
  __m512 acc[M][G], done[M][G];   // the sum of the current chunk of input pairs, and of the chunks before it
  __m512 odds[M][G];              // the tile order: the group's odd inputs (`acc` its even ones)
  bool started[M] = {};           // whether `done` holds a chunk yet
  for (int r = 0; r < M; ++r)
    for (int v = 0; v < G; ++v) acc[r][v] = done[r][v] = odds[r][v] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  expand_pairs<G, Paired>(w, g, [&](int64_t j, __m512* even, __m512* odd) {
    __m512bh pair[G];
    // paired codes come out in the dot product's order: rows 0-7 from even in the low half, 8-15 from odd
    for (int v = 0; v < G; ++v) pair[v] = Paired ? _mm512_cvtne2ps_pbh(odd[v], even[v]) : pair_bf16(even[v], odd[v]);
    if constexpr (Tiles) {
      // each lane's pair of bfloat16 weights as two float32 values, times x's pair broadcast
      __m512 lo[G], hi[G];
      for (int v = 0; v < G; ++v) {
        lo[v] = _mm512_castsi512_ps(_mm512_slli_epi32((__m512i)pair[v], 16));
        hi[v] = _mm512_castsi512_ps(_mm512_and_si512((__m512i)pair[v], high));
      }
      const bool last = j % kTilePairs == kTilePairs - 1 || j == K / 2 - 1;
      for (int r = 0; r < M; ++r) {
        int32_t two;
        std::memcpy(&two, x + r * K + 2 * j, 4);
        const __m512i both = _mm512_set1_epi32(two);
        const __m512 xe = _mm512_castsi512_ps(_mm512_slli_epi32(both, 16));
        const __m512 xo = _mm512_castsi512_ps(_mm512_and_si512(both, high));
        for (int v = 0; v < G; ++v) {
          acc[r][v] = _mm512_fmadd_ps(xe, lo[v], acc[r][v]);
          odds[r][v] = _mm512_fmadd_ps(xo, hi[v], odds[r][v]);
          if (last) {
            done[r][v] = _mm512_add_ps(done[r][v], _mm512_add_ps(acc[r][v], odds[r][v]));
            acc[r][v] = odds[r][v] = _mm512_setzero_ps();
          }
        }
      }
      return;
    }
    if (j > 0 && j % step == 0)
      for (int r = 0; r < M; ++r) {
        if (!pagedserve::chunk_ends(j, K, one_row, r)) continue;
        for (int v = 0; v < G; ++v) {
          done[r][v] = started[r] ? _mm512_add_ps(done[r][v], acc[r][v]) : acc[r][v];
          acc[r][v] = _mm512_setzero_ps();
        }
        started[r] = true;
      }
    for (int r = 0; r < M; ++r) {
      int32_t two;
      std::memcpy(&two, x + r * K + 2 * j, 4);
      const __m512bh xs = (__m512bh)_mm512_set1_epi32(two);
      for (int v = 0; v < G; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xs, pair[v]);
    }
  });
  for (int r = 0; r < M; ++r)
    for (int v = 0; v < G; ++v)
      pagedserve::store16(y + r * N + (g + v) * kGroup,
                          Tiles ? done[r][v] : started[r] ? _mm512_add_ps(done[r][v], acc[r][v]) : acc[r][v]);
}

// y [M, N] = x . W^T for bfloat16 x of 1 .. kDirectRows rows through the dot product
template <bool Paired>
void dot_rows(const Weights& w, const at::Tensor& x, at::Tensor& y, const bool* one_row) {
  const int64_t M = x.size(0), groups = y.size(1) / kGroup;
  const auto* xp = reinterpret_cast<const bf16*>(x.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<bf16*>(y.data_ptr<at::BFloat16>());
  at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    // the tiles' order (Tiles) keeps its own number of groups side by side
    const auto run = [&](auto m, auto tiles) {
      constexpr bool Tiles = decltype(tiles)::value;
      direct_groups_in<m(), Tiles ? tile_groups<m()>() : direct_groups<m()>()>(g0, g1, [&](auto G, int64_t g) {
        direct_group_dot<m(), G(), Paired, Tiles>(w, g, xp, yp, one_row, groups * kGroup);
      });
    };
    with_rows<kDirectRows>(M, [&](auto m) {
      if (g_bf16_tiles.load(std::memory_order_relaxed)) run(m, std::true_type{});
      else run(m, std::false_type{});
    });
  });
}

#endif

template <typename T>
void coded_rows(const Weights& w, const float* xp, T* yp, int64_t M, int64_t groups) {
  const int64_t K = w.K, N = groups * kGroup;
#if defined(PAGEDSERVE_AVX512) || defined(PAGEDSERVE_CODES_AVX2)
  if (M >= 1 && M <= kChainRows) {
    at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
      with_rows<kChainRows>(M, [&](auto m) {
        direct_groups_in<m()>(g0, g1, [&](auto G, int64_t g) { direct_group<T, m(), G()>(w, g, xp, yp, N); });
      });
    });
    return;
  }
#endif
#ifdef PAGEDSERVE_CODES_AVX2
  panel_rows8(w, xp, yp, M, groups);
#else
  const int64_t panels = (groups + kPanelGroups - 1) / kPanelGroups;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    float* buf = panel_buffer(K);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t g0 = p * kPanelGroups, count = std::min(kPanelGroups, groups - g0);
      expand<T>(w, g0, count, buf);
      panel_product(xp, buf, yp, M, g0 * kGroup, count, K, N);
    }
  });
#endif
}

}  // namespace

at::Tensor coded_linear(at::Tensor x, at::Tensor codes, at::Tensor scales, c10::optional<at::Tensor> mins,
                        c10::optional<at::Tensor> one_row) {
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.dim() == 2 && x.is_contiguous(),
              "coded_linear: x [M, K] float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), groups = codes.size(0);
  const Weights w = coded_weights(codes, scales, mins, K);
  const bool* ones = pagedserve::row_flags(one_row, M, "coded_linear");
  auto y = at::empty({M, groups * kGroup}, x.options());
  if (x.scalar_type() == at::kFloat) {
    coded_rows(w, x.data_ptr<float>(), y.data_ptr<float>(), M, groups);
  } else {
#ifdef PAGEDSERVE_CODES_BF16_DOT
    if (M >= 1 && M <= kDirectRows) {
      dot_rows<false>(w, x, y, ones);
      return y;
    }
#endif
    // x widened to float32 once (exact), not at each of its uses by every group of outputs
    const auto wide = x.to(at::kFloat);
    coded_rows(w, wide.data_ptr<float>(), reinterpret_cast<bf16*>(y.data_ptr<at::BFloat16>()), M, groups);
  }
  return y;
}

// coded_linear's bfloat16 result for 1 .. 8 rows from codes in the pair order (ops/quantized.py,
// Codes.paired_order), which spares the dot product's pairing a permutation of every pair of inputs
at::Tensor coded_pairs_linear(at::Tensor x, at::Tensor codes, at::Tensor scales, c10::optional<at::Tensor> mins,
                              c10::optional<at::Tensor> one_row) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous() && x.size(0) >= 1 &&
              x.size(0) <= kDirectRows, "coded_pairs_linear: x [M, K] bfloat16, 1 <= M <= 8");
  const int64_t K = x.size(1);
  const Weights w = coded_weights(codes, scales, mins, K);
  auto y = at::empty({x.size(0), codes.size(0) * kGroup}, x.options());
#ifdef PAGEDSERVE_CODES_BF16_DOT
  dot_rows<true>(w, x, y, pagedserve::row_flags(one_row, x.size(0), "coded_pairs_linear"));
#else
  TORCH_CHECK(false, "coded_pairs_linear: this build has no AVX512-BF16 dot product");
#endif
  return y;
}

void set_bf16_tile_order(bool on) {
#ifdef PAGEDSERVE_CODES_BF16_DOT
  g_bf16_tiles.store(on);
#else
  TORCH_CHECK(!on, "set_bf16_tile_order: this build has no AVX512-BF16 dot product");
#endif
}

// the float32 weights [N, K] the codes stand for (for checks; the kernel never builds them)
at::Tensor coded_expand(at::Tensor codes, at::Tensor scales, c10::optional<at::Tensor> mins) {
  const int64_t groups = codes.size(0), K = mins.has_value() ? codes.size(1) * 2 : codes.size(1);
  const Weights w = coded_weights(codes, scales, mins, K);
  auto out = at::empty({groups * kGroup, K}, scales.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    float* buf = panel_buffer(K);
    for (int64_t g = g0; g < g1; ++g) {
      expand<float>(w, g, 1, buf);
      for (int64_t l = 0; l < kGroup; ++l)
        for (int64_t k = 0; k < K; ++k) op[(g * kGroup + l) * K + k] = buf[k * kPanel + l];
    }
  });
  return out;
}

// Plain float32 weights (no codes) through the same tiles: laid out once at start as the expansion
// would lay them out, panel by panel, so that a product skips the expansion and reads the panels as
// they are. Each output is the same FMA chain over k in order at every row count, as with codes: a
// row's result does not depend on the batch it comes in. The width of a panel is the build's: 48
// outputs for the AVX-512 tiles, 32 for the AVX2 chunks.
namespace {
#ifdef PAGEDSERVE_CODES_AVX2
constexpr int64_t kPackWidth = kWide8;
#else
constexpr int64_t kPackWidth = kPanel;
#endif

#ifdef PAGEDSERVE_CODES_AVX2
// A few rows over a whole panel of 32 outputs (4 registers), the sums in registers from k = 0 to K - 1:
// the same FMA chains as the chunks, whose sums wait in memory between chunks (the same bits), but four
// chains a row in flight where a chunk's tile keeps two, and no round trip of the sums; up to
// kPanelDirectRows8 rows, in tiles of two (8 sums, 4 weights and 2 broadcasts of the 16 registers). With
// more rows each tile rereads the panel from L2, and the chunks (re-read from L1) are as fast or faster.
constexpr int64_t kPanelDirectRows8 = 32;

template <int R>
void panel_tile8(const float* x, const float* panel, float* y, int64_t m0, int64_t n0, int64_t cols, int64_t K,
                 int64_t N) {
  __m256 acc[R][4];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < 4; ++v) acc[i][v] = _mm256_setzero_ps();
  const float* xr = x + m0 * K;
  for (int64_t k = 0; k < K; ++k) {
    __m256 w[4];
    for (int v = 0; v < 4; ++v) w[v] = _mm256_loadu_ps(panel + k * kWide8 + 8 * v);
    for (int i = 0; i < R; ++i) {
      const __m256 xb = _mm256_set1_ps(xr[i * K + k]);
      for (int v = 0; v < 4; ++v) acc[i][v] = _mm256_fmadd_ps(xb, w[v], acc[i][v]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < 4 && 8 * v < cols; ++v) _mm256_storeu_ps(y + (m0 + i) * N + n0 + 8 * v, acc[i][v]);
}
#endif

// the panels that hold N outputs
int64_t panels_of(int64_t N) { return (N + kPackWidth - 1) / kPackWidth; }

void check_packed(const at::Tensor& packed, int64_t N, int64_t K, const char* name) {
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.dim() == 3 && packed.is_contiguous() &&
              packed.size(0) == panels_of(N) && packed.size(1) == K &&
              packed.size(2) == kPackWidth, name, ": packed [ceil(N / ", kPackWidth, "), K, ", kPackWidth,
              "] float32 from panel_pack");
  // the AVX-512 tiles load the panels with aligned loads, as their own buffer (thread_buffer)
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr()) % 64 == 0, name, ": packed 64-byte aligned (panel_pack's)");
}
}  // namespace

// w [N, K] float32 (N a multiple of 16) -> its panels [ceil(N / width), K, width], zero where N ends
at::Tensor panel_pack(at::Tensor w) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2 && w.is_contiguous() && w.size(0) % kGroup == 0,
              "panel_pack: w [N, K] float32, contiguous, N a multiple of 16");
  const int64_t N = w.size(0), K = w.size(1), panels = panels_of(N);
  auto out = at::empty({panels, K, kPackWidth}, w.options());
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  std::fill(op, op + panels * K * kPackWidth, 0.f);
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t c = 0; c < kPackWidth && p * kPackWidth + c < N; ++c)
        for (int64_t k = 0; k < K; ++k) op[(p * K + k) * kPackWidth + c] = wp[(p * kPackWidth + c) * K + k];
  });
  return out;
}

// y [M, N] = x [M, K] . W^T for W laid out by panel_pack; x float32
at::Tensor panel_linear(at::Tensor x, at::Tensor packed, int64_t N) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "panel_linear: x [M, K] float32");
  TORCH_CHECK(N > 0 && N % kGroup == 0, "panel_linear: N a multiple of 16");
  const int64_t M = x.size(0), K = x.size(1), groups = N / kGroup;
  check_packed(packed, N, K, "panel_linear");
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* pp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#if defined(PAGEDSERVE_CODES_AVX2)
  if (M <= kPanelDirectRows8) {
    at::parallel_for(0, packed.size(0), 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t cols = std::min<int64_t>(kWide8, N - p * kWide8);
        for (int64_t m0 = 0; m0 < M; m0 += 2) {
          if (M - m0 >= 2) panel_tile8<2>(xp, pp + p * K * kWide8, yp, m0, p * kWide8, cols, K, N);
          else panel_tile8<1>(xp, pp + p * K * kWide8, yp, m0, p * kWide8, cols, K, N);
        }
      }
    });
    return y;
  }
  chunked_rows8(xp, yp, M, K, groups, [&](int64_t g0, int64_t, int64_t k0, int64_t, float*) {
    return pp + ((g0 / 2) * K + k0) * kWide8;
  });
#elif defined(PAGEDSERVE_AVX512)
  at::parallel_for(0, packed.size(0), 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      panel_product(xp, pp + p * K * kPanel, yp, M, p * kPanel, std::min(kPanelGroups, groups - p * kPanelGroups), K, N,
                    p + 1 < p1 ? pp + (p + 1) * K * kPanel : nullptr);
  });
#else
  TORCH_CHECK(false, "panel_linear: this build has no vectorized tiles (has_coded_simd)");
#endif
  return y;
}

// whether coded_linear runs vectorized here (AVX-512, or AVX2 with F16C): elsewhere it is a scalar loop,
// correct but many times slower than the float32 GEMM over the expanded weights, which ops/linear.py
// then takes instead
bool has_coded_simd() {
#if defined(PAGEDSERVE_AVX512) || defined(PAGEDSERVE_CODES_AVX2)
  return true;
#else
  return false;
#endif
}
