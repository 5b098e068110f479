// The greedy token of float32 rows x [M, K] through an output layer held as Q8_0 codes (W[n, k] =
// scale * code, ops/quantized.py): the first index of the largest logit, with the bits the full product
// (coded_linear) gives, without computing most of the 49,152 logits exactly.
//
// A first pass computes every logit approximately in integers: each block b of 32 inputs of a row of x is
// rounded to int8 codes q with its own scale s_b = max |x| / 127, and the output layer's own codes are
// multiplied by them with VPDPBUSD, 64 products per instruction (16 float32 FMAs take one). The
// approximate logit Q_n is then the real product sum_k w_nk x_k less sum_k w_nk e_k, where e = x - s q is
// the rounding of x, known per row; by Cauchy-Schwarz, per block, that difference is at most
// |w_nb| |e_b| (Euclidean norms: the layer's computed once, x's when it is rounded). So the real product
// is within B_n = sum_b (|w_nb| |e_b| + 0.01 s_b |scale_nb| sum |codes of the block|) of Q_n: the second
// term covers every float rounding, the exact chain's own included (a 576-term chain: under half of it).
// Only an output whose upper end Q_n + B_n reaches the largest lower end max(Q_i - B_i) can be the
// argmax; those few are then computed exactly, in coded_linear's order (the FMA chain over k = 0..K-1,
// each weight the rounded product scale * code), and the first largest of them is the token. Activations
// whose blocks differ by orders of magnitude (a few outlier channels) are why the scale is per block and
// not per row. (The bound per block s_b / 2 * sum |w_nb|, which assumes every e_k at its largest and of
// w's sign, left several times the candidates on SmolLM2's states.)
//
// A plain output layer (weights w that are not codes) is read through Q8_0 codes found near it at start
// (ops/greedy_head.py): w = scale * code + r, and the real product differs from the codes' by sum r x, at most
// |r_b| |x_b| per block (Cauchy-Schwarz again: r's norms computed once, x's when it is rounded), which widens
// B_n. Its candidates' logits are then the weight's own, as its route computes them: panel_linear's FMA chain
// over k (float32), or bf16_linear's sums (bfloat16, below).
//
// The pass is two sweeps over the layer (approx_all). The first computes every approximate logit and bounds
// each group of 16 outputs at once, by the group's widest bound (each block's largest norm and sum over the
// group): enough for a lower end of the row's largest logit. The second bounds each output only in the few
// groups whose largest approximate logit plus that bound reaches it.
//
// The first pass reads the codes plus 128 as unsigned bytes (VPDPBUSD multiplies unsigned by signed), laid
// out [N / 16, K / 4, 16, 4]: for group g and inputs 4j..4j+3, the 16 rows' four codes, one 32-bit lane
// per row; sum (c + 128) q = sum c q + 128 sum q, so each block's accumulator starts at -128 * sum q.
//
// Without AVX512-VNNI, AVX2 does the same pass in eight lanes with VPMADDUBSW, which adds two unsigned x
// signed byte products into a saturating int16, then VPMADDWD by ones, which adds two of those into the
// int32 lane: two instructions for what VPDPBUSD does in one, still about twice the products per cycle of
// float32 FMAs. For the int16 never to saturate, 2 * 255 * |q| must stay under 32768, so x's codes there
// span -64..64 (kLevels): e doubles, and with it the bound, which leaves more candidates.
#include "aten.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "simd.h"

// the exact recomputation must round the weight's product before the FMA, as the expansion does
#pragma GCC optimize("fp-contract=off")

#if defined(PAGEDSERVE_AVX512) && defined(__AVX512VNNI__)
#define PAGEDSERVE_Q8_ARGMAX 1
#define PAGEDSERVE_Q8_ARGMAX_VNNI 1
#elif defined(PAGEDSERVE_AVX2)
#define PAGEDSERVE_Q8_ARGMAX 1
#endif
// a bfloat16 output layer's exact logits as bf16_linear.cpp computes them (VDPBF16PS)
#if defined(PAGEDSERVE_Q8_ARGMAX) && defined(PAGEDSERVE_AVX512) && defined(__AVX512BF16__)
#define PAGEDSERVE_BF16_ARGMAX 1
#endif
// and as bf16_dots_linear.cpp computes them (torch's own GEMM's order, where that is the route: AVX2)
#if defined(PAGEDSERVE_Q8_ARGMAX) && defined(PAGEDSERVE_AVX2)
#define PAGEDSERVE_BF16_DOTS_ARGMAX 1
#endif

namespace {

constexpr int64_t kGroup = 16;
constexpr int64_t kBlock = 32;
constexpr int kTile = 4;            // rows of x per register tile
constexpr float kSlack = 0.01f;     // the bound's share for every float rounding (above)
#ifdef PAGEDSERVE_Q8_ARGMAX_VNNI
constexpr int kTileGroups = 3;      // groups of 16 outputs per register tile: 12 accumulators, 12 sums
constexpr int32_t kLevels = 127;    // x's codes span -kLevels..kLevels
#else
constexpr int32_t kLevels = 64;     // VPMADDUBSW's int16 sums (see above)
#endif

// the output layer as the kernel reads it (q8_argmax's arguments say the layouts)
struct Head {
  const uint8_t* packed;    // codes + 128, [N / 16, K / 4, 16, 4]
  const at::Half* scales;   // [N / 16, K / 32, 16]
  const float* absums;      // |scale| * sum |codes| per block (a plain weight's: at least sum |w|), [N / 16, K / 32, 16]
  const float* norms;       // the Euclidean norm of the block's weights, rounded up, [N / 16, K / 32, 16]
  const float* widest;      // per group and block the largest of its 16 norms, then of its absums (then of its
                            // resids), [N / 16, 2 or 3, K / 32]
  const float* resid;       // plain weights: the Euclidean norm of the block's w - scale * code, rounded up,
                            // [N / 16, K / 32, 16]; null where the weights are the codes
};

// one row of x in int8 blocks: codes, per block scale, -128 * sum of the block's codes and the norm of
// the block's rounding x - s q
struct QuantRows {
  std::vector<int8_t> q;      // [M, K]
  std::vector<float> s;       // [M, K / 32]
  std::vector<int32_t> corr;  // [M, K / 32]
  std::vector<float> err;     // [M, K / 32], rounded up
  std::vector<char> finite;   // [M]
  std::vector<float> xnorm;   // [M, K / 32]: the Euclidean norm of the block of x, rounded up (plain weights)
  // err and s again by block, [K / 32, padded], each block's rows padded with zeros to a multiple of 16: what
  // the widest bounds of a group read 16 rows at a time (AVX512-VNNI)
  std::vector<float> err_t, s_t, xnorm_t;
  int64_t padded = 0;
};

// the norm of x_b - s q_b over a block, in double (each difference is exact there: s q has at most 32
// significant bits and lies within s of x), rounded up to float
float rounding_norm(const float* xb, const int8_t* qb, float s) {
  double sum = 0.0;
  for (int64_t i = 0; i < kBlock; ++i) {
    const double e = static_cast<double>(xb[i]) - static_cast<double>(s) * qb[i];
    sum += e * e;
  }
  // sqrt and the sum's roundings are relative errors near 1e-15: a bump of 1e-6 covers them
  const double norm = std::sqrt(sum) * (1.0 + 1e-6);
  const float f = static_cast<float>(norm);
  return static_cast<double>(f) >= norm ? f : std::nextafter(f, std::numeric_limits<float>::infinity());
}

QuantRows quantize(const float* x, int64_t M, int64_t K, bool norms) {
  const int64_t blocks = K / kBlock;
  QuantRows r{std::vector<int8_t>(M * K), std::vector<float>(M * blocks), std::vector<int32_t>(M * blocks),
              std::vector<float>(M * blocks), std::vector<char>(M, 1),
              std::vector<float>(norms ? M * blocks : 0, 0.f)};
  static const int8_t kZeros[kBlock] = {};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + m * K + b * kBlock;
      // the norm of x's block, which weighs a plain weight's distance from its codes (x - 0 q)
      if (norms) r.xnorm[m * blocks + b] = rounding_norm(xb, kZeros, 0.f);
      float top = 0.f;
      for (int64_t i = 0; i < kBlock; ++i) {
        if (!std::isfinite(xb[i])) r.finite[m] = 0;
        top = std::max(top, std::fabs(xb[i]));
      }
      const float inv = static_cast<float>(kLevels) / top;
      if (!r.finite[m] || !std::isfinite(inv)) {
        // zeros, or values so small that kLevels / max overflows: codes 0, so e = x
        std::fill_n(r.q.data() + m * K + b * kBlock, kBlock, int8_t{0});
        r.s[m * blocks + b] = 2.f * top;
        r.corr[m * blocks + b] = 0;
        r.err[m * blocks + b] = r.finite[m] ? rounding_norm(xb, r.q.data() + m * K + b * kBlock, 0.f) : 0.f;
        continue;
      }
      int32_t sum = 0;
      for (int64_t i = 0; i < kBlock; ++i) {
        const int32_t q = std::clamp(static_cast<int32_t>(std::nearbyint(xb[i] * inv)), -kLevels, kLevels);
        r.q[m * K + b * kBlock + i] = static_cast<int8_t>(q);
        sum += q;
      }
      r.s[m * blocks + b] = top / static_cast<float>(kLevels);
      r.corr[m * blocks + b] = -128 * sum;
      r.err[m * blocks + b] = rounding_norm(xb, r.q.data() + m * K + b * kBlock, r.s[m * blocks + b]);
    }
#ifdef PAGEDSERVE_Q8_ARGMAX_VNNI
  r.padded = (M + kGroup - 1) / kGroup * kGroup;
  r.err_t.assign(blocks * r.padded, 0.f);
  r.s_t.assign(blocks * r.padded, 0.f);
  r.xnorm_t.assign(norms ? blocks * r.padded : 0, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      r.err_t[b * r.padded + m] = r.err[m * blocks + b];
      r.s_t[b * r.padded + m] = r.s[m * blocks + b];
      if (norms) r.xnorm_t[b * r.padded + m] = r.xnorm[m * blocks + b];
    }
#endif
  return r;
}

// The least float that rounds to bfloat16 (to nearest even) at or above lower's own rounding: the midpoint
// between that bfloat16 value and the one below it. A logit under it rounds below the rounded lower end, so
// below the largest logit's bfloat16 value: it can neither be the largest nor tie with it.
inline float bf16_floor(float lower) {
  if (!std::isfinite(lower)) return lower;
  const pagedserve::bf16 at = pagedserve::from_float<pagedserve::bf16>(lower);
  const float rounded = pagedserve::to_float(at);
  // the next bfloat16 value down: one step less in magnitude above zero, one more at or below it (-0 included)
  const pagedserve::bf16 below = rounded > 0.f ? static_cast<pagedserve::bf16>(at - 1)
                                 : at == 0 ? static_cast<pagedserve::bf16>(0x8001) : static_cast<pagedserve::bf16>(at + 1);
  return 0.5f * (rounded + pagedserve::to_float(below));   // exact: one bit past bfloat16's
}

// the rows of head.widest a group has per block: norms and absums, and resids for a plain weight
inline int64_t rows_of_widest(const Head& head) { return head.resid != nullptr ? 3 : 2; }

// per row of x: the largest lower end seen, and the outputs whose upper end reached the lower end seen
// so far (a superset of those reaching the final one), in increasing order. `rounded`: the logits are
// rounded to bfloat16, where outputs within the lower end's rounding can tie with the largest: an output is
// kept while its upper end reaches bf16_floor of the lower end
struct Found {
  std::vector<float> lower;
  std::vector<std::vector<std::pair<int64_t, float>>> outputs;
  bool rounded = false;

  float reach(int64_t m) const { return rounded ? bf16_floor(lower[m]) : lower[m]; }
};

#ifdef PAGEDSERVE_Q8_ARGMAX
// the outputs n0 .. n0 + 15 whose upper end reaches the row's largest lower end so far, given their
// approximate logits and their bounds; the lower end is taken over all 16 outputs of the group first
inline void keep_reaching(const float* total, const float* bound, int64_t m, int64_t n0, Found& found) {
  float& lower = found.lower[m];
  alignas(32) float up[kGroup];
  for (int h = 0; h < 2; ++h) {
    const __m256 margin = _mm256_loadu_ps(bound + 8 * h);
    const __m256 total8 = _mm256_loadu_ps(total + 8 * h);
    alignas(32) float low[8];
    _mm256_store_ps(low, _mm256_sub_ps(total8, margin));
    _mm256_store_ps(up + 8 * h, _mm256_add_ps(total8, margin));
    for (float v : low) lower = std::max(lower, v);
  }
  const float floor = found.reach(m);
  for (int h = 0; h < 2; ++h) {
    unsigned reach = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_load_ps(up + 8 * h), _mm256_set1_ps(floor), _CMP_GE_OQ));
    while (reach) {
      const int l = __builtin_ctz(reach);
      reach &= reach - 1;
      found.outputs[m].emplace_back(n0 + 8 * h + l, up[8 * h + l]);
    }
  }
}
#endif

#ifdef PAGEDSERVE_Q8_ARGMAX_VNNI
// The widest bound of groups g .. g + C - 1 for every row, into wides[(g + c) * M + m]: from each block's
// largest norm and sum over the group's outputs, 16 rows a time from x's errors and scales laid out by block.
// Summed as an output's own bound is (reaching_groups), each term with a coefficient no smaller: never less
// than the bound of any output of the group.
void group_wides(const QuantRows& xq, int64_t M, const Head& head, int64_t g, int C, int64_t blocks, float slack,
                 float* wides) {
  for (int c = 0; c < C; ++c) {
    const float* widest = head.widest + (g + c) * rows_of_widest(head) * blocks;
    for (int64_t m0 = 0; m0 < M; m0 += kGroup) {
      __m512 sum = _mm512_setzero_ps(), cover = _mm512_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        sum = _mm512_fmadd_ps(_mm512_set1_ps(widest[b]), _mm512_loadu_ps(xq.err_t.data() + b * xq.padded + m0), sum);
        cover = _mm512_fmadd_ps(_mm512_set1_ps(widest[blocks + b]), _mm512_loadu_ps(xq.s_t.data() + b * xq.padded + m0),
                                cover);
      }
      if (head.resid != nullptr)
        for (int64_t b = 0; b < blocks; ++b)
          sum = _mm512_fmadd_ps(_mm512_set1_ps(widest[2 * blocks + b]),
                                _mm512_loadu_ps(xq.xnorm_t.data() + b * xq.padded + m0), sum);
      const __mmask16 live = M - m0 >= kGroup ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (M - m0)) - 1);
      _mm512_mask_storeu_ps(wides + (g + c) * M + m0, live, _mm512_fmadd_ps(cover, _mm512_set1_ps(slack), sum));
    }
  }
}

// R rows of x against C groups of 16 outputs from g: each weight load feeds R products and each broadcast
// of x C of them (one load per product held VPDPBUSD to about a third of its rate). Each (row, group)'s 16
// approximate logits go to totals[((g + c) * M + m) * 16], their largest to tops[(g + c) * M + m], and the
// row's lower end rises to that less the group's widest bound: no output's own bound here, 36 FMAs beside
// the 144 VPDPBUSD of a row and group (the second sweep bounds the few groups that can still hold the top).
template <int R, int C, bool Ask>
void approx_tile(const QuantRows& xq, int64_t M, int64_t m0, const Head& head, int64_t g, int64_t K, float* totals,
                 float* tops, const float* wides, float* lower, pagedserve::Ahead ahead) {
  const int64_t blocks = K / kBlock;
  __m512 total[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) total[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i acc[R][C];
    for (int r = 0; r < R; ++r) {
      const __m512i start = _mm512_set1_epi32(xq.corr[(m0 + r) * blocks + b]);
      for (int c = 0; c < C; ++c) acc[r][c] = start;
    }
    // the first tile of rows asks for the next C groups' scales at the place read here (coded_linear.cpp's
    // expand_pairs says why); every tile asks for its share of their codes (`ahead`), so that the memory keeps
    // reading while the later tiles run over these groups from the cache
    if constexpr (Ask)
      for (int c = 0; c < C; ++c) __builtin_prefetch(head.scales + ((g + c + C) * blocks + b) * kGroup, 0, 3);
    for (int64_t j = 0; j < kBlock / 4; ++j) {
      ahead.step();
      __m512i w[C];
      for (int c = 0; c < C; ++c) w[c] = _mm512_loadu_si512(head.packed + ((g + c) * (K / 4) + b * (kBlock / 4) + j) * 64);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xq.q.data() + (m0 + r) * K + b * kBlock + 4 * j, 4);
        const __m512i x4 = _mm512_set1_epi32(four);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], w[c], x4);
      }
    }
    for (int c = 0; c < C; ++c) {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(head.scales + ((g + c) * blocks + b) * kGroup)));
      for (int r = 0; r < R; ++r)
        total[r][c] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][c]), d),
                                      _mm512_set1_ps(xq.s[(m0 + r) * blocks + b]), total[r][c]);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r, at = (g + c) * M + m;
      _mm512_storeu_ps(totals + at * kGroup, total[r][c]);
      tops[at] = _mm512_reduce_max_ps(total[r][c]);
      lower[m] = std::max(lower[m], tops[at] - wides[at]);
    }
}

// groups g .. g + C - 1 against every row: their widest bounds, then the tiles of rows, the first of which
// asks for the next groups (Ask)
template <int C>
void sweep_tiles(const QuantRows& xq, int64_t M, const Head& head, int64_t g, int64_t K, float slack, float* totals,
                 float* tops, float* wides, float* lower) {
  group_wides(xq, M, head, g, C, K / kBlock, slack, wides);
  // the tiles that ask for the next C groups' codes: all of up to kAheadTiles (simd.h), else the first alone
  // (with more tiles the arithmetic bounds the pass, and the streamer keeps up)
  const int64_t tiles = (M + kTile - 1) / kTile, asking = tiles <= pagedserve::kAheadTiles ? tiles : 1;
  const auto tile = [&](auto ask, int64_t m0) {
    constexpr bool Ask = decltype(ask)::value;
    const pagedserve::Ahead ahead = m0 / kTile < asking ?
        pagedserve::Ahead(head.packed + (g + C) * K * kGroup, C * K * kGroup, m0 / kTile, asking, K / 4) :
        pagedserve::Ahead();
    switch (std::min<int64_t>(kTile, M - m0)) {
      case 1: approx_tile<1, C, Ask>(xq, M, m0, head, g, K, totals, tops, wides, lower, ahead); break;
      case 2: approx_tile<2, C, Ask>(xq, M, m0, head, g, K, totals, tops, wides, lower, ahead); break;
      case 3: approx_tile<3, C, Ask>(xq, M, m0, head, g, K, totals, tops, wides, lower, ahead); break;
      default: approx_tile<4, C, Ask>(xq, M, m0, head, g, K, totals, tops, wides, lower, ahead); break;
    }
  };
  if (M > 0) tile(std::true_type{}, 0);
  for (int64_t m0 = kTile; m0 < M; m0 += kTile) tile(std::false_type{}, m0);
}

// The first pass over groups [g0, g1), as the AVX2 one below: every row's approximate logits into
// totals[(g * M + m) * 16 + l], the group's largest into tops[g * M + m], its widest bound into
// wides[g * M + m], and lower[m] raised to the largest top - wide
void sweep_groups(const QuantRows& xq, int64_t M, const Head& head, int64_t g0, int64_t g1, int64_t K, float slack,
                  float* totals, float* tops, float* wides, std::vector<float>& lower) {
  int64_t g = g0;
  for (; g + kTileGroups <= g1; g += kTileGroups)
    sweep_tiles<kTileGroups>(xq, M, head, g, K, slack, totals, tops, wides, lower.data());
  for (; g < g1; ++g) sweep_tiles<1>(xq, M, head, g, K, slack, totals, tops, wides, lower.data());
}
#elif defined(PAGEDSERVE_Q8_ARGMAX)

// R rows of x against group g's 16 outputs (two eight-lane halves), into totals[m * 16 + l]: per four
// inputs, two loads of codes feed 2 R products of four, each a VPMADDUBSW and a VPMADDWD; R = 4 holds 8
// accumulators, the codes, x and the ones in the sixteen registers, and the float totals wait in memory
// between blocks. Per row, tops[m] gets the group's largest approximate logit.
template <int R, bool Ask>
void approx_tile(const QuantRows& xq, int64_t m0, const Head& head, int64_t g, int64_t next, int64_t K,
                 float* totals, float* tops) {
  const int64_t blocks = K / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  float (*total)[kGroup] = reinterpret_cast<float (*)[kGroup]>(totals + m0 * kGroup);
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(total[r] + 8 * h, _mm256_setzero_ps());
  // the rows' and the group's places, taken once: with them inside the loops GCC kept the row index on the
  // stack, added to it there every four inputs, and spilled accumulators
  const int8_t* xr[R];
  const float* sr[R];
  const int32_t* cr[R];
  for (int r = 0; r < R; ++r) {
    xr[r] = xq.q.data() + (m0 + r) * K;
    sr[r] = xq.s.data() + (m0 + r) * blocks;
    cr[r] = xq.corr.data() + (m0 + r) * blocks;
  }
  const uint8_t* codes = head.packed + g * (K / 4) * 64;
  const uint8_t* ahead = head.packed + next * (K / 4) * 64;
  const at::Half* scales = head.scales + g * blocks * kGroup;
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_set1_epi32(cr[r][b]);
    // the first tile of rows asks for the next group's codes and scales at the place read here
    // (coded_linear.cpp's expand_pairs says why); the other tiles find this group in the cache
    if constexpr (Ask) __builtin_prefetch(head.scales + (next * blocks + b) * kGroup, 0, 2);
    const uint8_t* p = codes + b * kBlock * kGroup;
#pragma GCC unroll 8
    for (int j = 0; j < kBlock / 4; ++j) {
      if constexpr (Ask) __builtin_prefetch(ahead + (b * (kBlock / 4) + j) * 64, 0, 2);
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * j));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * j + 32));
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xr[r] + b * kBlock + 4 * j, 4);
        const __m256i x4 = _mm256_set1_epi32(four);
        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(w0, x4), ones));
        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(w1, x4), ones));
        // each sum in its register here: GCC otherwise reorders the integer adds into a tree over the
        // block, its terms waiting on the stack
        asm("" : "+x"(acc[r][0]), "+x"(acc[r][1]));
      }
    }
    const at::Half* d = scales + b * kGroup;
    for (int h = 0; h < 2; ++h) {
      const __m256 dh = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + 8 * h)));
      for (int r = 0; r < R; ++r)
        _mm256_storeu_ps(total[r] + 8 * h,
                         _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][h]), dh),
                                         _mm256_set1_ps(sr[r][b]), _mm256_loadu_ps(total[r] + 8 * h)));
    }
    // the totals wait in memory: GCC would hold them in eight registers across the blocks and spill the
    // sums of the products instead, in the loop that matters
    asm volatile("" : : "r"(totals) : "memory");
  }
  for (int r = 0; r < R; ++r) {
    const __m256 top8 = _mm256_max_ps(_mm256_loadu_ps(total[r]), _mm256_loadu_ps(total[r] + 8));
    __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(top8), _mm256_extractf128_ps(top8, 1));
    top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
    tops[m0 + r] = _mm_cvtss_f32(_mm_max_ss(top4, _mm_movehdup_ps(top4)));
  }
}

// The first pass over groups [g0, g1): every row's approximate logits into totals[(g * M + m) * 16 + l],
// the group's largest of them into tops[g * M + m], its widest bound into wides[g * M + m] (from the
// largest norm and sum of each block over the group's outputs), and lower[m] raised to the largest
// top - wide: a lower end of the row's largest logit, found without the outputs' own bounds
void sweep_groups(const QuantRows& xq, int64_t M, const Head& head, int64_t g0, int64_t g1, int64_t K, float slack,
                  float* totals, float* tops, float* wides, std::vector<float>& lower) {
  const int64_t blocks = K / kBlock;
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t next = g + 1 < g1 ? g + 1 : g;
    const auto tile = [&](auto ask, int64_t m0) {
      constexpr bool Ask = decltype(ask)::value;
      float* t = totals + g * M * kGroup;
      float* top = tops + g * M;
      switch (std::min<int64_t>(kTile, M - m0)) {
        case 1: approx_tile<1, Ask>(xq, m0, head, g, next, K, t, top); break;
        case 2: approx_tile<2, Ask>(xq, m0, head, g, next, K, t, top); break;
        case 3: approx_tile<3, Ask>(xq, m0, head, g, next, K, t, top); break;
        default: approx_tile<4, Ask>(xq, m0, head, g, next, K, t, top); break;
      }
    };
    // the first tile of rows asks for the next group (Ask), the others do not
    if (M > 0) tile(std::true_type{}, 0);
    for (int64_t m0 = kTile; m0 < M; m0 += kTile) tile(std::false_type{}, m0);
    const float* widest = head.widest + g * rows_of_widest(head) * blocks;
    for (int64_t m = 0; m < M; ++m) {
      float wide = 0.f;
      for (int64_t b = 0; b < blocks; ++b)
        wide += widest[b] * xq.err[m * blocks + b] + slack * widest[blocks + b] * xq.s[m * blocks + b];
      if (head.resid != nullptr)
        for (int64_t b = 0; b < blocks; ++b) wide += widest[2 * blocks + b] * xq.xnorm[m * blocks + b];
      wides[g * M + m] = wide;
      lower[m] = std::max(lower[m], tops[g * M + m] - wide);
    }
  }
}

#endif

#ifdef PAGEDSERVE_Q8_ARGMAX
// The outputs of groups [g0, g1) whose upper end reaches the row's lower end (found.lower, the largest
// over the whole layer by now): a group whose top + wide falls short has none, and needs no bounds of
// its outputs; the others' outputs get their own, and raise the lower end further
void reaching_groups(const QuantRows& xq, int64_t M, const Head& head, int64_t g0, int64_t g1, int64_t K, float slack,
                     const float* totals, const float* tops, const float* wides, Found& found) {
  const int64_t blocks = K / kBlock;
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t m = 0; m < M; ++m) {
      if (tops[g * M + m] + wides[g * M + m] < found.reach(m)) continue;
      alignas(32) float bound[kGroup];
      for (int h = 0; h < 2; ++h) {
        __m256 sum = _mm256_setzero_ps(), cover = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t at = (g * blocks + b) * kGroup + 8 * h, xb = m * blocks + b;
          sum = _mm256_fmadd_ps(_mm256_loadu_ps(head.norms + at), _mm256_set1_ps(xq.err[xb]), sum);
          cover = _mm256_fmadd_ps(_mm256_loadu_ps(head.absums + at), _mm256_set1_ps(xq.s[xb]), cover);
        }
        if (head.resid != nullptr)
          for (int64_t b = 0; b < blocks; ++b)
            sum = _mm256_fmadd_ps(_mm256_loadu_ps(head.resid + (g * blocks + b) * kGroup + 8 * h),
                                  _mm256_set1_ps(xq.xnorm[m * blocks + b]), sum);
        _mm256_store_ps(bound + 8 * h, _mm256_fmadd_ps(cover, _mm256_set1_ps(slack), sum));
      }
      keep_reaching(totals + (g * M + m) * kGroup, bound, m, g * kGroup, found);
    }
}

// the first pass in two sweeps over each part's groups: a lower end from the whole layer first, so that few
// outputs are kept on the way (with a lower end that rose group by group from minus infinity, most groups
// needed their outputs' bounds, and a row kept tens of times the outputs left at the end). The approximate
// logits wait in between in a buffer kept from call to call (18 floats a group and row: 28 MB at 128 rows
// of SmolLM2's 3,072 groups), which saves the pages' faults of a fresh one every step; one buffer serves
// every call, as calls come one at a time (the interpreter's lock is held through them).
void approx_all(const QuantRows& xq, int64_t M, const Head& head, int64_t groups, int64_t K, float slack,
                int64_t parts, std::vector<Found>& found) {
  static std::vector<float> buffer;
  const size_t need = static_cast<size_t>(groups * M * (kGroup + 2));
  if (buffer.size() < need) buffer.resize(need);
  float* totals = buffer.data();
  float* tops = totals + groups * M * kGroup;
  float* wides = tops + groups * M;
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      sweep_groups(xq, M, head, groups * p / parts, groups * (p + 1) / parts, K, slack, totals, tops, wides,
                   found[p].lower);
  });
  for (int64_t m = 0; m < M; ++m) {
    float lower = -std::numeric_limits<float>::infinity();
    for (const Found& f : found) lower = std::max(lower, f.lower[m]);
    for (Found& f : found) f.lower[m] = lower;
  }
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      reaching_groups(xq, M, head, groups * p / parts, groups * (p + 1) / parts, K, slack, totals, tops, wides,
                      found[p]);
  });
}
#endif

// The logits of candidates (row m, output n) as coded_linear computes them: each its own FMA chain over k
// in order. A chain is bound by the FMA's latency, so kChains of them run side by side (the padding repeats
// the last candidate): the FMAs' throughput bounds them instead, and each chain's bits are its own.
constexpr int kChains = 8;
constexpr int kBf16Lanes = 16;   // the candidates of a bfloat16 output layer a run (exact_bf16_logits)

struct Candidate {
  int64_t m, n;
};

void exact_logits(const float* x, const int8_t* codes, const at::Half* scales, const Candidate* c, int64_t count,
                  int64_t K, float* out) {
  const int64_t blocks = K / kBlock;
  const float* xr[kChains];
  const int8_t* w[kChains];
  const at::Half* d[kChains];
  float acc[kChains];
  for (int i = 0; i < kChains; ++i) {
    const Candidate& one = c[std::min<int64_t>(i, count - 1)];
    const int64_t g = one.n / kGroup, l = one.n % kGroup;
    xr[i] = x + one.m * K;
    w[i] = codes + g * K * kGroup + l;
    d[i] = scales + g * blocks * kGroup + l;
    acc[i] = 0.f;
  }
  for (int64_t b = 0; b < blocks; ++b) {
    float scale[kChains];
    for (int i = 0; i < kChains; ++i) scale[i] = static_cast<float>(d[i][b * kGroup]);
    for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k)
      for (int i = 0; i < kChains; ++i)
        acc[i] = std::fma(xr[i][k], static_cast<float>(w[i][k * kGroup]) * scale[i], acc[i]);
  }
  for (int64_t i = 0; i < std::min<int64_t>(count, kChains); ++i) out[i] = acc[i];
}

// The same through a plain float32 output layer w [N, K] as panel_linear computes it (coded_linear.cpp): each
// output the FMA chain over k in order, the weight as it is
void exact_plain_logits(const float* x, const float* w, const Candidate* c, int64_t count, int64_t K, float* out) {
  const float* xr[kChains];
  const float* wr[kChains];
  float acc[kChains];
  for (int i = 0; i < kChains; ++i) {
    const Candidate& one = c[std::min<int64_t>(i, count - 1)];
    xr[i] = x + one.m * K;
    wr[i] = w + one.n * K;
    acc[i] = 0.f;
  }
  for (int64_t k = 0; k < K; ++k)
    for (int i = 0; i < kChains; ++i) acc[i] = std::fma(xr[i][k], wr[i][k], acc[i]);
  for (int64_t i = 0; i < std::min<int64_t>(count, kChains); ++i) out[i] = acc[i];
}

#ifdef PAGEDSERVE_BF16_ARGMAX
// The logits of up to 16 candidates through a bfloat16 output layer w [N, K] as bf16_linear computes them
// (a call without one_row, as the output layer's): one VDPBF16PS chain over the input pairs front to back,
// in chunks of onednn_bf16_chunk(K) inputs each from zero, the chunks' sums added front to back, rounded to
// bfloat16. Candidate i runs in lane i, its weight's and x's pairs gathered, so that each lane's sums are the
// ones bf16_linear's lane makes for that output: the same bits.
void exact_bf16_logits(const pagedserve::bf16* x, const pagedserve::bf16* w, const Candidate* c, int64_t count,
                       int64_t K, float* out) {
  const int64_t pairs = K / 2, step = pagedserve::onednn_bf16_chunk(K) / 2;
  alignas(64) int32_t wi[kBf16Lanes], xi[kBf16Lanes];
  for (int i = 0; i < kBf16Lanes; ++i) {
    const Candidate& one = c[std::min<int64_t>(i, count - 1)];
    wi[i] = static_cast<int32_t>(one.n * pairs);
    xi[i] = static_cast<int32_t>(one.m * pairs);
  }
  const __m512i wrow = _mm512_load_si512(wi), xrow = _mm512_load_si512(xi);
  __m512 acc = _mm512_setzero_ps(), done = _mm512_setzero_ps();
  bool started = false;
  for (int64_t j = 0; j < pairs; ++j) {
    if (j > 0 && j % step == 0) {
      done = started ? _mm512_add_ps(done, acc) : acc;
      acc = _mm512_setzero_ps();
      started = true;
    }
    const __m512i at = _mm512_set1_epi32(static_cast<int32_t>(j));
    const __m512i wv = _mm512_i32gather_epi32(_mm512_add_epi32(wrow, at), w, 4);
    const __m512i xv = _mm512_i32gather_epi32(_mm512_add_epi32(xrow, at), x, 4);
    acc = _mm512_dpbf16_ps(acc, (__m512bh)xv, (__m512bh)wv);
  }
  if (started) acc = _mm512_add_ps(done, acc);
  alignas(64) float sums[kBf16Lanes];
  _mm512_store_ps(sums, acc);
  for (int64_t i = 0; i < std::min<int64_t>(count, kBf16Lanes); ++i) out[i] = pagedserve::rounded<pagedserve::bf16>(sums[i]);
}
#endif

#ifdef PAGEDSERVE_BF16_DOTS_ARGMAX
// The logits of candidates through a bfloat16 output layer w [N, K] as bf16_dots_linear computes them: running
// sum v of each output takes inputs 8v .. 8v + 7 of every 64-block front to back (K a multiple of 64), the sums
// fold as torch's GEMM folds them, then one rounding to bfloat16. x is float32 holding bfloat16 values (the
// hidden states widened), so each product is the kernel's, exact in float32: the same bits. One candidate's
// eight sums are eight chains in flight.
void exact_dots_logits(const float* x, const pagedserve::bf16* w, const Candidate* c, int64_t count, int64_t K,
                       float* out) {
  for (int64_t i = 0; i < count; ++i) {
    const float* xr = x + c[i].m * K;
    const pagedserve::bf16* wr = w + c[i].n * K;
    __m256 sums[8];
    for (int v = 0; v < 8; ++v) sums[v] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 64)
      for (int v = 0; v < 8; ++v)
        sums[v] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + k + 8 * v), pagedserve::load8(wr + k + 8 * v), sums[v]);
    out[i] = pagedserve::rounded<pagedserve::bf16>(pagedserve::torch_dots_fold(sums));
  }
}
#endif

}  // namespace

bool has_q8_argmax() {
#ifdef PAGEDSERVE_Q8_ARGMAX
  return true;
#else
  return false;
#endif
}

bool has_bf16_argmax() {
#ifdef PAGEDSERVE_BF16_ARGMAX
  return true;
#else
  return false;
#endif
}

bool has_bf16_dots_argmax() {
#ifdef PAGEDSERVE_BF16_DOTS_ARGMAX
  return true;
#else
  return false;
#endif
}

std::string q8_argmax_kind() {
#if defined(PAGEDSERVE_Q8_ARGMAX_VNNI)
  return "avx512_vnni";
#elif defined(PAGEDSERVE_Q8_ARGMAX)
  return "avx2";
#else
  return "";
#endif
}

// x [M, K] float32; packed uint8 [N / 16, K / 4, 16, 4] (codes + 128); codes (or None) int8 [N / 16, K, 16]
// and scales float16 [N / 16, K / 32, 16] (coded_linear's); absums float32 [N / 16, K / 32, 16]: per block
// sum |w| (at least |scale| * sum |codes|); norms float32 [N / 16, K / 32, 16]: the Euclidean norm of each
// block's scale * code, rounded up; widest float32 [N / 16, 2 or 3, K / 32]: per group and block the largest
// of its 16 norms, then of its absums, then (with resid) of its resids. The weights whose logits decide:
// the codes' (codes given, weight and resid None: coded_linear's FMA chain), or weight's, bfloat16 [N, K]
// (bf16_linear's sums rounded to bfloat16; with dots, bf16_dots_linear's) or float32 [N, K] (panel_linear's FMA
// chain), with resid float32
// [N / 16, K / 32, 16]: the Euclidean norm of each block's w - scale * code, rounded up. Returns
// the token [M] (int64; -1 for a row with a value that is not finite: the caller computes that row in full),
// its logit [M] (float32) and how many outputs were computed exactly [M] (int64).
std::vector<at::Tensor> q8_argmax(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> codes,
                                  at::Tensor scales, at::Tensor absums, at::Tensor norms, at::Tensor widest,
                                  c10::optional<at::Tensor> weight, c10::optional<at::Tensor> resid, bool dots) {
  TORCH_CHECK(has_q8_argmax(), "q8_argmax: this build has neither AVX512-VNNI nor AVX2");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "q8_argmax: x [M, K] float32");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 4 &&
              packed.size(2) == kGroup && packed.size(3) == 4, "q8_argmax: packed uint8 [N / 16, K / 4, 16, 4]");
  const int64_t M = x.size(0), K = x.size(1), groups = packed.size(0), blocks = K / kBlock;
  TORCH_CHECK(K % kBlock == 0 && K > 0 && packed.size(1) == K / 4, "q8_argmax: K a positive multiple of 32, "
              "packed's K / 4");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 3 &&
              scales.size(0) == groups && scales.size(1) == blocks && scales.size(2) == kGroup,
              "q8_argmax: scales float16 [N / 16, K / 32, 16]");
  TORCH_CHECK(absums.scalar_type() == at::kFloat && absums.is_contiguous() && absums.sizes() == scales.sizes(),
              "q8_argmax: absums float32 [N / 16, K / 32, 16]");
  TORCH_CHECK(norms.scalar_type() == at::kFloat && norms.is_contiguous() && norms.sizes() == scales.sizes(),
              "q8_argmax: norms float32 [N / 16, K / 32, 16]");
  const bool plain = resid.has_value();
  TORCH_CHECK(!plain || (resid->scalar_type() == at::kFloat && resid->is_contiguous() &&
                         resid->sizes() == scales.sizes()), "q8_argmax: resid float32 [N / 16, K / 32, 16]");
  TORCH_CHECK(widest.scalar_type() == at::kFloat && widest.is_contiguous() && widest.dim() == 3 &&
              widest.size(0) == groups && widest.size(1) == (plain ? 3 : 2) && widest.size(2) == blocks,
              "q8_argmax: widest float32 [N / 16, 2, K / 32], or [N / 16, 3, K / 32] with resid");
  // a bfloat16 output layer: its logits rounded to bfloat16
  const bool rounded = weight.has_value() && weight->scalar_type() == at::kBFloat16;
  const bool wide = weight.has_value() && weight->scalar_type() == at::kFloat;
  TORCH_CHECK(!weight.has_value() || ((rounded || wide) && weight->is_contiguous() && weight->dim() == 2 &&
                                      weight->size(0) == groups * kGroup && weight->size(1) == K),
              "q8_argmax: weight bfloat16 or float32 [N, K]");
  TORCH_CHECK(!rounded || dots || has_bf16_argmax(),
              "q8_argmax: this build has no AVX512-BF16 for a bfloat16 output layer");
  TORCH_CHECK(!dots || (rounded && has_bf16_dots_argmax() && K % 64 == 0), "q8_argmax: dots takes a bfloat16 "
              "weight with K a multiple of 64, in a build with AVX2");
  TORCH_CHECK(weight.has_value() == plain, "q8_argmax: a weight needs resid, and resid a weight (the codes' "
              "logits take codes alone)");
  TORCH_CHECK(weight.has_value() || codes.has_value(), "q8_argmax: codes or a weight: the logits that decide");
  TORCH_CHECK(!codes.has_value() || (codes->scalar_type() == at::kChar && codes->is_contiguous() &&
                                     codes->dim() == 3 && codes->size(0) == groups && codes->size(1) == K &&
                                     codes->size(2) == kGroup), "q8_argmax: codes int8 [N / 16, K, 16]");
  // (exact_bf16_logits gathers a candidate's pairs by 32-bit indices)
  TORCH_CHECK(!rounded || dots || std::max(groups * kGroup, M) * (K / 2) <= std::numeric_limits<int32_t>::max(),
              "q8_argmax: a bfloat16 output layer or x of more than 2^31 input pairs");
  auto tokens = at::empty({M}, x.options().dtype(at::kLong));
  auto logits = at::empty({M}, x.options());
  auto counts = at::empty({M}, x.options().dtype(at::kLong));
#ifdef PAGEDSERVE_Q8_ARGMAX
  const float* xp = x.data_ptr<float>();
  QuantRows xq = quantize(xp, M, K, plain);
  // each thread a contiguous range of groups, its own list per row
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), groups));
  std::vector<Found> found(parts, Found{std::vector<float>(M, -std::numeric_limits<float>::infinity()),
                                        std::vector<std::vector<std::pair<int64_t, float>>>(M), rounded});
  const Head head{packed.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), absums.data_ptr<float>(),
                  norms.data_ptr<float>(), widest.data_ptr<float>(), plain ? resid->data_ptr<float>() : nullptr};
  // the float roundings' share (see the top): the exact chain's own error is at most K * 2^-24 of
  // sum |w x|, itself at most kLevels * sum_b s_b |w_b| (|x| <= kLevels s in a block), and the first
  // pass's a few 2^-24 a block; twice that, and never under kSlack (0.01 covers SmolLM2's K = 576 twice)
  const float slack = std::max(kSlack, 2.f * static_cast<float>(K + blocks) * std::ldexp(1.f, -24) * kLevels);
#ifdef PAGEDSERVE_BF16_ARGMAX
  std::vector<pagedserve::bf16> xb;
  if (rounded && !dots) {
    // VDPBF16PS takes subnormal inputs as zeros and flushes subnormal sums: a row with a value under 2^-64 (the
    // products of such values with the layer's weights, at least 2^-24, could reach that range) takes the full
    // logits, as a row that is not finite
    xb.resize(M * K);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) {
        const float v = xp[m * K + k];
        if (v != 0.f && std::fabs(v) < std::ldexp(1.f, -64)) xq.finite[m] = 0;
        xb[m * K + k] = pagedserve::from_float<pagedserve::bf16>(v);
      }
  }
#endif
  approx_all(xq, M, head, groups, K, slack, parts, found);
  int64_t* tp = tokens.data_ptr<int64_t>();
  float* lp = logits.data_ptr<float>();
  int64_t* cp = counts.data_ptr<int64_t>();
  // the candidates left once every part's lower end is known, row by row
  std::vector<Candidate> left;
  std::vector<int64_t> first(M + 1, 0);
  for (int64_t m = 0; m < M; ++m) {
    first[m] = static_cast<int64_t>(left.size());
    if (!xq.finite[m]) continue;
    float lower = -std::numeric_limits<float>::infinity();
    for (const Found& f : found) lower = std::max(lower, f.lower[m]);
    const float floor = rounded ? bf16_floor(lower) : lower;
    for (const Found& f : found)
      for (const auto& [n, upper] : f.outputs[m])
        if (upper >= floor) left.push_back({m, n});
  }
  first[M] = static_cast<int64_t>(left.size());
  // computed in runs of kChains (or kBf16Lanes) across rows: a row's share of candidates varies by thousands
  std::vector<float> exact(left.size());
  const int64_t run = rounded ? kBf16Lanes : kChains, runs = (first[M] + run - 1) / run;
  at::parallel_for(0, runs, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t count = std::min<int64_t>(run, first[M] - r * run);
#ifdef PAGEDSERVE_BF16_DOTS_ARGMAX
      if (dots) {
        exact_dots_logits(xp, reinterpret_cast<const pagedserve::bf16*>(weight->data_ptr<at::BFloat16>()),
                          left.data() + r * run, count, K, exact.data() + r * run);
        continue;
      }
#endif
#ifdef PAGEDSERVE_BF16_ARGMAX
      if (rounded) {
        exact_bf16_logits(xb.data(), reinterpret_cast<const pagedserve::bf16*>(weight->data_ptr<at::BFloat16>()),
                          left.data() + r * run, count, K, exact.data() + r * run);
        continue;
      }
#endif
      if (wide)
        exact_plain_logits(xp, weight->data_ptr<float>(), left.data() + r * run, count, K, exact.data() + r * run);
      else
        exact_logits(xp, codes->data_ptr<int8_t>(), scales.data_ptr<at::Half>(), left.data() + r * run, count, K,
                     exact.data() + r * run);
    }
  });
  for (int64_t m = 0; m < M; ++m) {
    tp[m] = -1, lp[m] = std::numeric_limits<float>::quiet_NaN(), cp[m] = first[m + 1] - first[m];
    // a row's candidates come in increasing order (parts in order, each in order): the first largest is
    // the first index
    for (int64_t i = first[m]; i < first[m + 1]; ++i)
      if (tp[m] < 0 || exact[i] > lp[m]) tp[m] = left[i].n, lp[m] = exact[i];
  }
#endif
  return {tokens, logits, counts};
}
