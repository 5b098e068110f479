// y[M, N] = x[M, K] . W[N, K]^T in bfloat16 on the AVX512-BF16 dot product (VDPBF16PS), for CPUs that
// have it but no AMX tiles (where oneDNN's AMX kernels are the faster route; ops/linear.py decides).
//
// Each product of two bfloat16 values is exact in float32 and the sums are float32 in oneDNN's order
// (pagedserve::onednn_bf16_chunk: chunks of 512 or 1024 inputs, each over its pairs front to back,
// then the chunks' sums; a row marked as of a one-row call in chunks of 512): y, rounded to bfloat16
// once, to nearest even, is `F.linear`'s bit for bit.
//
// Layout (bf16_pack): output rows in groups of 16; for group g and input pair (2j, 2j + 1), 32 values,
// lane l holding (W[16g + l, 2j], W[16g + l, 2j + 1]): one 64-byte load feeds one VDPBF16PS for 16
// outputs. A panel is up to 4 groups (64 outputs); a thread runs its tiles of up to 6 rows of x over it
// with 6 x 4 sixteen-lane accumulators: per input pair, 4 loads of weights and 6 broadcasts of x's pair
// feed 24 dot products. The panel (K / 2 * 256 bytes) stays in L2 for all the tiles; where a panel takes
// more than one tile, they ask for the thread's next panel meanwhile (a few rows are bound by the memory's reads,
// which would otherwise stop while the later tiles run from L2).
#include "aten.h"

#include <algorithm>
#include <cstring>

#include "simd.h"

namespace {

constexpr int64_t kGroup = 16;
constexpr int64_t kPanelGroups = 4;
constexpr int64_t kTileRows = 6;

#if defined(PAGEDSERVE_AVX512) && defined(__AVX512BF16__)
#define PAGEDSERVE_BF16_DOT 1
using pagedserve::bf16;

// y[m0 .. m0 + R, 16 n0g .. 16 (n0g + V)) from groups [n0g, n0g + V) of the packed weight, in oneDNN's
// order (simd.h): the registers sum one chunk of inputs from zero; the chunks before it wait in `done`.
// one_row (or nullptr): the rows summed as a one-row call sums them, whose chunks end more often.
// ahead: the tile's share of the thread's next panel to ask for into L2, over the pairs (simd.h).
template <int R, int V>
void tile(const bf16* x, const bf16* w, bf16* y, const bool* one_row, int64_t m0, int64_t n0g, int64_t K, int64_t N,
          pagedserve::Ahead ahead) {
  __m512 acc[R][V];
  alignas(64) float done[R][V][kGroup];
  bool started[R] = {};   // whether `done` holds a chunk yet
  const int64_t pairs = K / 2, step = pagedserve::kOneRowChunk / 2;
  const bf16* wg = w + n0g * pairs * 2 * kGroup;
  const bf16* xr = x + m0 * K;
  const bool* ones = one_row != nullptr ? one_row + m0 : nullptr;
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < V; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t j0 = 0; j0 < pairs; j0 += step) {
    for (int i = 0; i < R; ++i) {
      if (j0 == 0 || !pagedserve::chunk_ends(j0, K, ones, i)) continue;
      for (int v = 0; v < V; ++v) {
        _mm512_store_ps(done[i][v], started[i] ? _mm512_add_ps(_mm512_load_ps(done[i][v]), acc[i][v]) : acc[i][v]);
        acc[i][v] = _mm512_setzero_ps();
      }
      started[i] = true;
    }
    for (int64_t j = j0, j1 = std::min(pairs, j0 + step); j < j1; ++j) {
      __m512bh wv[V];
      for (int v = 0; v < V; ++v)
        wv[v] = (__m512bh)_mm512_loadu_si512(wg + (v * pairs + j) * 2 * kGroup);
      ahead.step();
      for (int i = 0; i < R; ++i) {
        int32_t two;
        std::memcpy(&two, xr + i * K + 2 * j, 4);
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(two);
        for (int v = 0; v < V; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], xb, wv[v]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < V; ++v) {
      if (started[i]) acc[i][v] = _mm512_add_ps(_mm512_load_ps(done[i][v]), acc[i][v]);
      pagedserve::store16(y + (m0 + i) * N + (n0g + v) * kGroup, acc[i][v]);
    }
}

template <int V>
void tile_rows(int64_t rows, const bf16* x, const bf16* w, bf16* y, const bool* one_row, int64_t m0, int64_t n0g,
               int64_t K, int64_t N, pagedserve::Ahead ahead) {
  switch (rows) {
    case 1: tile<1, V>(x, w, y, one_row, m0, n0g, K, N, ahead); break;
    case 2: tile<2, V>(x, w, y, one_row, m0, n0g, K, N, ahead); break;
    case 3: tile<3, V>(x, w, y, one_row, m0, n0g, K, N, ahead); break;
    case 4: tile<4, V>(x, w, y, one_row, m0, n0g, K, N, ahead); break;
    case 5: tile<5, V>(x, w, y, one_row, m0, n0g, K, N, ahead); break;
    default: tile<kTileRows, V>(x, w, y, one_row, m0, n0g, K, N, ahead); break;
  }
}
#endif

}  // namespace

bool has_bf16_dot() {
#ifdef PAGEDSERVE_BF16_DOT
  return true;
#else
  return false;
#endif
}

at::Tensor bf16_pack(at::Tensor w) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous(), "bf16_pack: W [N, K] bfloat16");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % kGroup == 0 && K % 2 == 0, "bf16_pack: N a multiple of 16 and K even");
  // [N / 16, K / 2, 16, 2]: row 16g + l, inputs (2j, 2j + 1) at [g, j, l]
  return w.view({N / kGroup, kGroup, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor bf16_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> one_row) {
  TORCH_CHECK(has_bf16_dot(), "bf16_linear: this build has no AVX512-BF16 dot product");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "bf16_linear: x [M, K] bfloat16");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.is_contiguous() &&
              packed.size(2) == kGroup && packed.size(3) == 2 && packed.size(1) * 2 == x.size(1),
              "bf16_linear: packed W [N / 16, K / 2, 16, 2] from bf16_pack, K matching x");
  const int64_t M = x.size(0), K = x.size(1), groups = packed.size(0), N = groups * kGroup;
  const bool* ones = pagedserve::row_flags(one_row, M, "bf16_linear");
  auto y = at::empty({M, N}, x.options());
#ifdef PAGEDSERVE_BF16_DOT
  const auto* xp = reinterpret_cast<const bf16*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const bf16*>(packed.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<bf16*>(y.data_ptr<at::BFloat16>());
  const int64_t panels = (groups + kPanelGroups - 1) / kPanelGroups;
  // The threads share the (panel, row) pairs taken panel by panel, not whole panels: SmolLM2's 576 and 960
  // outputs are 9 and 15 panels, which two threads would split 5 : 4 and 8 : 7, and a decode step's rows
  // fall into tiles of unequal size (7 rows: 6 and 1). A thread's pairs are one run: it loads a panel into
  // L2 once and runs its rows over it in tiles of near-equal size; only a panel split between two threads is
  // read by both. Every output is summed in the same order whichever thread and tile take it.
  at::parallel_for(0, panels * M, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t p = u0 / M; p < panels && p * M < u1; ++p) {
      const int64_t a = std::max(u0, p * M) - p * M, b = std::min(u1, (p + 1) * M) - p * M;
      const int64_t g0 = p * kPanelGroups, count = std::min(kPanelGroups, groups - g0);
      const int64_t tiles = (b - a + kTileRows - 1) / kTileRows;
      // the thread's next panel, if its run goes on to one, asked for into L2 while the tiles run over this one
      // (simd.h: where it pays), the lines shared out among the tiles in order
      const int64_t next = std::min(kPanelGroups, groups - g0 - kPanelGroups);
      const int64_t bytes = (p + 1) * M < u1 && next > 0 ? pagedserve::ahead_bytes(next * K * kGroup * 2, tiles) : 0;
      const bf16* const next_panel = bytes > 0 ? wp + (g0 + kPanelGroups) * K * kGroup : nullptr;
      for (int64_t t = 0, m0 = a; t < tiles; ++t) {
        const int64_t rows = pagedserve::tile_share(b - a, tiles, t);
        const pagedserve::Ahead ahead(next_panel, bytes, t, tiles, K / 2);
        switch (count) {
          case 1: tile_rows<1>(rows, xp, wp, yp, ones, m0, g0, K, N, ahead); break;
          case 2: tile_rows<2>(rows, xp, wp, yp, ones, m0, g0, K, N, ahead); break;
          case 3: tile_rows<3>(rows, xp, wp, yp, ones, m0, g0, K, N, ahead); break;
          default: tile_rows<4>(rows, xp, wp, yp, ones, m0, g0, K, N, ahead); break;
        }
        m0 += rows;
      }
    }
  });
#endif
  return y;
}
