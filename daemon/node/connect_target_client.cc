#include "daemon/node/connect_target_client.h"

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include "base/status.h"
#include "daemon/common/rpc.h"
#include "daemon/common/serve.h"
#include "proto/status_convert.h"
#include "proto/tls.h"
#include "wsync/v1/daemon.grpc.pb.h"

namespace wsync::daemon {
namespace {

constexpr int kReconnectSeconds = 10;

}  // namespace

absl::StatusOr<v1::ConnectTargetReply> DialConnectTargetReply(const std::string& target_daemon,
                                                              const v1::ConnectTargetRequest& req) {
  return DialConnectTargetBy(target_daemon, req, absl::InfiniteFuture());
}

absl::StatusOr<v1::ConnectTargetReply> DialConnectTargetBy(const std::string& target_daemon,
                                                           const v1::ConnectTargetRequest& req, absl::Time deadline) {
  const auto by = [&](int seconds) { return absl::ToChronoTime(std::min(absl::Now() + absl::Seconds(seconds), deadline)); };
  WSYNC_ASSIGN_OR_RETURN(auto channel, tls::Dial(target_daemon, kMaxControlMessageBytes));
  auto stub = v1::NodeDaemon::NewStub(channel);
  v1::ConnectTargetReply out;
  const auto call = [&] {
    grpc::ClientContext ctx;
    ctx.set_deadline(by(60));
    return stub->ConnectTarget(&ctx, req, &out);
  };
  grpc::Status s = call();
  // gRPC shares one connection per address among a process's channels and, after a failed connection attempt,
  // backs off (about a second) before the next: a call in that window fails at once with UNAVAILABLE "failed to
  // connect to all addresses" although the target serves (seen when a source connects again to a target it
  // had left, on a loaded machine). Such a call is made once more when the channel connects within
  // kReconnectSeconds; a target that is really gone still fails, after that wait.
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
    spdlog::warn("ConnectTarget to {}: {}; waiting up to {} s for the connection, then asking again", target_daemon,
                 s.error_message(), kReconnectSeconds);
    if (!channel->WaitForConnected(by(kReconnectSeconds)))
      return Annotate(FromGrpcStatus(s), absl::Now() >= deadline
                                             ? std::string("still unreachable when the caller's deadline passed")
                                             : absl::StrCat("still unreachable ", kReconnectSeconds, " s later"));
    s = call();
  }
  if (!s.ok()) return FromGrpcStatus(s);
  return out;
}

absl::StatusOr<std::string> DialConnectTarget(const std::string& target_daemon, const v1::ConnectTargetRequest& req) {
  WSYNC_ASSIGN_OR_RETURN(v1::ConnectTargetReply out, DialConnectTargetReply(target_daemon, req));
  return out.target_endpoint_info();
}

}  // namespace wsync::daemon
