#pragma once
// A small fixed pool of threads that runs a source's write-checksum hashing (wsyncd --write-checksum-threads), so the
// ingest thread only posts writes and queues the hashing of what they read.
//
// Contract: Submit may be called from any thread and never blocks on a job; jobs run in submission order on
// whichever worker is free. WaitIdle blocks until every job submitted before it (by any thread) has returned; the
// caller must hold no lock a job takes. The destructor runs every job already submitted, then joins the workers.
// A job must not Submit to or WaitIdle on its own pool.

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace wsync::daemon {

class HashPool {
 public:
  // The default size: min(4, hardware threads), at least 1.
  static int DefaultThreads();

  explicit HashPool(int threads);  // threads >= 1
  ~HashPool();
  HashPool(const HashPool&) = delete;
  HashPool& operator=(const HashPool&) = delete;

  void Submit(std::function<void()> job);
  void WaitIdle();
  int threads() const { return static_cast<int>(workers_.size()); }

 private:
  void Run();

  std::mutex mu_;
  std::condition_variable work_cv_, idle_cv_;
  std::deque<std::function<void()>> queue_;
  size_t running_ = 0;  // jobs taken off the queue and not yet returned
  bool stopping_ = false;
  std::vector<std::thread> workers_;  // last: started once everything they touch exists
};

}  // namespace wsync::daemon
