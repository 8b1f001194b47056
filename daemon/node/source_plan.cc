#include "daemon/node/source_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/memory_kind.h"
#include "base/status.h"
#include "base/tensor_slice.h"
#include "daemon/common/convert.h"
#include "daemon/common/quantization.h"
#include "replica/mapper.h"
#include "transport/registry.h"

namespace wsync::daemon {
namespace {

std::string ShapeStr(absl::Span<const int64_t> s) { return absl::StrCat("[", absl::StrJoin(s, ","), "]"); }

// What the engines reported holding, passed on by the coordinator; checked in the one place that reads reports (no
// default block size: fp8_block without [n, k] is refused).
absl::StatusOr<replica::QuantSpec> QuantOf(const v1::ConfigureSourceRequest& req) {
  v1::WeightQuantization engines_hold;
  engines_hold.set_method(req.quantization());
  *engines_hold.mutable_block_size() = req.weight_block_size();
  engines_hold.set_scale_format(req.scale_format());
  WSYNC_RETURN_IF_ERROR(CheckQuantization(engines_hold));
  return QuantSpecOf(engines_hold);
}

// Which transport writes `t` and, for one that connects to the region's owner itself, to which peer. Every segment
// of one rank is written by one backend and, for those, lies in one peer (the rank's own transfer engine).
absl::Status ChooseTransport(const v1::TargetAssignment& t, const SourcePlanOptions& opts, const std::string& who,
                             PlannedTarget* out) {
  const transport::TransportEntry* owner = nullptr;
  SegmentKind first_kind = SegmentKind::kHost;
  for (int i = 0; i < t.layout().segments_size(); ++i) {
    const v1::MemorySegment& seg = t.layout().segments(i);
    if (seg.region_descriptor().empty())
      return absl::InvalidArgumentError(absl::StrCat(who, ": segment ", seg.id(), " has no region descriptor"));
    // The wire's kind name, parsed here once: the plan carries the transport it picks, never the name.
    absl::StatusOr<SegmentKind> kind = ParseSegmentKind(seg.kind());
    if (!kind.ok()) return Annotate(kind.status(), absl::StrCat("segment ", seg.id(), " of ", who));
    const transport::TransportEntry* e = transport::TransportForSegmentKind(*kind);
    if (i == 0) {
      owner = e;
      first_kind = *kind;
    } else if (e != owner) {
      return absl::InvalidArgumentError(absl::StrCat(who, ": mixes ", owner ? owner->name : SegmentKindName(first_kind),
                                                     " and ", e ? e->name : SegmentKindName(*kind), " segments"));
    }
    if (e == nullptr || e->caps.needs_target_daemon) continue;
    // Parsed here, not only where the segments are imported: that is after the plan in use is torn down.
    if (!e->region_peer) return absl::InternalError(absl::StrCat("the ", e->name, " transport names no peers"));
    auto peer = e->region_peer(seg.region_descriptor());
    if (!peer.ok()) return Annotate(peer.status(), absl::StrCat("segment ", seg.id(), " of ", who));
    if (!out->peer.empty() && out->peer != *peer)
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": segments in two ", e->name, " peers (", out->peer, ", ", *peer, ")"));
    out->peer = *peer;
  }
  out->transport = owner ? owner->name : "";
  out->caps = owner ? owner->caps : opts.node_transport;
  return absl::OkStatus();
}

// The per-param wiring of a checked target: where each replica param lands and which ranges of it this source
// writes. CheckTargetLayout made sure every param is there, inside its segment.
void WireTarget(const replica::ParamTable& table, const v1::TargetAssignment& a,
                const std::map<std::string, std::vector<std::pair<uint64_t, uint64_t>>>& writes, PlannedTarget* t) {
  std::map<std::string, const v1::ParamDesc*> theirs;
  std::map<std::string, uint32_t> their_index;
  for (const auto& p : a.layout().params()) {
    their_index[p.name()] = static_cast<uint32_t>(theirs.size());
    theirs[p.name()] = &p;
  }
  // Deltas are decoded by the target daemon (host segments in place, cuda ones by its device scatter): not behind a
  // transport whose receiver is no wsync daemon.
  std::set<int> host_segments;
  for (const auto& seg : a.layout().segments())
    if (t->caps.needs_target_daemon && !t->caps.one_sided_only) host_segments.insert(seg.id());
  const size_t n = table.params().size();
  t->segment.reserve(n);
  t->dst_offset.reserve(n);
  t->layout_index.reserve(n);
  t->host_param.reserve(n);
  t->ranges.reserve(n);
  for (const auto& p : table.params()) {
    const v1::ParamDesc* d = theirs.at(p.name);
    t->layout_index.push_back(their_index.at(p.name));
    t->host_param.push_back(host_segments.count(d->segment()) ? 1 : 0);
    t->segment.push_back(d->segment());
    t->dst_offset.push_back(d->offset());
    if (a.writes_size() == 0) {
      t->ranges.push_back({{0, p.bytes}});
    } else {
      auto it = writes.find(p.name);
      t->ranges.push_back(it == writes.end() ? std::vector<std::pair<uint64_t, uint64_t>>{} : it->second);
    }
    if (t->host_param.back())
      for (const auto& [offset, length] : t->ranges.back()) t->delta_write_bytes += length;
  }
}

absl::Status PlanPushFilters(const v1::ConfigureSourceRequest& req, const SourcePlanOptions& opts, SourcePlan* plan) {
  if (req.push_filters_size() == 0) return absl::OkStatus();
  WSYNC_ASSIGN_OR_RETURN(auto specs, PlanCheckpointTensors(*plan));
  std::set<std::string> known, seen;
  std::map<std::string, std::vector<int64_t>> shape_of;
  for (const auto& s : specs) known.insert(s.name), shape_of[s.name] = s.shape;
  for (const auto& f : req.push_filters()) {
    if (f.local_rank() < 0 || f.local_rank() >= opts.trainer_ranks || plan->rank_push.count(f.local_rank()))
      return absl::InvalidArgumentError(absl::StrCat("push filter for local rank ", f.local_rank(),
                                                     ": out of range [0, ", opts.trainer_ranks, ") or repeated"));
    auto& names = plan->rank_push[f.local_rank()];
    for (const auto& n : f.tensor_names()) {
      if (!known.count(n))
        return absl::InvalidArgumentError(absl::StrCat("push filter for local rank ", f.local_rank(), " names ", n,
                                                       ", which is not a tensor of the model"));
      if (!seen.insert(n).second)
        return absl::InvalidArgumentError(absl::StrCat("push filter: tensor ", n, " is assigned to two local ranks"));
      names.push_back(n);
    }
    for (const auto& sp : f.slices()) {
      TensorSlice ts;
      ts.name = sp.name();
      ts.full_shape.assign(sp.shape().begin(), sp.shape().end());
      ts.offsets.assign(sp.offsets().begin(), sp.offsets().end());
      ts.extents.assign(sp.extents().begin(), sp.extents().end());
      WSYNC_RETURN_IF_ERROR_CTX(ValidateSlice(&ts), "push filter for local rank ", f.local_rank());
      auto it = shape_of.find(ts.name);
      if (it == shape_of.end() || it->second != ts.full_shape)
        return absl::InvalidArgumentError(absl::StrCat("push filter for local rank ", f.local_rank(), " slices ",
                                                       ts.name, ", which is not a tensor of the model ",
                                                       "with that shape"));
      if (seen.count(ts.name))
        return absl::InvalidArgumentError(
            absl::StrCat("push filter: tensor ", ts.name, " is both pushed whole and sliced"));
      plan->rank_slices[f.local_rank()].push_back(sp);
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<replica::TensorSpec>> PlanCheckpointTensors(const SourcePlan& plan) {
  const bool draft = std::any_of(plan.layouts.begin(), plan.layouts.end(),
                                 [](const replica::RankParallelism& rp) { return replica::HoldsDraft(rp.weights); });
  return replica::CheckpointTensors(plan.config, replica::CheckpointFormat::kTrainer, 128, 128,
                                    draft ? replica::WeightSet::kAll : replica::WeightSet::kTarget);
}

absl::Status CheckTargetLayout(const replica::ParamTable& table, const v1::RankLayout& target, const std::string& who) {
  std::map<std::string, const v1::ParamDesc*> theirs;
  for (const auto& p : target.params()) theirs[p.name()] = &p;
  std::map<int, uint64_t> segments;
  for (const auto& s : target.segments())
    if (!segments.emplace(s.id(), s.bytes()).second)
      return absl::FailedPreconditionError(absl::StrCat(who, ": segment ", s.id(), " appears twice in the layout"));
  for (const auto& p : table.params()) {
    auto it = theirs.find(p.name);
    if (it == theirs.end())
      return absl::FailedPreconditionError(
          absl::StrCat(who, ": the engine has no parameter ", p.name, " that the replica layout has"));
    const v1::ParamDesc& t = *it->second;
    std::vector<int64_t> tshape(t.shape().begin(), t.shape().end());
    if (t.bytes() != p.bytes || tshape != p.shape || t.dtype() != DTypeName(p.dtype))
      return absl::FailedPreconditionError(
          absl::StrCat(who, ": parameter ", p.name, ": replica has ", ShapeStr(p.shape), " ", DTypeName(p.dtype), " (",
                       p.bytes, " bytes), engine has ", ShapeStr(tshape), " ", t.dtype(), " (", t.bytes(), " bytes)"));
    auto seg = segments.find(t.segment());
    if (seg == segments.end())
      return absl::FailedPreconditionError(
          absl::StrCat(who, ": parameter ", p.name, " is in segment ", t.segment(), ", which the layout lacks"));
    if (t.offset() > seg->second || t.bytes() > seg->second - t.offset())
      return absl::FailedPreconditionError(absl::StrCat(who, ": parameter ", p.name, " [", t.offset(), ", +", t.bytes(),
                                                        ") lies outside segment ", t.segment(), " (", seg->second,
                                                        " bytes)"));
  }
  if (static_cast<size_t>(target.params_size()) != table.params().size()) {
    for (const auto& t : target.params())
      if (table.Find(t.name()) == nullptr)
        return absl::FailedPreconditionError(
            absl::StrCat(who, ": the engine has parameter ", t.name(), " that the replica layout lacks"));
  }
  return absl::OkStatus();
}

absl::StatusOr<SourcePlan> PlanSourceConfiguration(const v1::ConfigureSourceRequest& req,
                                                   const SourcePlanOptions& opts) {
  SourcePlan plan;
  WSYNC_ASSIGN_OR_RETURN(plan.config, replica::ModelConfig::FromJson(req.model_config_json()));
  WSYNC_ASSIGN_OR_RETURN(plan.quant, QuantOf(req));
  if (req.targets_size() == 0) {
    // A node the plan gives no work is told so explicitly: an empty push list for each local rank. Without targets
    // any other request would have its ranks push into nothing (a plan lost on the way, or a coordinator bug).
    bool pushes = req.push_filters_size() == 0;
    for (const auto& f : req.push_filters()) pushes |= f.tensor_names_size() > 0 || f.slices_size() > 0;
    if (pushes)
      return absl::InvalidArgumentError(
          "the plan names no targets but the push filters are missing or name tensors: its ranks would push into "
          "nothing (a node without work gets an empty push filter per local rank)");
  }

  // Identical engine ranks (same parallelism and engine dialect) share one layout: one load serves all of them.
  std::vector<int> layout_of;
  for (const auto& t : req.targets()) {
    replica::RankParallelism rp = FromProto(t.layout().parallelism());
    auto dialect = replica::DialectForEngineKind(t.engine_kind());
    if (!dialect.ok()) return Annotate(dialect.status(), absl::StrCat("engine ", t.engine_id(), " rank ", t.rank()));
    rp.dialect = *dialect;
    rp.weights = WeightSetOfLayout(t.layout());  // a rank with a draft: target and draft, one table
    auto it = std::find(plan.layouts.begin(), plan.layouts.end(), rp);
    layout_of.push_back(static_cast<int>(it - plan.layouts.begin()));
    if (it == plan.layouts.end()) plan.layouts.push_back(rp);
  }
  for (const auto& rp : plan.layouts) {
    auto table = replica::BuildParamTable(plan.config, rp, plan.quant);
    if (!table.ok()) return Annotate(table.status(), absl::StrCat("layout tp_rank ", rp.tp_rank));
    plan.tables.push_back(*std::move(table));
  }

  std::set<std::pair<std::string, int>> seen_targets;
  plan.required.resize(plan.tables.size());
  for (size_t l = 0; l < plan.tables.size(); ++l) plan.required[l].assign(plan.tables[l].params().size(), 0);
  for (int i = 0; i < req.targets_size(); ++i) {
    const auto& t = req.targets(i);
    const std::string who = absl::StrCat("engine ", t.engine_id(), " rank ", t.rank());
    if (!seen_targets.emplace(t.engine_id(), t.rank()).second)
      return absl::InvalidArgumentError(absl::StrCat(who, " is a target twice in the plan"));
    const replica::ParamTable& table = plan.tables[layout_of[i]];
    WSYNC_RETURN_IF_ERROR(CheckTargetLayout(table, t.layout(), who));
    PlannedTarget pt;
    pt.index = i;
    pt.layout = layout_of[i];
    WSYNC_RETURN_IF_ERROR(ChooseTransport(t, opts, who, &pt));
    // The plan's byte ranges (name → ranges, checked against the table).
    std::map<std::string, std::vector<std::pair<uint64_t, uint64_t>>> writes;
    for (const auto& w : t.writes()) {
      const replica::EngineParam* p = table.Find(w.param());
      if (p == nullptr || w.length() == 0 || w.offset() > p->bytes || w.length() > p->bytes - w.offset())
        return absl::InvalidArgumentError(
            absl::StrCat(who, ": write range [", w.offset(), ", +", w.length(), ") of ", w.param(),
                         p == nullptr ? " names no parameter of the layout"
                                      : absl::StrCat(" is empty or outside its ", p->bytes, " bytes")));
      writes[w.param()].emplace_back(w.offset(), w.length());
    }
    WireTarget(table, t, writes, &pt);
    for (size_t p = 0; p < pt.ranges.size(); ++p)
      if (!pt.ranges[p].empty()) plan.required[pt.layout][p] = 1;
    if (!pt.transport.empty()) plan.transports.insert(pt.transport);
    plan.targets.push_back(std::move(pt));
  }
  WSYNC_RETURN_IF_ERROR(PlanPushFilters(req, opts, &plan));
  return plan;
}

}  // namespace wsync::daemon
