#pragma once
// C++ client of the coordinator API (used by trainers that drive updates and by wsyncctl).

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "wsync/v1/coordinator.grpc.pb.h"

namespace wsync::client {

// Client deadlines derive from the server's worst case, so a call is never abandoned while the server still works
// on it and a retry does not overlap the first call (the coordinator answers such a retry with the first call's
// result anyway, see daemon/coordinator/coordinator.h). The rule: deadline = dial timeout + the server's worst case + a margin.
// The server's worst case is the sum of the per-phase peer deadlines of daemon/coordinator/coordinator.h (PeerDeadlines); the
// client cannot include the daemon, so daemon_coordinator_test checks that these stay above
// CommitWorstCaseSeconds / BeginWorstCaseSeconds.
inline constexpr double kDefaultCommitTimeoutSeconds = 120;  // CommitUpdateRequest.timeout_seconds default
// CommitUpdate on the server: FinishUpdate (timeout_seconds + 30) + apply delta 60 + post-process 300 + set version
// 30 + continue 30; staged updates add verify 2 x 120, pause 120, and prepare and switch 60 each.
inline constexpr double kCommitOverheadSeconds = 30 + 60 + 300 + 30 + 30 + 2 * 120 + 120 + 2 * 60;
// BeginUpdate on the server: pause 120 + engine info 30 + configure 600 (a first-time replica build) + start 30.
inline constexpr double kBeginWorstCaseSeconds = 120 + 30 + 600 + 30;
// Scheduling, queueing and transfer on top of the server's own bounds.
inline constexpr double kDeadlineMarginSeconds = 30;

inline absl::Duration CommitUpdateDeadline(double timeout_seconds, absl::Duration dial_timeout) {
  if (timeout_seconds <= 0) timeout_seconds = kDefaultCommitTimeoutSeconds;
  return dial_timeout + absl::Seconds(timeout_seconds + kCommitOverheadSeconds + kDeadlineMarginSeconds);
}
inline absl::Duration BeginUpdateDeadline(absl::Duration dial_timeout) {
  return dial_timeout + absl::Seconds(kBeginWorstCaseSeconds + kDeadlineMarginSeconds);
}

// High availability (docs/operations.md, "High availability (etcd)"): a standby coordinator answers every call with
// Unavailable "not the leader: ...; current leader: HOST:PORT".
// "a:1, b:2" → {"a:1", "b:2"} (whitespace and empty items dropped).
std::vector<std::string> SplitEndpoints(const std::string& list);
// The "current leader: HOST:PORT" a standby names in its error, or "" (none named, or "(electing)").
std::string LeaderHint(const std::string& message);
// How long a client given several coordinators keeps looking for the leader when none answers as one: a lease TTL
// (3 s by default) for the old leader's lease to expire, the new leader's state load, and a margin.
inline constexpr double kDefaultFailoverSeconds = 20;

class CoordinatorClient {
 public:
  // `endpoints` is host:port, or a comma-separated list of the coordinators sharing one etcd state store. With one
  // endpoint a call fails with Unavailable/DeadlineExceeded after `dial_timeout` when unreachable. With several, a
  // call goes to the one that answered last; on Unavailable (down, or a standby's "not the leader") it moves to the
  // leader the standby names, else to the next endpoint, retrying with backoff (0.1 s doubling to 2 s) for up to
  // `failover` in all. Every call is safe to repeat (the coordinator answers a repeat with the first call's result,
  // and one an old leader died during with that update's failure), so a call cut by a fail-over is repeated.
  explicit CoordinatorClient(const std::string& endpoints, absl::Duration dial_timeout = absl::Seconds(5),
                             absl::Duration failover = absl::Seconds(kDefaultFailoverSeconds));
  // The endpoint the last call went to (the leader, when it succeeded).
  std::string endpoint() const { return endpoints_[current_.load()]; }

  // Both are safe to retry with the same version: the coordinator answers a repeat with the first call's result.
  // `mode`: "classic" ("") or "staged" (docs/operations.md, "Staged updates").
  // `delta`: "" (auto) | "auto" | "off" | "always" (docs/delta.md).
  absl::StatusOr<v1::BeginUpdateReply> BeginUpdate(int64_t version, const std::string& pause_mode = "",
                                                   const std::string& mode = "", const std::string& delta = "");
  absl::StatusOr<v1::UpdateRecord> CommitUpdate(int64_t version, double timeout_seconds = kDefaultCommitTimeoutSeconds);
  absl::StatusOr<v1::ClusterStatus> Status();
  absl::StatusOr<v1::HistoryReply> History(int limit);
  // Closes the open update `version` without committing it (safe to retry: a repeat returns the first answer).
  // `aborted_by` says who asks, for the history (empty: "the operator").
  absl::StatusOr<v1::AbortUpdateReply> AbortUpdate(int64_t version, const std::string& reason,
                                                   const std::string& aborted_by = "");
  // Resumes paused engines at their current version; refused while they may hold partial writes.
  absl::StatusOr<v1::ResumeEnginesReply> ResumeEngines();
  absl::StatusOr<v1::RemoveNodeReply> RemoveNode(const std::string& node_id);
  // Drains (drain true) or undrains an engine (engine_id) or a whole node (node_id); exactly one is set.
  absl::StatusOr<v1::DrainReply> Drain(const std::string& engine_id, const std::string& node_id, bool drain);
  // Follows the engines' readiness (WatchEngines): calls `on_change` with the states now and at every change until it
  // returns false or `duration` (zero: no limit) passed; OK then, or the stream's error (the coordinator went away).
  absl::Status WatchEngines(const std::function<bool(const v1::EngineStates&)>& on_change, double interval_seconds,
                            absl::Duration duration);

 private:
  template <typename Req, typename Rep>
  using Method = grpc::Status (v1::Coordinator::Stub::*)(grpc::ClientContext*, const Req&, Rep*);
  // One call with the fail-over rule above; `deadline` bounds each attempt.
  template <typename Req, typename Rep>
  absl::StatusOr<Rep> Invoke(Method<Req, Rep> m, const Req& req, absl::Duration deadline);

  std::vector<std::string> endpoints_;
  // Null where the endpoint may not be dialled (mTLS settings; dial_status_ says why).
  std::vector<std::unique_ptr<v1::Coordinator::Stub>> stubs_;
  absl::Status dial_status_;
  std::atomic<size_t> current_{0};
  absl::Duration dial_timeout_;
  absl::Duration failover_;
};

}  // namespace wsync::client
