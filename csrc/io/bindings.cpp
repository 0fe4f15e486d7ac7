// Python bindings of the disk I/O engine. Every call that may block (opening files, waiting, closing
// the engine, whose workers may drop the last reference to a tensor) runs without the GIL.
#include <torch/extension.h>

#include "io/engine.h"

namespace zio = zero_kernels::io;
using Release = py::call_guard<py::gil_scoped_release>;

namespace {

std::shared_ptr<zio::Engine> make_engine(int64_t block_size, int64_t queue_depth, int64_t threads, bool direct) {
  TORCH_CHECK(block_size > 0 && block_size % zio::kPage == 0, "block_size must be a positive multiple of ",
              zio::kPage, ", got ", block_size);
  TORCH_CHECK(queue_depth > 0 && threads > 0, "queue_depth and threads must be positive");
  zio::Options options{block_size, queue_depth, threads, direct};
  return std::shared_ptr<zio::Engine>(new zio::Engine(options), [](zio::Engine* engine) {
    if (PyGILState_Check()) {
      py::gil_scoped_release release;
      delete engine;
    } else {
      delete engine;
    }
  });
}

std::shared_ptr<zio::Request> submit(zio::Engine& engine, const std::string& path, const at::Tensor& tensor,
                                     int64_t offset, bool write) {
  TORCH_CHECK(tensor.device().is_cpu() && tensor.is_contiguous(), "the tensor must be a contiguous CPU tensor");
  TORCH_CHECK(offset >= 0, "offset must be >= 0, got ", offset);
  auto keep_alive = std::make_shared<at::Tensor>(tensor);
  char* data = static_cast<char*>(tensor.data_ptr());
  const int64_t nbytes = tensor.numel() * static_cast<int64_t>(tensor.element_size());
  py::gil_scoped_release release;
  return engine.submit(path, data, nbytes, offset, write, std::move(keep_alive));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zero_kernels disk I/O engine: tensors to and from files on a thread pool, O_DIRECT where allowed";
  m.attr("MECHANISM") = "pread/pwrite thread pool";
  m.attr("PAGE") = zio::kPage;

  py::class_<zio::Request, std::shared_ptr<zio::Request>>(m, "Request")
      .def("done", &zio::Request::done)
      .def(
          "wait",
          [](zio::Request& request) {
            zio::Outcome outcome;
            {
              py::gil_scoped_release release;
              outcome = request.wait();
            }
            return py::make_tuple(outcome.error, outcome.detail);
          },
          "block until done; (errno, what failed), errno 0 when it succeeded")
      .def_property_readonly("path", &zio::Request::path);

  py::class_<zio::Engine, std::shared_ptr<zio::Engine>>(m, "Engine")
      .def(py::init(&make_engine), py::kw_only(), py::arg("block_size"), py::arg("queue_depth"), py::arg("threads"),
           py::arg("direct"))
      .def("submit", &submit, py::arg("path"), py::arg("tensor"), py::arg("offset"), py::arg("write"))
      .def("close", &zio::Engine::close, Release())
      .def("buffered_paths", &zio::Engine::buffered_paths);
}
