#pragma once
// The source's write pipeline (issue 39): one TargetWriter per target connection, its own thread and the only user of
// that target's endpoint, fed by a bounded queue with credits; and one UpdateWrites per source, the update-lifecycle
// object every writer reports its completions to.
//
// Producers (the buckets and placements of the trainer ranks, after they loaded the replica) hand a target a batch
// with Submit: it takes a credit and returns, so a rank waits on credits (a target whose queue and in-flight batches
// are full), never on the network of a Post, and never on another target. No lock is held across a Post or a Wait:
// the writer thread owns the endpoint, and its mutex guards only the queue and counters.
// The first failed Post or Wait of an update fails it (UpdateWrites::Report, then the source's failure callback,
// which cancels every writer: queued batches are dropped, in-flight ones fail at once by Endpoint::Cancel).
// FinishUpdate and AbortUpdate wait for UpdateWrites to be drained (nothing queued or in flight) by their deadline.

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "base/mutex.h"
#include "transport/transport.h"

namespace wsync::daemon {

// The open update's writes over every writer of a source: batches queued or in flight, and its first error.
// Thread-safe; never calls out while holding its mutex.
class UpdateWrites {
 public:
  // Called (outside any lock of this object, on the writer's thread) with the first error a writer reports for an
  // update: the source fails that update if it is still the open one.
  using FailureFn = std::function<void(int64_t version, const absl::Status& err)>;
  explicit UpdateWrites(FailureFn on_failure) : on_failure_(std::move(on_failure)) {}

  // A new update: nothing pending, no error. Batches of an earlier version that report later are ignored.
  void Begin(int64_t version);
  // Counts a batch of `version` in the pipeline; false (nothing counted) when `version` is not the update begun last
  // or it failed already.
  bool Add(int64_t version);
  // A batch counted by Add left the pipeline: written (OK), or failed. The first failure of the update is recorded
  // and handed to the failure callback; failures after it (the cancelled rest) only end their batch.
  void Report(int64_t version, const absl::Status& st);
  // Records `err` as the update's error without calling back (the source failed it itself).
  void Fail(int64_t version, const absl::Status& err);
  bool failed(int64_t version) const;
  // The first error of `version` (OK: none, or another update).
  absl::Status error(int64_t version) const;
  // Waits until no batch of the current update is queued or in flight, or `deadline`; true when drained.
  bool WaitDrained(absl::Time deadline);
  uint64_t pending() const;

 private:
  const FailureFn on_failure_;
  mutable Mutex mu_;
  CondVar cv_;
  int64_t version_ ABSL_GUARDED_BY(mu_) = -1;
  uint64_t pending_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

// One target connection's writer. Owns the endpoint and the thread that alone uses it (Post, Wait); Cancel is the
// one endpoint call another thread makes (Endpoint::Cancel's contract allows it).
class TargetWriter {
 public:
  struct Options {
    // Batches queued or in flight at once; Submit blocks beyond them. A batch is a list of write descriptors into
    // memory that stays put for the update (the replica, the delta mirror), so depth costs ~100 bytes per write,
    // not the bytes: the bound sits far above the batches one update gives a target, so a slow target falls behind
    // without pacing the ranks that feed the others (at 32, a target held 0.5 s per Post cut the others' rate to
    // 0.17 of their unslowed one: bench_node --slow-target-ms), and still stops a stuck target's queue from growing
    // past it.
    int credits = 1024;
    // For an endpoint without a CompletionFd: how long the thread waits for its oldest batch before it looks at the
    // queue again (new batches are posted while older ones are in flight). With one, the thread sleeps in poll on
    // that fd and its own wake-up fd (Submit, Cancel), and calls Wait(batch, 0) only when one of them fired.
    absl::Duration wait_slice = absl::Milliseconds(2);
    // The longest the thread sleeps in poll without a wake-up (a lost one then costs this long, not a hang).
    absl::Duration sleep_cap = absl::Seconds(1);
  };
  // `context` prefixes every error of this writer ("writing to engine E rank R at D; affected: ...").
  TargetWriter(std::unique_ptr<transport::Endpoint> endpoint, std::string context, UpdateWrites* updates, Options opts);
  TargetWriter(std::unique_ptr<transport::Endpoint> endpoint, std::string context, UpdateWrites* updates)
      : TargetWriter(std::move(endpoint), std::move(context), updates, Options{}) {}
  // Cancels what is left (nothing waits for it any more) and joins the thread.
  ~TargetWriter();
  TargetWriter(const TargetWriter&) = delete;
  TargetWriter& operator=(const TargetWriter&) = delete;

  // Called once when a queued batch leaves the pipeline, on the writer's thread or the canceller's, outside this
  // writer's lock: OK when its writes completed, else why not (failed, cancelled in flight: possibly part written;
  // dropped from the queue: nothing written).
  using Done = std::function<void(const absl::Status&)>;
  // Queues a batch of update `version`: blocks while every credit is taken, until one frees, the writer breaks or
  // the update fails. Errors (nothing queued, `done` never called): Unavailable once the writer is broken (its
  // endpoint must be re-created), Aborted once the update failed. The batch's regions must outlive its write.
  absl::Status Submit(int64_t version, std::vector<transport::WriteRequest> batch, Done done = nullptr);
  // Drops every queued batch and fails the ones in flight with `why` (Endpoint::Cancel), at once; the writer is
  // broken from then on. Any thread; never blocks on the network.
  void Cancel(const absl::Status& why);
  // OK while the endpoint is usable; else why not (a failed Post or Wait, a Cancel).
  absl::Status broken() const;
  // Batches queued or in flight.
  int busy() const;
  const transport::Endpoint& endpoint() const { return *endpoint_; }

 private:
  struct Item {
    int64_t version = -1;
    std::vector<transport::WriteRequest> writes;
    Done done;
  };
  struct InFlight {
    int64_t version = -1;
    transport::BatchId id = 0;
    Done done;
  };
  struct Dropped {
    int64_t version = -1;
    Done done;
  };
  void Run();
  // Makes the thread's poll return (a batch queued, a Cancel, the destructor).
  void Wake();
  // Sleeps until the endpoint's CompletionFd or the wake-up fd is readable; consumes the wake-ups.
  void Sleep();
  // Marks the writer broken by `err` (the first cause) and drops the queue; returns the dropped items.
  std::vector<Dropped> BreakLocked(const absl::Status& err) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends a batch that left the pipeline: its `done` with `st`, then UpdateWrites::Report(version, report).
  void End(int64_t version, const Done& done, const absl::Status& st, const absl::Status& report);

  const std::unique_ptr<transport::Endpoint> endpoint_;
  const std::string context_;
  UpdateWrites* const updates_;
  const Options opts_;
  mutable Mutex mu_;
  CondVar cv_;  // the thread: work queued, stop; producers: a credit freed, broken
  std::deque<Item> queue_ ABSL_GUARDED_BY(mu_);
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  const int completion_fd_;  // the endpoint's CompletionFd, or -1
  int wake_fd_ = -1;         // an eventfd, when completion_fd_ is one
  std::thread thread_;  // last: started once everything it touches exists
};

}  // namespace wsync::daemon
