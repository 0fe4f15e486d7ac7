// C++ tests of the CPU kernels, run by ctest without Python (see CMakeLists.txt).
//
// Adam (also with AMSGrad and maximize) is compared with a scalar double-precision loop,
// flatten/unflatten with a round trip and with ATen's own copies, block quantization with a scalar
// double loop; the found-inf flag and the input checks are exercised as well.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "ops/adam_cpu.h"
#include "ops/flatten_cpu.h"
#include "ops/quant_cpu.h"
#include "tests/check.h"

namespace {

using zero_kernels::testing::expect;

// Largest |actual - expected| beyond rtol * |expected| + atol, 0 when all elements pass.
double worst_excess(const at::Tensor& actual, const std::vector<double>& expected, double rtol, double atol) {
  const float* a = actual.const_data_ptr<float>();
  double worst = 0.0;
  for (size_t i = 0; i < expected.size(); ++i) {
    const double excess = std::abs(a[i] - expected[i]) - (rtol * std::abs(expected[i]) + atol);
    if (!(excess <= 0.0)) worst = std::max(worst, std::isnan(excess) ? INFINITY : excess);
  }
  return worst;
}

double max_abs(const std::vector<double>& x) {
  double m = 0.0;
  for (double v : x) m = std::max(m, std::abs(v));
  return m;
}

// Adam/AdamW in float64, one element at a time: the textbook formula, not the kernel's. With v_max:
// AMSGrad (the running maximum of v normalises the step).
void adam_reference(std::vector<double>& p, std::vector<double>& m, std::vector<double>& v, const at::Tensor& grad,
                    const zero_kernels::AdamHyper& h, std::vector<double>* v_max = nullptr) {
  const at::Tensor g = grad.to(at::kDouble);
  const double* gd = g.const_data_ptr<double>();
  for (size_t i = 0; i < p.size(); ++i) {
    double gi = gd[i] * h.grad_scale.value_or(1.0) * (h.maximize ? -1.0 : 1.0);
    if (h.adamw) {
      p[i] *= 1.0 - h.lr * h.weight_decay;
    } else {
      gi += h.weight_decay * p[i];
    }
    m[i] = h.beta1 * m[i] + (1.0 - h.beta1) * gi;
    v[i] = h.beta2 * v[i] + (1.0 - h.beta2) * gi * gi;
    double second = v[i];
    if (v_max != nullptr) second = (*v_max)[i] = std::max((*v_max)[i], v[i]);
    p[i] -= h.step_size * m[i] / (std::sqrt(second) / h.bc2_sqrt + h.eps);
  }
}

std::vector<double> to_vector(const at::Tensor& t) {
  const at::Tensor d = t.to(at::kDouble).contiguous();
  return std::vector<double>(d.const_data_ptr<double>(), d.const_data_ptr<double>() + d.numel());
}

zero_kernels::AdamHyper hyper_for_step(int step, bool adamw, std::optional<double> grad_scale) {
  const double lr = 1e-3, beta1 = 0.9, beta2 = 0.999;
  const double bc1 = 1.0 - std::pow(beta1, step), bc2 = 1.0 - std::pow(beta2, step);
  return {lr, beta1, beta2, 1e-8, 0.01, lr / bc1, std::sqrt(bc2), adamw, grad_scale};
}

void test_adam_against_double_loop(int64_t n, at::ScalarType grad_dtype, bool adamw) {
  const std::string name = "adam n=" + std::to_string(n) + " grad=" + c10::toString(grad_dtype) +
                           (adamw ? " adamw" : " adam");
  at::Tensor p = at::randn({n}), m = at::randn({n}) * 0.1, v = at::rand({n}) * 0.01;
  std::vector<double> pe = to_vector(p), me = to_vector(m), ve = to_vector(v);
  at::Tensor out = at::empty({n}, at::kBFloat16);
  for (int step = 1; step <= 3; ++step) {
    const at::Tensor grad = at::randn({n}).to(grad_dtype);
    const auto h = hyper_for_step(step, adamw, step == 2 ? std::optional<double>(0.5) : std::nullopt);
    zero_kernels::adam_step_cpu(p, grad, m, v, h, std::nullopt, out);
    adam_reference(pe, me, ve, grad, h);
    // fp32 against float64: a few roundings per step, and cancellation near zero.
    const double eps32 = std::numeric_limits<float>::epsilon();
    expect(worst_excess(p, pe, 1e-6, 8 * eps32 * max_abs(pe)) == 0.0, name + ": param step " + std::to_string(step));
    expect(worst_excess(m, me, 1e-6, 8 * eps32 * max_abs(me)) == 0.0, name + ": exp_avg step " + std::to_string(step));
    expect(worst_excess(v, ve, 1e-6, 8 * eps32 * max_abs(ve)) == 0.0,
           name + ": exp_avg_sq step " + std::to_string(step));
    expect(at::equal(out, p.to(at::kBFloat16)), name + ": out is the updated param in bf16");
  }
}

void test_amsgrad_maximize_against_double_loop(int64_t n, bool adamw) {
  const std::string name = "adam amsgrad+maximize n=" + std::to_string(n) + (adamw ? " adamw" : " adam");
  at::Tensor p = at::randn({n}), m = at::randn({n}) * 0.1, v = at::rand({n}) * 0.01, v_max = at::rand({n}) * 0.01;
  std::vector<double> pe = to_vector(p), me = to_vector(m), ve = to_vector(v), v_maxe = to_vector(v_max);
  const double eps32 = std::numeric_limits<float>::epsilon();
  for (int step = 1; step <= 3; ++step) {
    const at::Tensor grad = at::randn({n}) * (step == 2 ? 3.0 : 0.3);
    auto h = hyper_for_step(step, adamw, step == 2 ? std::optional<double>(0.5) : std::nullopt);
    h.maximize = true;
    zero_kernels::adam_step_cpu(p, grad, m, v, h, std::nullopt, std::nullopt, v_max);
    adam_reference(pe, me, ve, grad, h, &v_maxe);
    const std::string at_step = " step " + std::to_string(step);
    expect(worst_excess(p, pe, 1e-6, 8 * eps32 * max_abs(pe)) == 0.0, name + ": param" + at_step);
    expect(worst_excess(m, me, 1e-6, 8 * eps32 * max_abs(me)) == 0.0, name + ": exp_avg" + at_step);
    expect(worst_excess(v, ve, 1e-6, 8 * eps32 * max_abs(ve)) == 0.0, name + ": exp_avg_sq" + at_step);
    expect(worst_excess(v_max, v_maxe, 1e-6, 8 * eps32 * max_abs(v_maxe)) == 0.0, name + ": max_exp_avg_sq" + at_step);
  }
}

void test_found_inf() {
  const int64_t n = 100003;
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    at::Tensor p = at::randn({n}), m = at::zeros({n}), v = at::zeros({n});
    at::Tensor grad = at::randn({n}).to(dtype);
    grad[n - 2] = std::numeric_limits<float>::quiet_NaN();
    const at::Tensor p0 = p.clone();
    at::Tensor flag = at::zeros({1});
    zero_kernels::adam_step_cpu(p, grad, m, v, hyper_for_step(1, true, std::nullopt), flag, std::nullopt);
    const std::string name = std::string("found_inf grad=") + c10::toString(dtype);
    expect(flag.item<float>() == 1.0f, name + ": nan flagged");
    expect(at::equal(p, p0) && at::equal(m, at::zeros({n})) && at::equal(v, at::zeros({n})), name + ": untouched");
  }
  at::Tensor p = at::randn({7}), m = at::zeros({7}), v = at::zeros({7});
  const at::Tensor p0 = p.clone();
  at::Tensor flag = at::ones({1});
  zero_kernels::adam_step_cpu(p, at::randn({7}), m, v, hyper_for_step(1, true, std::nullopt), flag, std::nullopt);
  expect(at::equal(p, p0) && flag.item<float>() == 1.0f, "found_inf preset: nothing written");
  flag.zero_();
  zero_kernels::adam_step_cpu(p, at::randn({7}), m, v, hyper_for_step(1, true, std::nullopt), flag, std::nullopt);
  expect(!at::equal(p, p0) && flag.item<float>() == 0.0f, "found_inf clear, finite grad: step taken, flag stays 0");
}

void test_flatten_round_trip() {
  const at::Tensor big = at::randn({300, 700});
  std::vector<at::Tensor> tensors = {
      at::randn({5, 3}),                                          // contiguous
      at::randn({4, 6}).t(),                                      // transposed
      at::randn({9, 8}).to(at::kBFloat16).slice(1, 1, 8, 3),     // strided bf16
      at::randn({}).to(at::kHalf),                                // 0-d fp16
      at::empty({0, 4}),                                          // empty
      big.slice(1, 3, 603),                                       // large strided: split across threads
      at::randn({2, 3, 4}).to(at::kDouble).permute({2, 0, 1}),    // fp64, exact in fp32
  };
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (const auto& t : tensors) {
    offsets.push_back(total);
    total += t.numel() + 1;
  }
  at::Tensor flat = at::full({total}, -5.0);
  zero_kernels::flatten_cpu(tensors, flat, offsets, 2.0);
  std::vector<at::Tensor> copies;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor slot = flat.narrow(0, offsets[i], tensors[i].numel());
    const at::Tensor want = (tensors[i].to(at::kFloat) * 2.0f).reshape({-1});
    expect(at::equal(slot, want), "flatten: tensor " + std::to_string(i) + " scaled by 2 in fp32");
    expect(offsets[i] == 0 || flat[offsets[i] - 1].item<float>() == -5.0f,
           "flatten: padding before tensor " + std::to_string(i) + " untouched");
    copies.push_back(at::empty_strided(tensors[i].sizes(), tensors[i].strides(), tensors[i].options()));
  }
  zero_kernels::unflatten_cpu(flat, copies, offsets, 0.5);
  for (size_t i = 0; i < tensors.size(); ++i) {
    expect(at::equal(copies[i], tensors[i]), "round trip: tensor " + std::to_string(i));
  }
}

void expect_value_error(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    expect(false, "no error for: " + needle);
  } catch (const c10::ValueError& e) {
    expect(std::string(e.what()).find(needle) != std::string::npos, "error names '" + needle + "': " + e.what());
  }
}

// Block quantization against a scalar loop in double: each scale is absmax / qmax rounded once to
// float, each integer the float quotient rounded half to even and clamped; a NaN block sends zeros
// under a NaN scale. The round trip is within half a scale of every input.
void test_quantize_against_double_loop(int64_t n, int64_t bits, int64_t block, at::ScalarType dtype) {
  const std::string name = "quantize n=" + std::to_string(n) + " bits=" + std::to_string(bits) +
                           " block=" + std::to_string(block) + " " + c10::toString(dtype);
  at::Tensor x = (at::randn({n}) * 3.0).to(dtype);
  if (n > 2 * block) x[block + 1] = NAN;
  const int64_t blocks = (n + block - 1) / block;
  at::Tensor data = at::empty({blocks * block * bits / 8}, at::kByte), scales = at::empty({blocks});
  zero_kernels::quantize_cpu(x, bits, block, data, scales);
  const std::vector<double> xs = to_vector(x);
  const double qmax = bits == 8 ? 127.0 : 7.0;
  const uint8_t* d = data.const_data_ptr<uint8_t>();
  int bad = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    double absmax = 0.0;
    bool nan = false;
    for (int64_t i = b * block; i < std::min(n, (b + 1) * block); ++i) {
      absmax = std::max(absmax, std::abs(xs[i]));
      nan |= std::isnan(xs[i]);
    }
    const float scale = nan ? NAN : static_cast<float>(absmax / qmax);
    const float got = scales.const_data_ptr<float>()[b];
    bad += !(got == scale || (std::isnan(got) && std::isnan(scale)));
    for (int64_t i = b * block; i < (b + 1) * block; ++i) {
      const float quotient = i < n && scale > 0 && std::isfinite(scale) ? static_cast<float>(xs[i] / scale) : 0.0f;
      const int want = static_cast<int>(std::nearbyint(std::clamp(static_cast<double>(quotient), -qmax, qmax)));
      const int q = bits == 8 ? static_cast<int8_t>(d[i]) : ((((d[i / 2] >> (4 * (i % 2))) & 0x0F) ^ 8) - 8);
      bad += q != want;
    }
  }
  at::Tensor back = at::empty({n}, dtype);
  zero_kernels::dequantize_cpu(data, scales, bits, block, back);
  const std::vector<double> ys = to_vector(back);
  for (int64_t i = 0; i < n; ++i) {
    const double scale = scales.const_data_ptr<float>()[i / block];
    const double ulp = dtype == at::kFloat ? 0.0 : std::abs(ys[i]) * (dtype == at::kBFloat16 ? 0x1p-7 : 0x1p-10);
    bad += std::isnan(scale) ? !std::isnan(ys[i]) : !(std::abs(ys[i] - xs[i]) <= scale * (0.5 + qmax * 0x1p-22) + ulp);
  }
  expect(bad == 0, name + ": " + std::to_string(bad) + " values or scales differ from the double loop");
}

void test_checks() {
  at::Tensor p = at::zeros({4}), m = at::zeros({4}), v = at::zeros({3});
  const auto h = hyper_for_step(1, true, std::nullopt);
  expect_value_error([&] { zero_kernels::adam_step_cpu(p, at::zeros({4}), m, v, h, std::nullopt, std::nullopt); },
                     "exp_avg_sq has 3 elements, param has 4");
  at::Tensor v4 = at::zeros({4});
  expect_value_error(
      [&] { zero_kernels::adam_step_cpu(p, at::zeros({4}, at::kInt), m, v4, h, std::nullopt, std::nullopt); },
      "grad dtype Int");
  expect_value_error([&] { zero_kernels::flatten_cpu({at::zeros({3})}, at::zeros({4}), {2}, std::nullopt); },
                     "tensor 0 (3 elements at offset 2) overruns");
  expect_value_error(
      [&] { zero_kernels::unflatten_cpu(at::zeros({6}), {at::zeros({3}).expand({2, 3})}, {0}, std::nullopt); },
      "share memory");
  expect_value_error(
      [&] { zero_kernels::quantize_cpu(at::zeros({8}), 4, 7, at::empty({4}, at::kByte), at::empty({2})); },
      "even for bits=4");
}

}  // namespace

int main() {
  at::manual_seed(0);
  at::set_num_threads(2);
  for (const int64_t n : {1, 7, 4097, 100003}) {
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      test_adam_against_double_loop(n, dtype, true);
      test_adam_against_double_loop(n, dtype, false);
    }
  }
  for (const int64_t n : {7, 4097, 100003}) {
    test_amsgrad_maximize_against_double_loop(n, true);
    test_amsgrad_maximize_against_double_loop(n, false);
  }
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (const int64_t n : {1, 63, 64, 65, 4099}) {
      test_quantize_against_double_loop(n, 8, 64, dtype);
      test_quantize_against_double_loop(n, 4, 64, dtype);
    }
  }
  test_found_inf();
  test_flatten_round_trip();
  test_checks();
  return zero_kernels::testing::finish("CPU kernel tests");
}
