#include "daemon/services.h"
#include "daemon/serve.h"

#include <chrono>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "proto/status_convert.h"
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

#define WSYNC_NEED(role)                    \
  do {                                      \
    grpc::Status s_ = Need##role();         \
    if (!s_.ok()) return s_;                \
  } while (0)

grpc::Status TrainerIngestService::BeginPush(grpc::ServerContext* ctx, const v1::BeginPushRequest* req,
                                             v1::BeginPushReply* out) {
  // Answer "no update is open" a little before the caller's own deadline passes.
  if (ctx->deadline() == std::chrono::system_clock::time_point::max()) return Reply(source_->BeginPush(*req), out);
  const absl::Duration left = absl::FromChrono(ctx->deadline()) - absl::Now();
  return Reply(source_->BeginPush(*req, left - std::min(left / 10, absl::Milliseconds(200))), out);
}
grpc::Status TrainerIngestService::CommitBucket(grpc::ServerContext*, const v1::CommitBucketRequest* req,
                                                v1::CommitBucketReply* out) {
  return Reply(source_->CommitBucket(*req), out);
}
grpc::Status TrainerIngestService::EndPush(grpc::ServerContext*, const v1::EndPushRequest* req, v1::EndPushReply*) {
  return ToGrpcStatus(source_->EndPush(*req));
}
grpc::Status TrainerIngestService::CloseSession(grpc::ServerContext*, const v1::CloseSessionRequest* req,
                                                v1::CloseSessionReply*) {
  return ToGrpcStatus(source_->CloseSession(req->session_id()));
}
grpc::Status NodeDaemonService::ConfigureSource(grpc::ServerContext*, const v1::ConfigureSourceRequest* req,
                                                v1::ConfigureSourceReply* out) {
  WSYNC_NEED(Source);
  return Reply(source_->Configure(*req), out);
}
grpc::Status NodeDaemonService::StartUpdate(grpc::ServerContext*, const v1::StartUpdateRequest* req,
                                            v1::StartUpdateReply*) {
  WSYNC_NEED(Source);
  return ToGrpcStatus(source_->StartUpdate(*req));
}
grpc::Status NodeDaemonService::FinishUpdate(grpc::ServerContext*, const v1::FinishUpdateRequest* req,
                                             v1::FinishUpdateReply* out) {
  WSYNC_NEED(Source);
  return Reply(source_->FinishUpdate(*req), out);
}
grpc::Status NodeDaemonService::AbortSourceUpdate(grpc::ServerContext*, const v1::AbortSourceUpdateRequest* req,
                                                  v1::AbortSourceUpdateReply* out) {
  WSYNC_NEED(Source);
  return Reply(source_->AbortUpdate(*req), out);
}
grpc::Status NodeDaemonService::SetWriteWindow(grpc::ServerContext*, const v1::SetWriteWindowRequest* req,
                                               v1::SetWriteWindowReply* out) {
  WSYNC_NEED(Target);
  *out = target_.load()->SetWriteWindow(*req);
  return grpc::Status::OK;
}
grpc::Status NodeDaemonService::ConnectTarget(grpc::ServerContext*, const v1::ConnectTargetRequest* req,
                                              v1::ConnectTargetReply* out) {
  WSYNC_NEED(Target);
  return Reply(target_.load()->ConnectTarget(*req), out);
}
grpc::Status NodeDaemonService::GetNodeStatus(grpc::ServerContext*, const v1::NodeStatusRequest*, v1::NodeStatus* out) {
  if (source_ != nullptr) {
    *out = source_->Status();
    return grpc::Status::OK;
  }
  WSYNC_NEED(Target);
  *out = target_.load()->Status();
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::RegisterNode(grpc::ServerContext*, const v1::RegisterNodeRequest* req,
                                              v1::RegisterNodeReply* out) {
  return Reply(c_->RegisterNode(*req), out);
}
grpc::Status CoordinatorService::GetClusterStatus(grpc::ServerContext*, const v1::ClusterStatusRequest*,
                                                  v1::ClusterStatus* out) {
  *out = c_->Status();
  return grpc::Status::OK;
}
grpc::Status CoordinatorService::BeginUpdate(grpc::ServerContext*, const v1::BeginUpdateRequest* req,
                                             v1::BeginUpdateReply* out) {
  return Reply(c_->BeginUpdate(*req), out);
}
grpc::Status CoordinatorService::CommitUpdate(grpc::ServerContext*, const v1::CommitUpdateRequest* req,
                                              v1::CommitUpdateReply* out) {
  return Reply(c_->CommitUpdate(*req), out);
}
grpc::Status CoordinatorService::GetHistory(grpc::ServerContext*, const v1::HistoryRequest* req,
                                            v1::HistoryReply* out) {
  *out = c_->History(*req);
  return grpc::Status::OK;
}
grpc::Status CoordinatorService::AbortUpdate(grpc::ServerContext*, const v1::AbortUpdateRequest* req,
                                             v1::AbortUpdateReply* out) {
  return Reply(c_->AbortUpdate(*req), out);
}
grpc::Status CoordinatorService::RemoveNode(grpc::ServerContext*, const v1::RemoveNodeRequest* req,
                                            v1::RemoveNodeReply* out) {
  return Reply(c_->RemoveNode(*req), out);
}
grpc::Status CoordinatorService::Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* req,
                                           v1::HeartbeatReply* out) {
  *out = c_->Heartbeat(*req);
  return grpc::Status::OK;
}
grpc::Status CoordinatorService::ResumeEngines(grpc::ServerContext*, const v1::ResumeEnginesRequest* req,
                                               v1::ResumeEnginesReply* out) {
  return Reply(c_->ResumeEngines(*req), out);
}

namespace {

class EngineFacade final : public v1::EngineControl::Service {
 public:
  EngineFacade(TargetNode* target, std::string engine_id) : t_(target), id_(std::move(engine_id)) {}

  grpc::Status GetInfo(grpc::ServerContext*, const v1::GetEngineInfoRequest*, v1::EngineInfo* out) override {
    return Reply(t_->EngineInfo(id_), out);
  }
  grpc::Status GetParallelism(grpc::ServerContext*, const v1::RankRequest* req, v1::RankParallelism* out) override {
    auto l = t_->Layout(id_, req->rank());
    if (!l.ok()) return ToGrpcStatus(l.status());
    *out = l->parallelism();
    return grpc::Status::OK;
  }
  grpc::Status GetWeightLayout(grpc::ServerContext*, const v1::RankRequest* req, v1::RankLayout* out) override {
    return Reply(t_->Layout(id_, req->rank()), out);
  }
  grpc::Status Pause(grpc::ServerContext*, const v1::PauseRequest* req, v1::EngineReply* out) override {
    return Done(t_->Pause(id_, req->mode()), out);
  }
  grpc::Status PostProcess(grpc::ServerContext*, const v1::PostProcessRequest* req, v1::EngineReply* out) override {
    return Done(t_->PostProcess(id_, req->version()), out);
  }
  grpc::Status SetWeightVersion(grpc::ServerContext*, const v1::SetWeightVersionRequest* req,
                                v1::EngineReply* out) override {
    return Done(t_->SetWeightVersion(id_, req->version()), out);
  }
  grpc::Status Continue(grpc::ServerContext*, const v1::ContinueRequest*, v1::EngineReply* out) override {
    return Done(t_->Continue(id_), out);
  }
  grpc::Status Attach(grpc::ServerContext*, const v1::AttachRequest*, v1::EngineReply*) override {
    return ToGrpcStatus(absl::FailedPreconditionError(
        absl::StrCat("engine ", id_, " is attached through its target daemon; its ranks attach themselves")));
  }
  grpc::Status GetChecksums(grpc::ServerContext*, const v1::RankRequest*, v1::ChecksumReply*) override {
    return Unimplemented("GetChecksums");
  }
  grpc::Status Verify(grpc::ServerContext*, const v1::VerifyRequest*, v1::VerifyReply*) override {
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
  auto stub = v1::NodeDaemon::NewStub(grpc::CreateChannel(target_daemon, grpc::InsecureChannelCredentials()));
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

 private:
  template <typename Rep, typename Stub, typename Req, typename Method>
  static absl::StatusOr<Rep> Call(Stub* stub, Method m, const Req& req, double timeout_s) {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(timeout_s));
    Rep out;
    grpc::Status s = (stub->*m)(&ctx, req, &out);
    if (!s.ok()) return FromGrpcStatus(s);
    return out;
  }
  static absl::Status Check(absl::StatusOr<v1::EngineReply> r) {
    if (!r.ok()) return r.status();
    if (!r->success()) return absl::InternalError(absl::StrCat("engine refused: ", r->message()));
    return absl::OkStatus();
  }
  v1::NodeDaemon::Stub* Daemon(const std::string& addr) {
    std::lock_guard<std::mutex> l(mu_);
    auto& s = daemons_[addr];
    if (!s) s = v1::NodeDaemon::NewStub(Channel(addr));
    return s.get();
  }
  v1::EngineControl::Stub* Engine(const std::string& addr) {
    std::lock_guard<std::mutex> l(mu_);
    auto& s = engines_[addr];
    if (!s) s = v1::EngineControl::NewStub(Channel(addr));
    return s.get();
  }
  static std::shared_ptr<grpc::Channel> Channel(const std::string& addr) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(kMaxControlMessageBytes);
    args.SetMaxSendMessageSize(kMaxControlMessageBytes);
    return grpc::CreateCustomChannel(addr, grpc::InsecureChannelCredentials(), args);
  }
  std::mutex mu_;
  std::map<std::string, std::unique_ptr<v1::NodeDaemon::Stub>> daemons_;
  std::map<std::string, std::unique_ptr<v1::EngineControl::Stub>> engines_;

 private:
  EngineDeadlines d_;
};

}  // namespace

std::unique_ptr<Peers> MakeGrpcPeers(EngineDeadlines d) { return std::make_unique<GrpcPeers>(d); }

}  // namespace wsync::daemon
