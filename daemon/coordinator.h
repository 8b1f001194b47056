#pragma once
// The coordinator: membership (source and target daemons with their engines), the transfer plan, and the update
// lifecycle on every engine (pause → configure when membership changed → push → post-process → set version →
// continue), with per-phase timings kept in a bounded history.
//
// Peers are reached through the injected `Peers` interface so the logic can be tested without servers.

#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "wsync/v1/coordinator.pb.h"
#include "wsync/v1/daemon.pb.h"
#include "wsync/v1/engine.pb.h"

namespace wsync::daemon {

// Calls to the other processes; every call has a deadline.
class Peers {
 public:
  virtual ~Peers() = default;
  virtual absl::StatusOr<v1::ConfigureSourceReply> ConfigureSource(const std::string& addr,
                                                                  const v1::ConfigureSourceRequest& req) = 0;
  virtual absl::Status StartUpdate(const std::string& addr, const v1::StartUpdateRequest& req) = 0;
  virtual absl::StatusOr<v1::FinishUpdateReply> FinishUpdate(const std::string& addr,
                                                              const v1::FinishUpdateRequest& req) = 0;
  virtual absl::StatusOr<v1::EngineInfo> EngineInfo(const std::string& addr) = 0;
  virtual absl::Status Pause(const std::string& addr, const std::string& mode) = 0;
  // `version`: the update whose writes have all completed (a target daemon's facade sends it to the engine's ranks).
  virtual absl::Status PostProcess(const std::string& addr, const std::string& version) = 0;
  virtual absl::Status SetWeightVersion(const std::string& addr, const std::string& version) = 0;
  virtual absl::Status Continue(const std::string& addr) = 0;
};

// gRPC implementation of Peers.
std::unique_ptr<Peers> MakeGrpcPeers();

struct CoordinatorOptions {
  std::string strategy = "seed";  // transfer-plan strategy
  size_t history_limit = 1000;
};

class Coordinator {
 public:
  Coordinator(CoordinatorOptions opts, std::unique_ptr<Peers> peers);

  absl::StatusOr<v1::RegisterNodeReply> RegisterNode(const v1::RegisterNodeRequest& req);
  v1::ClusterStatus Status() const;
  absl::StatusOr<v1::BeginUpdateReply> BeginUpdate(const v1::BeginUpdateRequest& req);
  absl::StatusOr<v1::CommitUpdateReply> CommitUpdate(const v1::CommitUpdateRequest& req);
  v1::HistoryReply History(const v1::HistoryRequest& req) const;

 private:
  struct Planned {
    std::string source;  // node id
    v1::TargetAssignment assignment;
    uint64_t bytes = 0;
  };
  absl::Status Replan();  // requires mu_
  std::vector<std::string> EngineAddresses() const;
  void Fail(v1::UpdateRecord rec, const absl::Status& why);
  // Records the coordinator's view of engine `addr` after a call of `phase` (on_success "" = unchanged); returns st.
  absl::Status Track(const std::string& addr, const std::string& on_success, const std::string& phase,
                     absl::Status st);

  CoordinatorOptions opts_;
  std::unique_ptr<Peers> peers_;
  mutable std::mutex mu_;
  std::map<std::string, v1::RegisterNodeRequest> nodes_;
  int64_t membership_epoch_ = 0;
  int64_t plan_epoch_ = -1;  // membership epoch the current plan was built for
  std::vector<Planned> plan_;
  std::string model_config_json_;
  std::map<std::string, std::string> engine_state_;  // control address → registered | paused | serving | failed: …

  std::string state_ = "idle";
  int64_t open_version_ = -1;
  std::string current_version_;
  v1::UpdateRecord open_record_;
  std::deque<v1::UpdateRecord> history_;
};

}  // namespace wsync::daemon
