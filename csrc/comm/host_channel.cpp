#include "comm/host_channel.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

#include "comm/row_sums.h"

namespace zero_kernels::comm {

constexpr uint64_t kMagic = 0x7a6b73686d000002ULL;  // "zkshm", layout version 2

struct alignas(64) Counter {
  std::atomic<uint32_t> value{0};
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "the counters are shared between processes");
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "a futex word is 32 bits");

// What a rank's half holds: the operation it belongs to, which every peer compares with its own before reading.
struct ChunkTag {
  uint64_t op;      // this rank's operations on the channel so far
  int32_t kind;     // OpKind
  int32_t dtype;    // the summed ScalarType, -1 for a gather
  int64_t part;     // bytes per rank
  int64_t total;    // bytes in all
};

struct RankEntry {
  Counter written;   // chunks this rank has put into its slot
  Counter consumed;  // chunks this rank has read from every peer's slot
  alignas(64) int64_t pid = 0;
  uint64_t start_time = 0;  // the process's start time in clock ticks since boot (/proc/<pid>/stat)
  ChunkTag tags[2];         // per half
};

struct alignas(64) SegmentHeader {
  std::atomic<uint64_t> magic;  // written last by the creator
  int64_t world_size;
  int64_t chunk_bytes;
};

namespace {

constexpr int kSpins = 64;
constexpr auto kPoll = std::chrono::milliseconds(100);

class HostWork final : public c10d::Work {
 public:
  void complete(std::exception_ptr error) { finish(std::move(error)); }
};

size_t data_offset(int world_size) {
  const size_t end = sizeof(SegmentHeader) + sizeof(RankEntry) * static_cast<size_t>(world_size);
  return (end + 4095) / 4096 * 4096;
}

std::string system_error(const std::string& what, int error) { return what + ": " + std::strerror(error); }

struct ProcState {
  char state;
  uint64_t start_time;
};

// State and start time of process `pid` from /proc (fields 3 and 22 of its stat line); none when it is gone.
std::optional<ProcState> proc_state(int64_t pid) {
  std::ifstream file("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(file, line)) {
    return std::nullopt;
  }
  const size_t close = line.rfind(')');  // the command name in brackets may hold spaces
  if (close == std::string::npos) {
    return std::nullopt;
  }
  std::istringstream fields(line.substr(close + 2));
  ProcState out{};
  std::string skip;
  fields >> out.state;
  for (int field = 4; field < 22 && fields >> skip; ++field) {
  }
  if (!(fields >> out.start_time)) {
    return std::nullopt;
  }
  return out;
}

bool reached(uint32_t value, uint32_t target) { return static_cast<int32_t>(value - target) >= 0; }

const char* kind_name(int32_t kind) {
  switch (kind) {
    case OpKind::kReduceScatter:
      return "reduce_scatter";
    case OpKind::kAllGather:
      return "all_gather";
    case OpKind::kAllReduceSum:
      return "all_reduce's sum";
    case OpKind::kAllReduceMax:
      return "all_reduce's max";
    case OpKind::kAllReduceMin:
      return "all_reduce's min";
    default:
      return "all_reduce's gather";
  }
}

std::string describe_tag(const ChunkTag& tag) {
  return std::string(kind_name(tag.kind)) + " (" + std::to_string(tag.total) + " bytes" +
         (tag.dtype >= 0 ? std::string(" of ") + c10::toString(static_cast<at::ScalarType>(tag.dtype)) : "") +
         ", operation " + std::to_string(tag.op) + " on the channel)";
}

void futex_wake(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Sleeps while `word` holds `seen`, at most kPoll; false when the time ran out.
bool futex_wait(std::atomic<uint32_t>& word, uint32_t seen) {
  timespec limit{0, std::chrono::duration_cast<std::chrono::nanoseconds>(kPoll).count()};
  const long rc = syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT, seen, &limit, nullptr, 0);
  return !(rc == -1 && errno == ETIMEDOUT);
}

template <typename T>
std::vector<const T*> rows_of(const std::vector<const char*>& peers) {
  std::vector<const T*> rows;
  for (const char* p : peers) {
    rows.push_back(reinterpret_cast<const T*>(p));
  }
  return rows;
}

template <typename T>
void add_regions(char* mine, const std::vector<const char*>& peers, int64_t nbytes) {
  add_rows(reinterpret_cast<T*>(mine), rows_of<T>(peers), nbytes / static_cast<int64_t>(sizeof(T)));
}

// mine = mine + the peers' rows (integers: exact, wrapping as torch's do), or the largest or smallest of them (a NaN
// wins, as torch.maximum and torch.minimum have it; the result is one of the values, its bits unchanged).
template <typename T>
void fold_regions(char* mine_bytes, const std::vector<const char*>& peers, int64_t nbytes, int32_t kind) {
  T* mine = reinterpret_cast<T*>(mine_bytes);
  const int64_t n = nbytes / static_cast<int64_t>(sizeof(T));
  for (const T* row : rows_of<T>(peers)) {
    for (int64_t i = 0; i < n; ++i) {
      if (kind == OpKind::kAllReduceSum) {
        mine[i] = static_cast<T>(mine[i] + row[i]);
        continue;
      }
      const auto a = static_cast<double>(mine[i]);
      const auto b = static_cast<double>(row[i]);
      const bool take = std::isnan(b) ? !std::isnan(a) : (kind == OpKind::kAllReduceMax ? b > a : b < a);
      if (take) {
        mine[i] = row[i];
      }
    }
  }
}

}  // namespace

HostChannel::HostChannel(const std::string& name, bool create, int rank, int world_size, int64_t chunk_bytes,
                         std::chrono::milliseconds timeout, std::vector<int64_t> ranks)
    : rank_(rank), world_size_(world_size), chunk_bytes_(chunk_bytes), timeout_(timeout), ranks_(std::move(ranks)) {
  const std::string what = "shared-memory segment " + name;
  if (world_size < 2 || rank < 0 || rank >= world_size || chunk_bytes <= 0 || chunk_bytes % 64 != 0 ||
      !(ranks_.empty() || ranks_.size() == static_cast<size_t>(world_size))) {
    throw std::invalid_argument(what + ": rank " + std::to_string(rank) + " of " + std::to_string(world_size) +
                                ", chunk of " + std::to_string(chunk_bytes) + " bytes");
  }
  bytes_ = data_offset(world_size) + static_cast<size_t>(world_size) * 2 * world_size * chunk_bytes;
  const int fd = create ? shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600) : shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    throw std::runtime_error(system_error(what + ": shm_open", errno));
  }
  auto fail = [&](const std::string& step, int error) {
    close(fd);
    if (create) {
      shm_unlink(name.c_str());
    }
    throw std::runtime_error(system_error(what + ": " + step, error));
  };
  if (create) {
    const int error = posix_fallocate(fd, 0, static_cast<off_t>(bytes_));  // no room: an error now, not SIGBUS later
    if (error != 0) {
      fail("reserving " + std::to_string(bytes_) + " bytes of shared memory (/dev/shm)", error);
    }
  } else {
    struct stat info {};
    if (fstat(fd, &info) != 0) {
      fail("fstat", errno);
    }
    if (static_cast<size_t>(info.st_size) != bytes_) {
      fail("it holds " + std::to_string(info.st_size) + " bytes where this rank expects " + std::to_string(bytes_),
           EINVAL);
    }
  }
  base_ = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base_ == MAP_FAILED) {
    base_ = nullptr;
    fail("mmap", errno);
  }
  close(fd);
  header_ = static_cast<SegmentHeader*>(base_);
  entries_ = reinterpret_cast<RankEntry*>(static_cast<char*>(base_) + sizeof(SegmentHeader));
  data_ = static_cast<char*>(base_) + data_offset(world_size);
  if (create) {
    header_->world_size = world_size;
    header_->chunk_bytes = chunk_bytes;
    header_->magic.store(kMagic, std::memory_order_release);
  } else if (header_->magic.load(std::memory_order_acquire) != kMagic || header_->world_size != world_size ||
             header_->chunk_bytes != chunk_bytes) {
    munmap(base_, bytes_);
    throw std::runtime_error(what + ": its layout differs from this rank's (another build or another group)");
  }
  const auto self = proc_state(getpid());
  entries_[rank].pid = getpid();
  entries_[rank].start_time = self ? self->start_time : 0;
  worker_ = std::make_unique<OrderedWorker>();
}

HostChannel::~HostChannel() {
  worker_.reset();
  munmap(base_, bytes_);
}

void HostChannel::unlink(const std::string& name) { shm_unlink(name.c_str()); }

// The process in `peer`'s entry still runs: it is there, not a zombie, and started when the entry says (its pid
// was not taken by another process since).
bool HostChannel::peer_alive(int peer) const {
  const auto state = proc_state(entries_[peer].pid);
  return state && state->start_time == entries_[peer].start_time && state->state != 'Z' && state->state != 'X';
}

bool HostChannel::peers_visible() const {
  for (int peer = 0; peer < world_size_; ++peer) {
    if (!peer_alive(peer)) {
      return false;
    }
  }
  return true;
}

void HostChannel::check_peer(int peer) const {
  if (!peer_alive(peer)) {
    throw std::runtime_error(peer_name(peer) + " (process " +
                             std::to_string(entries_[peer].pid) + ") exited");
  }
}

std::string HostChannel::peer_name(int peer) const {
  return "rank " + std::to_string(ranks_.empty() ? static_cast<int64_t>(peer) : ranks_[peer]);
}

char* HostChannel::region(int owner, uint32_t chunk, int destination) const {
  const int64_t index = (static_cast<int64_t>(owner) * 2 + (chunk & 1u)) * world_size_ + destination;
  return data_ + index * chunk_bytes_;
}

void HostChannel::wait_counter(int peer, bool written, uint32_t target) {
  std::atomic<uint32_t>& word = written ? entries_[peer].written.value : entries_[peer].consumed.value;
  for (int spin = 0; spin < kSpins; ++spin) {
    if (reached(word.load(std::memory_order_acquire), target)) {
      return;
    }
    sched_yield();
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  while (true) {
    const uint32_t seen = word.load(std::memory_order_acquire);
    if (reached(seen, target)) {
      return;
    }
    if (!futex_wait(word, seen)) {
      check_peer(peer);
      if (std::chrono::steady_clock::now() > deadline) {
        throw std::runtime_error(peer_name(peer) + " did not reach this operation within the process group's timeout (" +
                                 std::to_string(timeout_.count() / 1000) + " s)");
      }
    }
  }
}

void HostChannel::wait_half_free(uint32_t chunk) {
  for (int peer = 0; peer < world_size_; ++peer) {
    if (peer != rank_) {
      wait_counter(peer, false, chunk - 1);
    }
  }
}

void HostChannel::publish_written(uint32_t chunk, const ChunkTag& tag) {
  entries_[rank_].tags[chunk & 1u] = tag;
  entries_[rank_].written.value.store(chunk + 1, std::memory_order_release);
  futex_wake(entries_[rank_].written.value);
}

// Every peer filled its half for `chunk`, for the operation this rank runs (`tag`): ranks that issued their
// operations in different orders raise here, before reading what the other put there for another operation.
void HostChannel::wait_written(uint32_t chunk, const ChunkTag& tag) {
  for (int peer = 0; peer < world_size_; ++peer) {
    if (peer != rank_) {
      wait_counter(peer, true, chunk + 1);
      const ChunkTag& theirs = entries_[peer].tags[chunk & 1u];
      if (theirs.kind != tag.kind || theirs.dtype != tag.dtype || theirs.part != tag.part || theirs.total != tag.total) {
        throw std::runtime_error("the ranks issued different operations: " + peer_name(peer) + " runs " +
                                 describe_tag(theirs) + " where this rank runs " + describe_tag(tag));
      }
    }
  }
}

void HostChannel::publish_consumed(uint32_t chunk) {
  entries_[rank_].consumed.value.store(chunk + 1, std::memory_order_release);
  futex_wake(entries_[rank_].consumed.value);
}

namespace {

// The bytes of part `part_index` of a buffer of `total` bytes cut into parts of `part` bytes (the last ones may be
// shorter or empty) from `offset` on, at most `limit`.
int64_t part_length(int part_index, int64_t part, int64_t total, int64_t offset, int64_t limit) {
  const int64_t end = std::min(total, (part_index + 1) * part);
  return std::max<int64_t>(0, std::min(limit, end - part_index * part - offset));
}

bool floating(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16;
}

bool integral(at::ScalarType dtype) {
  return dtype == at::kLong || dtype == at::kInt || dtype == at::kByte || dtype == at::kChar;
}

// mine combined with the peers' regions: a sum of floating-point values as the point-to-point exchange sums them
// (add_rows), anything else as fold_regions.
void combine_into(char* mine, const std::vector<const char*>& peers, int64_t nbytes, at::ScalarType dtype,
                  int32_t kind) {
  const bool sum = kind == OpKind::kReduceScatter || kind == OpKind::kAllReduceSum;
  const int32_t fold = sum ? OpKind::kAllReduceSum : kind;
  switch (dtype) {
    case at::kFloat:
      return sum ? add_regions<float>(mine, peers, nbytes) : fold_regions<float>(mine, peers, nbytes, fold);
    case at::kDouble:
      return sum ? add_regions<double>(mine, peers, nbytes) : fold_regions<double>(mine, peers, nbytes, fold);
    case at::kHalf:
      return sum ? add_regions<c10::Half>(mine, peers, nbytes) : fold_regions<c10::Half>(mine, peers, nbytes, fold);
    case at::kBFloat16:
      return sum ? add_regions<c10::BFloat16>(mine, peers, nbytes)
                 : fold_regions<c10::BFloat16>(mine, peers, nbytes, fold);
    case at::kLong:
      return fold_regions<int64_t>(mine, peers, nbytes, fold);
    case at::kInt:
      return fold_regions<int32_t>(mine, peers, nbytes, fold);
    case at::kByte:
      return fold_regions<uint8_t>(mine, peers, nbytes, fold);
    default:
      return fold_regions<int8_t>(mine, peers, nbytes, fold);
  }
}

void check_reduced(const at::Tensor& t, bool integers, const std::string& what) {
  const at::ScalarType dtype = t.scalar_type();
  if (t.is_cuda() || !t.is_contiguous() || !(floating(dtype) || (integers && integral(dtype)))) {
    throw std::invalid_argument(what + ": the shared-memory reductions take contiguous CPU tensors of float32, float64, "
                                       "float16 or bfloat16" +
                                (integers ? std::string(", or int64, int32, uint8 or int8 (all-reduce)") : ""));
  }
}

}  // namespace

// Part q of `data` (`part` bytes, `total` in all) gets the sum of every rank's part q, on rank q only.
void HostChannel::run_reduce_parts(char* data, int64_t part, int64_t total, at::ScalarType dtype, int32_t kind) {
  const ChunkTag tag{next_op_++, kind, static_cast<int32_t>(dtype), part, total};
  for (int64_t offset = 0; offset < part; offset += chunk_bytes_) {
    const uint32_t chunk = next_chunk_;
    wait_half_free(chunk);
    for (int peer = 0; peer < world_size_; ++peer) {
      const int64_t length = part_length(peer, part, total, offset, chunk_bytes_);
      if (peer != rank_ && length > 0) {
        std::memcpy(region(rank_, chunk, peer), data + peer * part + offset, length);
      }
    }
    publish_written(chunk, tag);
    wait_written(chunk, tag);
    const int64_t length = part_length(rank_, part, total, offset, chunk_bytes_);
    if (length > 0) {
      std::vector<const char*> peers;
      for (int peer = 0; peer < world_size_; ++peer) {
        if (peer != rank_) {
          peers.push_back(region(peer, chunk, rank_));
        }
      }
      combine_into(data + rank_ * part + offset, peers, length, dtype, kind);
    }
    publish_consumed(chunk);
    next_chunk_ = chunk + 1;
  }
}

// Part q of `output` (`part` bytes, `total` in all) gets rank q's `source`. An all-gather sends the same bytes to
// every peer: its chunk is the whole half of the slot.
void HostChannel::run_gather_parts(char* output, const char* source, int64_t part, int64_t total, int32_t kind) {
  const ChunkTag tag{next_op_++, kind, -1, part, total};
  const int64_t mine = part_length(rank_, part, total, 0, part);
  if (output + rank_ * part != source && mine > 0) {
    std::memcpy(output + rank_ * part, source, mine);
  }
  const int64_t half = chunk_bytes_ * world_size_;
  for (int64_t offset = 0; offset < part; offset += half) {
    const uint32_t chunk = next_chunk_;
    wait_half_free(chunk);
    const int64_t length = part_length(rank_, part, total, offset, half);
    if (length > 0) {
      std::memcpy(region(rank_, chunk, 0), source + offset, length);
    }
    publish_written(chunk, tag);
    wait_written(chunk, tag);
    for (int peer = 0; peer < world_size_; ++peer) {
      const int64_t theirs = part_length(peer, part, total, offset, half);
      if (peer != rank_ && theirs > 0) {
        std::memcpy(output + peer * part + offset, region(peer, chunk, 0), theirs);
      }
    }
    publish_consumed(chunk);
    next_chunk_ = chunk + 1;
  }
}

bool HostChannel::sums(at::ScalarType dtype) { return floating(dtype); }

c10::intrusive_ptr<c10d::Work> HostChannel::reduce_scatter(const at::Tensor& input, const std::string& what) {
  check_reduced(input, false, what);
  char* data = static_cast<char*>(input.data_ptr());
  const at::ScalarType dtype = input.scalar_type();
  const int64_t part = input.numel() / world_size_ * input.element_size();
  return submit([this, data, part, dtype] {
    run_reduce_parts(data, part, part * world_size_, dtype, OpKind::kReduceScatter);
  });
}

c10::intrusive_ptr<c10d::Work> HostChannel::all_gather(const at::Tensor& output, const at::Tensor& source,
                                                       const std::string& what) {
  if (output.is_cuda() || source.is_cuda() || output.scalar_type() != source.scalar_type()) {
    throw std::invalid_argument(what + ": the shared-memory all-gather takes CPU tensors of one dtype");
  }
  char* out = static_cast<char*>(output.data_ptr());
  const char* in = static_cast<const char*>(source.data_ptr());
  const int64_t part = source.numel() * source.element_size();
  return submit([this, out, in, part] { run_gather_parts(out, in, part, part * world_size_, OpKind::kAllGather); });
}

// A reduce-scatter of parts of ceil(n / world_size) elements (the last ones shorter), then an all-gather of them.
c10::intrusive_ptr<c10d::Work> HostChannel::all_reduce(const at::Tensor& tensor, const std::string& op,
                                                       const std::string& what) {
  check_reduced(tensor, true, what);
  int32_t kind = OpKind::kAllReduceSum;
  if (op == "max" || op == "min") {
    kind = op == "max" ? OpKind::kAllReduceMax : OpKind::kAllReduceMin;
  } else if (op != "sum") {
    throw std::invalid_argument(what + ": op '" + op + "'; allowed: sum, max, min");
  }
  char* data = static_cast<char*>(tensor.data_ptr());
  const at::ScalarType dtype = tensor.scalar_type();
  const int64_t part = (tensor.numel() + world_size_ - 1) / world_size_ * tensor.element_size();
  const int64_t total = tensor.numel() * tensor.element_size();
  return submit([this, data, part, total, dtype, kind] {
    run_reduce_parts(data, part, total, dtype, kind);
    run_gather_parts(data, data + rank_ * part, part, total, OpKind::kAllReduceGather);
  });
}

c10::intrusive_ptr<c10d::Work> HostChannel::submit(std::function<void()> job) {
  auto work = c10::make_intrusive<HostWork>();
  worker_->post([this, job = std::move(job), work]() mutable {
    std::exception_ptr error;
    try {
      if (broken_) {
        try {
          std::rethrow_exception(broken_);
        } catch (const std::exception& e) {
          throw std::runtime_error(std::string("an earlier operation on the shared-memory channel failed (") + e.what() +
                                   ")");
        }
      }
      job();
    } catch (...) {
      error = std::current_exception();
      if (!broken_) {
        broken_ = error;
      }
    }
    const auto done = std::move(work);  // let go of it here: its waiter waits for the last other reference
    done->complete(error);
  });
  return work;
}

}  // namespace zero_kernels::comm
