// Adam/AdamW step on one flat CPU shard: input checks, host scalars, then one parallel pass.
#include "ops/adam_cpu.h"

#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>
#include <utility>
#include <vector>

#include "ops/loops_cpu.h"
#include "ops/quant_cpu.h"

namespace zero_kernels {
namespace {

// Elements per thread below which a second thread costs more than it saves.
constexpr int64_t kGrain = 1 << 15;
// Elements processed at a time by one thread: the staged gradient stays in L1.
constexpr int64_t kBlock = 2048;

bool is_adam_grad_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

void check_inputs(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                  const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& found_inf,
                  const std::optional<at::Tensor>& out, const std::optional<at::Tensor>& max_exp_avg_sq) {
  const int64_t n = param.numel();
  std::vector<std::pair<const char*, const at::Tensor*>> state = {
      {"param", &param}, {"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}};
  if (max_exp_avg_sq) state.emplace_back("max_exp_avg_sq", &*max_exp_avg_sq);
  for (const auto& [name, t] : state) {
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat, "adam_step: ", name, " must be float32, got ",
                      t->scalar_type());
  }
  TORCH_CHECK_VALUE(is_adam_grad_dtype(grad.scalar_type()), "adam_step: grad dtype ", grad.scalar_type(),
                    "; allowed: float32, bfloat16, float16");
  std::vector<std::pair<const char*, const at::Tensor*>> buffers = state;
  buffers.emplace_back("grad", &grad);
  if (out) {
    TORCH_CHECK_VALUE(is_adam_grad_dtype(out->scalar_type()), "adam_step: out dtype ", out->scalar_type(),
                      "; allowed: float32, bfloat16, float16");
    buffers.emplace_back("out", &*out);
  }
  for (const auto& [name, t] : buffers) {
    TORCH_CHECK_VALUE(t->device().is_cpu(), "adam_step: ", name, " is on ", t->device(), "; this kernel needs CPU");
    TORCH_CHECK_VALUE(t->numel() == n, "adam_step: ", name, " has ", t->numel(), " elements, param has ", n);
    TORCH_CHECK_VALUE(t->is_contiguous(), "adam_step: ", name, " must be contiguous");
  }
  if (found_inf) {
    TORCH_CHECK_VALUE(found_inf->numel() == 1 && found_inf->scalar_type() == at::kFloat &&
                          found_inf->device().is_cpu(),
                      "adam_step: found_inf must be a one-element float32 CPU tensor, got ", found_inf->numel(),
                      " element(s) of ", found_inf->scalar_type(), " on ", found_inf->device());
  }
}

loops::AdamCoefs coefs_of(const AdamHyper& h) {
  loops::AdamCoefs c{};
  c.beta1 = static_cast<float>(h.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.eps = static_cast<float>(h.eps);
  c.neg_step_size = static_cast<float>(-h.step_size);
  c.inv_bc2_sqrt = static_cast<float>(1.0 / h.bc2_sqrt);
  c.decay = h.adamw ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
  c.l2 = h.adamw ? 0.0f : static_cast<float>(h.weight_decay);
  c.grad_scale = (h.grad_scale ? static_cast<float>(*h.grad_scale) : 1.0f) * (h.maximize ? -1.0f : 1.0f);
  return c;
}

// True when any gradient element is inf or nan; all threads take part.
template <typename grad_t>
bool grad_has_nonfinite(const grad_t* grad, int64_t n) {
  std::atomic<bool> found{false};
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end && !found.load(std::memory_order_relaxed); i += kBlock) {
      if (loops::any_nonfinite(grad + i, std::min(kBlock, end - i))) found.store(true, std::memory_order_relaxed);
    }
  });
  return found.load();
}

// Writes the fp32 params [begin, begin + len) into out, cast to its dtype.
void write_out(const float* param, const at::Tensor& out, int64_t begin, int64_t len) {
  AT_DISPATCH_V2(
      out.scalar_type(), "adam_step_out",
      AT_WRAP([&] { loops::convert(param + begin, 1, out.data_ptr<scalar_t>() + begin, 1, len, false, 1.0f); }),
      at::kFloat, at::kBFloat16, at::kHalf);
}

// Gives the fp32 params [begin, begin + len) the values of out where out was edited (loops::adopt_edits).
void adopt_out(float* param, const at::Tensor& out, int64_t begin, int64_t len) {
  AT_DISPATCH_V2(
      out.scalar_type(), "adam_step_adopt",
      AT_WRAP([&] { loops::adopt_edits(param + begin, out.const_data_ptr<scalar_t>() + begin, len); }), at::kFloat,
      at::kBFloat16, at::kHalf);
}

// One piece [i, i + len) of the update (len <= the size of staged): gradient staged as fp32, edits adopted, the
// moments and params updated, out written.
template <typename grad_t>
void adam_piece(float* param, const grad_t* grad, float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq, int64_t i,
                int64_t len, const loops::AdamCoefs& coefs, const std::optional<at::Tensor>& out, bool adopt,
                float* staged) {
  const float* g = nullptr;
  if constexpr (std::is_same_v<grad_t, float>) {
    g = grad + i;
  } else {
    loops::convert(grad + i, 1, staged, 1, len, false, 1.0f);
    g = staged;
  }
  if (adopt && out) adopt_out(param, *out, i, len);  // the piece stays in L1 for the update below
  if (max_exp_avg_sq != nullptr) {
    loops::adam_update_amsgrad(param + i, exp_avg + i, exp_avg_sq + i, max_exp_avg_sq + i, g, len, coefs);
  } else {
    loops::adam_update(param + i, exp_avg + i, exp_avg_sq + i, g, len, coefs);
  }
  if (out) write_out(param, *out, i, len);
}

template <typename grad_t>
void adam_pass(float* param, const grad_t* grad, float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq, int64_t n,
               const loops::AdamCoefs& coefs, const std::optional<at::Tensor>& out, bool adopt) {
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    float staged[kBlock];
    for (int64_t i = begin; i < end; i += kBlock) {
      adam_piece(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, i, std::min(kBlock, end - i), coefs, out, adopt,
                 staged);
    }
  });
}

// The written values [i, i + len) as fp32 in stage, zero-padded to block elements.
void stage_written(const float* param, const std::optional<at::Tensor>& out, int64_t i, int64_t len, int64_t block,
                   float* stage) {
  if (out) {
    AT_DISPATCH_V2(
        out->scalar_type(), "adam_step_stage",
        AT_WRAP([&] { loops::convert(out->const_data_ptr<scalar_t>() + i, 1, stage, 1, len, false, 1.0f); }),
        at::kFloat, at::kBFloat16, at::kHalf);
  } else {
    std::copy(param + i, param + i + len, stage);
  }
  std::fill(stage + len, stage + block, 0.0f);
}

// adam_pass with the epilogue: threads take whole quantization blocks; each block is updated, then its written
// values (still in cache) quantized.
template <typename grad_t>
void adam_quantize_pass(float* param, const grad_t* grad, float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq,
                        int64_t n, const loops::AdamCoefs& coefs, const std::optional<at::Tensor>& out, bool adopt,
                        const QuantizedOut& q) {
  const int64_t block = q.block;
  auto* data = reinterpret_cast<int8_t*>(q.data.data_ptr<uint8_t>());
  float* scales = q.scales.data_ptr<float>();
  at::parallel_for(0, q.scales.numel(), std::max<int64_t>(1, kGrain / block), [&](int64_t begin, int64_t end) {
    std::vector<float> staged(std::max(block, kBlock));
    for (int64_t b = begin; b < end; ++b) {
      const int64_t first = b * block;
      const int64_t len = std::min(block, n - first);
      for (int64_t i = first; i < first + len; i += kBlock) {
        adam_piece(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, i, std::min(kBlock, first + len - i), coefs, out,
                   adopt, staged.data());
      }
      stage_written(param, out, first, len, block, staged.data());
      scales[b] = quantize_staged_block(staged.data(), block, 127.0f, data + first);
    }
  });
}

void check_quantized_out(const QuantizedOut& q, int64_t n) {
  check_quantized("adam_step: quantized", 8, q.block, q.data, q.scales, n);
}

}  // namespace

void adam_step_cpu(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                   const AdamHyper& hyper, const std::optional<at::Tensor>& found_inf,
                   const std::optional<at::Tensor>& out, const std::optional<at::Tensor>& max_exp_avg_sq,
                   const std::optional<QuantizedOut>& quantized) {
  check_inputs(param, grad, exp_avg, exp_avg_sq, found_inf, out, max_exp_avg_sq);
  if (quantized) check_quantized_out(*quantized, param.numel());
  TORCH_CHECK_VALUE(std::isfinite(hyper.step_size) && std::isfinite(hyper.bc2_sqrt) && hyper.bc2_sqrt > 0,
                    "adam_step: step_size (", hyper.step_size, ") and bc2_sqrt (", hyper.bc2_sqrt,
                    ") must be finite, bc2_sqrt > 0");
  const int64_t n = param.numel();
  const loops::AdamCoefs coefs = coefs_of(hyper);
  float* max_sq = max_exp_avg_sq ? max_exp_avg_sq->data_ptr<float>() : nullptr;
  AT_DISPATCH_V2(grad.scalar_type(), "adam_step_cpu", AT_WRAP([&] {
                   const scalar_t* g = grad.const_data_ptr<scalar_t>();
                   if (found_inf) {
                     float* flag = found_inf->data_ptr<float>();
                     if (grad_has_nonfinite(g, n)) *flag = 1.0f;
                     if (*flag != 0.0f) {  // skipped: the blocks of the parameters as they are
                       if (quantized) quantize_cpu(out ? *out : param, 8, quantized->block, quantized->data,
                                                   quantized->scales);
                       return;
                     }
                   }
                   if (quantized) {
                     adam_quantize_pass(param.data_ptr<float>(), g, exp_avg.data_ptr<float>(),
                                        exp_avg_sq.data_ptr<float>(), max_sq, n, coefs, out, hyper.adopt_out,
                                        *quantized);
                   } else {
                     adam_pass(param.data_ptr<float>(), g, exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
                               max_sq, n, coefs, out, hyper.adopt_out);
                   }
                 }),
                 at::kFloat, at::kBFloat16, at::kHalf);
}

}  // namespace zero_kernels
