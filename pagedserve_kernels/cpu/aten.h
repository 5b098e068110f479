// The parts of ATen the kernels use: tensors, their allocation and the intra-op thread pool. Not
// <torch/extension.h>, which pulls in all of torch's C++ frontend and takes several times as long to
// compile per file; only bindings.cpp needs pybind11.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

namespace pagedserve {

// The data of an optional bool [M] argument that marks rows (nullptr where it is absent), checked
inline const bool* row_flags(const c10::optional<at::Tensor>& flags, int64_t M, const char* what) {
  if (!flags.has_value()) return nullptr;
  TORCH_CHECK(flags->scalar_type() == at::kBool && flags->dim() == 1 && flags->size(0) == M && flags->is_contiguous(),
              what, ": one_row must be a contiguous bool [M] tensor, one flag per row of x");
  return flags->data_ptr<bool>();
}

}  // namespace pagedserve
