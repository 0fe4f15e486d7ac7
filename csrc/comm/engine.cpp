#include "comm/engine.h"

#include <c10/core/StreamGuard.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <type_traits>
#include <utility>

#include "comm/row_sums.h"
#include "comm/side_stream.h"

namespace zero_kernels::comm {
namespace {

std::atomic<int64_t> g_live_ops{0};

// Tags of the point-to-point primitives: a range of their own, so that they never match a send or
// receive of the user's; one tag per operation, in issue order (the same on every rank).
constexpr uint32_t kTagBase = 1u << 30;
constexpr uint32_t kTagSpan = 1u << 29;

// A host (gloo) collective's worker thread still holds the finished work, and through it the
// tensors, for a few microseconds after wait() returns. Wait (bounded) until it lets go, so that the
// last reference to a tensor Python handed us is dropped on the waiting thread: dropped on a backend
// thread, it needs the GIL, which aborts the process while the interpreter is shutting down
// ("terminate called without an active exception"). On a loaded machine that thread can stay
// descheduled far longer than microseconds, so the bound is generous: it is only reached when that
// thread does not get to run.
void wait_for_backend_release(const c10::intrusive_ptr<c10d::Work>& work) {
  constexpr auto kLimit = std::chrono::seconds(5);
  const auto start = std::chrono::steady_clock::now();
  while (work.use_count() > 1 && std::chrono::steady_clock::now() - start < kLimit) {
    std::this_thread::yield();
  }
}

// The `n` elements of `buffer` that belong to rank `owner`.
at::Tensor part_of(const at::Tensor& buffer, int64_t owner, int64_t n) { return buffer.narrow(0, owner * n, n); }

// The epilogue of a point-to-point reduce-scatter: this rank's chunk `mine` (in the scratch input) plus the
// rows it received (none where `mine` holds the sum already), cast into `output` unless `mine` is `output`.
std::function<void()> sum_into(at::Tensor output, at::Tensor mine, at::Tensor received) {
  return [output = std::move(output), mine = std::move(mine), received = std::move(received)]() {
    if (received.defined()) {
      mine.add_(sum_rows(received));
    }
    if (output.data_ptr() != mine.data_ptr() || output.scalar_type() != mine.scalar_type()) {
      output.copy_(mine);
    }
  };
}

// Newer torch names the flat-tensor collectives *_single and deprecates the underscore names.
template <typename PG, typename = void>
struct HasSingleCollectives : std::false_type {};
template <typename PG>
struct HasSingleCollectives<PG, std::void_t<decltype(&PG::reduce_scatter_single)>> : std::true_type {};

template <typename PG>
c10::intrusive_ptr<c10d::Work> reduce_scatter_flat(PG& group, at::Tensor& output, at::Tensor& input) {
  if constexpr (HasSingleCollectives<PG>::value) {
    return group.reduce_scatter_single(output, input);
  } else {
    return group._reduce_scatter_base(output, input);
  }
}

template <typename PG>
c10::intrusive_ptr<c10d::Work> all_gather_flat(PG& group, at::Tensor& output, at::Tensor& input) {
  if constexpr (HasSingleCollectives<PG>::value) {
    return group.all_gather_single(output, input);
  } else {
    return group._allgather_base(output, input);
  }
}

CastType cast_type(const at::Tensor& t, const std::string& what) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return CastType::kFloat32;
    case at::kHalf:
      return CastType::kFloat16;
    case at::kBFloat16:
      return CastType::kBFloat16;
    case at::kDouble:
      return CastType::kFloat64;
    default:
      throw std::invalid_argument(what + ": dtype " + std::string(c10::toString(t.scalar_type())) +
                                  " cannot be cast on the side stream (float32, float16, bfloat16, float64)");
  }
}

void check_cuda(int32_t error, const SideStreamOps& ops, const std::string& what) {
  if (error != 0) {
    throw std::runtime_error(what + ": CUDA error " + ops.error_string(error));
  }
}

const SideStreamOps& cuda_ops(const std::string& what) {
  const SideStreamOps* ops = side_stream_ops();
  if (ops == nullptr) {
    throw std::runtime_error(what + ": CUDA tensors given but the comm extension was built without CUDA");
  }
  return *ops;
}

// dst <- src (same numel), casting; on CUDA queued on the side stream (ordered after the compute
// stream by order_after_compute, or after the collective in an epilogue).
void copy_in(const at::Tensor& dst, const at::Tensor& src, Streams streams, const std::string& what) {
  if (!dst.is_cuda()) {
    dst.copy_(src);
    return;
  }
  const SideStreamOps& ops = cuda_ops(what);
  check_cuda(ops.cast_copy(dst.data_ptr(), cast_type(dst, what), src.data_ptr(), cast_type(src, what), src.numel(),
                           streams.side, dst.get_device()),
             ops, what);
}

// The one place where a CUDA operation is ordered: the side stream, current while the caller
// issues (so the process group's own stream waits for it), waits for everything queued so far on
// the compute stream. Every entry point calls it first, before it allocates, copies or issues
// anything, for every primitive and dtype path: no collective or side-stream copy can then read a
// buffer before the kernels that write it, nor write into a block that queued compute still reads
// (a block the caching allocator handed back after compute freed it). CPU tensors need nothing.
// `compute` may be 0: that is torch's default stream (torch.cuda.current_stream().cuda_stream is 0 there,
// the legacy default stream), the stream an ordinary training loop runs on. Only the side stream, which the
// engine made itself, is never 0.
void order_after_compute(const at::Tensor& t, Streams streams, const std::string& what) {
  if (!t.is_cuda()) {
    return;
  }
  if (streams.side == 0) {
    throw std::invalid_argument(what + ": CUDA tensors need the side stream");
  }
  const SideStreamOps& ops = cuda_ops(what);
  check_cuda(ops.stream_wait(streams.side, streams.compute, t.get_device()), ops, what);
}

// Runs after the collective: the optional copy-out on the side stream, then on CUDA the compute
// stream waits for the side stream (which already waits for the collective's own stream).
std::function<void()> epilogue(at::Tensor dst, at::Tensor src, Streams streams, std::string what) {
  return [dst = std::move(dst), src = std::move(src), streams, what = std::move(what)]() {
    if (dst.defined()) {
      copy_in(dst, src, streams, what);
    }
    if (streams.side != 0) {
      const SideStreamOps& ops = cuda_ops(what);
      check_cuda(ops.stream_wait(streams.compute, streams.side, static_cast<int32_t>(src.defined() ? src.get_device()
                                                                                                   : dst.get_device())),
                 ops, what);
    }
  };
}

c10d::ReduceOp reduce_op(const std::string& op, const std::string& what) {
  if (op == "sum") {
    return c10d::ReduceOp(c10d::ReduceOp::SUM);
  }
  if (op == "max") {
    return c10d::ReduceOp(c10d::ReduceOp::MAX);
  }
  if (op == "min") {
    return c10d::ReduceOp(c10d::ReduceOp::MIN);
  }
  throw std::invalid_argument(what + ": op '" + op + "'; allowed: sum, max, min");
}

void check_flat(const at::Tensor& t, const char* role, const std::string& what) {
  if (!t.defined() || !t.is_contiguous()) {
    throw std::invalid_argument(what + ": " + role + " must be a defined, contiguous tensor");
  }
}

void check_pair(const at::Tensor& small, const at::Tensor& big, int world_size, const std::string& what) {
  check_flat(small, "the shard", what);
  check_flat(big, "the full buffer", what);
  if (small.device() != big.device()) {
    throw std::invalid_argument(what + ": shard on " + small.device().str() + " but full buffer on " +
                                big.device().str());
  }
  if (big.numel() != small.numel() * world_size) {
    throw std::invalid_argument(what + ": full buffer has " + std::to_string(big.numel()) + " elements, expected " +
                                std::to_string(world_size) + " x " + std::to_string(small.numel()) +
                                " (shard elements)");
  }
}

void check_primitive(Primitive primitive, std::initializer_list<Primitive> allowed, const std::string& what) {
  for (Primitive p : allowed) {
    if (p == primitive) {
      return;
    }
  }
  throw std::invalid_argument(what + ": primitive " + primitive_name(primitive) + " does not implement it");
}

}  // namespace

const char* primitive_name(Primitive primitive) {
  switch (primitive) {
    case Primitive::kAllReduce:
      return "all_reduce";
    case Primitive::kAllReduceSlice:
      return "all_reduce_slice";
    case Primitive::kReduceScatterList:
      return "reduce_scatter_list";
    case Primitive::kReduceScatterTensor:
      return "reduce_scatter_tensor";
    case Primitive::kAllGatherList:
      return "all_gather_list";
    case Primitive::kAllGatherTensor:
      return "all_gather_tensor";
    case Primitive::kReduceScatterP2P:
      return "reduce_scatter_p2p";
    case Primitive::kAllGatherP2P:
      return "all_gather_p2p";
    case Primitive::kReduceScatterNodes:
      return "reduce_scatter_nodes";
    case Primitive::kAllGatherNodes:
      return "all_gather_nodes";
    case Primitive::kReduceScatterShm:
      return "reduce_scatter_shm";
    case Primitive::kAllGatherShm:
      return "all_gather_shm";
  }
  return "unknown";
}

PendingOp::PendingOp(std::string what, Works works, std::vector<at::Tensor> keep_alive,
                     std::function<void()> epilogue, std::optional<c10::Stream> finish_on,
                     std::future<Works> later)
    : what_(std::move(what)),
      works_(std::move(works)),
      keep_alive_(std::move(keep_alive)),
      later_(std::move(later)),
      epilogue_(std::move(epilogue)),
      finish_on_(finish_on),
      on_host_(keep_alive_.empty() || !keep_alive_.front().is_cuda()) {
  ++g_live_ops;
}

PendingOp::~PendingOp() { --g_live_ops; }

int64_t PendingOp::live() { return g_live_ops.load(); }

// Finished with the side stream current, whoever calls: on NCCL a work's wait() orders the current
// stream after the collective, and the epilogue's cast is queued on the side stream.
void PendingOp::finish_locked() {
  if (before_) {  // its failure is its own: raised by its wait(), or by Engine::synchronize
    try {
      before_->wait();
    } catch (const std::exception&) {
    }
    before_.reset();
  }
  const c10::OptionalStreamGuard on_side(finish_on_);
  try {
    if (later_.valid()) {
      Works second = later_.get();  // moved out: the future holds no reference that outlives the works
      works_.insert(works_.end(), second.begin(), second.end());
    }
    for (const auto& work : works_) {
      work->wait();
      if (on_host_) {
        wait_for_backend_release(work);
      }
    }
    if (epilogue_) {
      epilogue_();
    }
  } catch (const std::exception& e) {
    error_ = std::make_exception_ptr(std::runtime_error(what_ + " failed: " + e.what()));
  }
  done_ = true;
  works_.clear();
  keep_alive_.clear();
  epilogue_ = nullptr;
}

void PendingOp::wait() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!done_) {
    finish_locked();
  }
  if (error_) {
    std::rethrow_exception(error_);
  }
}

bool PendingOp::is_completed() {
  std::lock_guard<std::mutex> lock(mu_);
  return done_ || all_completed_locked();
}

bool PendingOp::try_finish() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!done_ && all_completed_locked()) {
    finish_locked();
  }
  return done_;
}

void PendingOp::set_before(std::shared_ptr<PendingOp> before) {
  std::lock_guard<std::mutex> lock(mu_);
  before_ = std::move(before);
}

bool PendingOp::finished() {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

bool PendingOp::all_completed_locked() {
  if (before_ && !before_->finished()) {
    return false;
  }
  if (later_.valid()) {  // its second phase is point-to-point works, which cannot be polled either
    return false;
  }
  for (const auto& work : works_) {
    if (!work->isCompleted()) {
      return false;
    }
  }
  return true;
}

bool PendingOp::failed() {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<bool>(error_);
}

namespace {

// The tag counter of `group`, one per process group for as long as the group lives, whichever engines come and
// go: every rank issues the group's operations in the same order, so every rank gives each the same tags.
std::shared_ptr<std::atomic<uint32_t>> group_tags(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  using Entry = std::pair<c10::weak_intrusive_ptr<c10d::ProcessGroup>, std::shared_ptr<std::atomic<uint32_t>>>;
  static std::mutex mu;
  static std::vector<Entry> groups;
  std::lock_guard<std::mutex> lock(mu);
  std::shared_ptr<std::atomic<uint32_t>> found;
  for (auto it = groups.begin(); it != groups.end();) {
    const auto alive = it->first.lock();
    if (!alive) {  // a destroyed group: a new one at the same address starts afresh
      it = groups.erase(it);
      continue;
    }
    if (alive.get() == group.get()) {
      found = it->second;
    }
    ++it;
  }
  if (!found) {
    found = std::make_shared<std::atomic<uint32_t>>(0);
    groups.emplace_back(c10::weak_intrusive_ptr<c10d::ProcessGroup>(group), found);
  }
  return found;
}

}  // namespace

Engine::Engine(const c10::intrusive_ptr<c10d::ProcessGroup>& group)
    : group_(group),
      rank_(group->getRank()),
      world_size_(group->getSize()),
      backend_(group->getBackendName()),
      next_tag_(group_tags(group)) {}

c10::intrusive_ptr<c10d::ProcessGroup> Engine::group(const std::string& what) const {
  auto group = group_.lock();
  TORCH_CHECK(group, what, ": the process group was destroyed; create the optimizer again after init_process_group");
  return group;
}

Engine::~Engine() {
  std::deque<std::shared_ptr<PendingOp>> pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending.swap(in_flight_);
  }
  for (auto& op : pending) {
    try {
      op->wait();
    } catch (const std::exception& e) {
      TORCH_WARN("zero_kernels comm engine destroyed with a failed operation: ", e.what());
    }
  }
  relay_.reset();
}

std::string Engine::backend() const { return backend_; }

std::string Engine::describe(const char* op, const std::string& name) const {
  return std::string("zero_kernels comm: ") + op + " of bucket '" + name + "' on rank " + std::to_string(rank_) +
         " of " + std::to_string(world_size_) + " (" + backend() + ")";
}

void Engine::reap_locked() {
  for (auto it = in_flight_.begin(); it != in_flight_.end();) {
    if ((*it)->try_finish() && !(*it)->failed()) {
      it = in_flight_.erase(it);
    } else {
      ++it;
    }
  }
}

std::shared_ptr<PendingOp> Engine::track(std::shared_ptr<PendingOp> op) {
  std::vector<std::shared_ptr<PendingOp>> due;
  {
    std::lock_guard<std::mutex> lock(mu_);
    reap_locked();
    if (!in_flight_.empty()) {
      op->set_before(in_flight_.back());
    }
    in_flight_.push_back(op);
    while (static_cast<int64_t>(in_flight_.size()) > kMaxHeld) {
      due.push_back(in_flight_.front());
      in_flight_.pop_front();
    }
  }
  for (auto& old : due) {
    try {
      old->wait();
    } catch (const std::exception&) {
      std::lock_guard<std::mutex> lock(mu_);
      in_flight_.push_front(old);  // synchronize() raises it
    }
  }
  return op;
}

c10::intrusive_ptr<c10d::ProcessGroup> Engine::begin(const std::string& what, const at::Tensor& t, Streams streams) {
  auto pg = group(what);
  order_after_compute(t, streams, what);
  return pg;
}

std::shared_ptr<PendingOp> Engine::reduce_scatter(const at::Tensor& output, const at::Tensor& input,
                                                  const std::string& name, Primitive primitive, Streams streams) {
  const std::string what = describe("reduce_scatter", name);
  check_pair(output, input, world_size_, what);
  check_primitive(primitive,
                  {Primitive::kAllReduceSlice, Primitive::kReduceScatterList, Primitive::kReduceScatterTensor,
                   Primitive::kReduceScatterP2P, Primitive::kReduceScatterNodes, Primitive::kReduceScatterShm},
                  what);
  const auto pg = begin(what, input, streams);
  at::Tensor in = input;
  const int64_t n = output.numel();
  if (primitive == Primitive::kReduceScatterShm) {
    auto work = channel(what, input).reduce_scatter(in, what);
    return track(std::make_shared<PendingOp>(what, Works{std::move(work)}, std::vector<at::Tensor>{in, output},
                                             sum_into(output, part_of(in, rank_, n), at::Tensor())));
  }
  if (primitive == Primitive::kReduceScatterP2P) {
    return reduce_scatter_p2p(*pg, output, in, what);
  }
  if (primitive == Primitive::kReduceScatterNodes) {
    return reduce_scatter_nodes(pg, output, in, what);
  }
  if (primitive == Primitive::kAllReduceSlice) {
    std::vector<at::Tensor> tensors{in};
    auto work = pg->allreduce(tensors);
    at::Tensor mine = part_of(in, rank_, n);
    return track(std::make_shared<PendingOp>(what, Works{std::move(work)}, std::vector<at::Tensor>{in, output},
                                             epilogue(output, mine, streams, what), streams.side_stream));
  }
  const bool direct = output.scalar_type() == input.scalar_type();
  at::Tensor target = direct ? output : at::empty({n}, input.options());
  c10::intrusive_ptr<c10d::Work> work;
  if (primitive == Primitive::kReduceScatterList) {
    std::vector<at::Tensor> outputs{target};
    std::vector<std::vector<at::Tensor>> inputs{in.chunk(world_size_)};
    work = pg->reduce_scatter(outputs, inputs);
  } else {
    work = reduce_scatter_flat(*pg, target, in);
  }
  return track(std::make_shared<PendingOp>(what, Works{std::move(work)}, std::vector<at::Tensor>{in, target, output},
                                           epilogue(direct ? at::Tensor() : output, target, streams, what),
                                           streams.side_stream));
}

std::shared_ptr<PendingOp> Engine::all_gather(const at::Tensor& output, const at::Tensor& input,
                                              const std::string& name, Primitive primitive, Streams streams) {
  const std::string what = describe("all_gather", name);
  check_pair(input, output, world_size_, what);
  check_primitive(
      primitive,
      {Primitive::kAllGatherList, Primitive::kAllGatherTensor, Primitive::kAllGatherP2P, Primitive::kAllGatherNodes,
       Primitive::kAllGatherShm},
      what);
  const auto pg = begin(what, output, streams);
  at::Tensor out = output;
  at::Tensor source = input;
  if (input.scalar_type() != output.scalar_type()) {
    source = at::empty({input.numel()}, output.options());
    copy_in(source, input, streams, what);
  }
  if (primitive == Primitive::kAllGatherP2P) {
    return all_gather_p2p(*pg, out, source, input, what);
  }
  if (primitive == Primitive::kAllGatherNodes) {
    return all_gather_nodes(pg, out, source, input, what);
  }
  if (primitive == Primitive::kAllGatherShm) {
    auto work = channel(what, output).all_gather(out, source, what);
    return track(std::make_shared<PendingOp>(what, Works{std::move(work)},
                                             std::vector<at::Tensor>{input, source, out}, nullptr));
  }
  c10::intrusive_ptr<c10d::Work> work;
  if (primitive == Primitive::kAllGatherList) {
    std::vector<std::vector<at::Tensor>> outputs{out.chunk(world_size_)};
    std::vector<at::Tensor> inputs{source};
    work = pg->allgather(outputs, inputs);
  } else {
    work = all_gather_flat(*pg, out, source);
  }
  return track(std::make_shared<PendingOp>(what, Works{std::move(work)}, std::vector<at::Tensor>{input, source, out},
                                           epilogue(at::Tensor(), out, streams, what), streams.side_stream));
}

std::shared_ptr<PendingOp> Engine::all_reduce(const at::Tensor& tensor, const std::string& op,
                                              const std::string& name, Streams streams, bool shared_memory) {
  const std::string what = describe("all_reduce", name);
  check_flat(tensor, "the tensor", what);
  c10d::AllreduceOptions opts;
  opts.reduceOp = reduce_op(op, what);
  const auto pg = begin(what, tensor, streams);
  if (shared_memory) {
    auto work = channel(what, tensor).all_reduce(tensor, op, what);
    return track(std::make_shared<PendingOp>(what, Works{std::move(work)}, std::vector<at::Tensor>{tensor}, nullptr));
  }
  std::vector<at::Tensor> tensors{tensor};
  auto work = pg->allreduce(tensors, opts);
  return track(std::make_shared<PendingOp>(what, Works{std::move(work)}, std::vector<at::Tensor>{tensor},
                                           epilogue(at::Tensor(), tensor, streams, what), streams.side_stream));
}

uint32_t Engine::next_tag(const std::string& what, const at::Tensor& t) { return tag_at(next_tags(what, t, 1), 0); }

uint32_t Engine::next_tags(const std::string& what, const at::Tensor& t, uint32_t count) {
  if (t.is_cuda()) {
    throw std::invalid_argument(what + ": the point-to-point primitives are for CPU tensors (gloo)");
  }
  return next_tag_->fetch_add(count);
}

uint32_t Engine::tag_at(uint32_t first, uint32_t offset) const { return kTagBase + (first + offset) % kTagSpan; }

// Every rank sends chunk j of `input` to rank j and receives its own chunk from each peer into a
// scratch row; the epilogue sums those rows into its own chunk (input is scratch) and casts that into
// `output`. Each byte crosses one link once: half the traffic of an all-reduce.
// Both point-to-point primitives post every receive before any send: gloo tells a sender that its
// receiver is ready in-band, on the pair's socket, so a receive posted after a send to the same peer
// waits behind that send's bytes and the pair's two directions take turns (half the rate on a slow link).
std::shared_ptr<PendingOp> Engine::reduce_scatter_p2p(c10d::ProcessGroup& pg, const at::Tensor& output,
                                                      at::Tensor& input, const std::string& what) {
  const int64_t n = output.numel();
  const int tag = static_cast<int>(next_tag(what, input));
  at::Tensor received = at::empty({world_size_ - 1, n}, input.options());
  Works works;
  for (int peer = 0, row = 0; peer < world_size_; ++peer) {  // receives first: see the note above
    if (peer != rank_) {
      std::vector<at::Tensor> recv{received.select(0, row++)};
      works.push_back(pg.recv(recv, peer, tag));
    }
  }
  for (int peer = 0; peer < world_size_; ++peer) {
    if (peer != rank_) {
      std::vector<at::Tensor> send{part_of(input, peer, n)};
      works.push_back(pg.send(send, peer, tag));
    }
  }
  return track(std::make_shared<PendingOp>(what, std::move(works), std::vector<at::Tensor>{input, received, output},
                                           sum_into(output, part_of(input, rank_, n), received)));
}

// Every rank sends its (already cast) shard to each peer and receives theirs straight into `output`.
std::shared_ptr<PendingOp> Engine::all_gather_p2p(c10d::ProcessGroup& pg, at::Tensor& output, at::Tensor& source,
                                                  const at::Tensor& input, const std::string& what) {
  const int64_t n = source.numel();
  const int tag = static_cast<int>(next_tag(what, output));
  part_of(output, rank_, n).copy_(source);
  Works works;
  for (int peer = 0; peer < world_size_; ++peer) {  // receives first: see the note above reduce_scatter_p2p
    if (peer != rank_) {
      std::vector<at::Tensor> recv{part_of(output, peer, n)};
      works.push_back(pg.recv(recv, peer, tag));
    }
  }
  for (int peer = 0; peer < world_size_; ++peer) {
    if (peer != rank_) {
      std::vector<at::Tensor> send{source};
      works.push_back(pg.send(send, peer, tag));
    }
  }
  return track(std::make_shared<PendingOp>(what, std::move(works), std::vector<at::Tensor>{input, source, output},
                                           nullptr));
}

void Engine::set_nodes(const std::vector<std::vector<int64_t>>& rows) {
  const std::string what = "zero_kernels comm: set_nodes on rank " + std::to_string(rank_);
  TORCH_CHECK(rows_.empty(), what, ": the nodes are set already");
  TORCH_CHECK(!rows.empty() && !rows.front().empty(), what, ": no nodes given");
  std::vector<int> seen(world_size_, 0);
  for (size_t node = 0; node < rows.size(); ++node) {
    TORCH_CHECK(rows[node].size() == rows.front().size(), what, ": nodes of unequal size");
    for (size_t local = 0; local < rows[node].size(); ++local) {
      const int64_t r = rows[node][local];
      TORCH_CHECK(r >= 0 && r < world_size_ && seen[r]++ == 0, what, ": rank ", r, " out of range or repeated");
      if (r == rank_) {
        node_ = static_cast<int>(node);
        local_ = static_cast<int>(local);
      }
    }
  }
  TORCH_CHECK(rows.size() * rows.front().size() == static_cast<size_t>(world_size_), what, ": ",
              rows.size() * rows.front().size(), " ranks given for a group of ", world_size_);
  rows_ = rows;
  relay_ = std::make_unique<OrderedWorker>();
}

std::future<Works> Engine::relay(std::function<Works()> phase) {
  auto job = std::make_shared<std::packaged_task<Works()>>(std::move(phase));
  std::future<Works> done = job->get_future();
  relay_->post([job] { (*job)(); });  // a failure is stored in the future, raised by the operation's wait()
  return done;
}

namespace {

// `src` into `dst` (contiguous CPU tensors of one dtype and size) with memcpy: on the relay thread, whose OpenMP
// thread count is not the caller's, an ATen copy of a large piece would start a team of its own beside the ranks.
void copy_bytes(const at::Tensor& dst, const at::Tensor& src) {
  std::memcpy(dst.data_ptr(), src.data_ptr(), static_cast<size_t>(src.numel()) * src.element_size());
}

// The defined ones of `tensors` (what an operation holds).
std::vector<at::Tensor> defined_of(std::initializer_list<at::Tensor> tensors) {
  std::vector<at::Tensor> out;
  for (const auto& t : tensors) {
    if (t.defined()) {
      out.push_back(t);
    }
  }
  return out;
}

// Waits for the first phase's works on the relay thread and lets go of them there (their tensors are
// held by the operation until it is finished, so no last reference is dropped here).
void finish_first_phase(Works& works) {
  for (const auto& work : works) {
    work->wait();
    wait_for_backend_release(work);
  }
  works.clear();
}

}  // namespace

// Two levels along the nodes (M nodes of L ranks; chunk r of `input` belongs to rank r). First, within
// the node, every rank sends each node-mate the M chunks of that mate's column (the ranks with its local
// rank, one per node) and sums what it receives into its own column's chunks; then, across the nodes,
// it sends each of those node sums to its owner, who sums them into its chunk. A node's link carries
// (M-1)/M of the buffer each way, against L(N-L)/N for the pairwise exchange (half against all of it
// at 2 x 2). The relay thread issues the second phase once the first is done. Where the node's
// shared-memory channel is open (within_node), the first level is its reduce-scatter of the columns laid side
// by side instead, issued by the relay thread too.
std::shared_ptr<PendingOp> Engine::reduce_scatter_nodes(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                                        const at::Tensor& output, at::Tensor& input,
                                                        const std::string& what) {
  auto sums = std::make_shared<NodeSums>(start_node_sums(*pg, input, output.numel(), what));
  std::vector<at::Tensor> keep = defined_of({input, sums->across, output, sums->within, sums->columns});
  at::Tensor mine = sums->sums[node_];
  at::Tensor across = sums->across;
  // on the relay thread, where every operation's channel part goes from, in issue order on every rank alike
  auto later = relay([this, pg, sums, what]() { return send_node_sums_after(*pg, *sums, what); });
  return track(std::make_shared<PendingOp>(what, Works{}, std::move(keep), sum_into(output, mine, across),
                                           std::nullopt, std::move(later)));
}

// The first phase of reduce_scatter_nodes on the caller's thread (chunks of `n` elements): the sockets' exchange
// within the node is posted; through the node's channel nothing is done yet.
Engine::NodeSums Engine::start_node_sums(c10d::ProcessGroup& pg, const at::Tensor& input, int64_t n,
                                         const std::string& what) {
  const int nodes = static_cast<int>(rows_.size());
  const int locals = static_cast<int>(rows_.front().size());
  NodeSums r;
  const uint32_t first = next_tags(what, input, nodes + 1);
  r.tag = static_cast<int>(tag_at(first, nodes));
  r.input = input;
  r.across = at::empty({nodes - 1, n}, input.options());
  if (within_node(input) && HostChannel::sums(input.scalar_type())) {
    r.columns = at::empty({locals, nodes, n}, input.options());
    for (int node = 0; node < nodes; ++node) {
      r.sums.push_back(r.columns.select(0, local_).select(0, node));
    }
  } else {
    r.within = at::empty({locals - 1, nodes, n}, input.options());
    r.works = send_columns(pg, input, r.within, first);
    for (int node = 0; node < nodes; ++node) {
      r.sums.push_back(part_of(input, rows_[node][local_], n));
    }
  }
  return r;
}

// The second phase of reduce_scatter_nodes, on the relay thread: the node's sums of this rank's column (through the
// channel, or from what the node-mates sent), then sent across; returns the works of that exchange. Lets go of
// the tensors (the operation holds them: no last reference is dropped on this thread).
Works Engine::send_node_sums_after(c10d::ProcessGroup& pg, NodeSums& r, const std::string& what) {
  try {
    if (r.columns.defined()) {
      lay_columns(r.columns, r.input);
      r.works.push_back(channel_->reduce_scatter(r.columns.view({-1}), what));
      finish_first_phase(r.works);
    } else {
      finish_first_phase(r.works);
      for (size_t node = 0; node < r.sums.size(); ++node) {
        add_rows(r.sums[node], r.within.select(1, static_cast<int64_t>(node)));
      }
    }
    Works next = send_node_sums(pg, r.sums, r.across, r.tag);
    r = NodeSums{};
    return next;
  } catch (...) {
    r = NodeSums{};
    throw;
  }
}

// `tensor` summed over ranks in two levels, in place: reduce_scatter_nodes into this rank's chunk, then
// all_gather_nodes of the chunks, both on the relay thread after the first level within the node (which waits
// there for the sums from across: later operations' second phases wait behind it). A node's link carries
// 2(M-1)/M of the tensor each way, against 2 x 3/4 for gloo's ring at 2 x 2 (one of its links leaves each node).
// A tensor whose size the ranks do not divide is summed in a padded copy, copied back when the operation finishes.
std::shared_ptr<PendingOp> Engine::all_reduce_nodes(const at::Tensor& tensor, const std::string& name) {
  const std::string what = describe("all_reduce", name);
  check_flat(tensor, "the tensor", what);
  TORCH_CHECK(!rows_.empty(), what, ": all_reduce_nodes needs the nodes (set_nodes)");
  const auto pg = begin(what, tensor, Streams{});
  const int64_t n = (tensor.numel() + world_size_ - 1) / world_size_;
  const bool padded = n * world_size_ != tensor.numel();
  at::Tensor full = padded ? at::zeros({n * world_size_}, tensor.options()) : tensor;
  if (padded) {
    full.narrow(0, 0, tensor.numel()).copy_(tensor);
  }
  auto sums = std::make_shared<NodeSums>(start_node_sums(*pg, full, n, what));
  const uint32_t first = next_tags(what, full, static_cast<uint32_t>(rows_.size()) + 1);  // the gather's
  const bool shm = within_node(full);
  std::vector<at::Tensor> keep = defined_of({tensor, full, sums->across, sums->within, sums->columns});
  at::Tensor mine = sums->sums[node_];
  at::Tensor across = sums->across;
  auto second = [this, pg, sums, mine, across, full, n, first, shm, what]() mutable {
    auto drop = [&] { mine = across = full = at::Tensor(); };
    try {
      Works sent = send_node_sums_after(*pg, *sums, what);
      finish_first_phase(sent);
      add_rows(mine, across);
      if (mine.data_ptr() != part_of(full, rank_, n).data_ptr()) {
        copy_bytes(part_of(full, rank_, n), mine);
      }
      Works gathered = exchange_across(*pg, full, part_of(full, rank_, n), n, static_cast<int>(tag_at(first, 0)));
      finish_first_phase(gathered);
      Works next = gather_within(*pg, full, n, first, shm, what);
      drop();
      return next;
    } catch (...) {
      drop();
      throw;
    }
  };
  auto later = relay(std::move(second));
  std::function<void()> back;
  if (padded) {
    back = [tensor, full]() { tensor.copy_(full.narrow(0, 0, tensor.numel())); };
  }
  return track(std::make_shared<PendingOp>(what, Works{}, std::move(keep), std::move(back), std::nullopt,
                                           std::move(later)));
}

// The first level of reduce_scatter_nodes over the sockets: each node-mate gets the chunks of its column from this
// rank, and sends this rank's into `within` (by mate, then node).
Works Engine::send_columns(c10d::ProcessGroup& pg, const at::Tensor& input, const at::Tensor& within,
                           uint32_t first) {
  const int64_t n = within.size(2);
  const int nodes = static_cast<int>(rows_.size());
  const int locals = static_cast<int>(rows_.front().size());
  Works works;
  for (int local = 0, row = 0; local < locals; ++local) {  // receives first: see reduce_scatter_p2p
    if (local != local_) {
      for (int node = 0; node < nodes; ++node) {
        std::vector<at::Tensor> recv{within.select(0, row).select(0, node)};
        works.push_back(pg.recv(recv, static_cast<int>(rows_[node_][local]), static_cast<int>(tag_at(first, node))));
      }
      ++row;
    }
  }
  for (int local = 0; local < locals; ++local) {
    if (local != local_) {
      for (int node = 0; node < nodes; ++node) {
        std::vector<at::Tensor> send{part_of(input, rows_[node][local], n)};
        works.push_back(pg.send(send, static_cast<int>(rows_[node_][local]), static_cast<int>(tag_at(first, node))));
      }
    }
  }
  return works;
}

// Every node-mate's column side by side in `columns` (by local rank, then node), copied from `input` (by rank).
void Engine::lay_columns(const at::Tensor& columns, const at::Tensor& input) const {
  const int64_t n = columns.size(2);
  for (int64_t local = 0; local < columns.size(0); ++local) {
    for (size_t node = 0; node < rows_.size(); ++node) {
      const at::Tensor chunk = columns.select(0, local).select(0, static_cast<int64_t>(node));
      copy_bytes(chunk, part_of(input, rows_[node][local], n));
    }
  }
}

// The second level of reduce_scatter_nodes: this rank's node sums (`sums`, one per node) to the ranks of its
// column on the other nodes, theirs for this rank into the rows of `across`.
Works Engine::send_node_sums(c10d::ProcessGroup& pg, const std::vector<at::Tensor>& sums, const at::Tensor& across,
                             int tag) {
  const int nodes = static_cast<int>(rows_.size());
  Works works;
  for (int node = 0, row = 0; node < nodes; ++node) {
    if (node != node_) {
      std::vector<at::Tensor> recv{across.select(0, row++)};
      works.push_back(pg.recv(recv, static_cast<int>(rows_[node][local_]), tag));
    }
  }
  for (int node = 0; node < nodes; ++node) {
    if (node != node_) {
      std::vector<at::Tensor> send{sums[node]};
      works.push_back(pg.send(send, static_cast<int>(rows_[node][local_]), tag));
    }
  }
  return works;
}

// Two levels along the nodes: first every rank exchanges its shard with the ranks of its column on the
// other nodes, then it sends what its column holds (M chunks) to each node-mate and receives theirs (through
// the node's channel where it is open: an all-gather of the columns, copied into place).
std::shared_ptr<PendingOp> Engine::all_gather_nodes(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                                    at::Tensor& output, at::Tensor& source, const at::Tensor& input,
                                                    const std::string& what) {
  const int64_t n = source.numel();
  const int nodes = static_cast<int>(rows_.size());
  const uint32_t first = next_tags(what, output, nodes + 1);
  part_of(output, rank_, n).copy_(source);
  Works works = exchange_across(*pg, output, source, n, static_cast<int>(tag_at(first, 0)));
  const bool shm = within_node(output);
  auto second = [this, pg, works = std::move(works), output, n, first, shm, what]() mutable {
    auto drop = [&] {  // the operation holds the tensors: no last reference is dropped on this thread
      works.clear();
      output = at::Tensor();
    };
    try {
      finish_first_phase(works);
      Works next = gather_within(*pg, output, n, first, shm, what);
      drop();
      return next;
    } catch (...) {
      drop();
      throw;
    }
  };
  auto later = relay(std::move(second));
  return track(std::make_shared<PendingOp>(what, Works{}, std::vector<at::Tensor>{input, source, output}, nullptr,
                                           std::nullopt, std::move(later)));
}

// The first level of all_gather_nodes: `source` (this rank's chunk, `n` elements) to the ranks of its column on the
// other nodes, theirs into place in `output`.
Works Engine::exchange_across(c10d::ProcessGroup& pg, const at::Tensor& output, const at::Tensor& source, int64_t n,
                              int tag) {
  const int nodes = static_cast<int>(rows_.size());
  Works works;
  for (int node = 0; node < nodes; ++node) {  // receives first: see reduce_scatter_p2p
    if (node != node_) {
      std::vector<at::Tensor> recv{part_of(output, rows_[node][local_], n)};
      works.push_back(pg.recv(recv, static_cast<int>(rows_[node][local_]), tag));
    }
  }
  for (int node = 0; node < nodes; ++node) {
    if (node != node_) {
      std::vector<at::Tensor> send{source};
      works.push_back(pg.send(send, static_cast<int>(rows_[node][local_]), tag));
    }
  }
  return works;
}

// The second level of all_gather_nodes, on the relay thread: this rank's column to its node-mates and theirs into
// place in `output`, through the node's channel (`shm`, done on return) or over the sockets (their works returned).
Works Engine::gather_within(c10d::ProcessGroup& pg, const at::Tensor& output, int64_t n, uint32_t first, bool shm,
                            const std::string& what) {
  if (shm) {
    gather_columns_shm(output, n, what);
    return {};
  }
  return gather_columns(pg, output, n, first);
}

// The second level of all_gather_nodes over the sockets: this rank's column (its chunk of every node, `n` elements
// each) to every node-mate, and theirs into place in `output`.
Works Engine::gather_columns(c10d::ProcessGroup& pg, const at::Tensor& output, int64_t n, uint32_t first) {
  const int nodes = static_cast<int>(rows_.size());
  const int locals = static_cast<int>(rows_.front().size());
  Works works;
  for (int local = 0; local < locals; ++local) {  // receives first: see reduce_scatter_p2p
    if (local != local_) {
      for (int node = 0; node < nodes; ++node) {
        std::vector<at::Tensor> recv{part_of(output, rows_[node][local], n)};
        const int tag = static_cast<int>(tag_at(first, 1 + node));
        works.push_back(pg.recv(recv, static_cast<int>(rows_[node_][local]), tag));
      }
    }
  }
  for (int local = 0; local < locals; ++local) {
    if (local != local_) {
      for (int node = 0; node < nodes; ++node) {
        std::vector<at::Tensor> send{part_of(output, rows_[node][local_], n)};
        const int tag = static_cast<int>(tag_at(first, 1 + node));
        works.push_back(pg.send(send, static_cast<int>(rows_[node_][local]), tag));
      }
    }
  }
  return works;
}

// The second level of all_gather_nodes through the node's channel, on the relay thread: this rank's column
// (its chunk of every node, `n` elements each) gathered from every node-mate, and their columns copied into place.
void Engine::gather_columns_shm(const at::Tensor& output, int64_t n, const std::string& what) {
  const int nodes = static_cast<int>(rows_.size());
  const int locals = static_cast<int>(rows_.front().size());
  at::Tensor mine = at::empty({nodes, n}, output.options());
  at::Tensor columns = at::empty({locals, nodes, n}, output.options());
  for (int node = 0; node < nodes; ++node) {
    copy_bytes(mine.select(0, node), part_of(output, rows_[node][local_], n));
  }
  Works within{channel_->all_gather(columns.view({-1}), mine.view({-1}), what)};
  finish_first_phase(within);
  for (int local = 0; local < locals; ++local) {
    if (local != local_) {
      for (int node = 0; node < nodes; ++node) {
        copy_bytes(part_of(output, rows_[node][local], n), columns.select(0, local).select(0, node));
      }
    }
  }
}

bool Engine::within_node(const at::Tensor& t) const { return node_channel_ && !t.is_cuda(); }

void Engine::synchronize() {
  std::deque<std::shared_ptr<PendingOp>> pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending.swap(in_flight_);
  }
  std::exception_ptr first;
  for (auto& op : pending) {
    try {
      op->wait();
    } catch (const std::exception&) {
      if (!first) {
        first = std::current_exception();
      }
    }
  }
  if (first) {
    std::rethrow_exception(first);
  }
}

void Engine::open_host_channel(const std::string& name, bool create, int64_t chunk_bytes, int64_t timeout_ms) {
  TORCH_CHECK(!channel_, "zero_kernels comm: the shared-memory channel is open already");
  const bool node = !rows_.empty();
  channel_ = std::make_unique<HostChannel>(name, create, node ? local_ : rank_,
                                           node ? static_cast<int>(rows_.front().size()) : world_size_, chunk_bytes,
                                           std::chrono::milliseconds(timeout_ms),
                                           node ? rows_[node_] : std::vector<int64_t>{});  // errors name group ranks
}

void Engine::use_node_channel() {
  TORCH_CHECK(channel_ && !rows_.empty(), "zero_kernels comm: use_node_channel needs set_nodes and an open channel");
  node_channel_ = true;
}

bool Engine::host_channel_peers_visible() const { return channel_ && channel_->peers_visible(); }

void Engine::close_host_channel() {
  node_channel_ = false;
  channel_.reset();
}

HostChannel& Engine::channel(const std::string& what, const at::Tensor& t) {
  if (!channel_ || t.is_cuda() || !rows_.empty()) {
    throw std::invalid_argument(what + ": the shared-memory primitives need CPU tensors and every rank of the group "
                                       "on one host (no channel is open, or it is the node's)");
  }
  return *channel_;
}

int64_t Engine::in_flight() {
  std::lock_guard<std::mutex> lock(mu_);
  reap_locked();
  return static_cast<int64_t>(in_flight_.size());
}

}  // namespace zero_kernels::comm
