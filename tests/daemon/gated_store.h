#pragma once
// A state store for tests: a real store behind a gate. A save blocks while the gate is held (a stalled disk or etcd
// leader), fails while `fail` is set, and records each save's current version and history size.

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <vector>

#include "daemon/coordinator/state_store.h"

namespace wsync::testing {

using daemon::StateStore;
using daemon::StateStoreStats;

// A real SQLite store behind a gate: a save blocks while the gate is held (a stalled disk or etcd leader), fails
// while `fail` is set, and every save's history size and current version are recorded.
class GatedStore : public StateStore {
 public:
  explicit GatedStore(std::unique_ptr<StateStore> inner) : inner_(std::move(inner)) {}
  absl::StatusOr<v1::CoordinatorState> Load() override { return inner_->Load(); }
  absl::Status SaveChanges(const v1::CoordinatorState& state, bool nodes_changed) override {
    std::unique_lock<std::mutex> l(mu_);
    ++entered_;
    cv_.notify_all();
    cv_.wait(l, [&] { return !held_; });
    saves_.push_back({state.current_version(), state.history_size()});
    if (fail_) return absl::UnavailableError("store down (injected)");
    l.unlock();
    return inner_->SaveChanges(state, nodes_changed);
  }
  const std::string& path() const override { return inner_->path(); }
  StateStoreStats stats() const override { return inner_->stats(); }

  void Hold() {
    std::lock_guard<std::mutex> l(mu_);
    held_ = true;
  }
  void Release() {
    {
      std::lock_guard<std::mutex> l(mu_);
      held_ = false;
    }
    cv_.notify_all();
  }
  void SetFail(bool f) {
    std::lock_guard<std::mutex> l(mu_);
    fail_ = f;
  }
  // Blocks until `n` saves have entered (bounded); false if they did not.
  bool AwaitEntered(int n) {
    std::unique_lock<std::mutex> l(mu_);
    return cv_.wait_for(l, std::chrono::seconds(10), [&] { return entered_ >= n; });
  }
  struct Save {
    int64_t current_version;
    int history;
  };
  std::vector<Save> saves() {
    std::lock_guard<std::mutex> l(mu_);
    return saves_;
  }

 private:
  std::unique_ptr<StateStore> inner_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool held_ = false, fail_ = false;
  int entered_ = 0;
  std::vector<Save> saves_;
};

}  // namespace wsync::testing
