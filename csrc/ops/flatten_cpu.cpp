// Multi-threaded CPU copy of many tensors into one flat buffer and back.
#include "ops/flatten_cpu.h"

#include <ATen/Parallel.h>

namespace zero_kernels {

void flatten_cpu(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& offsets, at::Tensor& flat) {
  TORCH_CHECK(tensors.size() == offsets.size(), "flatten: ", tensors.size(), " tensors but ", offsets.size(),
              " offsets");
  at::parallel_for(0, static_cast<int64_t>(tensors.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const at::Tensor& t = tensors[i];
      flat.narrow(0, offsets[i], t.numel()).view(t.sizes()).copy_(t);
    }
  });
}

}  // namespace zero_kernels
