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
#include "aten.h"

#include <algorithm>

#include "simd.h"

namespace {

constexpr int64_t kBlock = 64, kLanes = 8, kSums = kBlock / kLanes;
constexpr int64_t kTileRows = 4, kTileCols = 2, kPanelCols = 32;

#ifdef PAGEDSERVE_AVX2
using pagedserve::bf16;

// sixteen bfloat16 values as float32: inputs 0-3 and 8-11 in `a`, 4-7 and 12-15 in `b` (the unpacks work
// within each 128-bit half)
inline void widen16(const bf16* p, __m256& a, __m256& b) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), zero = _mm256_setzero_si256();
  a = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
  b = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
}

// The eight running sums of one output, halved as torch halves them, then the lanes
inline float fold(const __m256* s) {
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
    for (int c = 0; c < C; ++c) y[(m0 + r) * N + n0 + c] = pagedserve::from_float<bf16>(fold(sums[r][c]));
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
  y[n] = pagedserve::from_float<bf16>(fold(sums));
}

#endif

}  // namespace

at::Tensor bf16_dots_linear(at::Tensor x, at::Tensor w) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "bf16_dots_linear: x [M, K] bfloat16, contiguous");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1),
              "bf16_dots_linear: W [N, K] bfloat16, contiguous, K matching x");
  TORCH_CHECK(x.size(1) % kBlock == 0, "bf16_dots_linear: K must be a multiple of 64");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
#ifdef PAGEDSERVE_AVX2
  if (M == 0 || N == 0) return y;
  // x as float32: in widen16's lane order for one row, in input order for the tiles
  const at::Tensor widened = at::empty({M, K}, x.options().dtype(at::kFloat));
  float* const xf = widened.data_ptr<float>();
  const auto* xp = reinterpret_cast<const bf16*>(x.data_ptr<at::BFloat16>());
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0 * K; i < r1 * K; i += 2 * kLanes) {
      __m256 a, b;
      if (M == 1) widen16(xp + i, a, b);
      else a = pagedserve::load8(xp + i), b = pagedserve::load8(xp + i + kLanes);
      _mm256_storeu_ps(xf + i, a);
      _mm256_storeu_ps(xf + i + kLanes, b);
    }
  });
  const auto* wp = reinterpret_cast<const bf16*>(w.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<bf16*>(y.data_ptr<at::BFloat16>());
  if (M == 1) {
    at::parallel_for(0, N, kPanelCols, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) one_row(xf, wp, yp, n, K);
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
