// The draws of sampled rows (temperature > 0; data_plane/sampler.py says the rules): per draw, one pass
// over its row's logits for the largest, one for the weights w_i = exp((x_i - max) / T), then the
// filters on the few tokens that can pass them and one uniform number u turned into a token by the
// inverse of the kept weights' cumulative sum, in token order. torch's route (sort the 49,152 logits for
// top-p, a softmax, 49,152 exponential draws and an argmax, row by row) costs about a millisecond a row
// for the draw alone and several with top-p.
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
// Sums of weights are in double, over fixed chunks in a fixed order, so that the draw depends on the
// row and u alone: not on the batch or the threads. A row with a NaN, or with no finite logit, gives
// -1 (the caller then takes torch's route).
#include "aten.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t kChunk = 16;   // weights per partial sum

struct Params {
  float inv_t;     // 1 / temperature
  int64_t top_k;   // 0 < top_k < V: on
  float top_p;     // < 1: on
  float min_p;     // > 0: on
};

// the largest logit of the row; NaN where any is NaN
float row_max(const float* x, int64_t V) {
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#ifdef PAGEDSERVE_AVX512
  __m512 mx = _mm512_set1_ps(m);
  __mmask16 unordered = 0;
  for (; i + 16 <= V; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mx = _mm512_max_ps(mx, v);
  }
  m = _mm512_reduce_max_ps(mx);
  nan = unordered != 0;
#elif defined(PAGEDSERVE_AVX2)
  __m256 mx = _mm256_set1_ps(m), unordered = _mm256_setzero_ps();
  for (; i + 8 <= V; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mx = _mm256_max_ps(mx, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  for (const float v : lanes) m = v > m ? v : m;
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; i < V; ++i) {
    nan |= x[i] != x[i];
    m = x[i] > m ? x[i] : m;
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : m;
}

// w[i] = exp((x[i] - m) * inv_t), 0 where that is under `floor`; sums[c] the sum of chunk c's weights.
// Returns the row's total (the chunks' sums added in order).
double weights(const float* x, int64_t V, float m, float inv_t, float floor, float* w, float* sums) {
  int64_t i = 0;
  double total = 0;
#ifdef PAGEDSERVE_AVX512
  const __m512 mv = _mm512_set1_ps(m), tv = _mm512_set1_ps(inv_t), fv = _mm512_set1_ps(floor);
  for (; i + kChunk <= V; i += kChunk) {
    __m512 e = pagedserve::exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv), tv));
    e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(e, fv, _CMP_GE_OQ), e);
    _mm512_storeu_ps(w + i, e);
    sums[i / kChunk] = _mm512_reduce_add_ps(e);
    total += sums[i / kChunk];
  }
#elif defined(PAGEDSERVE_AVX2)
  const __m256 mv = _mm256_set1_ps(m), tv = _mm256_set1_ps(inv_t), fv = _mm256_set1_ps(floor);
  for (; i + kChunk <= V; i += kChunk) {
    __m256 a = pagedserve::exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv), tv));
    __m256 b = pagedserve::exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), mv), tv));
    a = _mm256_and_ps(a, _mm256_cmp_ps(a, fv, _CMP_GE_OQ));
    b = _mm256_and_ps(b, _mm256_cmp_ps(b, fv, _CMP_GE_OQ));
    _mm256_storeu_ps(w + i, a);
    _mm256_storeu_ps(w + i + 8, b);
    sums[i / kChunk] = pagedserve::hsum8(_mm256_add_ps(a, b));
    total += sums[i / kChunk];
  }
#endif
  for (; i < V; i += kChunk) {   // the last, partial chunk (every chunk without SIMD)
    float s = 0.f;
    for (int64_t j = i; j < std::min(V, i + kChunk); ++j) {
      const float e = std::exp((x[j] - m) * inv_t);
      w[j] = e >= floor ? e : 0.f;
      s += w[j];
    }
    sums[i / kChunk] = s;
    total += s;
  }
  return total;
}

// The token of u over every token's weight (chunk sums `sums`, their total `total`): the first whose
// running sum passes u * total; where rounding leaves none, the last of positive weight in the chunk
// (or the row) the walk ended in
int64_t draw_all(const float* w, const float* sums, int64_t V, double total, double u) {
  const double target = u * total;
  double before = 0;
  const int64_t chunks = (V + kChunk - 1) / kChunk;
  int64_t c = 0;
  for (; c < chunks && before + sums[c] <= target; ++c) before += sums[c];
  const int64_t from = c < chunks ? c * kChunk : 0, to = c < chunks ? std::min(V, from + kChunk) : V;
  int64_t last = -1;
  for (int64_t i = from; i < to; ++i) {
    if (w[i] <= 0.f) continue;
    last = i;
    before += w[i];
    if (c < chunks && before > target) return i;
  }
  return last;
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

// One draw: the token for u of the row x under the filters, or -1 (a NaN, or no finite logit)
int64_t draw_row(const float* x, int64_t V, const Params& p, double u, std::vector<float>& w,
                 std::vector<float>& sums, std::vector<int32_t>& kept) {
  const float m = row_max(x, V);
  if (!std::isfinite(m)) return -1;
  if (!std::isfinite(p.inv_t)) {   // a temperature so small that 1 / T overflows: the limit, the first max
    int64_t i = 0;
    while (x[i] != m) ++i;
    return i;
  }
  w.resize(V);
  sums.resize((V + kChunk - 1) / kChunk);
  const bool top_k = p.top_k > 0 && p.top_k < V, top_p = p.top_p < 1.f;
  // min-p alone is a floor on the weights; after top-k or top-p it applies to what they kept
  const float floor = p.min_p > 0.f && !top_k && !top_p ? p.min_p : 0.f;
  const double total = weights(x, V, m, p.inv_t, floor, w.data(), sums.data());
  if (!top_k && !top_p) return draw_all(w.data(), sums.data(), V, total, u);
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
  double sum = 0;
  for (const int32_t i : kept) sum += w[i];
  const double target = u * sum;
  double before = 0;
  int64_t last = -1;
  for (const int32_t i : kept) {
    if (w[i] <= 0.f) continue;
    last = i;
    before += w[i];
    if (before > target) return i;
  }
  return last;
}

}  // namespace

// logits float32 [R, V]; per row its temperature, top-k, top-p and min-p (params float32 [R, 4]); per
// draw its row (rows int64 [D]) and its uniform number in [0, 1) (u float64 [D]). Returns the drawn
// tokens (int64 [D]; -1 where the row has a NaN or no finite logit).
at::Tensor sample_draws(at::Tensor logits, at::Tensor params, at::Tensor rows, at::Tensor u) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0,
              "sample_draws: logits must be contiguous float32 [R, V]");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(params.scalar_type() == at::kFloat && params.is_contiguous() && params.dim() == 2 &&
              params.size(0) == R && params.size(1) == 4, "sample_draws: params float32 [R, 4]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.dim() == 1 &&
              u.scalar_type() == at::kDouble && u.is_contiguous() && u.sizes() == rows.sizes(),
              "sample_draws: rows int64 [D] and u float64 [D]");
  const int64_t D = rows.size(0);
  const float* xp = logits.data_ptr<float>();
  const float* pp = params.data_ptr<float>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const double* up = u.data_ptr<double>();
  for (int64_t d = 0; d < D; ++d) {
    TORCH_CHECK(rp[d] >= 0 && rp[d] < R, "sample_draws: a draw's row is out of range");
    TORCH_CHECK(pp[4 * rp[d]] > 0.f, "sample_draws: a sampled row's temperature must be positive");
    TORCH_CHECK(up[d] >= 0.0 && up[d] < 1.0, "sample_draws: u must lie in [0, 1)");
  }
  auto out = at::empty({D}, rows.options());
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, D, 1, [&](int64_t d0, int64_t d1) {
    std::vector<float> w, sums;
    std::vector<int32_t> kept;
    for (int64_t d = d0; d < d1; ++d) {
      const float* q = pp + 4 * rp[d];
      const Params p{1.f / q[0], static_cast<int64_t>(q[1]), q[2], q[3]};
      op[d] = draw_row(xp + rp[d] * V, V, p, up[d], w, sums, kept);
    }
  });
  return out;
}
