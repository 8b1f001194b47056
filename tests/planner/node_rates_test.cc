// Measured node rates in the cost model: the result-file parser, the per-node sharing of the replica load, and the
// built-in file the coordinator and `wsyncctl plan` use.

#include "planner/node_rates.h"

#include <catch2/catch.hpp>
#include <map>

#include "planner/cost.h"
#include "planner/plan.h"
#include "synthetic.h"

namespace wsync::planner {
namespace {

constexpr const char* kGood = R"({"machine": "m16", "date": "2026-12-04", "command": "bench_node --ranks 1,4,8",
  "node_load_gbps": [[1, 6.0], [4, 20.0], [8, 32.0]], "d2h_gbps": 50.0, "baseline": {"memcpy_gbps": 40}})";

TEST_CASE("node rates: a result file is read; malformed ones are refused naming the file and the field",
          "[planner][node_rates]") {
  auto r = ParseNodeRates(kGood, "good.json");
  REQUIRE(r.ok());
  CHECK(r->machine == "m16");
  CHECK(r->node_load_gbps == std::vector<std::pair<int, double>>{{1, 6.0}, {4, 20.0}, {8, 32.0}});
  CHECK(r->d2h_gbps == 50.0);
  CHECK(r->send_gbps.empty());  // optional curves: absent, not measured
  auto full = ParseNodeRates(R"({"machine": "m", "date": "d", "command": "bench_node",
    "node_load_gbps": [[1, 6.0], [8, 32.0]], "fp8_passthrough_load_gbps": [[1, 5.0], [8, 30.0]],
    "fp8_quantize_load_gbps": [[1, 1.5], [8, 9.0]], "send_gbps": [[1, 4.0]], "cuda_load_gbps": [[8, 45.0]]})",
                             "full.json");
  REQUIRE(full.ok());
  CHECK(full->fp8_passthrough_load_gbps == std::vector<std::pair<int, double>>{{1, 5.0}, {8, 30.0}});
  CHECK(full->fp8_quantize_load_gbps == std::vector<std::pair<int, double>>{{1, 1.5}, {8, 9.0}});
  CHECK(full->send_gbps == std::vector<std::pair<int, double>>{{1, 4.0}});
  CHECK(full->cuda_load_gbps == std::vector<std::pair<int, double>>{{8, 45.0}});
  const std::map<std::string, std::string> bad = {
      {"{", "not a JSON object"},
      {R"({"date":"d","command":"c","node_load_gbps":[[1,1]]})", "\"machine\""},
      {R"({"machine":"m","date":"d","command":"c"})", "\"node_load_gbps\""},
      {R"({"machine":"m","date":"d","command":"c","node_load_gbps":[[4,2],[2,3]]})", "must increase"},
      {R"({"machine":"m","date":"d","command":"c","node_load_gbps":[[1,0]]})", "GB/s > 0"},
      {R"({"machine":"m","date":"d","command":"c","node_load_gbps":[[1,"x"]]})", "is not [ranks, GB/s]"},
      {R"({"machine":"m","date":"d","command":"c","node_load_gbps":[[1,2]],"d2h_gbps":-1})", "d2h_gbps"},
      {R"({"machine":"m","date":"d","command":"c","node_load_gbps":[[1,2]],"send_gbps":[]})", "\"send_gbps\""},
      {R"({"machine":"m","date":"d","command":"c","node_load_gbps":[[1,2]],"fp8_quantize_load_gbps":[[2,1],[1,1]]})",
       "fp8_quantize_load_gbps ranks must increase"},
      {R"({"machine":"m","date":"d","command":"c","node_load_gbps":[[1,2]],"cuda_load_gbps":[[1,-3]]})",
       "cuda_load_gbps entry"},
  };
  for (const auto& [text, why] : bad) {
    auto p = ParseNodeRates(text, "bad.json");
    INFO(text);
    REQUIRE_FALSE(p.ok());
    CHECK(p.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(p.status().message()).find("bad.json") != std::string::npos);
    CHECK(std::string(p.status().message()).find(why) != std::string::npos);
  }
  CHECK(LoadNodeRates("/nonexistent/rates.json").status().code() == absl::StatusCode::kNotFound);
}

TEST_CASE("node rates: interpolated between measured points, never extrapolated", "[planner][node_rates]") {
  CostParams cp;
  ApplyNodeRates(*ParseNodeRates(kGood, "good.json"), &cp);
  CHECK(NodeLoadGbps(cp, 1) == 6.0);
  CHECK(NodeLoadGbps(cp, 2) == Approx(6.0 + 14.0 / 3));
  CHECK(NodeLoadGbps(cp, 6) == Approx(26.0));
  CHECK(NodeLoadGbps(cp, 8) == 32.0);
  CHECK(NodeLoadGbps(cp, 16) == 32.0);  // beyond the last measurement: what was measured, not more
  CHECK(SourceLoadRate(cp, 8) == Approx(4e9));
  CHECK(MaxSourceLoadRate(cp) == Approx(6e9));
  CHECK(cp.d2h_gbps == 50.0);
  CHECK(cp.rates_origin.find("good.json") != std::string::npos);
  CostParams plain;
  CHECK(SourceLoadRate(plain, 8) == Approx(plain.replica_load_gbps * 1e9));  // the seed's: each source on its own
}

TEST_CASE("node rates: a node's active sources share its load rate", "[planner][node_rates]") {
  testing::SyntheticShape shape;  // one trainer node of 8 ranks, one engine of TP 8
  const PlanInput in = testing::MakeInput(shape);
  PlanOptions po;
  po.min_source_bytes = 0;  // every source
  auto plan = BuildPlan(in, po);
  REQUIRE(plan.ok());
  CostParams cp;
  cp.include_gather = false;
  cp.executor = Executor::kPipelined;
  ApplyNodeRates(*ParseNodeRates(kGood, "good.json"), &cp);
  int active = 0;
  for (const SourcePlan& s : plan->sources) active += s.active();
  REQUIRE(active == 8);
  const Prediction p = PredictPlan(in, *plan, cp);
  REQUIRE(p.sources.size() == 8);
  for (const SourceTime& st : p.sources) {
    const SourcePlan& sp = plan->sources[st.source];
    // 8 ranks at once: 32 GB/s for the node, 4 GB/s each.
    CHECK(st.load_s == Approx(sp.load_bytes / 4e9));
  }
  // The same sources, each loading on its own at 6 GB/s (what the seed's per-rank rate would claim): faster.
  CostParams alone = cp;
  alone.node_load_gbps.clear();
  alone.replica_load_gbps = 6.0;
  CHECK(PredictPlan(in, *plan, alone).sources[0].load_s < p.sources[0].load_s);
}

TEST_CASE("node rates: the automatic source count agrees with the built plan under node rates",
          "[planner][node_rates]") {
  // The count model (plan.cc) and PredictTransfer must share the per-node figure: the plan built with the chosen
  // count predicts no worse than every explicit count.
  for (const auto& shape : testing::CoverageShapes()) {
    const PlanInput in = testing::MakeInput(shape);
    PlanOptions po;
    po.cost.executor = Executor::kPipelined;
    po.cost.include_gather = false;
    ApplyNodeRates(*ParseNodeRates(kGood, "good.json"), &po.cost);
    auto chosen = BuildPlan(in, po);
    REQUIRE(chosen.ok());
    const double t = PredictTransfer(in, *chosen, po.cost).transfer_s;
    PlanOptions all = po;
    all.min_source_bytes = 0;
    auto every = BuildPlan(in, all);
    REQUIRE(every.ok());
    CHECK(t <= PredictTransfer(in, *every, po.cost).transfer_s * (1 + 1e-9));
  }
}

TEST_CASE("node rates: the built-in result file is valid and says where it was measured", "[planner][node_rates]") {
  auto r = BuiltinNodeRates();
  if (r.status().code() == absl::StatusCode::kNotFound) {
    // None kept in the tree: the error says what to do, and nothing else claims measured rates.
    CHECK(std::string(r.status().message()).find("bench/node/results/default.json") != std::string::npos);
    return;
  }
  REQUIRE(r.ok());
  CHECK_FALSE(r->machine.empty());
  CHECK_FALSE(r->command.empty());
  CHECK(r->origin == "bench/node/results/default.json");
  CHECK(r->node_load_gbps.size() >= 2);  // a function of ranks, not one figure
}

}  // namespace
}  // namespace wsync::planner
