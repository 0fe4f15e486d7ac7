// The shared-memory channel: the ranks of one process group that live on one host exchange the data
// of reduce-scatter and all-gather through one shared-memory segment instead of gloo's sockets. A
// socket on loopback moves every byte through the kernel twice and costs a system call per message;
// here each rank copies what its peers need into its own slot of the segment once, and each peer
// reads it from there (`python -m benchmarks comm` measures both).
//
// Rank 0 creates the segment and the others open it (all of them before rank 0 unlinks its name, so
// it never outlives the processes, even when they are killed). Each rank has a slot of two halves,
// each with a region per destination rank; an operation runs in chunks of `chunk_bytes` per
// destination through the halves in turn. Two counters per rank order the chunks: `written` (this
// rank filled its half for that chunk) and `consumed` (it read every peer's region of that half).
// Chunks are numbered across operations: every rank runs the group's operations in the same order. Each
// half carries a tag of the operation it belongs to (kind, dtype, sizes), which every peer compares with
// its own before it reads: ranks that issued different operations raise an error naming both, where
// gloo's sockets would have raised on a size mismatch or hung, instead of mixing their data.
// A rank waits for its peers by spinning briefly, then on a futex, checking every 100 ms that each
// peer process is still alive (a peer that died raises an error naming it, as gloo's closed socket
// does) and the process group's timeout.
//
// Operations run on the channel's worker thread, in issue order; each returns a c10d work that
// completes when this rank's part is done. Plain loops copy and add (no ATen call on that thread,
// whose intra-op thread count is not the caller's). After one operation failed, every later one
// fails with the same error: the chunk counts of the ranks no longer agree.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/ordered_worker.h"

namespace zero_kernels::comm {

struct SegmentHeader;
struct RankEntry;
struct ChunkTag;

// What a chunk belongs to, compared across ranks (ChunkTag in host_channel.cpp).
namespace OpKind {
constexpr int32_t kReduceScatter = 0;
constexpr int32_t kAllGather = 1;
constexpr int32_t kAllReduceSum = 2;
constexpr int32_t kAllReduceMax = 3;
constexpr int32_t kAllReduceMin = 4;
constexpr int32_t kAllReduceGather = 5;
}  // namespace OpKind

class HostChannel {
 public:
  // Rank 0 creates the segment `name` (`create`), the others open it; every rank writes its process's
  // identity into its entry. `chunk_bytes`: one destination's region of one half (a multiple of 64).
  // Throws std::runtime_error naming the segment and what failed (no shared memory, too little room).
  // `ranks`: each slot's rank in the process group, which the errors name (empty: the slot's own index; across
  // nodes the channel is the node's and its slots are local ranks).
  HostChannel(const std::string& name, bool create, int rank, int world_size, int64_t chunk_bytes,
              std::chrono::milliseconds timeout, std::vector<int64_t> ranks = {});
  // Waits for the queued operations, stops the worker and unmaps the segment.
  ~HostChannel();
  HostChannel(const HostChannel&) = delete;
  HostChannel& operator=(const HostChannel&) = delete;

  // Whether reduce_scatter sums tensors of `dtype` (float32, float64, float16, bfloat16).
  static bool sums(at::ScalarType dtype);
  // Removes the segment's name (the mappings stay); call once every rank has opened it.
  static void unlink(const std::string& name);
  // True when every peer's entry names a process this one sees alive with the same start time (the
  // ranks share a process namespace, so a peer's death can be told); call once every rank has opened it.
  bool peers_visible() const;

  // Sum over ranks of `input` (world_size x n elements, float32/float64/float16/bfloat16) into this
  // rank's chunk of `input` itself (the caller casts it into its output); `input` is scratch afterwards.
  c10::intrusive_ptr<c10d::Work> reduce_scatter(const at::Tensor& input, const std::string& what);
  // Every rank's `source` (n elements of output's dtype) in rank order into `output`.
  c10::intrusive_ptr<c10d::Work> all_gather(const at::Tensor& output, const at::Tensor& source,
                                            const std::string& what);
  // `tensor` (float32/float64/float16/bfloat16, int64/int32/uint8/int8) reduced over ranks in place with `op`
  // (sum, max or min): every rank reduces one part of ceil(n / world_size) elements, then every rank gathers the
  // parts; every rank gets the same bits.
  c10::intrusive_ptr<c10d::Work> all_reduce(const at::Tensor& tensor, const std::string& op, const std::string& what);


 private:
  c10::intrusive_ptr<c10d::Work> submit(std::function<void()> job);

  // The chunk loops: a buffer of `total` bytes in parts of `part` bytes, part q rank q's (the last parts may be
  // shorter or empty). Their errors name the peer; the operation's PendingOp names the operation.
  void run_reduce_parts(char* data, int64_t part, int64_t total, at::ScalarType dtype, int32_t kind);
  void run_gather_parts(char* output, const char* source, int64_t part, int64_t total, int32_t kind);
  // Waits until chunk `chunk` may be written into its half (every peer consumed the one before in it).
  void wait_half_free(uint32_t chunk);
  void publish_written(uint32_t chunk, const ChunkTag& tag);
  void wait_written(uint32_t chunk, const ChunkTag& tag);
  void publish_consumed(uint32_t chunk);
  void wait_counter(int peer, bool written, uint32_t target);
  bool peer_alive(int peer) const;
  void check_peer(int peer) const;
  std::string peer_name(int peer) const;  // "rank R": the peer's rank in the process group

  char* region(int owner, uint32_t chunk, int destination) const;

  const int rank_;
  const int world_size_;
  const int64_t chunk_bytes_;
  const std::chrono::milliseconds timeout_;
  const std::vector<int64_t> ranks_;
  size_t bytes_ = 0;
  void* base_ = nullptr;
  SegmentHeader* header_ = nullptr;
  RankEntry* entries_ = nullptr;
  char* data_ = nullptr;

  uint32_t next_chunk_ = 0;  // worker thread only
  uint64_t next_op_ = 0;     // worker thread only
  std::exception_ptr broken_;  // worker thread only: the first failure

  std::unique_ptr<OrderedWorker> worker_;  // reset before the segment is unmapped
};

}  // namespace zero_kernels::comm
