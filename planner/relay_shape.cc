#include "planner/relay_shape.h"

#include <algorithm>

#include "absl/strings/str_format.h"

namespace wsync::planner {

int RelayTreeDepth(int members, int degree) {
  const int d = std::max(1, degree);
  // Member k (0-based, breadth first) sits at the depth where the levels above it end: levels hold 1, d, d^2, ...
  int depth = 0;
  long long placed = 1, level = 1;
  while (placed < members) {
    level *= d;
    placed += level;
    ++depth;
  }
  return depth;
}

double RelayChunkSeconds(uint64_t chunk_bytes, int streams_on_nic, double nic_bps, double hop_s) {
  return static_cast<double>(chunk_bytes) * std::max(1, streams_on_nic) / nic_bps + hop_s;
}

RelayShapeCost RelayDirectCost(const RelayLinks& l) {
  RelayShapeCost c;
  const int n = std::max(1, l.instances);
  const double b = static_cast<double>(l.copy_bytes);
  c.trainer_egress_bytes = l.copy_bytes * static_cast<uint64_t>(n);
  c.source_s = b * n / (std::max(1, l.source_nics) * l.source_nic_bps);
  c.inbound_s = b / (std::max(1, l.instance_nics) * l.target_nic_bps);
  c.total_s = std::max(c.source_s, c.inbound_s);
  return c;
}

RelayShapeCost RelayTreeCost(const RelayLinks& l, int degree) {
  RelayShapeCost c;
  const int n = std::max(1, l.instances);
  c.degree = std::max(1, std::min(degree, n - 1));
  c.depth = RelayTreeDepth(n, c.degree);
  const double b = static_cast<double>(l.copy_bytes);
  const double instance_bps = std::max(1, l.instance_nics) * l.target_nic_bps;
  c.trainer_egress_bytes = l.copy_bytes;
  c.source_s = b / (std::max(1, l.source_nics) * l.source_nic_bps);
  c.inbound_s = b / instance_bps;
  c.forward_s = b * c.degree / instance_bps;
  c.chunk_s = RelayChunkSeconds(std::min(l.chunk_bytes, l.copy_bytes), c.degree * std::max(1, l.ranks_per_nic),
                                l.target_nic_bps, l.hop_s);
  c.latency_s = c.depth * c.chunk_s;
  c.total_s = std::max({c.source_s, c.inbound_s, c.forward_s}) + c.latency_s;
  return c;
}

RelayShapeChoice ChooseRelayShape(const RelayLinks& l) {
  RelayShapeChoice out;
  if (!(l.source_nic_bps > 0) || !(l.target_nic_bps > 0)) {
    out.why = "no link rates: direct";
    return out;
  }
  out.direct = RelayDirectCost(l);
  out.chosen = out.direct;
  if (l.instances < 2 || l.copy_bytes == 0) {
    out.why = l.instances < 2 ? "one instance: nothing to relay" : "nothing to send: direct";
    return out;
  }
  RelayShapeCost best_tree;
  for (int d = 1; d < l.instances; ++d) {
    out.candidates.push_back(RelayTreeCost(l, d));
    if (d == 1 || out.candidates.back().total_s < best_tree.total_s) best_tree = out.candidates.back();
  }
  if (best_tree.total_s < out.direct.total_s) out.chosen = best_tree;
  if (out.relayed()) {
    out.why = absl::StrFormat("auto: degree %d, depth %d, predicted %.1f ms; direct %.1f ms", out.chosen.degree,
                              out.chosen.depth, out.chosen.total_s * 1e3, out.direct.total_s * 1e3);
  } else {
    out.why = absl::StrFormat("auto: direct predicted %.1f ms, no tree faster (best: degree %d, %.1f ms)",
                              out.direct.total_s * 1e3, best_tree.degree, best_tree.total_s * 1e3);
  }
  return out;
}

}  // namespace wsync::planner
