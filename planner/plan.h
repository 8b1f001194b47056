#pragma once
// The transfer planner: which trainer rank (source) writes which engine parameters to which engine rank (target).
//
// The core works on abstract layouts, not on a model: for every engine rank r (0..engine.tp-1) a list of
// parameters with their byte size, the trainer PP stage that produces them, and the HF tensors they are loaded from.
// Identical engine ranks of different engine instances share layout r (same bytes, same content), so one replica
// load on a source can serve all of them. See docs/planner.md for the algorithms and their guarantees.
//
// Threading: everything here is a pure function of its inputs; a Planner object is not thread-safe.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "planner/cluster.h"

namespace wsync::planner {

// One HF tensor the trainer hands over (what the push filter selects from).
struct HfTensorInfo {
  std::string name;
  uint64_t bytes = 0;        // in the transfer dtype (after trainer-side quantization)
  int stage = 0;             // trainer PP stage that holds it
  uint64_t train_bytes = 0;  // in the trainer's dtype: what the TP/EP all-gather moves (cost model; 0 = none)
  bool expert = false;       // routed-expert tensor (gathered over EP rather than TP)
};

// One engine parameter of one engine rank's layout.
struct ParamInfo {
  std::string name;
  uint64_t bytes = 0;
  int stage = 0;             // trainer PP stage that produces it
  std::vector<int> inputs;   // indices into PlanInput::hf_tensors this parameter is loaded from
};

struct LayoutInfo {
  std::vector<ParamInfo> params;
};

struct PlanInput {
  ClusterSpec cluster;
  std::vector<HfTensorInfo> hf_tensors;
  std::vector<LayoutInfo> layouts;  // index = engine rank; size must be cluster.engine.tp
  std::vector<int> instances;       // active engine instance ids (sorted, unique); empty = 0..engine.instances-1
  absl::Status Validate() const;
  std::vector<int> ActiveInstances() const;
};

enum class Strategy { kSeed, kBalanced };
absl::StatusOr<Strategy> ParseStrategy(absl::string_view name);
absl::string_view StrategyName(Strategy s);

struct PlanOptions {
  Strategy strategy = Strategy::kBalanced;
  // balanced: a cut that falls inside a parameter splits it into byte ranges (both sources load the parameter, each
  // writes its range) unless the cut is within `snap_bytes` of a parameter boundary, where it moves to the boundary.
  bool split_params = true;
  uint64_t snap_bytes = 4ull << 20;
  uint64_t align_bytes = 4096;  // byte-range cuts are multiples of this
  // balanced: a source is only given work if each used source gets at least this many bytes per copy (avoids
  // hundreds of tiny sessions for small models). 0 = use every source.
  uint64_t min_source_bytes = 64ull << 20;
};

// A byte range of one parameter of a layout. Whole parameter: offset 0, length = bytes.
struct ParamSlice {
  int param = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  bool operator==(const ParamSlice& o) const {
    return param == o.param && offset == o.offset && length == o.length;
  }
};

struct Target {
  int instance = 0;
  int rank = 0;
  bool operator==(const Target& o) const { return instance == o.instance && rank == o.rank; }
  bool operator<(const Target& o) const {
    return instance != o.instance ? instance < o.instance : rank < o.rank;
  }
};

// Write `slices` of layout `target.rank` into `target`.
struct Task {
  Target target;
  std::vector<ParamSlice> slices;
  uint64_t bytes = 0;
  bool operator==(const Task& o) const {
    return target == o.target && slices == o.slices && bytes == o.bytes;
  }
};

// What one source loads into its replica for one layout, and to which instances it fans out.
struct LayoutAssignment {
  int rank = 0;                        // engine rank = layout
  std::vector<ParamSlice> slices;      // sorted by param
  std::vector<int> instances;          // targets (instance, rank) this slice set goes to; empty = every active one
  uint64_t bytes = 0;                  // sum of slice lengths (one copy)
  uint64_t load_bytes = 0;             // bytes of the whole parameters touched (what the replica must load)
  bool operator==(const LayoutAssignment& o) const {
    return rank == o.rank && slices == o.slices && instances == o.instances;
  }
};

struct SourcePlan {
  int stage = 0;
  int index = 0;         // position within the stage (miles' gathered_dp_rank)
  int trainer_rank = 0;  // stage * sources_per_stage + index
  int node = 0;
  int nic = 0;           // NIC within the node
  std::vector<LayoutAssignment> assignments;  // replica loads, in load order
  std::vector<Task> tasks;                    // writes, in issue order (grouped by layout, load order)
  std::vector<int> push_filter;               // HF tensor ids (sorted) the trainer rank must hand over
  uint64_t push_bytes = 0;
  uint64_t load_bytes = 0;   // replica load work (sum over assignments)
  uint64_t bytes_out = 0;    // sum over tasks
  int sessions = 0;          // distinct targets
  bool active() const { return !tasks.empty(); }
};

struct NicLoad {
  int node = 0;
  int nic = 0;
  uint64_t bytes = 0;
};

struct Plan {
  Strategy strategy = Strategy::kBalanced;
  std::vector<SourcePlan> sources;  // every trainer rank, in rank order (inactive ones have no tasks)
  std::vector<NicLoad> source_nics;  // trainer NICs carrying at least one source
  std::vector<NicLoad> target_nics;  // engine NICs of active targets
  std::vector<uint64_t> target_bytes;  // per target, indexed instance_slot * tp + rank (ActiveInstances order)
};

// Builds the plan for every active instance. Deterministic: same input, same plan, on any machine.
absl::StatusOr<Plan> BuildPlan(const PlanInput& input, const PlanOptions& options);

// Checks the plan against the input: every target receives every byte of its layout exactly once per stage, no
// source sends a parameter of another stage or one it did not load, the push filter covers what was loaded.
absl::Status VerifyPlan(const PlanInput& input, const Plan& plan);

// Incremental re-planning. The replica assignment (which source loads which slices) depends only on the cluster
// shape and the layouts, never on how many instances are active, so an instance joining or leaving only adds or
// removes that instance's tasks (and their bytes); every other task keeps its content and relative order.
// The result is identical to BuildPlan on the new instance set (tested).
class Planner {
 public:
  static absl::StatusOr<Planner> Create(PlanInput input, PlanOptions options);
  const Plan& plan() const { return plan_; }
  const PlanInput& input() const { return input_; }
  // Adds instance `id` (InvalidArgument when out of range, AlreadyExists when active). Returns the changed sources.
  absl::StatusOr<std::vector<int>> AddInstance(int id);
  // Removes instance `id` (NotFound when not active). Returns the changed sources.
  absl::StatusOr<std::vector<int>> RemoveInstance(int id);

 private:
  Planner() = default;
  PlanInput input_;
  PlanOptions options_;
  Plan plan_;
};

// Summary figures used by the CLI, the cost model and the bench.
struct PlanStats {
  int sources_used = 0;
  int sources_total = 0;
  uint64_t max_source_bytes = 0, min_source_bytes = 0;  // over used sources
  double mean_source_bytes = 0;
  uint64_t max_target_bytes = 0, min_target_bytes = 0;
  double mean_target_bytes = 0;
  int max_sessions = 0, min_sessions = 0;
  double mean_sessions = 0;
  int max_layouts_per_source = 0;
  uint64_t max_load_bytes = 0;    // replica load work of the busiest source
  uint64_t total_bytes = 0;       // over the network
  uint64_t max_source_nic_bytes = 0, max_target_nic_bytes = 0;
  // max over stages of (max source bytes_out in the stage) / (stage bytes / sources in the stage).
  double imbalance = 0;
};
PlanStats ComputeStats(const PlanInput& input, const Plan& plan);

}  // namespace wsync::planner
