// Python bindings of the comm engine: one def per entry point, the GIL released around every call
// into c10d (issuing may wait on the backend's queue, wait() blocks on CPU) and around destruction.
// On CUDA the side stream comes twice: as a cudaStream_t for the side-stream kernels (side_stream) and
// as the torch stream (side) that is made current while an operation is finished.
#include <torch/python.h>

#include "comm/engine.h"

namespace zk = zero_kernels::comm;
using Release = py::call_guard<py::gil_scoped_release>;

namespace {

// Destroying an engine waits for its operations still in flight, whose completion on the backend's
// threads may need the GIL to release tensors, so never destroy an engine while holding it.
std::shared_ptr<zk::Engine> make_engine(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  return std::shared_ptr<zk::Engine>(new zk::Engine(group), [](zk::Engine* engine) {
    if (PyGILState_Check()) {
      py::gil_scoped_release release;
      delete engine;
    } else {
      delete engine;
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zero_kernels comm engine: asynchronous, ordered c10d collectives";

  py::enum_<zk::Primitive>(m, "Primitive")
      .value("all_reduce", zk::Primitive::kAllReduce)
      .value("all_reduce_slice", zk::Primitive::kAllReduceSlice)
      .value("reduce_scatter_list", zk::Primitive::kReduceScatterList)
      .value("reduce_scatter_tensor", zk::Primitive::kReduceScatterTensor)
      .value("all_gather_list", zk::Primitive::kAllGatherList)
      .value("all_gather_tensor", zk::Primitive::kAllGatherTensor)
      .value("reduce_scatter_p2p", zk::Primitive::kReduceScatterP2P)
      .value("all_gather_p2p", zk::Primitive::kAllGatherP2P)
      .value("reduce_scatter_nodes", zk::Primitive::kReduceScatterNodes)
      .value("all_gather_nodes", zk::Primitive::kAllGatherNodes)
      .value("reduce_scatter_shm", zk::Primitive::kReduceScatterShm)
      .value("all_gather_shm", zk::Primitive::kAllGatherShm);

  py::class_<zk::PendingOp, std::shared_ptr<zk::PendingOp>>(m, "PendingOp")
      .def("wait", &zk::PendingOp::wait, Release())
      .def("is_completed", &zk::PendingOp::is_completed, Release())
      .def_property_readonly("what", &zk::PendingOp::what);

  py::class_<zk::Engine, std::shared_ptr<zk::Engine>>(m, "Engine")
      .def(py::init(&make_engine), py::arg("process_group"))
      .def(
          "reduce_scatter",
          [](zk::Engine& e, const at::Tensor& output, const at::Tensor& input, const std::string& name,
             zk::Primitive primitive, intptr_t compute_stream, intptr_t side_stream, std::optional<c10::Stream> side) {
            return e.reduce_scatter(output, input, name, primitive, {compute_stream, side_stream, side});
          },
          py::arg("output"), py::arg("input"), py::arg("name"), py::arg("primitive"), py::arg("compute_stream") = 0,
          py::arg("side_stream") = 0, py::arg("side") = py::none(), Release())
      .def(
          "all_gather",
          [](zk::Engine& e, const at::Tensor& output, const at::Tensor& input, const std::string& name,
             zk::Primitive primitive, intptr_t compute_stream, intptr_t side_stream, std::optional<c10::Stream> side) {
            return e.all_gather(output, input, name, primitive, {compute_stream, side_stream, side});
          },
          py::arg("output"), py::arg("input"), py::arg("name"), py::arg("primitive"), py::arg("compute_stream") = 0,
          py::arg("side_stream") = 0, py::arg("side") = py::none(), Release())
      .def(
          "all_reduce",
          [](zk::Engine& e, const at::Tensor& tensor, const std::string& op, const std::string& name,
             intptr_t compute_stream, intptr_t side_stream, std::optional<c10::Stream> side, bool shared_memory) {
            return e.all_reduce(tensor, op, name, {compute_stream, side_stream, side}, shared_memory);
          },
          py::arg("tensor"), py::arg("op"), py::arg("name"), py::arg("compute_stream") = 0, py::arg("side_stream") = 0,
          py::arg("side") = py::none(), py::arg("shared_memory") = false, Release())
      .def("all_reduce_nodes", &zk::Engine::all_reduce_nodes, py::arg("tensor"), py::arg("name"), Release())
      .def("synchronize", &zk::Engine::synchronize, Release())
      .def("set_nodes", &zk::Engine::set_nodes, py::arg("rows"))
      .def("in_flight", &zk::Engine::in_flight, Release())
      .def("open_host_channel", &zk::Engine::open_host_channel, py::arg("name"), py::arg("create"),
           py::arg("chunk_bytes"), py::arg("timeout_ms"), Release())
      .def("use_node_channel", &zk::Engine::use_node_channel)
      .def("host_channel_peers_visible", &zk::Engine::host_channel_peers_visible, Release())
      .def("close_host_channel", &zk::Engine::close_host_channel, Release())
      .def_static("unlink_host_channel", &zk::HostChannel::unlink, py::arg("name"))
      .def_property_readonly("rank", &zk::Engine::rank)
      .def_property_readonly("world_size", &zk::Engine::world_size)
      .def_property_readonly("backend", &zk::Engine::backend);

  m.def("live_ops", &zk::PendingOp::live, "PendingOp objects alive in this process");
}
