// Vectorised leaf loops of the CPU kernels (see loops_cpu.h).
//
// Plain loops under `#pragma omp simd`; the compiler vectorises each for every target of
// ZK_CPU_CLONES. Needs -fno-math-errno so that sqrt becomes a vector instruction.
#include "ops/loops_cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define ZK_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ZK_CPU_CLONES
#endif

namespace zero_kernels::loops {

ZK_CPU_CLONES void adam_update(float* __restrict param, float* __restrict exp_avg, float* __restrict exp_avg_sq,
                               const float* __restrict grad, int64_t n, const AdamCoefs& c) {
  const AdamCoefs k = c;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float p = param[i];
    const float g = grad[i] * k.grad_scale + k.l2 * p;
    const float m = exp_avg[i] * k.beta1 + k.one_minus_beta1 * g;
    const float v = exp_avg_sq[i] * k.beta2 + k.one_minus_beta2 * g * g;
    const float denom = std::sqrt(v) * k.inv_bc2_sqrt + k.eps;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    param[i] = p * k.decay + (k.neg_step_size * m) / denom;
  }
}

ZK_CPU_CLONES void adam_update_amsgrad(float* __restrict param, float* __restrict exp_avg,
                                       float* __restrict exp_avg_sq, float* __restrict max_exp_avg_sq,
                                       const float* __restrict grad, int64_t n, const AdamCoefs& c) {
  const AdamCoefs k = c;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float p = param[i];
    const float g = grad[i] * k.grad_scale + k.l2 * p;
    const float m = exp_avg[i] * k.beta1 + k.one_minus_beta1 * g;
    const float v = exp_avg_sq[i] * k.beta2 + k.one_minus_beta2 * g * g;
    const float old = max_exp_avg_sq[i];
    const float v_max = (v > old || v != v) ? v : old;
    const float denom = std::sqrt(v_max) * k.inv_bc2_sqrt + k.eps;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    max_exp_avg_sq[i] = v_max;
    param[i] = p * k.decay + (k.neg_step_size * m) / denom;
  }
}

ZK_CPU_CLONES float block_scale(const float* __restrict v, int64_t n, float qmax) {
  float absmax = 0.0f;
  int nan = 0;
#pragma omp simd reduction(max : absmax) reduction(| : nan)
  for (int64_t i = 0; i < n; ++i) {
    absmax = std::max(absmax, std::fabs(v[i]));
    nan |= static_cast<int>(v[i] != v[i]);
  }
  if (nan) return std::numeric_limits<float>::quiet_NaN();
  const float scale = absmax / qmax;
  const bool overflows = std::isinf(scale * qmax) && std::isfinite(scale);
  return overflows ? std::nextafter(scale, 0.0f) : scale;  // every qmax * scale stays finite
}

ZK_CPU_CLONES void quantize_block(const float* __restrict v, int8_t* __restrict q, int64_t n, float scale,
                                  float qmax) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) q[i] = static_cast<int8_t>(std::rint(std::clamp(v[i] / scale, -qmax, qmax)));
}

ZK_CPU_CLONES void pack_int4(const int8_t* __restrict q, uint8_t* __restrict out, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n / 2; ++j) {
    out[j] = static_cast<uint8_t>((q[2 * j] & 0x0F) | ((q[2 * j + 1] & 0x0F) << 4));
  }
}

ZK_CPU_CLONES void dequantize_block(const uint8_t* __restrict data, int64_t bits, float* __restrict v, int64_t n,
                                    float scale) {
  if (bits == 8) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(static_cast<int8_t>(data[i])) * scale;
    return;
  }
#pragma omp simd
  for (int64_t j = 0; j < n / 2; ++j) {
    v[2 * j] = static_cast<float>(static_cast<int8_t>(data[j] << 4) >> 4) * scale;
    v[2 * j + 1] = static_cast<float>(static_cast<int8_t>(data[j]) >> 4) * scale;
  }
}

namespace {

// How each element type is stored and turned into / made from a float (double stays double).
// The 16-bit types are handled as raw bits so that the loops vectorise.
template <typename T>
struct Elem {
  using storage = T;
  static T load(T x) { return x; }
  template <typename V>
  static T store(V x) {
    return static_cast<T>(x);
  }
};
template <>
struct Elem<c10::BFloat16> {
  using storage = uint16_t;
  static float load(uint16_t x) { return c10::detail::f32_from_bits(x); }
  static uint16_t store(float x) { return c10::detail::round_to_nearest_even(x); }
};
template <>
struct Elem<c10::Half> {
  using storage = uint16_t;
  static float load(uint16_t x) { return c10::detail::fp16_ieee_to_fp32_value(x); }
  static uint16_t store(float x) { return c10::detail::fp16_ieee_from_fp32_value(x); }
};

// Raw bits of a floating type and the mask of its exponent field (all ones = inf or nan).
template <typename T>
struct ExponentBits;
template <>
struct ExponentBits<float> {
  using type = uint32_t;
  static constexpr type mask = 0x7f800000u;
};
template <>
struct ExponentBits<double> {
  using type = uint64_t;
  static constexpr type mask = 0x7ff0000000000000ull;
};
template <>
struct ExponentBits<c10::BFloat16> {
  using type = uint16_t;
  static constexpr type mask = 0x7f80u;
};
template <>
struct ExponentBits<c10::Half> {
  using type = uint16_t;
  static constexpr type mask = 0x7c00u;
};

}  // namespace

template <typename Src, typename Dst>
ZK_CPU_CLONES void convert(const Src* src_elems, int64_t src_stride, Dst* dst_elems, int64_t dst_stride, int64_t n,
                           bool scaled, float scale) {
  using S = Elem<Src>;
  using D = Elem<Dst>;
  const auto* __restrict src = reinterpret_cast<const typename S::storage*>(src_elems);
  auto* __restrict dst = reinterpret_cast<typename D::storage*>(dst_elems);
  if (src_stride == 1 && dst_stride == 1) {
    if (scaled) {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) dst[i] = D::store(static_cast<float>(S::load(src[i])) * scale);
    } else {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) dst[i] = D::store(S::load(src[i]));
    }
    return;
  }
  if (scaled) {
    for (int64_t i = 0; i < n; ++i) {
      dst[i * dst_stride] = D::store(static_cast<float>(S::load(src[i * src_stride])) * scale);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i * dst_stride] = D::store(S::load(src[i * src_stride]));
  }
}

inline uint16_t bits_of(uint16_t x) { return x; }
inline uint32_t bits_of(float x) { return c10::detail::fp32_to_bits(x); }

template <typename T>
ZK_CPU_CLONES void adopt_edits(float* __restrict param, const T* out_elems, int64_t n) {
  using E = Elem<T>;
  const auto* __restrict out = reinterpret_cast<const typename E::storage*>(out_elems);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float p = param[i];
    const auto o = out[i];
    param[i] = bits_of(o) != bits_of(E::store(p)) ? static_cast<float>(E::load(o)) : p;
  }
}

template void adopt_edits<float>(float*, const float*, int64_t);
template void adopt_edits<c10::Half>(float*, const c10::Half*, int64_t);
template void adopt_edits<c10::BFloat16>(float*, const c10::BFloat16*, int64_t);

template <typename T>
ZK_CPU_CLONES bool any_nonfinite(const T* x, int64_t n) {
  using Bits = typename ExponentBits<T>::type;
  static_assert(sizeof(Bits) == sizeof(T), "exponent bits must cover the whole element");
  constexpr Bits mask = ExponentBits<T>::mask;
  const Bits* bits = reinterpret_cast<const Bits*>(x);
  Bits found = 0;
#pragma omp simd reduction(| : found)
  for (int64_t i = 0; i < n; ++i) found |= static_cast<Bits>((bits[i] & mask) == mask);
  return found != 0;
}

#define ZK_CONVERT_TO(Src, Dst) \
  template void convert<Src, Dst>(const Src*, int64_t, Dst*, int64_t, int64_t, bool, float);
#define ZK_CONVERT_FROM(Src)          \
  ZK_CONVERT_TO(Src, float)           \
  ZK_CONVERT_TO(Src, double)          \
  ZK_CONVERT_TO(Src, c10::Half)       \
  ZK_CONVERT_TO(Src, c10::BFloat16)   \
  template bool any_nonfinite<Src>(const Src*, int64_t);

ZK_CONVERT_FROM(float)
ZK_CONVERT_FROM(double)
ZK_CONVERT_FROM(c10::Half)
ZK_CONVERT_FROM(c10::BFloat16)

#undef ZK_CONVERT_FROM
#undef ZK_CONVERT_TO

}  // namespace zero_kernels::loops
