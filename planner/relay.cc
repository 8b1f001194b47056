#include "planner/relay.h"

#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status.h"

namespace wsync::planner {
namespace {

constexpr int kMaxDegree = 1 << 16;

uint64_t EgressBytes(const Plan& plan) {
  uint64_t b = 0;
  for (const SourcePlan& s : plan.sources) b += s.bytes_out;
  return b;
}

// What the sources write into `root`, cut into chunks: per rank, every slice of every task to (root, rank), each
// slice cut at chunk_bytes from its start (a chunk never spans two sources' writes). Sorted by (param, offset).
std::vector<RelayRankRegions> RootRegions(const PlanInput& in, const Plan& plan, int root, uint64_t chunk_bytes) {
  std::vector<RelayRankRegions> out(in.layouts.size());
  for (size_t r = 0; r < out.size(); ++r) out[r].rank = static_cast<int>(r);
  for (size_t k = 0; k < plan.sources.size(); ++k) {
    for (const Task& t : plan.sources[k].tasks) {
      if (t.target.instance != root) continue;
      RelayRankRegions& rr = out[t.target.rank];
      for (const ParamSlice& sl : t.slices) {
        if (sl.length == 0) {
          rr.chunks.push_back({sl.param, sl.offset, 0, static_cast<int>(k)});
          continue;
        }
        for (uint64_t off = 0; off < sl.length; off += chunk_bytes) {
          rr.chunks.push_back({sl.param, sl.offset + off, std::min(chunk_bytes, sl.length - off), static_cast<int>(k)});
        }
        rr.bytes += sl.length;
      }
    }
  }
  for (RelayRankRegions& rr : out) {
    std::sort(rr.chunks.begin(), rr.chunks.end(), [](const RelayChunk& a, const RelayChunk& b) {
      return a.param != b.param ? a.param < b.param : a.offset < b.offset;
    });
  }
  return out;
}

void SetShape(RelayTree* t, int degree) {
  t->nodes = RelayTreeShape(t->group.instances, degree);
  t->degree = 0;
  t->depth = 0;
  for (const RelayNode& n : t->nodes) {
    t->degree = std::max(t->degree, static_cast<int>(n.children.size()));
    t->depth = std::max(t->depth, n.depth);
  }
}

struct NicKey {
  int node, nic;
  bool operator<(const NicKey& o) const { return node != o.node ? node < o.node : nic < o.nic; }
};

// Every target NIC's traffic under the plan's trees; `forwarding` false leaves out what relays send (the inbound
// copies alone, which the direct plan pays too).
std::map<NicKey, RelayNic> NicTraffic(const PlanInput& in, const RelayPlan& rp, const CostParams& cp, bool forwarding) {
  std::map<NicKey, RelayNic> nics;
  // Writers into each root rank: the sources with tasks to it.
  std::map<Target, int> writers;
  for (const SourcePlan& s : rp.plan.sources) {
    std::set<Target> seen;
    for (const Task& t : s.tasks)
      if (seen.insert(t.target).second) writers[t.target]++;
  }
  for (const RelayTree& t : rp.trees) {
    for (const RelayNode& n : t.nodes) {
      for (const RelayRankRegions& rr : t.regions) {
        const auto [node, nic] = TargetNicOf(in.cluster, {n.instance, rr.rank});
        RelayNic& x = nics[{node, nic}];
        x.node = node, x.nic = nic;
        x.in_bytes += rr.bytes;
        x.sessions += n.parent < 0 ? writers[{n.instance, rr.rank}] : 1;
        if (forwarding) {
          x.out_bytes += rr.bytes * n.children.size();
          x.sessions += static_cast<int>(n.children.size());
        }
      }
    }
  }
  const double bw = in.cluster.nic.bytes_per_second();
  for (auto& [k, x] : nics) x.time_s = PredictTargetNic(cp, bw, std::max(x.in_bytes, x.out_bytes), x.sessions);
  return nics;
}

double MaxTime(const std::map<NicKey, RelayNic>& nics) {
  double t = 0;
  for (const auto& [k, x] : nics) t = std::max(t, x.time_s);
  return t;
}

}  // namespace

absl::StatusOr<RelayOptions> ParseRelayMode(absl::string_view text) {
  const std::string t = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text));
  RelayOptions o;
  if (t == "off") return o;
  if (t == "auto") {
    o.mode = RelayMode::kAuto;
    return o;
  }
  int d = 0;
  if (absl::SimpleAtoi(t, &d) && d >= 1 && d <= kMaxDegree) {
    o.mode = RelayMode::kDegree;
    o.degree = d;
    return o;
  }
  return absl::InvalidArgumentError(absl::StrCat("--relay: expected auto, off or a degree (children per relay, 1..",
                                                 kMaxDegree, "), got '", text, "'"));
}

std::string FormatRelayMode(const RelayOptions& o) {
  switch (o.mode) {
    case RelayMode::kOff:
      return "off";
    case RelayMode::kAuto:
      return "auto";
    case RelayMode::kDegree:
      return absl::StrCat(o.degree);
  }
  return "off";
}

std::string EngineLayoutKey::ToString() const {
  return absl::StrCat(kind.empty() ? "engine" : kind, " tp=", tp, " ep=", ep, " dp=", dp_attention, " pp=", pp,
                      dtype.empty() ? "" : " ", dtype, quantization.empty() ? "" : " ", quantization);
}

bool EngineLayoutKey::operator==(const EngineLayoutKey& o) const {
  return kind == o.kind && tp == o.tp && ep == o.ep && dp_attention == o.dp_attention && pp == o.pp &&
         dtype == o.dtype && quantization == o.quantization;
}

absl::StatusOr<std::vector<LayoutGroup>> GroupByLayout(const std::vector<int>& instances,
                                                       const std::vector<EngineLayoutKey>& keys) {
  if (instances.size() != keys.size())
    return absl::InvalidArgumentError(absl::StrCat(keys.size(), " layout keys for ", instances.size(), " instances"));
  std::vector<LayoutGroup> groups;
  std::set<int> seen;
  for (size_t k = 0; k < instances.size(); ++k) {
    if (!seen.insert(instances[k]).second)
      return absl::InvalidArgumentError(absl::StrCat("instance ", instances[k], " given twice"));
    auto g = std::find_if(groups.begin(), groups.end(), [&](const LayoutGroup& x) { return x.key == keys[k]; });
    if (g == groups.end()) {
      groups.push_back({keys[k], {}});
      g = std::prev(groups.end());
    }
    g->instances.push_back(instances[k]);
  }
  return groups;
}

std::vector<RelayNode> RelayTreeShape(const std::vector<int>& members, int degree) {
  const int d = std::max(1, degree);
  std::vector<RelayNode> nodes(members.size());
  for (size_t k = 0; k < members.size(); ++k) {
    nodes[k].instance = members[k];
    if (k == 0) continue;
    const size_t p = (k - 1) / d;
    nodes[k].parent = members[p];
    nodes[k].depth = nodes[p].depth + 1;
    nodes[p].children.push_back(members[k]);
  }
  return nodes;
}

RelayPrediction PredictRelay(const PlanInput& in, const RelayPlan& rp, const CostParams& cp) {
  RelayPrediction out;
  out.trainer_egress_bytes = EgressBytes(rp.plan);
  if (!rp.relayed) {
    const Prediction p = PredictPlan(in, rp.plan, cp);
    out.source_s = p.transfer_s;
    out.transfer_s = p.transfer_s;
    out.gather_s = p.gather_s;
    out.total_s = p.total_s;
    return out;
  }
  const Prediction src = PredictPlan(rp.roots_input, rp.plan, cp);
  out.source_s = src.transfer_s;
  out.gather_s = src.gather_s;
  const std::map<NicKey, RelayNic> nics = NicTraffic(in, rp, cp, true);
  out.tree_s = MaxTime(nics);
  for (const auto& [k, x] : nics) out.nics.push_back(x);

  const double bw = in.cluster.nic.bytes_per_second();
  // Forwarding streams through each NIC (a relay rank sends to each child's rank): a chunk to one child crosses
  // the NIC at its share.
  std::map<NicKey, int> streams;
  for (const RelayTree& t : rp.trees)
    for (const RelayNode& n : t.nodes)
      for (const RelayRankRegions& rr : t.regions) {
        const auto [node, nic] = TargetNicOf(in.cluster, {n.instance, rr.rank});
        streams[{node, nic}] += static_cast<int>(n.children.size());
      }
  for (size_t g = 0; g < rp.trees.size(); ++g) {
    const RelayTree& t = rp.trees[g];
    std::map<int, double> first;   // instance -> first chunk landed, after the root's
    std::map<int, double> chunk;   // relay instance -> one chunk across its hop
    std::map<int, double> stream;  // relay instance -> one full copy out of its slowest NIC
    for (const RelayNode& n : t.nodes) {
      if (n.children.empty()) continue;
      double c = 0, s = 0;
      for (const RelayRankRegions& rr : t.regions) {
        const auto [node, nic] = TargetNicOf(in.cluster, {n.instance, rr.rank});
        const int k = std::max(1, streams[{node, nic}]);
        c = std::max(c, RelayChunkSeconds(std::min(rp.options.chunk_bytes, rr.bytes), k, bw, cp.relay_hop_ms / 1e3));
        s = std::max(s, static_cast<double>(nics.at({node, nic}).out_bytes) / bw);
      }
      chunk[n.instance] = c;
      stream[n.instance] = s;
    }
    for (const RelayNode& n : t.nodes) {
      RelayHop h;
      h.group = static_cast<int>(g);
      h.parent = n.parent;
      h.child = n.instance;
      h.level = n.depth;
      if (n.parent < 0) {
        h.stream_s = out.source_s;
        first[n.instance] = 0;
      } else {
        h.chunk_s = chunk[n.parent];
        h.first_s = first[n.parent] + h.chunk_s;
        h.stream_s = stream[n.parent];
        first[n.instance] = h.first_s;
      }
      out.latency_s = std::max(out.latency_s, h.first_s);
      out.hops.push_back(h);
    }
  }
  out.transfer_s = std::max(out.source_s, out.tree_s) + out.latency_s;
  out.total_s = (cp.fixed_ms + cp.post_process_ms) / 1e3 + out.gather_s + out.transfer_s;
  return out;
}

int MaxRelayDegree(const PlanInput& in, const RelayPlan& rp, const CostParams& cp, int group) {
  if (!rp.relayed || group < 0 || group >= static_cast<int>(rp.trees.size())) return 1;
  const int members = static_cast<int>(rp.trees[group].group.instances.size());
  const Prediction src = PredictTransfer(rp.roots_input, rp.plan, cp);
  const double inbound = MaxTime(NicTraffic(in, rp, cp, false));
  const double limit = std::max(src.transfer_s, inbound);
  RelayPlan trial = rp;
  int best = 1;
  for (int d = 1; d < members; ++d) {
    SetShape(&trial.trees[group], d);
    if (MaxTime(NicTraffic(in, trial, cp, true)) > limit) break;
    best = d;
  }
  return best;
}

absl::StatusOr<RelayPlan> BuildRelayPlan(const PlanInput& input, const PlanOptions& options, const RelayOptions& relay,
                                         const std::vector<EngineLayoutKey>& keys) {
  if (relay.mode == RelayMode::kDegree && (relay.degree < 1 || relay.degree > kMaxDegree))
    return absl::InvalidArgumentError(absl::StrCat("relay degree ", relay.degree, " outside [1, ", kMaxDegree, "]"));
  if (relay.mode != RelayMode::kOff && relay.chunk_bytes == 0)
    return absl::InvalidArgumentError("relay chunk size must be positive");
  RelayPlan rp;
  rp.options = relay;
  WSYNC_ASSIGN_OR_RETURN(Plan direct, BuildPlan(input, options));
  auto direct_plan = [&](std::string why) {
    rp.relayed = false;
    rp.why = std::move(why);
    rp.plan = std::move(direct);
    rp.trees.clear();
    rp.roots_input = PlanInput();
    rp.trainer_egress_bytes = EgressBytes(rp.plan);
    return rp;
  };
  if (relay.mode == RelayMode::kOff) return direct_plan("off");

  const std::vector<int> active = input.ActiveInstances();
  std::vector<LayoutGroup> groups;
  if (keys.empty()) {
    EngineLayoutKey k;
    k.tp = input.cluster.engine.tp;
    k.ep = input.cluster.engine.ep;
    k.dp_attention = input.cluster.engine.dp_attention;
    groups.push_back({k, active});
  } else {
    WSYNC_ASSIGN_OR_RETURN(groups, GroupByLayout(active, keys));
  }
  if (std::all_of(groups.begin(), groups.end(), [](const LayoutGroup& g) { return g.instances.size() < 2; }))
    return direct_plan(groups.size() == 1 ? "one instance: nothing to relay"
                                          : "every layout group has one instance: nothing to relay");

  rp.roots_input = input;
  rp.roots_input.instances.clear();
  for (const LayoutGroup& g : groups) rp.roots_input.instances.push_back(g.instances.front());
  std::sort(rp.roots_input.instances.begin(), rp.roots_input.instances.end());
  PlanOptions roots_options = options;
  if (roots_options.count_instances.empty()) roots_options.count_instances = rp.roots_input.instances;
  absl::StatusOr<Plan> roots_plan = BuildPlan(rp.roots_input, roots_options);
  if (!roots_plan.ok()) return Annotate(roots_plan.status(), "the sources' plan for the group roots");
  rp.plan = *std::move(roots_plan);
  rp.relayed = true;
  rp.trainer_egress_bytes = EgressBytes(rp.plan);
  for (const LayoutGroup& g : groups) {
    RelayTree t;
    t.group = g;
    t.regions = RootRegions(input, rp.plan, g.instances.front(), relay.chunk_bytes);
    SetShape(&t, relay.mode == RelayMode::kDegree ? relay.degree : 1);
    rp.trees.push_back(std::move(t));
  }
  if (relay.mode == RelayMode::kDegree) {
    rp.why = absl::StrCat("degree ", relay.degree, " as asked");
    return rp;
  }

  // auto: per group, the fastest degree the relays' egress keeps up with; then relay or not, whichever is faster.
  const CostParams& cp = options.cost;
  for (size_t g = 0; g < rp.trees.size(); ++g) {
    const int members = static_cast<int>(rp.trees[g].group.instances.size());
    if (members < 2) continue;
    const int dmax = MaxRelayDegree(input, rp, cp, static_cast<int>(g));
    int best_d = 1;
    double best = -1;
    for (int d = 1; d <= dmax; ++d) {
      SetShape(&rp.trees[g], d);
      const double t = PredictRelay(input, rp, cp).total_s;
      if (best < 0 || t < best) best = t, best_d = d;
    }
    SetShape(&rp.trees[g], best_d);
  }
  const double relayed_s = PredictRelay(input, rp, cp).total_s;
  const double direct_s = PredictPlan(input, direct, cp).total_s;
  if (!(relayed_s < direct_s)) {
    return direct_plan(
        absl::StrFormat("auto: direct predicted %.1f ms, relay %.1f ms", direct_s * 1e3, relayed_s * 1e3));
  }
  rp.why = absl::StrFormat("auto: relay predicted %.1f ms, direct %.1f ms", relayed_s * 1e3, direct_s * 1e3);
  return rp;
}

RelayLinks RelayLinksOf(const PlanInput& in, const RelayOptions& relay, const CostParams& cp) {
  RelayLinks l;
  const std::vector<int> active = in.ActiveInstances();
  l.instances = static_cast<int>(active.size());
  for (const auto& layout : in.layouts)
    for (const auto& p : layout.params) l.copy_bytes += p.bytes;
  const TrainerSpec& t = in.cluster.trainer;
  l.source_nics = std::max(1, t.nodes * std::max(1, std::min(in.cluster.nic.per_node, t.gpus_per_node)));
  l.source_nic_bps = l.target_nic_bps = in.cluster.nic.bytes_per_second();
  std::map<NicKey, int> ranks_on;
  if (!active.empty())
    for (size_t r = 0; r < in.layouts.size(); ++r) {
      const auto [node, nic] = TargetNicOf(in.cluster, {active.front(), static_cast<int>(r)});
      ranks_on[{node, nic}]++;
    }
  l.instance_nics = std::max<int>(1, static_cast<int>(ranks_on.size()));
  for (const auto& [k, n] : ranks_on) l.ranks_per_nic = std::max(l.ranks_per_nic, n);
  l.chunk_bytes = relay.chunk_bytes;
  l.hop_s = cp.relay_hop_ms / 1e3;
  return l;
}

absl::Status VerifyRelayPlan(const PlanInput& in, const RelayPlan& rp) {
  if (!rp.relayed) return VerifyPlan(in, rp.plan);
  WSYNC_RETURN_IF_ERROR_CTX(VerifyPlan(rp.roots_input, rp.plan), "the sources' plan for the group roots");
  const std::vector<int> active = in.ActiveInstances();
  std::set<int> placed;
  std::set<int> roots(rp.roots_input.instances.begin(), rp.roots_input.instances.end());
  for (const RelayTree& t : rp.trees) {
    if (t.nodes.size() != t.group.instances.size() || t.group.instances.empty())
      return absl::InternalError(absl::StrCat("group ", t.group.key.ToString(), ": ", t.nodes.size(),
                                              " tree nodes for ", t.group.instances.size(), " instances"));
    std::map<int, const RelayNode*> by_instance;
    int depth = 0;
    for (size_t k = 0; k < t.nodes.size(); ++k) {
      const RelayNode& n = t.nodes[k];
      if (n.instance != t.group.instances[k] && k == 0)
        return absl::InternalError(absl::StrCat("group ", t.group.key.ToString(), ": the root is not its first"));
      if (std::find(t.group.instances.begin(), t.group.instances.end(), n.instance) == t.group.instances.end())
        return absl::InternalError(absl::StrCat("instance ", n.instance, " is not of group ", t.group.key.ToString()));
      if (!placed.insert(n.instance).second)
        return absl::InternalError(absl::StrCat("instance ", n.instance, " is in two trees or twice in one"));
      if (k == 0) {
        if (n.parent != -1 || n.depth != 0 || !roots.count(n.instance))
          return absl::InternalError(absl::StrCat("root ", n.instance, " is not written by the sources"));
      } else {
        auto p = by_instance.find(n.parent);
        if (p == by_instance.end())
          return absl::InternalError(
              absl::StrCat("instance ", n.instance, "'s relay ", n.parent, " is not before it in its tree"));
        if (n.depth != p->second->depth + 1)
          return absl::InternalError(
              absl::StrCat("instance ", n.instance, " at depth ", n.depth, " under depth ", p->second->depth));
        const auto& ch = p->second->children;
        if (std::count(ch.begin(), ch.end(), n.instance) != 1)
          return absl::InternalError(absl::StrCat("relay ", n.parent, " does not list child ", n.instance));
        if (roots.count(n.instance))
          return absl::InternalError(absl::StrCat("instance ", n.instance, " gets both sources' and relayed bytes"));
      }
      if (static_cast<int>(n.children.size()) > t.degree)
        return absl::InternalError(
            absl::StrCat("relay ", n.instance, " has ", n.children.size(), " children, degree ", t.degree));
      depth = std::max(depth, n.depth);
      by_instance[n.instance] = &n;
    }
    size_t child_links = 0;
    for (const RelayNode& n : t.nodes) child_links += n.children.size();
    if (child_links != t.nodes.size() - 1 || depth != t.depth)
      return absl::InternalError(absl::StrCat("group ", t.group.key.ToString(), ": not one tree of depth ", t.depth));

    // The regions: every byte of every rank's layout once, each chunk inside one source's write to the root.
    const int root = t.group.instances.front();
    if (t.regions.size() != in.layouts.size())
      return absl::InternalError(absl::StrCat("group ", t.group.key.ToString(), ": regions for ", t.regions.size(),
                                              " ranks, layouts ", in.layouts.size()));
    for (size_t r = 0; r < t.regions.size(); ++r) {
      const RelayRankRegions& rr = t.regions[r];
      const auto& params = in.layouts[r].params;
      // (source, param) -> its write's ranges into the root's rank r
      std::map<std::pair<int, int>, std::vector<std::pair<uint64_t, uint64_t>>> writes;
      for (size_t s = 0; s < rp.plan.sources.size(); ++s)
        for (const Task& task : rp.plan.sources[s].tasks)
          if (task.target.instance == root && task.target.rank == static_cast<int>(r))
            for (const ParamSlice& sl : task.slices)
              writes[{static_cast<int>(s), sl.param}].push_back({sl.offset, sl.offset + sl.length});
      size_t c = 0;
      uint64_t bytes = 0;
      for (int k = 0; k < static_cast<int>(params.size()); ++k) {
        uint64_t covered = 0;
        bool any = false;
        for (; c < rr.chunks.size() && rr.chunks[c].param == k; ++c) {
          const RelayChunk& ch = rr.chunks[c];
          if (ch.offset != covered || ch.length > rp.options.chunk_bytes)
            return absl::InternalError(absl::StrCat("rank ", r, " parameter ", params[k].name, ": chunk at ", ch.offset,
                                                    " of ", ch.length, " bytes after ", covered));
          const auto w = writes.find({ch.source, k});
          const bool inside = w != writes.end() && std::any_of(w->second.begin(), w->second.end(), [&](const auto& x) {
                                return x.first <= ch.offset && ch.offset + ch.length <= x.second;
                              });
          if (!inside)
            return absl::InternalError(absl::StrCat("rank ", r, " parameter ", params[k].name, ": chunk at ", ch.offset,
                                                    " is not inside a write of source ", ch.source));
          covered += ch.length;
          any = true;
        }
        if (!any || covered != params[k].bytes)
          return absl::InternalError(absl::StrCat("rank ", r, " parameter ", params[k].name, ": chunks cover ", covered,
                                                  " of ", params[k].bytes, " bytes"));
        bytes += covered;
      }
      if (c != rr.chunks.size() || bytes != rr.bytes)
        return absl::InternalError(absl::StrCat("rank ", r, ": chunks out of order or beyond the layout"));
    }
  }
  for (int i : active)
    if (!placed.count(i)) return absl::InternalError(absl::StrCat("instance ", i, " is in no tree"));
  if (placed.size() != active.size()) return absl::InternalError("a tree holds an instance that is not active");
  return absl::OkStatus();
}

}  // namespace wsync::planner
