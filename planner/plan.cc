#include "planner/plan.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <numeric>
#include <set>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "planner/cost.h"

namespace wsync::planner {
namespace {

// Per stage and engine rank: the layout's parameter indices of that stage, in layout order.
struct StageIndex {
  std::vector<std::vector<std::vector<int>>> params;  // [stage][rank] -> param ids
  std::vector<std::vector<uint64_t>> bytes;           // [stage][rank] -> bytes of one copy
};

StageIndex IndexStages(const PlanInput& in) {
  const int pp = in.cluster.trainer.pp;
  const int ranks = static_cast<int>(in.layouts.size());
  StageIndex ix;
  ix.params.assign(pp, std::vector<std::vector<int>>(ranks));
  ix.bytes.assign(pp, std::vector<uint64_t>(ranks, 0));
  for (int r = 0; r < ranks; ++r) {
    const auto& ps = in.layouts[r].params;
    for (int k = 0; k < static_cast<int>(ps.size()); ++k) {
      ix.params[ps[k].stage][r].push_back(k);
      ix.bytes[ps[k].stage][r] += ps[k].bytes;
    }
  }
  return ix;
}

void PlaceSource(const ClusterSpec& c, SourcePlan* s) {
  const TrainerSpec& t = c.trainer;
  s->trainer_rank = s->stage * t.sources_per_stage() + s->index;
  s->node = s->trainer_rank / t.gpus_per_node;
  s->nic = (s->trainer_rank % t.gpus_per_node) * c.nic.per_node / t.gpus_per_node;
}

std::pair<int, int> PlaceTarget(const ClusterSpec& c, const Target& tg) {
  const int gpn = c.engine.gpus_per_node();
  const int gpu = tg.instance * c.engine.tp + tg.rank;
  return {gpu / gpn, (gpu % gpn) * c.nic.per_node / gpn};
}

std::vector<ParamSlice> WholeParams(const LayoutInfo& layout, const std::vector<int>& ids) {
  std::vector<ParamSlice> out;
  out.reserve(ids.size());
  for (int k : ids) out.push_back({k, 0, layout.params[k].bytes});
  return out;
}

void FinishAssignment(const LayoutInfo& layout, LayoutAssignment* a) {
  a->bytes = 0;
  a->load_bytes = 0;
  int last = -1;
  for (const auto& sl : a->slices) {
    a->bytes += sl.length;
    if (sl.param != last) a->load_bytes += layout.params[sl.param].bytes;
    last = sl.param;
  }
}

// The seed's heuristic (miles' plan_p2p), one stage: targets (instance outer, rank inner); round 1 maps them 1:1
// onto sources; each leftover target goes to the source already serving its engine rank with the fewest targets of
// that rank (ties: lower source), else round-robin. A source serving rank r for several instances loads it once.
void PlanStageSeed(const PlanInput& in, const StageIndex& ix, int stage, const std::vector<int>& instances,
                   std::vector<SourcePlan*>& srcs) {
  const int S = static_cast<int>(srcs.size());
  const int R = static_cast<int>(in.layouts.size());
  std::vector<Target> targets;
  for (int i : instances)
    for (int r = 0; r < R; ++r) targets.push_back({i, r});
  const int T = static_cast<int>(targets.size());
  // assigned[s] = map rank -> instances, in assignment order of ranks
  std::vector<std::vector<std::pair<int, std::vector<int>>>> assigned(S);
  std::vector<std::map<int, int>> count(S);  // source -> rank -> targets
  auto give = [&](int s, const Target& tg) {
    auto& lst = assigned[s];
    auto it = std::find_if(lst.begin(), lst.end(), [&](const auto& p) { return p.first == tg.rank; });
    if (it == lst.end()) {
      lst.push_back({tg.rank, {}});
      it = std::prev(lst.end());
    }
    it->second.push_back(tg.instance);
    count[s][tg.rank]++;
  };
  const int first = std::min(S, T);
  for (int k = 0; k < first; ++k) give(k, targets[k]);
  int rr = 0;
  for (int k = first; k < T; ++k) {
    const Target& tg = targets[k];
    int best = -1, best_count = 0;
    for (int s = 0; s < S; ++s) {
      auto it = count[s].find(tg.rank);
      if (it == count[s].end()) continue;
      if (best < 0 || it->second < best_count) {
        best = s;
        best_count = it->second;
      }
    }
    if (best < 0) {
      best = rr;
      rr = (rr + 1) % S;
    }
    give(best, tg);
  }
  for (int s = 0; s < S; ++s) {
    for (auto& [rank, insts] : assigned[s]) {
      LayoutAssignment a;
      a.rank = rank;
      a.slices = WholeParams(in.layouts[rank], ix.params[stage][rank]);
      a.instances = insts;
      FinishAssignment(in.layouts[rank], &a);
      srcs[s]->assignments.push_back(std::move(a));
    }
  }
}

uint64_t AlignDown(uint64_t v, uint64_t a) { return a > 1 ? v / a * a : v; }

// balanced, one stage's line: every engine rank's parameters of the stage (rank-major, layout order) laid end to
// end in bytes of one copy. Zero-byte parameters are on it with no extent.
struct LineItem {
  int rank, param;
  uint64_t start, bytes;
};
struct StageLine {
  std::vector<LineItem> items;
  uint64_t total = 0;
};

StageLine MakeStageLine(const PlanInput& in, const StageIndex& ix, int stage) {
  StageLine line;
  for (int r = 0; r < static_cast<int>(in.layouts.size()); ++r) {
    for (int k : ix.params[stage][r]) {
      const uint64_t b = in.layouts[r].params[k].bytes;
      line.items.push_back({r, k, line.total, b});
      line.total += b;
    }
  }
  return line;
}

// The cut of a stage's line into consecutive segments proportional to `weights` (cuts[0] = 0, cuts[U] = total):
// a cut inside a parameter snaps to its boundary within snap_bytes, else splits it at an aligned offset (or, with
// split_params off, goes to the nearer boundary). One function for the plan and the source count's prediction.
std::vector<uint64_t> CutLine(const PlanOptions& opt, const StageLine& sl, const std::vector<double>& weights) {
  const std::vector<LineItem>& line = sl.items;
  const int U = static_cast<int>(weights.size());
  const uint64_t total = sl.total;
  const double wsum = std::accumulate(weights.begin(), weights.end(), 0.0);
  std::vector<uint64_t> cuts(U + 1, 0);
  cuts[U] = total;
  double acc = 0;
  size_t item = 0;
  for (int k = 1; k < U; ++k) {
    acc += weights[k - 1];
    uint64_t c = static_cast<uint64_t>(static_cast<long double>(total) * acc / wsum);
    c = std::max(c, cuts[k - 1]);
    while (item + 1 < line.size() && line[item].start + line[item].bytes <= c) ++item;
    const LineItem& it = line[item];
    const uint64_t lo = it.start, hi = it.start + it.bytes;
    if (c > lo && c < hi) {
      if (!opt.split_params) {
        c = (c - lo <= hi - c) ? lo : hi;
      } else if (c - lo <= opt.snap_bytes) {
        c = lo;
      } else if (hi - c <= opt.snap_bytes) {
        c = hi;
      } else {
        c = lo + AlignDown(c - lo, opt.align_bytes);
      }
    }
    cuts[k] = std::max(c, cuts[k - 1]);
  }
  return cuts;
}

// balanced, one stage: cut the stage's line into consecutive segments proportional to each used source's weight.
// Every segment is sent to every active instance, so a source's load is (#instances x its segment) and the cut
// never depends on how many instances are active.
void PlanStageBalanced(const PlanInput& in, const PlanOptions& opt, const StageLine& sl,
                       const std::vector<SourcePlan*>& used, const std::vector<double>& weights) {
  const std::vector<LineItem>& line = sl.items;
  const int U = static_cast<int>(used.size());
  if (U == 0 || line.empty()) return;
  const std::vector<uint64_t> cuts = CutLine(opt, sl, weights);
  // Walk the line once, emitting each segment's slices grouped by rank.
  size_t pos = 0;
  for (int u = 0; u < U; ++u) {
    const uint64_t a = cuts[u], b = cuts[u + 1];
    while (pos < line.size() && line[pos].start + line[pos].bytes <= a && line[pos].bytes > 0) ++pos;
    LayoutAssignment* cur = nullptr;
    for (size_t q = pos; q < line.size() && line[q].start < b; ++q) {
      const LineItem& it = line[q];
      const uint64_t s0 = std::max(a, it.start), s1 = std::min(b, it.start + it.bytes);
      if (s1 <= s0) continue;
      if (cur == nullptr || cur->rank != it.rank) {
        used[u]->assignments.push_back({});
        cur = &used[u]->assignments.back();
        cur->rank = it.rank;
      }
      cur->slices.push_back({it.param, s0 - it.start, s1 - s0});
    }
    // Zero-byte parameters have no extent on the line; give them to the source whose segment starts at them.
    for (auto& as : used[u]->assignments) FinishAssignment(in.layouts[as.rank], &as);
  }
  // Zero-byte parameters: attach to the first used source (they still need to be "written" as empty).
  for (const LineItem& it : line) {
    if (it.bytes != 0) continue;
    SourcePlan* s = used[0];
    auto f = std::find_if(s->assignments.begin(), s->assignments.end(),
                          [&](const LayoutAssignment& as) { return as.rank == it.rank; });
    if (f == s->assignments.end()) {
      s->assignments.push_back({});
      f = std::prev(s->assignments.end());
      f->rank = it.rank;
    }
    f->slices.push_back({it.param, 0, 0});
    std::sort(f->slices.begin(), f->slices.end(),
              [](const ParamSlice& x, const ParamSlice& y) { return x.param < y.param || (x.param == y.param && x.offset < y.offset); });
    std::sort(s->assignments.begin(), s->assignments.end(),
              [](const LayoutAssignment& x, const LayoutAssignment& y) { return x.rank < y.rank; });
  }
}

// Order in which a source visits instances: rotated by the source's index so that sources serving the same rank
// start on different instances. Depends only on instance ids, so adding/removing one keeps the others' order.
std::vector<int> RotatedInstances(const std::vector<int>& active, int source_index, int max_instances) {
  std::vector<int> out = active;
  const int m = std::max(1, max_instances);
  const int shift = source_index % m;
  std::stable_sort(out.begin(), out.end(), [&](int a, int b) {
    return ((a - shift) % m + m) % m < ((b - shift) % m + m) % m;
  });
  return out;
}

// Rebuilds tasks, push filter and per-source figures from the assignments and the active instances.
void Materialize(const PlanInput& in, const std::vector<int>& active, SourcePlan* s) {
  s->tasks.clear();
  s->bytes_out = 0;
  s->load_bytes = 0;
  std::vector<int> push;  // sorted and deduplicated below (cheaper than a set at millions of inputs)
  std::set<Target> sessions;
  const std::set<int> active_set(active.begin(), active.end());
  const std::vector<int> rotated = RotatedInstances(active, s->index, in.cluster.engine.instances);
  for (const LayoutAssignment& a : s->assignments) {
    std::vector<int> insts;
    if (a.instances.empty()) {
      insts = rotated;
    } else {
      for (int i : a.instances)
        if (active_set.count(i)) insts.push_back(i);
    }
    if (insts.empty()) continue;
    s->load_bytes += a.load_bytes;
    int last = -1;
    for (const auto& sl : a.slices) {
      if (sl.param == last) continue;
      last = sl.param;
      const std::vector<int>& inputs = in.layouts[a.rank].params[sl.param].inputs;
      push.insert(push.end(), inputs.begin(), inputs.end());
    }
    for (int i : insts) {
      Task t;
      t.target = {i, a.rank};
      t.slices = a.slices;
      t.bytes = a.bytes;
      s->bytes_out += t.bytes;
      sessions.insert(t.target);
      s->tasks.push_back(std::move(t));
    }
  }
  std::sort(push.begin(), push.end());
  push.erase(std::unique(push.begin(), push.end()), push.end());
  s->push_filter = std::move(push);
  s->push_bytes = 0;
  for (int h : s->push_filter) s->push_bytes += in.hf_tensors[h].bytes;
  s->sessions = static_cast<int>(sessions.size());
}

void Account(const PlanInput& in, const std::vector<int>& active, Plan* plan) {
  const int tp = in.cluster.engine.tp;
  std::map<int, int> slot;
  for (size_t k = 0; k < active.size(); ++k) slot[active[k]] = static_cast<int>(k);
  plan->target_bytes.assign(active.size() * tp, 0);
  std::map<std::pair<int, int>, uint64_t> snic, tnic;
  std::map<std::pair<int, int>, int> snic_sessions, tnic_sessions;
  for (const SourcePlan& s : plan->sources) {
    if (!s.active()) continue;
    snic[{s.node, s.nic}] += s.bytes_out;
    snic_sessions[{s.node, s.nic}] += s.sessions;
    std::set<Target> targets;
    for (const Task& t : s.tasks) {
      plan->target_bytes[slot[t.target.instance] * tp + t.target.rank] += t.bytes;
      targets.insert(t.target);
    }
    for (const Target& t : targets) tnic_sessions[PlaceTarget(in.cluster, t)]++;
  }
  for (int i : active) {
    for (int r = 0; r < tp; ++r) {
      tnic[PlaceTarget(in.cluster, {i, r})] += plan->target_bytes[slot[i] * tp + r];
    }
  }
  plan->source_nics.clear();
  plan->target_nics.clear();
  for (auto& [k, v] : snic) plan->source_nics.push_back({k.first, k.second, v, snic_sessions[k]});
  for (auto& [k, v] : tnic) plan->target_nics.push_back({k.first, k.second, v, tnic_sessions[k]});
}


// Element sizes of an HF tensor in the transfer and the trainer dtype.
double ElemBytes(const HfTensorInfo& h) { return h.full().area() ? static_cast<double>(h.bytes) / h.full().area() : 0; }
double TrainElemBytes(const HfTensorInfo& h) {
  return h.full().area() ? static_cast<double>(h.train_bytes) / h.full().area() : 0;
}

absl::Status CheckLocalInput(const PlanInput& in) {
  const TrainerSpec& t = in.cluster.trainer;
  bool experts = false;
  for (const HfTensorInfo& h : in.hf_tensors) {
    if (h.rows <= 0 || h.cols <= 0)
      return absl::InvalidArgumentError(
          absl::StrCat("strategy local needs the geometry of every HF tensor; ", h.name, " has none"));
    experts |= h.expert_id >= 0;
  }
  if (experts && (in.num_experts <= 0 || in.num_experts % std::max(1, t.ep) != 0))
    return absl::InvalidArgumentError(absl::StrCat("strategy local: ", in.num_experts,
                                                   " routed experts cannot be split over trainer ep=", t.ep));
  for (size_t r = 0; r < in.layouts.size(); ++r)
    for (const ParamInfo& p : in.layouts[r].params) {
      if (p.needs.empty() && !p.inputs.empty())
        return absl::InvalidArgumentError(
            absl::StrCat("strategy local: rank ", r, " parameter ", p.name, " has no HF rectangles"));
      for (const Need& n : p.needs)
        if (n.hf < 0 || n.hf >= static_cast<int>(in.hf_tensors.size()) || !in.hf_tensors[n.hf].full().Contains(n.box))
          return absl::InvalidArgumentError(
              absl::StrCat("strategy local: rank ", r, " parameter ", p.name, " reads outside its HF tensor"));
    }
  return absl::OkStatus();
}

// Who holds what of each HF tensor: the tensor cut into its trainer shards (one shard when replicated), and per
// rank of the stage the shards it holds. Computed on first use.
class Holdings {
 public:
  explicit Holdings(const PlanInput& in) : in_(in), info_(in.hf_tensors.size()) {}
  const std::vector<Box>& Shards(int hf) { return Get(hf).shards; }
  bool Holds(int hf, int index, int shard) {
    const auto& v = Get(hf).held[index];
    return std::find(v.begin(), v.end(), shard) != v.end();
  }
  // Shards of `hf` held by ranks `indices` (sorted, unique).
  std::vector<int> ShardsHeld(int hf, const std::vector<int>& indices) {
    std::vector<int> out;
    for (int j : indices)
      for (int k : Get(hf).held[j]) out.push_back(k);
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    return out;
  }

 private:
  struct Info {
    bool ready = false;
    std::vector<Box> shards;
    std::vector<std::vector<int>> held;  // per rank of the stage: indices into shards
  };
  Info& Get(int hf) {
    Info& i = info_[hf];
    if (i.ready) return i;
    const HfTensorInfo& h = in_.hf_tensors[hf];
    const int S = in_.cluster.trainer.sources_per_stage();
    i.held.assign(S, {});
    for (int j = 0; j < S; ++j) {
      for (const Box& b : HeldBoxes(in_.cluster.trainer, in_.num_experts, h, j)) {
        if (b.empty()) continue;
        auto f = std::find(i.shards.begin(), i.shards.end(), b);
        i.held[j].push_back(static_cast<int>(f - i.shards.begin()));
        if (f == i.shards.end()) i.shards.push_back(b);
      }
    }
    if (i.shards.empty()) i.shards.push_back(h.full());  // nobody holds it as one rectangle: gathered
    i.ready = true;
    return i;
  }
  const PlanInput& in_;
  std::vector<Info> info_;
};

// Area of `need` that ranks holding `shards` (indices into Holdings::Shards, which are disjoint) cover.
uint64_t CoveredArea(Holdings& hold, int hf, const Box& need, const std::vector<int>& shards) {
  uint64_t a = 0;
  for (int k : shards) a += hold.Shards(hf)[k].Intersect(need).area();
  return a;
}

// local, one stage. A source can send a parameter when the trainer ranks on its node hold, between them, every
// rectangle the parameter reads (the node's daemon assembles slices, so no single rank needs all of it). Parameters
// go whole, fewest candidate sources first, then largest first, to the candidate with the least weighted bytes,
// preferring one already serving the engine rank unless that costs more than layout_affinity_bytes. A parameter no
// node holds goes to a source whose node holds most of it; its node gathers the rest (AssignLocalPushes).
void PlanStageLocal(const PlanInput& in, const PlanOptions& opt, const StageIndex& ix, int stage,
                    const std::vector<SourcePlan*>& srcs, const std::vector<double>& weights, Holdings& hold) {
  const int S = static_cast<int>(srcs.size());
  const int R = static_cast<int>(in.layouts.size());
  // Per node of the stage: its ranks' stage indices.
  std::map<int, std::vector<int>> node_idx;
  for (int j = 0; j < S; ++j) node_idx[srcs[j]->node].push_back(j);
  struct Item {
    int rank, param;
    uint64_t bytes;
    std::vector<int> cands;
  };
  std::vector<Item> items;
  for (int r = 0; r < R; ++r) {
    for (int k : ix.params[stage][r]) {
      const ParamInfo& p = in.layouts[r].params[k];
      Item it{r, k, p.bytes, {}};
      for (const auto& [node, idx] : node_idx) {
        bool all = true;
        for (const Need& n : p.needs)
          if (CoveredArea(hold, n.hf, n.box, hold.ShardsHeld(n.hf, idx)) != n.box.area()) {
            all = false;
            break;
          }
        if (all) it.cands.insert(it.cands.end(), idx.begin(), idx.end());
      }
      std::sort(it.cands.begin(), it.cands.end());
      items.push_back(std::move(it));
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    const size_t ca = a.cands.empty() ? SIZE_MAX : a.cands.size(), cb = b.cands.empty() ? SIZE_MAX : b.cands.size();
    if (ca != cb) return ca < cb;
    return a.bytes > b.bytes;
  });
  std::vector<double> load(S, 0);
  std::vector<std::map<int, std::vector<ParamSlice>>> got(S);  // source -> rank -> slices
  for (const Item& it : items) {
    auto cost = [&](int j) { return (load[j] + it.bytes) / weights[j]; };
    int best = -1;
    if (it.cands.empty()) {
      uint64_t most = 0;
      for (const auto& [node, idx] : node_idx) {
        uint64_t have = 0;
        for (const Need& n : in.layouts[it.rank].params[it.param].needs)
          have += CoveredArea(hold, n.hf, n.box, hold.ShardsHeld(n.hf, idx));
        for (int j : idx)
          if (best < 0 || have > most || (have == most && cost(j) < cost(best))) best = j, most = have;
      }
    } else {
      int best_any = -1, best_served = -1;
      for (int j : it.cands) {
        if (best_any < 0 || cost(j) < cost(best_any)) best_any = j;
        if (got[j].count(it.rank) && (best_served < 0 || cost(j) < cost(best_served))) best_served = j;
      }
      best = best_any;
      if (best_served >= 0 && cost(best_served) - cost(best_any) <= opt.layout_affinity_bytes / weights[best_served])
        best = best_served;
    }
    load[best] += it.bytes;
    got[best][it.rank].push_back({it.param, 0, it.bytes});
  }
  for (int j = 0; j < S; ++j) {
    for (auto& [rank, slices] : got[j]) {
      LayoutAssignment a;
      a.rank = rank;
      a.slices = std::move(slices);
      std::sort(a.slices.begin(), a.slices.end(),
                [](const ParamSlice& x, const ParamSlice& y) { return x.param < y.param; });
      FinishAssignment(in.layouts[rank], &a);
      srcs[j]->assignments.push_back(std::move(a));
    }
  }
}

// The union of rectangles inside one shard, as few disjoint rectangles: intervals along the rows when all span the
// same columns, along the columns when all span the same rows, else their bounding box (still inside the shard).
std::vector<Box> UnionInShard(std::vector<Box> boxes) {
  if (boxes.empty()) return {};
  bool same_cols = true, same_rows = true;
  Box bound = boxes.front();
  for (const Box& b : boxes) {
    same_cols &= b.col0 == boxes[0].col0 && b.cols == boxes[0].cols;
    same_rows &= b.row0 == boxes[0].row0 && b.rows == boxes[0].rows;
    const int64_t r1 = std::max(bound.row0 + bound.rows, b.row0 + b.rows);
    const int64_t c1 = std::max(bound.col0 + bound.cols, b.col0 + b.cols);
    bound.row0 = std::min(bound.row0, b.row0), bound.col0 = std::min(bound.col0, b.col0);
    bound.rows = r1 - bound.row0, bound.cols = c1 - bound.col0;
  }
  if (!same_cols && !same_rows) return {bound};
  auto lo = [&](const Box& b) { return same_cols ? b.row0 : b.col0; };
  auto hi = [&](const Box& b) { return same_cols ? b.row0 + b.rows : b.col0 + b.cols; };
  auto make = [&](int64_t a, int64_t z) {
    Box b = boxes[0];
    (same_cols ? b.row0 : b.col0) = a;
    (same_cols ? b.rows : b.cols) = z - a;
    return b;
  };
  std::sort(boxes.begin(), boxes.end(), [&](const Box& a, const Box& b) { return lo(a) < lo(b); });
  std::vector<Box> out;
  int64_t a = lo(boxes[0]), z = hi(boxes[0]);
  for (size_t k = 1; k < boxes.size(); ++k) {
    if (lo(boxes[k]) <= z) {
      z = std::max(z, hi(boxes[k]));
    } else {
      out.push_back(make(a, z));
      a = lo(boxes[k]), z = hi(boxes[k]);
    }
  }
  out.push_back(make(a, z));
  return out;
}

// local: what every node's trainer ranks push. Per node and HF tensor, the rectangles its sources' parameters read
// are cut at the trainer's shard boundaries and united per shard (disjoint by construction); each piece is pushed
// by a rank of the node holding that shard (fewest pushed bytes first). A piece whose shard no rank of the node
// holds is pushed by the node's rank with the fewest pushed bytes, which first gathers it from the shard's holders
// on other nodes (gather_bytes, over its NIC share).
void AssignLocalPushes(const PlanInput& in, Plan* plan) {
  Holdings hold(in);
  std::map<int, std::map<int, std::vector<Box>>> need;  // node -> hf -> rectangles
  std::map<int, std::vector<int>> node_sources;          // node -> indices into plan->sources
  for (size_t k = 0; k < plan->sources.size(); ++k) {
    SourcePlan& s = plan->sources[k];
    s.push_slices.clear();
    s.gather_bytes = 0;
    node_sources[s.node].push_back(static_cast<int>(k));
    for (const LayoutAssignment& a : s.assignments)
      for (const ParamSlice& sl : a.slices)
        for (const Need& n : in.layouts[a.rank].params[sl.param].needs)
          if (!n.box.empty()) need[s.node][n.hf].push_back(n.box);
  }
  plan->gather_bytes = plan->expert_gather_bytes = 0;
  std::vector<uint64_t> pushed(plan->sources.size(), 0);
  for (auto& [node, per_hf] : need) {
    for (auto& [hf, boxes] : per_hf) {
      const HfTensorInfo& h = in.hf_tensors[hf];
      std::vector<int> ranks;  // plan->sources indices of the tensor's stage on this node
      for (int k : node_sources[node])
        if (plan->sources[k].stage == h.stage) ranks.push_back(k);
      const std::vector<Box>& shards = hold.Shards(hf);
      for (size_t sh = 0; sh < shards.size(); ++sh) {
        std::vector<Box> parts;
        for (const Box& b : boxes) {
          const Box p = b.Intersect(shards[sh]);
          if (!p.empty()) parts.push_back(p);
        }
        for (const Box& piece : UnionInShard(std::move(parts))) {
          int k = -1;
          for (int q : ranks)
            if (hold.Holds(hf, plan->sources[q].index, static_cast<int>(sh)) && (k < 0 || pushed[q] < pushed[k]))
              k = q;
          PushSlice ps;
          ps.hf = hf;
          ps.box = piece;
          ps.bytes = static_cast<uint64_t>(std::llround(piece.area() * ElemBytes(h)));
          if (k < 0) {
            for (int q : ranks)
              if (k < 0 || pushed[q] < pushed[k]) k = q;
            ps.gather_bytes = static_cast<uint64_t>(std::llround(piece.area() * TrainElemBytes(h)));
          }
          SourcePlan& s = plan->sources[k];
          pushed[k] += ps.bytes;
          s.gather_bytes += ps.gather_bytes;
          plan->gather_bytes += ps.gather_bytes;
          if (h.expert) plan->expert_gather_bytes += ps.gather_bytes;
          s.push_slices.push_back(ps);
        }
      }
    }
  }
  for (SourcePlan& s : plan->sources) {
    std::sort(s.push_slices.begin(), s.push_slices.end(), [](const PushSlice& a, const PushSlice& b) {
      return a.hf != b.hf ? a.hf < b.hf
                          : std::make_pair(a.box.row0, a.box.col0) < std::make_pair(b.box.row0, b.box.col0);
    });
    std::set<int> ids;
    s.push_bytes = 0;
    for (const PushSlice& ps : s.push_slices) ids.insert(ps.hf), s.push_bytes += ps.bytes;
    s.push_filter.assign(ids.begin(), ids.end());
  }
}

// local: every rectangle a node's parameters read is covered exactly by its ranks' push slices, which are disjoint
// per tensor, lie inside the tensor, and are held by the rank that pushes them unless it gathers them (then
// gather_bytes is the piece's trainer-dtype size).
absl::Status VerifyLocalPushes(const PlanInput& in, const Plan& plan) {
  std::map<std::pair<int, int>, std::vector<Box>> pushed;  // (node, hf) -> boxes
  for (const SourcePlan& s : plan.sources) {
    for (const PushSlice& ps : s.push_slices) {
      const HfTensorInfo& h = in.hf_tensors[ps.hf];
      if (h.stage != s.stage || !h.full().Contains(ps.box) || ps.box.empty())
        return absl::InternalError(absl::StrCat("source ", s.trainer_rank, " pushes an empty, out-of-range or "
                                                "other-stage rectangle of ", h.name));
      bool holds = false;
      for (const Box& b : HeldBoxes(in.cluster.trainer, in.num_experts, h, s.index)) holds |= b.Contains(ps.box);
      const uint64_t want = holds ? 0 : static_cast<uint64_t>(std::llround(ps.box.area() * TrainElemBytes(h)));
      if (ps.gather_bytes != want)
        return absl::InternalError(absl::StrCat("source ", s.trainer_rank, " push of ", h.name, ": gather bytes ",
                                                ps.gather_bytes, ", but the rank ", holds ? "holds" : "lacks",
                                                " the rectangle"));
      auto& v = pushed[{s.node, ps.hf}];
      for (const Box& o : v)
        if (!o.Intersect(ps.box).empty())
          return absl::InternalError(absl::StrCat("node ", s.node, " pushes overlapping rectangles of ", h.name));
      v.push_back(ps.box);
    }
  }
  for (const SourcePlan& s : plan.sources)
    for (const LayoutAssignment& a : s.assignments)
      for (const ParamSlice& sl : a.slices)
        for (const Need& n : in.layouts[a.rank].params[sl.param].needs) {
          uint64_t covered = 0;
          auto it = pushed.find({s.node, n.hf});
          if (it != pushed.end())
            for (const Box& b : it->second) covered += b.Intersect(n.box).area();
          if (covered != n.box.area())
            return absl::InternalError(absl::StrCat("node ", s.node, ": parameter ",
                                                    in.layouts[a.rank].params[sl.param].name, " reads ",
                                                    in.hf_tensors[n.hf].name, " rows [", n.box.row0, ", +",
                                                    n.box.rows, ") cols [", n.box.col0, ", +", n.box.cols,
                                                    ") that its node's ranks do not push"));
        }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Strategy> ParseStrategy(absl::string_view name) {
  if (name == "seed") return Strategy::kSeed;
  if (name == "balanced") return Strategy::kBalanced;
  if (name == "local") return Strategy::kLocal;
  return absl::InvalidArgumentError(absl::StrCat("unknown strategy '", name, "' (seed|balanced|local)"));
}

absl::string_view StrategyName(Strategy s) {
  switch (s) {
    case Strategy::kSeed: return "seed";
    case Strategy::kBalanced: return "balanced";
    case Strategy::kLocal: return "local";
  }
  return "?";
}

Box Box::Intersect(const Box& o) const {
  if (empty() || o.empty()) return {};
  const int64_t r0 = std::max(row0, o.row0), r1 = std::min(row0 + rows, o.row0 + o.rows);
  const int64_t c0 = std::max(col0, o.col0), c1 = std::min(col0 + cols, o.col0 + o.cols);
  if (r1 <= r0 || c1 <= c0) return {};
  return {r0, r1 - r0, c0, c1 - c0};
}

namespace {

// Rank `rank` of `g`'s shares of `h` along its split dimension: consecutive equal shards (sizes a multiple of
// split_align, the last one possibly short or empty), one per stacked part.
std::vector<Box> SplitBoxes(const HfTensorInfo& h, int g, int rank) {
  Box b = h.full();
  if (g <= 1 || h.split == TrainerSplit::kReplicated) return {b};
  const int parts = std::max(1, h.split_parts);
  const int64_t n = (h.split == TrainerSplit::kRows ? h.rows : h.cols) / parts;
  const int64_t a = std::max<int64_t>(1, h.split_align);
  const int64_t per = (n + g * a - 1) / (g * a) * a;
  const int64_t lo = std::min<int64_t>(n, per * rank), hi = std::min<int64_t>(n, per * (rank + 1));
  if (hi <= lo) return {};
  std::vector<Box> out;
  for (int p = 0; p < parts; ++p) {
    if (h.split == TrainerSplit::kRows) {
      b.row0 = p * n + lo, b.rows = hi - lo;
    } else {
      b.col0 = p * n + lo, b.cols = hi - lo;
    }
    out.push_back(b);
  }
  return out;
}

}  // namespace

std::vector<Box> HeldBoxes(const TrainerSpec& t, int num_experts, const HfTensorInfo& h, int index) {
  if (h.expert_id >= 0) {
    const int etp = std::max(1, t.etp), ep = std::max(1, t.ep);
    const int per = num_experts / ep;
    if (per <= 0 || h.expert_id / per != (index / etp) % ep) return {};
    return SplitBoxes(h, etp, index % etp);
  }
  const int tp = std::max(1, t.tp);
  return SplitBoxes(h, tp, index % tp);
}

Box HeldBox(const TrainerSpec& t, int num_experts, const HfTensorInfo& h, int index) {
  const std::vector<Box> b = HeldBoxes(t, num_experts, h, index);
  return b.size() == 1 ? b[0] : Box{};
}

std::vector<int> PlanInput::ActiveInstances() const {
  if (!instances.empty()) return instances;
  std::vector<int> all(cluster.engine.instances);
  std::iota(all.begin(), all.end(), 0);
  return all;
}

absl::Status PlanInput::Validate() const {
  WSYNC_RETURN_IF_ERROR(cluster.Validate());
  if (static_cast<int>(layouts.size()) != cluster.engine.tp) {
    return absl::InvalidArgumentError(
        absl::StrCat("need one layout per engine rank: ", layouts.size(), " layouts for engine tp=", cluster.engine.tp));
  }
  const int pp = cluster.trainer.pp;
  // The tensors' stages packed apart: parameters read millions of inputs at the largest shapes, and this is
  // checked on every plan build.
  std::vector<int> hf_stage(hf_tensors.size());
  for (size_t h = 0; h < hf_tensors.size(); ++h) {
    if (hf_tensors[h].stage < 0 || hf_tensors[h].stage >= pp) {
      return absl::InvalidArgumentError(absl::StrCat("HF tensor ", hf_tensors[h].name, " has stage ",
                                                     hf_tensors[h].stage, " outside [0, ", pp, ")"));
    }
    hf_stage[h] = hf_tensors[h].stage;
  }
  for (size_t r = 0; r < layouts.size(); ++r) {
    for (const ParamInfo& p : layouts[r].params) {
      if (p.stage < 0 || p.stage >= pp) {
        return absl::InvalidArgumentError(
            absl::StrCat("rank ", r, " parameter ", p.name, " has stage ", p.stage, " outside [0, ", pp, ")"));
      }
      for (int h : p.inputs) {
        if (h < 0 || h >= static_cast<int>(hf_tensors.size())) {
          return absl::InvalidArgumentError(absl::StrCat("rank ", r, " parameter ", p.name, ": bad input id ", h));
        }
        if (hf_stage[h] != p.stage) {
          return absl::InvalidArgumentError(absl::StrCat("rank ", r, " parameter ", p.name, " (stage ", p.stage,
                                                         ") loads from ", hf_tensors[h].name, " of stage ",
                                                         hf_tensors[h].stage));
        }
      }
    }
  }
  int prev = -1;
  for (int i : instances) {
    if (i <= prev || i >= cluster.engine.instances) {
      return absl::InvalidArgumentError(
          absl::StrCat("active instances must be sorted, unique and < ", cluster.engine.instances));
    }
    prev = i;
  }
  return absl::OkStatus();
}

namespace {

// u of a stage's S sources, spread evenly over its ranks (hence nodes and NICs).
std::vector<int> SpreadSources(int S, int u) {
  std::vector<int> out;
  for (int k = 0; k < u; ++k) out.push_back(static_cast<int>(static_cast<int64_t>(k) * S / u));
  return out;
}

// Every configured instance (what the automatic source count plans for, so the count, like the cut, stays put when
// instances join or leave), or PlanOptions::count_instances where given (a relay plan's group roots).
std::vector<int> ConfiguredInstances(const ClusterSpec& c, const PlanOptions& opt) {
  if (!opt.count_instances.empty()) return opt.count_instances;
  std::vector<int> all(std::max(1, c.engine.instances));
  std::iota(all.begin(), all.end(), 0);
  return all;
}

bool NoSlower(const StageCountTime& a, const StageCountTime& b) {
  return a.transfer_s < b.transfer_s || (a.transfer_s == b.transfer_s && a.sources_s <= b.sources_s);
}

// The automatic source count's figure for one stage and count u, from the cut alone: the cost model's inputs of a
// source (bytes out, replica load, blocking writes, sessions, push filter) and of a target NIC (bytes in, sessions)
// follow from where its segment starts and ends on the stage's line, so no plan is built. The figures are the very
// integers Materialize and Account would produce, fed to the same PredictSource / PredictTargetNic, hence the same
// doubles as PredictTransfer on BuildStagePlan (tested on every count of the test and bench shapes).
class StageCountModel {
 public:
  // `line` is MakeStageLine(in, ix, stage) and must outlive the model.
  StageCountModel(const PlanInput& in, const PlanOptions& opt, const StageIndex& ix, const StageLine& line, int stage)
      : in_(in), opt_(opt), line_(line) {
    const ClusterSpec& c = in.cluster;
    const int R = static_cast<int>(in.layouts.size());
    S_ = c.trainer.sources_per_stage();
    insts_ = ConfiguredInstances(c, opt);
    I_ = static_cast<int>(insts_.size());
    bw_ = c.nic.bytes_per_second();
    ord_of_rank_.assign(R, -1);
    for (const LineItem& it : line_.items) {
      if (it.bytes == 0) {
        if (zero_ranks_.empty() || zero_ranks_.back() != it.rank) zero_ranks_.push_back(it.rank);
        zero_items_.push_back(it);
        continue;
      }
      if (ord_of_rank_[it.rank] < 0) {
        ord_of_rank_[it.rank] = static_cast<int>(rank_start_.size());
        rank_start_.push_back(it.start);
        rank_of_ord_.push_back(it.rank);
      }
      items_.push_back(it);
      starts_.push_back(it.start);
    }
    std::map<std::pair<int, int>, int> ids;
    std::map<int, int> node_ids;
    for (int j = 0; j < S_; ++j) {
      SourcePlan s;
      s.stage = stage;
      s.index = j;
      PlaceSource(c, &s);
      src_nic_.push_back(ids.emplace(std::make_pair(s.node, s.nic), static_cast<int>(ids.size())).first->second);
      src_node_.push_back(node_ids.emplace(s.node, static_cast<int>(node_ids.size())).first->second);
    }
    num_src_nics_ = static_cast<int>(ids.size());
    num_src_nodes_ = static_cast<int>(node_ids.size());
    ids.clear();
    // Every configured target receives its rank's bytes of the stage, whatever the count.
    for (int i = 0; i < I_; ++i) {
      for (int r = 0; r < R; ++r) {
        const int id = ids.emplace(PlaceTarget(c, {insts_[i], r}), static_cast<int>(ids.size())).first->second;
        if (id == static_cast<int>(tgt_bytes_.size())) tgt_bytes_.push_back(0);
        tgt_bytes_[id] += ix.bytes[stage][r];
        tgt_nic_.push_back(id);  // index i * R + r
      }
    }
  }

  StageCountTime Predict(int u) const {
    const int R = static_cast<int>(in_.layouts.size());
    const uint64_t I = static_cast<uint64_t>(I_);
    const std::vector<int> js = SpreadSources(S_, u);
    std::vector<int> per_nic(num_src_nics_, 0);
    for (int j : js) per_nic[src_nic_[j]]++;
    std::vector<double> weights;
    for (int j : js) weights.push_back(1.0 / per_nic[src_nic_[j]]);
    const std::vector<uint64_t> cuts = CutLine(opt_, line_, weights);

    struct Figures {
      int nic = 0, node = 0, sessions = 0;
      uint64_t load = 0, blocking = 0, push = 0;
    };
    std::vector<Figures> active;
    std::vector<uint64_t> nic_bytes(num_src_nics_, 0);
    std::vector<int> nic_sources(num_src_nics_, 0);
    std::vector<int> node_sources(num_src_nodes_, 0);
    std::vector<int> touch(rank_start_.size() + 1, 0);  // difference array over rank ordinals
    std::vector<int> zero_touch(R, 0);
    std::vector<int> stamp;
    const bool pipelined = opt_.cost.executor == Executor::kPipelined;
    if (pipelined) stamp.assign(in_.hf_tensors.size(), -1);
    for (int k = 0; k < static_cast<int>(js.size()); ++k) {
      const uint64_t a = cuts[k], b = cuts[k + 1];
      Figures f;
      int ranks = 0, last_rank = -1, first_ord = 0, last_ord = -1;
      size_t first = 0, last = 0;
      uint64_t blocking = 0;  // one copy
      if (b > a) {
        // The positive items tile [0, total): `first` holds byte a, `last` byte b - 1.
        first = std::upper_bound(starts_.begin(), starts_.end(), a) - starts_.begin() - 1;
        last = std::upper_bound(starts_.begin(), starts_.end(), b - 1) - starts_.begin() - 1;
        f.load = items_[last].start + items_[last].bytes - items_[first].start;
        first_ord = ord_of_rank_[items_[first].rank];
        last_ord = ord_of_rank_[items_[last].rank];
        ranks = last_ord - first_ord + 1;
        last_rank = items_[last].rank;
        blocking = std::max(a, rank_start_[last_ord]) - a;  // the segment's bytes before its last rank
        touch[first_ord]++;
        touch[last_ord + 1]--;
      }
      if (k == 0) {
        // PlanStageBalanced gives zero-byte parameters to the first used source, in rank order with its others.
        for (int z : zero_ranks_) {
          const int o = ord_of_rank_[z];
          if (o >= 0 && o >= first_ord && o <= last_ord) continue;
          ++ranks;
          zero_touch[z]++;
        }
        if (!zero_ranks_.empty() && zero_ranks_.back() > last_rank) blocking = b - a;
      }
      if (ranks == 0) continue;  // no tasks: an idle source
      f.nic = src_nic_[js[k]];
      f.node = src_node_[js[k]];
      f.sessions = ranks * I_;
      f.blocking = blocking * I;
      nic_bytes[f.nic] += (b - a) * I;
      nic_sources[f.nic]++;
      node_sources[f.node]++;
      if (pipelined) {
        auto add = [&](const LineItem& it) {
          for (int h : in_.layouts[it.rank].params[it.param].inputs) {
            if (stamp[h] == k) continue;
            stamp[h] = k;
            f.push += in_.hf_tensors[h].bytes;
          }
        };
        if (b > a)
          for (size_t q = first; q <= last; ++q) add(items_[q]);
        if (k == 0)
          for (const LineItem& it : zero_items_) add(it);
      }
      active.push_back(f);
    }

    StageCountTime t;
    for (const Figures& f : active) {
      const SourceTime st = PredictSource(opt_.cost, bw_, nic_sources[f.nic], nic_bytes[f.nic], f.push, f.load,
                                          f.blocking, f.sessions, node_sources[f.node]);
      t.sources_s = std::max(t.sources_s, st.total_s);
    }
    // Sessions into each target: the sources whose segment (or zero-byte parameters) touch its rank.
    std::vector<int> writers(R, 0);
    int run = 0;
    for (size_t o = 0; o < rank_start_.size(); ++o) writers[rank_of_ord_[o]] = run += touch[o];
    for (int r = 0; r < R; ++r) writers[r] += zero_touch[r];
    std::vector<int> tgt_sessions(tgt_bytes_.size(), 0);
    for (int i = 0; i < I_; ++i)
      for (int r = 0; r < R; ++r) tgt_sessions[tgt_nic_[i * R + r]] += writers[r];
    double targets_s = 0;
    for (size_t n = 0; n < tgt_bytes_.size(); ++n)
      targets_s = std::max(targets_s, PredictTargetNic(opt_.cost, bw_, tgt_bytes_[n], tgt_sessions[n]));
    t.transfer_s = std::max(targets_s, t.sources_s);
    return t;
  }

 private:
  const PlanInput& in_;
  const PlanOptions& opt_;
  const StageLine& line_;
  std::vector<int> insts_;
  int S_ = 0, I_ = 0;
  double bw_ = 0;
  std::vector<LineItem> items_;   // the line's items with bytes
  std::vector<uint64_t> starts_;  // their starts (increasing)
  std::vector<int> ord_of_rank_;  // rank -> ordinal among ranks with bytes in the stage, -1 when none
  std::vector<int> rank_of_ord_;
  std::vector<uint64_t> rank_start_;  // per ordinal: where the rank's bytes start on the line
  std::vector<int> zero_ranks_;       // ranks with zero-byte parameters in the stage (increasing)
  std::vector<LineItem> zero_items_;
  std::vector<int> src_nic_;   // per source of the stage: its NIC (dense id)
  std::vector<int> src_node_;  // per source of the stage: its node (dense id)
  int num_src_nics_ = 0;
  int num_src_nodes_ = 0;
  std::vector<int> tgt_nic_;         // per configured target (instance * R + rank): its NIC (dense id)
  std::vector<uint64_t> tgt_bytes_;  // per target NIC: the stage's bytes into it
};

// The fewest of the stage's sources with the lowest predicted time: starting from all S, a count is taken when its
// prediction is no higher than the best so far, i.e. a source is kept only if the stage is faster with it (where a
// target NIC bounds the stage whatever the count, the slowest source decides). The scan stops at the first u whose
// lower bound (the stage's bytes over u sources at the replica load rate or over u NICs at line rate, to every
// instance) already exceeds the best; below it no count can do better.
int AutoSourceCount(const PlanInput& in, const PlanOptions& opt, const StageIndex& ix, const StageLine& line,
                    int stage) {
  const int S = in.cluster.trainer.sources_per_stage();
  uint64_t stage_bytes = 0;
  for (uint64_t b : ix.bytes[stage]) stage_bytes += b;
  if (stage_bytes == 0 || S <= 1) return S;
  const int instances = std::max(1, in.cluster.engine.instances);
  const double load_rate = MaxSourceLoadRate(opt.cost);
  const double nic_rate = in.cluster.nic.bytes_per_second();
  const StageCountModel model(in, opt, ix, line, stage);
  int best_u = S;
  StageCountTime best = model.Predict(S);
  for (int u = S - 1; u >= 1; --u) {
    const double share = static_cast<double>(stage_bytes) / u;
    const double bound = std::max(share / load_rate, share * instances / nic_rate);
    // Both figures of any count <= u are at least `bound`.
    if (bound > best.transfer_s || (bound >= best.transfer_s && bound > best.sources_s)) break;
    const StageCountTime t = model.Predict(u);
    if (NoSlower(t, best)) best = t, best_u = u;
  }
  return best_u;
}

absl::Status CheckStageCount(const PlanInput& in, int stage, int sources) {
  WSYNC_RETURN_IF_ERROR_CTX(in.Validate(), "plan input");
  const int pp = in.cluster.trainer.pp, S = in.cluster.trainer.sources_per_stage();
  if (stage < 0 || stage >= pp)
    return absl::InvalidArgumentError(absl::StrCat("stage ", stage, " outside [0, ", pp, ")"));
  if (sources < 1 || sources > S)
    return absl::InvalidArgumentError(absl::StrCat("source count ", sources, " outside [1, ", S, "]"));
  return absl::OkStatus();
}

}  // namespace

std::pair<int, int> TargetNicOf(const ClusterSpec& cluster, const Target& target) {
  return PlaceTarget(cluster, target);
}

absl::StatusOr<std::optional<uint64_t>> ParseMinSourceMib(absl::string_view text) {
  const std::string t = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text));
  if (t == "auto") return std::optional<uint64_t>();
  uint64_t mib = 0;
  if (!absl::SimpleAtoi(t, &mib) || mib > (uint64_t{1} << 40)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--min-source-mib: expected auto or a whole number of MiB, got '", text, "'"));
  }
  return std::optional<uint64_t>(mib << 20);
}

std::string FormatMinSourceMib(const std::optional<uint64_t>& bytes) {
  return bytes.has_value() ? absl::StrCat(*bytes >> 20) : "auto";
}

absl::StatusOr<Plan> BuildPlan(const PlanInput& input, const PlanOptions& options) {
  WSYNC_RETURN_IF_ERROR_CTX(input.Validate(), "plan input");
  const ClusterSpec& c = input.cluster;
  const int pp = c.trainer.pp;
  const int S = c.trainer.sources_per_stage();
  const StageIndex ix = IndexStages(input);
  const std::vector<int> active = input.ActiveInstances();

  Plan plan;
  plan.strategy = options.strategy;
  plan.sources.resize(static_cast<size_t>(pp) * S);
  for (int p = 0; p < pp; ++p) {
    for (int j = 0; j < S; ++j) {
      SourcePlan& s = plan.sources[p * S + j];
      s.stage = p;
      s.index = j;
      PlaceSource(c, &s);
    }
  }

  if (options.strategy == Strategy::kSeed) {
    for (int p = 0; p < pp; ++p) {
      std::vector<SourcePlan*> srcs;
      for (int j = 0; j < S; ++j) srcs.push_back(&plan.sources[p * S + j]);
      PlanStageSeed(input, ix, p, active, srcs);
    }
  } else if (options.strategy == Strategy::kLocal) {
    WSYNC_RETURN_IF_ERROR(CheckLocalInput(input));
    // Every rank may send (it holds its shards anyway); weights equalise bytes per NIC as in balanced.
    std::map<std::pair<int, int>, int> per_nic;
    for (const SourcePlan& s : plan.sources) per_nic[{s.node, s.nic}]++;
    Holdings hold(input);
    for (int p = 0; p < pp; ++p) {
      std::vector<SourcePlan*> srcs;
      std::vector<double> weights;
      for (int j = 0; j < S; ++j) {
        SourcePlan* s = &plan.sources[p * S + j];
        srcs.push_back(s);
        weights.push_back(1.0 / per_nic[{s->node, s->nic}]);
      }
      PlanStageLocal(input, options, ix, p, srcs, weights, hold);
    }
  } else {
    // Which sources each stage uses: the cost model's choice (auto), or all of them unless the stage is too small
    // to give each min_source_bytes.
    std::vector<std::vector<int>> used(pp);
    std::vector<StageLine> lines(pp);
    std::map<std::pair<int, int>, int> per_nic;
    for (int p = 0; p < pp; ++p) {
      lines[p] = MakeStageLine(input, ix, p);
      uint64_t stage_bytes = 0;
      for (uint64_t b : ix.bytes[p]) stage_bytes += b;
      int u = S;
      if (!options.min_source_bytes.has_value()) {
        u = AutoSourceCount(input, options, ix, lines[p], p);
      } else if (*options.min_source_bytes > 0) {
        const uint64_t m = *options.min_source_bytes;
        u = static_cast<int>(std::min<uint64_t>(S, std::max<uint64_t>(1, (stage_bytes + m - 1) / m)));
      }
      for (int j : SpreadSources(S, u)) {
        used[p].push_back(j);
        const SourcePlan& s = plan.sources[p * S + j];
        per_nic[{s.node, s.nic}]++;
      }
    }
    for (int p = 0; p < pp; ++p) {
      std::vector<SourcePlan*> srcs;
      std::vector<double> weights;
      for (int j : used[p]) {
        SourcePlan* s = &plan.sources[p * S + j];
        srcs.push_back(s);
        weights.push_back(1.0 / per_nic[{s->node, s->nic}]);  // equal bytes per NIC, split among its sources
      }
      PlanStageBalanced(input, options, lines[p], srcs, weights);
    }
  }
  for (SourcePlan& s : plan.sources) Materialize(input, active, &s);
  if (options.strategy == Strategy::kLocal) AssignLocalPushes(input, &plan);
  Account(input, active, &plan);
  return plan;
}

absl::StatusOr<Plan> BuildStagePlan(const PlanInput& input, const PlanOptions& options, int stage, int sources) {
  WSYNC_RETURN_IF_ERROR(CheckStageCount(input, stage, sources));
  const ClusterSpec& c = input.cluster;
  const int S = c.trainer.sources_per_stage();
  const StageIndex ix = IndexStages(input);
  const std::vector<int> all = ConfiguredInstances(c, options);
  Plan plan;
  plan.strategy = Strategy::kBalanced;
  plan.sources.resize(static_cast<size_t>(c.trainer.pp) * S);
  for (size_t k = 0; k < plan.sources.size(); ++k) {
    plan.sources[k].stage = static_cast<int>(k) / S;
    plan.sources[k].index = static_cast<int>(k) % S;
    PlaceSource(c, &plan.sources[k]);
  }
  const std::vector<int> js = SpreadSources(S, sources);
  std::map<std::pair<int, int>, int> per_nic;
  for (int j : js) per_nic[{plan.sources[stage * S + j].node, plan.sources[stage * S + j].nic}]++;
  std::vector<SourcePlan*> srcs;
  std::vector<double> weights;
  for (int j : js) {
    SourcePlan* s = &plan.sources[stage * S + j];
    srcs.push_back(s);
    weights.push_back(1.0 / per_nic[{s->node, s->nic}]);
  }
  PlanStageBalanced(input, options, MakeStageLine(input, ix, stage), srcs, weights);
  for (SourcePlan* s : srcs) Materialize(input, all, s);
  Account(input, all, &plan);
  return plan;
}

absl::StatusOr<StageCountTime> PredictStageCount(const PlanInput& input, const PlanOptions& options, int stage,
                                                 int sources) {
  WSYNC_RETURN_IF_ERROR(CheckStageCount(input, stage, sources));
  const StageIndex ix = IndexStages(input);
  const StageLine line = MakeStageLine(input, ix, stage);
  return StageCountModel(input, options, ix, line, stage).Predict(sources);
}

absl::StatusOr<std::vector<int>> AutoSourceCounts(const PlanInput& input, const PlanOptions& options) {
  WSYNC_RETURN_IF_ERROR_CTX(input.Validate(), "plan input");
  const StageIndex ix = IndexStages(input);
  std::vector<int> out;
  for (int p = 0; p < input.cluster.trainer.pp; ++p)
    out.push_back(AutoSourceCount(input, options, ix, MakeStageLine(input, ix, p), p));
  return out;
}

absl::Status VerifyPlan(const PlanInput& in, const Plan& plan) {
  const int pp = in.cluster.trainer.pp;
  const int S = in.cluster.trainer.sources_per_stage();
  if (static_cast<int>(plan.sources.size()) != pp * S) {
    return absl::InternalError(absl::StrCat("plan has ", plan.sources.size(), " sources, expected ", pp * S));
  }
  const std::vector<int> active = in.ActiveInstances();
  const std::set<int> active_set(active.begin(), active.end());
  // received[stage][(instance, rank)] = slices
  std::vector<std::map<Target, std::vector<ParamSlice>>> received(pp);
  const bool local = plan.strategy == Strategy::kLocal;
  std::map<int, std::set<int>> node_push;  // local: a node's ranks push for every source of the node
  if (local) {
    WSYNC_RETURN_IF_ERROR(VerifyLocalPushes(in, plan));
    for (const SourcePlan& s : plan.sources) node_push[s.node].insert(s.push_filter.begin(), s.push_filter.end());
  }
  for (const SourcePlan& s : plan.sources) {
    std::set<int> push = local ? node_push[s.node] : std::set<int>(s.push_filter.begin(), s.push_filter.end());
    std::map<int, std::set<std::pair<int, uint64_t>>> loaded;  // rank -> (param, offset)
    for (const LayoutAssignment& a : s.assignments) {
      for (const auto& sl : a.slices) loaded[a.rank].insert({sl.param, sl.offset});
    }
    for (const Task& t : s.tasks) {
      if (!active_set.count(t.target.instance)) {
        return absl::InternalError(absl::StrCat("source ", s.trainer_rank, " writes to inactive instance ", t.target.instance));
      }
      const LayoutInfo& layout = in.layouts[t.target.rank];
      for (const ParamSlice& sl : t.slices) {
        const ParamInfo& p = layout.params[sl.param];
        if (p.stage != s.stage) {
          return absl::InternalError(absl::StrCat("source ", s.trainer_rank, " (stage ", s.stage, ") sends ", p.name,
                                                  " of stage ", p.stage));
        }
        if (!loaded[t.target.rank].count({sl.param, sl.offset})) {
          return absl::InternalError(absl::StrCat("source ", s.trainer_rank, " sends ", p.name, " it did not load"));
        }
        for (int h : p.inputs) {
          if (in.hf_tensors[h].stage != s.stage || !push.count(h)) {
            return absl::InternalError(absl::StrCat("source ", s.trainer_rank, " sends ", p.name, " but does not get ",
                                                    in.hf_tensors[h].name));
          }
        }
        received[s.stage][t.target].push_back(sl);
      }
    }
  }
  for (int p = 0; p < pp; ++p) {
    for (int i : active) {
      for (int r = 0; r < static_cast<int>(in.layouts.size()); ++r) {
        std::vector<ParamSlice> got = received[p][{i, r}];
        std::sort(got.begin(), got.end(), [](const ParamSlice& a, const ParamSlice& b) {
          return a.param != b.param ? a.param < b.param : a.offset < b.offset;
        });
        size_t g = 0;
        const auto& params = in.layouts[r].params;
        for (int k = 0; k < static_cast<int>(params.size()); ++k) {
          if (params[k].stage != p) continue;
          uint64_t covered = 0;
          bool any = false;
          while (g < got.size() && got[g].param == k) {
            if (got[g].offset != covered) {
              return absl::InternalError(absl::StrCat("target (", i, ",", r, ") parameter ", params[k].name,
                                                      ": bytes at ", covered, " missing or duplicated"));
            }
            covered += got[g].length;
            any = true;
            ++g;
          }
          if (!any || covered != params[k].bytes) {
            return absl::InternalError(absl::StrCat("target (", i, ",", r, ") parameter ", params[k].name, " received ",
                                                    covered, " of ", params[k].bytes, " bytes"));
          }
        }
        if (g != got.size()) {
          return absl::InternalError(absl::StrCat("target (", i, ",", r, ") stage ", p, " receives parameter ",
                                                  got[g].param, " not of this stage"));
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Planner> Planner::Create(PlanInput input, PlanOptions options) {
  Planner p;
  p.input_ = std::move(input);
  p.input_.instances = p.input_.ActiveInstances();
  p.options_ = options;
  WSYNC_ASSIGN_OR_RETURN(p.plan_, BuildPlan(p.input_, options));
  return p;
}

namespace {

std::vector<int> ChangedSources(const Plan& before, const Plan& after) {
  std::vector<int> out;
  for (size_t k = 0; k < after.sources.size(); ++k) {
    if (!(before.sources[k].tasks == after.sources[k].tasks)) out.push_back(static_cast<int>(k));
  }
  return out;
}

}  // namespace

absl::StatusOr<std::vector<int>> Planner::AddInstance(int id) {
  if (id < 0 || id >= input_.cluster.engine.instances) {
    return absl::InvalidArgumentError(absl::StrCat("instance ", id, " outside [0, ", input_.cluster.engine.instances, ")"));
  }
  auto& v = input_.instances;
  if (std::binary_search(v.begin(), v.end(), id)) {
    return absl::AlreadyExistsError(absl::StrCat("instance ", id, " is already active"));
  }
  v.insert(std::lower_bound(v.begin(), v.end(), id), id);
  const Plan before = plan_;
  if (options_.strategy == Strategy::kSeed) {
    // The seed heuristic's assignment depends on the target order; it is recomputed in full.
    WSYNC_ASSIGN_OR_RETURN(plan_, BuildPlan(input_, options_));
  } else {
    for (SourcePlan& s : plan_.sources) {
      if (!s.assignments.empty()) Materialize(input_, v, &s);
    }
    if (options_.strategy == Strategy::kLocal) AssignLocalPushes(input_, &plan_);
    Account(input_, v, &plan_);
  }
  return ChangedSources(before, plan_);
}

absl::StatusOr<std::vector<int>> Planner::RemoveInstance(int id) {
  auto& v = input_.instances;
  auto it = std::lower_bound(v.begin(), v.end(), id);
  if (it == v.end() || *it != id) return absl::NotFoundError(absl::StrCat("instance ", id, " is not active"));
  if (v.size() == 1) return absl::FailedPreconditionError("cannot remove the last active instance");
  v.erase(it);
  const Plan before = plan_;
  if (options_.strategy == Strategy::kSeed) {
    WSYNC_ASSIGN_OR_RETURN(plan_, BuildPlan(input_, options_));
  } else {
    for (SourcePlan& s : plan_.sources) {
      if (!s.assignments.empty()) Materialize(input_, v, &s);
    }
    if (options_.strategy == Strategy::kLocal) AssignLocalPushes(input_, &plan_);
    Account(input_, v, &plan_);
  }
  return ChangedSources(before, plan_);
}

PlanStats ComputeStats(const PlanInput& in, const Plan& plan) {
  PlanStats st;
  st.sources_total = static_cast<int>(plan.sources.size());
  const int pp = in.cluster.trainer.pp;
  std::vector<uint64_t> stage_total(pp, 0), stage_max(pp, 0);
  std::vector<int> stage_n(pp, 0);
  bool first = true;
  uint64_t sum = 0;
  int64_t sess_sum = 0;
  for (const SourcePlan& s : plan.sources) {
    stage_n[s.stage]++;
    if (!s.active()) continue;
    stage_total[s.stage] += s.bytes_out;
    stage_max[s.stage] = std::max(stage_max[s.stage], s.bytes_out);
    st.sources_used++;
    sum += s.bytes_out;
    sess_sum += s.sessions;
    if (first) {
      st.max_source_bytes = st.min_source_bytes = s.bytes_out;
      st.max_sessions = st.min_sessions = s.sessions;
      first = false;
    }
    st.max_source_bytes = std::max(st.max_source_bytes, s.bytes_out);
    st.min_source_bytes = std::min(st.min_source_bytes, s.bytes_out);
    st.max_sessions = std::max(st.max_sessions, s.sessions);
    st.min_sessions = std::min(st.min_sessions, s.sessions);
    st.max_layouts_per_source = std::max(st.max_layouts_per_source, static_cast<int>(s.assignments.size()));
    st.max_load_bytes = std::max(st.max_load_bytes, s.load_bytes);
  }
  st.total_bytes = sum;
  if (st.sources_used > 0) {
    st.mean_source_bytes = static_cast<double>(sum) / st.sources_used;
    st.mean_sessions = static_cast<double>(sess_sum) / st.sources_used;
  }
  for (int p = 0; p < pp; ++p) {
    if (stage_total[p] == 0 || stage_n[p] == 0) continue;
    const double ideal = static_cast<double>(stage_total[p]) / stage_n[p];
    st.imbalance = std::max(st.imbalance, stage_max[p] / ideal);
  }
  if (!plan.target_bytes.empty()) {
    st.max_target_bytes = *std::max_element(plan.target_bytes.begin(), plan.target_bytes.end());
    st.min_target_bytes = *std::min_element(plan.target_bytes.begin(), plan.target_bytes.end());
    uint64_t t = 0;
    for (uint64_t b : plan.target_bytes) t += b;
    st.mean_target_bytes = static_cast<double>(t) / plan.target_bytes.size();
  }
  for (const auto& n : plan.source_nics) st.max_source_nic_bytes = std::max(st.max_source_nic_bytes, n.bytes);
  for (const auto& n : plan.target_nics) st.max_target_nic_bytes = std::max(st.max_target_nic_bytes, n.bytes);
  return st;
}

}  // namespace wsync::planner
