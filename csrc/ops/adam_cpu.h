// Adam/AdamW step on one flat CPU shard, fused in a single pass over memory.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace zero_kernels {

// Hyper-parameters of one step. step_size = lr / bias_correction1 and
// bc2_sqrt = sqrt(bias_correction2) are computed by the caller in float64.
struct AdamHyper {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  double step_size;
  double bc2_sqrt;
  bool adamw;                       // decoupled decay (AdamW) or L2 added to the gradient (Adam)
  std::optional<double> grad_scale; // gradient multiplier, applied first
  bool maximize = false;            // ascend: the scaled gradient is negated
  bool adopt_out = false;           // out is also read first: its edits reach param (see below)
};

// The int8 blocks of the written parameters (ZeRO++'s payload), made in the update's pass: data holds
// ceil(n / block) * block bytes, scales one float32 per block (the format of quant_cpu.h's quantize_cpu, 8 bits).
struct QuantizedOut {
  at::Tensor data;
  at::Tensor scales;
  int64_t block;
};

// Updates param, exp_avg, exp_avg_sq in place (fp32, contiguous, same numel) from grad (fp32, bf16
// or fp16). found_inf (one fp32 element, optional): set to 1 when grad holds inf/nan; when it is
// non-zero after that check nothing else is written. out (optional, fp32/bf16/fp16): receives the
// updated params; with hyper.adopt_out it is read first, and wherever out[i] differs from param[i]
// rounded to out's dtype, bit for bit (the low-precision copy was edited since it was written) param[i] takes
// out[i]'s value before the update. max_exp_avg_sq (optional, fp32, same numel): AMSGrad, the running maximum of
// exp_avg_sq, updated in place and used for the denominator. quantized (optional): receives
// quantize_cpu(out, else param, 8 bits) of the whole tensor as this call leaves it, block by block right after
// each block's update (threads take whole blocks); also when found_inf skips the update. Throws c10::Error naming the
// offending buffer on bad input.
void adam_step_cpu(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                   const AdamHyper& hyper, const std::optional<at::Tensor>& found_inf,
                   const std::optional<at::Tensor>& out,
                   const std::optional<at::Tensor>& max_exp_avg_sq = std::nullopt,
                   const std::optional<QuantizedOut>& quantized = std::nullopt);

}  // namespace zero_kernels
