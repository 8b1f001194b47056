#pragma once
// ClusterModel: what the coordinator's readers see — Status, EngineStates (WatchEngines), History and the status page
// built from them — as one immutable snapshot.
//
// Why: the coordinator's lock (mu_) guards the state an update changes. A reader that took it waited behind whatever
// held it: a re-plan, a membership change written to the store under it, the bookkeeping of a thousand engine calls.
// Instead the coordinator builds a new model under mu_ at every change of what readers report (Coordinator::Publish,
// at the same place it moves the change counter WatchEngines waits on) and publishes it as a
// shared_ptr<const ClusterModel> swapped under ModelCell's own mutex, held for a pointer copy only. Readers take the
// pointer and read without any lock of the coordinator: they see the state as of the last change, whole (no reader
// sees half of a transition), and never wait for an update, a peer call or the store.
//
// Cost: a model is built per state change and per engine call ended. The parts that are large at 1024 engine ranks
// are shared between successive models and rebuilt only when their inputs change: the layout (nodes, each engine's
// fixed details, the plan and its groups) when the membership epoch or the plan generation moves; the history per
// record (a record is copied once, when added or rewritten; the model holds pointers). What is rebuilt every time is
// small: one entry per engine (not per rank) and the update's summary.
//
// Time-dependent fields (a node's last heartbeat, reachable) are not in the model: Status reads them from the lease
// table at answer time (the coordinator's lease_mu_, held for a lookup; never held across anything else).

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "base/mutex.h"
#include "wsync/v1/coordinator.pb.h"

namespace wsync::daemon {

struct ClusterModel {
  // One engine's state as readers report it.
  struct Engine {
    std::string state;           // the coordinator's view: "serving", "paused", "failed (pause)", "stale", "drained"…
    std::string weight_version;  // the label last set on it ("" none)
    std::string staged_version;  // verified in its staging copy, not yet switched ("" none)
    bool stale = false;          // left out of a staged update's switch
    bool drained = false;        // drained, or on a node whose lease had lapsed when the update began
  };
  using Records = std::vector<std::shared_ptr<const v1::UpdateRecord>>;

  uint64_t generation = 0;  // moves with every model published
  // Nodes with their engines' fixed details (id, kind, address, ranks, staging); the plan, its groups. Nothing in it
  // changes without the membership epoch or the plan generation.
  std::shared_ptr<const v1::ClusterStatus> layout;
  std::map<std::string, Engine> engines;  // by control address
  // The update's summary and the small lists: membership and plan epochs, state, current / open / failed version,
  // failure, engines_hold_partial_writes, not_resumed, source_plan_epochs, drained_nodes.
  v1::ClusterStatus summary;
  std::shared_ptr<const Records> history;  // oldest first, at most CoordinatorOptions::history_limit
};

// A node's lease as of now: seconds since its last renewal (-1: never renewed).
using HeartbeatAgo = std::function<double(const std::string& node_id)>;

// The status of `m`: the layout with every engine's state, the summary, each node's lease (`heartbeat_ago`; a node
// is reachable when it renewed within 3 `heartbeat_seconds`). `with_plan` false: without the plan, its groups, the
// sources' plan epochs and the drained nodes (what EngineStates needs). Pure.
v1::ClusterStatus StatusOf(const ClusterModel& m, bool with_plan, const HeartbeatAgo& heartbeat_ago,
                           double heartbeat_seconds);
// The last `limit` records of `m` (all when limit <= 0), oldest first. Pure.
v1::HistoryReply HistoryOf(const ClusterModel& m, int limit);

// Holds the model in force. Get and Set copy a pointer under mu_; nothing else ever holds it.
class ModelCell {
 public:
  ModelCell() : model_(std::make_shared<const ClusterModel>()) {}
  std::shared_ptr<const ClusterModel> Get() const ABSL_LOCKS_EXCLUDED(mu_);
  void Set(std::shared_ptr<const ClusterModel> m) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable Mutex mu_;
  std::shared_ptr<const ClusterModel> model_ ABSL_GUARDED_BY(mu_);
};

}  // namespace wsync::daemon
