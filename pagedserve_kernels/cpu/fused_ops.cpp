// The elementwise parts of a Llama layer in one pass each, for the lean forward (data_plane/llama_forward.py):
// the residual add with RMSNorm, the rotary embedding of Q and K, and SiLU(gate) * up.
//
// In torch each is 3-12 separate operations, each a pass over its tensor and a dispatch; for a
// decode step of a few sequences the dispatches cost more than the arithmetic. The arithmetic is
// torch's own, in the same order per element: x * rsqrt(mean(x^2) + eps) * w, q * cos + rot(q) * sin,
// gate / (1 + exp(-gate)) * up. The sum of squares adds in torch's order (torch_sum_of_squares); expf
// may differ from torch's vectorized exp in the last bit, so the results agree with torch's to float32
// rounding. Products and sums are not contracted into FMAs, as torch's separate ops are not.
//
// In bfloat16 every function rounds where transformers' bfloat16 forward rounds (each torch operation
// writes bfloat16; RMSNorm works in float32 and rounds before the weight), with float32 arithmetic in
// between, so the results are transformers' up to the same float32 differences.
#include "aten.h"

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

// for every function below, lambdas included (a function attribute does not reach a lambda's body)
#pragma GCC optimize("fp-contract=off")

namespace {

// grain: rows per task, so that a decode step of a few rows stays on one thread
constexpr int64_t kRowGrain = 8;

using pagedserve::bf16;
using pagedserve::from_float;
using pagedserve::rounded;
using pagedserve::to_float;

// The sum of x[i]^2 over a row as torch's `x.pow(2).mean(-1)` adds it in float32 (its inner sum,
// aten/src/ATen/native/cpu/SumKernel.cpp, whose kernels run on eight-lane vectors on x86 even where the
// CPU has AVX-512): the row as vectors of 8, vector v in accumulator v % 4 (ilp), each accumulator a
// cascade of levels that takes 2^power vectors at a time; leftover vectors into the first accumulator,
// the four added in order; then, from zero, the leftover elements and the eight lanes in order.
template <typename T>
float torch_sum_of_squares(const T* x, int64_t n) {
  constexpr int kLanes = 8, kIlp = 4, kLevels = 4;
  const int64_t vectors = n / kLanes, size = vectors / kIlp;
  int64_t ceil_log2 = 1;
  while ((int64_t{1} << ceil_log2) < size) ++ceil_log2;
  const int64_t power = std::max<int64_t>(4, ceil_log2 / kLevels), step = int64_t{1} << power, mask = step - 1;
  float acc[kLevels][kIlp][kLanes] = {};
  auto add_vector = [&](float* into, int64_t v) {
    for (int l = 0; l < kLanes; ++l) {
      const float e = to_float(x[v * kLanes + l]);
      into[l] += e * e;
    }
  };
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int k = 0; k < kIlp; ++k) add_vector(acc[0][k], i * kIlp + k);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kIlp; ++k)
        for (int l = 0; l < kLanes; ++l) {
          acc[j][k][l] += acc[j - 1][k][l];
          acc[j - 1][k][l] = 0.f;
        }
      if (i & (mask << (j * power))) break;
    }
  }
  for (; i < size; ++i)
    for (int k = 0; k < kIlp; ++k) add_vector(acc[0][k], i * kIlp + k);
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < kIlp; ++k)
      for (int l = 0; l < kLanes; ++l) acc[0][k][l] += acc[j][k][l];
  for (int64_t v = size * kIlp; v < vectors; ++v) add_vector(acc[0][0], v);
  for (int k = 1; k < kIlp; ++k)
    for (int l = 0; l < kLanes; ++l) acc[0][0][l] += acc[0][k][l];
  float sum = 0.f;
  for (int64_t e = vectors * kLanes; e < n; ++e) sum += to_float(x[e]) * to_float(x[e]);
  for (int l = 0; l < kLanes; ++l) sum += acc[0][0][l];
  return sum;
}

template <typename T>
void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  const float inv = 1.f / std::sqrt(torch_sum_of_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = from_float<T>(to_float(w[i]) * rounded<T>(to_float(x[i]) * inv));
}

template <typename T> T* data(const at::Tensor& t) { return static_cast<T*>(t.data_ptr()); }

// the kernels' two element types
bool float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

template <typename T>
void add_rms_norm_rows(at::Tensor& residual, const c10::optional<at::Tensor>& x, const at::Tensor& w, at::Tensor& out,
                       float eps) {
  const int64_t rows = residual.size(0), n = residual.size(1);
  const T* xp = x.has_value() ? data<T>(*x) : nullptr;
  const int64_t x_stride = x.has_value() ? x->stride(0) : 0;
  T* rp = data<T>(residual);
  const T* wp = data<T>(w);
  T* op = data<T>(out);
  at::parallel_for(0, rows, kRowGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* row = rp + r * n;
      if (xp)
        for (int64_t i = 0; i < n; ++i) row[i] = from_float<T>(to_float(row[i]) + to_float(xp[r * x_stride + i]));
      norm_row(row, wp, op + r * n, n, eps);
    }
  });
}

}  // namespace

// residual += x (in place), then out = RMSNorm(residual) * w; with x undefined, only the norm
at::Tensor add_rms_norm(at::Tensor residual, c10::optional<at::Tensor> x, at::Tensor w,
                                  double eps) {
  const auto dtype = residual.scalar_type();
  TORCH_CHECK(float_or_bf16(residual) && residual.dim() == 2 && residual.is_contiguous(),
              "add_rms_norm: residual must be contiguous float32 or bfloat16 [rows, hidden]");
  TORCH_CHECK(w.scalar_type() == dtype && w.is_contiguous() && w.numel() == residual.size(1),
              "add_rms_norm: weight must be [hidden] of the residual's type");
  if (x.has_value())
    TORCH_CHECK(x->scalar_type() == dtype && x->dim() == 2 && x->size(0) == residual.size(0) &&
                x->size(1) == residual.size(1) && x->stride(1) == 1,
                "add_rms_norm: x must be [rows, hidden] of the residual's type with unit last stride");
  auto out = at::empty_like(residual);
  if (dtype == at::kFloat) add_rms_norm_rows<float>(residual, x, w, out, static_cast<float>(eps));
  else add_rms_norm_rows<bf16>(residual, x, w, out, static_cast<float>(eps));
  return out;
}

namespace {

// x * cos + rotate_half(x) * sin for `heads` heads of one token (in: heads packed, out likewise);
// each product and the sum rounded to T
template <typename T>
void rotate_heads(const T* in, T* out, int64_t heads, int64_t d, const T* c, const T* s) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const T* x = in + h * d;
    T* y = out + h * d;
    for (int64_t i = 0; i < half; ++i) {
      const float a = rounded<T>(to_float(x[i]) * to_float(c[i]));
      const float b = rounded<T>((-to_float(x[i + half])) * to_float(s[i]));
      y[i] = from_float<T>(a + b);
    }
    for (int64_t i = half; i < d; ++i) {
      const float a = rounded<T>(to_float(x[i]) * to_float(c[i]));
      const float b = rounded<T>(to_float(x[i - half]) * to_float(s[i]));
      y[i] = from_float<T>(a + b);
    }
  }
}

template <typename T>
void rotary_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                 at::Tensor& qo, at::Tensor& ko) {
  const int64_t tokens = q.size(0), d = q.size(2);
  const T* cp = data<T>(cos);
  const T* sp = data<T>(sin);
  auto one = [&](const at::Tensor& src, at::Tensor& dst, int64_t t) {
    const int64_t heads = src.size(1);
    rotate_heads<T>(data<T>(src) + t * src.stride(0), data<T>(dst) + t * heads * d, heads, d, cp + t * d, sp + t * d);
  };
  at::parallel_for(0, tokens, kRowGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      one(q, qo, t);
      one(k, ko, t);
    }
  });
}

}  // namespace

// q [T, H, D] and k [T, Hk, D] rows of a [T, *] tensor (any row stride, unit last stride); cos, sin
// [T, D]. Returns contiguous rotated copies: x * cos + cat(-x[D/2:], x[:D/2]) * sin.
std::vector<at::Tensor> rotary(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(float_or_bf16(q) && k.scalar_type() == dtype && q.dim() == 3 && k.dim() == 3,
              "rotary: q and k must be float32 or bfloat16 [tokens, heads, dim]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(1) == k.size(2),
              "rotary: heads must be packed with unit last stride");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == dtype && sin.scalar_type() == dtype &&
              cos.dim() == 2 && cos.size(0) == q.size(0) && cos.size(1) == q.size(2) && sin.sizes() == cos.sizes(),
              "rotary: cos and sin must be contiguous [tokens, dim] of q's type");
  const int64_t tokens = q.size(0), d = q.size(2), half = d / 2;
  TORCH_CHECK(k.size(0) == tokens && k.size(2) == d && d % 2 == 0, "rotary: q and k disagree");
  auto qo = at::empty({tokens, q.size(1), d}, q.options());
  auto ko = at::empty({tokens, k.size(1), d}, k.options());
  if (dtype == at::kFloat) rotary_rows<float>(q, k, cos, sin, qo, ko);
  else rotary_rows<bf16>(q, k, cos, sin, qo, ko);
  return {qo, ko};
}

// One attention layer's rows of qkv [T, (H + 2 Hk) D] (any row stride; q, k, v packed in a row, as the
// stacked product writes them): q rotated into a new contiguous [T, H, D], which is returned; k rotated
// and v copied straight into the caches [blocks, block_size, Hk, D] at slots[t] (-1: skipped). The
// same arithmetic as rotary and the same bytes as write_kv, in one call instead of the slicing, the
// two calls and the temporary k between them.
at::Tensor rotary_store(at::Tensor qkv, int64_t heads, int64_t kv_heads, at::Tensor cos, at::Tensor sin,
                        at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots) {
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK(float_or_bf16(qkv) && qkv.dim() == 2 && qkv.stride(1) == 1, "rotary_store: qkv [tokens, width] float32 or bfloat16");
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype && k_cache.is_contiguous() &&
              v_cache.is_contiguous() && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
              k_cache.size(2) == kv_heads, "rotary_store: caches contiguous [blocks, block_size, kv_heads, dim] of qkv's type");
  const int64_t tokens = qkv.size(0), d = k_cache.size(3);
  TORCH_CHECK(heads > 0 && kv_heads > 0 && d % 2 == 0 && qkv.size(1) == (heads + 2 * kv_heads) * d,
              "rotary_store: qkv's width is not (heads + 2 kv_heads) * dim");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == dtype && sin.scalar_type() == dtype &&
              cos.dim() == 2 && cos.size(0) == tokens && cos.size(1) == d && sin.sizes() == cos.sizes(),
              "rotary_store: cos and sin must be contiguous [tokens, dim] of qkv's type");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == tokens,
              "rotary_store: one int64 slot per token");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1), width = kv_heads * d;
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(sp[t] >= -1 && sp[t] < num_slots, "rotary_store: slot ", sp[t], " out of range");
  auto q = at::empty({tokens, heads, d}, qkv.options());
  auto run = [&](auto zero) {
    using T = decltype(zero);
    const T* src = data<T>(qkv);
    const T* cp = data<T>(cos);
    const T* snp = data<T>(sin);
    T* qp = data<T>(q);
    T* kc = data<T>(k_cache);
    T* vc = data<T>(v_cache);
    const int64_t stride = qkv.stride(0);
    at::parallel_for(0, tokens, kRowGrain, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const T* row = src + t * stride;
        rotate_heads<T>(row, qp + t * heads * d, heads, d, cp + t * d, snp + t * d);
        if (sp[t] < 0) continue;
        rotate_heads<T>(row + heads * d, kc + sp[t] * width, kv_heads, d, cp + t * d, snp + t * d);
        std::memcpy(vc + sp[t] * width, row + (heads + kv_heads) * d, sizeof(T) * width);
      }
    });
  };
  if (dtype == at::kFloat) run(float{});
  else run(bf16{});
  return q;
}

// gate_up [T, 2I] (gate, then up) -> SiLU(gate) * up, [T, I]: gate / (1 + e^-gate) * up, as torch
// computes it; with AVX-512 in sixteen lanes (simd.h's exp16, within ~2e-7 of expf), with AVX2 in eight
// (exp8: the same arithmetic, so the same bits), else expf.
namespace {

// SiLU(gate) rounded to T (torch's silu writes T), times up, rounded to T
template <typename T>
void silu_mul_rows(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2;
  const T* gp = data<T>(gate_up);
  T* op = data<T>(out);
  // split by elements, not rows, so that one row of a decode step uses every thread too
  at::parallel_for(0, rows * inner, 2048, [&](int64_t e0, int64_t e1) {
    for (int64_t e = e0; e < e1;) {
      const int64_t r = e / inner, i0 = e % inner, i1 = std::min(inner, i0 + (e1 - e));
      const T* g = gp + r * 2 * inner;
      const T* u = g + inner;
      T* y = op + r * inner;
      int64_t i = i0;
#ifdef PAGEDSERVE_AVX512
      const __m512 one = _mm512_set1_ps(1.f);
      for (; i + 16 <= i1; i += 16) {
        const __m512 gv = pagedserve::load16(g + i);
        const __m512 e_neg = pagedserve::exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        const __m512 silu = pagedserve::rounded16<T>(_mm512_div_ps(gv, _mm512_add_ps(one, e_neg)));
        pagedserve::store16(y + i, _mm512_mul_ps(silu, pagedserve::load16(u + i)));
      }
#elif defined(PAGEDSERVE_AVX2)
      const __m256 one = _mm256_set1_ps(1.f);
      for (; i + 8 <= i1; i += 8) {
        const __m256 gv = pagedserve::load8(g + i);
        const __m256 e_neg = pagedserve::exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        const __m256 silu = pagedserve::rounded8<T>(_mm256_div_ps(gv, _mm256_add_ps(one, e_neg)));
        pagedserve::store8(y + i, _mm256_mul_ps(silu, pagedserve::load8(u + i)));
      }
#endif
      for (; i < i1; ++i) {
        const float gi = to_float(g[i]);
        y[i] = from_float<T>(rounded<T>(gi / (1.f + std::exp(-gi))) * to_float(u[i]));
      }
      e += i1 - i0;
    }
  });
}

}  // namespace

at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(float_or_bf16(gate_up) && gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be contiguous float32 or bfloat16 [rows, 2 * inner]");
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) silu_mul_rows<float>(gate_up, out);
  else silu_mul_rows<bf16>(gate_up, out);
  return out;
}

namespace {

// greedy_logsumexp's rows (below) of float32 or bfloat16 logits: a bfloat16 row gives what its float32
// widening would, the same operations on the same values, without writing the widened copy first
template <typename T>
void greedy_rows(const T* lp, int64_t rows, int64_t vocab, float* bp, int64_t* ip, float* sp) {
  using pagedserve::to_float;
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* x = lp + r * vocab;
      // the max (and whether any NaN), then the first position that holds it
      bool nan = false;
      const float m = pagedserve::row_max(x, vocab, nan);
      int64_t at = 0;
#ifdef PAGEDSERVE_AVX512
      for (const __m512 mv = _mm512_set1_ps(m); at + 16 <= vocab; at += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(pagedserve::load16(x + at), mv, _CMP_EQ_OQ);
        if (hit) { at += __builtin_ctz(hit); break; }
      }
#elif defined(PAGEDSERVE_AVX2)
      for (const __m256 mv = _mm256_set1_ps(m); at + 8 <= vocab; at += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(pagedserve::load8(x + at), mv, _CMP_EQ_OQ));
        if (hit) { at += __builtin_ctz(hit); break; }
      }
#endif
      while (at < vocab && !(to_float(x[at]) == m)) ++at;
      bp[r] = m;
      ip[r] = at < vocab ? at : 0;
      if (nan || !std::isfinite(m)) { sp[r] = std::numeric_limits<float>::quiet_NaN(); continue; }
      int64_t i = 0;
      float sum = 0.f;
#ifdef PAGEDSERVE_AVX512
      const __m512 mv = _mm512_set1_ps(m);
      __m512 total = _mm512_setzero_ps();
      for (; i + 16 <= vocab; i += 16)
        total = _mm512_add_ps(total, pagedserve::exp16(_mm512_sub_ps(pagedserve::load16(x + i), mv)));
      sum = _mm512_reduce_add_ps(total);
#elif defined(PAGEDSERVE_AVX2)
      const __m256 mv = _mm256_set1_ps(m);
      __m256 total = _mm256_setzero_ps();
      for (; i + 8 <= vocab; i += 8)
        total = _mm256_add_ps(total, pagedserve::exp8(_mm256_sub_ps(pagedserve::load8(x + i), mv)));
      sum = pagedserve::hsum8(total);
#endif
      for (; i < vocab; ++i) sum += std::exp(to_float(x[i]) - m);
      sp[r] = m + std::log(sum);
    }
  });
}

}  // namespace

// logits [R, V] -> per row (max, first index of the max, log-sum-exp): torch's logits.max(-1) and
// logsumexp(-1) in two passes over each row, without the [R, V] temporaries torch writes. A row with a
// NaN, or whose max is not finite, gets a NaN log-sum-exp: the caller then uses torch's own ops. The
// results are float32 whatever the logits' type.
std::vector<at::Tensor> greedy_logsumexp(at::Tensor logits) {
  TORCH_CHECK(float_or_bf16(logits) && logits.dim() == 2 && logits.is_contiguous(),
              "greedy_logsumexp: contiguous float32 or bfloat16 [rows, vocab]");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "greedy_logsumexp: empty rows");
  const auto options = logits.options().dtype(at::kFloat);
  auto best = at::empty({rows}, options);
  auto index = at::empty({rows}, options.dtype(at::kLong));
  auto lse = at::empty({rows}, options);
  float* bp = best.data_ptr<float>();
  int64_t* ip = index.data_ptr<int64_t>();
  float* sp = lse.data_ptr<float>();
  if (logits.scalar_type() == at::kFloat) greedy_rows(logits.data_ptr<float>(), rows, vocab, bp, ip, sp);
  else greedy_rows(reinterpret_cast<const bf16*>(logits.data_ptr<at::BFloat16>()), rows, vocab, bp, ip, sp);
  return {best, index, lse};
}

// k, v [T, Hk, D] (any token stride, heads packed) into the flat caches [slots, Hk, D] at slot_mapping[t];
// slot -1: skipped. One call per layer instead of torch's mask, select and two index_copy_ calls.
void write_kv(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots) {
  const auto dtype = k.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && v.scalar_type() == dtype &&
              k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "write_kv: float32 or bfloat16, the same for k, v and the caches");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1 &&
              k.stride(1) == k.size(2) && v.stride(1) == v.size(2), "write_kv: k and v [tokens, heads, dim], heads packed");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
              k_cache.dim() == 4 && k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2),
              "write_kv: caches must be contiguous [blocks, block_size, heads, dim] matching k");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == k.size(0),
              "write_kv: one int64 slot per token");
  const int64_t tokens = k.size(0), width = k.size(1) * k.size(2);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(sp[t] >= -1 && sp[t] < num_slots, "write_kv: slot ", sp[t], " out of range");
  // a token's row is copied as bytes: the caches hold the same type as k and v
  const int64_t item = k.element_size(), row = width * item;
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    if (sp[t] < 0) continue;
    std::memcpy(kc + sp[t] * row, kp + t * k.stride(0) * item, row);
    std::memcpy(vc + sp[t] * row, vp + t * v.stride(0) * item, row);
  }
}
