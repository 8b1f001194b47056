#pragma once
// The shape of a relay tree from link rates alone (issue 41): how many children per relay and how deep, for one
// layout group, from the sources' NICs, the engines' NICs, the chunk size and one copy's bytes. What the coordinator's
// `--relay auto` decides with (daemon/coordinator/relay_wiring.h), where no model input (layouts of the trainer,
// replica load rates) is at hand; `wsyncctl plan --relay auto` prints it beside the plan-level model of relay.h
// (PredictRelay, which charges the same per-hop chunk time, RelayChunkSeconds, NIC by NIC over a whole plan).
//
//   direct     the sources send every member a copy: max(N x copy / source egress, copy / one instance's NICs)
//   degree d   the sources send the root one copy; every relay sends each of its d children one copy out of its own
//              NICs (full duplex: its inbound copy does not slow its outbound ones):
//                max(copy / source egress, copy / instance NICs, d x copy / instance NICs) + depth x chunk_s
//              chunks are forwarded as soon as they landed, so each level adds one chunk's time (chunk_s), not one
//              copy's: chunk_s = chunk x d x (ranks per NIC) / NIC rate + hop_s
//
// Threading: pure functions of their inputs.

#include <cstdint>
#include <string>
#include <vector>

namespace wsync::planner {

// What a relay tree's shape depends on. Rates in bytes per second.
struct RelayLinks {
  uint64_t copy_bytes = 0;    // one engine instance's bytes, all its ranks
  int instances = 1;          // members of the layout group
  int source_nics = 1;        // NICs the sources send from, all source nodes together
  double source_nic_bps = 0;  // each one's line rate
  int instance_nics = 1;      // NICs one instance's ranks receive on (and a relay forwards from)
  double target_nic_bps = 0;  // each one's line rate
  int ranks_per_nic = 1;      // an instance's ranks sharing one NIC: each forwards its own chunk stream
  uint64_t chunk_bytes = 4ull << 20;
  double hop_s = 0.5e-3;  // per hop and chunk beyond its bytes (CostParams::relay_hop_ms)
};

// One candidate: direct (degree 0) or a complete tree of `degree` children per relay.
struct RelayShapeCost {
  int degree = 0;  // 0: direct, the sources write every member
  int depth = 0;   // levels below the root (0 for direct)
  double source_s = 0;   // the sources' egress: copies they send / their NICs' rate
  double inbound_s = 0;  // one copy into an instance
  double forward_s = 0;  // a relay's copies out (0 for direct)
  double chunk_s = 0;    // one chunk across one hop (0 for direct)
  double latency_s = 0;  // depth x chunk_s: the deepest member's first chunk after the root's
  double total_s = 0;    // max(source_s, inbound_s, forward_s) + latency_s
  uint64_t trainer_egress_bytes = 0;
};

struct RelayShapeChoice {
  RelayShapeCost chosen;                   // degree 0: direct is predicted no slower than any tree
  RelayShapeCost direct;                   // for comparison
  std::vector<RelayShapeCost> candidates;  // every degree 1 .. instances - 1, in order
  std::string why;                         // one line: what decided
  bool relayed() const { return chosen.degree > 0; }
};

// Levels below the root of a complete `degree`-ary tree of `members` (RelayTreeShape's shape): 0 for one member.
int RelayTreeDepth(int members, int degree);
// One chunk across one hop out of a relay with `degree` children: its bytes at the NIC's share plus the hop's cost.
double RelayChunkSeconds(uint64_t chunk_bytes, int streams_on_nic, double nic_bps, double hop_s);

RelayShapeCost RelayDirectCost(const RelayLinks& links);
RelayShapeCost RelayTreeCost(const RelayLinks& links, int degree);
// The fastest of direct and every degree from 1 to instances - 1; a tree only when strictly faster than direct, and
// among equal trees the smallest degree. A group of one, or no copy bytes, is direct.
RelayShapeChoice ChooseRelayShape(const RelayLinks& links);

}  // namespace wsync::planner
