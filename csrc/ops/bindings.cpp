// Python bindings of the CPU kernels: one m.def per op, the GIL released around the work.
// Input checks sit at the top of each C++ entry point (adam_cpu.cpp, flatten_cpu.cpp,
// quant_cpu.cpp), so they also guard callers that use the kernels without Python.
#include <torch/extension.h>

#include "ops/adam_cpu.h"
#include "ops/flatten_cpu.h"
#include "ops/quant_cpu.h"

namespace {

void adam_step(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg, at::Tensor& exp_avg_sq, double lr,
               double beta1, double beta2, double eps, double weight_decay, double step_size, double bc2_sqrt,
               bool adamw, std::optional<double> grad_scale, const std::optional<at::Tensor>& found_inf,
               const std::optional<at::Tensor>& out, const std::optional<at::Tensor>& max_exp_avg_sq, bool maximize,
               bool adopt_out, const std::optional<at::Tensor>& quantized_data,
               const std::optional<at::Tensor>& quantized_scales, int64_t quantized_block) {
  const zero_kernels::AdamHyper hyper{
      lr, beta1, beta2, eps, weight_decay, step_size, bc2_sqrt, adamw, grad_scale, maximize, adopt_out};
  TORCH_CHECK_VALUE(quantized_data.has_value() == quantized_scales.has_value(),
                    "adam_step: pass quantized_data and quantized_scales together");
  std::optional<zero_kernels::QuantizedOut> quantized;
  if (quantized_data) quantized = zero_kernels::QuantizedOut{*quantized_data, *quantized_scales, quantized_block};
  zero_kernels::adam_step_cpu(param, grad, exp_avg, exp_avg_sq, hyper, found_inf, out, max_exp_avg_sq, quantized);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zero_kernels CPU kernels";
  m.def("adam_step", &adam_step, "one fused Adam/AdamW step on a flat fp32 shard, in place", py::arg("param"),
        py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::kw_only(), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("step_size"), py::arg("bc2_sqrt"),
        py::arg("adamw"), py::arg("grad_scale"), py::arg("found_inf"), py::arg("out"),
        py::arg("max_exp_avg_sq") = std::nullopt, py::arg("maximize") = false,
        py::arg("adopt_out") = false, py::arg("quantized_data") = std::nullopt,
        py::arg("quantized_scales") = std::nullopt, py::arg("quantized_block") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("flatten", &zero_kernels::flatten_cpu, "copy tensors into a flat buffer at offsets (cast, scale)",
        py::arg("tensors"), py::arg("flat"), py::arg("offsets"), py::kw_only(), py::arg("scale"),
        py::call_guard<py::gil_scoped_release>());
  m.def("unflatten", &zero_kernels::unflatten_cpu, "copy a flat buffer back into tensors in place (cast, scale)",
        py::arg("flat"), py::arg("tensors"), py::arg("offsets"), py::kw_only(), py::arg("scale"),
        py::call_guard<py::gil_scoped_release>());
  m.def("quantize", &zero_kernels::quantize_cpu, "block quantization into preallocated data and scales",
        py::arg("x"), py::arg("bits"), py::arg("block"), py::arg("data"), py::arg("scales"),
        py::call_guard<py::gil_scoped_release>());
  m.def("dequantize", &zero_kernels::dequantize_cpu, "block dequantization into a preallocated tensor",
        py::arg("data"), py::arg("scales"), py::arg("bits"), py::arg("block"), py::arg("out"),
        py::call_guard<py::gil_scoped_release>());
}
