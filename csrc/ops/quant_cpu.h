// Block quantization of a flat CPU tensor: symmetric int8 / int4, one float32 scale per block.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace zero_kernels {

// Quantizes x (contiguous; float32, bfloat16 or float16, read as that type) in blocks of `block`
// elements, the last one padded with zeros: scales[b] = absmax / qmax (qmax 127 for bits=8, 7 for
// bits=4; NaN when the block holds a NaN, inf when it holds an infinity; one ulp smaller where
// qmax * scale would overflow float), and each element
// rint(x / scale) clamped to [-qmax, qmax] (0 in a block whose scale is 0 or not finite). data gets
// the integers as bytes (bits=8) or two per byte, the even element in the low nibble (bits=4).
// One thread works on whole blocks; math is float32 with a true division, as the reference.
void quantize_cpu(const at::Tensor& x, int64_t bits, int64_t block, const at::Tensor& data, const at::Tensor& scales);

// One block of `block` float32 values (the caller pads past the data with zeros) as int8 values q, returned
// with its scale: the quantization above, in place for the callers that stage a block themselves (the Adam
// step's epilogue).
float quantize_staged_block(const float* stage, int64_t block, float qmax, int8_t* q);

// Throws c10::Error (naming `op`) unless bits is 4 or 8, block positive (even for 4 bits), data a contiguous
// uint8 CPU tensor of the bytes that numel values take and scales a contiguous float32 CPU tensor, one per block.
void check_quantized(const char* op, int64_t bits, int64_t block, const at::Tensor& data, const at::Tensor& scales,
                     int64_t numel);

// The inverse: out[i] = Out(float(q[i]) * scales[i / block]) for the out.numel() first elements,
// with Out the dtype of out (float32, bfloat16 or float16; rounded to nearest even).
void dequantize_cpu(const at::Tensor& data, const at::Tensor& scales, int64_t bits, int64_t block,
                    const at::Tensor& out);

}  // namespace zero_kernels
