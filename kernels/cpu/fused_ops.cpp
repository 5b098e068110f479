// The elementwise parts of a Llama layer in one pass each, for the lean forward (data_plane/llama_forward.py):
// the residual add with RMSNorm, the rotary embedding of Q and K, and SiLU(gate) * up.
//
// In torch each is 3-12 separate operations, each a pass over its tensor and a dispatch; for a
// decode step of a few sequences the dispatches cost more than the arithmetic. The arithmetic is
// torch's own, in the same order per element: x * rsqrt(mean(x^2) + eps) * w, q * cos + rot(q) * sin,
// gate / (1 + exp(-gate)) * up. Only the sum of squares is accumulated in another order (and
// expf may differ from torch's vectorized exp in the last bit), so the results agree with torch's to
// float32 rounding. Products and sums are not contracted into FMAs, as torch's separate ops are not.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

// for every function below, lambdas included (a function attribute does not reach a lambda's body)
#pragma GCC optimize("fp-contract=off")

namespace {

// grain: rows per task, so that a decode step of a few rows stays on one thread
constexpr int64_t kRowGrain = 8;

void norm_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  // sixteen running sums, one per lane, so that the compiler keeps them in one vector register
  float lanes[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) lanes[j] += x[i + j] * x[i + j];
  float sum = 0.f;
  for (int j = 0; j < 16; ++j) sum += lanes[j];
  for (; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

}  // namespace

// residual += x (in place), then out = RMSNorm(residual) * w; with x undefined, only the norm
torch::Tensor add_rms_norm(torch::Tensor residual, c10::optional<torch::Tensor> x, torch::Tensor w,
                                  double eps) {
  TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.dim() == 2 && residual.is_contiguous(),
              "add_rms_norm: residual must be contiguous float32 [rows, hidden]");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == residual.size(1),
              "add_rms_norm: weight must be float32 [hidden]");
  const int64_t rows = residual.size(0), n = residual.size(1);
  const float* xp = nullptr;
  int64_t x_stride = 0;
  if (x.has_value()) {
    TORCH_CHECK(x->scalar_type() == at::kFloat && x->dim() == 2 && x->size(0) == rows && x->size(1) == n &&
                x->stride(1) == 1, "add_rms_norm: x must be float32 [rows, hidden] with unit last stride");
    xp = x->data_ptr<float>();
    x_stride = x->stride(0);
  }
  auto out = torch::empty_like(residual);
  float* rp = residual.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, kRowGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* row = rp + r * n;
      if (xp)
        for (int64_t i = 0; i < n; ++i) row[i] = row[i] + xp[r * x_stride + i];
      norm_row(row, wp, op + r * n, n, e);
    }
  });
  return out;
}

// q [T, H, D] and k [T, Hk, D] rows of a [T, *] tensor (any row stride, unit last stride); cos, sin
// [T, D]. Returns contiguous rotated copies: x * cos + cat(-x[D/2:], x[:D/2]) * sin.
std::vector<torch::Tensor> rotary(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && q.dim() == 3 && k.dim() == 3,
              "rotary: q and k must be float32 [tokens, heads, dim]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(1) == k.size(2),
              "rotary: heads must be packed with unit last stride");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
              cos.dim() == 2 && cos.size(0) == q.size(0) && cos.size(1) == q.size(2) && sin.sizes() == cos.sizes(),
              "rotary: cos and sin must be contiguous float32 [tokens, dim]");
  const int64_t tokens = q.size(0), d = q.size(2), half = d / 2;
  TORCH_CHECK(k.size(0) == tokens && k.size(2) == d && d % 2 == 0, "rotary: q and k disagree");
  auto qo = torch::empty({tokens, q.size(1), d}, q.options());
  auto ko = torch::empty({tokens, k.size(1), d}, k.options());
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  auto one = [&](const torch::Tensor& src, torch::Tensor& dst, int64_t t) {
    const float* c = cp + t * d;
    const float* s = sp + t * d;
    const int64_t heads = src.size(1);
    const float* in = src.data_ptr<float>() + t * src.stride(0);
    float* out = dst.data_ptr<float>() + t * heads * d;
    for (int64_t h = 0; h < heads; ++h) {
      const float* x = in + h * d;
      float* y = out + h * d;
      for (int64_t i = 0; i < half; ++i) {
        const float a = x[i] * c[i];
        const float b = (-x[i + half]) * s[i];
        y[i] = a + b;
      }
      for (int64_t i = half; i < d; ++i) {
        const float a = x[i] * c[i];
        const float b = x[i - half] * s[i];
        y[i] = a + b;
      }
    }
  };
  at::parallel_for(0, tokens, kRowGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      one(q, qo, t);
      one(k, ko, t);
    }
  });
  return {qo, ko};
}

// gate_up [T, 2I] (gate, then up) -> SiLU(gate) * up, [T, I]. Its expf is scalar: the lean forward
// uses it for a few rows only, where torch's dispatches cost more than torch's vectorized exp saves.
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.dim() == 2 && gate_up.is_contiguous() &&
              gate_up.size(1) % 2 == 0, "silu_mul: gate_up must be contiguous float32 [rows, 2 * inner]");
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2;
  auto out = torch::empty({rows, inner}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = gp + r * 2 * inner;
      const float* u = g + inner;
      float* y = op + r * inner;
      for (int64_t i = 0; i < inner; ++i) y[i] = (g[i] / (1.f + std::exp(-g[i]))) * u[i];
    }
  });
  return out;
}

// k, v [T, Hk, D] (any token stride, heads packed) into the flat caches [slots, Hk, D] at slot_mapping[t];
// slot -1: skipped. One call per layer instead of torch's mask, select and two index_copy_ calls.
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots) {
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
              v_cache.scalar_type() == at::kFloat, "write_kv: float32 only");
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
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    if (sp[t] < 0) continue;
    std::copy(kp + t * k.stride(0), kp + t * k.stride(0) + width, kc + sp[t] * width);
    std::copy(vp + t * v.stride(0), vp + t * v.stride(0) + width, vc + sp[t] * width);
  }
}
