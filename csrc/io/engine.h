// The disk I/O engine: tensors' bytes moved to and from files by a pool of threads, asynchronously.
//
// A request (one tensor, one file, one byte offset) is cut in file space into pieces: a head up to
// the first 4 KiB boundary, then block_size pieces of whole 4 KiB pages, then a tail of less than a
// page. The aligned pieces go through a descriptor opened with O_DIRECT (memory that is not page
// aligned passes through the worker's aligned bounce buffer); the head and tail, and every piece of
// a file whose file system refuses O_DIRECT (ramfs, tmpfs before Linux 6.6), through a buffered
// descriptor. Pieces of every request share one FIFO queue served by threads * queue_depth workers
// calling pread/pwrite, so that many blocks are in flight: measured on this project's machines, that
// pool moves as many bytes as libaio or io_uring at the same depth and needs no library (the
// docstring of zero_kernels/offload/aio.py gives the figures).
//
// Errors never throw across threads: the first failure of a request (errno and what failed) is kept
// and returned by wait().
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace zero_kernels::io {

constexpr int64_t kPage = 4096;  // the alignment O_DIRECT asks of offsets, lengths and addresses

struct Options {
  int64_t block_size = 1 << 20;  // bytes per piece (a multiple of kPage)
  int64_t queue_depth = 8;       // pieces in flight per thread
  int64_t threads = 1;           // independent streams; the pool has threads * queue_depth workers
  bool direct = true;            // O_DIRECT where the file system allows it
};

// Whether the last piece ran: the error of the first failed piece (0: none) and what it was doing.
struct Outcome {
  int error = 0;
  std::string detail;
};

class Request {
 public:
  Request(std::string path, bool write, char* data, int64_t nbytes, int64_t offset, std::shared_ptr<void> keep_alive);
  ~Request();
  bool done() const;
  Outcome wait();  // blocks until every piece has finished
  const std::string& path() const { return path_; }

 private:
  friend class Engine;
  void fail(int error, std::string detail);
  bool failed();
  void finish_piece();  // the last one closes the files and wakes the waiters
  void finish();

  const std::string path_;
  const bool write_;
  char* const data_;
  const int64_t nbytes_;
  const int64_t offset_;
  std::shared_ptr<void> keep_alive_;  // the tensor whose bytes move, alive until the request is destroyed
  int fd_buffered_ = -1;
  int fd_direct_ = -1;
  std::atomic<int64_t> remaining_{0};
  mutable std::mutex mutex_;
  std::condition_variable finished_cv_;
  bool finished_ = false;
  Outcome outcome_;
};

class Engine {
 public:
  explicit Engine(Options options);
  ~Engine();  // close()
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Starts moving nbytes at data to (write) or from the file at path, from byte offset; returns at once.
  // keep_alive is held until the request is destroyed.
  std::shared_ptr<Request> submit(const std::string& path, char* data, int64_t nbytes, int64_t offset, bool write,
                                  std::shared_ptr<void> keep_alive);
  void close();  // finishes every request submitted, then stops the workers; idempotent
  // Paths whose file system refused O_DIRECT (buffered I/O ran instead), in the order met.
  std::vector<std::string> buffered_paths() const;
  const Options& options() const { return options_; }

 private:
  struct Piece {
    std::shared_ptr<Request> request;
    int64_t start;   // byte offset in the file
    int64_t length;  // bytes
    bool direct;
  };
  void open_files(Request& request);
  void reserve(Request& request);
  std::vector<Piece> split(const std::shared_ptr<Request>& request) const;
  void work();
  void run(const Piece& piece, char* bounce);

  const Options options_;
  mutable std::mutex mutex_;
  std::condition_variable queue_cv_;
  std::deque<Piece> queue_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
  std::vector<std::string> buffered_paths_;
};

}  // namespace zero_kernels::io
