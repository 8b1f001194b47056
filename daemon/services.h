#pragma once
// The gRPC faces of the daemon roles and the coordinator: thin classes that delegate to the plain C++ modules
// (SourceNode, TargetNode, Coordinator) and convert statuses in one place (proto/status_convert.h).

#include <atomic>
#include <memory>

#include "daemon/coordinator.h"
#include "daemon/source_node.h"
#include "daemon/target_node.h"
#include "wsync/v1/coordinator.grpc.pb.h"
#include "wsync/v1/daemon.grpc.pb.h"
#include "wsync/v1/trainer.grpc.pb.h"

namespace wsync::daemon {

class NodeDaemonService final : public v1::NodeDaemon::Service {
 public:
  // Exactly one of source/target is non-null.
  NodeDaemonService(SourceNode* source, TargetNode* target) : source_(source), target_(target) {}
  // A target daemon serves before its engines attached; it sets its TargetNode once they have (before it registers).
  void set_target(TargetNode* target) { target_ = target; }

  grpc::Status ConfigureSource(grpc::ServerContext*, const v1::ConfigureSourceRequest*,
                               v1::ConfigureSourceReply*) override;
  grpc::Status StartUpdate(grpc::ServerContext*, const v1::StartUpdateRequest*, v1::StartUpdateReply*) override;
  grpc::Status FinishUpdate(grpc::ServerContext*, const v1::FinishUpdateRequest*, v1::FinishUpdateReply*) override;
  grpc::Status AbortSourceUpdate(grpc::ServerContext*, const v1::AbortSourceUpdateRequest*,
                                 v1::AbortSourceUpdateReply*) override;
  grpc::Status ConnectTarget(grpc::ServerContext*, const v1::ConnectTargetRequest*, v1::ConnectTargetReply*) override;
  grpc::Status SetWriteWindow(grpc::ServerContext*, const v1::SetWriteWindowRequest*,
                              v1::SetWriteWindowReply*) override;
  grpc::Status GetNodeStatus(grpc::ServerContext*, const v1::NodeStatusRequest*, v1::NodeStatus*) override;

 private:
  grpc::Status NeedSource() const;
  grpc::Status NeedTarget() const;
  SourceNode* source_;
  std::atomic<TargetNode*> target_;
};

// The trainer ranks' service of a source daemon, served only on its local Unix gRPC socket (daemon/trainer_socket.h);
// every call is authorized by its session id.
class TrainerIngestService final : public v1::TrainerIngest::Service {
 public:
  explicit TrainerIngestService(SourceNode* source) : source_(source) {}
  grpc::Status BeginPush(grpc::ServerContext*, const v1::BeginPushRequest*, v1::BeginPushReply*) override;
  grpc::Status CommitBucket(grpc::ServerContext*, const v1::CommitBucketRequest*, v1::CommitBucketReply*) override;
  grpc::Status EndPush(grpc::ServerContext*, const v1::EndPushRequest*, v1::EndPushReply*) override;
  grpc::Status CloseSession(grpc::ServerContext*, const v1::CloseSessionRequest*, v1::CloseSessionReply*) override;

 private:
  SourceNode* source_;
};

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

 private:
  grpc::Status Gate() const;
  Coordinator* c_;
  const LeaderGate* gate_;
};

// The EngineControl facade the target daemon serves for one engine whose kind has no EngineControl endpoint of its
// own (e.g. vllm): every call goes through TargetNode (and so the engine's adapter). Verify and GetChecksums are
// reference-engine diagnostics and answer Unimplemented.
std::unique_ptr<grpc::Service> MakeEngineFacade(TargetNode* target, std::string engine_id);

// Dials a target daemon's ConnectTarget over gRPC (used by SourceNode).
absl::StatusOr<std::string> DialConnectTarget(const std::string& target_daemon, const v1::ConnectTargetRequest& req);

}  // namespace wsync::daemon
