// The Python module of the CPU kernels (ops/cpu_kernels.py builds and loads it).
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>   // pybind11 with the casters for tensors, not all of <torch/extension.h>

#include "coded_layers.h"
#include "simd.h"

void paged_decode(at::Tensor out, at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
                  at::Tensor block_tables, at::Tensor seq_lens, at::Tensor tokens, double scale,
                  int64_t window, double softcap, c10::optional<at::Tensor> sinks,
                  c10::optional<at::Tensor> alibi, int64_t chunk, c10::optional<at::Tensor> ends,
                  int64_t lanes, c10::optional<at::Tensor> qrows);
void set_sdpa_tile_order(bool on);
void set_bf16_tile_order(bool on);
bool sdpa_tile_order();
at::Tensor skinny_linear(at::Tensor x, at::Tensor w);
at::Tensor add_rms_norm(at::Tensor residual, c10::optional<at::Tensor> x, at::Tensor w, double eps);
std::vector<at::Tensor> rotary(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin);
at::Tensor rotary_store(at::Tensor qkv, int64_t heads, int64_t kv_heads, at::Tensor cos, at::Tensor sin,
                        at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots);
at::Tensor silu_mul(at::Tensor gate_up);
std::vector<at::Tensor> greedy_logsumexp(at::Tensor logits);
at::Tensor sample_draws(at::Tensor logits, at::Tensor params, at::Tensor rows, at::Tensor keys);
at::Tensor coded_linear(at::Tensor x, at::Tensor codes, at::Tensor scales, c10::optional<at::Tensor> mins,
                        c10::optional<at::Tensor> one_row);
at::Tensor coded_pairs_linear(at::Tensor x, at::Tensor codes, at::Tensor scales, c10::optional<at::Tensor> mins,
                              c10::optional<at::Tensor> one_row);
at::Tensor coded_expand(at::Tensor codes, at::Tensor scales, c10::optional<at::Tensor> mins);
bool has_coded_simd();
at::Tensor panel_pack(at::Tensor w);
at::Tensor panel_linear(at::Tensor x, at::Tensor packed, int64_t N);
bool has_bf16_dot();
at::Tensor bf16_pack(at::Tensor w);
at::Tensor bf16_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> one_row);
at::Tensor bf16_dots_linear(at::Tensor x, at::Tensor w);
bool has_amx_linear();
bool has_amx_codes_linear();
at::Tensor amx_codes_linear(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor mins);
at::Tensor amx_codes_expand(at::Tensor codes, at::Tensor scales, at::Tensor mins);
at::Tensor amx_linear(at::Tensor x, at::Tensor packed, int64_t chunk);
void amx_linear_out(at::Tensor x, at::Tensor packed, at::Tensor y, int64_t chunk,
                    c10::optional<at::Tensor> row_chunks);
at::Tensor bf16_dots_codes_linear(at::Tensor x, at::Tensor codes, at::Tensor scale_min);
at::Tensor bf16_dots_codes_expand(at::Tensor codes, at::Tensor scale_min);
bool has_q8_argmax();
std::string q8_argmax_kind();
std::vector<at::Tensor> q8_argmax(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> codes,
                                  at::Tensor scales, at::Tensor absums, at::Tensor norms, at::Tensor widest,
                                  c10::optional<at::Tensor> weight, c10::optional<at::Tensor> resid, bool dots);
bool has_bf16_argmax();
bool has_bf16_dots_argmax();
void write_kv(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots);

static bool vectorized() {
#ifdef PAGEDSERVE_AVX2
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode,
        "paged decode attention over the block pool (float32 or bfloat16; window, softcap and chunk 0: none; "
        "sinks and ALiBi slopes float32 [heads] or None; ends int32 [R], the keys of transformers' call per row, "
        "with lanes 8 or 16: bfloat16 in torch's SDPA order; qrows int32 [R], the query rows of that call (0: "
        "none; -1: a prompt's row alone in its block): its two products in MKL's order)",
        pybind11::arg("out"), pybind11::arg("query"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("block_tables"), pybind11::arg("seq_lens"), pybind11::arg("tokens"), pybind11::arg("scale"),
        pybind11::arg("window"), pybind11::arg("softcap"), pybind11::arg("sinks") = pybind11::none(),
        pybind11::arg("alibi") = pybind11::none(), pybind11::arg("chunk") = 0,
        pybind11::arg("ends") = pybind11::none(), pybind11::arg("lanes") = 0,
        pybind11::arg("qrows") = pybind11::none());
  m.def("set_sdpa_tile_order", &set_sdpa_tile_order,
        "paged_decode's rows of calls of two or more query rows (qrows) add their two products in the order MKL "
        "takes with AMX tiles (on: chosen by ops/sdpa_order.py's start-up check) or in its AVX2 path's (off)");
  m.def("sdpa_tile_order", &sdpa_tile_order, "whether set_sdpa_tile_order is on");
  m.def("set_bf16_tile_order", &set_bf16_tile_order,
        "coded_linear's and coded_pairs_linear's bfloat16 rows sum in the order of oneDNN's GEMM with AMX tiles (on: "
        "ops/linear.py's start-up check) or in its AVX512-BF16 order (off); needs has_bf16_dot");
  m.def("skinny_linear", &skinny_linear, "x [M, K] . w[N, K]^T for a few rows M (float32)");
  m.def("add_rms_norm", &add_rms_norm, "residual += x (in place, x optional), then RMSNorm(residual) * w (float32)");
  m.def("rotary", &rotary, "rotary embedding of q [T, H, D] and k [T, Hk, D] with cos/sin [T, D] (float32)");
  m.def("rotary_store", &rotary_store, "q of qkv [T, (H + 2Hk) D] rotated into [T, H, D]; k rotated and v stored in the caches at slots (float32 or bfloat16)");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up of gate_up [T, 2I] (float32)");
  m.def("greedy_logsumexp", &greedy_logsumexp, "per row of float32 or bfloat16 logits [R, V]: max, its first index, log-sum-exp (float32)");
  m.def("sample_draws", &sample_draws, "per draw (its row of float32 logits [R, V], the int64 key of its noise): the exponential race's token under the row's temperature, top-k, top-p and min-p (params [R, 4]); -1 where the row has a NaN or no finite logit (pagedserve_kernels/cpu/sampler.cpp)");
  m.def("write_kv", &write_kv, "k, v [T, Hk, D] into the caches at their slots (-1: skipped; float32 or bfloat16)");
  // one_row (bool [M], optional): the bfloat16 rows to sum as oneDNN sums a call of one row (simd.h)
  m.def("coded_linear", &coded_linear, "x [M, K] . W^T with W held as Q4_1 or Q8_0 codes (ops/quantized.py); x float32, or bfloat16 with W rounded to bfloat16",
        pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("mins"),
        pybind11::arg("one_row") = pybind11::none());
  m.def("coded_pairs_linear", &coded_pairs_linear, "coded_linear for 1-4 bfloat16 rows, codes in pair order (Codes.paired_order); needs has_bf16_dot",
        pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("mins"),
        pybind11::arg("one_row") = pybind11::none());
  m.def("coded_expand", &coded_expand, "the float32 weights [N, K] that Q4_1 or Q8_0 codes stand for");
  m.def("panel_pack", &panel_pack, "float32 W [N, K] laid out once for panel_linear (the tiles' panels)");
  m.def("panel_linear", &panel_linear, "x [M, K] . W^T for float32 W from panel_pack: each output the FMA chain over k in order, as coded_linear");
  m.def("has_coded_simd", &has_coded_simd, "whether coded_linear is vectorized in this build (AVX-512; else a scalar loop)");
  m.def("has_bf16_dot", &has_bf16_dot, "whether this build has bf16_linear (the AVX512-BF16 dot product)");
  m.def("has_amx_linear", &has_amx_linear, "whether this build and process have amx_linear (AMX tiles)");
  m.def("amx_linear", &amx_linear, "x [M, K] . W^T in bfloat16 on AMX tiles, W from bf16_pack, K a multiple of 32: "
        "every row summed over all of K in one accumulator, the bits of a call of that row alone; chunk (0: K): the "
        "inputs in chunks of that many, their sums added", py::arg("x"), py::arg("packed"), py::arg("chunk") = 0);
  m.def("amx_linear_out", &amx_linear_out, "amx_linear into out [M, N], whose rows are contiguous (a slice of "
        "columns too); row_chunks (int32 [M]): each row's chunk, 0 for `chunk`'s", py::arg("x"), py::arg("packed"),
        py::arg("out"), py::arg("chunk") = 0, py::arg("row_chunks") = py::none());
  m.def("has_amx_codes_linear", &has_amx_codes_linear,
        "whether this build and process have amx_codes_linear (AMX tiles and AVX512-BF16)");
  m.def("amx_codes_linear", &amx_codes_linear, "x [M, K] . W^T in bfloat16 on AMX tiles, W from its Q4_1 codes in the "
        "pair order (codes, scales, minimums), each rounded to bfloat16: amx_linear's sums on amx_codes_expand's tiles");
  m.def("amx_codes_expand", &amx_codes_expand, "the B tiles (bf16_pack's layout) of Q4_1 codes in the pair order");
  m.def("bf16_pack", &bf16_pack, "W [N, K] bfloat16 laid out for bf16_linear: [N / 16, K / 2, 16, 2]");
  m.def("bf16_linear", &bf16_linear, "x [M, K] . W^T in bfloat16, W from bf16_pack (float32 sums, rounded once)",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("one_row") = pybind11::none());
  m.def("bf16_dots_linear", &bf16_dots_linear, "x [M, K] . W[N, K]^T in bfloat16 in the order of torch's own GEMM (its route where "
        "oneDNN has no bfloat16 for the CPU); K a multiple of 64; needs the AVX2 paths (vectorized)");
  m.def("bf16_dots_codes_linear", &bf16_dots_codes_linear, "bf16_dots_linear's sums with W held as GGUF codes row by row "
        "(Q4_1: codes uint8 [N, K / 2], scale_min float32 [N, K / 32, 2]; Q8_0: int8 [N, K], [N, K / 32, 1]: "
        "Codes.row_blocks), each weight rounded to bfloat16");
  m.def("bf16_dots_codes_expand", &bf16_dots_codes_expand, "the bfloat16 weights [N, K] that bf16_dots_codes_linear multiplies");
  m.def("has_q8_argmax", &has_q8_argmax, "whether this build has q8_argmax (AVX512-VNNI or AVX2)");
  m.def("q8_argmax_kind", &q8_argmax_kind, "q8_argmax's first pass: avx512_vnni, avx2, or empty where there is none");
  m.def("q8_argmax", &q8_argmax, pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("codes"),
        pybind11::arg("scales"), pybind11::arg("absums"), pybind11::arg("norms"), pybind11::arg("widest"),
        pybind11::arg("weight"), pybind11::arg("resid") = pybind11::none(), pybind11::arg("dots") = false,
        "per float32 row of x: the first index of the largest logit through a Q8_0 output layer (or one held near Q8_0 codes), its logit and how many were computed exactly (pagedserve_kernels/cpu/greedy_head.cpp)");
  m.def("has_bf16_argmax", &has_bf16_argmax, "whether q8_argmax takes a bfloat16 output layer (AVX512-BF16 beside its first pass)");
  m.def("has_bf16_dots_argmax", &has_bf16_dots_argmax, "whether q8_argmax takes a bfloat16 output layer summed in "
        "torch's own GEMM's order (dots: bf16_dots_linear's, AVX2 beside its first pass)");
  // module_local: two builds of these kernels can then be loaded in one process (bench/kernels_ab.py)
  pybind11::class_<CodedLayers>(m, "CodedLayers", pybind11::module_local(), "a model's decoder layers whose products read GGUF codes (bfloat16 weights above the rows those serve), run in one call per step (pagedserve_kernels/cpu/coded_layers.cpp)")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<double>, std::vector<double>, int64_t, int64_t, int64_t, double>())
      .def("set_caches", &CodedLayers::set_caches, "per layer its K and V cache")
      .def("forward", &CodedLayers::forward, "the layers over residual (in place) from its first norm x; returns the last norm (of the rows in keep, when given)",
           pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("vectorized", &vectorized, "whether this build uses the AVX2/FMA paths");
}
