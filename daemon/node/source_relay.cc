// The source's side of relay trees (issue 41, docs/planner.md "The relay data path"): after a batch of writes into
// a tree's root completed, the root's daemon is told which ranges landed and their checksums (relay_notice.h).

#include "daemon/node/source_node.h"

namespace wsync::daemon {

TargetWriter::Done SourceNode::RelayNoticeFor(int64_t version, const Target& t,
                                              const std::vector<replica::ReadyParam>& ready) {
  std::vector<RelayNotifier::Range> ranges;
  for (const auto& r : ready) {
    if (r.layout != t.layout) continue;
    const replica::EngineParam& p = replica_->table(r.layout).params()[r.param];
    for (const auto& [offset, length] : t.ranges[r.param])
      ranges.push_back({t.assignment.rank(), p.name, offset, length, replica_->data(r.layout) + p.offset + offset});
  }
  if (ranges.empty()) return nullptr;
  std::call_once(relay_once_,
                 [this] { relay_notifier_ = std::make_unique<RelayNotifier>(opts_.node_id, CallRelayLanded); });
  RelayNotifier* notifier = relay_notifier_.get();
  return [notifier, version, daemon = t.assignment.target_daemon(), engine = t.assignment.engine_id(),
          ranges = std::move(ranges)](const absl::Status& st) mutable {
    if (st.ok()) notifier->Written(version, daemon, engine, std::move(ranges));
  };
}

}  // namespace wsync::daemon
