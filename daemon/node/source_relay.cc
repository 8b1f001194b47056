// The source's side of relay trees (issue 41, docs/planner.md "The relay data path"): a tree's root takes each bucket
// in pieces of at most kRelayPieceBytes, cut inside parameters where needed; after a piece's writes completed, the
// root's daemon is told which ranges landed and their checksums (relay_notice.h).

#include <algorithm>

#include "absl/time/clock.h"
#include "daemon/node/source_node.h"
#include "spdlog/spdlog.h"

namespace wsync::daemon {

void SourceNode::CutRelayPieces(const Target& t, const replica::ReadyParam& r,
                                const std::vector<transport::WriteRequest>& writes, std::vector<RelayPiece>* pieces) {
  const replica::EngineParam& p = replica_->table(r.layout).params()[r.param];
  const transport::LocalRegion* replica_region = (*t.src_regions)[r.layout].get();
  for (const transport::WriteRequest& w : writes) {
    // Relayed updates are dense: every write reads the replica at the parameter's offset plus its range's.
    const bool dense = w.src == replica_region && w.src_offset >= p.offset;
    for (uint64_t done = 0; done < w.length;) {
      if (pieces->empty() || pieces->back().bytes >= kRelayPieceBytes) pieces->emplace_back();
      RelayPiece& piece = pieces->back();
      const uint64_t take = dense ? std::min(w.length - done, kRelayPieceBytes - piece.bytes) : w.length;
      transport::WriteRequest part = w;
      part.src_offset += done;
      part.dst_offset += done;
      part.length = take;
      piece.writes.push_back(part);
      if (dense) {
        const uint64_t offset = w.src_offset - p.offset + done;
        piece.ranges.push_back(
            {t.assignment.rank(), p.name, offset, take, replica_->data(r.layout) + p.offset + offset});
      }
      piece.bytes += take;
      done += take;
    }
  }
}

TargetWriter::Done SourceNode::RelayNoticeFor(int64_t version, const Target& t,
                                              std::vector<RelayNotifier::Range> ranges) {
  if (ranges.empty()) return nullptr;
  std::call_once(relay_once_,
                 [this] { relay_notifier_ = std::make_unique<RelayNotifier>(opts_.node_id, CallRelayLanded); });
  RelayNotifier* notifier = relay_notifier_.get();
  return [notifier, version, daemon = t.assignment.target_daemon(), engine = t.assignment.engine_id(),
          ranges = std::move(ranges), t_post = absl::Now()](const absl::Status& st) mutable {
    if (spdlog::should_log(spdlog::level::debug) && !ranges.empty()) {  // the sum and the texts only when logged
      uint64_t b = 0;
      for (const auto& r : ranges) b += r.length;
      spdlog::debug("relaytime source piece to {} acked: {} ranges {} bytes first {} +{} in {:.2f} ms: {}", engine,
                    ranges.size(), b, ranges[0].param, ranges[0].offset,
                    absl::ToDoubleMilliseconds(absl::Now() - t_post), st.ToString());
    }
    if (st.ok()) notifier->Written(version, daemon, engine, std::move(ranges));
  };
}

}  // namespace wsync::daemon
