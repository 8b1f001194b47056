#pragma once
// The coordinator's re-plan, decided apart from the coordinator: a pure function from the membership (registered
// nodes, what is drained), the model the engines serve and the planning options to the transfer plan — per engine
// group the (source node, engine rank) assignments, per source node what each local trainer rank pushes, and the
// quantization the engines hold — or the reason no plan can be built. Coordinator::Replan applies the result (keeps
// it, and BeginUpdate configures the sources from it); tests/daemon/replan_test.cc drives it at Kimi-K2 scale.

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/common/quantization.h"
#include "google/protobuf/repeated_ptr_field.h"
#include "wsync/v1/common.pb.h"
#include "wsync/v1/coordinator.pb.h"
#include "wsync/v1/daemon.pb.h"

namespace wsync::daemon {

// One (source node, engine rank) pair of a plan: what that source writes to that rank. Shared, never copied: at
// 1024 engine ranks a plan holds thousands of assignments with millions of write ranges, and every rank's
// parameter table (hundreds of KB) once per engine rank, not once per source writing it; keeping a group's plan or
// flattening the groups into one plan copies pointers.
struct PlannedAssignment {
  std::string source;  // node id
  // Engine, rank, target daemon and node, kind, stage and the write ranges; its layout left empty (below).
  std::shared_ptr<const v1::TargetAssignment> assignment;
  std::shared_ptr<const v1::RankLayout> layout;  // the engine rank's table, one copy per engine rank
  uint64_t bytes = 0;
  int64_t epoch = -1;  // its group's plan epoch
  // AssignmentDigest(*assignment), computed once when the plan is built (empty: not computed): a source's
  // configuration key is made of its assignments' digests instead of a serialization of their write ranges (at 1024
  // engine ranks, 1.6 million of them) at every re-plan.
  std::string digest;
  // The assignment as a source is sent it (layout included).
  v1::TargetAssignment Wire() const {
    v1::TargetAssignment a = *assignment;
    if (layout) *a.mutable_layout() = *layout;
    return a;
  }
};

// Hex XXH3-128 of `a`'s deterministic serialization: equal digests, equal assignments (as the coordinator holds
// them: the layout left out).
std::string AssignmentDigest(const v1::TargetAssignment& a);

// Hex XXH3-128 of one engine's registration with its node id and address (deterministic bytes): what a group's
// plan depends on per engine. Serializing a Kimi-K2 engine's 32 rank tables takes tens of ms: the coordinator
// computes it once per registration and hands it in (ReplanInput::engine_digests) instead of once per plan.
std::string EngineInputDigest(const std::string& node_id, const std::string& node_address,
                              const v1::EngineRegistration& engine);

// One engine group's share of the plan (the engines of one kind and parallelism), kept between re-plans: a
// membership change re-plans only the groups whose inputs changed, the others keep their plan and epoch.
struct GroupPlan {
  // XXH3-128 (hex) of what it was planned from: model, options, sources, the engines' registrations (a digest, not
  // the bytes: at Kimi-K2 scale the registrations of one group are hundreds of MB).
  std::string inputs;
  int64_t epoch = -1;  // membership epoch it was planned at
  std::vector<std::string> engine_ids;
  std::vector<PlannedAssignment> planned;                             // in (source node, engine, rank) order
  std::map<std::string, std::vector<std::vector<std::string>>> push;  // source node → per local rank
  std::map<std::string, std::vector<google::protobuf::RepeatedPtrField<v1::TensorSliceSpec>>> slice_push;
};

// The coordinator's planning options (CoordinatorOptions' fields of the same names).
struct ReplanOptions {
  std::string strategy = "balanced";
  std::string trainer_parallelism;
  std::optional<uint64_t> min_source_bytes;
  std::string nic = "1x400Gbps";
  uint64_t snap_bytes = 4ull << 20;
};

// The source nodes that take part in plans (not drained), in (stage, node id) order, with their shape; pointers
// into the membership map given to PlanSourceNodes.
struct PlanSources {
  std::vector<const v1::RegisterNodeRequest*> nodes;
  int ranks_per_node = 1;
  int pp = 1;
};

// Sources ordered by (stage, node id); FailedPrecondition when none is left, a stage has no node that is not
// drained, nodes hold different numbers of trainer ranks, stages are not 0..pp-1 with equal node counts, or a
// drained node's ranks hold shards of their own (--trainer-parallelism, strategy local). Pure.
absl::StatusOr<PlanSources> PlanSourceNodes(const std::map<std::string, v1::RegisterNodeRequest>& nodes,
                                            const std::set<std::string>& drained_nodes, const ReplanOptions& options);

struct ReplanInput {
  const std::map<std::string, v1::RegisterNodeRequest>* nodes = nullptr;  // node id → registration
  const std::set<std::string>* drained_engines = nullptr;                 // engine ids
  const std::set<std::string>* drained_nodes = nullptr;                   // node ids
  int64_t membership_epoch = 0;                                           // the epoch groups planned afresh get
  std::string model_config_json;                                          // what the engines serve (EngineInfo)
  ReplanOptions options;
  // The groups of the plan in force (may be null): a group whose inputs did not change keeps its plan and epoch.
  const std::map<std::string, GroupPlan>* previous = nullptr;
  // Engine id → EngineInputDigest of its registration, as the caller computed it when the engine registered (may be
  // null; an engine not in it is digested here). Must be the digest of the registration in `nodes`.
  const std::map<std::string, std::string>* engine_digests = nullptr;
};

struct Replanned {
  std::vector<PlannedAssignment> plan;      // every group's assignments, groups in key order
  std::map<std::string, GroupPlan> groups;  // by group key ("<dialect> tp=N ep=N dp=N")
  std::vector<std::string> replanned;       // the keys planned afresh (the others were kept)
  // Engine registrations serialized and digested here (not found in ReplanInput::engine_digests): 0 when the caller
  // handed in every digest, so a kept plan costs no pass over the parameter tables (tests check it).
  size_t engines_digested = 0;
  // Per source node (every registered one, drained ones with empty lists): what each local trainer rank pushes.
  std::map<std::string, std::vector<v1::RankPushFilter>> push_filters;
  v1::WeightQuantization quantization;  // what every engine reports holding (the sources quantize to it)
  size_t sources = 0;                   // source nodes that take part
  int pp = 1, ranks_per_node = 1;
};

// Plans the membership in `in`. Engines are grouped by layout (engine kind and parallelism); sources in (stage, node
// id) order hold trainer ranks node_index * ranks_per_node + local rank; engines in id order are the planner's
// instances. Every engine rank must report the layout the planner computes for it (names and sizes) and every
// engine the same quantization (QuantSpecOfLayout; one source replica holds one). Errors (mostly
// FailedPrecondition) say what is refused and why, naming the engine, rank, parameter or option. Pure: reads `in`
// only, no clock, no I/O.
absl::StatusOr<Replanned> PlanMembership(const ReplanInput& in);

// The configuration of every source node in `nodes`, by node id: the model, its assignments (each as `assignment`
// makes it: PlannedAssignment::Wire for the whole request; the coordinator leaves the tables out and adds each
// source's when it sends it), its push filters and the engines' quantization. Pure (given a pure `assignment`).
template <typename AssignmentFn>
std::map<std::string, v1::ConfigureSourceRequest> SourceConfigurations(
    const std::map<std::string, v1::RegisterNodeRequest>& nodes, const std::string& model_config_json,
    const std::vector<PlannedAssignment>& plan, const std::map<std::string, std::vector<v1::RankPushFilter>>& filters,
    const v1::WeightQuantization& quantization, AssignmentFn assignment);

template <typename AssignmentFn>
std::map<std::string, v1::ConfigureSourceRequest> SourceConfigurations(
    const std::map<std::string, v1::RegisterNodeRequest>& nodes, const std::string& model_config_json,
    const std::vector<PlannedAssignment>& plan, const std::map<std::string, std::vector<v1::RankPushFilter>>& filters,
    const v1::WeightQuantization& quantization, AssignmentFn assignment) {
  std::map<std::string, v1::ConfigureSourceRequest> out;
  for (const auto& [id, n] : nodes)
    if (n.role() == "source") out[id].set_model_config_json(model_config_json);
  for (const auto& p : plan) *out[p.source].add_targets() = assignment(p);
  for (auto& [id, r] : out) {
    auto f = filters.find(id);
    if (f != filters.end()) *r.mutable_push_filters() = {f->second.begin(), f->second.end()};
    // The engines hold what they report: the source quantizes to it.
    SetSourceQuantization(quantization, &r);
  }
  return out;
}

}  // namespace wsync::daemon
