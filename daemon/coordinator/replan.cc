#include "daemon/coordinator/replan.h"

#include <xxhash.h>

#include <algorithm>
#include <memory>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status.h"
#include "daemon/common/quantization.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "planner/model_input.h"
#include "daemon/common/convert.h"
#include "planner/plan.h"
#include "replica/layout_plan.h"
#include "replica/model_config.h"

namespace wsync::daemon {
namespace {

// Byte-stable serialization (map fields in key order), to tell whether a registration changed.
std::string StableBytes(const google::protobuf::Message& m) {
  std::string out;
  {
    google::protobuf::io::StringOutputStream sos(&out);
    google::protobuf::io::CodedOutputStream cos(&sos);
    cos.SetSerializationDeterministic(true);
    m.SerializeToCodedStream(&cos);
  }
  return out;
}

struct Engine {
  std::string node_id;
  std::string node_addr;
  const v1::EngineRegistration* reg;
};

// Hex XXH3-128 of `common` and every engine's EngineInputDigest (from `cached` where the caller has it; `computed`
// counts the others). Empty (never taken as unchanged) if no hash state could be allocated.
std::string InputsDigest(const std::string& common, const std::vector<Engine>& engines,
                         const std::map<std::string, std::string>* cached, size_t* computed) {
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(), &XXH3_freeState);
  if (state == nullptr) return std::string();
  XXH3_state_t* st = state.get();
  XXH3_128bits_reset(st);
  XXH3_128bits_update(st, common.data(), common.size());
  for (const Engine& e : engines) {
    std::string digest;
    if (cached != nullptr)
      if (auto it = cached->find(e.reg->engine_id()); it != cached->end()) digest = it->second;
    if (digest.empty()) {
      digest = EngineInputDigest(e.node_id, e.node_addr, *e.reg);
      ++*computed;
    }
    XXH3_128bits_update(st, digest.data(), digest.size());
  }
  const XXH128_hash_t h = XXH3_128bits_digest(st);
  return absl::StrFormat("%016x%016x", h.high64, h.low64);
}

bool Drained(const ReplanInput& in, const std::string& node_id, const std::string& engine_id) {
  return in.drained_engines->count(engine_id) > 0 || in.drained_nodes->count(node_id) > 0;
}

// The quantization every rank of every engine in `engines` reports; FailedPrecondition naming two engine ranks
// that report different ones (one plan, one source replica, one quantization).
absl::StatusOr<std::pair<v1::WeightQuantization, replica::QuantSpec>> GroupQuantization(
    const std::vector<Engine>& engines) {
  const v1::RankLayout& first = engines.front().reg->ranks(0);
  const std::string first_who = absl::StrCat("engine ", engines.front().reg->engine_id(), " rank ", first.rank());
  WSYNC_ASSIGN_OR_RETURN(replica::QuantSpec spec, QuantSpecOfLayout(first, first_who));
  for (const Engine& e : engines)
    for (const auto& r : e.reg->ranks()) {
      const std::string who = absl::StrCat("engine ", e.reg->engine_id(), " rank ", r.rank());
      WSYNC_RETURN_IF_ERROR(QuantSpecOfLayout(r, who).status());
      if (!SameQuantization(r.quantization(), first.quantization()))
        return absl::FailedPreconditionError(absl::StrCat(who, " reports quantization ",
                                                          QuantizationName(r.quantization()), ", ", first_who, " ",
                                                          QuantizationName(first.quantization())));
    }
  return std::make_pair(first.quantization(), spec);
}

}  // namespace

std::string AssignmentDigest(const v1::TargetAssignment& a) {
  const std::string bytes = StableBytes(a);
  const XXH128_hash_t h = XXH3_128bits(bytes.data(), bytes.size());
  return absl::StrFormat("%016x%016x", h.high64, h.low64);
}

std::string EngineInputDigest(const std::string& node_id, const std::string& node_address,
                              const v1::EngineRegistration& engine) {
  const std::string head = absl::StrCat(node_id, " ", node_address, " ");
  const std::string reg = StableBytes(engine);
  const uint64_t n = reg.size();  // length-prefixed: no two different sequences hash the same bytes
  std::string bytes = head;
  bytes.append(reinterpret_cast<const char*>(&n), sizeof(n));
  bytes += reg;
  const XXH128_hash_t h = XXH3_128bits(bytes.data(), bytes.size());
  return absl::StrFormat("%016x%016x", h.high64, h.low64);
}

absl::StatusOr<PlanSources> PlanSourceNodes(const std::map<std::string, v1::RegisterNodeRequest>& nodes,
                                            const std::set<std::string>& drained_nodes, const ReplanOptions& options) {
  // Every node must hold the same number of trainer ranks, every stage the same number of nodes (Megatron rank
  // order: stage p owns a contiguous block of ranks).
  PlanSources out;
  std::vector<const v1::RegisterNodeRequest*>& sources = out.nodes;
  std::set<int> all_stages;
  bool any_drained = false;
  for (const auto& [id, n] : nodes) {
    if (n.role() != "source") continue;
    all_stages.insert(n.pp_stage());
    if (drained_nodes.count(id)) {
      any_drained = true;
      continue;
    }
    sources.push_back(&n);
  }
  if (sources.empty())
    return absl::FailedPreconditionError(any_drained ? "every source node is drained"
                                                     : "no source daemon has registered");
  for (int stage : all_stages) {
    bool held = false;
    for (const auto* s : sources) held |= s->pp_stage() == stage;
    if (!held)
      return absl::FailedPreconditionError(
          absl::StrCat("trainer stage ", stage,
                       " has no source node left that is not drained: the tensors of its layers could "
                       "not be pushed"));
  }
  if (any_drained && (!options.trainer_parallelism.empty() || options.strategy == "local"))
    return absl::FailedPreconditionError(
        "a drained source node's trainer ranks hold their own shards under --trainer-parallelism / strategy local: "
        "the other nodes cannot push them");
  std::sort(sources.begin(), sources.end(), [](const auto* a, const auto* b) {
    return std::make_pair(a->pp_stage(), a->node_id()) < std::make_pair(b->pp_stage(), b->node_id());
  });
  out.ranks_per_node = std::max(sources.front()->trainer_ranks(), 1);
  std::map<int, int> nodes_per_stage;
  for (const auto* s : sources) {
    if (std::max(s->trainer_ranks(), 1) != out.ranks_per_node)
      return absl::FailedPreconditionError(absl::StrCat("source nodes hold different numbers of trainer ranks (",
                                                        sources.front()->node_id(), ": ", out.ranks_per_node, ", ",
                                                        s->node_id(), ": ", s->trainer_ranks(), ")"));
    ++nodes_per_stage[s->pp_stage()];
  }
  out.pp = static_cast<int>(nodes_per_stage.size());
  for (const auto& [stage, count] : nodes_per_stage)
    if (stage >= out.pp || count != nodes_per_stage.begin()->second)
      return absl::FailedPreconditionError(absl::StrCat("trainer stages must be 0..", out.pp - 1,
                                                        " with the same number of source nodes",
                                                        any_drained ? " (not drained)" : "", " each; stage ", stage,
                                                        " has ", count, " (a stage may not have registered yet)"));
  return out;
}

absl::StatusOr<Replanned> PlanMembership(const ReplanInput& in) {
  const ReplanOptions& opts = in.options;
  WSYNC_ASSIGN_OR_RETURN(PlanSources ps, PlanSourceNodes(*in.nodes, *in.drained_nodes, opts));
  const std::vector<const v1::RegisterNodeRequest*>& sources = ps.nodes;
  const int ranks_per_node = ps.ranks_per_node, pp = ps.pp;

  // Engines: grouped by everything that makes their layouts differ.
  std::map<std::string, std::vector<Engine>> groups;  // "<dialect> tp=N ep=N dp=N"
  std::map<std::string, std::tuple<int, int, int>> group_shape;
  std::map<std::string, replica::WeightSet> group_weights;
  bool any_drained = false;
  for (const auto& [id, n] : *in.nodes)
    for (const auto& e : n.engines()) {
      if (Drained(in, id, e.engine_id())) {
        any_drained = true;
        continue;
      }
      if (e.ranks_size() == 0)
        return absl::FailedPreconditionError(absl::StrCat("engine ", e.engine_id(), " has no ranks"));
      auto dialect = replica::DialectForEngineKind(e.kind());
      if (!dialect.ok()) return Annotate(dialect.status(), absl::StrCat("engine ", e.engine_id()));
      const auto& par = e.ranks(0).parallelism();
      const int tp = e.ranks_size(), ep = std::max(par.ep_size(), 1), dp = std::max(par.attn_dp_size(), 1);
      // A draft (speculative decoding) is updated on every rank of the engine or on none.
      const replica::WeightSet weights = WeightSetOfLayout(e.ranks(0));
      for (const auto& r : e.ranks())
        if (WeightSetOfLayout(r) != weights)
          return absl::FailedPreconditionError(
              absl::StrCat("engine ", e.engine_id(), " rank ", r.rank(),
                           (weights == replica::WeightSet::kAll ? " lacks" : " has"), " a draft segment that rank ",
                           e.ranks(0).rank(), (weights == replica::WeightSet::kAll ? " has" : " lacks"),
                           ": a speculative draft is updated on every rank of an engine or on none"));
      std::string key = absl::StrCat(replica::DialectName(*dialect), " tp=", tp, " ep=", ep, " dp=", dp);
      if (weights == replica::WeightSet::kAll) key += " +draft";
      groups[key].push_back({id, n.address(), &e});
      group_shape[key] = {tp, ep, dp};
      group_weights[key] = weights;
    }
  if (groups.empty())
    return absl::FailedPreconditionError(any_drained ? "every engine is drained"
                                                     : "no target daemon with an engine has registered");
  WSYNC_ASSIGN_OR_RETURN(replica::ModelConfig cfg, replica::ModelConfig::FromJson(in.model_config_json));
  WSYNC_ASSIGN_OR_RETURN(planner::Strategy strategy, planner::ParseStrategy(opts.strategy));
  if (strategy == planner::Strategy::kLocal && groups.size() > 1)
    return absl::FailedPreconditionError(
        "strategy local plans one engine group (one engine kind and parallelism); this membership has several");

  // The sources hold one replica, quantized one way: every engine must report the same quantization.
  Replanned out;
  std::string quant_of;  // the engine whose report out.quantization is
  std::map<std::string, replica::QuantSpec> group_quant;
  for (auto& [key, engines] : groups) {
    std::sort(engines.begin(), engines.end(),
              [](const Engine& a, const Engine& b) { return a.reg->engine_id() < b.reg->engine_id(); });
    WSYNC_ASSIGN_OR_RETURN(auto q, GroupQuantization(engines));
    if (quant_of.empty()) {
      out.quantization = q.first;
      quant_of = engines.front().reg->engine_id();
    } else if (!SameQuantization(q.first, out.quantization)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "engine ", engines.front().reg->engine_id(), " reports quantization ", QuantizationName(q.first), ", engine ",
          quant_of, " ", QuantizationName(out.quantization), ": the sources quantize one way for every engine"));
    }
    group_quant[key] = q.second;
  }

  // What every group's plan depends on besides its own engines.
  std::string common =
      absl::StrCat(in.model_config_json, "\n", opts.strategy, "\n", opts.trainer_parallelism, "\n",
                   planner::FormatMinSourceMib(opts.min_source_bytes), "\n", opts.nic, "\n", opts.snap_bytes, "\n");
  for (const auto* s : sources)
    absl::StrAppend(&common, s->node_id(), " ", s->address(), " ", s->trainer_ranks(), " ", s->pp_stage(), "\n");

  std::map<std::string, std::vector<int64_t>> shapes;  // checkpoint tensor → shape (slices are sent in its dims)
  std::map<std::string, GroupPlan>& new_groups = out.groups;
  for (auto& [key, engines] : groups) {
    std::string inputs = InputsDigest(common, engines, in.engine_digests, &out.engines_digested);
    if (in.previous != nullptr) {
      if (auto old = in.previous->find(key);
          old != in.previous->end() && !inputs.empty() && old->second.inputs == inputs) {
        new_groups[key] = old->second;  // unchanged inputs: the same plan, its epoch kept
        continue;
      }
    }
    out.replanned.push_back(key);
    GroupPlan g;
    g.inputs = std::move(inputs);
    g.epoch = in.membership_epoch;
    for (const Engine& e : engines) g.engine_ids.push_back(e.reg->engine_id());
    const replica::WeightSet weights = group_weights.at(key);
    if (weights == replica::WeightSet::kAll && !replica::HasDraft(cfg))
      return absl::FailedPreconditionError(absl::StrCat(
          "engine ", engines.front().reg->engine_id(), " declares a speculative draft (a draft segment on its ranks), "
          "but the model (", cfg.architecture, ") has no draft: its config.json declares no next-n / MTP layer "
          "(num_nextn_predict_layers) and no separate draft checkpoint (speculative_draft)"));
    if (shapes.empty() || weights == replica::WeightSet::kAll) {
      WSYNC_ASSIGN_OR_RETURN(auto specs, replica::CheckpointTensors(cfg, replica::CheckpointFormat::kTrainer, 128, 128,
                                                                    weights));
      for (const auto& sp : specs) shapes[sp.name] = sp.shape;
    }
    // (source node, engine, rank) → the assignment being built and its write ranges
    std::map<std::tuple<std::string, std::string, int>, std::pair<PlannedAssignment, v1::TargetAssignment>> planned;
    // engine rank → its table, shared by every assignment to it
    std::map<std::pair<std::string, int>, std::shared_ptr<const v1::RankLayout>> tables;
    std::map<std::string, std::set<std::string>> pushed;  // node → tensors already assigned
    planner::ClusterSpec c;
    if (!opts.trainer_parallelism.empty()) {
      auto t = planner::ParseTrainerSpec(opts.trainer_parallelism);
      if (!t.ok()) return Annotate(t.status(), "--trainer-parallelism");
      c.trainer = *t;
    }
    c.trainer.pp = pp;
    c.trainer.nodes = static_cast<int>(sources.size());
    c.trainer.gpus_per_node = ranks_per_node;
    c.engine.instances = static_cast<int>(engines.size());
    std::tie(c.engine.tp, c.engine.ep, c.engine.dp_attention) = group_shape.at(key);
    // Engines on distinct target nodes have NICs of their own (the cost model's target side, which the automatic
    // source count weighs).
    std::set<std::string> engine_nodes;
    for (const Engine& e : engines) engine_nodes.insert(e.node_id);
    c.engine.nodes = static_cast<int>(engine_nodes.size());
    auto nic = planner::ParseNicSpec(opts.nic);
    if (!nic.ok()) return Annotate(nic.status(), "--nic");
    c.nic = *nic;
    planner::ModelInputOptions mo;
    mo.dialect = *replica::DialectForEngineKind(engines.front().reg->kind());
    // Quantization is what the engines report (GroupQuantization), never the parameter names.
    mo.quant = group_quant.at(key);
    mo.weights = weights;
    replica::ModelConfig gcfg = cfg;
    if (mo.quant.mode == replica::QuantSpec::Mode::kFp8Block)
      gcfg.weight_block_size = {mo.quant.block_n, mo.quant.block_k};
    auto input = planner::BuildModelInput(gcfg, c, mo);
    if (!input.ok())
      return Annotate(input.status(), absl::StrCat("planning engines of kind ", engines.front().reg->kind()));
    // Every engine rank must hold exactly the layout planned for it (names and sizes), before any write.
    for (const Engine& e : engines)
      for (const auto& r : e.reg->ranks()) {
        const std::string who = absl::StrCat("engine ", e.reg->engine_id(), " rank ", r.rank());
        if (r.rank() < 0 || r.rank() >= c.engine.tp)
          return absl::FailedPreconditionError(absl::StrCat(who, ": rank out of [0, ", c.engine.tp, ")"));
        std::set<int> draft_segments;
        for (const auto& sg : r.segments())
          if (sg.weights() == v1::WEIGHT_SET_DRAFT) draft_segments.insert(sg.id());
        std::map<std::string, const v1::ParamDesc*> theirs;
        for (const auto& p : r.params()) theirs[p.name()] = &p;
        for (const auto& p : input->layouts[r.rank()].params) {
          const std::string whose = p.draft ? absl::StrCat("draft of ", who) : who;
          auto it = theirs.find(p.name);
          if (it == theirs.end())
            return absl::FailedPreconditionError(absl::StrCat(whose, " lacks parameter ", p.name));
          if (it->second->bytes() != p.bytes)
            return absl::FailedPreconditionError(absl::StrCat(
                whose, ": parameter ", p.name, " has ", it->second->bytes(), " bytes, the model needs ", p.bytes));
          // The typed segments say which model a parameter belongs to: a draft parameter lies in a draft segment.
          if (draft_segments.count(it->second->segment()) != (p.draft ? 1u : 0u))
            return absl::FailedPreconditionError(absl::StrCat(
                whose, ": parameter ", p.name, " is the ", p.draft ? "draft's" : "target's", " but lies in segment ",
                it->second->segment(), ", a ", p.draft ? "target" : "draft", " segment"));
        }
        if (theirs.size() != input->layouts[r.rank()].params.size())
          return absl::FailedPreconditionError(absl::StrCat(
              who, " has ", theirs.size(), " parameters, the model's layout ", input->layouts[r.rank()].params.size()));
      }
    planner::PlanOptions po;
    po.strategy = strategy;
    po.min_source_bytes = opts.min_source_bytes;
    po.snap_bytes = opts.snap_bytes;
    auto plan = planner::BuildPlan(*input, po);
    if (!plan.ok()) return Annotate(plan.status(), "building the transfer plan");
    WSYNC_RETURN_IF_ERROR_CTX(planner::VerifyPlan(*input, *plan), "checking the transfer plan");
    for (const auto& sp : plan->sources) {
      const v1::RegisterNodeRequest& node = *sources[sp.trainer_rank / ranks_per_node];
      const int local = sp.trainer_rank % ranks_per_node;
      for (const auto& task : sp.tasks) {
        const Engine& e = engines[task.target.instance];
        const v1::RankLayout* layout = nullptr;
        for (const auto& r : e.reg->ranks())
          if (r.rank() == task.target.rank) layout = &r;
        if (layout == nullptr)
          return absl::FailedPreconditionError(
              absl::StrCat("engine ", e.reg->engine_id(), " did not report rank ", task.target.rank));
        auto& [p, a] = planned[{node.node_id(), e.reg->engine_id(), task.target.rank}];
        if (p.source.empty()) {
          p.source = node.node_id();
          p.epoch = g.epoch;
          auto& table = tables[{e.reg->engine_id(), task.target.rank}];
          if (!table) table = std::make_shared<const v1::RankLayout>(*layout);
          p.layout = table;
          a.set_engine_id(e.reg->engine_id());
          a.set_rank(task.target.rank);
          a.set_target_daemon(e.node_addr);
          a.set_target_node(e.node_id);
          a.set_engine_kind(e.reg->kind());
          a.set_pp_stage(sp.stage);
        }
        for (const auto& s : task.slices) {
          auto* w = a.add_writes();
          w->set_param(input->layouts[task.target.rank].params[s.param].name);
          w->set_offset(s.offset);
          w->set_length(s.length);
          p.bytes += s.length;
        }
      }
      auto& lists = g.push[node.node_id()];
      lists.resize(ranks_per_node);
      if (strategy == planner::Strategy::kLocal) {
        // Slices (planner::PushSlice, rectangles of the 2-D view) as offsets/extents of the tensor's own shape; a
        // slice covering the whole tensor is pushed by name.
        auto& sl = g.slice_push[node.node_id()];
        sl.resize(ranks_per_node);
        for (const auto& psl : sp.push_slices) {
          const planner::HfTensorInfo& h = input->hf_tensors[psl.hf];
          if (psl.box == h.full()) {
            lists[local].push_back(h.name);
            continue;
          }
          const std::vector<int64_t>& shape = shapes.at(h.name);
          v1::TensorSliceSpec spec;
          spec.set_name(h.name);
          spec.set_gather(psl.gather_bytes > 0);
          for (int64_t d : shape) spec.add_shape(d);
          if (shape.size() == 2) {
            spec.add_offsets(psl.box.row0), spec.add_offsets(psl.box.col0);
            spec.add_extents(psl.box.rows), spec.add_extents(psl.box.cols);
          } else {
            // A row range of the 2-D view: whole sub-tensors along dim 0 (1-D: elements).
            int64_t inner = 1;
            for (size_t d = 1; d + 1 < shape.size(); ++d) inner *= shape[d];
            if (psl.box.cols != h.cols || psl.box.row0 % inner != 0 || psl.box.rows % inner != 0)
              return absl::InternalError(absl::StrCat("local plan slices ", h.name, " across its inner dims"));
            spec.add_offsets(psl.box.row0 / inner), spec.add_extents(psl.box.rows / inner);
            for (size_t d = 1; d < shape.size(); ++d) spec.add_offsets(0), spec.add_extents(shape[d]);
          }
          *sl[local].Add() = std::move(spec);
        }
        continue;
      }
      for (int h : sp.push_filter) {
        const std::string& name = input->hf_tensors[h].name;
        if (pushed[node.node_id()].insert(name).second) lists[local].push_back(name);
      }
    }
    for (auto& [k, pa] : planned) {
      pa.first.digest = AssignmentDigest(pa.second);
      pa.first.assignment = std::make_shared<const v1::TargetAssignment>(std::move(pa.second));
      g.planned.push_back(std::move(pa.first));
    }
    new_groups[key] = std::move(g);
  }

  // The whole plan: the groups' plans in key order; a node pushes a tensor once whichever groups need it.
  std::map<std::string, std::vector<std::vector<std::string>>> push;  // node → per local rank
  std::map<std::string, std::set<std::string>> pushed;
  std::map<std::string, std::vector<google::protobuf::RepeatedPtrField<v1::TensorSliceSpec>>> slice_push;
  for (const auto& [key, g] : new_groups) {
    out.plan.insert(out.plan.end(), g.planned.begin(), g.planned.end());
    for (const auto& [node, lists] : g.push) {
      auto& o = push[node];
      o.resize(ranks_per_node);
      for (size_t r = 0; r < lists.size() && r < o.size(); ++r)
        for (const auto& name : lists[r])
          if (pushed[node].insert(name).second) o[r].push_back(name);
    }
    for (const auto& [node, sl] : g.slice_push) slice_push[node] = sl;  // local: one group only
  }
  for (const auto& [id, n] : *in.nodes) {
    if (n.role() != "source") continue;
    // A drained source node is configured with empty lists: its ranks push nothing.
    auto& filters = out.push_filters[id];
    const auto& lists = push[id];
    for (int r = 0; r < std::max(n.trainer_ranks(), 1); ++r) {
      v1::RankPushFilter f;
      f.set_local_rank(r);
      if (r < static_cast<int>(lists.size())) *f.mutable_tensor_names() = {lists[r].begin(), lists[r].end()};
      auto sl = slice_push.find(id);
      if (sl != slice_push.end() && r < static_cast<int>(sl->second.size())) *f.mutable_slices() = sl->second[r];
      filters.push_back(std::move(f));
    }
  }
  out.sources = sources.size();
  out.pp = pp;
  out.ranks_per_node = ranks_per_node;
  return out;
}

}  // namespace wsync::daemon
