#pragma once
// C++ client of the coordinator API (used by trainers that drive updates and by wsyncctl).

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "wsync/v1/coordinator.grpc.pb.h"

namespace wsync::client {

// Client deadlines derive from the server's worst case, so a call is never abandoned while the server still works
// on it and a retry does not overlap the first call (the coordinator answers such a retry with the first call's
// result anyway, see daemon/coordinator.h). The rule: deadline = dial timeout + the server's worst case + a margin.
// The server's worst case is the sum of the per-phase peer deadlines of daemon/coordinator.h (PeerDeadlines); the
// client cannot include the daemon, so daemon_coordinator_test checks that these stay above
// CommitWorstCaseSeconds / BeginWorstCaseSeconds.
inline constexpr double kDefaultCommitTimeoutSeconds = 120;  // CommitUpdateRequest.timeout_seconds default
// CommitUpdate on the server: FinishUpdate (timeout_seconds + 30) + post-process 300 + set version 30 + continue 30.
inline constexpr double kCommitOverheadSeconds = 30 + 300 + 30 + 30;
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

class CoordinatorClient {
 public:
  // `endpoint` is host:port. Calls fail with Unavailable/DeadlineExceeded after `dial_timeout` when unreachable.
  explicit CoordinatorClient(const std::string& endpoint, absl::Duration dial_timeout = absl::Seconds(5));

  // Both are safe to retry with the same version: the coordinator answers a repeat with the first call's result.
  absl::StatusOr<v1::BeginUpdateReply> BeginUpdate(int64_t version, const std::string& pause_mode = "");
  absl::StatusOr<v1::UpdateRecord> CommitUpdate(int64_t version, double timeout_seconds = kDefaultCommitTimeoutSeconds);
  absl::StatusOr<v1::ClusterStatus> Status();
  absl::StatusOr<v1::HistoryReply> History(int limit);
  // Closes the open update `version` without committing it (safe to retry: a repeat returns the first answer).
  absl::StatusOr<v1::AbortUpdateReply> AbortUpdate(int64_t version, const std::string& reason);
  // Resumes paused engines at their current version; refused while they may hold partial writes.
  absl::StatusOr<v1::ResumeEnginesReply> ResumeEngines();
  absl::StatusOr<v1::RemoveNodeReply> RemoveNode(const std::string& node_id);

 private:
  std::unique_ptr<v1::Coordinator::Stub> stub_;  // null when the endpoint may not be dialled (dial_status_ says why)
  absl::Status dial_status_;
  absl::Duration dial_timeout_;
};

}  // namespace wsync::client
