// The greedy token of float32 rows x [M, K] through an output layer held as Q8_0 codes (W[n, k] =
// scale * code, ops/quantized.py): the first index of the largest logit, with the bits the full product
// (coded_linear) gives, without computing most of the 49,152 logits exactly.
//
// A first pass computes every logit approximately in integers: each block of 32 inputs of a row of x is
// rounded to int8 codes q with its own scale s = max |x| / 127, and the output layer's own codes are
// multiplied by them with VPDPBUSD, 64 products per instruction (16 float32 FMAs take one). Per block,
// |x - s q| <= s / 2 (plus float rounding far below it), so each approximate logit is within
// B_n = 0.51 * sum_b s_b * |scale_nb| * sum |codes of the block| of the real product, and the exact chain's
// own rounding (a 576-term chain: under 1% of that) is inside the same margin. Only an output whose
// upper end Q_n + B_n reaches the largest lower end max(Q_i - B_i) can be the argmax; those few are then
// computed exactly, in coded_linear's order (the FMA chain over k = 0..K-1, each weight the rounded
// product scale * code), and the first largest of them is the token. Activations whose blocks differ by
// orders of magnitude (a few outlier channels) are why the scale is per block and not per row.
//
// The first pass reads the codes plus 128 as unsigned bytes (VPDPBUSD multiplies unsigned by signed), laid
// out [N / 16, K / 4, 16, 4]: for group g and inputs 4j..4j+3, the 16 rows' four codes, one 32-bit lane
// per row; sum (c + 128) q = sum c q + 128 sum q, so each block's accumulator starts at -128 * sum q.
#include "aten.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "simd.h"

// the exact recomputation must round the weight's product before the FMA, as the expansion does
#pragma GCC optimize("fp-contract=off")

#if defined(PAGEDSERVE_AVX512) && defined(__AVX512VNNI__)
#define PAGEDSERVE_Q8_ARGMAX 1
#endif

namespace {

constexpr int64_t kGroup = 16;
constexpr int64_t kBlock = 32;
constexpr int kTile = 4;            // rows of x per register tile
constexpr int kTileGroups = 3;      // groups of 16 outputs per register tile: 12 accumulators, 12 sums
constexpr float kMargin = 0.51f;    // 0.5 for the rounding of x to codes, 0.01 for every float rounding

// one row of x in int8 blocks: codes, per block scale and -128 * sum of the block's codes
struct QuantRows {
  std::vector<int8_t> q;      // [M, K]
  std::vector<float> s;       // [M, K / 32]
  std::vector<int32_t> corr;  // [M, K / 32]
  std::vector<char> finite;   // [M]
};

QuantRows quantize(const float* x, int64_t M, int64_t K) {
  const int64_t blocks = K / kBlock;
  QuantRows r{std::vector<int8_t>(M * K), std::vector<float>(M * blocks), std::vector<int32_t>(M * blocks),
              std::vector<char>(M, 1)};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + m * K + b * kBlock;
      float top = 0.f;
      for (int64_t i = 0; i < kBlock; ++i) {
        if (!std::isfinite(xb[i])) r.finite[m] = 0;
        top = std::max(top, std::fabs(xb[i]));
      }
      const float inv = 127.f / top;
      if (!r.finite[m] || !std::isfinite(inv)) {
        // zeros, or values so small that 127 / max overflows: codes 0, and a "scale" whose half is the
        // block's largest value, so that the bound still covers |x - 0|
        std::fill_n(r.q.data() + m * K + b * kBlock, kBlock, int8_t{0});
        r.s[m * blocks + b] = 2.f * top;
        r.corr[m * blocks + b] = 0;
        continue;
      }
      int32_t sum = 0;
      for (int64_t i = 0; i < kBlock; ++i) {
        const int32_t q = std::clamp(static_cast<int32_t>(std::nearbyint(xb[i] * inv)), -127, 127);
        r.q[m * K + b * kBlock + i] = static_cast<int8_t>(q);
        sum += q;
      }
      r.s[m * blocks + b] = top / 127.f;
      r.corr[m * blocks + b] = -128 * sum;
    }
  return r;
}

// per row of x: the largest lower end seen, and the outputs whose upper end reached the lower end seen
// so far (a superset of those reaching the final one), in increasing order
struct Found {
  std::vector<float> lower;
  std::vector<std::vector<std::pair<int64_t, float>>> outputs;
};

#ifdef PAGEDSERVE_Q8_ARGMAX
// the outputs of group g whose upper end reaches the row's largest lower end so far, given the row's
// approximate logits and their bounds' sums
inline void keep_reaching(__m512 total, __m512 bound, int64_t m, int64_t g, Found& found) {
  const __m512 margin = _mm512_mul_ps(bound, _mm512_set1_ps(kMargin));
  float& lower = found.lower[m];
  lower = std::max(lower, _mm512_reduce_max_ps(_mm512_sub_ps(total, margin)));
  const __m512 upper = _mm512_add_ps(total, margin);
  __mmask16 reach = _mm512_cmp_ps_mask(upper, _mm512_set1_ps(lower), _CMP_GE_OQ);
  if (!reach) return;
  alignas(64) float up[kGroup];
  _mm512_store_ps(up, upper);
  while (reach) {
    const int l = __builtin_ctz(reach);
    reach &= reach - 1;
    found.outputs[m].emplace_back(g * kGroup + l, up[l]);
  }
}

// R rows of x against C groups of 16 outputs from g: each weight load feeds R products and each
// broadcast of x C of them (one load per product held VPDPBUSD to about a third of its rate)
template <int R, int C, bool Ask>
void approx_tile(const QuantRows& xq, int64_t m0, const uint8_t* packed, const at::Half* scales, const float* absums,
                 int64_t g, int64_t K, Found& found) {
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
    // the first tile of rows asks for the next C groups' codes, scales and bounds at the place read here
    // (coded_linear.cpp's expand_pairs says why); the other tiles find these groups in the cache
    if constexpr (Ask)
      for (int c = 0; c < C; ++c) {
        __builtin_prefetch(scales + ((g + c + C) * blocks + b) * kGroup, 0, 3);
        __builtin_prefetch(absums + ((g + c + C) * blocks + b) * kGroup, 0, 3);
      }
    for (int64_t j = 0; j < kBlock / 4; ++j) {
      __m512i w[C];
      for (int c = 0; c < C; ++c) {
        if constexpr (Ask) __builtin_prefetch(packed + ((g + c + C) * (K / 4) + b * (kBlock / 4) + j) * 64, 0, 3);
        w[c] = _mm512_loadu_si512(packed + ((g + c) * (K / 4) + b * (kBlock / 4) + j) * 64);
      }
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xq.q.data() + (m0 + r) * K + b * kBlock + 4 * j, 4);
        const __m512i x4 = _mm512_set1_epi32(four);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], w[c], x4);
      }
    }
    for (int c = 0; c < C; ++c) {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + ((g + c) * blocks + b) * kGroup)));
      for (int r = 0; r < R; ++r)
        total[r][c] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][c]), d),
                                      _mm512_set1_ps(xq.s[(m0 + r) * blocks + b]), total[r][c]);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) {
      __m512 bound = _mm512_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b)
        bound = _mm512_fmadd_ps(_mm512_loadu_ps(absums + ((g + c) * blocks + b) * kGroup),
                                _mm512_set1_ps(xq.s[(m0 + r) * blocks + b]), bound);
      keep_reaching(total[r][c], bound, m0 + r, g + c, found);
    }
}

template <int C>
void approx_rows(const QuantRows& xq, int64_t M, const uint8_t* packed, const at::Half* scales, const float* absums,
                 int64_t g, int64_t K, Found& found) {
  // the first tile of rows asks for the next groups (Ask), the others do not
  const auto tile = [&](auto ask, int64_t m0) {
    constexpr bool Ask = decltype(ask)::value;
    switch (std::min<int64_t>(kTile, M - m0)) {
      case 1: approx_tile<1, C, Ask>(xq, m0, packed, scales, absums, g, K, found); break;
      case 2: approx_tile<2, C, Ask>(xq, m0, packed, scales, absums, g, K, found); break;
      case 3: approx_tile<3, C, Ask>(xq, m0, packed, scales, absums, g, K, found); break;
      default: approx_tile<4, C, Ask>(xq, m0, packed, scales, absums, g, K, found); break;
    }
  };
  if (M > 0) tile(std::true_type{}, 0);
  for (int64_t m0 = kTile; m0 < M; m0 += kTile) tile(std::false_type{}, m0);
}

void approx_groups(const QuantRows& xq, int64_t M, const uint8_t* packed, const at::Half* scales,
                   const float* absums, int64_t g0, int64_t g1, int64_t K, Found& found) {
  int64_t g = g0;
  for (; g + kTileGroups <= g1; g += kTileGroups)
    approx_rows<kTileGroups>(xq, M, packed, scales, absums, g, K, found);
  for (; g < g1; ++g) approx_rows<1>(xq, M, packed, scales, absums, g, K, found);
}
#endif

// output n's logit for row x as coded_linear computes it: the FMA chain over k in order
float exact_logit(const float* x, const int8_t* codes, const at::Half* scales, int64_t n, int64_t K) {
  const int64_t g = n / kGroup, l = n % kGroup, blocks = K / kBlock;
  float acc = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const float d = static_cast<float>(scales[(g * blocks + b) * kGroup + l]);
    for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k) {
      const float w = static_cast<float>(codes[(g * K + k) * kGroup + l]) * d;
      acc = std::fma(x[k], w, acc);
    }
  }
  return acc;
}

}  // namespace

bool has_q8_argmax() {
#ifdef PAGEDSERVE_Q8_ARGMAX
  return true;
#else
  return false;
#endif
}

// x [M, K] float32; packed uint8 [N / 16, K / 4, 16, 4] (codes + 128); codes int8 [N / 16, K, 16] and
// scales float16 [N / 16, K / 32, 16] (coded_linear's); absums float32 [N / 16, K / 32, 16]:
// |scale| * sum |codes| per block. Returns the token [M] (int64; -1 for a row with a value that is not
// finite: the caller computes that row in full), its logit [M] (float32) and how many outputs were
// computed exactly [M] (int64).
std::vector<at::Tensor> q8_argmax(at::Tensor x, at::Tensor packed, at::Tensor codes, at::Tensor scales,
                                  at::Tensor absums) {
  TORCH_CHECK(has_q8_argmax(), "q8_argmax: this build has no AVX512-VNNI");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "q8_argmax: x [M, K] float32");
  const int64_t M = x.size(0), K = x.size(1), groups = codes.size(0), blocks = K / kBlock;
  TORCH_CHECK(K % kBlock == 0 && K > 0, "q8_argmax: K a positive multiple of 32");
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous() && codes.dim() == 3 && codes.size(1) == K &&
              codes.size(2) == kGroup, "q8_argmax: codes int8 [N / 16, K, 16]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 4 &&
              packed.size(0) == groups && packed.size(1) == K / 4 && packed.size(2) == kGroup && packed.size(3) == 4,
              "q8_argmax: packed uint8 [N / 16, K / 4, 16, 4]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 3 &&
              scales.size(0) == groups && scales.size(1) == blocks && scales.size(2) == kGroup,
              "q8_argmax: scales float16 [N / 16, K / 32, 16]");
  TORCH_CHECK(absums.scalar_type() == at::kFloat && absums.is_contiguous() && absums.sizes() == scales.sizes(),
              "q8_argmax: absums float32 [N / 16, K / 32, 16]");
  auto tokens = at::empty({M}, x.options().dtype(at::kLong));
  auto logits = at::empty({M}, x.options());
  auto counts = at::empty({M}, x.options().dtype(at::kLong));
#ifdef PAGEDSERVE_Q8_ARGMAX
  const float* xp = x.data_ptr<float>();
  const QuantRows xq = quantize(xp, M, K);
  // each thread a contiguous range of groups, its own list per row
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), groups));
  std::vector<Found> found(parts, Found{std::vector<float>(M, -std::numeric_limits<float>::infinity()),
                                        std::vector<std::vector<std::pair<int64_t, float>>>(M)});
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      approx_groups(xq, M, packed.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), absums.data_ptr<float>(),
                    groups * p / parts, groups * (p + 1) / parts, K, found[p]);
  });
  int64_t* tp = tokens.data_ptr<int64_t>();
  float* lp = logits.data_ptr<float>();
  int64_t* cp = counts.data_ptr<int64_t>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      tp[m] = -1, lp[m] = std::numeric_limits<float>::quiet_NaN(), cp[m] = 0;
      if (!xq.finite[m]) continue;
      float lower = -std::numeric_limits<float>::infinity();
      for (const Found& f : found) lower = std::max(lower, f.lower[m]);
      // parts in order, each in increasing order: the first largest is the first index
      for (const Found& f : found)
        for (const auto& [n, upper] : f.outputs[m]) {
          if (upper < lower) continue;
          const float e = exact_logit(xp + m * K, codes.data_ptr<int8_t>(), scales.data_ptr<at::Half>(), n, K);
          ++cp[m];
          if (tp[m] < 0 || e > lp[m]) tp[m] = n, lp[m] = e;
        }
    }
  });
#endif
  return {tokens, logits, counts};
}
