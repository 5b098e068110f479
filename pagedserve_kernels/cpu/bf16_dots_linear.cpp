// y[M, N] = x[M, K] . W[N, K]^T in bfloat16 as torch computes `F.linear` where oneDNN has no bfloat16
// GEMM for the CPU (AVX2 without AVX-512 or AVX-NE-CONVERT): torch's own GEMM then takes each output as
// one dot product of two bfloat16 rows with float32 arithmetic, in this order (read off its outputs;
// tests/kernels/test_bf16_dots_linear.py holds the kernel to `F.linear` where that is torch's route):
//   - inputs in blocks of 64; within a block, eight-lane vector v (inputs 8v .. 8v + 7) is added into
//     running sum v, so each of the 8 sums x 8 lanes sees every 64th input, front to back;
//   - the eight sums halved as a tree (v + v+4, then + v+2, then + v+1), then the lanes the same way
//     (l + l+4, then + l+2, then + l+1);
//   - one rounding to bfloat16, to nearest even.
// Every product of two bfloat16 values is exact in float32, so a fused or a plain multiply-add give
// the same sums. Each output depends on its own row and column only: no batch effects.
//
// torch's GEMM computes output after output without reusing a loaded weight across rows; here a tile of
// 4 rows x 2 outputs takes one vector position v at a time over the whole row (8 running sums in
// registers), so each weight vector is loaded and widened once for 4 rows; the 8 positions' sums then
// fold as above. One row (a decode step alone) walks each weight row once instead, its eight running
// sums in registers as four pairs: sixteen bfloat16 weights widened by two unpacks with zeros, which
// leave them in the lane order (0-3, 8-11) and (4-7, 12-15), x widened in that order too, and the sums
// put back in place before they fold. x is widened into a 64-byte aligned buffer: from a 16-byte
// aligned one, half of the 32-byte loads of x straddled two cache lines. K must be a multiple of 64
// (the tails torch adds after the blocks are not followed; ops/linear.py routes other shapes to torch).
//
// bf16_dots_codes_linear takes the same sums for a few rows from a weight held as GGUF codes, where the
// bfloat16 weight is those codes expanded in float32 (Q4_1: scale * code + min; Q8_0: scale * code) and
// rounded to bfloat16: a few rows are bound by reading the weights, and the codes are 20 (Q4_1) or 36
// (Q8_0) bytes a block of 32 inputs against 64. Their layout is GGUF's own, row by row (ops/quantized.py,
// Codes.row_blocks): Q4_1's block b of row n is 16 bytes at codes[n, 16 b], byte j holding the code of
// input 32 b + j in its low nibble and of input 32 b + 16 + j in its high one; Q8_0's codes are
// codes[n, k]; each block's scale (and minimum) is at scale_min[n, b] (float32, each a float16 value).
// Up to four rows, each weight is expanded and rounded in registers and multiplied at once, in the vector
// position the sums above give it; with more, an output's weights are expanded once into an L1 buffer that
// the rows' tiles read. The same bits as bf16_dots_linear on the bfloat16 weight, which ops/linear.py checks
// at load (bf16_dots_codes_expand) before routing. The walks over outputs (these and bf16_dots_linear's) ask
// for the rows they read next: without that a row of codes took about twice as long from memory as from
// cache (bench/route_rows.py held to AVX2).
#include "aten.h"

#include <algorithm>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t kBlock = 64, kLanes = 8, kSums = kBlock / kLanes;
constexpr int64_t kTileRows = 4, kTileCols = 2, kPanelCols = 32;
// the most rows that walk each row of W (rows_walk) rather than take the tiles (as fast at 6 rows, faster from 8)
constexpr int64_t kWalkRows = 5;
// the outputs ahead whose row (of codes or of bfloat16 weights) a walk over outputs asks for
constexpr int64_t kRowsAhead = 4;
// the most rows whose tile expands an output's codes in registers (codes_tile); more read them expanded from L1
constexpr int64_t kCodesTileRows = 4;

#ifdef PAGEDSERVE_AVX2
using pagedserve::bf16;

// sixteen bfloat16 values as float32: inputs 0-3 and 8-11 in `a`, 4-7 and 12-15 in `b` (the unpacks work
// within each 128-bit half)
inline void widen16(const bf16* p, __m256& a, __m256& b) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), zero = _mm256_setzero_si256();
  a = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
  b = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
}

using pagedserve::torch_dots_fold;

// rows [m0, m0 + R) x outputs [n0, n0 + C), xf x widened in input order: one pass per vector position v
// over the blocks, its R x C running sums in registers
template <int R, int C>
void tile(const float* xf, const bf16* w, bf16* y, int64_t m0, int64_t n0, int64_t K, int64_t N) {
  __m256 sums[R][C][kSums];
  for (int v = 0; v < kSums; ++v) {
    __m256 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t k = v * kLanes; k < K; k += kBlock) {
      __m256 wv[C];
      for (int c = 0; c < C; ++c) wv[c] = pagedserve::load8(w + (n0 + c) * K + k);
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_loadu_ps(xf + (m0 + r) * K + k);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) sums[r][c][v] = acc[r][c];
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[(m0 + r) * N + n0 + c] = pagedserve::from_float<bf16>(torch_dots_fold(sums[r][c]));
}

// tile<R, C> for the rows and columns left, R <= kTileRows and C <= kTileCols
template <int R>
void tile_cols(int64_t cols, const float* xf, const bf16* w, bf16* y, int64_t m0, int64_t n0, int64_t K, int64_t N) {
  if (cols >= kTileCols) tile<R, kTileCols>(xf, w, y, m0, n0, K, N);
  else tile<R, 1>(xf, w, y, m0, n0, K, N);
}

// One row: output after output, each row of W read once front to back with its eight running sums in
// registers as four (a, b) pairs; the same sums as tile<1, C>, which walks a row once per vector
// position with too few chains in flight to keep up with memory
void one_row(const float* xf, const bf16* w, bf16* y, int64_t n, int64_t K) {
  __m256 acc_a[4], acc_b[4];
  for (int t = 0; t < 4; ++t) acc_a[t] = acc_b[t] = _mm256_setzero_ps();
  const bf16* row = w + n * K;
  for (int64_t k = 0; k < K; k += kBlock)
    for (int t = 0; t < 4; ++t) {
      __m256 wa, wb;
      widen16(row + k + 2 * t * kLanes, wa, wb);
      acc_a[t] = _mm256_fmadd_ps(_mm256_loadu_ps(xf + k + 2 * t * kLanes), wa, acc_a[t]);
      acc_b[t] = _mm256_fmadd_ps(_mm256_loadu_ps(xf + k + 2 * t * kLanes + kLanes), wb, acc_b[t]);
    }
  __m256 sums[kSums];
  for (int t = 0; t < 4; ++t) {
    sums[2 * t] = _mm256_permute2f128_ps(acc_a[t], acc_b[t], 0x20);
    sums[2 * t + 1] = _mm256_permute2f128_ps(acc_a[t], acc_b[t], 0x31);
  }
  y[n] = pagedserve::from_float<bf16>(torch_dots_fold(sums));
}

// R rows [m0, m0 + R) x output n, for a few rows: W's row walked twice, a pass taking half of every 64-block
// (inputs 32 h .. 32 h + 31, vector positions 4 h .. 4 h + 3) with each row's four running sums of that half
// in registers as two (a, b) pairs, as one_row keeps them; x widened in one_row's lane order. Each weight
// vector is loaded and widened once for the R rows, and the row's other half comes from L1. The sums go back
// in place and fold as one_row's: the same bits. (The tiles above walk a row once per vector position, eight
// strided passes: with 2-5 rows they took longer.)
template <int R>
void rows_walk(const float* xf, const bf16* w, bf16* y, int64_t m0, int64_t n, int64_t K, int64_t N) {
  const bf16* row = w + n * K;
  __m256 sums[R][kSums];
  for (int h = 0; h < 2; ++h) {
    __m256 acc_a[R][2], acc_b[R][2];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < 2; ++t) acc_a[r][t] = acc_b[r][t] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += kBlock)
      for (int t = 0; t < 2; ++t) {
        const int64_t at = k + 2 * (2 * h + t) * kLanes;
        __m256 wa, wb;
        widen16(row + at, wa, wb);
        for (int r = 0; r < R; ++r) {
          const float* xr = xf + (m0 + r) * K + at;
          acc_a[r][t] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), wa, acc_a[r][t]);
          acc_b[r][t] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + kLanes), wb, acc_b[r][t]);
        }
      }
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < 2; ++t) {
        sums[r][2 * (2 * h + t)] = _mm256_permute2f128_ps(acc_a[r][t], acc_b[r][t], 0x20);
        sums[r][2 * (2 * h + t) + 1] = _mm256_permute2f128_ps(acc_a[r][t], acc_b[r][t], 0x31);
      }
  }
  for (int r = 0; r < R; ++r) y[(m0 + r) * N + n] = pagedserve::from_float<bf16>(torch_dots_fold(sums[r]));
}

// w rounded to bfloat16 (nearest, ties to even), as float32: with c = +-2^e for w's exponent e (its sign
// and exponent bits), t = w + 2^16 c rounds w on bfloat16's grid at w (float32's grid at 2^(e + 16) is
// 2^(e - 7)), and t - 2^16 c is exact; each an FMA, so 2^16 c is never rounded. One mask and two FMAs:
// five integer operations (the usual rounding) or two float additions cost more on this loop. Exact for
// normal w under 2^112 and +0; -0 and subnormal values come out otherwise (the load check turns such
// codes down).
inline __m256 bf16_grid8(__m256 w) {
  const __m256 c = _mm256_and_ps(w, _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0xFF800000u))));
  const __m256 scale = _mm256_set1_ps(65536.0f);
  return _mm256_fnmadd_ps(c, scale, _mm256_fmadd_ps(c, scale, w));
}

// The two formats, as the tile takes them: the 64 inputs of a sum's block are four units of 16 codes, one
// unit two of the eight-lane vector positions v, `first` and `second` (the sums above: positions v of
// every block add into running sum v). `row` points at output n's codes and `sm` at its first block's
// scale (and minimum); `weights` gives unit u's two vectors of the 64-block at input k, rounded.
struct Q4_1 {
  static constexpr int64_t kScaleFloats = 2;   // scale and minimum
  static constexpr int64_t row_bytes(int64_t K) { return K / 2; }
  // unit u: block u / 2 of 32, bytes 8 (u % 2) ..: the low nibbles (v), then the high ones (v + 2)
  static constexpr int first(int u) { return 4 * (u / 2) + u % 2; }
  static constexpr int second(int u) { return first(u) + 2; }
  static void weights(const uint8_t* row, const float* sm, int64_t k, int u, __m256& a, __m256& b) {
    const int64_t block = k / 32 + u / 2;
    const __m256 d = _mm256_broadcast_ss(sm + 2 * block), m = _mm256_broadcast_ss(sm + 2 * block + 1);
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 16 * block + 8 * (u % 2))));
    a = bf16_grid8(_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(c, _mm256_set1_epi32(15))), d, m));
    b = bf16_grid8(_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4)), d, m));
  }
};
struct Q8_0 {
  static constexpr int64_t kScaleFloats = 1;   // the scale
  static constexpr int64_t row_bytes(int64_t K) { return K; }   // (signed)
  // unit u: inputs 16 u .. 16 u + 15 of the block, positions 2 u and 2 u + 1
  static constexpr int first(int u) { return 2 * u; }
  static constexpr int second(int u) { return 2 * u + 1; }
  static void weights(const uint8_t* row, const float* sm, int64_t k, int u, __m256& a, __m256& b) {
    const __m256 d = _mm256_broadcast_ss(sm + k / 32 + u / 2);
    const auto* p = reinterpret_cast<const __m128i*>(row + k + 16 * u);
    a = bf16_grid8(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p))), d));
    b = bf16_grid8(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
        reinterpret_cast<const __m128i*>(row + k + 16 * u + 8)))), d));
  }
};

// rows [m0, m0 + R) x output n from its codes. A pass over the row takes U units of every 64-block with
// their 2 U R running sums in registers, so more rows take more passes (each code still expanded once:
// with all eight sums of four rows in flight, sixteen registers would not hold them); the sums then fold
// as bf16_dots_linear's.
template <typename Kind, int R, int U>
void codes_tile(const float* xf, const uint8_t* codes, const float* scale_min, bf16* y, int64_t m0, int64_t n,
                int64_t K, int64_t N) {
  const uint8_t* row = codes + n * Kind::row_bytes(K);
  const float* sm = scale_min + n * (K / 32) * Kind::kScaleFloats;
  __m256 sums[R][kSums];
  for (int u0 = 0; u0 < 4; u0 += U) {
    __m256 acc[R][2 * U];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < 2 * U; ++j) acc[r][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += kBlock) {
#pragma GCC unroll 4
      for (int j = 0; j < U; ++j) {
        const int u = u0 + j;
        __m256 a, b;
        Kind::weights(row, sm, k, u, a, b);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const float* x = xf + (m0 + r) * K + k;
          acc[r][2 * j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + kLanes * Kind::first(u)), a, acc[r][2 * j]);
          acc[r][2 * j + 1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + kLanes * Kind::second(u)), b, acc[r][2 * j + 1]);
        }
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < U; ++j)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        sums[r][Kind::first(u0 + j)] = acc[r][2 * j], sums[r][Kind::second(u0 + j)] = acc[r][2 * j + 1];
  }
  for (int r = 0; r < R; ++r) y[(m0 + r) * N + n] = pagedserve::from_float<bf16>(torch_dots_fold(sums[r]));
}

// output n's K weights from its codes, expanded and rounded, into out in input order (float32, or bfloat16: the
// rounded values are exact in either)
template <typename Kind, typename Out>
void expand_row(const uint8_t* codes, const float* scale_min, int64_t n, int64_t K, Out* out) {
  const uint8_t* row = codes + n * Kind::row_bytes(K);
  const float* sm = scale_min + n * (K / 32) * Kind::kScaleFloats;
  for (int64_t k = 0; k < K; k += kBlock)
    for (int u = 0; u < 4; ++u) {
      __m256 a, b;
      Kind::weights(row, sm, k, u, a, b);
      pagedserve::store8(out + k + kLanes * Kind::first(u), a);
      pagedserve::store8(out + k + kLanes * Kind::second(u), b);
    }
}

// rows [m0, m0 + R) x output n from its row of weights already expanded and rounded into `wf` (float32, input
// order): a pass per V vector positions over the blocks, R x V running sums in registers (eight chains, for the
// FMAs' latency); the sums fold as bf16_dots_linear's. (Two outputs a tile, each x loaded once for both, was
// no faster.)
template <int R, int V>
void expanded_tile(const float* xf, const float* wf, bf16* y, int64_t m0, int64_t n, int64_t K, int64_t N) {
  __m256 sums[R][kSums];
  for (int v0 = 0; v0 < kSums; v0 += V) {
    __m256 acc[R][V];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += kBlock) {
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) {
        const __m256 w = _mm256_loadu_ps(wf + k + kLanes * (v0 + v));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          acc[r][v] = _mm256_fmadd_ps(_mm256_loadu_ps(xf + (m0 + r) * K + k + kLanes * (v0 + v)), w, acc[r][v]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) sums[r][v0 + v] = acc[r][v];
  }
  for (int r = 0; r < R; ++r) y[(m0 + r) * N + n] = pagedserve::from_float<bf16>(torch_dots_fold(sums[r]));
}

// Up to kCodesTileRows rows, each output's codes are expanded in registers and multiplied at once (codes_tile);
// with more, each row tile would expand them again, so the output's row is expanded once into an L1 buffer and
// the rows' tiles read it from there. Each thread asks for the codes some outputs ahead: the hardware's
// prefetcher did not keep up with a walk of two streams (codes, scales) that few rows make this fast.
template <typename Kind>
void codes_product(const float* xf, const uint8_t* codes, const float* scale_min, bf16* y, int64_t M, int64_t K,
                   int64_t N) {
  const int64_t row_bytes = Kind::row_bytes(K), sm_bytes = (K / 32) * Kind::kScaleFloats * 4;
  at::parallel_for(0, N, kPanelCols, [&](int64_t n0, int64_t n1) {
    std::vector<float> buffer(M > kCodesTileRows ? K : 0);
    float* const wf = buffer.data();
    for (int64_t n = n0; n < n1; ++n) {
      if (n + kRowsAhead < n1) {
        pagedserve::ask_lines(codes + (n + kRowsAhead) * row_bytes, row_bytes);
        pagedserve::ask_lines(reinterpret_cast<const char*>(scale_min) + (n + kRowsAhead) * sm_bytes, sm_bytes);
      }
      switch (M) {
        case 1: codes_tile<Kind, 1, 4>(xf, codes, scale_min, y, 0, n, K, N); continue;
        case 2: codes_tile<Kind, 2, 2>(xf, codes, scale_min, y, 0, n, K, N); continue;
        case 3: codes_tile<Kind, 3, 1>(xf, codes, scale_min, y, 0, n, K, N); continue;
        case kCodesTileRows: codes_tile<Kind, kCodesTileRows, 1>(xf, codes, scale_min, y, 0, n, K, N); continue;
        default: break;
      }
      expand_row<Kind>(codes, scale_min, n, K, wf);
      int64_t m0 = 0;
      for (; m0 + kTileRows <= M; m0 += kTileRows) expanded_tile<kTileRows, 2>(xf, wf, y, m0, n, K, N);
      switch (M - m0) {
        case 1: expanded_tile<1, 8>(xf, wf, y, m0, n, K, N); break;
        case 2: expanded_tile<2, 4>(xf, wf, y, m0, n, K, N); break;
        case 3: expanded_tile<3, 4>(xf, wf, y, m0, n, K, N); break;
        default: break;
      }
    }
  });
}

// every weight of the codes, rounded to bfloat16, into w [N, K]
template <typename Kind>
void codes_expand(const uint8_t* codes, const float* scale_min, bf16* w, int64_t K, int64_t N) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) expand_row<Kind>(codes, scale_min, n, K, w + n * K);
  });
}

// x [M, K] as float32 (exact): in widen16's lane order (one_row's), or in input order (the tiles')
at::Tensor widen_x(const at::Tensor& x, bool lane_order) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor widened = at::empty({M, K}, x.options().dtype(at::kFloat));
  float* const xf = widened.data_ptr<float>();
  const auto* xp = reinterpret_cast<const bf16*>(x.data_ptr<at::BFloat16>());
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0 * K; i < r1 * K; i += 2 * kLanes) {
      __m256 a, b;
      if (lane_order) widen16(xp + i, a, b);
      else a = pagedserve::load8(xp + i), b = pagedserve::load8(xp + i + kLanes);
      _mm256_storeu_ps(xf + i, a);
      _mm256_storeu_ps(xf + i + kLanes, b);
    }
  });
  return widened;
}

#endif

void check_x(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(), what,
              ": x [M, K] bfloat16, contiguous");
}

// checks bf16_dots_codes_linear's weight, and whether it is Q4_1 (codes uint8 [N, K / 2], scale_min float32
// [N, K / 32, 2]) or Q8_0 (codes int8 [N, K], scales float32 [N, K / 32, 1])
bool check_codes(const at::Tensor& codes, const at::Tensor& scale_min, int64_t K, const char* what) {
  const bool q4 = codes.scalar_type() == at::kByte;
  TORCH_CHECK((q4 || codes.scalar_type() == at::kChar) && codes.dim() == 2 && codes.is_contiguous() &&
              K % kBlock == 0 && codes.size(1) * (q4 ? 2 : 1) == K,
              what, ": codes uint8 [N, K / 2] (Q4_1) or int8 [N, K] (Q8_0), contiguous, K a multiple of 64");
  TORCH_CHECK(scale_min.scalar_type() == at::kFloat && scale_min.dim() == 3 && scale_min.is_contiguous() &&
              scale_min.size(0) == codes.size(0) && scale_min.size(1) * 32 == K && scale_min.size(2) == (q4 ? 2 : 1),
              what, ": scale_min float32 [N, K / 32, 2] (Q4_1: scale and minimum) or [N, K / 32, 1] (Q8_0), contiguous");
  return q4;
}

}  // namespace

at::Tensor bf16_dots_codes_linear(at::Tensor x, at::Tensor codes, at::Tensor scale_min) {
  check_x(x, "bf16_dots_codes_linear");
  const int64_t M = x.size(0), K = x.size(1), N = codes.dim() == 2 ? codes.size(0) : 0;
  [[maybe_unused]] const bool q4 = check_codes(codes, scale_min, K, "bf16_dots_codes_linear");
  auto y = at::empty({M, N}, x.options());
#ifdef PAGEDSERVE_AVX2
  if (M == 0 || N == 0) return y;
  const at::Tensor widened = widen_x(x, false);
  const float* xf = widened.data_ptr<float>();
  const auto* cp = static_cast<const uint8_t*>(codes.data_ptr());
  auto* yp = reinterpret_cast<bf16*>(y.data_ptr<at::BFloat16>());
  if (q4) codes_product<Q4_1>(xf, cp, scale_min.data_ptr<float>(), yp, M, K, N);
  else codes_product<Q8_0>(xf, cp, scale_min.data_ptr<float>(), yp, M, K, N);
#else
  TORCH_CHECK(false, "bf16_dots_codes_linear: this build has no AVX2/FMA path");
#endif
  return y;
}

at::Tensor bf16_dots_codes_expand(at::Tensor codes, at::Tensor scale_min) {
  const bool q4 = codes.scalar_type() == at::kByte;   // (else int8 Q8_0, or refused below)
  const int64_t N = codes.dim() == 2 ? codes.size(0) : 0, K = codes.dim() == 2 ? codes.size(1) * (q4 ? 2 : 1) : 0;
  check_codes(codes, scale_min, K, "bf16_dots_codes_expand");
  auto w = at::empty({N, K}, codes.options().dtype(at::kBFloat16));
#ifdef PAGEDSERVE_AVX2
  const auto* cp = static_cast<const uint8_t*>(codes.data_ptr());
  auto* wp = reinterpret_cast<bf16*>(w.data_ptr<at::BFloat16>());
  if (q4) codes_expand<Q4_1>(cp, scale_min.data_ptr<float>(), wp, K, N);
  else codes_expand<Q8_0>(cp, scale_min.data_ptr<float>(), wp, K, N);
#else
  TORCH_CHECK(false, "bf16_dots_codes_expand: this build has no AVX2/FMA path");
#endif
  return w;
}

at::Tensor bf16_dots_linear(at::Tensor x, at::Tensor w) {
  check_x(x, "bf16_dots_linear");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1),
              "bf16_dots_linear: W [N, K] bfloat16, contiguous, K matching x");
  TORCH_CHECK(x.size(1) % kBlock == 0, "bf16_dots_linear: K must be a multiple of 64");
  [[maybe_unused]] const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
#ifdef PAGEDSERVE_AVX2
  if (M == 0 || N == 0) return y;
  const at::Tensor widened = widen_x(x, M <= kWalkRows);
  const float* xf = widened.data_ptr<float>();
  const auto* wp = reinterpret_cast<const bf16*>(w.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<bf16*>(y.data_ptr<at::BFloat16>());
  if (M == 1) {
    at::parallel_for(0, N, kPanelCols, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        if (n + kRowsAhead < n1) pagedserve::ask_lines(wp + (n + kRowsAhead) * K, 2 * K);
        one_row(xf, wp, yp, n, K);
      }
    });
    return y;
  }
  if (M <= kWalkRows) {
    // output by output, its row of W walked by three rows of x at a time, or two (4 rows: two and two; from two
    // rows up this never leaves one alone)
    at::parallel_for(0, N, kPanelCols, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        if (n + kRowsAhead < n1) pagedserve::ask_lines(wp + (n + kRowsAhead) * K, 2 * K);
        for (int64_t m0 = 0; m0 < M;) {
          const int64_t left = M - m0;
          if (left >= 3 && left != 4) rows_walk<3>(xf, wp, yp, m0, n, K, N), m0 += 3;
          else rows_walk<2>(xf, wp, yp, m0, n, K, N), m0 += 2;
        }
      }
    });
    return y;
  }
  const int64_t panels = (N + kPanelCols - 1) / kPanelCols;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t c0 = p * kPanelCols, c1 = std::min(N, c0 + kPanelCols);
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
        const int64_t rows = std::min(kTileRows, M - m0);
        for (int64_t n0 = c0; n0 < c1; n0 += kTileCols) {
          const int64_t cols = std::min(kTileCols, c1 - n0);
          // the panel's first row tile asks for its columns in the thread's next panel (none past the last output)
          if (m0 == 0 && p + 1 < p1)
            pagedserve::ask_lines(wp + (n0 + kPanelCols) * K, std::min(cols, N - n0 - kPanelCols) * K * 2);
          switch (rows) {
            case 1: tile_cols<1>(cols, xf, wp, yp, m0, n0, K, N); break;
            case 2: tile_cols<2>(cols, xf, wp, yp, m0, n0, K, N); break;
            case 3: tile_cols<3>(cols, xf, wp, yp, m0, n0, K, N); break;
            default: tile_cols<kTileRows>(cols, xf, wp, yp, m0, n0, K, N); break;
          }
        }
      }
    }
  });
#else
  TORCH_CHECK(false, "bf16_dots_linear: this build has no AVX2/FMA path");
#endif
  return y;
}
