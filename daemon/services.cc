#include "daemon/services.h"
#include "daemon/serve.h"

#include <chrono>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "proto/status_convert.h"
#include "proto/tls.h"
#include "wsync/v1/engine.grpc.pb.h"

namespace wsync::daemon {
namespace {

// Copies a StatusOr's value into the reply or converts its error.
template <typename T>
grpc::Status Reply(absl::StatusOr<T> r, T* out) {
  if (!r.ok()) return ToGrpcStatus(r.status());
  *out = *std::move(r);
  return grpc::Status::OK;
}

std::chrono::system_clock::time_point Deadline(double seconds) {
  return std::chrono::system_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

}  // namespace

grpc::Status NodeDaemonService::NeedSource() const {
  return source_ ? grpc::Status::OK
                 : grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "this wsyncd runs the target role");
}
grpc::Status NodeDaemonService::NeedTarget() const {
  if (target_ != nullptr) return grpc::Status::OK;
  return source_ ? grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "this wsyncd runs the source role")
                 : grpc::Status(grpc::StatusCode::UNAVAILABLE, "this target wsyncd is still attaching its engines");
}

// Role check first (before any validation or state access): PERMISSION_DENIED for a caller whose certificate's role
// is not allowed (docs/security.md, "Roles"). No check on an insecure (loopback development) server.
#define WSYNC_AUTHORIZE(rpc, ...)                                                  \
  do {                                                                            \
    grpc::Status a_ = tls::Authorize(ctx, rpc, __VA_ARGS__);                      \
    if (!a_.ok()) return a_;                                                      \
  } while (0)

#define WSYNC_NEED(role)                    \
  do {                                      \
    grpc::Status s_ = Need##role();         \
    if (!s_.ok()) return s_;                \
  } while (0)

grpc::Status TrainerIngestService::BeginPush(grpc::ServerContext* ctx, const v1::BeginPushRequest* req,
                                             v1::BeginPushReply* out) {
  // Answer "no update is open" a little before the caller's own deadline passes.
  const CancelFn gone = [ctx] { return ctx->IsCancelled(); };
  if (ctx->deadline() == std::chrono::system_clock::time_point::max())
    return Reply(source_->BeginPush(*req, absl::InfiniteDuration(), gone), out);
  const absl::Duration left = absl::FromChrono(ctx->deadline()) - absl::Now();
  return Reply(source_->BeginPush(*req, left - std::min(left / 10, absl::Milliseconds(200)), gone), out);
}
grpc::Status TrainerIngestService::CommitBucket(grpc::ServerContext* ctx, const v1::CommitBucketRequest* req,
                                                v1::CommitBucketReply* out) {
  return Reply(source_->CommitBucket(*req, [ctx] { return ctx->IsCancelled(); }), out);
}
grpc::Status TrainerIngestService::EndPush(grpc::ServerContext*, const v1::EndPushRequest* req, v1::EndPushReply*) {
  return ToGrpcStatus(source_->EndPush(*req));
}
grpc::Status TrainerIngestService::CloseSession(grpc::ServerContext*, const v1::CloseSessionRequest* req,
                                                v1::CloseSessionReply*) {
  return ToGrpcStatus(source_->CloseSession(req->session_id()));
}
grpc::Status NodeDaemonService::ConfigureSource(grpc::ServerContext* ctx, const v1::ConfigureSourceRequest* req,
                                                v1::ConfigureSourceReply* out) {
  WSYNC_AUTHORIZE("ConfigureSource", {tls::kCoordinator});
  WSYNC_NEED(Source);
  return Reply(source_->Configure(*req), out);
}
grpc::Status NodeDaemonService::StartUpdate(grpc::ServerContext* ctx, const v1::StartUpdateRequest* req,
                                            v1::StartUpdateReply*) {
  WSYNC_AUTHORIZE("StartUpdate", {tls::kCoordinator});
  WSYNC_NEED(Source);
  return ToGrpcStatus(source_->StartUpdate(*req));
}
grpc::Status NodeDaemonService::FinishUpdate(grpc::ServerContext* ctx, const v1::FinishUpdateRequest* req,
                                             v1::FinishUpdateReply* out) {
  WSYNC_AUTHORIZE("FinishUpdate", {tls::kCoordinator});
  WSYNC_NEED(Source);
  return Reply(source_->FinishUpdate(*req, [ctx] { return ctx->IsCancelled(); }), out);
}
grpc::Status NodeDaemonService::AbortSourceUpdate(grpc::ServerContext* ctx, const v1::AbortSourceUpdateRequest* req,
                                                  v1::AbortSourceUpdateReply* out) {
  WSYNC_AUTHORIZE("AbortSourceUpdate", {tls::kCoordinator});
  WSYNC_NEED(Source);
  return Reply(source_->AbortUpdate(*req), out);
}
grpc::Status NodeDaemonService::SetWriteWindow(grpc::ServerContext* ctx, const v1::SetWriteWindowRequest* req,
                                               v1::SetWriteWindowReply* out) {
  WSYNC_AUTHORIZE("SetWriteWindow", {tls::kCoordinator});
  WSYNC_NEED(Target);
  *out = target_.load()->SetWriteWindow(*req);
  return grpc::Status::OK;
}
grpc::Status NodeDaemonService::ConnectTarget(grpc::ServerContext* ctx, const v1::ConnectTargetRequest* req,
                                              v1::ConnectTargetReply* out) {
  tls::Peer peer;
  if (auto a = tls::Authorize(ctx, "ConnectTarget", {tls::kSource}, &peer); !a.ok()) return a;
  WSYNC_NEED(Target);
  return Reply(target_.load()->ConnectTarget(*req, peer.authenticated ? peer.Describe() : std::string()), out);
}
grpc::Status NodeDaemonService::GetNodeStatus(grpc::ServerContext* ctx, const v1::NodeStatusRequest*, v1::NodeStatus* out) {
  WSYNC_AUTHORIZE("GetNodeStatus", WSYNC_ANY_ROLE);
  if (source_ != nullptr) {
    *out = source_->Status();
    return grpc::Status::OK;
  }
  WSYNC_NEED(Target);
  *out = target_.load()->Status();
  return grpc::Status::OK;
}

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
  if (!tls::Enabled() && !tls::IsLoopback(req->address()))
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("node ", req->node_id(), " registers address ", req->address(),
                                     ", which is not loopback: this coordinator runs without TLS (loopback development "
                                     "only) and dials nobody else"));
  if (grpc::Status g = Gate(); !g.ok()) return g;
  return Reply(c_->RegisterNode(*req), out);
}
grpc::Status CoordinatorService::GetClusterStatus(grpc::ServerContext* ctx, const v1::ClusterStatusRequest*,
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
grpc::Status CoordinatorService::Heartbeat(grpc::ServerContext* ctx, const v1::HeartbeatRequest* req,
                                           v1::HeartbeatReply* out) {
  if (auto a = NodeDaemonIdentity(ctx, "Heartbeat", req->node_id(), nullptr); !a.ok()) return a;
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

namespace {

class EngineFacade final : public v1::EngineControl::Service {
 public:
  EngineFacade(TargetNode* target, std::string engine_id) : t_(target), id_(std::move(engine_id)) {}

  grpc::Status GetInfo(grpc::ServerContext* ctx, const v1::GetEngineInfoRequest*, v1::EngineInfo* out) override {
    WSYNC_AUTHORIZE("GetInfo", WSYNC_ANY_ROLE);
    return Reply(t_->EngineInfo(id_), out);
  }
  grpc::Status GetParallelism(grpc::ServerContext* ctx, const v1::RankRequest* req, v1::RankParallelism* out) override {
    WSYNC_AUTHORIZE("GetParallelism", WSYNC_ANY_ROLE);
    auto l = t_->Layout(id_, req->rank());
    if (!l.ok()) return ToGrpcStatus(l.status());
    *out = l->parallelism();
    return grpc::Status::OK;
  }
  grpc::Status GetWeightLayout(grpc::ServerContext* ctx, const v1::RankRequest* req, v1::RankLayout* out) override {
    WSYNC_AUTHORIZE("GetWeightLayout", WSYNC_ANY_ROLE);
    return Reply(t_->Layout(id_, req->rank()), out);
  }
  grpc::Status Pause(grpc::ServerContext* ctx, const v1::PauseRequest* req, v1::EngineReply* out) override {
    WSYNC_AUTHORIZE("Pause", {tls::kCoordinator});
    return Done(t_->Pause(id_, req->mode()), out);
  }
  grpc::Status PostProcess(grpc::ServerContext* ctx, const v1::PostProcessRequest* req, v1::EngineReply* out) override {
    WSYNC_AUTHORIZE("PostProcess", {tls::kCoordinator});
    return Done(t_->PostProcess(id_, req->version()), out);
  }
  grpc::Status SetWeightVersion(grpc::ServerContext* ctx, const v1::SetWeightVersionRequest* req,
                                v1::EngineReply* out) override {
    WSYNC_AUTHORIZE("SetWeightVersion", {tls::kCoordinator});
    return Done(t_->SetWeightVersion(id_, req->version()), out);
  }
  grpc::Status Continue(grpc::ServerContext* ctx, const v1::ContinueRequest*, v1::EngineReply* out) override {
    WSYNC_AUTHORIZE("Continue", {tls::kCoordinator});
    return Done(t_->Continue(id_), out);
  }
  grpc::Status Attach(grpc::ServerContext* ctx, const v1::AttachRequest*, v1::EngineReply*) override {
    WSYNC_AUTHORIZE("Attach", {tls::kTarget});
    return ToGrpcStatus(absl::FailedPreconditionError(
        absl::StrCat("engine ", id_, " is attached through its target daemon; its ranks attach themselves")));
  }
  grpc::Status GetChecksums(grpc::ServerContext* ctx, const v1::RankRequest*, v1::ChecksumReply*) override {
    WSYNC_AUTHORIZE("GetChecksums", {tls::kAdmin, tls::kTrainer});
    return Unimplemented("GetChecksums");
  }
  grpc::Status Verify(grpc::ServerContext* ctx, const v1::VerifyRequest*, v1::VerifyReply*) override {
    WSYNC_AUTHORIZE("Verify", {tls::kAdmin, tls::kTrainer});
    return Unimplemented("Verify");
  }

 private:
  static grpc::Status Done(const absl::Status& st, v1::EngineReply* out) {
    if (!st.ok()) return ToGrpcStatus(st);
    out->set_success(true);
    return grpc::Status::OK;
  }
  grpc::Status Unimplemented(const char* what) const {
    return ToGrpcStatus(absl::UnimplementedError(
        absl::StrCat(what, " is a reference-engine diagnostic; engine ", id_,
                     " is served through the target daemon's facade, which has no independent loader to check with")));
  }
  TargetNode* t_;
  std::string id_;
};

}  // namespace

std::unique_ptr<grpc::Service> MakeEngineFacade(TargetNode* target, std::string engine_id) {
  return std::make_unique<EngineFacade>(target, std::move(engine_id));
}

absl::StatusOr<std::string> DialConnectTarget(const std::string& target_daemon, const v1::ConnectTargetRequest& req) {
  WSYNC_ASSIGN_OR_RETURN(auto channel, tls::Dial(target_daemon, kMaxControlMessageBytes));
  auto stub = v1::NodeDaemon::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(60));
  v1::ConnectTargetReply out;
  grpc::Status s = stub->ConnectTarget(&ctx, req, &out);
  if (!s.ok()) return FromGrpcStatus(s);
  return out.target_endpoint_info();
}

namespace {

class GrpcPeers final : public Peers {
 public:
  explicit GrpcPeers(EngineDeadlines d) : d_(d) {}

  absl::StatusOr<v1::ConfigureSourceReply> ConfigureSource(const std::string& addr,
                                                          const v1::ConfigureSourceRequest& req) override {
    return Call<v1::ConfigureSourceReply>(Daemon(addr), &v1::NodeDaemon::Stub::ConfigureSource, req,
                                            PeerDeadlines::kConfigure);
  }
  absl::Status StartUpdate(const std::string& addr, const v1::StartUpdateRequest& req) override {
    return Call<v1::StartUpdateReply>(Daemon(addr), &v1::NodeDaemon::Stub::StartUpdate, req,
                                      PeerDeadlines::kStart).status();
  }
  absl::StatusOr<v1::FinishUpdateReply> FinishUpdate(const std::string& addr,
                                                     const v1::FinishUpdateRequest& req) override {
    return Call<v1::FinishUpdateReply>(Daemon(addr), &v1::NodeDaemon::Stub::FinishUpdate, req,
                                       req.timeout_seconds() + PeerDeadlines::kFinishSlack);
  }
  absl::StatusOr<v1::AbortSourceUpdateReply> AbortSourceUpdate(const std::string& addr,
                                                               const v1::AbortSourceUpdateRequest& req) override {
    return Call<v1::AbortSourceUpdateReply>(Daemon(addr), &v1::NodeDaemon::Stub::AbortSourceUpdate, req,
                                            PeerDeadlines::kAbort);
  }
  absl::StatusOr<v1::SetWriteWindowReply> SetWriteWindow(const std::string& addr,
                                                          const v1::SetWriteWindowRequest& req) override {
    return Call<v1::SetWriteWindowReply>(Daemon(addr), &v1::NodeDaemon::Stub::SetWriteWindow, req,
                                         PeerDeadlines::kStart);
  }
  absl::StatusOr<v1::EngineInfo> EngineInfo(const std::string& addr) override {
    return Call<v1::EngineInfo>(Engine(addr), &v1::EngineControl::Stub::GetInfo, v1::GetEngineInfoRequest(),
                                PeerDeadlines::kEngineInfo);
  }
  absl::Status Pause(const std::string& addr, const std::string& mode) override {
    v1::PauseRequest r;
    r.set_mode(mode);
    return Check(Call<v1::EngineReply>(Engine(addr), &v1::EngineControl::Stub::Pause, r, d_.pause));
  }
  absl::Status PostProcess(const std::string& addr, const std::string& version) override {
    v1::PostProcessRequest r;
    r.set_version(version);
    r.set_post_process_quantization(true);
    r.set_post_load_weights(true);
    return Check(Call<v1::EngineReply>(Engine(addr), &v1::EngineControl::Stub::PostProcess, r, d_.post_process));
  }
  absl::Status SetWeightVersion(const std::string& addr, const std::string& version) override {
    v1::SetWeightVersionRequest r;
    r.set_version(version);
    return Check(Call<v1::EngineReply>(Engine(addr), &v1::EngineControl::Stub::SetWeightVersion, r,
                                      PeerDeadlines::kSetVersion));
  }
  absl::Status Continue(const std::string& addr) override {
    return Check(Call<v1::EngineReply>(Engine(addr), &v1::EngineControl::Stub::Continue, v1::ContinueRequest(),
                                      PeerDeadlines::kContinue));
  }
  void Forget(const std::string& addr) override {
    std::lock_guard<std::mutex> l(mu_);
    daemons_.erase(addr);
    engines_.erase(addr);
  }

 private:
  template <typename Rep, typename Stub, typename Req, typename Method>
  static absl::StatusOr<Rep> Call(absl::StatusOr<std::shared_ptr<Stub>> stub_or, Method m, const Req& req,
                                  double timeout_s) {
    if (!stub_or.ok()) return stub_or.status();
    const std::shared_ptr<Stub>& stub = *stub_or;
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(timeout_s));
    Rep out;
    grpc::Status s = ((*stub).*m)(&ctx, req, &out);
    if (!s.ok()) return FromGrpcStatus(s);
    return out;
  }
  static absl::Status Check(absl::StatusOr<v1::EngineReply> r) {
    if (!r.ok()) return r.status();
    if (!r->success()) return absl::InternalError(absl::StrCat("engine refused: ", r->message()));
    return absl::OkStatus();
  }
  // Stubs are shared: Forget may drop one while a call on it is still running.
  absl::StatusOr<std::shared_ptr<v1::NodeDaemon::Stub>> Daemon(const std::string& addr) {
    std::lock_guard<std::mutex> l(mu_);
    auto& s = daemons_[addr];
    if (!s) {
      WSYNC_ASSIGN_OR_RETURN(auto channel, tls::Dial(addr, kMaxControlMessageBytes));
      s = v1::NodeDaemon::NewStub(channel);
    }
    return s;
  }
  absl::StatusOr<std::shared_ptr<v1::EngineControl::Stub>> Engine(const std::string& addr) {
    std::lock_guard<std::mutex> l(mu_);
    auto& s = engines_[addr];
    if (!s) {
      WSYNC_ASSIGN_OR_RETURN(auto channel, tls::Dial(addr, kMaxControlMessageBytes));
      s = v1::EngineControl::NewStub(channel);
    }
    return s;
  }
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<v1::NodeDaemon::Stub>> daemons_;
  std::map<std::string, std::shared_ptr<v1::EngineControl::Stub>> engines_;

 private:
  EngineDeadlines d_;
};

}  // namespace

std::unique_ptr<Peers> MakeGrpcPeers(EngineDeadlines d) { return std::make_unique<GrpcPeers>(d); }

}  // namespace wsync::daemon
