#include "tools/cli/plan_command.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include "CLI/CLI.hpp"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/memory_kind.h"
#include "base/status.h"
#include "nlohmann/json.hpp"
#include "planner/cost.h"
#include "planner/model_input.h"
#include "planner/node_rates.h"
#include "planner/relay.h"
#include "planner/seed_table.h"
#include "replica/model_config.h"

namespace wsync::tools {
namespace {

using planner::ClusterSpec;
using planner::HfTensorInfo;
using planner::LayoutInfo;
using planner::ParamInfo;
using planner::PlanInput;

constexpr int kExitOk = 0;
constexpr int kExitError = 1;
constexpr int kExitUsage = 2;

// ---------------------------------------------------------------------------------------------------------------
// Output.

std::string Bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) b /= 1024, ++u;
  return absl::StrFormat(u == 0 ? "%.0f %s" : "%.2f %s", b, units[u]);
}

std::string Secs(double s) { return s < 1 ? absl::StrFormat("%.0f ms", s * 1e3) : absl::StrFormat("%.2f s", s); }

struct Report {
  std::string model;
  planner::PlanStats stats;
  planner::Prediction p2p;
  planner::BroadcastPrediction bcast;
  uint64_t max_push = 0;
  double build_ms = 0;
};

nlohmann::json SourcesJson(const PlanInput& in, const planner::Plan& plan, bool tasks) {
  nlohmann::json arr = nlohmann::json::array();
  for (const auto& s : plan.sources) {
    if (!s.active()) continue;
    nlohmann::json j = {{"trainer_rank", s.trainer_rank}, {"stage", s.stage}, {"node", s.node}, {"nic", s.nic},
                        {"bytes_out", s.bytes_out}, {"load_bytes", s.load_bytes}, {"push_bytes", s.push_bytes},
                        {"sessions", s.sessions}, {"push_tensors", s.push_filter.size()},
                        {"gather_bytes", s.gather_bytes}};
    if (tasks) {
      nlohmann::json tj = nlohmann::json::array();
      for (const auto& t : s.tasks) {
        nlohmann::json sl = nlohmann::json::array();
        for (const auto& x : t.slices) {
          sl.push_back({{"param", in.layouts[t.target.rank].params[x.param].name}, {"offset", x.offset},
                        {"length", x.length}});
        }
        tj.push_back({{"instance", t.target.instance}, {"rank", t.target.rank}, {"bytes", t.bytes}, {"params", sl}});
      }
      j["tasks"] = tj;
      nlohmann::json pf = nlohmann::json::array();
      for (int h : s.push_filter) pf.push_back(in.hf_tensors[h].name);
      j["push_filter"] = pf;
      if (!s.push_slices.empty()) {
        nlohmann::json ps = nlohmann::json::array();
        for (const auto& x : s.push_slices)
          ps.push_back({{"tensor", in.hf_tensors[x.hf].name}, {"rows", {x.box.row0, x.box.row0 + x.box.rows}},
                        {"cols", {x.box.col0, x.box.col0 + x.box.cols}}, {"bytes", x.bytes},
                        {"gather_bytes", x.gather_bytes}});
        j["push_slices"] = ps;
      }
    }
    arr.push_back(j);
  }
  return arr;
}

// Which replica-load and hand-over rates a prediction used, and where they come from.
std::string RatesLine(const planner::CostParams& cp) {
  std::string load;
  if (cp.node_load_gbps.empty()) {
    load = absl::StrFormat("replica load %.2f GB/s per source", cp.replica_load_gbps);
  } else {
    load = "replica load per node";
    for (const auto& [r, g] : cp.node_load_gbps)
      absl::StrAppendFormat(&load, " %d rank%s %.1f GB/s,", r, r == 1 ? "" : "s", g);
    load.back() = ';';
    load += " shared by the node's active ranks";
  }
  return absl::StrFormat("%s; d2h %.1f GB/s; from %s", load, cp.d2h_gbps,
                         cp.rates_origin.empty() ? "the defaults (docs/planner.md)" : cp.rates_origin);
}

void PrintTable(const PlanInput& in, const planner::Plan& plan, const Report& r, const WeightFormat& f,
                const planner::CostParams& cp, bool tasks) {
  const auto& c = in.cluster;
  const auto& st = r.stats;
  std::printf("model             %s, %s\n", r.model.c_str(),
              f.fp8_block ? absl::StrCat("fp8 [", f.fp8_block, ",", f.fp8_block, "] blocks").c_str() : "bf16");
  std::printf("trainer           %s -> %d ranks, %d sources per PP stage\n",
              planner::FormatTrainerSpec(c.trainer).c_str(), c.trainer.world(), c.trainer.sources_per_stage());
  std::printf("engine            %s -> %d targets\n", planner::FormatEngineSpec(c.engine).c_str(),
              c.engine.instances * c.engine.tp);
  std::printf("nic               %d x %.0f Gb/s per node\n", c.nic.per_node, c.nic.gbps);
  std::printf("strategy          %s (built in %.1f ms)\n", std::string(planner::StrategyName(plan.strategy)).c_str(),
              r.build_ms);
  std::printf("sources used      %d / %d\n", st.sources_used, st.sources_total);
  std::printf("bytes per source  max %s  min %s  mean %s  (max / ideal %.3f)\n", Bytes(st.max_source_bytes).c_str(),
              Bytes(st.min_source_bytes).c_str(), Bytes(st.mean_source_bytes).c_str(), st.imbalance);
  std::printf("bytes per target  max %s  min %s  mean %s\n", Bytes(st.max_target_bytes).c_str(),
              Bytes(st.min_target_bytes).c_str(), Bytes(st.mean_target_bytes).c_str());
  std::printf("sessions/source   max %d  min %d  mean %.1f\n", st.max_sessions, st.min_sessions, st.mean_sessions);
  std::printf("replica loads     max %d layouts, %s per source; push filter max %s\n", st.max_layouts_per_source,
              Bytes(st.max_load_bytes).c_str(), Bytes(r.max_push).c_str());
  std::printf("NIC bytes         source max %s, target max %s\n", Bytes(st.max_source_nic_bytes).c_str(),
              Bytes(st.max_target_nic_bytes).c_str());
  std::printf("network bound     %s  (any plan: %s)\n", Secs(r.p2p.bound_s).c_str(), Secs(r.p2p.ideal_bound_s).c_str());
  std::printf("rates             %s\n", RatesLine(cp).c_str());
  std::printf("predicted         %s  (gather %s + transfer %s + fixed/post %s; %s executor)\n",
              Secs(r.p2p.total_s).c_str(), Secs(r.p2p.gather_s).c_str(), Secs(r.p2p.transfer_s).c_str(),
              Secs((cp.fixed_ms + cp.post_process_ms) / 1e3).c_str(),
              cp.executor == planner::Executor::kSerial ? "serial" : "pipelined");
  std::printf("gathered          %s in the trainer's dtype (%s of expert tensors)%s\n", Bytes(r.p2p.gather_bytes).c_str(),
              Bytes(plan.expert_gather_bytes).c_str(),
              plan.strategy == planner::Strategy::kLocal ? "; only what no rank of the pushing node holds"
                                                         : "; the whole TP/EP all-gather");
  std::printf("NCCL broadcast    %s  (gather %s + transfer %s; %s per engine rank)\n", Secs(r.bcast.total_s).c_str(),
              Secs(r.bcast.gather_s).c_str(), Secs(r.bcast.transfer_s).c_str(),
              Bytes(r.bcast.bytes_per_receiver).c_str());
  std::printf("speed-up          %.2fx\n", r.bcast.total_s / r.p2p.total_s);
  if (tasks) {
    for (const auto& s : plan.sources) {
      if (!s.active()) continue;
      std::printf("source %d (stage %d, node %d, nic %d): %s out, load %s, push %zu tensors (%s), gathers %s\n",
                  s.trainer_rank, s.stage, s.node, s.nic, Bytes(s.bytes_out).c_str(), Bytes(s.load_bytes).c_str(),
                  s.push_filter.size(), Bytes(s.push_bytes).c_str(), Bytes(s.gather_bytes).c_str());
      for (const auto& t : s.tasks) {
        std::printf("  -> (%d,%d) %zu params %s\n", t.target.instance, t.target.rank, t.slices.size(),
                    Bytes(t.bytes).c_str());
      }
    }
  }
}

nlohmann::json ReportJson(const Report& r) {
  const auto& st = r.stats;
  return {{"model", r.model},
          {"build_ms", r.build_ms},
          {"sources_used", st.sources_used},
          {"sources_total", st.sources_total},
          {"source_bytes", {{"max", st.max_source_bytes}, {"min", st.min_source_bytes}, {"mean", st.mean_source_bytes}}},
          {"target_bytes", {{"max", st.max_target_bytes}, {"min", st.min_target_bytes}, {"mean", st.mean_target_bytes}}},
          {"sessions", {{"max", st.max_sessions}, {"min", st.min_sessions}, {"mean", st.mean_sessions}}},
          {"imbalance", st.imbalance},
          {"max_layouts_per_source", st.max_layouts_per_source},
          {"max_load_bytes", st.max_load_bytes},
          {"max_push_bytes", r.max_push},
          {"max_source_nic_bytes", st.max_source_nic_bytes},
          {"max_target_nic_bytes", st.max_target_nic_bytes},
          {"bound_s", r.p2p.bound_s},
          {"ideal_bound_s", r.p2p.ideal_bound_s},
          {"predicted_s", r.p2p.total_s},
          {"gather_s", r.p2p.gather_s},
          {"gather_bytes", r.p2p.gather_bytes},
          {"transfer_s", r.p2p.transfer_s},
          {"broadcast_s", r.bcast.total_s},
          {"broadcast_transfer_s", r.bcast.transfer_s},
          {"speedup", r.bcast.total_s / r.p2p.total_s}};
}

Report Evaluate(const std::string& model, const PlanInput& in, const planner::Plan& plan,
                const planner::CostParams& cp, double build_ms) {
  Report r;
  r.model = model;
  r.build_ms = build_ms;
  r.stats = planner::ComputeStats(in, plan);
  r.p2p = planner::PredictPlan(in, plan, cp);
  r.bcast = planner::PredictBroadcast(in, cp);
  for (const auto& s : plan.sources) r.max_push = std::max(r.max_push, s.push_bytes);
  return r;
}

std::string FindModel(const std::vector<std::string>& dirs, const std::string& name) {
  for (const auto& d : dirs) {
    const std::string p = absl::StrCat(d, "/", name, "/config.json");
    if (std::ifstream(p).good()) return p;
  }
  return "";
}

int RunSeedTable(const std::vector<std::string>& dirs, const planner::CostParams& base, bool json) {
  nlohmann::json rows = nlohmann::json::array();
  if (!json) {
    std::printf("%-24s %5s %9s | %9s %9s | %9s %9s %9s %9s %9s | %9s | %7s %7s\n", "model", "nodes", "HF bytes",
                "bcast", "bcast", "seed", "balanced", "bal+pipe", "loc+pipe", "P2P", "bound", "speedup", "speedup");
    std::printf("%-24s %5s %9s | %9s %9s | %9s %9s %9s %9s %9s | %9s | %7s %7s\n", "", "", "", "pred", "measured",
                "pred", "pred", "pred", "pred", "measured", "", "pred", "meas");
  }
  int rc = kExitOk;
  for (const planner::SeedRow& row : planner::SeedRows()) {
    const std::string path = FindModel(dirs, row.model_dir);
    if (path.empty()) {
      std::fprintf(stderr, "seed table: no %s/config.json under any --models-dir; row skipped\n", row.model_dir.c_str());
      rc = kExitError;
      continue;
    }
    ClusterSpec c{row.trainer, row.engine, planner::SeedNic()};
    WeightFormat f{row.fp8_block};
    auto in = PlanInputFromModel(path, c, f);
    if (!in.ok()) {
      std::fprintf(stderr, "seed table: %s: %s\n", row.model.c_str(), std::string(in.status().message()).c_str());
      rc = kExitError;
      continue;
    }
    planner::CostParams cp = base;
    cp.post_process_ms = row.post_process_ms;
    planner::PlanOptions so, bo, lo;
    so.strategy = planner::Strategy::kSeed;
    lo.strategy = planner::Strategy::kLocal;
    bo.cost = cp;
    auto seed = planner::BuildPlan(*in, so);
    auto bal = planner::BuildPlan(*in, bo);
    auto loc = planner::BuildPlan(*in, lo);
    if (!seed.ok() || !bal.ok() || !loc.ok()) {
      std::fprintf(stderr, "seed table: %s: planning failed\n", row.model.c_str());
      rc = kExitError;
      continue;
    }
    const auto ps = planner::PredictPlan(*in, *seed, cp);
    const auto pb = planner::PredictPlan(*in, *bal, cp);
    planner::CostParams pipe = cp;
    pipe.executor = planner::Executor::kPipelined;
    const auto pp = planner::PredictPlan(*in, *bal, pipe);
    const auto pl = planner::PredictPlan(*in, *loc, pipe);
    const auto bc = planner::PredictBroadcast(*in, cp);
    const double meas_ratio = row.nccl_ms / row.rdma_ms;
    if (json) {
      rows.push_back({{"model", row.model}, {"nodes", row.trainer.nodes}, {"hf_bytes", bc.bytes_per_receiver},
                      {"trainer", planner::FormatTrainerSpec(row.trainer)},
                      {"engine", planner::FormatEngineSpec(row.engine)},
                      {"broadcast_pred_ms", bc.total_s * 1e3}, {"broadcast_meas_ms", row.nccl_ms},
                      {"seed_pred_ms", ps.total_s * 1e3}, {"balanced_pred_ms", pb.total_s * 1e3},
                      {"balanced_pipelined_pred_ms", pp.total_s * 1e3},
                      {"local_pipelined_pred_ms", pl.total_s * 1e3}, {"local_gather_ms", pl.gather_s * 1e3},
                      {"local_gather_bytes", pl.gather_bytes}, {"local_transfer_ms", pl.transfer_s * 1e3},
                      {"p2p_meas_ms", row.rdma_ms},
                      {"gather_ms", ps.gather_s * 1e3}, {"bound_ms", pb.bound_s * 1e3},
                      {"speedup_pred", bc.total_s / ps.total_s}, {"speedup_meas", meas_ratio}});
    } else {
      std::printf("%-24s %5d %9s | %9.0f %9.0f | %9.0f %9.0f %9.0f %9.0f %9.0f | %9.0f | %6.2fx %6.2fx\n",
                  row.model.c_str(), row.trainer.nodes, Bytes(bc.bytes_per_receiver).c_str(), bc.total_s * 1e3,
                  row.nccl_ms, ps.total_s * 1e3, pb.total_s * 1e3, pp.total_s * 1e3, pl.total_s * 1e3, row.rdma_ms,
                  pb.bound_s * 1e3,
                  bc.total_s / ps.total_s, meas_ratio);
    }
  }
  if (json) {
    std::printf("%s\n", nlohmann::json({{"seed_table", rows}}).dump(2).c_str());
  } else {
    std::printf("times in ms; pred = this cost model (serial executor unless 'pipe'); speed-up pred = bcast / seed\n");
  }
  return rc;
}

// ---------------------------------------------------------------------------------------------------------------
// Relay plans (--relay): the tree, its per-hop times and the direct plan beside it.

struct RelayReport {
  planner::RelayPlan plan;
  planner::RelayPrediction pred;
  double direct_s = 0;         // the direct plan's prediction at the same rates
  uint64_t direct_egress = 0;  // what the direct plan's sources send
};

std::string HopName(int parent) { return parent < 0 ? "sources" : absl::StrCat(parent); }

// The link-rate model (planner/relay_shape.h): the coordinator's --relay auto, from rates and sizes alone.
void PrintLinkModel(const planner::RelayLinks& l, const planner::RelayShapeChoice& c) {
  std::printf("link model        %s (what wsync-coordinator --relay auto decides): %d instances, %s per copy, "
              "sources %d NICs, an instance %d NIC%s (%d rank%s each)\n",
              c.why.c_str(), l.instances, Bytes(l.copy_bytes).c_str(), l.source_nics, l.instance_nics,
              l.instance_nics == 1 ? "" : "s", l.ranks_per_nic, l.ranks_per_nic == 1 ? "" : "s");
  std::printf("  %-8s %5s %12s %12s %12s %12s %12s %12s\n", "degree", "depth", "sources", "in", "out", "per hop",
              "latency", "total");
  auto row = [](const planner::RelayShapeCost& x, const char* mark) {
    std::printf("  %-8s %5d %12s %12s %12s %12s %12s %12s%s\n",
                x.degree == 0 ? "direct" : absl::StrCat(x.degree).c_str(), x.depth, Secs(x.source_s).c_str(),
                Secs(x.inbound_s).c_str(), x.degree == 0 ? "-" : Secs(x.forward_s).c_str(),
                x.degree == 0 ? "-" : absl::StrFormat("%.3f ms", x.chunk_s * 1e3).c_str(),
                x.degree == 0 ? "-" : absl::StrFormat("%.2f ms", x.latency_s * 1e3).c_str(), Secs(x.total_s).c_str(),
                mark);
  };
  row(c.direct, c.relayed() ? "" : "  <- chosen");
  for (const auto& x : c.candidates)
    if (x.degree <= 8 || x.degree == c.chosen.degree) row(x, c.chosen.degree == x.degree ? "  <- chosen" : "");
  if (c.candidates.size() > 8) std::printf("  (degrees 9..%zu left out)\n", c.candidates.size());
}

nlohmann::json LinkModelJson(const planner::RelayLinks& l, const planner::RelayShapeChoice& c) {
  auto cost = [](const planner::RelayShapeCost& x) {
    return nlohmann::json{{"degree", x.degree},       {"depth", x.depth},         {"source_s", x.source_s},
                          {"inbound_s", x.inbound_s}, {"forward_s", x.forward_s}, {"chunk_s", x.chunk_s},
                          {"latency_s", x.latency_s}, {"total_s", x.total_s},
                          {"trainer_egress_bytes", x.trainer_egress_bytes}};
  };
  nlohmann::json cands = nlohmann::json::array();
  for (const auto& x : c.candidates) cands.push_back(cost(x));
  return {{"why", c.why},
          {"relayed", c.relayed()},
          {"chosen", cost(c.chosen)},
          {"direct", cost(c.direct)},
          {"candidates", cands},
          {"links",
           {{"copy_bytes", l.copy_bytes},
            {"instances", l.instances},
            {"source_nics", l.source_nics},
            {"source_nic_bps", l.source_nic_bps},
            {"instance_nics", l.instance_nics},
            {"target_nic_bps", l.target_nic_bps},
            {"ranks_per_nic", l.ranks_per_nic},
            {"chunk_bytes", l.chunk_bytes},
            {"hop_s", l.hop_s}}}};
}

void PrintRelay(const PlanInput& in, const RelayReport& rr, const planner::CostParams& cp, bool tasks) {
  const planner::RelayPlan& rp = rr.plan;
  const planner::RelayLinks links = planner::RelayLinksOf(in, rp.options, cp);
  PrintLinkModel(links, planner::ChooseRelayShape(links));
  if (!rp.relayed) {
    std::printf("relay             %s: direct (%s)\n", planner::FormatRelayMode(rp.options).c_str(), rp.why.c_str());
    return;
  }
  std::printf("relay             %s: %zu layout group%s, chunks of %s, %.2f ms per hop; %s\n",
              planner::FormatRelayMode(rp.options).c_str(), rp.trees.size(), rp.trees.size() == 1 ? "" : "s",
              Bytes(rp.options.chunk_bytes).c_str(), cp.relay_hop_ms, rp.why.c_str());
  std::printf(
      "trainer egress    %s (%zu cop%s, one per group); direct: %s (%.2f copies)\n",
      Bytes(rr.pred.trainer_egress_bytes).c_str(), rp.trees.size(), rp.trees.size() == 1 ? "y" : "ies",
      Bytes(rr.direct_egress).c_str(),
      rr.pred.trainer_egress_bytes ? static_cast<double>(rr.direct_egress) / rr.pred.trainer_egress_bytes : 0.0);
  uint64_t max_in = 0, max_out = 0;
  for (const auto& n : rr.pred.nics) max_in = std::max(max_in, n.in_bytes), max_out = std::max(max_out, n.out_bytes);
  std::printf(
      "relay predicted   %s  (sources %s, engine NICs %s [in max %s, out max %s], + first chunk down the tree "
      "%s); direct %s\n",
      Secs(rr.pred.total_s).c_str(), Secs(rr.pred.source_s).c_str(), Secs(rr.pred.tree_s).c_str(),
      Bytes(max_in).c_str(), Bytes(max_out).c_str(), Secs(rr.pred.latency_s).c_str(), Secs(rr.direct_s).c_str());
  for (size_t g = 0; g < rp.trees.size(); ++g) {
    const planner::RelayTree& t = rp.trees[g];
    uint64_t chunks = 0, bytes = 0;
    for (const auto& x : t.regions) chunks += x.chunks.size(), bytes += x.bytes;
    std::printf("relay group %zu     %s: %zu instance%s, root %d, degree %d, depth %d; %s per copy in %llu chunks\n", g,
                t.group.key.ToString().c_str(), t.group.instances.size(), t.group.instances.size() == 1 ? "" : "s",
                t.group.instances.front(), t.degree, t.depth, Bytes(bytes).c_str(),
                static_cast<unsigned long long>(chunks));
    std::printf("  %-18s %5s %12s %12s %12s\n", "hop", "level", "first chunk", "per chunk", "one copy");
    for (const auto& h : rr.pred.hops) {
      if (h.group != static_cast<int>(g)) continue;
      const std::string hop = absl::StrCat(HopName(h.parent), " -> ", h.child);
      std::printf("  %-18s %5d %12s %12s %12s\n", hop.c_str(), h.level,
                  absl::StrFormat("%.2f ms", h.first_s * 1e3).c_str(),
                  h.parent < 0 ? "-" : absl::StrFormat("%.3f ms", h.chunk_s * 1e3).c_str(), Secs(h.stream_s).c_str());
    }
    if (tasks) {
      for (const auto& x : t.regions)
        std::printf("  rank %d forwards %s to each child in %zu chunks\n", x.rank, Bytes(x.bytes).c_str(),
                    x.chunks.size());
    }
  }
}

nlohmann::json RelayJson(const PlanInput& in, const RelayReport& rr, const planner::CostParams& cp, bool tasks) {
  const planner::RelayPlan& rp = rr.plan;
  nlohmann::json j = {{"mode", planner::FormatRelayMode(rp.options)},
                      {"relayed", rp.relayed},
                      {"why", rp.why},
                      {"chunk_bytes", rp.options.chunk_bytes},
                      {"hop_ms", cp.relay_hop_ms},
                      {"trainer_egress_bytes", rr.pred.trainer_egress_bytes},
                      {"direct_trainer_egress_bytes", rr.direct_egress},
                      {"predicted_s", rr.pred.total_s},
                      {"direct_predicted_s", rr.direct_s},
                      {"source_s", rr.pred.source_s},
                      {"tree_s", rr.pred.tree_s},
                      {"latency_s", rr.pred.latency_s},
                      {"transfer_s", rr.pred.transfer_s}};
  nlohmann::json groups = nlohmann::json::array();
  for (size_t g = 0; g < rp.trees.size(); ++g) {
    const planner::RelayTree& t = rp.trees[g];
    nlohmann::json nodes = nlohmann::json::array();
    for (const auto& n : t.nodes)
      nodes.push_back({{"instance", n.instance}, {"parent", n.parent}, {"depth", n.depth}, {"children", n.children}});
    nlohmann::json ranks = nlohmann::json::array();
    for (const auto& x : t.regions) {
      nlohmann::json rj = {{"rank", x.rank}, {"bytes", x.bytes}, {"chunks", x.chunks.size()}};
      if (tasks) {
        nlohmann::json cj = nlohmann::json::array();
        for (const auto& c : x.chunks)
          cj.push_back({{"param", in.layouts[x.rank].params[c.param].name},
                        {"offset", c.offset},
                        {"length", c.length},
                        {"source", rp.plan.sources[c.source].trainer_rank}});
        rj["chunk_list"] = cj;
      }
      ranks.push_back(rj);
    }
    groups.push_back({{"key", t.group.key.ToString()},
                      {"instances", t.group.instances},
                      {"root", t.group.instances.front()},
                      {"degree", t.degree},
                      {"depth", t.depth},
                      {"tree", nodes},
                      {"ranks", ranks}});
  }
  j["groups"] = groups;
  nlohmann::json hops = nlohmann::json::array();
  for (const auto& h : rr.pred.hops)
    hops.push_back({{"group", h.group},
                    {"parent", h.parent},
                    {"child", h.child},
                    {"level", h.level},
                    {"chunk_s", h.chunk_s},
                    {"first_chunk_s", h.first_s},
                    {"copy_s", h.stream_s}});
  j["hops"] = hops;
  nlohmann::json nics = nlohmann::json::array();
  for (const auto& n : rr.pred.nics)
    nics.push_back({{"node", n.node},
                    {"nic", n.nic},
                    {"in_bytes", n.in_bytes},
                    {"out_bytes", n.out_bytes},
                    {"sessions", n.sessions},
                    {"time_s", n.time_s}});
  j["engine_nics"] = nics;
  const planner::RelayLinks links = planner::RelayLinksOf(in, rp.options, cp);
  j["link_model"] = LinkModelJson(links, planner::ChooseRelayShape(links));
  return j;
}

// `plan --relay auto|DEGREE`: the relay plan, its tree and per-hop times, next to the direct plan `direct` (built
// with the same options). The figures above the relay section describe what the sources execute: with a relay, the
// group roots only; the predicted time and speed-up are the relay's.
int RunRelayPlan(const std::string& model, const PlanInput& in, const WeightFormat& wf, const planner::PlanOptions& opt,
                 const planner::RelayOptions& relay, const planner::CostParams& cp, const planner::Plan& direct,
                 bool json, bool tasks) {
  const auto t0 = std::chrono::steady_clock::now();
  auto rp = planner::BuildRelayPlan(in, opt, relay);
  const double build_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (!rp.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(rp.status().message()).c_str());
    return kExitError;
  }
  RelayReport rr;
  rr.plan = *std::move(rp);
  rr.pred = planner::PredictRelay(in, rr.plan, cp);
  rr.direct_s = planner::PredictPlan(in, direct, cp).total_s;
  for (const auto& s : direct.sources) rr.direct_egress += s.bytes_out;
  const PlanInput& src_in = rr.plan.relayed ? rr.plan.roots_input : in;
  Report r = Evaluate(model, src_in, rr.plan.plan, cp, build_ms);
  if (rr.plan.relayed) {
    r.p2p.transfer_s = rr.pred.transfer_s;
    r.p2p.total_s = rr.pred.total_s;
    uint64_t max_nic = 0;
    for (const auto& n : rr.pred.nics) max_nic = std::max({max_nic, n.in_bytes, n.out_bytes});
    r.p2p.bound_s = std::max(r.p2p.bound_s, max_nic / in.cluster.nic.bytes_per_second());
  }
  if (json) {
    nlohmann::json j = ReportJson(r);
    j["strategy"] = std::string(planner::StrategyName(rr.plan.plan.strategy));
    j["trainer"] = planner::FormatTrainerSpec(in.cluster.trainer);
    j["engine"] = planner::FormatEngineSpec(in.cluster.engine);
    j["sources"] = SourcesJson(src_in, rr.plan.plan, tasks);
    j["rates"] = {{"replica_load_gbps_per_source", cp.node_load_gbps.empty() ? cp.replica_load_gbps : 0.0},
                  {"node_load_gbps", cp.node_load_gbps},
                  {"d2h_gbps", cp.d2h_gbps},
                  {"origin", cp.rates_origin.empty() ? "defaults" : cp.rates_origin},
                  {"text", RatesLine(cp)}};
    j["relay"] = RelayJson(in, rr, cp, tasks);
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    PrintTable(src_in, rr.plan.plan, r, wf, cp, tasks);
    PrintRelay(in, rr, cp, tasks);
  }
  return kExitOk;
}

}  // namespace

absl::StatusOr<WeightFormat> ParseWeightFormat(const std::string& text) {
  WeightFormat f;
  if (text == "bf16" || text == "none") return f;
  if (text == "fp8") {
    f.fp8_block = 128;
    return f;
  }
  if (text.rfind("fp8:", 0) == 0 && absl::SimpleAtoi(text.substr(4), &f.fp8_block) && f.fp8_block > 0) return f;
  return absl::InvalidArgumentError(absl::StrCat("--weights: expected bf16, fp8 or fp8:BLOCK, got '", text, "'"));
}

absl::StatusOr<PlanInput> PlanInputFromModel(const std::string& config_path, const ClusterSpec& cluster,
                                             const WeightFormat& format) {
  WSYNC_RETURN_IF_ERROR(cluster.Validate());
  auto config = replica::ModelConfig::FromFile(config_path);
  if (!config.ok()) return Annotate(config.status(), config_path);
  planner::ModelInputOptions o;
  if (format.fp8_block > 0) {
    // The trainer quantizes and sends fp8 weights with their block scales (what the engine holds).
    o.quant.mode = replica::QuantSpec::Mode::kFp8Block;
    o.quant.block_n = o.quant.block_k = format.fp8_block;
    o.format = replica::CheckpointFormat::kFp8PassThrough;
  }
  auto in = planner::BuildModelInput(*config, cluster, o);
  if (!in.ok()) return Annotate(in.status(), config_path);
  return in;
}

int RunPlanCommand(int argc, char** argv) {
  CLI::App app{"Build a weight-transfer plan and predict its cost against NCCL broadcast.", "plan"};
  app.footer(
      "Exit codes: 0 ok, 1 model or planning error, 2 bad flags.\n"
      "Example: plan --model config.json --train tp=8,pp=8,cp=4,ep=32,nodes=32 --infer instances=8,tp=32,ep=32 "
      "--nic 8x400Gbps --weights fp8:64");
  std::string model, train = "tp=1", infer = "instances=1,tp=1", nic = "8x400Gbps", strategy = "balanced";
  std::string out = "table", weights = "bf16", executor;  // default: see --executor
  std::vector<std::string> models_dirs;
  bool seed_table = false, tasks = false, no_gather = false;
  planner::CostParams cp;
  app.add_option("--model", model, "HF config.json of the model");
  app.add_option("--train", train, "trainer: tp=,pp=,cp=,ep=,etp=,nodes=,gpus= (gpus per node, default 8)");
  app.add_option("--infer", infer, "engines: instances=,tp=,ep=,dp=,nodes=");
  app.add_option("--nic", nic, "NICs per node x rate, e.g. 8x400Gbps")->capture_default_str();
  app.add_option("--strategy", strategy, "seed|balanced|local")->capture_default_str();
  app.add_option("-w,--write-out", out, "table|json")->capture_default_str();
  app.add_option("--weights", weights, "transfer format: bf16, fp8 (128 blocks) or fp8:BLOCK")->capture_default_str();
  app.add_option("--executor", executor,
                 "the executor the time is predicted for: pipelined (what wsync's source daemons run) or serial "
                 "(the seed's). Default: pipelined, with the plan built as the coordinator builds it; serial for "
                 "--seed-table");
  auto* load_opt = app.add_option("--replica-load-gbps", cp.replica_load_gbps,
                                  "CPU replica load rate per source, each source on its own (no node rates)")
                       ->capture_default_str();
  auto* d2h_opt =
      app.add_option("--d2h-gbps", cp.d2h_gbps, "GPU->host hand-over rate per source")->capture_default_str();
  std::string node_rates = "auto";
  app.add_option("--node-rates", node_rates,
                 "measured node rates: auto (the built-in bench/node result, if one was compiled in, with --executor "
                 "pipelined, i.e. wsync's source daemon, unless --replica-load-gbps is given; none with serial, the "
                 "seed's executor), builtin, none, or a bench/node result FILE")
      ->capture_default_str();
  std::string trainer_tensors = "cuda";
  app.add_option("--trainer-tensors", trainer_tensors,
                 "where the trainer's tensors are when it pushes: cuda (GPU memory, the seed's trainers) or host; "
                 "picks the measured node curve (with --weights: bf16 or FP8 pass-through)")
      ->check([](const std::string& v) {
        auto k = ParseMemoryKind(v);
        return k.ok() ? std::string() : std::string(k.status().message());
      })
      ->capture_default_str();
  app.add_option("--nvlink-gbps", cp.nvlink_gbps, "intra-node all-gather rate per GPU")->capture_default_str();
  app.add_option("--bcast-rx-gbps", cp.bcast_rx_gbps, "what one broadcast receiver absorbs")->capture_default_str();
  app.add_option("--fixed-ms", cp.fixed_ms, "fixed per-update overhead")->capture_default_str();
  app.add_option("--post-process-ms", cp.post_process_ms, "engine post-processing")->capture_default_str();
  std::string min_source_mib = planner::FormatMinSourceMib(planner::PlanOptions().min_source_bytes);
  uint64_t snap_kib = planner::PlanOptions().snap_bytes >> 10;
  app.add_option("--session-ms", cp.session_ms, "per target session of a source, per update")->capture_default_str();
  app.add_option("--min-source-mib", min_source_mib,
                 "balanced: auto (the source count per stage the cost model predicts fastest, at these rates) or N: "
                 "give a source work only if it gets at least N MiB per engine copy (0: every source); as "
                 "wsync-coordinator --min-source-mib")
      ->capture_default_str();
  app.add_option("--snap-kib", snap_kib,
                 "balanced: a cut this close (KiB) to a parameter boundary moves to it; as wsync-coordinator --snap-kib")
      ->capture_default_str();
  std::string relay = "off";
  uint64_t relay_chunk_kib = planner::RelayOptions().chunk_bytes >> 10;
  app.add_option("--relay", relay,
                 "relay plans: off (the sources write every instance: today's plan), auto (engine instances of one "
                 "layout relay to each other when the cost model predicts it faster, the degree it predicts fastest) "
                 "or DEGREE (children per relay); also prints the link-rate model's choice, what wsync-coordinator "
                 "--relay auto decides with (planner/relay_shape.h)")
      ->capture_default_str();
  app.add_option("--relay-chunk-kib", relay_chunk_kib, "relay: what a relay forwards at once (KiB)")
      ->capture_default_str();
  app.add_option("--relay-hop-ms", cp.relay_hop_ms,
                 "relay: per hop and chunk, beyond its bytes (landed, checked, "
                 "forward posted)")
      ->capture_default_str();
  app.add_flag("--no-gather", no_gather, "leave the trainer all-gather out of the prediction");
  app.add_flag("--tasks", tasks, "print every source's tasks (and push filter in json)");
  app.add_flag("--seed-table", seed_table, "reproduce the seed write-up's 8-row table in simulation");
  app.add_option("--models-dir", models_dirs, "directories holding <org>__<name>/config.json (repeatable)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? kExitOk : kExitUsage;
  }
  auto usage = [](const absl::Status& s) {
    std::fprintf(stderr, "error: %s\n", std::string(s.message()).c_str());
    return kExitUsage;
  };
  if (out != "table" && out != "json") return usage(absl::InvalidArgumentError("-w must be table or json"));
  // Without --executor the time is predicted for what wsync's source daemons run (pipelined, with the measured node
  // rates), while the plan itself is built as the coordinator builds it (its cost model: the serial executor's
  // per-source defaults), so that the plan printed is the one the coordinator would execute.
  const bool executor_given = !executor.empty();
  if (!executor_given) executor = seed_table ? "serial" : "pipelined";
  planner::CostParams coordinator_cost = cp;  // the flags' rates, before any node rates
  coordinator_cost.executor = planner::Executor::kSerial;
  if (executor == "serial") {
    cp.executor = planner::Executor::kSerial;
  } else if (executor == "pipelined") {
    cp.executor = planner::Executor::kPipelined;
  } else {
    return usage(absl::InvalidArgumentError("--executor must be serial or pipelined"));
  }
  if (node_rates == "auto")
    node_rates = cp.executor == planner::Executor::kPipelined && load_opt->count() == 0 &&
                         planner::BuiltinNodeRates().ok()
                     ? "builtin"
                     : "none";
  if (node_rates != "none") {
    if (load_opt->count() > 0)
      return usage(absl::InvalidArgumentError("--replica-load-gbps and --node-rates exclude each other"));
    auto rates = node_rates == "builtin" ? planner::BuiltinNodeRates() : planner::LoadNodeRates(node_rates);
    if (!rates.ok()) return usage(rates.status());
    auto pushed = ParseWeightFormat(weights);
    if (!pushed.ok()) return usage(pushed.status());
    const double d2h = cp.d2h_gbps;
    if (absl::Status a = planner::ApplyNodeRates(
            *rates, *ParseMemoryKind(trainer_tensors),  // checked when the flag was parsed
            pushed->fp8_block > 0 ? planner::PushedWeights::kFp8PassThrough : planner::PushedWeights::kBf16, &cp);
        !a.ok())
      return usage(a);
    if (d2h_opt->count() > 0) cp.d2h_gbps = d2h;  // the command line wins
  } else if (load_opt->count() > 0 || d2h_opt->count() > 0) {
    cp.rates_origin = "the command line";
  }
  for (double v : {cp.replica_load_gbps, cp.d2h_gbps, cp.nvlink_gbps, cp.bcast_rx_gbps}) {
    if (!(v > 0)) return usage(absl::InvalidArgumentError("rates must be positive"));
  }
  if (!(cp.session_ms >= 0)) return usage(absl::InvalidArgumentError("--session-ms must not be negative"));
  auto min_source = planner::ParseMinSourceMib(min_source_mib);
  if (!min_source.ok()) return usage(min_source.status());
  auto relay_opt = planner::ParseRelayMode(relay);
  if (!relay_opt.ok()) return usage(relay_opt.status());
  if (relay_chunk_kib == 0 || relay_chunk_kib > (uint64_t{1} << 30))
    return usage(absl::InvalidArgumentError("--relay-chunk-kib must be in [1, 2^30]"));
  relay_opt->chunk_bytes = relay_chunk_kib << 10;
  if (!(cp.relay_hop_ms >= 0)) return usage(absl::InvalidArgumentError("--relay-hop-ms must not be negative"));
  cp.include_gather = !no_gather;
  coordinator_cost.include_gather = cp.include_gather;
  if (seed_table) {
    if (models_dirs.empty()) return usage(absl::InvalidArgumentError("--seed-table needs --models-dir"));
    return RunSeedTable(models_dirs, cp, out == "json");
  }
  if (model.empty()) return usage(absl::InvalidArgumentError("--model is required"));
  auto t = planner::ParseTrainerSpec(train);
  if (!t.ok()) return usage(t.status());
  auto e = planner::ParseEngineSpec(infer);
  if (!e.ok()) return usage(e.status());
  auto n = planner::ParseNicSpec(nic);
  if (!n.ok()) return usage(n.status());
  auto st = planner::ParseStrategy(strategy);
  if (!st.ok()) return usage(st.status());
  auto wf = ParseWeightFormat(weights);
  if (!wf.ok()) return usage(wf.status());
  ClusterSpec c{*t, *e, *n};
  if (absl::Status v = c.Validate(); !v.ok()) return usage(v);

  auto in = PlanInputFromModel(model, c, *wf);
  if (!in.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(in.status().message()).c_str());
    return kExitError;
  }
  planner::PlanOptions opt;
  opt.strategy = *st;
  opt.min_source_bytes = *min_source;
  opt.cost = executor_given ? cp : coordinator_cost;
  opt.snap_bytes = snap_kib << 10;
  const auto t0 = std::chrono::steady_clock::now();
  auto plan = planner::BuildPlan(*in, opt);
  const double build_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (!plan.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(plan.status().message()).c_str());
    return kExitError;
  }
  if (relay_opt->mode != planner::RelayMode::kOff)
    return RunRelayPlan(model, *in, *wf, opt, *relay_opt, cp, *plan, out == "json", tasks);
  const std::string name = model.substr(model.find_last_of('/') == std::string::npos ? 0 : model.find_last_of('/') + 1);
  Report r = Evaluate(model, *in, *plan, cp, build_ms);
  if (out == "json") {
    nlohmann::json j = ReportJson(r);
    j["strategy"] = std::string(planner::StrategyName(plan->strategy));
    j["trainer"] = planner::FormatTrainerSpec(c.trainer);
    j["engine"] = planner::FormatEngineSpec(c.engine);
    j["sources"] = SourcesJson(*in, *plan, tasks);
    j["rates"] = {{"replica_load_gbps_per_source", cp.node_load_gbps.empty() ? cp.replica_load_gbps : 0.0},
                  {"node_load_gbps", cp.node_load_gbps},
                  {"d2h_gbps", cp.d2h_gbps},
                  {"origin", cp.rates_origin.empty() ? "defaults" : cp.rates_origin},
                  {"text", RatesLine(cp)}};
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    PrintTable(*in, *plan, r, *wf, cp, tasks);
  }
  return kExitOk;
}

}  // namespace wsync::tools
