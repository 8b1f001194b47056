#include "daemon/common/engines/reference_adapter.h"

#include <chrono>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "proto/status_convert.h"
#include "proto/tls.h"
#include "wsync/v1/engine.grpc.pb.h"

namespace wsync::daemon {
namespace {

class ReferenceAdapter final : public EngineAdapter {
 public:
  ReferenceAdapter(std::string address, std::string grpc_target, absl::Duration timeout,
                   std::shared_ptr<grpc::Channel> channel)
      : address_(std::move(address)),
        target_(std::move(grpc_target)),
        timeout_(timeout),
        stub_(v1::EngineControl::NewStub(std::move(channel))) {}

  const std::string& kind() const override { return kind_; }
  const std::string& address() const override { return address_; }
  std::string control_address() const override { return target_; }

  absl::StatusOr<EngineDescription> Describe() override {
    v1::EngineInfo info;
    auto ctx = Context();
    ctx->set_wait_for_ready(true);  // the engine may still be starting
    absl::Status st = FromGrpcStatus(stub_->GetInfo(ctx.get(), v1::GetEngineInfoRequest(), &info));
    if (!st.ok()) return Named(st, "GetInfo");
    EngineDescription d;
    d.engine_id = info.engine_id();
    d.kind = info.kind().empty() ? kind_ : info.kind();
    d.num_ranks = info.num_ranks();
    d.weight_version = info.weight_version();
    d.paused = info.paused();
    return d;
  }
  absl::Status RequestAttach(const AttachInfo& info) override {
    v1::AttachRequest r;
    r.set_socket_path(info.socket_path);
    r.set_engine_id(info.engine_id);
    r.set_token(info.token);
    r.set_mode(info.mode);
    return Call(&v1::EngineControl::Stub::Attach, r, "Attach");
  }
  absl::Status Pause(const std::string& mode) override {
    v1::PauseRequest r;
    r.set_mode(mode);
    return Call(&v1::EngineControl::Stub::Pause, r, "Pause");
  }
  absl::Status PostProcess(const std::string& version) override {
    v1::PostProcessRequest r;
    r.set_version(version);
    r.set_post_process_quantization(true);
    r.set_post_load_weights(true);
    return Call(&v1::EngineControl::Stub::PostProcess, r, "PostProcess");
  }
  absl::Status SetWeightVersion(const std::string& version) override {
    v1::SetWeightVersionRequest r;
    r.set_version(version);
    return Call(&v1::EngineControl::Stub::SetWeightVersion, r, "SetWeightVersion");
  }
  absl::Status Continue() override {
    return Call(&v1::EngineControl::Stub::Continue, v1::ContinueRequest(), "Continue");
  }

 private:
  std::unique_ptr<grpc::ClientContext> Context() const {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout_));
    return ctx;
  }
  absl::Status Named(const absl::Status& st, const char* what) const {
    return absl::Status(st.code(), absl::StrCat("reference engine at ", target_, ": ", what, ": ", st.message()));
  }
  template <typename Req, typename Method>
  absl::Status Call(Method m, const Req& req, const char* what) {
    auto ctx = Context();
    v1::EngineReply out;
    absl::Status st = FromGrpcStatus((stub_.get()->*m)(ctx.get(), req, &out));
    if (!st.ok()) return Named(st, what);
    if (!out.success()) return Named(absl::InternalError(absl::StrCat("engine refused: ", out.message())), what);
    return absl::OkStatus();
  }

  const std::string kind_ = "reference";
  std::string address_, target_;
  absl::Duration timeout_;
  std::unique_ptr<v1::EngineControl::Stub> stub_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<EngineAdapter>> MakeReferenceAdapter(const std::string& address, const std::string& grpc_target,
                                                    absl::Duration call_timeout) {
  auto channel = tls::Dial(grpc_target);  // mTLS with the daemon's certificate (role target) unless insecure
  if (!channel.ok()) return channel.status();
  return std::unique_ptr<EngineAdapter>(
      std::make_unique<ReferenceAdapter>(address, grpc_target, call_timeout, *std::move(channel)));
}

}  // namespace wsync::daemon
