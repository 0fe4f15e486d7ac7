// One thread that runs jobs one after another in the order they were posted. The engine's relay thread
// (the second level of a two-level operation) and the shared-memory channel's worker are both one.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace zero_kernels::comm {

class OrderedWorker {
 public:
  using Job = std::function<void()>;

  OrderedWorker() : thread_([this] { loop(); }) {}
  // Runs the jobs still queued, then joins the thread.
  ~OrderedWorker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  OrderedWorker(const OrderedWorker&) = delete;
  OrderedWorker& operator=(const OrderedWorker&) = delete;

  // Queues `job` behind every job posted before it; a job must not throw (it reports its own errors).
  void post(Job job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_one();
  }

 private:
  void loop() {
    while (true) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
        if (jobs_.empty()) {
          return;
        }
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool stop_ = false;
  std::thread thread_;  // last: it starts once the members it uses exist
};

}  // namespace zero_kernels::comm
