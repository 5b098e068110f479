// The decoder layers of a Llama-style model whose every product reads GGUF codes, in one call per step: a
// float32 model's at every row count; a bfloat16 model's for the few rows its products read codes, and above
// those where each product's route for more rows is one of this module's bfloat16 kernels.
// data_plane/llama_forward.py calls the same kernels in the same order from Python, about ten calls a
// layer; those calls' own cost (Python, pybind11, building the arguments) is a visible share of a step's
// time next to the kernels, and while one thread runs it the others wait for the next kernel: a loop here
// skips it. Same kernels, same arguments, same order: the same bits.
#include "coded_layers.h"

#include <utility>

at::Tensor coded_linear(at::Tensor x, at::Tensor codes, at::Tensor scales, c10::optional<at::Tensor> mins,
                        c10::optional<at::Tensor> one_row);
at::Tensor coded_pairs_linear(at::Tensor x, at::Tensor codes, at::Tensor scales, c10::optional<at::Tensor> mins,
                              c10::optional<at::Tensor> one_row);
at::Tensor bf16_dots_codes_linear(at::Tensor x, at::Tensor codes, at::Tensor scale_min);
at::Tensor bf16_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> one_row);
at::Tensor bf16_dots_linear(at::Tensor x, at::Tensor w);
at::Tensor amx_linear(at::Tensor x, at::Tensor packed, int64_t chunk);
at::Tensor amx_codes_linear(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor mins);
at::Tensor add_rms_norm(at::Tensor residual, c10::optional<at::Tensor> x, at::Tensor w, double eps);
at::Tensor rotary_store(at::Tensor qkv, int64_t heads, int64_t kv_heads, at::Tensor cos, at::Tensor sin,
                        at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots);
at::Tensor silu_mul(at::Tensor gate_up);
void paged_decode(at::Tensor out, at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
                  at::Tensor block_tables, at::Tensor seq_lens, at::Tensor tokens, double scale,
                  int64_t window, double softcap, c10::optional<at::Tensor> sinks,
                  c10::optional<at::Tensor> alibi, int64_t chunk, c10::optional<at::Tensor> ends,
                  int64_t lanes, c10::optional<at::Tensor> qrows);

namespace {

// the tensors of one layer in the order CodedLayers takes them: four for each of four products, then the
// weight of the norm after attention and of the next norm
constexpr size_t kPerLayer = 18;

c10::optional<at::Tensor> present(const at::Tensor& t) {
  return t.numel() > 0 ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

}  // namespace

CodedLayers::CodedLayers(std::vector<at::Tensor> tensors, std::vector<int64_t> kinds, std::vector<double> post_eps,
                         std::vector<double> next_eps, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         double scaling)
    : post_eps_(std::move(post_eps)), next_eps_(std::move(next_eps)), heads_(heads), kv_heads_(kv_heads),
      head_dim_(head_dim), scaling_(scaling) {
  const size_t layers = post_eps_.size();
  TORCH_CHECK(tensors.size() == kPerLayer * layers && kinds.size() == 12 * layers && next_eps_.size() == layers,
              "CodedLayers: 18 tensors, twelve kind numbers and two epsilons per layer");
  for (size_t i = 0; i < layers; ++i) {
    const at::Tensor* t = tensors.data() + kPerLayer * i;
    Layer layer;
    for (int p = 0; p < 4; ++p) {
      const int64_t kind = kinds[12 * i + 3 * p], codes_rows = kinds[12 * i + 3 * p + 1], wide = kinds[12 * i + 3 * p + 2];
      TORCH_CHECK(kind == kCoded || kind == kPairs || kind == kDots, "CodedLayers: unknown product kind ", kind);
      TORCH_CHECK(wide == kNoWide || wide == kBf16Dot || wide == kBf16Dots || wide == kAmxTiles || wide == kAmxCodes,
                  "CodedLayers: unknown wide kind ", wide);
      TORCH_CHECK(codes_rows >= 0 && (wide == kNoWide || wide == kAmxCodes) == (t[4 * p + 3].numel() == 0),
                  "CodedLayers: a product's codes rows are counted from 0, and a wide kernel has its weight (but the "
                  "codes' tiles, which read the product's codes)");
      TORCH_CHECK(wide != kAmxCodes || (kind == kPairs && t[4 * p + 2].numel() > 0),
                  "CodedLayers: the codes' tiles read Q4_1 codes in the pair order");
      layer.products[p] = {static_cast<Kind>(kind), t[4 * p], t[4 * p + 1], present(t[4 * p + 2]), codes_rows,
                           static_cast<Wide>(wide), t[4 * p + 3]};
    }
    layer.post_norm = t[16];
    layer.next_norm = t[17];
    layers_.push_back(std::move(layer));
  }
}

void CodedLayers::set_caches(std::vector<at::Tensor> caches) {
  TORCH_CHECK(caches.size() == 2 * layers_.size(), "CodedLayers: a K and a V cache per layer");
  caches_ = std::move(caches);
}

at::Tensor CodedLayers::apply(const Product& w, const at::Tensor& x, const c10::optional<at::Tensor>& one_row) {
  if (x.size(0) > w.codes_rows) {
    TORCH_CHECK(w.wide != kNoWide, "CodedLayers: ", x.size(0), " rows, more than the codes serve and no kernel for more");
    switch (w.wide) {
      case kBf16Dot:
        return bf16_linear(x, w.weight, one_row);
      case kAmxTiles:   // (every row over all of K in one tile accumulator: a generated token's one-row bits)
        return amx_linear(x, w.weight, 0);
      case kAmxCodes:   // (the same, the tiles expanded from the codes)
        return amx_codes_linear(x, w.codes, w.scales, *w.mins);
      default:
        return bf16_dots_linear(x, w.weight);
    }
  }
  switch (w.kind) {
    case kPairs:
      return coded_pairs_linear(x, w.codes, w.scales, w.mins, one_row);
    case kDots:
      return bf16_dots_codes_linear(x, w.codes, w.scales);
    default:
      return coded_linear(x, w.codes, w.scales, w.mins, one_row);
  }
}

at::Tensor CodedLayers::forward(at::Tensor residual, at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor slots,
                                at::Tensor tables, at::Tensor lens, at::Tensor tokens,
                                c10::optional<at::Tensor> ends, int64_t lanes, c10::optional<at::Tensor> qrows,
                                c10::optional<at::Tensor> one_row, c10::optional<at::Tensor> keep) {
  TORCH_CHECK(caches_.size() == 2 * layers_.size(), "CodedLayers: set_caches first");
  TORCH_CHECK(!keep || (keep->scalar_type() == at::kLong && keep->dim() == 1), "CodedLayers: keep int64 [rows kept]");
  const int64_t rows = x.size(0);
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& layer = layers_[i];
    const auto product = [&](int p, const at::Tensor& in) { return apply(layer.products[p], in, one_row); };
    const at::Tensor& k_cache = caches_[2 * i];
    const at::Tensor& v_cache = caches_[2 * i + 1];
    at::Tensor q = rotary_store(product(0, x), heads_, kv_heads_, cos, sin, k_cache, v_cache, slots);
    at::Tensor out = at::empty_like(q);
    paged_decode(out, q, k_cache, v_cache, tables, lens, tokens, scaling_, 0, 0.0, c10::nullopt, c10::nullopt, 0, ends,
                 lanes, qrows);
    at::Tensor attended = out.view({rows, heads_ * head_dim_});
    if (keep && i + 1 == layers_.size()) {
      // past the last attention only the kept rows' states are read: each product's row is its own FMA chains,
      // so the rows left out change no bit of the others (a step that samples nothing reads none)
      if (keep->numel() == 0) return at::empty({0, residual.size(1)}, residual.options());
      residual = residual.index_select(0, *keep);
      attended = attended.index_select(0, *keep);
      if (one_row) one_row = one_row->index_select(0, *keep);
    }
    x = add_rms_norm(residual, product(1, attended), layer.post_norm, post_eps_[i]);
    x = add_rms_norm(residual, product(3, silu_mul(product(2, x))), layer.next_norm, next_eps_[i]);
  }
  return x;
}
