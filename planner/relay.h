#pragma once
// Relay plans (issue 41): one copy per engine layout group leaves the trainer. Engine instances whose layouts match
// (same engine kind, parallelism, dtype and quantization: every rank holds the same bytes at the same offsets) form a
// group; the sources write the group's first instance (the root) as they write any instance today, and inside the
// group each instance's target daemon forwards every chunk that landed in its engine ranks to the same ranks of its
// children, so the trainer's egress no longer grows with the fleet.
//
// This header is the plan and its cost; nothing here moves bytes. The data path (target daemons forwarding landed
// chunks under coordinator-minted grants: daemon/node/relay_forwarder.h, daemon/coordinator/relay_wiring.h) uses
// RelayTreeShape for the trees' shape (docs/planner.md, "The relay data path").
//
// Threading: pure functions of their inputs.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "planner/cost.h"
#include "planner/cost_params.h"
#include "planner/plan.h"
#include "planner/relay_shape.h"

namespace wsync::planner {

enum class RelayMode : uint8_t {
  kOff,     // today's plan: the sources write every instance
  kAuto,    // relay when the cost model predicts it faster, with the degree it predicts fastest
  kDegree,  // relay with this many children per relay (capped by the group's size)
};

struct RelayOptions {
  RelayMode mode = RelayMode::kOff;
  int degree = 0;  // kDegree: children per relay, >= 1
  // What a relay forwards at once: a chunk is forwarded as soon as it has landed and been checked, so each level of
  // the tree adds about one chunk's time. 4 MiB: the target daemon's staging chunk (daemon/node/target_node_cuda.cc).
  uint64_t chunk_bytes = 4ull << 20;
};

// "off", "auto" or a degree "N" (N >= 1). InvalidArgument otherwise.
absl::StatusOr<RelayOptions> ParseRelayMode(absl::string_view text);
std::string FormatRelayMode(const RelayOptions& options);

// What must match for one engine instance to forward its weights into another: relaying copies bytes verbatim, so
// the two must hold the same bytes at the same offsets of every rank.
struct EngineLayoutKey {
  std::string kind;  // the engine's dialect (EngineRegistration.kind)
  int tp = 1, ep = 1, dp_attention = 1, pp = 1;
  std::string dtype;         // the weights' dtype ("bf16", "fp8_e4m3")
  std::string quantization;  // "" | "fp8_block 64x64" ... (what every rank reports)
  std::string ToString() const;
  bool operator==(const EngineLayoutKey& o) const;
  bool operator!=(const EngineLayoutKey& o) const { return !(*this == o); }
};

// Engine instances that can relay to each other. `instances[0]` is the root: the one the sources write.
struct LayoutGroup {
  EngineLayoutKey key;
  std::vector<int> instances;  // in the order given
};

// Groups `instances` by `keys` (keys[k] is instances[k]'s): one group per distinct key, in order of first appearance,
// members in the order given. InvalidArgument when the sizes differ or an instance repeats.
absl::StatusOr<std::vector<LayoutGroup>> GroupByLayout(const std::vector<int>& instances,
                                                       const std::vector<EngineLayoutKey>& keys);

// One chunk a relay forwards: a byte range of one parameter of the rank's layout. A chunk lies inside one source's
// write (`source`: index into Plan::sources), so it lands, and can be forwarded, as one piece. Zero-byte parameters
// are one chunk of length 0 (the child records them as written).
struct RelayChunk {
  int param = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  int source = 0;
  bool operator==(const RelayChunk& o) const {
    return param == o.param && offset == o.offset && length == o.length && source == o.source;
  }
};

// What every relay of a group forwards from its rank `rank` to rank `rank` of each of its children: the layouts
// match, so it is the same for every edge of the tree. Sorted by (param, offset); covers the layout exactly once.
struct RelayRankRegions {
  int rank = 0;
  std::vector<RelayChunk> chunks;
  uint64_t bytes = 0;  // one copy of the rank's layout
};

struct RelayNode {
  int instance = 0;
  int parent = -1;            // instance id of its relay; -1: the group's root, written by the sources
  int depth = 0;              // 0: the root
  std::vector<int> children;  // instance ids, in forwarding order
};

struct RelayTree {
  LayoutGroup group;
  int degree = 0;                         // most children of any relay (0: a group of one)
  int depth = 0;                          // levels below the root
  std::vector<RelayNode> nodes;           // breadth-first, root first; one per member of the group
  std::vector<RelayRankRegions> regions;  // index = engine rank
};

// The shape of a group's tree: a complete `degree`-ary tree over `members` in breadth-first order (members[0] the
// root; the k-th member's parent is member (k - 1) / degree). Pure; `degree` >= 1.
std::vector<RelayNode> RelayTreeShape(const std::vector<int>& members, int degree);

struct RelayPlan {
  RelayOptions options;
  bool relayed = false;  // false: `plan` is today's direct plan (off, a group of one, or auto found direct faster)
  std::string why;       // what decided (printed by `wsyncctl plan`)
  // What the sources execute: the direct plan when not relayed; else every group's root only (`roots_input`'s
  // active instances), one copy per group.
  Plan plan;
  PlanInput roots_input;              // the input `plan` was built for (relayed only)
  std::vector<RelayTree> trees;       // relayed only: one per layout group
  uint64_t trainer_egress_bytes = 0;  // what the sources send, over all of them
};

// Builds the plan for `input`'s active instances under `relay`. `keys` (one per active instance, in
// ActiveInstances order) groups them; empty: all in one group (a PlanInput's instances share its layouts).
// kOff returns exactly BuildPlan(input, options). kAuto decides with options.cost (PredictRelay against
// PredictPlan of the direct plan): per group the degree, from 1 up to the relay's egress bound (MaxRelayDegree),
// that the model predicts fastest; relays only if that beats the direct plan.
absl::StatusOr<RelayPlan> BuildRelayPlan(const PlanInput& input, const PlanOptions& options, const RelayOptions& relay,
                                         const std::vector<EngineLayoutKey>& keys = {});

// One edge of a tree (or the sources' writes into a root: parent -1).
struct RelayHop {
  int group = 0;
  int parent = -1, child = 0;  // instance ids
  int level = 0;               // the child's depth
  double chunk_s = 0;          // one chunk across this hop: the parent's egress share per chunk plus the per-hop check
  double first_s = 0;   // when the child's first chunk has landed, after the root's first (sum of chunk_s above it)
  double stream_s = 0;  // one full copy at the parent's slowest egress NIC (sources: the root-only source time)
};

// Target NIC traffic of a relay plan: every member takes one copy in; a relay's NIC also sends one per child.
struct RelayNic {
  int node = 0, nic = 0;
  uint64_t in_bytes = 0, out_bytes = 0;
  int sessions = 0;  // writers into it plus children it forwards to (per rank)
  double time_s = 0;
};

struct RelayPrediction {
  // Sources: the root-only plan's transfer time (PredictTransfer): replica loads, source NICs, the roots' NICs.
  double source_s = 0;
  double tree_s = 0;      // slowest target NIC with forwarding (full duplex: max of in and out) and its sessions
  double latency_s = 0;   // the deepest member's first chunk after the root's: each level about one chunk
  double transfer_s = 0;  // max(source_s, tree_s) + latency_s
  double gather_s = 0;
  double total_s = 0;  // fixed + post + gather + transfer
  uint64_t trainer_egress_bytes = 0;
  std::vector<RelayHop> hops;  // per group, breadth-first; the sources' hop into each root first
  std::vector<RelayNic> nics;
};

// The relay plan's predicted time. A non-relayed plan is predicted as PredictPlan predicts it (hops and nics empty).
RelayPrediction PredictRelay(const PlanInput& input, const RelayPlan& plan, const CostParams& params);

// The most children a relay of a tree with `degree` d can have while its egress keeps up: the largest d (1 at
// least, at most the group's size - 1) for which the tree's slowest target NIC takes no longer than the sources or
// the same NICs' inbound copies take anyway. `plan` must be relayed.
int MaxRelayDegree(const PlanInput& input, const RelayPlan& plan, const CostParams& params, int group);

// The link-rate model's view of `input` (planner/relay_shape.h: what the coordinator's `--relay auto` decides
// with): one copy's bytes (every rank's layout), the active instances, the trainer's NICs (nodes x NICs per node,
// at most one per GPU), the NICs the first instance's ranks land on (TargetNicOf) and the most of its ranks on one.
RelayLinks RelayLinksOf(const PlanInput& input, const RelayOptions& relay, const CostParams& params);

// Checks a relay plan against its input: the sources cover every root exactly once (VerifyPlan), every active
// instance is in exactly one tree, each tree is a tree over its group (parents earlier, depths consistent, degree
// respected), and every rank's chunks cover its layout exactly once, each inside one source's write to the root and
// no longer than the chunk size.
absl::Status VerifyRelayPlan(const PlanInput& input, const RelayPlan& plan);

}  // namespace wsync::planner
