// CodedLayers (coded_layers.cpp): a model's decoder layers, the products read from GGUF codes (and from a
// bfloat16 weight above the rows the codes serve), in one call.
#pragma once

#include <vector>

#include "aten.h"

class CodedLayers {
 public:
  // the kernels that read codes, numbered as ops/linear.CODES_KERNELS names them
  enum Kind : int64_t { kCoded = 0, kPairs = 1, kDots = 2 };
  // the kernels of a bfloat16 product above the rows its codes serve: none, bf16_linear on bf16_pack's
  // layout, bf16_dots_linear on the weight itself, amx_linear on bf16_pack's layout, amx_codes_linear on the
  // product's own Q4_1 codes (pair order; no weight of its own) (the routes of ops/linear.RoutedLinear.route)
  enum Wide : int64_t { kNoWide = 0, kBf16Dot = 1, kBf16Dots = 2, kAmxTiles = 3, kAmxCodes = 4 };

  // tensors: per layer, four per product of qkv, o, gate_up and down (for kCoded and kPairs the codes, scales
  // and minimums, empty for Q8_0; for kDots the codes, scale_min and an empty one; then the wide kernel's
  // weight, empty for none), then the weights of the norm after attention and of the next layer's (or the
  // model's last) norm; kinds: per layer and product three numbers, its codes kernel, the most rows that read
  // codes (0: none) and its Wide kernel; post_eps and next_eps those norms' epsilons; every layer has the same
  // heads and scaling
  CodedLayers(std::vector<at::Tensor> tensors, std::vector<int64_t> kinds, std::vector<double> post_eps,
              std::vector<double> next_eps, int64_t heads, int64_t kv_heads, int64_t head_dim, double scaling);
  // per layer its K and V cache (views of the pool), in that order
  void set_caches(std::vector<at::Tensor> caches);
  // residual [rows, hidden] (updated in place) and x its first norm; the rest as paged_decode and
  // rotary_store take them, and one_row as the products take it. Returns the last norm of the residual; with
  // keep (int64 row indices), of those rows only, whose last layer alone then runs past its attention (the
  // residual then holds the last layer's input).
  at::Tensor forward(at::Tensor residual, at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor slots,
                     at::Tensor tables, at::Tensor lens, at::Tensor tokens, c10::optional<at::Tensor> ends,
                     int64_t lanes, c10::optional<at::Tensor> qrows, c10::optional<at::Tensor> one_row,
                     c10::optional<at::Tensor> keep);

 private:
  struct Product {
    Kind kind;
    at::Tensor codes, scales;
    c10::optional<at::Tensor> mins;
    int64_t codes_rows;   // a call of up to this many rows reads the codes
    Wide wide;            // a call of more, this kernel on `weight`
    at::Tensor weight;
  };
  struct Layer {
    Product products[4];   // qkv, o, gate_up, down
    at::Tensor post_norm, next_norm;
  };
  static at::Tensor apply(const Product& w, const at::Tensor& x, const c10::optional<at::Tensor>& one_row);
  std::vector<Layer> layers_;
  std::vector<at::Tensor> caches_;
  std::vector<double> post_eps_, next_eps_;
  int64_t heads_, kv_heads_, head_dim_;
  double scaling_;
};
