#pragma once
// The gRPC faces of the node daemon's roles: thin classes that delegate to the plain C++ modules (SourceNode,
// TargetNode) and convert statuses in one place (proto/status_convert.h). The coordinator's face is
// daemon/coordinator/coordinator_service.h.

#include <atomic>
#include <memory>

#include "base/fault_knob.h"
#include "daemon/node/source_node.h"
#include "daemon/node/target_node.h"
#include "wsync/v1/daemon.grpc.pb.h"
#include "wsync/v1/trainer.grpc.pb.h"

namespace wsync::daemon {

class NodeDaemonService final : public v1::NodeDaemon::Service {
 public:
  // Exactly one of source/target is non-null. `node_id` selects this node's rules of the testing aid
  // WSYNC_DAEMON_FAULTS_FILE (base/fault_knob.h; wsyncd --help): ConfigureSource, StartUpdate, FinishUpdate,
  // SetWriteWindow (opening) and ApplyDelta fail or hang on demand at their phase's name (configure, start, finish,
  // open_windows, apply_delta).
  NodeDaemonService(SourceNode* source, TargetNode* target, const std::string& node_id = "")
      : source_(source), target_(target), faults_("WSYNC_DAEMON_FAULTS_FILE", node_id,
                                                  "daemon_fault: node " + node_id) {}
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
  grpc::Status ApplyDelta(grpc::ServerContext*, const v1::ApplyDeltaRequest*, v1::ApplyDeltaReply*) override;
  grpc::Status SetRelay(grpc::ServerContext*, const v1::SetRelayRequest*, v1::SetRelayReply*) override;
  grpc::Status RelayLanded(grpc::ServerContext*, const v1::RelayLandedRequest*, v1::RelayLandedReply*) override;
  grpc::Status RelayDrain(grpc::ServerContext*, const v1::RelayDrainRequest*, v1::RelayDrainReply*) override;
  grpc::Status GetNodeStatus(grpc::ServerContext*, const v1::NodeStatusRequest*, v1::NodeStatus*) override;
  grpc::Status GetWriteChecksums(grpc::ServerContext*, const v1::WriteChecksumsRequest*,
                                 v1::WriteChecksumsReply*) override;

 private:
  grpc::Status NeedSource() const;
  grpc::Status NeedTarget() const;
  SourceNode* source_;
  std::atomic<TargetNode*> target_;
  FaultKnob faults_;
};

// The trainer ranks' service of a source daemon, served only on its local Unix gRPC socket (daemon/node/trainer_socket.h);
// every call is authorized by its session id.
class TrainerIngestService final : public v1::TrainerIngest::Service {
 public:
  explicit TrainerIngestService(SourceNode* source) : source_(source) {}
  grpc::Status BeginPush(grpc::ServerContext*, const v1::BeginPushRequest*, v1::BeginPushReply*) override;
  grpc::Status CommitBucket(grpc::ServerContext*, const v1::CommitBucketRequest*, v1::CommitBucketReply*) override;
  grpc::Status EndPush(grpc::ServerContext*, const v1::EndPushRequest*, v1::EndPushReply*) override;
  grpc::Status CommitPlaced(grpc::ServerContext*, const v1::CommitPlacedRequest*, v1::CommitPlacedReply*) override;
  grpc::Status CloseSession(grpc::ServerContext*, const v1::CloseSessionRequest*, v1::CloseSessionReply*) override;

 private:
  SourceNode* source_;
};

// The EngineControl facade the target daemon serves for one engine whose kind has no EngineControl endpoint of its
// own (e.g. vllm): every call goes through TargetNode (and so the engine's adapter). GetChecksums hashes the engine
// memory this daemon maps (host segments); Verify is a reference-engine diagnostic and answers Unimplemented.
std::unique_ptr<grpc::Service> MakeEngineFacade(TargetNode* target, std::string engine_id);

}  // namespace wsync::daemon
