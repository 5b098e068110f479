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
//
// amx_codes_linear takes W from its GGUF Q4_1 codes in the pair order (ops/quantized.Codes.paired_order) instead:
// up to 32 rows (one pass of the tiles), each step's B tiles are expanded into L1 just before the tiles take them;
// with more rows a thread expands a pair of groups' B tiles once into a buffer (in L2), then runs every block of
// rows over it as above. A step of a few dozen rows is bound by reading W, and the codes are 5 bits a weight
// against 16; the expansion runs on the vector units beside the tiles. Its tiles are bf16_pack's of the bfloat16 weight
// the codes round to (ops/linear.py checks that at load, amx_codes_expand), so are the outputs.
#include "aten.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "simd.h"

#if defined(PAGEDSERVE_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define PAGEDSERVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__AVX512BF16__)
#define PAGEDSERVE_AMX_CODES 1   // (the expansion rounds with AVX512-BF16's conversion)
#endif
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

// B tiles in bf16_pack's layout: group g0's from w0, those of g0 + 1 right after them (K / 2 pairs each)
struct Packed {
  const bf16* w0;
  int64_t K;
  template <bool TwoN>
  void step(int64_t k, const bf16*& b0, const bf16*& b1) const {
    b0 = w0 + k * kGroup;   // (the B tile's first pair, k / 2, times 2 x 16)
    b1 = b0 + K * kGroup;
  }
};

// Blocks of ra (and rb, where TwoM) rows from row m0, times output groups g0 (and g0 + 1, where TwoN), into y
// (row stride N), each step's B tiles from `tiles` (Packed, or Codes below). With `chunk` < K, the inputs in chunks
// of that many, each summed from zero in the tiles, the chunks' sums added in float32 in order (oneDNN's order for
// calls of more rows, where the call's shape makes it so)
template <bool TwoM, bool TwoN, typename Tiles>
void block(const bf16* x, const Tiles& tiles, bf16* y, int64_t m0, int ra, int rb, int64_t g0, int64_t K, int64_t N,
           int64_t chunk) {
  const int64_t xstride = K * sizeof(bf16);
  const bf16* xa = x + m0 * K;
  const bf16* xb = xa + kRows * K;
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
      const bf16 *b0, *b1;
      tiles.template step<TwoN>(k, b0, b1);
      _tile_loadd(4, xa + k, xstride);
      _tile_loadd(6, b0, 64);
      if (TwoN) _tile_loadd(7, b1, 64);
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

// Blocks of up to 32 rows, runs (start, chunk) of rows with their chunk ((M, 0) ends them), times output groups
// g0 and g0 + 1 (where two_n) from `tiles`
template <typename Tiles>
void rows_over(const bf16* x, const Tiles& tiles, bf16* y, int64_t g0, bool two_n, int64_t K, int64_t N,
               const std::vector<std::pair<int64_t, int64_t>>& runs, int& configured_a, int& configured_b) {
  for (size_t run = 0; run + 1 < runs.size(); ++run) {
    const int64_t end = runs[run + 1].first, c = runs[run].second;
    for (int64_t m0 = runs[run].first; m0 < end; m0 += 2 * kRows) {
      const int ra = static_cast<int>(std::min(kRows, end - m0));
      const int rb = static_cast<int>(std::max<int64_t>(0, std::min(kRows, end - m0 - kRows)));
      if (ra != configured_a || rb != configured_b) {
        configure(ra, rb);
        configured_a = ra, configured_b = rb;
      }
      if (rb > 0 && two_n) block<true, true>(x, tiles, y, m0, ra, rb, g0, K, N, c);
      else if (rb > 0) block<true, false>(x, tiles, y, m0, ra, rb, g0, K, N, c);
      else if (two_n) block<false, true>(x, tiles, y, m0, ra, rb, g0, K, N, c);
      else block<false, false>(x, tiles, y, m0, ra, rb, g0, K, N, c);
    }
  }
}
#endif

#ifdef PAGEDSERVE_AMX_CODES
// A group's Q4_1 codes in the pair order (16 bytes per input pair j: byte 2r + e holds the code of (row r, input
// 2j + e) in its low nibble and of row 8 + r in its high one) and its float16 scales and minimums per 32 inputs
struct Q4Group {
  const uint8_t* codes;
  const uint16_t* scales;
  const uint16_t* mins;
};

// How far ahead the expansion asks for the codes: the hardware's streamer alone left it waiting on them
constexpr int64_t kCodesAhead = 2048;

// Inputs 32 s .. 32 s + 31 of group q expanded into their B tile at dst (16 pairs x 16 rows x 2 bfloat16): scale *
// code + min in float32 (the product is exact, so one FMA rounds as the separate operations do), rounded to
// bfloat16 (nearest, ties to even). The low nibbles of a pair's line are its tile row's first 16 values (rows 0-7,
// two inputs each), the high ones the last 16.
inline void expand_step(const Q4Group& q, int64_t s, bf16* dst) {
  const __m512i low_rows = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i high_rows = _mm512_add_epi32(low_rows, _mm512_set1_epi32(8));
  const __m512i nibble = _mm512_set1_epi32(15);
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.scales + kGroup * s)));
  const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.mins + kGroup * s)));
  const __m512 d_low = _mm512_permutexvar_ps(low_rows, d), d_high = _mm512_permutexvar_ps(high_rows, d);
  const __m512 m_low = _mm512_permutexvar_ps(low_rows, m), m_high = _mm512_permutexvar_ps(high_rows, m);
  const uint8_t* line = q.codes + kGroup * kInputs / 2 * s;
  pagedserve::ask_lines(line + kCodesAhead, kInputs / 2 * kGroup);
  // (the scales and minimums as many steps ahead: 32 bytes each a step against the codes' 256)
  __builtin_prefetch(q.scales + kGroup * s + kCodesAhead / 16, 0, 3);
  __builtin_prefetch(q.mins + kGroup * s + kCodesAhead / 16, 0, 3);
  for (int64_t j = 0; j < kInputs / 2; ++j) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(line + kGroup * j)));
    const __m512 low = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(c, nibble)), d_low, m_low);
    const __m512 high = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(c, 4)), d_high, m_high);
    _mm512_store_si512(dst + 2 * kGroup * j, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low)));
  }
}

// Group q's B tiles for all K inputs at dst ([K / 2][16][2])
void expand_q4_1(const Q4Group& q, bf16* dst, int64_t K) {
  for (int64_t s = 0; s < K / kInputs; ++s) expand_step(q, s, dst + kInputs * kGroup * s);
}

// The B tiles of groups q[0] (and q[1]) expanded from their codes step by step, just before the tiles take them,
// into `buffer` (two pairs of B tiles in turn: 4 KiB, in L1)
struct Codes {
  const Q4Group* q;
  bf16* buffer;
  template <bool TwoN>
  void step(int64_t k, const bf16*& b0, const bf16*& b1) const {
    const int64_t s = k / kInputs;
    bf16* const pair = buffer + (s % 2) * 2 * kInputs * kGroup;
    expand_step(q[0], s, pair);
    if (TwoN) expand_step(q[1], s, pair + kInputs * kGroup);
    b0 = pair, b1 = pair + kInputs * kGroup;
  }
};
#endif

// checks amx_codes_linear's codes: Q4_1 in the pair order, for K inputs
void check_codes(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins, int64_t K,
                 const char* what) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && codes.is_contiguous() && codes.size(2) == 16 &&
              codes.size(1) * 2 == K && K % 32 == 0,
              what, ": Q4_1 codes uint8 [N / 16, K / 2, 16] in the pair order, K a multiple of 32");
  for (const at::Tensor* t : {&scales, &mins})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->dim() == 3 && t->is_contiguous() && t->size(0) == codes.size(0) &&
                t->size(1) * 32 == K && t->size(2) == 16, what, ": scales and minimums float16 [N / 16, K / 32, 16]");
}

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
    for (int64_t p = p0; p < p1; ++p)
      rows_over(xp, Packed{wp + 2 * p * K * kGroup, K}, yp, 2 * p, 2 * p + 1 < groups, K, ldy, runs, configured_a,
                configured_b);
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

bool has_amx_codes_linear() {
#ifdef PAGEDSERVE_AMX_CODES
  return tiles_permitted();
#else
  return false;
#endif
}

at::Tensor amx_codes_expand(at::Tensor codes, at::Tensor scales, at::Tensor mins) {
  TORCH_CHECK(has_amx_codes_linear(), "amx_codes_expand: this build or process has no AMX tiles and AVX512-BF16");
  const int64_t K = codes.dim() == 3 ? codes.size(1) * 2 : 0;
  check_codes(codes, scales, mins, K, "amx_codes_expand");
  const int64_t groups = codes.size(0);
  auto w = at::empty({groups, K / 2, 16, 2}, codes.options().dtype(at::kBFloat16));
#ifdef PAGEDSERVE_AMX_CODES
  const auto* cp = codes.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const auto* mp = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  auto* wp = reinterpret_cast<bf16*>(w.data_ptr<at::BFloat16>());
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      expand_q4_1({cp + g * K / 2 * 16, sp + g * K / 32 * 16, mp + g * K / 32 * 16}, wp + g * K * 16, K);
  });
#endif
  return w;
}

at::Tensor amx_codes_linear(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor mins) {
  TORCH_CHECK(has_amx_codes_linear(), "amx_codes_linear: this build or process has no AMX tiles and AVX512-BF16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "amx_codes_linear: x [M, K] bfloat16, contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  check_codes(codes, scales, mins, K, "amx_codes_linear");
  const int64_t groups = codes.size(0), N = groups * 16;
  auto y = at::empty({M, N}, x.options());
#ifdef PAGEDSERVE_AMX_CODES
  if (M == 0 || N == 0) return y;
  const auto* xp = reinterpret_cast<const bf16*>(x.data_ptr<at::BFloat16>());
  const auto* cp = codes.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const auto* mp = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  auto* yp = reinterpret_cast<bf16*>(y.data_ptr<at::BFloat16>());
  const std::vector<std::pair<int64_t, int64_t>> runs = {{0, K}, {M, 0}};
  const int64_t pairs_of_groups = (groups + 1) / 2;
  // as amx_linear_out: the threads share the output groups two at a time. Up to 32 rows (one block of rows), each
  // step's B tiles are expanded as the tiles take them; more rows, each pair's B tiles are expanded once into the
  // thread's buffer (in L2) and every block of rows runs over them there
  const bool one_pass = M <= 2 * kRows;
  at::parallel_for(0, pairs_of_groups, 1, [&](int64_t p0, int64_t p1) {
    const size_t bytes = (one_pass ? 4 * kInputs : 2 * K) * kGroup * sizeof(bf16);
    bf16* tiles = static_cast<bf16*>(std::aligned_alloc(64, bytes));
    TORCH_CHECK(tiles != nullptr, "amx_codes_linear: no memory for the tiles' buffer");
    int configured_a = -1, configured_b = -1;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t g0 = 2 * p;
      const bool two_n = g0 + 1 < groups;
      Q4Group q[2];
      for (int64_t i = 0; i < (two_n ? 2 : 1); ++i)
        q[i] = {cp + (g0 + i) * K / 2 * 16, sp + (g0 + i) * K / 32 * 16, mp + (g0 + i) * K / 32 * 16};
      if (one_pass) {
        rows_over(xp, Codes{q, tiles}, yp, g0, two_n, K, N, runs, configured_a, configured_b);
        continue;
      }
      for (int64_t i = 0; i < (two_n ? 2 : 1); ++i) expand_q4_1(q[i], tiles + i * K * kGroup, K);
      rows_over(xp, Packed{tiles, K}, yp, g0, two_n, K, N, runs, configured_a, configured_b);
    }
    if (configured_a >= 0) _tile_release();
    std::free(tiles);
  });
#endif
  return y;
}
