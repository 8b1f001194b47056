#include "daemon/node/connect_target_client.h"

#include <grpcpp/grpcpp.h>

#include "base/status.h"
#include "daemon/common/rpc.h"
#include "daemon/common/serve.h"
#include "proto/status_convert.h"
#include "proto/tls.h"
#include "wsync/v1/daemon.grpc.pb.h"

namespace wsync::daemon {

absl::StatusOr<v1::ConnectTargetReply> DialConnectTargetReply(const std::string& target_daemon,
                                                              const v1::ConnectTargetRequest& req) {
  WSYNC_ASSIGN_OR_RETURN(auto channel, tls::Dial(target_daemon, kMaxControlMessageBytes));
  auto stub = v1::NodeDaemon::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(60));
  v1::ConnectTargetReply out;
  grpc::Status s = stub->ConnectTarget(&ctx, req, &out);
  if (!s.ok()) return FromGrpcStatus(s);
  return out;
}

absl::StatusOr<std::string> DialConnectTarget(const std::string& target_daemon, const v1::ConnectTargetRequest& req) {
  WSYNC_ASSIGN_OR_RETURN(v1::ConnectTargetReply out, DialConnectTargetReply(target_daemon, req));
  return out.target_endpoint_info();
}

}  // namespace wsync::daemon
