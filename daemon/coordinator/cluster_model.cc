#include "daemon/coordinator/cluster_model.h"

#include <algorithm>

#include "base/cli.h"

namespace wsync::daemon {

v1::ClusterStatus StatusOf(const ClusterModel& m, bool with_plan, const HeartbeatAgo& heartbeat_ago,
                           double heartbeat_seconds) {
  v1::ClusterStatus s;
  if (m.layout != nullptr) {
    if (with_plan) {
      s = *m.layout;
    } else {
      *s.mutable_nodes() = m.layout->nodes();
    }
  }
  s.set_server_version(cli::VersionString("wsync-coordinator"));
  for (auto& n : *s.mutable_nodes()) {
    for (auto& d : *n.mutable_engine_details()) {
      auto it = m.engines.find(d.address());
      if (it == m.engines.end()) continue;  // the layout and the engines are built from the same membership
      const ClusterModel::Engine& e = it->second;
      d.set_state(e.state);
      if (!e.weight_version.empty()) d.set_weight_version(e.weight_version);
      if (!e.staged_version.empty()) d.set_staged_version(e.staged_version);
      d.set_stale(e.stale);
      d.set_drained(e.drained);
    }
    const double ago = heartbeat_ago(n.node_id());
    n.set_last_heartbeat_seconds_ago(ago);
    n.set_reachable(ago >= 0 && ago <= 3 * heartbeat_seconds);
  }
  if (with_plan) {
    s.MergeFrom(m.summary);  // the layout sets none of the summary's fields
  } else {
    v1::ClusterStatus summary = m.summary;
    summary.clear_source_plan_epochs();
    summary.clear_drained_nodes();
    s.MergeFrom(summary);
  }
  return s;
}

v1::HistoryReply HistoryOf(const ClusterModel& m, int limit) {
  v1::HistoryReply out;
  if (m.history == nullptr) return out;
  const ClusterModel::Records& h = *m.history;
  const size_t n = limit > 0 ? std::min<size_t>(static_cast<size_t>(limit), h.size()) : h.size();
  out.mutable_records()->Reserve(static_cast<int>(n));
  for (size_t i = h.size() - n; i < h.size(); ++i) *out.add_records() = *h[i];
  return out;
}

std::shared_ptr<const ClusterModel> ModelCell::Get() const {
  MutexLock l(&mu_);
  return model_;
}

void ModelCell::Set(std::shared_ptr<const ClusterModel> m) {
  std::shared_ptr<const ClusterModel> old;  // released after mu_: the last reference may free a large model
  MutexLock l(&mu_);
  old = std::move(model_);
  model_ = std::move(m);
}

}  // namespace wsync::daemon
