// The parts of ATen the kernels use: tensors, their allocation and the intra-op thread pool. Not
// <torch/extension.h>, which pulls in all of torch's C++ frontend and takes several times as long to
// compile per file; only bindings.cpp needs pybind11.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
