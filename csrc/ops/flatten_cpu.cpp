// Many CPU tensors <-> one flat buffer: checks, work split by elements, strided runs.
#include "ops/flatten_cpu.h"

#include <ATen/Dispatch_v2.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>

#include <algorithm>

#include "ops/loops_cpu.h"

namespace zero_kernels {
namespace {

// Elements per thread below which a second thread costs more than it saves.
constexpr int64_t kGrain = 1 << 16;

// A tensor seen in row-major order, its dimensions merged where memory allows (innermost last).
struct Layout {
  char* data;
  at::ScalarType dtype;
  int64_t offset;  // where it starts in the flat buffer, in elements
  int64_t numel;
  c10::SmallVector<int64_t, 6> sizes;
  c10::SmallVector<int64_t, 6> strides;
};

bool is_float_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

Layout layout_of(const at::Tensor& t, int64_t offset) {
  Layout l{static_cast<char*>(t.data_ptr()), t.scalar_type(), offset, t.numel(), {}, {}};
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    const int64_t size = t.size(d);
    const int64_t stride = t.stride(d);
    if (size == 1) continue;
    if (!l.sizes.empty() && stride == l.sizes.back() * l.strides.back()) {
      l.sizes.back() *= size;
      continue;
    }
    l.sizes.push_back(size);
    l.strides.push_back(stride);
  }
  if (l.sizes.empty()) {
    l.sizes.push_back(1);
    l.strides.push_back(1);
  }
  std::reverse(l.sizes.begin(), l.sizes.end());
  std::reverse(l.strides.begin(), l.strides.end());
  return l;
}

// Copies the tensor's row-major elements [begin, end) to (to_flat) or from the flat buffer.
template <typename tensor_t, typename flat_t>
void copy_range(const Layout& l, flat_t* flat, int64_t begin, int64_t end, bool to_flat, bool scaled, float scale) {
  auto* data = reinterpret_cast<tensor_t*>(l.data);
  const int64_t nd = static_cast<int64_t>(l.sizes.size());
  const int64_t inner = l.sizes[nd - 1];
  const int64_t inner_stride = l.strides[nd - 1];
  c10::SmallVector<int64_t, 6> index(nd);
  int64_t element = 0;  // offset of `index` in the tensor's storage, in elements
  for (int64_t d = nd - 1, rest = begin; d >= 0; --d) {
    index[d] = rest % l.sizes[d];
    rest /= l.sizes[d];
    element += index[d] * l.strides[d];
  }
  for (int64_t pos = begin; pos < end;) {
    const int64_t run = std::min(end - pos, inner - index[nd - 1]);
    flat_t* f = flat + l.offset + pos;
    if (to_flat) {
      loops::convert(data + element, inner_stride, f, 1, run, scaled, scale);
    } else {
      loops::convert(f, 1, data + element, inner_stride, run, scaled, scale);
    }
    pos += run;
    index[nd - 1] += run;
    element += run * inner_stride;
    for (int64_t d = nd - 1; d > 0 && index[d] == l.sizes[d]; --d) {
      element += l.strides[d - 1] - index[d] * l.strides[d];
      index[d] = 0;
      ++index[d - 1];
    }
  }
}

void copy_range_any(const Layout& l, const at::Tensor& flat, int64_t begin, int64_t end, bool to_flat, bool scaled,
                    float scale) {
  AT_DISPATCH_V2(
      l.dtype, "flatten_tensor", AT_WRAP([&] {
        using tensor_t = scalar_t;
        AT_DISPATCH_V2(flat.scalar_type(), "flatten_flat", AT_WRAP([&] {
                         copy_range<tensor_t>(l, flat.data_ptr<scalar_t>(), begin, end, to_flat, scaled, scale);
                       }),
                       at::kFloat, at::kDouble, at::kHalf, at::kBFloat16);
      }),
      at::kFloat, at::kDouble, at::kHalf, at::kBFloat16);
}

std::vector<Layout> checked_layouts(const char* op, const std::vector<at::Tensor>& tensors, const at::Tensor& flat,
                                    const std::vector<int64_t>& offsets, bool written) {
  TORCH_CHECK_VALUE(tensors.size() == offsets.size(), op, ": ", tensors.size(), " tensors but ", offsets.size(),
                    " offsets");
  TORCH_CHECK_VALUE(flat.device().is_cpu(), op, ": the flat buffer is on ", flat.device(), "; this kernel needs CPU");
  TORCH_CHECK_VALUE(flat.dim() == 1 && flat.is_contiguous(), op, ": the flat buffer must be 1-D and contiguous");
  TORCH_CHECK_VALUE(is_float_dtype(flat.scalar_type()), op, ": the flat buffer has dtype ", flat.scalar_type(),
                    "; allowed: float32, float64, float16, bfloat16");
  std::vector<Layout> layouts;
  layouts.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": tensor ", i, " is on ", t.device(), "; this kernel needs CPU");
    TORCH_CHECK_VALUE(is_float_dtype(t.scalar_type()), op, ": tensor ", i, " has dtype ", t.scalar_type(),
                      "; allowed: float32, float64, float16, bfloat16");
    TORCH_CHECK_VALUE(offsets[i] >= 0 && offsets[i] + t.numel() <= flat.numel(), op, ": tensor ", i, " (",
                      t.numel(), " elements at offset ", offsets[i], ") overruns the flat buffer of ", flat.numel());
    TORCH_CHECK_VALUE(!written || at::has_internal_overlap(t) != at::MemOverlap::Yes, op, ": tensor ", i,
                      " has elements that share memory (e.g. an expanded view) and cannot be written");
    if (t.numel() > 0) layouts.push_back(layout_of(t, offsets[i]));
  }
  return layouts;
}

// Splits all elements of all tensors evenly over the threads and copies them.
void run(const std::vector<Layout>& layouts, const at::Tensor& flat, bool to_flat, std::optional<double> scale) {
  std::vector<int64_t> ends(layouts.size());
  int64_t total = 0;
  for (size_t k = 0; k < layouts.size(); ++k) ends[k] = total += layouts[k].numel;
  const bool scaled = scale.has_value();
  const float s = scaled ? static_cast<float>(*scale) : 1.0f;
  at::parallel_for(0, total, kGrain, [&](int64_t begin, int64_t end) {
    size_t k = std::upper_bound(ends.begin(), ends.end(), begin) - ends.begin();
    for (; k < layouts.size(); ++k) {
      const int64_t start = ends[k] - layouts[k].numel;
      if (start >= end) break;
      copy_range_any(layouts[k], flat, std::max(begin, start) - start, std::min(end, ends[k]) - start, to_flat,
                     scaled, s);
    }
  });
}

}  // namespace

at::Tensor flatten_cpu(const std::vector<at::Tensor>& tensors, const at::Tensor& flat,
                       const std::vector<int64_t>& offsets, std::optional<double> scale) {
  run(checked_layouts("flatten", tensors, flat, offsets, false), flat, true, scale);
  return flat;
}

void unflatten_cpu(const at::Tensor& flat, const std::vector<at::Tensor>& tensors,
                   const std::vector<int64_t>& offsets, std::optional<double> scale) {
  run(checked_layouts("unflatten", tensors, flat, offsets, true), flat, false, scale);
}

}  // namespace zero_kernels
