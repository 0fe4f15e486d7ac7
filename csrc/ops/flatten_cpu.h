// Many CPU tensors <-> one flat buffer at given offsets, in parallel, with fused cast and scale.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace zero_kernels {

// Copies each tensor (any shape, strides and floating dtype) into flat[offsets[i], + numel) in
// row-major order, cast to flat's dtype; with scale, the value is multiplied in fp32 first.
// Work is split by elements, so one large tensor uses every thread. Returns flat.
at::Tensor flatten_cpu(const std::vector<at::Tensor>& tensors, const at::Tensor& flat,
                       const std::vector<int64_t>& offsets, std::optional<double> scale);

// The inverse: writes flat[offsets[i], + numel) back into each tensor in place (its storage and
// strides are kept), cast to the tensor's dtype and scaled as above.
void unflatten_cpu(const at::Tensor& flat, const std::vector<at::Tensor>& tensors,
                   const std::vector<int64_t>& offsets, std::optional<double> scale);

}  // namespace zero_kernels
