#pragma once

#include <torch/extension.h>

#include <vector>

namespace zero_kernels {

void flatten_cpu(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& offsets, at::Tensor& flat);

}  // namespace zero_kernels
