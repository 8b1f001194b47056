#include "daemon/node/hash_pool.h"

#include <algorithm>
#include <utility>

namespace wsync::daemon {

int HashPool::DefaultThreads() {
  const unsigned hw = std::thread::hardware_concurrency();
  return static_cast<int>(std::clamp(hw, 1u, 4u));
}

HashPool::HashPool(int threads) {
  workers_.reserve(static_cast<size_t>(std::max(threads, 1)));
  for (int i = 0; i < std::max(threads, 1); ++i) workers_.emplace_back([this] { Run(); });
}

HashPool::~HashPool() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (auto& w : workers_) w.join();
}

void HashPool::Submit(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> l(mu_);
    queue_.push_back(std::move(job));
  }
  work_cv_.notify_one();
}

void HashPool::WaitIdle() {
  std::unique_lock<std::mutex> l(mu_);
  idle_cv_.wait(l, [&] { return queue_.empty() && running_ == 0; });
}

void HashPool::Run() {
  std::unique_lock<std::mutex> l(mu_);
  for (;;) {
    // Stopping still drains the queue: a queued hash may be the last piece of a recorded update.
    work_cv_.wait(l, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;
    std::function<void()> job = std::move(queue_.front());
    queue_.pop_front();
    ++running_;
    l.unlock();
    job();
    job = nullptr;  // what it captured goes before WaitIdle can return
    l.lock();
    --running_;
    if (queue_.empty() && running_ == 0) idle_cv_.notify_all();
  }
}

}  // namespace wsync::daemon
