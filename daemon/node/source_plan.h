#pragma once
// The source's configuration step, decided before anything is acted on: a pure function from a ConfigureSource
// request, the node's options and the transports' declared capabilities to the plan the source then applies
// (SourceNode::Configure: replica memory, registrations, connections). Every refusal of a request is decided here,
// so a refused request leaves the configuration in use untouched; no memory is allocated, no socket opened, no
// thread started, and the same input always gives the same plan (tests/daemon/source_plan_test.cc).

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "replica/model_config.h"
#include "replica/param_table.h"
#include "transport/transport.h"
#include "wsync/v1/daemon.pb.h"

namespace wsync::daemon {

struct SourcePlanOptions {
  int trainer_ranks = 1;
  // The node's own data-path transport (wsyncd --transport): writes every segment no registered backend owns.
  transport::Capabilities node_transport;
};

// One (engine, rank) the source writes.
struct PlannedTarget {
  int index = 0;   // in the request's targets
  int layout = 0;  // in SourcePlan::layouts
  // The registered backend that owns this rank's segments (transport/registry.h TransportForSegmentKind), "" for the
  // node's own transport, and what the one used declares.
  std::string transport;
  transport::Capabilities caps;
  // !caps.needs_target_daemon: the peer every segment's region descriptor names, which Endpoint::Connect takes.
  std::string peer;
  // Per replica param of its layout, in the table's order: the segment id and offset it lies at, its index in the
  // rank's layout, whether it is in memory the target daemon applies deltas into (its host segments, and its cuda ones
  // through the device scatter; not memory written one-sided), and the byte ranges (offset, length) this source writes
  // (the plan's slices; empty for a parameter another source writes).
  std::vector<int> segment;
  std::vector<uint64_t> dst_offset;
  std::vector<uint32_t> layout_index;
  std::vector<char> host_param;
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> ranges;
  uint64_t delta_write_bytes = 0;  // bytes of those parameters it takes from this source
};

struct SourcePlan {
  replica::ModelConfig config;
  replica::QuantSpec quant;
  // Distinct layouts (identical engine ranks share one: one load serves all of them) and their parameter tables
  // (what the replica allocates).
  std::vector<replica::RankParallelism> layouts;
  std::vector<replica::ParamTable> tables;
  std::vector<PlannedTarget> targets;
  // Per layout and param: whether some target takes bytes of it (what an update must complete).
  std::vector<std::vector<char>> required;
  // The plan's per-local-rank push lists and slices; empty rank_push when the request has no push filters (the
  // source then splits what its replica needs over its ranks).
  std::map<int, std::vector<std::string>> rank_push;
  std::map<int, std::vector<v1::TensorSliceSpec>> rank_slices;
  // Registered backends beyond the node's own that some target is written with (by name).
  std::set<std::string> transports;
};

// Decides the configuration for `req`, or refuses it (InvalidArgument / FailedPrecondition naming why: an unknown
// engine kind or quantization, a layout that does not match the model, a target listed twice, a write range outside
// its parameter, a segment without a descriptor or one the owning backend cannot parse, a rank whose segments mix
// backends or peers, a push filter out of range or naming unknown tensors, push filters naming tensors while the
// plan names no targets). Pure.
absl::StatusOr<SourcePlan> PlanSourceConfiguration(const v1::ConfigureSourceRequest& req,
                                                   const SourcePlanOptions& opts);

// The checkpoint tensors (trainer format) the plan's layouts are loaded from: the model's, with its next-n (MTP)
// layer when some engine rank has a draft (WeightSetOfLayout).
absl::StatusOr<std::vector<replica::TensorSpec>> PlanCheckpointTensors(const SourcePlan& plan);

// The engine rank's layout against the replica's table of it: every parameter on both sides with the same shape,
// dtype and size, inside a segment the layout lists once. `who` names the rank in errors.
absl::Status CheckTargetLayout(const replica::ParamTable& table, const v1::RankLayout& target, const std::string& who);

}  // namespace wsync::daemon
