// The comm engine: ordered, asynchronous c10d collectives on one process group, with every
// buffer held until its collective has finished.
//
// Each operation returns a PendingOp. On CPU (gloo) the collective runs on the backend's own
// threads and PendingOp::wait() blocks until it is done; on CUDA (NCCL) wait() only makes the
// streams wait (events), never the host. Casts into and out of the communication buffers run on
// a side stream given by the caller, ordered by events (side_stream.h).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "comm/host_channel.h"
#include "comm/ordered_worker.h"

namespace zero_kernels::comm {

// The c10d call that carries out an operation; chosen per backend and size by the caller.
enum class Primitive {
  kAllReduce,            // all_reduce: in place
  kAllReduceSlice,       // reduce_scatter as all_reduce of the whole bucket, then copy out this rank's slice
  kReduceScatterList,    // reduce_scatter with a list of per-rank input views
  kReduceScatterTensor,  // reduce_scatter of one flat tensor (_reduce_scatter_base)
  kAllGatherList,        // all_gather into a list of per-rank output views
  kAllGatherTensor,      // all_gather into one flat tensor (_allgather_base)
  kReduceScatterP2P,     // reduce_scatter as a send/recv of each chunk to its owner, summed there (CPU)
  kAllGatherP2P,         // all_gather as a send/recv of this rank's shard to every peer (CPU)
  kReduceScatterNodes,   // reduce_scatter in two levels along the nodes: within each node, then across (CPU)
  kAllGatherNodes,       // all_gather in two levels along the nodes: across them, then within each (CPU)
  kReduceScatterShm,     // reduce_scatter through the shared-memory channel of ranks on one host (CPU)
  kAllGatherShm,         // all_gather through the shared-memory channel of ranks on one host (CPU)
};

using Works = std::vector<c10::intrusive_ptr<c10d::Work>>;

const char* primitive_name(Primitive primitive);

// Streams of a CUDA operation: `compute` and `side` as integers (cudaStream_t), zero on CPU, and
// `side_stream`, the side stream as torch knows it. The caller issues with the side stream current,
// so the process group's stream follows it; every operation first makes the side stream wait for
// `compute` (Engine::begin), so the collective and any cast follow the caller's kernels. Whoever
// finishes an operation (PendingOp::wait, Engine::synchronize, the destructor, reaping) does it
// with `side_stream` current, whatever stream is current on that thread: the work's wait then
// orders the side stream after the collective, and the epilogue's cast reads the buffer only once
// the collective wrote it; `compute` waits for the side stream at the end.
struct Streams {
  intptr_t compute = 0;
  intptr_t side = 0;
  std::optional<c10::Stream> side_stream;  // none on CPU
};

// One in-flight operation: one c10d work (a collective) or several (point-to-point). Holds the works
// and every tensor they touch until all have finished.
class PendingOp {
 public:
  // `finish_on`: the stream made current while the operation is finished (its side stream; none on CPU).
  // `later`: works of a second phase, issued by the engine's relay thread once the first is done (the
  // two-level primitives); finishing waits for them too, before the epilogue.
  PendingOp(std::string what, Works works, std::vector<at::Tensor> keep_alive, std::function<void()> epilogue,
            std::optional<c10::Stream> finish_on = std::nullopt, std::future<Works> later = {});
  ~PendingOp();
  PendingOp(const PendingOp&) = delete;
  PendingOp& operator=(const PendingOp&) = delete;

  // Completes the operation and runs its epilogue, with the side stream current (finish_on);
  // idempotent. A failure, now or earlier, is raised as std::runtime_error naming the operation,
  // bucket and rank.
  void wait();
  // True once the collective itself has finished (the epilogue may still be due in wait()).
  bool is_completed();
  // Finishes the operation without blocking when the collective is done; true when finished.
  bool try_finish();
  bool failed();
  const std::string& what() const { return what_; }

  // Number of PendingOp objects alive in this process (a leak check for tests).
  static int64_t live();

  // The operation issued just before this one on its engine, still unfinished: this one is finished only after
  // it, so that the epilogues write their outputs in issue order (an operation whose handle an interrupt lost,
  // finished late, never overwrites what a later one wrote). Set by Engine::track.
  void set_before(std::shared_ptr<PendingOp> before);
  bool finished();

 private:
  void finish_locked();
  bool all_completed_locked();

  std::mutex mu_;
  const std::string what_;
  Works works_;
  std::vector<at::Tensor> keep_alive_;
  std::future<Works> later_;
  std::function<void()> epilogue_;
  const std::optional<c10::Stream> finish_on_;
  const bool on_host_;  // a CPU collective: wait() blocks until the backend has finished with it
  bool done_ = false;
  std::exception_ptr error_;
  std::shared_ptr<PendingOp> before_;  // set_before; dropped once finished
};

// Holds its process group weakly: destroy_process_group() really destroys it (joining gloo's
// threads) even while an optimizer is still alive; an operation after that raises.
class Engine {
 public:
  explicit Engine(const c10::intrusive_ptr<c10d::ProcessGroup>& group);
  // Waits for every operation still in flight (their buffers must outlive the collectives), each
  // finished on its side stream as in PendingOp::wait, whatever stream is current.
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Sum of `input` (world_size * output.numel() elements) over ranks; this rank's slice lands in
  // `output`, cast to output's dtype. `input` is scratch afterwards.
  std::shared_ptr<PendingOp> reduce_scatter(const at::Tensor& output, const at::Tensor& input, const std::string& name,
                                            Primitive primitive, Streams streams);
  // Every rank's `input` (cast to output's dtype) concatenated in rank order into `output`.
  std::shared_ptr<PendingOp> all_gather(const at::Tensor& output, const at::Tensor& input, const std::string& name,
                                        Primitive primitive, Streams streams);
  // `tensor` reduced in place with op "sum", "max" or "min"; through the shared-memory channel where
  // `shared_memory` (CPU tensors of its dtypes, the channel open).
  std::shared_ptr<PendingOp> all_reduce(const at::Tensor& tensor, const std::string& op, const std::string& name,
                                        Streams streams, bool shared_memory = false);
  // `tensor` (CPU, a floating-point dtype) summed over ranks in place, in two levels along the nodes (set_nodes):
  // a reduce-scatter within and across them, then an all-gather across and within them.
  std::shared_ptr<PendingOp> all_reduce_nodes(const at::Tensor& tensor, const std::string& name);
  // Waits for every operation issued so far (each on its side stream, as PendingOp::wait); raises
  // the first failure among them.
  void synchronize();
  // The global ranks of each node, by local rank (nodes of equal size, every rank once): the grid the
  // *Nodes primitives exchange along. Call once, before they are used; identical on every rank.
  void set_nodes(const std::vector<std::vector<int64_t>>& rows);
  // Operations the engine still holds (finished ones are dropped first).
  int64_t in_flight();
  // The shared-memory channel of the *Shm primitives (host_channel.h): rank 0 creates the segment `name`,
  // the others open it once it exists; `timeout_ms` bounds every wait for a peer. Throws when it cannot.
  // After set_nodes it is the channel of this rank's node instead (its local rank 0 creates it): the *Nodes
  // primitives run their level within the node through it.
  void open_host_channel(const std::string& name, bool create, int64_t chunk_bytes, int64_t timeout_ms);
  // After set_nodes: the *Nodes primitives use the node's open channel from now on (once every rank opened its
  // node's: the exchanges that decide it do not).
  void use_node_channel();
  // HostChannel::peers_visible of the open channel; false without one.
  bool host_channel_peers_visible() const;
  // Drops the channel (when the ranks did not all open it); the *Shm primitives then raise.
  void close_host_channel();

  // Operations held at most: issuing more first waits for the oldest. A point-to-point operation
  // cannot be polled (gloo's send/recv works report completion only once waited), so this bounds
  // what unwaited ones hold.
  static constexpr int64_t kMaxHeld = 16;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  std::string backend() const;

 private:
  std::string describe(const char* op, const std::string& name) const;
  c10::intrusive_ptr<c10d::ProcessGroup> group(const std::string& what) const;
  // The start of every operation: its process group, and on CUDA the side stream ordered after the
  // compute stream (order_after_compute in engine.cpp), before anything is allocated or issued.
  c10::intrusive_ptr<c10d::ProcessGroup> begin(const std::string& what, const at::Tensor& t, Streams streams);
  std::shared_ptr<PendingOp> track(std::shared_ptr<PendingOp> op);
  HostChannel& channel(const std::string& what, const at::Tensor& t);
  uint32_t next_tag(const std::string& what, const at::Tensor& t);
  std::shared_ptr<PendingOp> reduce_scatter_p2p(c10d::ProcessGroup& pg, const at::Tensor& output, at::Tensor& input,
                                                const std::string& what);
  std::shared_ptr<PendingOp> all_gather_p2p(c10d::ProcessGroup& pg, at::Tensor& output, at::Tensor& source,
                                            const at::Tensor& input, const std::string& what);
  std::shared_ptr<PendingOp> reduce_scatter_nodes(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                                  const at::Tensor& output, at::Tensor& input, const std::string& what);
  std::shared_ptr<PendingOp> all_gather_nodes(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, at::Tensor& output,
                                              at::Tensor& source, const at::Tensor& input, const std::string& what);
  // What reduce_scatter_nodes carries from its first phase to its second.
  struct NodeSums {
    Works works;                   // the first level's sends and receives (the sockets)
    at::Tensor input;              // the buffer reduced (scratch)
    at::Tensor within;             // the sockets: what the node-mates send, by mate and node
    at::Tensor columns;            // the node's channel: every column's chunks side by side, by local rank and node
    at::Tensor across;             // the other nodes' sums of this rank's chunk
    std::vector<at::Tensor> sums;  // this rank's column: the chunk it sums for each node
    int tag = 0;                   // of the exchange across the nodes
  };
  NodeSums start_node_sums(c10d::ProcessGroup& pg, const at::Tensor& input, int64_t n, const std::string& what);
  Works send_node_sums_after(c10d::ProcessGroup& pg, NodeSums& sums, const std::string& what);
  Works exchange_across(c10d::ProcessGroup& pg, const at::Tensor& output, const at::Tensor& source, int64_t n,
                        int tag);
  Works send_columns(c10d::ProcessGroup& pg, const at::Tensor& input, const at::Tensor& within, uint32_t first);
  Works send_node_sums(c10d::ProcessGroup& pg, const std::vector<at::Tensor>& sums, const at::Tensor& across, int tag);
  void lay_columns(const at::Tensor& columns, const at::Tensor& input) const;
  Works gather_within(c10d::ProcessGroup& pg, const at::Tensor& output, int64_t n, uint32_t first, bool shm,
                      const std::string& what);
  Works gather_columns(c10d::ProcessGroup& pg, const at::Tensor& output, int64_t n, uint32_t first);
  void gather_columns_shm(const at::Tensor& output, int64_t n, const std::string& what);
  // Whether a two-level operation on `t` runs its level within the node through the node's channel.
  bool within_node(const at::Tensor& t) const;
  // Reserves `count` consecutive tags for one operation (the same on every rank): the first's number,
  // made a tag by tag_at(first, 0..count-1).
  uint32_t next_tags(const std::string& what, const at::Tensor& t, uint32_t count);
  uint32_t tag_at(uint32_t first, uint32_t offset) const;
  // Runs `phase` on the relay thread, after every phase handed over before it.
  std::future<Works> relay(std::function<Works()> phase);
  void reap_locked();

  c10::weak_intrusive_ptr<c10d::ProcessGroup> group_;
  int rank_;
  int world_size_;
  std::string backend_;
  std::mutex mu_;
  std::deque<std::shared_ptr<PendingOp>> in_flight_;
  // The point-to-point tags of this engine's process group, shared with every other engine on it: the
  // operations of two engines on one group (two optimizers) never share a tag, so their sends and receives
  // match whichever thread posts them (the relay thread posts a second level whenever the first is done).
  std::shared_ptr<std::atomic<uint32_t>> next_tag_;
  std::vector<std::vector<int64_t>> rows_;  // set_nodes: the ranks of each node, by local rank
  int node_ = 0;
  int local_ = 0;
  // The relay thread waits for each two-level operation's first phase and issues its second, in issue
  // order, so the caller never blocks between them (gloo's point-to-point works cannot be polled).
  std::unique_ptr<OrderedWorker> relay_;
  std::unique_ptr<HostChannel> channel_;  // open_host_channel; destroyed after the operations are waited for
  bool node_channel_ = false;             // use_node_channel
};

}  // namespace zero_kernels::comm
