#include <catch2/catch.hpp>

#include <map>
#include <set>

#include "planner/cost.h"
#include "planner/plan.h"
#include "synthetic.h"

namespace wsync::planner {
namespace {

TEST_CASE("bound is the busiest NIC over the line rate", "[planner][cost]") {
  testing::SyntheticShape shape;
  shape.instances = 2, shape.engine_nodes = 2;
  const PlanInput in = testing::MakeInput(shape);
  auto plan = BuildPlan(in, {});
  REQUIRE(plan.ok());
  const Prediction p = PredictPlan(in, *plan, {});
  uint64_t max_nic = 0;
  for (const auto& n : plan->source_nics) max_nic = std::max(max_nic, n.bytes);
  for (const auto& n : plan->target_nics) max_nic = std::max(max_nic, n.bytes);
  CHECK(p.bound_s == Approx(max_nic / 50e9));
  CHECK(p.transfer_s >= p.bound_s);
  CHECK(p.ideal_bound_s <= p.bound_s + 1e-12);
}

TEST_CASE("serial executor pays replica loads and blocking writes; pipelined overlaps them", "[planner][cost]") {
  testing::SyntheticShape shape;  // 8 sources, 4 instances x 16 ranks: 2 layouts per source
  shape.instances = 4, shape.engine_tp = 16, shape.engine_nodes = 8;
  const PlanInput in = testing::MakeInput(shape);
  auto plan = BuildPlan(in, {});
  REQUIRE(plan.ok());
  CostParams serial;
  serial.include_gather = false;
  CostParams pipe = serial;
  pipe.executor = Executor::kPipelined;
  const Prediction a = PredictPlan(in, *plan, serial);
  const Prediction b = PredictPlan(in, *plan, pipe);
  CHECK(a.transfer_s >= b.transfer_s);
  REQUIRE(!a.sources.empty());
  const SourceTime& s = a.sources[0];
  const SourcePlan& sp = plan->sources[s.source];
  CHECK(s.load_s == Approx(sp.load_bytes / 4e9));
  CHECK(s.blocking_send_s > 0);  // the first layout's writes are waited for
  CHECK(s.session_s == Approx(sp.sessions * 1e-3));  // 1 ms per target session by default
  CHECK(s.total_s == Approx(std::max(s.load_s + s.blocking_send_s, s.nic_s) + s.session_s));
}

TEST_CASE("sessions cost on both ends: per source and per target NIC", "[planner][cost]") {
  testing::SyntheticShape shape;  // 8 sources, 2 instances x 8 ranks, one NIC per engine rank
  shape.instances = 2, shape.engine_nodes = 2;
  const PlanInput in = testing::MakeInput(shape);
  PlanOptions po;
  po.min_source_bytes = 0;
  auto plan = BuildPlan(in, po);
  REQUIRE(plan.ok());
  CostParams none;
  none.include_gather = false;
  none.session_ms = 0;
  CostParams ten = none;
  ten.session_ms = 10;
  const Prediction a = PredictPlan(in, *plan, none);
  const Prediction b = PredictPlan(in, *plan, ten);
  REQUIRE(a.sources.size() == b.sources.size());
  for (size_t k = 0; k < a.sources.size(); ++k) {
    const SourcePlan& sp = plan->sources[a.sources[k].source];
    CHECK(b.sources[k].total_s == Approx(a.sources[k].total_s + sp.sessions * 0.010));
  }
  // Every target NIC: its bytes at line rate plus 10 ms per (source, target) pair writing into it, counted here from
  // the tasks.
  std::map<std::pair<int, int>, std::set<size_t>> writers;  // target (instance, rank) -> sources writing into it
  std::map<std::pair<int, int>, uint64_t> bytes_in;
  for (size_t k = 0; k < plan->sources.size(); ++k)
    for (const Task& t : plan->sources[k].tasks) {
      writers[{t.target.instance, t.target.rank}].insert(k);
      bytes_in[{t.target.instance, t.target.rank}] += t.bytes;
    }
  double expect = 0;  // one engine rank per NIC in this shape (8 ranks, 8 NICs per node, one instance per node)
  for (const auto& [tg, w] : writers) expect = std::max(expect, bytes_in[tg] / 50e9 + w.size() * 0.010);
  CHECK(b.max_target_nic_s == Approx(expect));
  CHECK(a.max_target_nic_s < b.max_target_nic_s);
}

TEST_CASE("broadcast sends every stage's full HF tensors to every engine rank", "[planner][cost]") {
  testing::SyntheticShape shape;
  shape.pp = 2, shape.train_nodes = 2, shape.instances = 2, shape.engine_nodes = 2;
  const PlanInput in = testing::MakeInput(shape);
  uint64_t hf = 0;
  for (const auto& h : in.hf_tensors) hf += h.bytes;
  CostParams cp;
  cp.include_gather = false;
  cp.bcast_rx_gbps = 10;
  const BroadcastPrediction b = PredictBroadcast(in, cp);
  CHECK(b.bytes_per_receiver == hf);
  CHECK(b.network_bytes == hf * 16);
  CHECK(b.transfer_s == Approx(hf / 10e9));
  CHECK(b.total_s == Approx(b.transfer_s));
}

TEST_CASE("gather time follows group placement", "[planner][cost]") {
  PlanInput in;
  in.cluster.trainer.nodes = 2;
  in.cluster.trainer.ep = 16;
  in.cluster.engine.tp = 1;
  in.layouts.resize(1);
  HfTensorInfo h;
  h.name = "e";
  h.bytes = h.train_bytes = 16'000'000'000ull;
  h.expert = true;
  in.hf_tensors.push_back(h);
  CostParams cp;
  cp.nvlink_gbps = 100;
  // EP 16 over 2 nodes: 7/16 of the bytes over NVLink, 8/16 over the GPU's NIC share (50 GB/s).
  CHECK(PredictGather(in, cp) == Approx(7e9 / 100e9 + 8e9 / 50e9));
  cp.include_gather = false;
  CHECK(PredictGather(in, cp) == 0);
}

}  // namespace
}  // namespace wsync::planner
