// y[M, N] = x[M, K] . W[N, K]^T in bfloat16 on AMX tiles (TDPBF16PS), for CPUs that have them.
//
// Why a kernel of our own where oneDNN's GEMM already runs on the tiles: oneDNN sums a call of up to 32 rows over
// all of K in one tile accumulator, but a call of more rows in blocks of K whose sums it adds afterwards, the blocks
// chosen by the call's shape (row count and outputs). A row's bits then depend on how many rows share its call. A
// generated token, which transformers computes in a call of one row, must get the one-row bits whatever the batch;
// this kernel sums every row over all of K in one accumulator, as oneDNN does for a few rows, at every row count.
//
// Layout: bf16_pack's ([N / 16, K / 2, 16, 2]), which is the tiles' own: for output group g and 32 inputs from
// 32 kb, the 16 input pairs times 16 outputs times 2 are 1 KiB at [g, 16 kb], one B tile of 16 rows of 64 bytes.
// A tiles are read from x as it is (rows of 32 inputs, the row stride K). Eight tiles: four accumulators (two
// blocks of 16 rows times two groups of 16 outputs), two of x, two of W.
#include "aten.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "simd.h"

#if defined(PAGEDSERVE_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define PAGEDSERVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#ifdef PAGEDSERVE_AMX
using pagedserve::bf16;

constexpr int64_t kRows = 16;     // rows of an A or C tile
constexpr int64_t kGroup = 16;    // outputs of a B or C tile
constexpr int64_t kInputs = 32;   // inputs of an A tile's row (64 bytes)

// The 64-byte tile configuration (palette 1): bytes per row and rows of each of the eight tiles
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux lends a process the tiles' register state only once asked (arch_prctl); the answer holds for all its
// threads. oneDNN asks the same where it runs on the tiles, so asking again is harmless.
bool tiles_permitted() {
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

// The configuration for blocks of ra and rb rows (rb 0: one block): C tiles 0, 1 (block a) and 2, 3 (block b),
// A tiles 4 (a) and 5 (b), B tiles 6 and 7
void configure(int ra, int rb) {
  TileConfig cfg;
  const int rows[8] = {ra, ra, rb, rb, ra, rb, static_cast<int>(kInputs / 2), static_cast<int>(kInputs / 2)};
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(rows[t]);
    cfg.colsb[t] = rows[t] > 0 ? 64 : 0;
  }
  _tile_loadconfig(&cfg);
}

// A C tile's rows (stored to `sums`), rounded to bfloat16 (nearest, ties to even) into y's rows from y0 (row
// stride N). (The tile's number is the instruction's operand: the callers store each tile themselves.)
void store_rows(const float (*sums)[kGroup], bf16* y0, int64_t N, int rows) {
  for (int i = 0; i < rows; ++i) pagedserve::store16(y0 + i * N, _mm512_load_ps(sums[i]));
}

// Blocks of ra (and rb, where TwoM) rows from row m0, times output groups g0 (and g0 + 1, where TwoN), into y
// (row stride N). With `chunk` < K, the inputs in chunks of that many, each summed from zero in the tiles, the
// chunks' sums added in float32 in order (oneDNN's order for calls of more rows, where the call's shape makes it so)
template <bool TwoM, bool TwoN>
void block(const bf16* x, const bf16* w, bf16* y, int64_t m0, int ra, int rb, int64_t g0, int64_t K, int64_t N,
           int64_t chunk) {
  const int64_t pairs = K / 2, xstride = K * sizeof(bf16);
  const bf16* xa = x + m0 * K;
  const bf16* xb = xa + kRows * K;
  const bf16* w0 = w + g0 * pairs * 2 * kGroup;
  const bf16* w1 = w0 + pairs * 2 * kGroup;
  bf16* ya = y + m0 * N + g0 * kGroup;
  bf16* const dest[4] = {ya, ya + kGroup, ya + kRows * N, ya + kRows * N + kGroup};
  const int rows[4] = {ra, ra, rb, rb};
  alignas(64) float sums[4][kRows][kGroup];   // the chunks summed so far, per C tile (more than one chunk only)
  alignas(64) float part[kRows][kGroup];      // a C tile's chunk, stored
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    _tile_zero(0);
    if (TwoN) _tile_zero(1);
    if (TwoM) _tile_zero(2);
    if (TwoM && TwoN) _tile_zero(3);
    for (int64_t k = k0, k1 = std::min(K, k0 + chunk); k < k1; k += kInputs) {
      const int64_t at = k / 2 * 2 * kGroup;   // the B tile's first pair, k / 2
      _tile_loadd(4, xa + k, xstride);
      _tile_loadd(6, w0 + at, 64);
      if (TwoN) _tile_loadd(7, w1 + at, 64);
      if (TwoM) _tile_loadd(5, xb + k, xstride);
      _tile_dpbf16ps(0, 4, 6);
      if (TwoN) _tile_dpbf16ps(1, 4, 7);
      if (TwoM) _tile_dpbf16ps(2, 5, 6);
      if (TwoM && TwoN) _tile_dpbf16ps(3, 5, 7);
    }
    const bool first = k0 == 0, last = k0 + chunk >= K;
    // tile t's chunk (in `part`): the output where it is the only one, else added to the sums, the last time out
    auto drain = [&](int t) {
      if (first && last) return store_rows(part, dest[t], N, rows[t]);
      for (int i = 0; i < rows[t]; ++i) {
        const __m512 v = _mm512_load_ps(part[i]);
        _mm512_store_ps(sums[t][i], first ? v : _mm512_add_ps(_mm512_load_ps(sums[t][i]), v));
      }
      if (last) store_rows(sums[t], dest[t], N, rows[t]);
    };
    constexpr int64_t stride = kGroup * sizeof(float);
    _tile_stored(0, part, stride);
    drain(0);
    if (TwoN) {
      _tile_stored(1, part, stride);
      drain(1);
    }
    if (TwoM) {
      _tile_stored(2, part, stride);
      drain(2);
    }
    if (TwoM && TwoN) {
      _tile_stored(3, part, stride);
      drain(3);
    }
  }
}
#endif

}  // namespace

bool has_amx_linear() {
#ifdef PAGEDSERVE_AMX
  return tiles_permitted();
#else
  return false;
#endif
}

void amx_linear_out(at::Tensor x, at::Tensor packed, at::Tensor y, int64_t chunk,
                    c10::optional<at::Tensor> row_chunks) {
  TORCH_CHECK(has_amx_linear(), "amx_linear: this build or process has no AMX tiles");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "amx_linear: x [M, K] bfloat16");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.is_contiguous() &&
              packed.size(2) == 16 && packed.size(3) == 2 && packed.size(1) * 2 == x.size(1),
              "amx_linear: packed W [N / 16, K / 2, 16, 2] from bf16_pack, K matching x");
  TORCH_CHECK(x.size(1) % 32 == 0, "amx_linear: K a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1), groups = packed.size(0), N = groups * 16;
  TORCH_CHECK(chunk >= 0 && chunk % 32 == 0, "amx_linear: chunk 0 (all of K) or a multiple of 32");
  TORCH_CHECK(y.scalar_type() == at::kBFloat16 && y.dim() == 2 && y.stride(1) == 1 && y.size(0) == M &&
              y.size(1) == N, "amx_linear: out [M, N] bfloat16, its rows contiguous");
  // the runs of rows that share a chunk (all the rows, or runs of equal entries of row_chunks), as (start, chunk)
  std::vector<std::pair<int64_t, int64_t>> runs;
  const int64_t all = chunk > 0 ? chunk : K;
  if (row_chunks.has_value()) {
    const at::Tensor& rc = *row_chunks;
    TORCH_CHECK(rc.scalar_type() == at::kInt && rc.dim() == 1 && rc.size(0) == M && rc.is_contiguous(),
                "amx_linear: row_chunks int32 [M]");
    const int32_t* r = rc.data_ptr<int32_t>();
    for (int64_t m = 0; m < M; ++m) {
      TORCH_CHECK(r[m] >= 0 && r[m] % 32 == 0, "amx_linear: row_chunks entries 0 (chunk's) or multiples of 32");
      const int64_t c = r[m] > 0 ? r[m] : all;
      if (runs.empty() || runs.back().second != c) runs.emplace_back(m, c);
    }
  } else if (M > 0) {
    runs.emplace_back(0, all);
  }
  runs.emplace_back(M, 0);   // (the end)
  const int64_t ldy = y.stride(0);
#ifdef PAGEDSERVE_AMX
  if (M == 0) return;
  const auto* xp = reinterpret_cast<const bf16*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const bf16*>(packed.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<bf16*>(y.data_ptr<at::BFloat16>());
  const int64_t pairs_of_groups = (groups + 1) / 2;
  // The threads share the output groups, two at a time; each runs all rows over its groups, so a group's
  // weights are read from memory once and from cache for the later blocks of rows. Every output is summed in
  // the same order whichever thread takes it.
  at::parallel_for(0, pairs_of_groups, 1, [&](int64_t p0, int64_t p1) {
    int configured_a = -1, configured_b = -1;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t g0 = 2 * p;
      const bool two_n = g0 + 1 < groups;
      for (size_t run = 0; run + 1 < runs.size(); ++run) {
        const int64_t end = runs[run + 1].first, c = runs[run].second;
        for (int64_t m0 = runs[run].first; m0 < end; m0 += 2 * kRows) {
          const int ra = static_cast<int>(std::min(kRows, end - m0));
          const int rb = static_cast<int>(std::max<int64_t>(0, std::min(kRows, end - m0 - kRows)));
          if (ra != configured_a || rb != configured_b) {
            configure(ra, rb);
            configured_a = ra, configured_b = rb;
          }
          if (rb > 0 && two_n) block<true, true>(xp, wp, yp, m0, ra, rb, g0, K, ldy, c);
          else if (rb > 0) block<true, false>(xp, wp, yp, m0, ra, rb, g0, K, ldy, c);
          else if (two_n) block<false, true>(xp, wp, yp, m0, ra, rb, g0, K, ldy, c);
          else block<false, false>(xp, wp, yp, m0, ra, rb, g0, K, ldy, c);
        }
      }
    }
    if (configured_a >= 0) _tile_release();
  });
#endif
}

at::Tensor amx_linear(at::Tensor x, at::Tensor packed, int64_t chunk) {
  TORCH_CHECK(packed.dim() == 4, "amx_linear: packed W [N / 16, K / 2, 16, 2] from bf16_pack");
  auto y = at::empty({x.size(0), packed.size(0) * 16}, x.options());
  amx_linear_out(x, packed, y, chunk, c10::nullopt);
  return y;
}
