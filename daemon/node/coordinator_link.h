#pragma once
// The node daemon's outbound calls to the coordinator: registration and the lease (heartbeats), over one or several
// coordinator endpoints (high availability: whichever leads).

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "client/coordinator_client.h"
#include "proto/tls.h"
#include "spdlog/spdlog.h"
#include "wsync/v1/coordinator.grpc.pb.h"

namespace wsync::daemon {

// The coordinators this daemon reports to (--coordinator A[,B...]). With several (high availability, one leader), a
// call that gets Unavailable — the coordinator is down, or a standby answering "not the leader" — moves on to the
// leader the standby named, else to the next one.
class Coordinators {
 public:
  explicit Coordinators(const std::string& list) : endpoints_(client::SplitEndpoints(list)) {
    if (endpoints_.empty()) endpoints_.push_back(list);
    // mTLS from the --tls-* flags; without TLS only loopback coordinators may be dialled.
    for (const auto& e : endpoints_) {
      auto channel = tls::Dial(e);
      if (!channel.ok()) {
        if (dial_status_.ok()) dial_status_ = channel.status();
        stubs_.push_back(nullptr);
        continue;
      }
      stubs_.push_back(v1::Coordinator::NewStub(*std::move(channel)));
    }
  }
  // Why a coordinator may not be dialled (then stub() is null for it).
  const absl::Status& dial_status() const { return dial_status_; }
  size_t size() const { return endpoints_.size(); }
  const std::string& current() const { return endpoints_[i_]; }
  v1::Coordinator::Stub* stub() { return stubs_[i_].get(); }
  // After `why` from the current one: moves on (no-op with a single coordinator). True when it moved.
  bool Next(const absl::Status& why) {
    if (endpoints_.size() < 2) return false;
    const size_t from = i_;
    i_ = (i_ + 1) % endpoints_.size();
    const std::string hint = client::LeaderHint(std::string(why.message()));
    for (size_t k = 0; k < endpoints_.size(); ++k)
      if (!hint.empty() && endpoints_[k] == hint && k != from) i_ = k;
    spdlog::info("coordinator {} is not the leader or is down ({}); trying {}", endpoints_[from],
                 std::string(why.message()).substr(0, 200), endpoints_[i_]);
    return true;
  }

 private:
  std::vector<std::string> endpoints_;
  std::vector<std::unique_ptr<v1::Coordinator::Stub>> stubs_;
  absl::Status dial_status_;
  size_t i_ = 0;
};

// Registers with the coordinator (the leader, when there are several), retrying (every 0.5 s, each attempt logged)
// while it is not up yet. Returns Cancelled at once when SIGTERM/SIGINT arrives meanwhile.
absl::Status Register(Coordinators& coordinators, const v1::RegisterNodeRequest& req, int attempts);

// Holds this node's lease with the coordinator until SIGTERM/SIGINT: a heartbeat every interval (the coordinator
// says how long); when the coordinator answers that it does not know the node (it restarted without its state or
// dropped the node), registers again; while it is unreachable, logs once and keeps trying. With several
// coordinators, an unreachable one or a standby sends the heartbeats on to the next (the new leader after a
// fail-over), retried after 0.2 s instead of a whole interval. `report`, when given, fills each heartbeat's report
// before it is sent (a source: the plan epoch and configuration digest it holds, SourceNode::AppliedConfig).
void HoldLease(Coordinators& coordinators, const v1::RegisterNodeRequest& reg,
               const std::function<v1::RegisterNodeRequest()>& fresh_registration,
               const std::function<void(v1::HeartbeatRequest*)>& report = nullptr);

// Tells the coordinator at once that this source failed an update on its own (SourceOptions::on_update_failed), so
// the update ends then (Coordinator::ReportUpdateFailure) instead of when the trainer commits. Report() only queues
// (it is called under the source's lock); one thread of its own makes the calls, each within `call_timeout`, moving
// to the next coordinator on Unavailable (high availability) and trying each at most twice. A report that reaches
// nobody is logged: the update then ends at the trainer's commit, as it always could.
class FailureReporter {
 public:
  FailureReporter(const std::string& coordinators, std::string node_id,
                  absl::Duration call_timeout = absl::Seconds(5));
  ~FailureReporter();
  FailureReporter(const FailureReporter&) = delete;
  FailureReporter& operator=(const FailureReporter&) = delete;
  void Report(int64_t version, const absl::Status& err);

 private:
  void Run();
  void Send(int64_t version, const std::string& error);

  Coordinators coordinators_;  // used by the thread only
  const std::string node_id_;
  const absl::Duration call_timeout_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<int64_t, std::string>> queue_;  // guarded by mu_
  bool stop_ = false;                                   // guarded by mu_
  std::thread thread_;
};

}  // namespace wsync::daemon
