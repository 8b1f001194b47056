#pragma once
// The coordinator's gRPC face: a thin class that delegates to the plain C++ Coordinator and converts statuses in one
// place (proto/status_convert.h).

#include <atomic>

#include "daemon/coordinator/coordinator.h"
#include "wsync/v1/coordinator.grpc.pb.h"

namespace wsync::daemon {

// Whether this coordinator may serve the coordinator API now. With high availability (etcd) only the leader does:
// a standby answers every call with Unavailable "not the leader ...; current leader: HOST:PORT", which clients given
// several endpoints take as "try the next one" (docs/operations.md, "High availability (etcd)").
class LeaderGate {
 public:
  virtual ~LeaderGate() = default;
  virtual absl::Status Check() const = 0;
};

class CoordinatorService final : public v1::Coordinator::Service {
 public:
  // `gate` null: always serve (a single coordinator).
  explicit CoordinatorService(Coordinator* c, const LeaderGate* gate = nullptr) : c_(c), gate_(gate) {}
  grpc::Status RegisterNode(grpc::ServerContext*, const v1::RegisterNodeRequest*, v1::RegisterNodeReply*) override;
  grpc::Status GetClusterStatus(grpc::ServerContext*, const v1::ClusterStatusRequest*, v1::ClusterStatus*) override;
  grpc::Status BeginUpdate(grpc::ServerContext*, const v1::BeginUpdateRequest*, v1::BeginUpdateReply*) override;
  grpc::Status CommitUpdate(grpc::ServerContext*, const v1::CommitUpdateRequest*, v1::CommitUpdateReply*) override;
  grpc::Status GetHistory(grpc::ServerContext*, const v1::HistoryRequest*, v1::HistoryReply*) override;
  grpc::Status AbortUpdate(grpc::ServerContext*, const v1::AbortUpdateRequest*, v1::AbortUpdateReply*) override;
  grpc::Status ResumeEngines(grpc::ServerContext*, const v1::ResumeEnginesRequest*,
                             v1::ResumeEnginesReply*) override;
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest*, v1::HeartbeatReply*) override;
  grpc::Status RemoveNode(grpc::ServerContext*, const v1::RemoveNodeRequest*, v1::RemoveNodeReply*) override;
  grpc::Status Drain(grpc::ServerContext*, const v1::DrainRequest*, v1::DrainReply*) override;
  grpc::Status Undrain(grpc::ServerContext*, const v1::DrainRequest*, v1::DrainReply*) override;
  // Streams EngineStatesOf(Status()) now and at every change, polled every interval, until the caller cancels; at
  // most kMaxWatchers at a time (each holds a server thread while it watches).
  grpc::Status WatchEngines(grpc::ServerContext*, const v1::WatchEnginesRequest*,
                            grpc::ServerWriter<v1::EngineStates>*) override;
  static constexpr int kMaxWatchers = 32;

 private:
  grpc::Status Gate() const;
  Coordinator* c_;
  const LeaderGate* gate_;
  std::atomic<int> watchers_{0};
};

}  // namespace wsync::daemon
