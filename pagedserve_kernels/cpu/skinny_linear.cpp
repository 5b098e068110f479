// y[M, N] = x[M, K] . W[N, K]^T for a few rows M: the linear layers of a decode step that holds
// only a handful of sequences (the tail of a batch, a lone long request).
//
// With few rows the step only has to stream the weights, but a general GEMM tiles for many rows.
// Here each weight row is loaded once and dotted with every input row while it sits in L1, and the
// rows of W are split between torch's intra-op threads. With AVX-512 a tile is four weight rows
// against up to four input rows in sixteen-lane registers; without it, two rows in eight lanes.
// Every linear layer of one SmolLM2 step, 2 threads, against MKL (F.linear), measured 2026-12-01
// (bench/cpu_kernels.py prints kernel against F.linear): 1-2 rows even (~20 ms, the memory's ~25 GB/s), 4-16
// rows 1.2-1.4x faster (8 rows: 33 against 45 ms), 24-32 rows even. The AVX2 tile took 28-48 ms
// at 1-16 rows.
#include "aten.h"

#include <algorithm>

#include "simd.h"

namespace {

constexpr int64_t kRowsPerPass = 4;   // input rows sharing one pass over a weight row

#ifdef PAGEDSERVE_AVX2
using pagedserve::hsum8;
#endif

// y[m, n] for m in [m0, m0 + rows) and n in [n0, n0 + cols): rows <= kRowsPerPass, cols <= 2.
// Two weight rows against four input rows keep eight accumulators busy per pair of loads.
inline void dot_tile(const float* x, const float* w, float* y, int64_t m0, int64_t rows, int64_t n0,
                     int64_t cols, int64_t K, int64_t N) {
  float out[2][kRowsPerPass] = {};
  const float* w0 = w + n0 * K;
  const float* w1 = cols > 1 ? w0 + K : w0;   // a lone last row is computed twice, stored once
  int64_t k = 0;
#ifdef PAGEDSERVE_AVX2
  __m256 a0[kRowsPerPass], a1[kRowsPerPass];
  for (int64_t i = 0; i < kRowsPerPass; ++i) a0[i] = a1[i] = _mm256_setzero_ps();
  if (rows == kRowsPerPass) {   // the common case: eight named accumulators stay in registers
    const float *x0 = x + m0 * K, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K;
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00;
    __m256 c10 = c00, c11 = c00, c12 = c00, c13 = c00;
    for (; k + 8 <= K; k += 8) {
      const __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k);
      __m256 xv = _mm256_loadu_ps(x0 + k);
      c00 = _mm256_fmadd_ps(xv, v0, c00); c10 = _mm256_fmadd_ps(xv, v1, c10);
      xv = _mm256_loadu_ps(x1 + k);
      c01 = _mm256_fmadd_ps(xv, v0, c01); c11 = _mm256_fmadd_ps(xv, v1, c11);
      xv = _mm256_loadu_ps(x2 + k);
      c02 = _mm256_fmadd_ps(xv, v0, c02); c12 = _mm256_fmadd_ps(xv, v1, c12);
      xv = _mm256_loadu_ps(x3 + k);
      c03 = _mm256_fmadd_ps(xv, v0, c03); c13 = _mm256_fmadd_ps(xv, v1, c13);
    }
    a0[0] = c00; a0[1] = c01; a0[2] = c02; a0[3] = c03;
    a1[0] = c10; a1[1] = c11; a1[2] = c12; a1[3] = c13;
  } else {
    for (; k + 8 <= K; k += 8) {
      const __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k);
      for (int64_t i = 0; i < rows; ++i) {
        const __m256 xv = _mm256_loadu_ps(x + (m0 + i) * K + k);
        a0[i] = _mm256_fmadd_ps(xv, v0, a0[i]);
        a1[i] = _mm256_fmadd_ps(xv, v1, a1[i]);
      }
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    out[0][i] = hsum8(a0[i]);
    out[1][i] = hsum8(a1[i]);
  }
#endif
  for (; k < K; ++k)
    for (int64_t i = 0; i < rows; ++i) {
      out[0][i] += x[(m0 + i) * K + k] * w0[k];
      out[1][i] += x[(m0 + i) * K + k] * w1[k];
    }
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < cols; ++c) y[(m0 + i) * N + n0 + c] = out[c][i];
}

#ifdef PAGEDSERVE_AVX512
constexpr int64_t kWeightRowsPerTile = 4;

// y[m, n] for m in [m0, m0 + R) and n in [n0, n0 + cols), cols <= 4: four weight rows against R
// input rows, 4R sixteen-lane accumulators. Per 16 columns of K: 4 weight loads and R input loads
// feed 4R FMAs, so at R = 4 the loads no longer outnumber the FMAs as in the AVX2 tile. A missing
// weight row (cols < 4 at the end of W) repeats the last one and is not stored. The K tail is read
// with a lane mask.
template <int R>
inline void dot_tile16(const float* x, const float* w, float* y, int64_t m0, int64_t n0, int64_t cols,
                       int64_t K, int64_t N) {
  const float* wr[4];
  for (int c = 0; c < 4; ++c) wr[c] = w + (n0 + std::min<int64_t>(c, cols - 1)) * K;
  const float* xr[R];
  for (int i = 0; i < R; ++i) xr[i] = x + (m0 + i) * K;
  __m512 acc[4][R];
  for (int c = 0; c < 4; ++c)
    for (int i = 0; i < R; ++i) acc[c][i] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 w0 = _mm512_loadu_ps(wr[0] + k), w1 = _mm512_loadu_ps(wr[1] + k);
    const __m512 w2 = _mm512_loadu_ps(wr[2] + k), w3 = _mm512_loadu_ps(wr[3] + k);
    for (int i = 0; i < R; ++i) {
      const __m512 xv = _mm512_loadu_ps(xr[i] + k);
      acc[0][i] = _mm512_fmadd_ps(xv, w0, acc[0][i]);
      acc[1][i] = _mm512_fmadd_ps(xv, w1, acc[1][i]);
      acc[2][i] = _mm512_fmadd_ps(xv, w2, acc[2][i]);
      acc[3][i] = _mm512_fmadd_ps(xv, w3, acc[3][i]);
    }
  }
  if (k < K) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (K - k)) - 1u);
    __m512 wv[4];
    for (int c = 0; c < 4; ++c) wv[c] = _mm512_maskz_loadu_ps(tail, wr[c] + k);
    for (int i = 0; i < R; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(tail, xr[i] + k);
      for (int c = 0; c < 4; ++c) acc[c][i] = _mm512_fmadd_ps(xv, wv[c], acc[c][i]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < cols; ++c) y[(m0 + i) * N + n0 + c] = _mm512_reduce_add_ps(acc[c][i]);
}

// the rows [m0, m0 + rows) of y for the weight rows [n0, n0 + cols), rows <= kRowsPerPass
inline void dot_rows16(const float* x, const float* w, float* y, int64_t m0, int64_t rows, int64_t n0,
                       int64_t cols, int64_t K, int64_t N) {
  switch (rows) {
    case 1: dot_tile16<1>(x, w, y, m0, n0, cols, K, N); break;
    case 2: dot_tile16<2>(x, w, y, m0, n0, cols, K, N); break;
    case 3: dot_tile16<3>(x, w, y, m0, n0, cols, K, N); break;
    default: dot_tile16<4>(x, w, y, m0, n0, cols, K, N); break;
  }
}
#endif

}  // namespace

at::Tensor skinny_linear(at::Tensor x, at::Tensor w) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "skinny_linear: float32 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "skinny_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "skinny_linear: contiguous inputs");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // grain 32: a task streams at least 32 weight rows, and even the small K/V projections (192
  // rows for SmolLM2) are split between two threads
#ifdef PAGEDSERVE_AVX512
  at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n += kWeightRowsPerTile)
      for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass)
        dot_rows16(xp, wp, yp, m0, std::min(kRowsPerPass, M - m0), n, std::min(kWeightRowsPerTile, n1 - n), K, N);
  });
  return y;
#endif
  at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n += 2)
      for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass)
        dot_tile(xp, wp, yp, m0, std::min(kRowsPerPass, M - m0), n, std::min<int64_t>(2, n1 - n), K, N);
  });
  return y;
}
