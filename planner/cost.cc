#include "planner/cost.h"

#include <algorithm>
#include <map>
#include <utility>

namespace wsync::planner {
namespace {

constexpr double kGB = 1e9;

// Ranks of a contiguous group of `size` ranks with stride `stride`: how many peers share the node.
int PeersOnNode(int size, int stride, int gpus_per_node) {
  const int per_node = std::max(1, gpus_per_node / std::max(1, stride));
  return std::min(size, per_node) - 1;
}

}  // namespace

double NodeLoadGbps(const CostParams& cp, int ranks) {
  const auto& pts = cp.node_load_gbps;
  if (pts.empty()) return 0;
  if (ranks <= pts.front().first) return pts.front().second;
  for (size_t i = 1; i < pts.size(); ++i) {
    if (ranks <= pts[i].first) {
      const auto& [r0, g0] = pts[i - 1];
      const auto& [r1, g1] = pts[i];
      return g0 + (g1 - g0) * (ranks - r0) / static_cast<double>(r1 - r0);
    }
  }
  return pts.back().second;
}

double SourceLoadRate(const CostParams& cp, int node_sources) {
  if (cp.node_load_gbps.empty()) return cp.replica_load_gbps * kGB;
  const int r = std::max(1, node_sources);
  return NodeLoadGbps(cp, r) * kGB / r;
}

double MaxSourceLoadRate(const CostParams& cp) {
  if (cp.node_load_gbps.empty()) return cp.replica_load_gbps * kGB;
  // The per-source share is highest at a measured point (it is linear in between, over R).
  double best = 0;
  for (const auto& [r, g] : cp.node_load_gbps) best = std::max(best, SourceLoadRate(cp, r));
  return std::max(best, SourceLoadRate(cp, 1));
}

uint64_t GatherBytes(const PlanInput& in) {
  const TrainerSpec& t = in.cluster.trainer;
  // Every rank of a group of g receives (g-1)/g of the group's bytes; a stage has S/g such receivers per group.
  long double total = 0;
  const int S = t.sources_per_stage();
  for (const HfTensorInfo& h : in.hf_tensors) {
    const int g = h.expert ? t.ep : t.tp;
    if (g > 1) total += static_cast<long double>(h.train_bytes) * (g - 1) / g * S;
  }
  return static_cast<uint64_t>(total);
}

double PredictGather(const PlanInput& in, const CostParams& cp) {
  if (!cp.include_gather) return 0;
  const TrainerSpec& t = in.cluster.trainer;
  const double nic_per_gpu =
      in.cluster.nic.bytes_per_second() * in.cluster.nic.per_node / t.gpus_per_node * cp.gather_efficiency;
  std::vector<double> dense(t.pp, 0), expert(t.pp, 0);
  for (const HfTensorInfo& h : in.hf_tensors) {
    const double b = static_cast<double>(h.train_bytes);
    (h.expert ? expert : dense)[h.stage] += b;
  }
  double worst = 0;
  for (int p = 0; p < t.pp; ++p) {
    // Dense tensors are gathered over TP (contiguous ranks), experts over EP (stride etp). A rank receives
    // (g-1)/g of the group's bytes; the share coming from peers on the same node travels over NVLink.
    double intra = 0, inter = 0;
    auto add = [&](double bytes, int g, int stride) {
      if (g <= 1) return;
      const int on = PeersOnNode(g, stride, t.gpus_per_node);
      intra += bytes * on / g;
      inter += bytes * (g - 1 - on) / g;
    };
    add(dense[p], t.tp, 1);
    add(expert[p], t.ep, t.etp);
    worst = std::max(worst, intra / (cp.nvlink_gbps * kGB) + inter / nic_per_gpu);
  }
  return worst;
}

SourceTime PredictSource(const CostParams& cp, double bw, int nic_sources, uint64_t nic_bytes, uint64_t push_bytes,
                         uint64_t load_bytes, uint64_t blocking_bytes, int sessions, int node_sources) {
  SourceTime st;
  const double share = bw / std::max(1, nic_sources);  // sources on one NIC split it
  st.d2h_s = push_bytes / (cp.d2h_gbps * kGB);
  st.load_s = load_bytes / SourceLoadRate(cp, node_sources);
  st.nic_s = nic_bytes / bw;
  st.blocking_send_s = blocking_bytes / share;
  st.session_s = sessions * cp.session_ms / 1e3;
  const ExecutorTraits traits = TraitsOf(cp.executor);
  if (!traits.writes_overlap_loads) {
    // The seed's replica loads slice straight from the gathered GPU tensors (its hand-over is part of the measured
    // load rate and not counted again), and its writes block the next load.
    st.total_s = std::max(st.load_s + st.blocking_send_s, st.nic_s) + st.session_s;
  } else {
    // Hand-over, load and writes are stages of a pipeline; session set-up and completion overlap with the data
    // like everything else in this executor.
    st.total_s = std::max({traits.handover_overlaps_load ? st.d2h_s : 0.0, st.load_s, st.nic_s, st.session_s});
  }
  return st;
}

double PredictTargetNic(const CostParams& cp, double bw, uint64_t bytes, int sessions) {
  // Its bytes at line rate and the sessions writing into it, one after the other (serial) or overlapped
  // (pipelined).
  const double sessions_s = sessions * cp.session_ms / 1e3;
  return TraitsOf(cp.executor).writes_overlap_loads ? std::max(bytes / bw, sessions_s) : bytes / bw + sessions_s;
}

Prediction PredictTransfer(const PlanInput& in, const Plan& plan, const CostParams& cp) {
  Prediction pr;
  const double bw = in.cluster.nic.bytes_per_second();
  std::map<std::pair<int, int>, uint64_t> nic_bytes;
  std::map<std::pair<int, int>, int> nic_sources;
  std::map<int, int> node_sources;
  for (const NicLoad& n : plan.source_nics) nic_bytes[{n.node, n.nic}] = n.bytes;
  for (const SourcePlan& s : plan.sources)
    if (s.active()) nic_sources[{s.node, s.nic}]++, node_sources[s.node]++;
  uint64_t max_src_nic = 0, max_tgt_nic = 0, total = 0;
  for (const NicLoad& n : plan.source_nics) max_src_nic = std::max(max_src_nic, n.bytes), total += n.bytes;
  for (const NicLoad& n : plan.target_nics) {
    max_tgt_nic = std::max(max_tgt_nic, n.bytes);
    pr.max_target_nic_s = std::max(pr.max_target_nic_s, PredictTargetNic(cp, bw, n.bytes, n.sessions));
  }
  pr.bound_s = std::max(max_src_nic, max_tgt_nic) / bw;
  const double trainer_nics = static_cast<double>(in.cluster.trainer.nodes) * in.cluster.nic.per_node;
  pr.ideal_bound_s = std::max(static_cast<double>(max_tgt_nic), total / trainer_nics) / bw;

  double worst = pr.max_target_nic_s;
  for (size_t k = 0; k < plan.sources.size(); ++k) {
    const SourcePlan& s = plan.sources[k];
    if (!s.active()) continue;
    const std::pair<int, int> key{s.node, s.nic};
    // Writes of every layout but the last are waited for before the shared replica buffer is reloaded.
    uint64_t blocking = 0;
    if (!s.tasks.empty()) {
      const int last_rank = s.tasks.back().target.rank;
      for (const Task& t : s.tasks)
        if (t.target.rank != last_rank) blocking += t.bytes;
    }
    SourceTime st = PredictSource(cp, bw, nic_sources[key], nic_bytes[key], s.push_bytes, s.load_bytes, blocking,
                                  s.sessions, node_sources[s.node]);
    st.source = static_cast<int>(k);
    if (st.total_s > worst) {
      worst = st.total_s;
      pr.critical_source = st.source;
    }
    pr.sources.push_back(st);
  }
  pr.transfer_s = worst;
  pr.total_s = worst;
  return pr;
}

Prediction PredictPlan(const PlanInput& in, const Plan& plan, const CostParams& cp) {
  Prediction pr = PredictTransfer(in, plan, cp);
  if (plan.strategy == Strategy::kLocal) {
    // Only what the plan gathers: each rank's gathered bytes, from holders on other nodes, at its NIC share.
    const TrainerSpec& t = in.cluster.trainer;
    const double nic_per_gpu =
        in.cluster.nic.bytes_per_second() * in.cluster.nic.per_node / t.gpus_per_node * cp.gather_efficiency;
    pr.gather_s = 0;
    if (cp.include_gather)
      for (const SourcePlan& s : plan.sources)
        pr.gather_s = std::max(pr.gather_s, s.gather_bytes / nic_per_gpu);
    pr.gather_bytes = plan.gather_bytes;
  } else {
    pr.gather_s = PredictGather(in, cp);
    pr.gather_bytes = GatherBytes(in);
  }
  pr.total_s = (cp.fixed_ms + cp.post_process_ms) / 1e3 + pr.gather_s + pr.transfer_s;
  return pr;
}

BroadcastPrediction PredictBroadcast(const PlanInput& in, const CostParams& cp) {
  BroadcastPrediction b;
  const TrainerSpec& t = in.cluster.trainer;
  std::vector<uint64_t> stage(t.pp, 0);
  for (const HfTensorInfo& h : in.hf_tensors) {
    stage[h.stage] += h.bytes;
    b.bytes_per_receiver += h.bytes;
  }
  b.max_stage_bytes = *std::max_element(stage.begin(), stage.end());
  const int receivers = in.cluster.engine.instances * in.cluster.engine.tp;
  b.network_bytes = b.bytes_per_receiver * static_cast<uint64_t>(receivers);
  // The head rank streams its stage once into a pipelined ring (its GPU's NIC share is the ceiling); every
  // receiver takes in all stages and loads them into its GPU weights bucket by bucket.
  const double head_bw = in.cluster.nic.bytes_per_second() * in.cluster.nic.per_node / t.gpus_per_node;
  b.transfer_s = std::max(b.max_stage_bytes / head_bw, b.bytes_per_receiver / (cp.bcast_rx_gbps * kGB));
  b.gather_s = PredictGather(in, cp);
  b.total_s = (cp.fixed_ms + cp.post_process_ms) / 1e3 + b.gather_s + b.transfer_s;
  return b;
}

}  // namespace wsync::planner
