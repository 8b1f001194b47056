#include "daemon/coordinator/coordinator_service.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "absl/time/clock.h"

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
grpc::Status CoordinatorService::ReportUpdateFailure(grpc::ServerContext* ctx,
                                                     const v1::ReportUpdateFailureRequest* req,
                                                     v1::ReportUpdateFailureReply* out) {
  static const std::string kSourceRole = tls::kSource;
  if (auto a = NodeDaemonIdentity(ctx, "ReportUpdateFailure", req->node_id(), &kSourceRole); !a.ok()) return a;
  if (auto l = CheckRequestSize("ReportUpdateFailure", *req); !l.ok()) return l;
  if (grpc::Status g = Gate(); !g.ok()) return g;
  *out = c_->ReportUpdateFailure(*req);
  return grpc::Status::OK;
}
grpc::Status CoordinatorService::ResumeEngines(grpc::ServerContext* ctx, const v1::ResumeEnginesRequest* req,
                                               v1::ResumeEnginesReply* out) {
  WSYNC_AUTHORIZE("ResumeEngines", {tls::kAdmin});
  if (grpc::Status g = Gate(); !g.ok()) return g;
  return Reply(c_->ResumeEngines(*req), out);
}

std::string WatcherIdentity(const grpc::ServerContext* ctx) {
  const tls::Peer p = tls::PeerOf(ctx);
  if (p.authenticated) return p.Describe();
  // Insecure (loopback development): the peer's host, without its port (one client, several connections).
  const std::string peer = ctx->peer();
  const size_t colon = peer.rfind(':');
  return colon == std::string::npos ? peer : peer.substr(0, colon);
}

bool CoordinatorService::TakeWatchSlot(const std::string& who, std::string* refused) {
  MutexLock l(&watch_mu_);
  if (watchers_ >= kMaxWatchers) {
    *refused = absl::StrCat("more than ", kMaxWatchers, " WatchEngines streams are open; retry later");
    return false;
  }
  int& mine = watchers_by_identity_[who];
  if (mine >= kMaxWatchersPerIdentity) {
    *refused = absl::StrCat(who, " already holds ", kMaxWatchersPerIdentity,
                            " WatchEngines streams (the most one identity may hold); close one first");
    if (mine == 0) watchers_by_identity_.erase(who);
    return false;
  }
  ++mine;
  ++watchers_;
  return true;
}

void CoordinatorService::ReleaseWatchSlot(const std::string& who) {
  MutexLock l(&watch_mu_);
  --watchers_;
  if (--watchers_by_identity_[who] <= 0) watchers_by_identity_.erase(who);
}

double WatchInterval(double asked) {
  if (!(asked > 0)) return CoordinatorService::kDefaultWatchInterval;  // also NaN
  return std::clamp(asked, CoordinatorService::kMinWatchInterval, CoordinatorService::kMaxWatchInterval);
}

grpc::Status CoordinatorService::WatchEngines(grpc::ServerContext* ctx, const v1::WatchEnginesRequest* req,
                                              grpc::ServerWriter<v1::EngineStates>* writer) {
  WSYNC_AUTHORIZE("WatchEngines", WSYNC_ANY_ROLE);
  if (grpc::Status g = Gate(); !g.ok()) return g;
  const std::string who = WatcherIdentity(ctx);
  std::string refused;
  if (!TakeWatchSlot(who, &refused)) return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, refused);
  struct Release {
    CoordinatorService* s;
    const std::string& who;
    ~Release() { s->ReleaseWatchSlot(who); }
  } release{this, who};
  // At most one message per interval: changes within it are coalesced into the next one.
  const absl::Duration interval = absl::Seconds(WatchInterval(req->interval_seconds()));
  // How long one wait lasts at most: cancellation and a lost leadership are seen within it.
  const absl::Duration slice = absl::Milliseconds(250);
  std::string last;
  bool sent = false;
  uint64_t gen = c_->ChangeGeneration();
  bool changed = true;
  absl::Time next_send = absl::InfinitePast();
  while (!ctx->IsCancelled()) {
    if (grpc::Status g = Gate(); !g.ok()) return g;  // lost the leadership: clients move to the new leader
    const absl::Time now = absl::Now();
    if (changed && now >= next_send) {
      gen = c_->ChangeGeneration();  // before the read: a change during it is seen at the next wait
      const v1::EngineStates states = c_->EngineStates();
      std::string bytes;
      states.SerializeToString(&bytes);
      if (!sent || bytes != last) {  // the first one always: an empty fleet's states serialize to nothing
        if (!writer->Write(states)) return grpc::Status::OK;  // the caller went away
        sent = true;
        last = std::move(bytes);
        next_send = absl::Now() + interval;
      }
      changed = false;
    }
    const absl::Duration wait =
        changed ? std::min(slice, std::max(next_send - absl::Now(), absl::ZeroDuration())) : slice;
    const uint64_t seen = c_->WaitForChange(gen, wait);
    if (seen != gen) {
      changed = true;
      gen = seen;
    }
  }
  return grpc::Status::OK;
}

}  // namespace wsync::daemon
