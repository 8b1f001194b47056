#pragma once
// The one owner of the coordinator's state store (docs/operations.md, "Coordinator restarts").
//
// The coordinator decides under its lock and never waits there for the store: it hands each new state to the
// writer (Submit, a queue of one: a newer state replaces one not yet written) and goes on. The writer's thread
// writes the newest state it has; saves that pile up while a write is slow (an etcd leader election, a disk stall)
// are coalesced into the next write. Where the protocol needs a state to be durable before the next step (an update
// begun before any engine is paused, the commit point before the first Continue, the outcome), the coordinator waits
// for its ticket (Wait) without holding its lock, so Status, History, heartbeats and aborts answer throughout.
//
// History records go to the writer once, when they are added or changed: a state handed to Submit carries only
// those (CoordinatorState.history_incremental), plus the oldest version kept (history_floor); the writer keeps the
// records not yet written across coalesced states and failed writes, so none is lost, and a store rewrites only
// them instead of re-serializing the whole history at every save.
//
// A state whose nodes changed (a registration or removal: between updates only) lends the coordinator's node
// objects; it is written by SaveNow on the caller's thread, in order with the queued states, because the lent
// objects must not outlive the caller's lock.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "base/mutex.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "daemon/coordinator/state_store.h"
#include "wsync/v1/coordinator.pb.h"

namespace wsync::daemon {

class StoreWriter {
 public:
  explicit StoreWriter(std::unique_ptr<StateStore> store);
  // Writes what is queued (bounded by one more attempt), then stops the thread.
  ~StoreWriter();
  StoreWriter(const StoreWriter&) = delete;
  StoreWriter& operator=(const StoreWriter&) = delete;

  // The store, for Load before the first Submit and for its stats and path. Owned by the writer.
  StateStore* store() const { return store_.get(); }

  // Queues `state` (no nodes: the store's last ones stand; history_incremental set by the caller) and returns its
  // ticket. Never waits for the store. Thread-safe.
  uint64_t Submit(v1::CoordinatorState state) ABSL_LOCKS_EXCLUDED(mu_);
  // Writes `state` (which may lend nodes: `nodes_changed`) now, on the caller's thread, after the write in progress;
  // it covers every state queued before it. Returns the store's answer and the ticket it covered.
  absl::Status SaveNow(v1::CoordinatorState* state, bool nodes_changed, uint64_t* ticket)
      ABSL_LOCKS_EXCLUDED(mu_, io_mu_);
  // Blocks until the write covering ticket `t` has been attempted (or `timeout`): OK when it was written, the store's
  // error when that attempt failed (a later attempt retries it), DeadlineExceeded naming the store on timeout.
  absl::Status Wait(uint64_t t, absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);
  // The newest ticket handed out.
  uint64_t last_ticket() const ABSL_LOCKS_EXCLUDED(mu_);

  // Test hooks (tests/daemon/store_writer_test.cc), set before the first Submit, never by the coordinator.
  // after_take: the thread has taken the queued state and is about to write it (no lock of the writer's but the one
  // it writes under). save_now_waits: a SaveNow found a write in progress and is about to wait for it. With both, a
  // test puts a SaveNow between the thread's take and its write on every run, not 1 run in 3.
  struct TestHooks {
    std::function<void()> after_take;
    std::function<void()> save_now_waits;
  };
  void SetTestHooks(TestHooks hooks) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Run() ABSL_LOCKS_EXCLUDED(mu_, io_mu_);
  // Takes the queued state with the history records not yet written.
  v1::CoordinatorState TakePending(uint64_t* ticket) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A write of the records in `state` failed: they are queued again unless newer ones replaced them.
  void Requeue(const v1::CoordinatorState& state) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The outcome of an attempt covering tickets up to `t`.
  void Attempted(uint64_t t, const absl::Status& st) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::unique_ptr<StateStore> store_;
  Mutex io_mu_;  // one write at a time: the thread's and SaveNow's (taken before mu_)

  mutable Mutex mu_ ABSL_ACQUIRED_AFTER(io_mu_);
  CondVar cv_;        // a state queued, stop asked
  CondVar done_cv_;   // an attempt ended
  // The newest state not yet written (history cleared).
  std::optional<v1::CoordinatorState> pending_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, v1::UpdateRecord> pending_history_ ABSL_GUARDED_BY(mu_);  // by version: records to write
  int64_t pending_floor_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 0;      // tickets handed out
  uint64_t pending_ticket_ ABSL_GUARDED_BY(mu_) = 0;   // the ticket pending_ covers
  uint64_t attempted_ ABSL_GUARDED_BY(mu_) = 0;        // tickets covered by an attempt that ended
  uint64_t written_ ABSL_GUARDED_BY(mu_) = 0;          // tickets covered by a write that succeeded
  absl::Status last_error_ ABSL_GUARDED_BY(mu_);       // of the last failed attempt
  uint64_t last_error_ticket_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;  // io_mu_ is held for a write (what save_now_waits reports)
  TestHooks hooks_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace wsync::daemon
