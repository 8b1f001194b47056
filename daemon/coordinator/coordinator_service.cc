#include "daemon/coordinator/coordinator_service.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "daemon/common/rpc.h"
#include "proto/status_convert.h"
#include "proto/tls.h"

namespace wsync::daemon {

grpc::Status CoordinatorService::Gate() const {
  return gate_ == nullptr ? grpc::Status::OK : ToGrpcStatus(gate_->Check());
}

// A node registers and heartbeats only as itself: the certificate's role is the registered role and its id the node
// id, so no caller can take over another node's id (or register a target with a source certificate).
static grpc::Status NodeDaemonIdentity(const grpc::ServerContext* ctx, const char* rpc, const std::string& node_id,
                                const std::string* role) {
  tls::Peer p;
  if (auto a = tls::Authorize(ctx, rpc, {tls::kSource, tls::kTarget}, &p); !a.ok()) return a;
  if (!tls::Enabled()) return grpc::Status::OK;
  if (p.id != node_id || (role != nullptr && p.role != *role))
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        absl::StrCat(rpc, " refused for ", p.Describe(), ": a node may ", rpc, " only as itself (",
                                     role != nullptr ? *role + ":" : std::string(), node_id, " requested)"));
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::RegisterNode(grpc::ServerContext* ctx, const v1::RegisterNodeRequest* req,
                                              v1::RegisterNodeReply* out) {
  if (auto a = NodeDaemonIdentity(ctx, "RegisterNode", req->node_id(), &req->role()); !a.ok()) return a;
  if (auto l = CheckRequestSize("RegisterNode", *req); !l.ok()) return l;
  if (!tls::Enabled() && !tls::IsLoopback(req->address()))
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("node ", req->node_id(), " registers address ", req->address(),
                                     ", which is not loopback: this coordinator runs without TLS (loopback development "
                                     "only) and dials nobody else"));
  if (grpc::Status g = Gate(); !g.ok()) return g;
  return Reply(c_->RegisterNode(*req), out);
}
grpc::Status CoordinatorService::GetClusterStatus(grpc::ServerContext* ctx, const v1::ClusterStatusRequest* req,
                                                  v1::ClusterStatus* out) {
  WSYNC_AUTHORIZE("GetClusterStatus", WSYNC_ANY_ROLE);
  if (grpc::Status g = Gate(); !g.ok()) return g;
  *out = c_->Status();
  return grpc::Status::OK;
}
grpc::Status CoordinatorService::BeginUpdate(grpc::ServerContext* ctx, const v1::BeginUpdateRequest* req,
                                             v1::BeginUpdateReply* out) {
  WSYNC_AUTHORIZE("BeginUpdate", {tls::kTrainer, tls::kAdmin});
  if (grpc::Status g = Gate(); !g.ok()) return g;
  return Reply(c_->BeginUpdate(*req), out);
}
grpc::Status CoordinatorService::CommitUpdate(grpc::ServerContext* ctx, const v1::CommitUpdateRequest* req,
                                              v1::CommitUpdateReply* out) {
  WSYNC_AUTHORIZE("CommitUpdate", {tls::kTrainer, tls::kAdmin});
  if (grpc::Status g = Gate(); !g.ok()) return g;
  return Reply(c_->CommitUpdate(*req), out);
}
grpc::Status CoordinatorService::GetHistory(grpc::ServerContext* ctx, const v1::HistoryRequest* req,
                                            v1::HistoryReply* out) {
  WSYNC_AUTHORIZE("GetHistory", WSYNC_ANY_ROLE);
  if (grpc::Status g = Gate(); !g.ok()) return g;
  *out = c_->History(*req);
  return grpc::Status::OK;
}
grpc::Status CoordinatorService::AbortUpdate(grpc::ServerContext* ctx, const v1::AbortUpdateRequest* req,
                                             v1::AbortUpdateReply* out) {
  WSYNC_AUTHORIZE("AbortUpdate", {tls::kAdmin});
  if (grpc::Status g = Gate(); !g.ok()) return g;
  return Reply(c_->AbortUpdate(*req), out);
}
grpc::Status CoordinatorService::RemoveNode(grpc::ServerContext* ctx, const v1::RemoveNodeRequest* req,
                                            v1::RemoveNodeReply* out) {
  WSYNC_AUTHORIZE("RemoveNode", {tls::kAdmin});
  if (grpc::Status g = Gate(); !g.ok()) return g;
  return Reply(c_->RemoveNode(*req), out);
}
grpc::Status CoordinatorService::Drain(grpc::ServerContext* ctx, const v1::DrainRequest* req, v1::DrainReply* out) {
  WSYNC_AUTHORIZE("Drain", {tls::kAdmin});
  if (grpc::Status g = Gate(); !g.ok()) return g;
  return Reply(c_->Drain(*req, true), out);
}
grpc::Status CoordinatorService::Undrain(grpc::ServerContext* ctx, const v1::DrainRequest* req, v1::DrainReply* out) {
  WSYNC_AUTHORIZE("Undrain", {tls::kAdmin});
  if (grpc::Status g = Gate(); !g.ok()) return g;
  return Reply(c_->Drain(*req, false), out);
}
grpc::Status CoordinatorService::Heartbeat(grpc::ServerContext* ctx, const v1::HeartbeatRequest* req,
                                           v1::HeartbeatReply* out) {
  if (auto a = NodeDaemonIdentity(ctx, "Heartbeat", req->node_id(), nullptr); !a.ok()) return a;
  if (auto l = CheckRequestSize("Heartbeat", *req); !l.ok()) return l;
  if (grpc::Status g = Gate(); !g.ok()) return g;
  *out = c_->Heartbeat(*req);
  return grpc::Status::OK;
}
grpc::Status CoordinatorService::ResumeEngines(grpc::ServerContext* ctx, const v1::ResumeEnginesRequest* req,
                                               v1::ResumeEnginesReply* out) {
  WSYNC_AUTHORIZE("ResumeEngines", {tls::kAdmin});
  if (grpc::Status g = Gate(); !g.ok()) return g;
  return Reply(c_->ResumeEngines(*req), out);
}

grpc::Status CoordinatorService::WatchEngines(grpc::ServerContext* ctx, const v1::WatchEnginesRequest* req,
                                              grpc::ServerWriter<v1::EngineStates>* writer) {
  WSYNC_AUTHORIZE("WatchEngines", WSYNC_ANY_ROLE);
  if (grpc::Status g = Gate(); !g.ok()) return g;
  if (watchers_.fetch_add(1) >= kMaxWatchers) {
    watchers_.fetch_sub(1);
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat("more than ", kMaxWatchers, " WatchEngines streams are open; retry later"));
  }
  struct Release {
    std::atomic<int>& n;
    ~Release() { n.fetch_sub(1); }
  } release{watchers_};
  const double interval = req->interval_seconds() > 0 ? std::max(req->interval_seconds(), 0.05) : 0.2;
  std::string last;
  while (!ctx->IsCancelled()) {
    if (grpc::Status g = Gate(); !g.ok()) return g;  // lost the leadership: clients move to the new leader
    const v1::EngineStates now = EngineStatesOf(c_->Status());
    std::string bytes;
    now.SerializeToString(&bytes);
    if (bytes != last) {
      if (!writer->Write(now)) return grpc::Status::OK;  // the caller went away
      last = std::move(bytes);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(interval * 1000)));
  }
  return grpc::Status::OK;
}

}  // namespace wsync::daemon
