#pragma once
// C++ client of the coordinator API (used by trainers that drive updates and by wsyncctl).

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "wsync/v1/coordinator.grpc.pb.h"

namespace wsync::client {

class CoordinatorClient {
 public:
  // `endpoint` is host:port. Calls fail with Unavailable/DeadlineExceeded after `dial_timeout` when unreachable.
  explicit CoordinatorClient(const std::string& endpoint, absl::Duration dial_timeout = absl::Seconds(5));

  absl::StatusOr<v1::BeginUpdateReply> BeginUpdate(int64_t version, const std::string& pause_mode = "");
  absl::StatusOr<v1::UpdateRecord> CommitUpdate(int64_t version, double timeout_seconds = 120);
  absl::StatusOr<v1::ClusterStatus> Status();
  absl::StatusOr<v1::HistoryReply> History(int limit);

 private:
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  absl::Duration dial_timeout_;
};

}  // namespace wsync::client
