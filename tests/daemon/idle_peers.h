#pragma once
// Peers for coordinator tests that run no real update: every call answers OK at once (EngineInfo with the model
// given). Tests override what they observe or script.

#include <string>

#include "daemon/coordinator/coordinator.h"

namespace wsync::testing {

class IdlePeers : public daemon::Peers {
 public:
  explicit IdlePeers(std::string config_json = "") : config_json(std::move(config_json)) {}
  absl::StatusOr<v1::ConfigureSourceReply> ConfigureSource(const std::string&,
                                                           const v1::ConfigureSourceRequest&) override {
    return v1::ConfigureSourceReply();
  }
  absl::Status StartUpdate(const std::string&, const v1::StartUpdateRequest&) override { return absl::OkStatus(); }
  absl::StatusOr<v1::FinishUpdateReply> FinishUpdate(const std::string&, const v1::FinishUpdateRequest&) override {
    return v1::FinishUpdateReply();
  }
  absl::StatusOr<v1::AbortSourceUpdateReply> AbortSourceUpdate(const std::string&,
                                                               const v1::AbortSourceUpdateRequest&) override {
    return v1::AbortSourceUpdateReply();
  }
  absl::StatusOr<v1::EngineInfo> EngineInfo(const std::string&) override {
    v1::EngineInfo i;
    i.set_model_config_json(config_json);
    return i;
  }
  absl::Status Pause(const std::string&, const std::string&) override { return absl::OkStatus(); }
  absl::Status PostProcess(const std::string&, const std::string&) override { return absl::OkStatus(); }
  absl::Status SetWeightVersion(const std::string&, const std::string&) override { return absl::OkStatus(); }
  absl::Status Continue(const std::string&) override { return absl::OkStatus(); }

  std::string config_json;  // what EngineInfo reports the engines serve
};

}  // namespace wsync::testing
