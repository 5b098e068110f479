// The draws of sampled rows (temperature > 0; data_plane/sampler.py says the rules): per draw, one pass
// over its row's logits for the largest, one for the weights w_i = exp((x_i - max) / T), then the
// filters on the few tokens that can pass them, and the token that wins the exponential race: the first
// largest w_i / E_i over the kept tokens, where E_i = -ln U_i and U_i in (0, 1) is a 32-bit hash of the
// token id under the draw's 64-bit key. That picks token i with probability w_i / sum w, and, unlike a
// single uniform number walked along the running sum, a change in the last bits of a logit moves the
// winner only where two tokens' ratios nearly tie. torch's route (sort the 49,152 logits for top-p, a
// softmax, 49,152 exponential draws and an argmax, row by row) cost about a millisecond a row for the
// draw alone and several with top-p.
//
// The filters, each over what the one before kept (the max token always stays):
//   top-k (0 < k < V): the tokens whose logit is at least the k-th largest (ties with it stay);
//   top-p (p < 1): in order of logit, largest first (ties by token id), a token stays while the weight
//     of those before it is under p times the weight of all kept so far;
//   min-p (q > 0): the tokens whose weight is at least q (the max token's weight is 1).
// Top-k and top-p need the largest tokens in order, not all of them: the tokens whose weight is at
// least a threshold are gathered and sorted, and the threshold is lowered (down to every token of
// positive weight) until they hold the k tokens, or the mass p, that the filter asks for.
//
// Sums of weights are in double, over fixed chunks in a fixed order, and the hash is the row's alone, so the
// draw depends on the row and its key: not on the batch or the threads. A row with a NaN, or with no finite
// logit, gives -1 (the caller then takes torch's route).
#include "aten.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t kChunk = 16;   // weights per partial sum of the total

struct Params {
  float inv_t;     // 1 / temperature
  int64_t top_k;   // 0 < top_k < V: on
  float top_p;     // < 1: on
  float min_p;     // > 0: on
};

// w[i] = exp((x[i] - m) * inv_t). Returns the row's total: each chunk's sum, the chunks added in order in double.
double weights(const float* x, int64_t V, float m, float inv_t, float* w) {
  int64_t i = 0;
  double total = 0;
#ifdef PAGEDSERVE_AVX512
  const __m512 mv = _mm512_set1_ps(m), tv = _mm512_set1_ps(inv_t);
  for (; i + kChunk <= V; i += kChunk) {
    const __m512 e = pagedserve::exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv), tv));
    _mm512_storeu_ps(w + i, e);
    total += _mm512_reduce_add_ps(e);
  }
#elif defined(PAGEDSERVE_AVX2)
  const __m256 mv = _mm256_set1_ps(m), tv = _mm256_set1_ps(inv_t);
  for (; i + kChunk <= V; i += kChunk) {
    const __m256 a = pagedserve::exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv), tv));
    const __m256 b = pagedserve::exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), mv), tv));
    _mm256_storeu_ps(w + i, a);
    _mm256_storeu_ps(w + i + 8, b);
    total += pagedserve::hsum8(_mm256_add_ps(a, b));
  }
#endif
  for (; i < V; i += kChunk) {   // the last, partial chunk (every chunk without SIMD)
    float s = 0.f;
    for (int64_t j = i; j < std::min(V, i + kChunk); ++j) {
      w[j] = std::exp((x[j] - m) * inv_t);
      s += w[j];
    }
    total += s;
  }
  return total;
}

// The race's noise: E = -ln U for U = (floor(h / 2^9) + 1/2) / 2^23 in (0, 1) (exact in float32), h a 32-bit hash of the token id under
// the draw's key (k0, k1). The same integer steps in torch's route (data_plane/sampler._noise), each product of a
// 32-bit value and a constant under 2^31, so that int64 arithmetic there gives these bits.
constexpr uint32_t kMix1 = 0x7feb352dU, kMix2 = 0x1b873593U;
inline uint32_t mix32(uint32_t v) {
  v ^= v >> 16;
  v *= kMix1;
  v ^= v >> 15;
  v *= kMix2;
  return v ^ (v >> 16);
}
inline float noise(uint32_t token, uint32_t k0, uint32_t k1) {
  const uint32_t h = mix32(mix32(token ^ k0) ^ k1);
  return -std::log((static_cast<float>(h >> 9) + 0.5f) * (1.f / 8388608.f));
}

#ifdef PAGEDSERVE_AVX512
inline __m512i mix16(__m512i v) {
  v = _mm512_xor_si512(v, _mm512_srli_epi32(v, 16));
  v = _mm512_mullo_epi32(v, _mm512_set1_epi32(static_cast<int>(kMix1)));
  v = _mm512_xor_si512(v, _mm512_srli_epi32(v, 15));
  v = _mm512_mullo_epi32(v, _mm512_set1_epi32(static_cast<int>(kMix2)));
  return _mm512_xor_si512(v, _mm512_srli_epi32(v, 16));
}
// -ln U of sixteen tokens from `first` on: ln U = e ln 2 + ln m (U = m 2^e, m in [1, 2)), ln m = 2 atanh(t)
// for t = (m - 1) / (m + 1) in [0, 1/3], its series to t^11 (error under 1e-7)
inline __m512 noise16(int64_t first, uint32_t k0, uint32_t k1) {
  const __m512i ids = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first)),
                                       _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m512i h = mix16(_mm512_xor_si512(mix16(_mm512_xor_si512(ids, _mm512_set1_epi32(static_cast<int>(k0)))),
                                           _mm512_set1_epi32(static_cast<int>(k1))));
  const __m512 u = _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(h, 9)), _mm512_set1_ps(0.5f)),
                                 _mm512_set1_ps(1.f / 8388608.f));
  const __m512 e = _mm512_getexp_ps(u), m = _mm512_getmant_ps(u, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(m, one), _mm512_add_ps(m, one)), t2 = _mm512_mul_ps(t, t);
  __m512 series = _mm512_set1_ps(1.f / 11);
  for (const float c : {1.f / 9, 1.f / 7, 1.f / 5, 1.f / 3, 1.f}) series = _mm512_fmadd_ps(series, t2, _mm512_set1_ps(c));
  const __m512 ln = _mm512_fmadd_ps(e, _mm512_set1_ps(0.69314718f), _mm512_mul_ps(_mm512_set1_ps(2.f), _mm512_mul_ps(t, series)));
  return _mm512_sub_ps(_mm512_setzero_ps(), ln);
}
#elif defined(PAGEDSERVE_AVX2)
inline __m256i mix8(__m256i v) {
  v = _mm256_xor_si256(v, _mm256_srli_epi32(v, 16));
  v = _mm256_mullo_epi32(v, _mm256_set1_epi32(static_cast<int>(kMix1)));
  v = _mm256_xor_si256(v, _mm256_srli_epi32(v, 15));
  v = _mm256_mullo_epi32(v, _mm256_set1_epi32(static_cast<int>(kMix2)));
  return _mm256_xor_si256(v, _mm256_srli_epi32(v, 16));
}
// noise16's arithmetic in eight lanes, the exponent and mantissa taken from the bits
inline __m256 noise8(int64_t first, uint32_t k0, uint32_t k1) {
  const __m256i ids = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(first)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i h = mix8(_mm256_xor_si256(mix8(_mm256_xor_si256(ids, _mm256_set1_epi32(static_cast<int>(k0)))),
                                          _mm256_set1_epi32(static_cast<int>(k1))));
  const __m256 u = _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 9)), _mm256_set1_ps(0.5f)),
                                 _mm256_set1_ps(1.f / 8388608.f));
  const __m256i bits = _mm256_castps_si256(u);
  const __m256 e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127)));
  const __m256 m = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFF)),
                                                       _mm256_set1_epi32(0x3F800000)));
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 t = _mm256_div_ps(_mm256_sub_ps(m, one), _mm256_add_ps(m, one)), t2 = _mm256_mul_ps(t, t);
  __m256 series = _mm256_set1_ps(1.f / 11);
  for (const float c : {1.f / 9, 1.f / 7, 1.f / 5, 1.f / 3, 1.f}) series = _mm256_fmadd_ps(series, t2, _mm256_set1_ps(c));
  const __m256 ln = _mm256_fmadd_ps(e, _mm256_set1_ps(0.69314718f), _mm256_mul_ps(_mm256_set1_ps(2.f), _mm256_mul_ps(t, series)));
  return _mm256_sub_ps(_mm256_setzero_ps(), ln);
}
#endif

// The race over every token (min-p alone as a floor on the weights): the first largest w_i / E_i, in one
// pass that neither stores the weights nor sums them
int64_t race_all(const float* x, int64_t V, float m, float inv_t, float floor, uint32_t k0, uint32_t k1) {
  float best = -1.f;
  int64_t at = -1, i = 0;
#ifdef PAGEDSERVE_AVX512
  const __m512 mv = _mm512_set1_ps(m), tv = _mm512_set1_ps(inv_t), fv = _mm512_set1_ps(floor);
  __m512 lane_best = _mm512_set1_ps(-1.f);
  __m512i lane_at = _mm512_set1_epi32(-1);
  for (; i + 16 <= V; i += 16) {
    __m512 w = pagedserve::exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv), tv));
    w = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(w, fv, _CMP_GE_OQ), w);
    const __m512 r = _mm512_div_ps(w, noise16(i, k0, k1));
    const __mmask16 better = _mm512_cmp_ps_mask(r, lane_best, _CMP_GT_OQ);   // (strict: a lane keeps its first)
    lane_best = _mm512_mask_mov_ps(lane_best, better, r);
    lane_at = _mm512_mask_mov_epi32(lane_at, better, _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(i)),
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)));
  }
  alignas(64) float bests[16];
  alignas(64) int32_t ats[16];
  _mm512_store_ps(bests, lane_best);
  _mm512_store_si512(ats, lane_at);
  for (int l = 0; l < 16; ++l)   // the largest, and of equal ones the first token
    if (ats[l] >= 0 && (bests[l] > best || (bests[l] == best && ats[l] < at))) best = bests[l], at = ats[l];
#elif defined(PAGEDSERVE_AVX2)
  const __m256 mv = _mm256_set1_ps(m), tv = _mm256_set1_ps(inv_t), fv = _mm256_set1_ps(floor);
  __m256 lane_best = _mm256_set1_ps(-1.f);
  __m256i lane_at = _mm256_set1_epi32(-1);
  for (; i + 8 <= V; i += 8) {
    __m256 w = pagedserve::exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv), tv));
    w = _mm256_and_ps(w, _mm256_cmp_ps(w, fv, _CMP_GE_OQ));
    const __m256 r = _mm256_div_ps(w, noise8(i, k0, k1));
    const __m256 better = _mm256_cmp_ps(r, lane_best, _CMP_GT_OQ);
    lane_best = _mm256_blendv_ps(lane_best, r, better);
    lane_at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(lane_at), _mm256_castsi256_ps(
        _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(i)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))), better));
  }
  alignas(32) float bests[8];
  alignas(32) int32_t ats[8];
  _mm256_store_ps(bests, lane_best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(ats), lane_at);
  for (int l = 0; l < 8; ++l)
    if (ats[l] >= 0 && (bests[l] > best || (bests[l] == best && ats[l] < at))) best = bests[l], at = ats[l];
#endif
  for (; i < V; ++i) {
    float w = std::exp((x[i] - m) * inv_t);
    w = w >= floor ? w : 0.f;
    const float r = w / noise(static_cast<uint32_t>(i), k0, k1);
    if (r > best) best = r, at = i;
  }
  return best > 0.f ? at : -1;
}

// the tokens of weight at least `threshold` (positive), in token order
void gather(const float* w, int64_t V, float threshold, std::vector<int32_t>& out) {
  out.clear();
  int64_t i = 0;
#ifdef PAGEDSERVE_AVX512
  const __m512 tv = _mm512_set1_ps(threshold);
  for (; i + 16 <= V; i += 16)
    for (__mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(w + i), tv, _CMP_GE_OQ); hit; hit &= hit - 1)
      out.push_back(static_cast<int32_t>(i + __builtin_ctz(hit)));
#elif defined(PAGEDSERVE_AVX2)
  const __m256 tv = _mm256_set1_ps(threshold);
  for (; i + 8 <= V; i += 8)
    for (int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(w + i), tv, _CMP_GE_OQ)); hit; hit &= hit - 1)
      out.push_back(static_cast<int32_t>(i + __builtin_ctz(hit)));
#endif
  for (; i < V; ++i)
    if (w[i] >= threshold) out.push_back(static_cast<int32_t>(i));
}

// One draw: the race's token of the row x under the filters for the key, or -1 (a NaN, or no finite logit)
int64_t draw_row(const float* x, int64_t V, const Params& p, uint64_t key, std::vector<float>& w,
                 std::vector<int32_t>& kept) {
  bool nan = false;
  const float m = pagedserve::row_max(x, V, nan);
  if (nan || !std::isfinite(m)) return -1;
  if (!std::isfinite(p.inv_t)) {   // a temperature so small that 1 / T overflows: the limit, the first max
    int64_t i = 0;
    while (x[i] != m) ++i;
    return i;
  }
  const uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  const bool top_k = p.top_k > 0 && p.top_k < V, top_p = p.top_p < 1.f;
  // min-p alone is a floor on the weights; after top-k or top-p it applies to what they kept
  if (!top_k && !top_p) return race_all(x, V, m, p.inv_t, p.min_p, k0, k1);
  w.resize(V);
  const double total = weights(x, V, m, p.inv_t, w.data());
  // the largest tokens, enough for the filter: a weight of 2^-12, then 2^-24, 2^-36, then any positive
  float threshold = 1.f / 4096;
  for (int attempt = 0;; ++attempt) {
    gather(w.data(), V, attempt < 3 ? threshold : std::numeric_limits<float>::denorm_min(), kept);
    if (attempt >= 3) break;
    if (top_k ? static_cast<int64_t>(kept.size()) >= p.top_k : [&] {
          double mass = 0;
          for (const int32_t i : kept) mass += w[i];
          return mass >= static_cast<double>(p.top_p) * total;
        }())
      break;
    threshold /= 4096;
  }
  std::sort(kept.begin(), kept.end(), [&](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); });
  size_t n = kept.size();
  double mass = total;
  if (top_k && n > static_cast<size_t>(p.top_k)) {
    const float kth = x[kept[p.top_k - 1]];
    n = p.top_k;
    while (n < kept.size() && x[kept[n]] >= kth) ++n;
  }
  if (top_k) {
    mass = 0;
    for (size_t j = 0; j < n; ++j) mass += w[kept[j]];
  }
  if (top_p) {
    const double limit = static_cast<double>(p.top_p) * mass;
    double before = 0;
    size_t j = 0;
    for (; j < n && (j == 0 || before < limit); ++j) before += w[kept[j]];
    n = j;
  }
  kept.resize(n);
  if (kept.empty()) return -1;   // (never: the max token's weight, 1, passes every threshold)
  if (p.min_p > 0.f)   // (the first, the max token, has weight 1)
    kept.erase(std::remove_if(kept.begin() + 1, kept.end(), [&](int32_t i) { return w[i] < p.min_p; }), kept.end());
  std::sort(kept.begin(), kept.end());
  float best = -1.f;
  int64_t at = -1;
  for (const int32_t i : kept) {
    const float r = w[i] / noise(static_cast<uint32_t>(i), k0, k1);
    if (r > best) best = r, at = i;
  }
  return best > 0.f ? at : -1;
}

}  // namespace

// logits float32 [R, V]; per row its temperature, top-k, top-p and min-p (params float32 [R, 4]); per
// draw its row (rows int64 [D]) and the key of its noise (keys int64 [D], any 64 bits). Returns the drawn
// tokens (int64 [D]; -1 where the row has a NaN or no finite logit).
at::Tensor sample_draws(at::Tensor logits, at::Tensor params, at::Tensor rows, at::Tensor keys) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0,
              "sample_draws: logits must be contiguous float32 [R, V]");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(params.scalar_type() == at::kFloat && params.is_contiguous() && params.dim() == 2 &&
              params.size(0) == R && params.size(1) == 4, "sample_draws: params float32 [R, 4]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.dim() == 1 &&
              keys.scalar_type() == at::kLong && keys.is_contiguous() && keys.sizes() == rows.sizes(),
              "sample_draws: rows int64 [D] and keys int64 [D]");
  const int64_t D = rows.size(0);
  const float* xp = logits.data_ptr<float>();
  const float* pp = params.data_ptr<float>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* kp = keys.data_ptr<int64_t>();
  for (int64_t d = 0; d < D; ++d) {
    TORCH_CHECK(rp[d] >= 0 && rp[d] < R, "sample_draws: a draw's row is out of range");
    TORCH_CHECK(pp[4 * rp[d]] > 0.f, "sample_draws: a sampled row's temperature must be positive");
  }
  auto out = at::empty({D}, rows.options());
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, D, 1, [&](int64_t d0, int64_t d1) {
    std::vector<float> w;
    std::vector<int32_t> kept;
    for (int64_t d = d0; d < d1; ++d) {
      const float* q = pp + 4 * rp[d];
      const Params p{1.f / q[0], static_cast<int64_t>(q[1]), q[2], q[3]};
      op[d] = draw_row(xp + rp[d] * V, V, p, static_cast<uint64_t>(kp[d]), w, kept);
    }
  });
  return out;
}
