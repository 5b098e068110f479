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
// torch's GEMM computes output after output without reusing a loaded weight across rows; here a tile
// of 3 rows x 4 outputs takes the running sums of one vector position v at a time (12 registers), so
// each weight vector loaded feeds 3 rows, and x is widened to float32 once. K must be a multiple of 64
// (the tails torch adds after the blocks are not followed; ops/linear.py routes other shapes to torch).
#include "aten.h"

#include <algorithm>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t kBlock = 64, kLanes = 8, kSums = kBlock / kLanes;
constexpr int64_t kTileRows = 3, kTileCols = 4, kPanelCols = 32;

#ifdef PAGEDSERVE_AVX2
using pagedserve::bf16;

inline __m256 widen8(const bf16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
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

// rows [m0, m0 + R) x outputs [n0, n0 + C): xf is x widened, sums[r][c][v] the running sums
template <int R, int C>
void tile(const float* xf, const bf16* w, bf16* y, int64_t m0, int64_t n0, int64_t K, int64_t N) {
  __m256 sums[R][C][kSums];
  for (int64_t v = 0; v < kSums; ++v) {
    __m256 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t k = v * kLanes; k < K; k += kBlock) {
      __m256 xv[R];
      for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(xf + (m0 + r) * K + k);
      for (int c = 0; c < C; ++c) {
        const __m256 wv = widen8(w + (n0 + c) * K + k);
        for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) sums[r][c][v] = acc[r][c];
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[(m0 + r) * N + n0 + c] = pagedserve::from_float<bf16>(fold(sums[r][c]));
}

template <int R>
void tile_cols(int64_t cols, const float* xf, const bf16* w, bf16* y, int64_t m0, int64_t n0, int64_t K, int64_t N) {
  switch (cols) {
    case 1: tile<R, 1>(xf, w, y, m0, n0, K, N); break;
    case 2: tile<R, 2>(xf, w, y, m0, n0, K, N); break;
    case 3: tile<R, 3>(xf, w, y, m0, n0, K, N); break;
    default: tile<R, kTileCols>(xf, w, y, m0, n0, K, N); break;
  }
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
  std::vector<float> widened(M * K);
  const auto* xp = reinterpret_cast<const bf16*>(x.data_ptr<at::BFloat16>());
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0 * K; i < r1 * K; ++i) widened[i] = pagedserve::to_float(xp[i]);
  });
  const float* xf = widened.data();
  const auto* wp = reinterpret_cast<const bf16*>(w.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<bf16*>(y.data_ptr<at::BFloat16>());
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
