// Vectorised leaf loops of the CPU kernels: contiguous runs, no threads, no checks.
//
// Each loop is compiled for several x86-64 levels (AVX-512, AVX2, baseline) and the best one is
// picked at load time (GCC function multiversioning), so one binary is both fast and portable.
// Callers split the work into runs and call these from inside at::parallel_for.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace zero_kernels::loops {

// Per-step constants of Adam/AdamW in fp32; computed on the host from float64 values.
struct AdamCoefs {
  float beta1;            // m = beta1 * m + (1 - beta1) * g
  float one_minus_beta1;
  float beta2;            // v = beta2 * v + (1 - beta2) * g * g
  float one_minus_beta2;
  float eps;
  float neg_step_size;    // -lr / bias_correction1
  float inv_bc2_sqrt;     // 1 / sqrt(bias_correction2)
  float decay;            // AdamW: 1 - lr * weight_decay (1 for Adam)
  float l2;               // Adam: weight_decay added to the gradient (0 for AdamW)
  float grad_scale;       // gradient multiplier (1 when none; negated to maximize)
};

// One Adam/AdamW update of n contiguous fp32 elements; param, exp_avg, exp_avg_sq in place.
void adam_update(float* param, float* exp_avg, float* exp_avg_sq, const float* grad, int64_t n,
                 const AdamCoefs& c);

// As adam_update, with AMSGrad: max_exp_avg_sq = max(max_exp_avg_sq, exp_avg_sq) (nan propagates,
// as torch.maximum) in place, and the denominator uses it.
void adam_update_amsgrad(float* param, float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq, const float* grad,
                         int64_t n, const AdamCoefs& c);

// dst[i * dst_stride] = Dst(src[i * src_stride]) for i < n; with `scaled`, Dst(float(src) * scale).
// Supported types: float, double, c10::Half, c10::BFloat16 (any pair).
template <typename Src, typename Dst>
void convert(const Src* src, int64_t src_stride, Dst* dst, int64_t dst_stride, int64_t n, bool scaled, float scale);

// Where out[i] differs from param[i] rounded to T (the copy in T was edited since it was written),
// param[i] = float(out[i]); elsewhere param[i] is kept. Compared bit for bit.
// Supported types: float, c10::Half, c10::BFloat16.
template <typename T>
void adopt_edits(float* param, const T* out, int64_t n);

// Block quantization (quant_cpu.cpp): absmax / qmax of n contiguous values, NaN when one is NaN; one ulp
// smaller where qmax * scale would overflow float, so that every dequantized value of a finite block is finite.
float block_scale(const float* v, int64_t n, float qmax);

// q[i] = rint(v[i] / scale) clamped to [-qmax, qmax] (a true division, ties to even); scale finite, not 0.
void quantize_block(const float* v, int8_t* q, int64_t n, float scale, float qmax);

// out[j] = the int4 values q[2j] (low nibble) and q[2j + 1] (high nibble); n even.
void pack_int4(const int8_t* q, uint8_t* out, int64_t n);

// v[i] = float(q[i]) * scale for n values stored as int8 bytes (bits 8) or int4 nibbles (bits 4, n even).
void dequantize_block(const uint8_t* data, int64_t bits, float* v, int64_t n, float scale);

// True when any of the n contiguous elements is inf or nan (tested on the exponent bits).
template <typename T>
bool any_nonfinite(const T* x, int64_t n);

}  // namespace zero_kernels::loops
