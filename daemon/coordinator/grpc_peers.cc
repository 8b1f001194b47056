// The coordinator's outbound calls: the gRPC implementation of Peers (daemon/coordinator/coordinator.h) that dials
// the node daemons and the engines.
#include <map>
#include <memory>
#include <mutex>
#include <set>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "daemon/common/rpc.h"
#include "daemon/common/serve.h"
#include "daemon/coordinator/coordinator.h"
#include "proto/status_convert.h"
#include "proto/tls.h"
#include "wsync/v1/daemon.grpc.pb.h"
#include "wsync/v1/engine.grpc.pb.h"

namespace wsync::daemon {

namespace {

class GrpcPeers final : public Peers {
 public:
  explicit GrpcPeers(EngineDeadlines d) : d_(d) {}

  absl::StatusOr<v1::ConfigureSourceReply> ConfigureSource(const std::string& addr,
                                                          const v1::ConfigureSourceRequest& req) override {
    return Call<v1::ConfigureSourceReply>(addr, Daemon(addr), &v1::NodeDaemon::Stub::ConfigureSource, req,
                                            PeerDeadlines::kConfigure);
  }
  absl::Status StartUpdate(const std::string& addr, const v1::StartUpdateRequest& req) override {
    return Call<v1::StartUpdateReply>(addr, Daemon(addr), &v1::NodeDaemon::Stub::StartUpdate, req,
                                      PeerDeadlines::kStart).status();
  }
  absl::StatusOr<v1::FinishUpdateReply> FinishUpdate(const std::string& addr,
                                                     const v1::FinishUpdateRequest& req) override {
    return Call<v1::FinishUpdateReply>(addr, Daemon(addr), &v1::NodeDaemon::Stub::FinishUpdate, req,
                                       req.timeout_seconds() + PeerDeadlines::kFinishSlack);
  }
  absl::StatusOr<v1::AbortSourceUpdateReply> AbortSourceUpdate(const std::string& addr,
                                                               const v1::AbortSourceUpdateRequest& req) override {
    return Call<v1::AbortSourceUpdateReply>(addr, Daemon(addr), &v1::NodeDaemon::Stub::AbortSourceUpdate, req,
                                            PeerDeadlines::kAbort);
  }
  absl::StatusOr<v1::SetWriteWindowReply> SetWriteWindow(const std::string& addr,
                                                          const v1::SetWriteWindowRequest& req) override {
    return Call<v1::SetWriteWindowReply>(addr, Daemon(addr), &v1::NodeDaemon::Stub::SetWriteWindow, req,
                                         PeerDeadlines::kStart);
  }
  absl::StatusOr<v1::ApplyDeltaReply> ApplyDelta(const std::string& addr, const v1::ApplyDeltaRequest& req) override {
    return Call<v1::ApplyDeltaReply>(addr, Daemon(addr), &v1::NodeDaemon::Stub::ApplyDelta, req,
                                     PeerDeadlines::kApplyDelta);
  }
  absl::StatusOr<v1::EngineInfo> EngineInfo(const std::string& addr) override {
    return Call<v1::EngineInfo>(addr, Engine(addr), &v1::EngineControl::Stub::GetInfo, v1::GetEngineInfoRequest(),
                                PeerDeadlines::kEngineInfo);
  }
  absl::Status Pause(const std::string& addr, const std::string& mode) override {
    v1::PauseRequest r;
    r.set_mode(mode);
    return Check(Call<v1::EngineReply>(addr, Engine(addr), &v1::EngineControl::Stub::Pause, r, d_.pause));
  }
  absl::Status PostProcess(const std::string& addr, const std::string& version) override {
    v1::PostProcessRequest r;
    r.set_version(version);
    r.set_post_process_quantization(true);
    r.set_post_load_weights(true);
    return Check(Call<v1::EngineReply>(addr, Engine(addr), &v1::EngineControl::Stub::PostProcess, r, d_.post_process));
  }
  absl::Status SetWeightVersion(const std::string& addr, const std::string& version) override {
    v1::SetWeightVersionRequest r;
    r.set_version(version);
    return Check(Call<v1::EngineReply>(addr, Engine(addr), &v1::EngineControl::Stub::SetWeightVersion, r,
                                      PeerDeadlines::kSetVersion));
  }
  absl::Status Continue(const std::string& addr) override {
    return Check(Call<v1::EngineReply>(addr, Engine(addr), &v1::EngineControl::Stub::Continue, v1::ContinueRequest(),
                                      PeerDeadlines::kContinue));
  }
  absl::StatusOr<v1::WriteChecksumsReply> WriteChecksums(const std::string& addr, int64_t version) override {
    v1::WriteChecksumsRequest r;
    r.set_version(version);
    return Call<v1::WriteChecksumsReply>(addr, Daemon(addr), &v1::NodeDaemon::Stub::GetWriteChecksums, r,
                                         PeerDeadlines::kVerify);
  }
  absl::StatusOr<v1::ChecksumReply> EngineChecksums(const std::string& addr, const v1::RankRequest& req) override {
    return Call<v1::ChecksumReply>(addr, Engine(addr), &v1::EngineControl::Stub::GetChecksums, req,
                                   PeerDeadlines::kVerify);
  }
  absl::Status Switch(const std::string& addr, const v1::SwitchRequest& req) override {
    return Check(
        Call<v1::EngineReply>(addr, Engine(addr), &v1::EngineControl::Stub::Switch, req, PeerDeadlines::kSwitch));
  }
  absl::Status PrepareSwitch(const std::string& addr, const v1::SwitchRequest& req) override {
    return Check(Call<v1::EngineReply>(addr, Engine(addr), &v1::EngineControl::Stub::PrepareSwitch, req,
                                       PeerDeadlines::kSwitch));
  }
  void CancelCalls(const std::string& addr) override {
    std::lock_guard<std::mutex> l(mu_);
    auto it = in_flight_.find(addr);
    if (it == in_flight_.end()) return;
    for (grpc::ClientContext* ctx : it->second) ctx->TryCancel();
  }
  void Forget(const std::string& addr) override {
    std::lock_guard<std::mutex> l(mu_);
    daemons_.erase(addr);
    engines_.erase(addr);
  }

 private:
  template <typename Rep, typename Stub, typename Req, typename Method>
  absl::StatusOr<Rep> Call(const std::string& addr, absl::StatusOr<std::shared_ptr<Stub>> stub_or, Method m,
                           const Req& req, double timeout_s) {
    if (!stub_or.ok()) return stub_or.status();
    const std::shared_ptr<Stub>& stub = *stub_or;
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(timeout_s));
    {
      std::lock_guard<std::mutex> l(mu_);
      in_flight_[addr].insert(&ctx);
    }
    Rep out;
    grpc::Status s = ((*stub).*m)(&ctx, req, &out);
    {
      std::lock_guard<std::mutex> l(mu_);
      auto it = in_flight_.find(addr);
      it->second.erase(&ctx);
      if (it->second.empty()) in_flight_.erase(it);
    }
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
  std::map<std::string, std::set<grpc::ClientContext*>> in_flight_;  // calls running, per peer (CancelCalls)

 private:
  EngineDeadlines d_;
};

}  // namespace

std::unique_ptr<Peers> MakeGrpcPeers(EngineDeadlines d) { return std::make_unique<GrpcPeers>(d); }

}  // namespace wsync::daemon
