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
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "planner/cluster.h"
#include "planner/cost_params.h"

namespace wsync::planner {

// A rectangle of an HF tensor viewed as 2-D row-major [rows, cols] (1-D tensors as [n, 1]), in elements.
struct Box {
  int64_t row0 = 0, rows = 0, col0 = 0, cols = 0;
  bool empty() const { return rows <= 0 || cols <= 0; }
  uint64_t area() const { return empty() ? 0 : static_cast<uint64_t>(rows) * static_cast<uint64_t>(cols); }
  bool Contains(const Box& o) const {
    return o.empty() || (!empty() && o.row0 >= row0 && o.row0 + o.rows <= row0 + rows && o.col0 >= col0 &&
                         o.col0 + o.cols <= col0 + cols);
  }
  Box Intersect(const Box& o) const;
  bool operator==(const Box& o) const {
    return row0 == o.row0 && rows == o.rows && col0 == o.col0 && cols == o.cols;
  }
};

// How a Megatron trainer shards an HF tensor over its tensor-parallel group (TP for dense tensors, expert-TP for
// routed experts). kRows: column-parallel (q/k/v, gate/up, q_b/kv_b, vocab embeddings and lm_head); kCols:
// row-parallel (o_proj, down_proj); kReplicated: norms, router, MLA down-projections ("duplicated" in Megatron).
enum class TrainerSplit : uint8_t { kReplicated, kRows, kCols };

// One HF tensor the trainer hands over (what the push filter selects from).
struct HfTensorInfo {
  std::string name;
  uint64_t bytes = 0;        // in the transfer dtype (after trainer-side quantization)
  int stage = 0;             // trainer PP stage that holds it
  uint64_t train_bytes = 0;  // in the trainer's dtype: what the TP/EP all-gather moves (cost model; 0 = none)
  bool expert = false;       // routed-expert tensor (gathered over EP rather than TP)
  // Geometry for the `local` strategy (rows = 0: unknown; `local` then refuses the input).
  int64_t rows = 0, cols = 0;   // 2-D view
  TrainerSplit split = TrainerSplit::kReplicated;
  int64_t split_align = 1;      // shard sizes are multiples of this (Megatron pads the vocabulary to 128 per rank)
  // > 1: the split dimension is this many stacked tensors each split on its own (GLM4's fused gate_up_proj: a TP
  // rank holds its share of gate and its share of up, two rectangles).
  int split_parts = 1;
  int expert_id = -1;           // global routed-expert id (expert tensors)
  Box full() const { return {0, rows, 0, cols}; }
};

// A rectangle of an HF tensor that one engine parameter is loaded from.
struct Need {
  int hf = 0;
  Box box;
};

// One engine parameter of one engine rank's layout.
struct ParamInfo {
  std::string name;
  uint64_t bytes = 0;
  int stage = 0;             // trainer PP stage that produces it
  std::vector<int> inputs;   // indices into PlanInput::hf_tensors this parameter is loaded from
  std::vector<Need> needs;   // the rectangles it reads (the `local` strategy's input)
  bool draft = false;        // a parameter of the rank's speculative draft (ModelInputOptions::weights kAll)
};

struct LayoutInfo {
  std::vector<ParamInfo> params;
};

struct PlanInput {
  ClusterSpec cluster;
  std::vector<HfTensorInfo> hf_tensors;
  std::vector<LayoutInfo> layouts;  // index = engine rank; size must be cluster.engine.tp
  std::vector<int> instances;       // active engine instance ids (sorted, unique); empty = 0..engine.instances-1
  int num_experts = 0;              // routed experts per MoE layer (expert ownership under trainer EP)
  absl::Status Validate() const;
  std::vector<int> ActiveInstances() const;
};

enum class Strategy { kSeed, kBalanced, kLocal };
absl::StatusOr<Strategy> ParseStrategy(absl::string_view name);
// "--min-source-mib": "auto" -> nullopt, "N" -> N MiB in bytes (0 = every source). InvalidArgument otherwise.
absl::StatusOr<std::optional<uint64_t>> ParseMinSourceMib(absl::string_view text);
std::string FormatMinSourceMib(const std::optional<uint64_t>& bytes);
absl::string_view StrategyName(Strategy s);

struct PlanOptions {
  Strategy strategy = Strategy::kBalanced;
  // balanced: a cut that falls inside a parameter splits it into byte ranges (both sources load the parameter, each
  // writes its range) unless the cut is within `snap_bytes` of a parameter boundary, where it moves to the boundary.
  bool split_params = true;
  uint64_t snap_bytes = 4ull << 20;
  uint64_t align_bytes = 4096;  // byte-range cuts are multiples of this
  // balanced: how many of a stage's sources get work. nullopt (default, "auto"): the count the cost model below
  // predicts fastest for the stage; a source is added only if the stage's predicted time with it is lower, so
  // tiny shares, whose per-session cost outweighs the bytes they take off the others, stay together.
  // A value: an explicit floor, a source is only given work if each used source gets at least this many bytes per
  // copy; 0 = use every source.
  std::optional<uint64_t> min_source_bytes;
  // The instances the automatic source count plans for (ids, sorted); empty: every configured instance. A relay
  // plan (planner/relay.h) sets its group roots, the only instances its sources write.
  std::vector<int> count_instances;
  // The rates and fixed costs the automatic source count is predicted with (the `wsyncctl plan` flags of the same
  // names; the coordinator uses the defaults at its NIC rate).
  CostParams cost;
  // local: a source that does not yet serve an engine rank gets one of its parameters only when that beats the
  // best source already serving the rank by more than this many bytes (fewer replica layouts per source).
  uint64_t layout_affinity_bytes = 4ull << 20;
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

// The engine NIC a target writes through: (node, NIC within the node). Instance i's rank r is engine GPU
// i * tp + r, gpus_per_node() GPUs per node, GPU g of a node on NIC g * nics / gpus_per_node.
std::pair<int, int> TargetNicOf(const ClusterSpec& cluster, const Target& target);

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

// One rectangle of an HF tensor a trainer rank pushes (the `local` strategy's push filter). It lies inside one
// trainer shard; when no rank of the node holds that shard, the rank first gathers the rectangle from a holder on
// another node (gather_bytes > 0, in the trainer's dtype).
struct PushSlice {
  int hf = 0;
  Box box;
  uint64_t bytes = 0;                // transfer bytes of the box
  uint64_t gather_bytes = 0;         // trainer-dtype bytes it gathers first (its node holds none of the box)
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
  // `local` only: the rectangles of those tensors this rank pushes (disjoint per node and tensor); empty for the
  // other strategies, whose push filters name whole tensors.
  std::vector<PushSlice> push_slices;
  uint64_t gather_bytes = 0;        // `local`: sum of push_slices' gather_bytes
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
  int sessions = 0;  // (source, target) pairs with writes through this NIC
};

struct Plan {
  Strategy strategy = Strategy::kBalanced;
  std::vector<SourcePlan> sources;  // every trainer rank, in rank order (inactive ones have no tasks)
  std::vector<NicLoad> source_nics;  // trainer NICs carrying at least one source
  std::vector<NicLoad> target_nics;  // engine NICs of active targets
  std::vector<uint64_t> target_bytes;  // per target, indexed instance_slot * tp + rank (ActiveInstances order)
  uint64_t gather_bytes = 0;           // `local`: trainer-dtype bytes gathered by all ranks together
  uint64_t expert_gather_bytes = 0;    // `local`: of which expert tensors
};

// Which rectangle of HF tensor `h` trainer rank `index` (its position inside its PP stage) holds, under Megatron's
// rank order tp-cp-ep-dp-pp: a dense tensor's TP rank is index % tp; a routed expert's expert-TP rank is
// index % etp and its EP rank (index / etp) % ep, owning experts [ep_rank * E/ep, (ep_rank+1) * E/ep).
// Empty when the rank holds none of it, or holds more than one rectangle (HeldBoxes: split_parts > 1).
Box HeldBox(const TrainerSpec& trainer, int num_experts, const HfTensorInfo& h, int index);
std::vector<Box> HeldBoxes(const TrainerSpec& trainer, int num_experts, const HfTensorInfo& h, int index);

// Builds the plan for every active instance. Deterministic: same input, same plan, on any machine.
absl::StatusOr<Plan> BuildPlan(const PlanInput& input, const PlanOptions& options);

// balanced's automatic source count (PlanOptions::min_source_bytes unset), per stage. A count u of a stage's S
// sources is judged on the stage alone (BuildStagePlan) by the cost model's transfer time of that plan
// (PredictTransfer: slowest source or target NIC, with PlanOptions::cost); the planner keeps the fewest sources
// with the lowest (transfer_s, sources_s). See docs/planner.md, "How many sources".
struct StageCountTime {
  double transfer_s = 0;  // slowest source or target NIC of the stage
  double sources_s = 0;   // slowest source alone: decides between counts a target NIC makes equal
};
// The stage alone cut for `sources` of its sources (spread evenly over its ranks, each weighted 1 / the stage's
// used sources on its NIC) and written to every configured instance; other stages' sources stay idle. What a count
// is judged on. InvalidArgument for a stage or count out of range.
absl::StatusOr<Plan> BuildStagePlan(const PlanInput& input, const PlanOptions& options, int stage, int sources);
// PredictTransfer of BuildStagePlan(input, options, stage, sources), computed from the cut alone without building
// the plan: what the planner evaluates per count (equal to the bit; tested).
absl::StatusOr<StageCountTime> PredictStageCount(const PlanInput& input, const PlanOptions& options, int stage,
                                                 int sources);
// The count the planner picks for every stage (BuildPlan's balanced strategy with min_source_bytes unset).
absl::StatusOr<std::vector<int>> AutoSourceCounts(const PlanInput& input, const PlanOptions& options);

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
