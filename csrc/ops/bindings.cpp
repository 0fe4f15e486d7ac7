// Python bindings of the CPU kernels: checks at the top, one m.def per op.
#include <torch/extension.h>

#include "ops/flatten_cpu.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zero_kernels CPU kernels";
  m.def("flatten", &zero_kernels::flatten_cpu, "copy tensors into a flat buffer at offsets",
        py::arg("tensors"), py::arg("offsets"), py::arg("flat"), py::call_guard<py::gil_scoped_release>());
}
