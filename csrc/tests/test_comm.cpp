// C++ tests of the comm engine's stream ordering, run by ctest without Python or a GPU (see CMakeLists.txt).
//
// On NCCL a work's wait() makes the *current* stream wait for the collective, and the epilogue's cast
// is queued on the side stream: an operation must be finished with its side stream current, whoever
// finishes it and whatever stream is current on that thread. A fake device (PrivateUse1) with
// streams stands in for CUDA, and a fake process-group backend hands out works that record, when
// they are waited on, which stream was current: PendingOp::wait, Engine::synchronize and the
// engine's destructor must all report the side stream, and leave the caller's stream current.
// The ordered worker (the relay thread, the shared-memory channel's worker) runs its jobs in posting order
// and, when destroyed, those still queued before it stops.
#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <mutex>
#include <thread>
#include <string>
#include <vector>

#include "comm/engine.h"
#include "comm/ordered_worker.h"
#include "tests/check.h"

namespace {

using zero_kernels::testing::expect;

constexpr c10::DeviceType kFake = c10::DeviceType::PrivateUse1;
thread_local c10::StreamId current_stream_id = 0;  // the fake device's current stream on this thread

// One fake device with streams: what c10::StreamGuard sets and a work's wait() would read.
struct FakeGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kFake; }
  c10::Device exchangeDevice(c10::Device) const override { return {kFake, 0}; }
  c10::Device getDevice() const override { return {kFake, 0}; }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device device) const override {
    return c10::Stream(c10::Stream::UNSAFE, device, current_stream_id);
  }
  c10::Stream exchangeStream(c10::Stream stream) const override {
    const c10::Stream previous = getStream(stream.device());
    current_stream_id = stream.id();
    return previous;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
};

c10::StreamId current() { return current_stream_id; }

// A collective that never completes by itself: only wait() finishes it, and it records the stream
// current then (the stream NCCL's wait would order after the collective).
struct RecordingWork final : c10d::Work {
  explicit RecordingWork(std::vector<c10::StreamId>* seen) : seen_(seen) {}
  bool isCompleted() override { return false; }
  bool wait(std::chrono::milliseconds /*timeout*/) override {
    seen_->push_back(current());
    return true;
  }
  std::vector<c10::StreamId>* seen_;
};

struct RecordingBackend final : c10d::Backend {
  RecordingBackend() : c10d::Backend(0, 2) {}
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& /*tensors*/,
                                           const c10d::AllreduceOptions& /*opts*/) override {
    return c10::make_intrusive<RecordingWork>(&seen);
  }
  const std::string getBackendName() const override { return "recording"; }
  std::vector<c10::StreamId> seen;
};

c10::intrusive_ptr<c10d::ProcessGroup> make_group(const c10::intrusive_ptr<RecordingBackend>& backend) {
  auto group = c10::make_intrusive<c10d::ProcessGroup>(c10::make_intrusive<c10d::HashStore>(), 0, 2);
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, backend);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
  return group;
}

void test_operations_finish_on_their_side_stream() {
  namespace zk = zero_kernels::comm;
  auto backend = c10::make_intrusive<RecordingBackend>();
  auto group = make_group(backend);
  const c10::Device device(kFake, 0);
  const c10::Stream side(c10::Stream::UNSAFE, device, 7);
  const c10::Stream caller(c10::Stream::UNSAFE, device, 3);  // e.g. an autograd callback's stream
  zk::Streams streams;
  streams.side_stream = side;
  at::Tensor t = at::ones({4});

  auto engine = std::make_unique<zk::Engine>(group);
  const c10::StreamGuard on_caller(caller);
  auto op = engine->all_reduce(t, "sum", "waited", streams);
  op->wait();
  expect(backend->seen.size() == 1 && backend->seen.back() == 7, "PendingOp::wait did not finish on the side stream");
  expect(current() == 3, "PendingOp::wait left another stream current");

  engine->all_reduce(t, "sum", "synchronized", streams);
  engine->synchronize();
  expect(backend->seen.size() == 2 && backend->seen.back() == 7, "Engine::synchronize did not finish on the side stream");
  expect(current() == 3, "Engine::synchronize left another stream current");

  engine->all_reduce(t, "sum", "destroyed", streams);
  engine.reset();
  expect(backend->seen.size() == 3 && backend->seen.back() == 7, "~Engine did not finish on the side stream");
  expect(current() == 3, "~Engine left another stream current");

  zk::Engine host(group);  // CPU operations have no side stream: finished under whatever is current
  host.all_reduce(t, "sum", "host", zk::Streams{})->wait();
  expect(backend->seen.size() == 4 && backend->seen.back() == 3, "a CPU operation changed the current stream");
}

void test_ordered_worker_runs_jobs_in_order_and_drains_them() {
  std::vector<int> ran;
  std::mutex mu;
  std::atomic<bool> go{false};
  std::thread release([&] {  // lets the first job end once the worker is being destroyed, its queue still full
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    go = true;
  });
  {
    zero_kernels::comm::OrderedWorker worker;
    worker.post([&] {  // holds the thread while the rest are queued
      while (!go.load()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    });
    for (int i = 0; i < 100; ++i) {
      worker.post([&, i] {
        std::lock_guard<std::mutex> lock(mu);
        ran.push_back(i);
      });
    }
  }  // destroyed with the jobs still queued: they run first
  release.join();
  bool ordered = ran.size() == 100;
  for (size_t i = 0; ordered && i < ran.size(); ++i) {
    ordered = ran[i] == static_cast<int>(i);
  }
  expect(ordered, "the ordered worker ran " + std::to_string(ran.size()) + " of 100 jobs, or out of order");
}

}  // namespace

C10_REGISTER_GUARD_IMPL(PrivateUse1, FakeGuard);

int main() {
  test_operations_finish_on_their_side_stream();
  test_ordered_worker_runs_jobs_in_order_and_drains_them();
  return zero_kernels::testing::finish("comm engine tests");
}
