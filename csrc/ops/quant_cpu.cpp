// Block quantization on the CPU: input checks, then whole blocks per thread through an fp32 stage.
#include "ops/quant_cpu.h"

#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/loops_cpu.h"

namespace zero_kernels {
namespace {

// Elements per thread below which a second thread costs more than it saves.
constexpr int64_t kGrain = 1 << 16;

int64_t qmax_of(int64_t bits) { return bits == 8 ? 127 : 7; }

bool is_quant_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

int64_t blocks_of(int64_t numel, int64_t block) { return (numel + block - 1) / block; }

void check_values(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": ", name, " is on ", t.device(), "; this kernel needs CPU");
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " must be contiguous");
  TORCH_CHECK_VALUE(is_quant_dtype(t.scalar_type()), op, ": ", name, " has dtype ", t.scalar_type(),
                    "; allowed: float32, bfloat16, float16");
}

template <typename T>
void quantize_blocks(const T* x, int64_t numel, int64_t bits, int64_t block, uint8_t* data, float* scales,
                     int64_t begin, int64_t end) {
  const float qmax = static_cast<float>(qmax_of(bits));
  std::vector<float> stage(block);
  std::vector<int8_t> q(block);
  for (int64_t b = begin; b < end; ++b) {
    const int64_t n = std::min(block, numel - b * block);
    loops::convert(x + b * block, 1, stage.data(), 1, n, false, 1.0f);
    std::fill(stage.begin() + n, stage.end(), 0.0f);
    int8_t* dst = bits == 8 ? reinterpret_cast<int8_t*>(data + b * block) : q.data();
    scales[b] = quantize_staged_block(stage.data(), block, qmax, dst);
    if (bits == 4) loops::pack_int4(q.data(), data + b * block / 2, block);
  }
}

template <typename T>
void dequantize_blocks(const uint8_t* data, const float* scales, int64_t numel, int64_t bits, int64_t block, T* out,
                       int64_t begin, int64_t end) {
  std::vector<float> stage(block);
  for (int64_t b = begin; b < end; ++b) {
    loops::dequantize_block(data + b * block * bits / 8, bits, stage.data(), block, scales[b]);
    loops::convert(stage.data(), 1, out + b * block, 1, std::min(block, numel - b * block), false, 1.0f);
  }
}

int64_t grain_blocks(int64_t block) { return std::max<int64_t>(1, kGrain / block); }

}  // namespace

void check_quantized(const char* op, int64_t bits, int64_t block, const at::Tensor& data, const at::Tensor& scales,
                     int64_t numel) {
  TORCH_CHECK_VALUE(bits == 8 || bits == 4, op, ": bits must be 4 or 8, got ", bits);
  TORCH_CHECK_VALUE(block >= 1 && (bits == 8 || block % 2 == 0), op, ": block must be positive (even for bits=4), got ",
                    block);
  const int64_t blocks = blocks_of(numel, block);
  TORCH_CHECK_VALUE(data.scalar_type() == at::kByte && data.is_contiguous() && data.device().is_cpu() &&
                        data.numel() == blocks * block * bits / 8,
                    op, ": data must be a contiguous uint8 CPU tensor of ", blocks * block * bits / 8,
                    " bytes, got ", data.scalar_type(), " of ", data.numel(), " on ", data.device());
  TORCH_CHECK_VALUE(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.device().is_cpu() &&
                        scales.numel() == blocks,
                    op, ": scales must be a contiguous float32 CPU tensor of ", blocks, " elements, got ",
                    scales.scalar_type(), " of ", scales.numel(), " on ", scales.device());
}

float quantize_staged_block(const float* stage, int64_t block, float qmax, int8_t* q) {
  const float scale = loops::block_scale(stage, block, qmax);
  if (!std::isfinite(scale) || scale == 0.0f) {
    std::fill(q, q + block, int8_t{0});  // nothing sent for an all-zero or non-finite block
  } else {
    loops::quantize_block(stage, q, block, scale, qmax);
  }
  return scale;
}


void quantize_cpu(const at::Tensor& x, int64_t bits, int64_t block, const at::Tensor& data, const at::Tensor& scales) {
  check_values("quantize", "x", x);
  check_quantized("quantize", bits, block, data, scales, x.numel());
  const int64_t numel = x.numel();
  auto* d = data.data_ptr<uint8_t>();
  auto* s = scales.data_ptr<float>();
  AT_DISPATCH_V2(
      x.scalar_type(), "quantize_cpu", AT_WRAP([&] {
        const scalar_t* src = x.const_data_ptr<scalar_t>();
        at::parallel_for(0, scales.numel(), grain_blocks(block), [&](int64_t begin, int64_t end) {
          quantize_blocks(src, numel, bits, block, d, s, begin, end);
        });
      }),
      at::kFloat, at::kHalf, at::kBFloat16);
}

void dequantize_cpu(const at::Tensor& data, const at::Tensor& scales, int64_t bits, int64_t block,
                    const at::Tensor& out) {
  check_values("dequantize", "out", out);
  check_quantized("dequantize", bits, block, data, scales, out.numel());
  const int64_t numel = out.numel();
  const auto* d = data.const_data_ptr<uint8_t>();
  const auto* s = scales.const_data_ptr<float>();
  AT_DISPATCH_V2(
      out.scalar_type(), "dequantize_cpu", AT_WRAP([&] {
        scalar_t* dst = out.data_ptr<scalar_t>();
        at::parallel_for(0, scales.numel(), grain_blocks(block), [&](int64_t begin, int64_t end) {
          dequantize_blocks(d, s, numel, bits, block, dst, begin, end);
        });
      }),
      at::kFloat, at::kHalf, at::kBFloat16);
}

}  // namespace zero_kernels
