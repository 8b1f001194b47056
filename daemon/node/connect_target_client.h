#pragma once
// The source daemon's outbound call to a target daemon (its NodeDaemon service).

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "wsync/v1/daemon.pb.h"

namespace wsync::daemon {

// Dials a target daemon's ConnectTarget over gRPC (used by SourceNode).
absl::StatusOr<std::string> DialConnectTarget(const std::string& target_daemon, const v1::ConnectTargetRequest& req);
// The same, answering the whole reply (with the connection's delta staging region).
absl::StatusOr<v1::ConnectTargetReply> DialConnectTargetReply(const std::string& target_daemon,
                                                              const v1::ConnectTargetRequest& req);
// The same, ended by `deadline` (the source's caller's): the call, the wait for a connection after a failed attempt
// and the second call each end by it, and by 60 s, 10 s and 60 s at most.
absl::StatusOr<v1::ConnectTargetReply> DialConnectTargetBy(const std::string& target_daemon,
                                                           const v1::ConnectTargetRequest& req, absl::Time deadline);

}  // namespace wsync::daemon
