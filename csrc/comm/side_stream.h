// Side-stream copies and casts for the comm engine on CUDA, behind a table of plain function
// pointers. The table is filled in by side_stream.cu when the extension is built with CUDA; the
// engine sees nullptr otherwise. Nothing here includes torch or CUDA headers, so the .cu compiles
// with nvcc against any torch build and the engine compiles without a CUDA toolkit.
#pragma once

#include <cstdint>

namespace zero_kernels::comm {

// Element types the side-stream cast understands (a subset of at::ScalarType).
enum class CastType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

// Streams travel as integers (cudaStream_t cast to intptr_t); each call returns a cudaError_t
// value, 0 on success, never synchronizes the host, and runs on `device` but leaves the caller's
// current device as it found it.
struct SideStreamOps {
  // Everything queued on `signaler` so far happens before anything queued next on `waiter`.
  int32_t (*stream_wait)(intptr_t waiter, intptr_t signaler, int32_t device);
  // dst[i] = (dst_type) src[i] for i < numel, queued on `stream`.
  int32_t (*cast_copy)(void* dst, CastType dst_type, const void* src, CastType src_type, int64_t numel,
                       intptr_t stream, int32_t device);
  // The message of a cudaError_t value.
  const char* (*error_string)(int32_t error);
};

inline const SideStreamOps*& side_stream_ops_slot() {
  static const SideStreamOps* ops = nullptr;
  return ops;
}

// nullptr when this build has no CUDA.
inline const SideStreamOps* side_stream_ops() { return side_stream_ops_slot(); }

}  // namespace zero_kernels::comm
