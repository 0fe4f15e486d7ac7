// CUDA side-stream work of the comm engine: event ordering between streams and one cast-copy
// kernel for every (source, destination) element type pair. No torch headers: see side_stream.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "comm/side_stream.h"

namespace zero_kernels::comm {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;

template <typename T>
__device__ __forceinline__ float load_as_float(const T* p, int64_t i) {
  return static_cast<float>(p[i]);
}
template <>
__device__ __forceinline__ float load_as_float<__half>(const __half* p, int64_t i) {
  return __half2float(p[i]);
}
template <>
__device__ __forceinline__ float load_as_float<__nv_bfloat16>(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}

template <typename T>
__device__ __forceinline__ void store_from_float(T* p, int64_t i, float v) {
  p[i] = static_cast<T>(v);
}
template <>
__device__ __forceinline__ void store_from_float<__half>(__half* p, int64_t i, float v) {
  p[i] = __float2half_rn(v);
}
template <>
__device__ __forceinline__ void store_from_float<__nv_bfloat16>(__nv_bfloat16* p, int64_t i, float v) {
  p[i] = __float2bfloat16_rn(v);
}

// Grid-stride cast through fp32, or straight through double when both sides are fp64.
template <typename Dst, typename Src>
__global__ void cast_copy_kernel(Dst* __restrict__ dst,        // numel elements written
                                 const Src* __restrict__ src,  // numel elements read
                                 int64_t numel) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel; i += stride) {
    if constexpr (std::is_same_v<Dst, double> && std::is_same_v<Src, double>) {
      dst[i] = src[i];
    } else {
      store_from_float(dst, i, load_as_float(src, i));
    }
  }
}

template <typename Dst, typename Src>
cudaError_t launch(void* dst, const void* src, int64_t numel, cudaStream_t stream) {
  const int64_t blocks = std::min<int64_t>((numel + kThreads - 1) / kThreads, kMaxBlocks);
  cast_copy_kernel<Dst, Src><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<Dst*>(dst), static_cast<const Src*>(src), numel);
  return cudaGetLastError();
}

// Makes `device` current for its lifetime and gives the caller's current device back afterwards, so
// that queueing side-stream work never changes the device a rank's own code runs on.
class DeviceScope {
 public:
  explicit DeviceScope(int32_t device) {
    error_ = cudaGetDevice(&previous_);
    if (error_ == cudaSuccess && previous_ != device) {
      error_ = cudaSetDevice(device);
    }
  }
  ~DeviceScope() {
    if (error_ == cudaSuccess) {
      cudaSetDevice(previous_);
    }
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  cudaError_t error() const { return error_; }

 private:
  int previous_ = 0;
  cudaError_t error_;
};

template <typename Dst>
cudaError_t launch_from(CastType src_type, void* dst, const void* src, int64_t numel, cudaStream_t stream) {
  switch (src_type) {
    case CastType::kFloat32:
      return launch<Dst, float>(dst, src, numel, stream);
    case CastType::kFloat16:
      return launch<Dst, __half>(dst, src, numel, stream);
    case CastType::kBFloat16:
      return launch<Dst, __nv_bfloat16>(dst, src, numel, stream);
    case CastType::kFloat64:
      return launch<Dst, double>(dst, src, numel, stream);
  }
  return cudaErrorInvalidValue;
}

int32_t cast_copy(void* dst, CastType dst_type, const void* src, CastType src_type, int64_t numel, intptr_t stream,
                  int32_t device) {
  if (numel == 0) {
    return cudaSuccess;
  }
  DeviceScope scope(device);
  if (scope.error() != cudaSuccess) {
    return scope.error();
  }
  auto s = reinterpret_cast<cudaStream_t>(stream);
  switch (dst_type) {
    case CastType::kFloat32:
      return launch_from<float>(src_type, dst, src, numel, s);
    case CastType::kFloat16:
      return launch_from<__half>(src_type, dst, src, numel, s);
    case CastType::kBFloat16:
      return launch_from<__nv_bfloat16>(src_type, dst, src, numel, s);
    case CastType::kFloat64:
      return launch_from<double>(src_type, dst, src, numel, s);
  }
  return cudaErrorInvalidValue;
}

int32_t stream_wait(intptr_t waiter, intptr_t signaler, int32_t device) {
  if (waiter == signaler) {
    return cudaSuccess;
  }
  DeviceScope scope(device);
  if (scope.error() != cudaSuccess) {
    return scope.error();
  }
  cudaEvent_t event;
  cudaError_t err = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
  if (err != cudaSuccess) {
    return err;
  }
  err = cudaEventRecord(event, reinterpret_cast<cudaStream_t>(signaler));
  if (err == cudaSuccess) {
    err = cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(waiter), event, 0);
  }
  // Destroying a recorded event is legal: its resources go once the wait is satisfied.
  cudaError_t destroyed = cudaEventDestroy(event);
  return err != cudaSuccess ? err : destroyed;
}

const char* error_string(int32_t error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

const SideStreamOps kOps{&stream_wait, &cast_copy, &error_string};

const bool kRegistered = (side_stream_ops_slot() = &kOps, true);

}  // namespace
}  // namespace zero_kernels::comm
