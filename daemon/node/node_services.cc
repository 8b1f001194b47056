#include "daemon/node/node_services.h"

#include <chrono>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "daemon/common/rpc.h"
#include "proto/status_convert.h"
#include "proto/tls.h"
#include "wsync/v1/engine.grpc.pb.h"

namespace wsync::daemon {

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

// Testing aid (base/fault_knob.h): the injected failure or hang of the phase `call`, if one is asked for.
#define WSYNC_FAULT_AT(call)                                                              \
  do {                                                                                    \
    absl::Status f_ = faults_.At(call, [ctx] { return ctx->IsCancelled(); });             \
    if (!f_.ok()) return ToGrpcStatus(f_);                                                \
  } while (0)

grpc::Status TrainerIngestService::BeginPush(grpc::ServerContext* ctx, const v1::BeginPushRequest* req,
                                             v1::BeginPushReply* out) {
  WSYNC_LIMIT("BeginPush");
  // Answer "no update is open" a little before the caller's own deadline passes.
  const CancelFn gone = [ctx] { return ctx->IsCancelled(); };
  if (ctx->deadline() == std::chrono::system_clock::time_point::max())
    return Reply(source_->BeginPush(*req, absl::InfiniteDuration(), gone), out);
  const absl::Duration left = absl::FromChrono(ctx->deadline()) - absl::Now();
  return Reply(source_->BeginPush(*req, left - std::min(left / 10, absl::Milliseconds(200)), gone), out);
}
grpc::Status TrainerIngestService::CommitBucket(grpc::ServerContext* ctx, const v1::CommitBucketRequest* req,
                                                v1::CommitBucketReply* out) {
  WSYNC_LIMIT("CommitBucket");
  return Reply(source_->CommitBucket(*req, [ctx] { return ctx->IsCancelled(); }), out);
}
grpc::Status TrainerIngestService::EndPush(grpc::ServerContext*, const v1::EndPushRequest* req, v1::EndPushReply*) {
  WSYNC_LIMIT("EndPush");
  return ToGrpcStatus(source_->EndPush(*req));
}
grpc::Status TrainerIngestService::CommitPlaced(grpc::ServerContext*, const v1::CommitPlacedRequest* req,
                                                v1::CommitPlacedReply* out) {
  WSYNC_LIMIT("CommitPlaced");
  return Reply(source_->CommitPlaced(*req), out);
}
grpc::Status TrainerIngestService::CloseSession(grpc::ServerContext*, const v1::CloseSessionRequest* req,
                                                v1::CloseSessionReply*) {
  WSYNC_LIMIT("CloseSession");
  return ToGrpcStatus(source_->CloseSession(req->session_id()));
}
namespace {

// The connects to targets (ConfigureSource, StartUpdate's reconnects) end before the caller's deadline, so it hears
// which one failed rather than its own deadline passing.
absl::Time ConnectDeadline(const grpc::ServerContext& ctx) {
  if (ctx.deadline() == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  const absl::Duration left = absl::FromChrono(ctx.deadline()) - absl::Now();
  return absl::Now() + left - std::min(left / 10, absl::Seconds(1));
}

}  // namespace

grpc::Status NodeDaemonService::ConfigureSource(grpc::ServerContext* ctx, const v1::ConfigureSourceRequest* req,
                                                v1::ConfigureSourceReply* out) {
  WSYNC_AUTHORIZE("ConfigureSource", {tls::kCoordinator});
  WSYNC_NEED(Source);
  WSYNC_FAULT_AT("configure");
  return Reply(source_->Configure(*req, ConnectDeadline(*ctx)), out);
}
grpc::Status NodeDaemonService::StartUpdate(grpc::ServerContext* ctx, const v1::StartUpdateRequest* req,
                                            v1::StartUpdateReply*) {
  WSYNC_AUTHORIZE("StartUpdate", {tls::kCoordinator});
  WSYNC_NEED(Source);
  WSYNC_FAULT_AT("start");
  return ToGrpcStatus(source_->StartUpdate(*req, ConnectDeadline(*ctx)));
}
grpc::Status NodeDaemonService::FinishUpdate(grpc::ServerContext* ctx, const v1::FinishUpdateRequest* req,
                                             v1::FinishUpdateReply* out) {
  WSYNC_AUTHORIZE("FinishUpdate", {tls::kCoordinator});
  WSYNC_NEED(Source);
  WSYNC_FAULT_AT("finish");
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
  if (req->open()) WSYNC_FAULT_AT("open_windows");
  *out = target_.load()->SetWriteWindow(*req);
  return grpc::Status::OK;
}
grpc::Status NodeDaemonService::ApplyDelta(grpc::ServerContext* ctx, const v1::ApplyDeltaRequest* req,
                                           v1::ApplyDeltaReply* out) {
  WSYNC_AUTHORIZE("ApplyDelta", {tls::kCoordinator});
  WSYNC_NEED(Target);
  WSYNC_FAULT_AT("apply_delta");
  return Reply(target_.load()->ApplyDelta(*req), out);
}
grpc::Status NodeDaemonService::SetRelay(grpc::ServerContext* ctx, const v1::SetRelayRequest* req,
                                         v1::SetRelayReply* out) {
  WSYNC_AUTHORIZE("SetRelay", {tls::kCoordinator});
  WSYNC_NEED(Target);
  return Reply(target_.load()->SetRelay(*req), out);
}
grpc::Status NodeDaemonService::RelayLanded(grpc::ServerContext* ctx, const v1::RelayLandedRequest* req,
                                            v1::RelayLandedReply*) {
  WSYNC_AUTHORIZE("RelayLanded", {tls::kSource, tls::kTarget});  // a tree's root hears its sources, a child its relay
  WSYNC_NEED(Target);
  return ToGrpcStatus(target_.load()->RelayLanded(*req));
}
grpc::Status NodeDaemonService::RelayDrain(grpc::ServerContext* ctx, const v1::RelayDrainRequest* req,
                                           v1::RelayDrainReply* out) {
  WSYNC_AUTHORIZE("RelayDrain", {tls::kCoordinator});
  WSYNC_NEED(Target);
  return Reply(target_.load()->RelayDrain(*req), out);
}
grpc::Status NodeDaemonService::ConnectTarget(grpc::ServerContext* ctx, const v1::ConnectTargetRequest* req,
                                              v1::ConnectTargetReply* out) {
  tls::Peer peer;
  // A relay (a target daemon) connects to its children as a source does; its grant is bound to its identity.
  if (auto a = tls::Authorize(ctx, "ConnectTarget", {tls::kSource, tls::kTarget}, &peer); !a.ok()) return a;
  WSYNC_LIMIT("ConnectTarget");
  WSYNC_NEED(Target);
  return Reply(target_.load()->ConnectTarget(*req, peer.authenticated ? peer.Describe() : std::string()), out);
}
grpc::Status NodeDaemonService::GetNodeStatus(grpc::ServerContext* ctx, const v1::NodeStatusRequest* req, v1::NodeStatus* out) {
  WSYNC_AUTHORIZE("GetNodeStatus", WSYNC_ANY_ROLE);
  if (source_ != nullptr) {
    *out = source_->Status();
    return grpc::Status::OK;
  }
  WSYNC_NEED(Target);
  *out = target_.load()->Status();
  return grpc::Status::OK;
}

grpc::Status NodeDaemonService::GetWriteChecksums(grpc::ServerContext* ctx, const v1::WriteChecksumsRequest* req,
                                                  v1::WriteChecksumsReply* out) {
  WSYNC_AUTHORIZE("GetWriteChecksums", {tls::kAdmin, tls::kTrainer, tls::kCoordinator});  // staged updates verify
  // A source: what it wrote; a target: what its relays forwarded into their children (relay trees).
  if (source_ != nullptr) return Reply(source_->WriteChecksums(req->version()), out);
  WSYNC_NEED(Target);
  return Reply(target_.load()->WriteChecksums(req->version()), out);
}

namespace {

class EngineFacade final : public v1::EngineControl::Service {
 public:
  EngineFacade(TargetNode* target, std::string engine_id) : t_(target), id_(std::move(engine_id)) {}

  grpc::Status GetInfo(grpc::ServerContext* ctx, const v1::GetEngineInfoRequest* req, v1::EngineInfo* out) override {
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
  grpc::Status Continue(grpc::ServerContext* ctx, const v1::ContinueRequest* req, v1::EngineReply* out) override {
    WSYNC_AUTHORIZE("Continue", {tls::kCoordinator});
    return Done(t_->Continue(id_), out);
  }
  grpc::Status Attach(grpc::ServerContext* ctx, const v1::AttachRequest* req, v1::EngineReply*) override {
    WSYNC_AUTHORIZE("Attach", {tls::kTarget});
    return ToGrpcStatus(absl::FailedPreconditionError(
        absl::StrCat("engine ", id_, " is attached through its target daemon; its ranks attach themselves")));
  }
  grpc::Status GetChecksums(grpc::ServerContext* ctx, const v1::RankRequest* req, v1::ChecksumReply* out) override {
    WSYNC_AUTHORIZE("GetChecksums", {tls::kAdmin, tls::kTrainer, tls::kCoordinator});  // staged updates verify
    return Reply(t_->Checksums(id_, *req), out);
  }
  // Staged updates of an engine that stages in place (vLLM): the switch checks the verified bytes; its
  // PostProcess (the reload) makes them live.
  grpc::Status Switch(grpc::ServerContext* ctx, const v1::SwitchRequest* req, v1::EngineReply* out) override {
    WSYNC_AUTHORIZE("Switch", {tls::kCoordinator});
    return Done(t_->Switch(id_, *req, /*prepare=*/false), out);
  }
  grpc::Status PrepareSwitch(grpc::ServerContext* ctx, const v1::SwitchRequest* req, v1::EngineReply* out) override {
    WSYNC_AUTHORIZE("PrepareSwitch", {tls::kCoordinator});
    return Done(t_->Switch(id_, *req, /*prepare=*/true), out);
  }
  grpc::Status Verify(grpc::ServerContext* ctx, const v1::VerifyRequest* req, v1::VerifyReply*) override {
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

}  // namespace wsync::daemon
