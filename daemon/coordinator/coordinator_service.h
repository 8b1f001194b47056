#pragma once
// The coordinator's gRPC face: a thin class that delegates to the plain C++ Coordinator and converts statuses in one
// place (proto/status_convert.h).

#include <atomic>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "base/mutex.h"
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
  grpc::Status ReportUpdateFailure(grpc::ServerContext*, const v1::ReportUpdateFailureRequest*,
                                   v1::ReportUpdateFailureReply*) override;
  grpc::Status RemoveNode(grpc::ServerContext*, const v1::RemoveNodeRequest*, v1::RemoveNodeReply*) override;
  grpc::Status Drain(grpc::ServerContext*, const v1::DrainRequest*, v1::DrainReply*) override;
  grpc::Status Undrain(grpc::ServerContext*, const v1::DrainRequest*, v1::DrainReply*) override;
  // Streams the engines' states now and whenever they change (woken by the coordinator's change counter, never by
  // polling a whole status), at most one message per interval (interval_seconds clamped to [kMinWatchInterval,
  // kMaxWatchInterval]; 0 or less: kDefaultWatchInterval), until the caller cancels (seen within 250 ms). At most
  // kMaxWatchers at a time and kMaxWatchersPerIdentity per caller (certificate identity; insecure: host), so no one
  // holder takes every slot (each holds a server thread while it watches).
  grpc::Status WatchEngines(grpc::ServerContext*, const v1::WatchEnginesRequest*,
                            grpc::ServerWriter<v1::EngineStates>*) override;
  static constexpr int kMaxWatchers = 32;
  static constexpr int kMaxWatchersPerIdentity = 4;
  static constexpr double kMinWatchInterval = 0.05;
  static constexpr double kMaxWatchInterval = 60;
  static constexpr double kDefaultWatchInterval = 0.2;

 private:
  grpc::Status Gate() const;
  // A watcher slot for `who`; false with why (`refused`) when every slot, or every slot `who` may hold, is taken.
  bool TakeWatchSlot(const std::string& who, std::string* refused) ABSL_LOCKS_EXCLUDED(watch_mu_);
  void ReleaseWatchSlot(const std::string& who) ABSL_LOCKS_EXCLUDED(watch_mu_);
  Coordinator* c_;
  const LeaderGate* gate_;
  Mutex watch_mu_;
  int watchers_ ABSL_GUARDED_BY(watch_mu_) = 0;
  std::map<std::string, int> watchers_by_identity_ ABSL_GUARDED_BY(watch_mu_);
};

// The interval a WatchEngines call runs with (clamped; see WatchEngines). Pure.
double WatchInterval(double asked);
// Who holds a WatchEngines stream, for its per-identity cap.
std::string WatcherIdentity(const grpc::ServerContext* ctx);

}  // namespace wsync::daemon
