// Measured node rates in the cost model: the result-file parser, the per-node sharing of the replica load, and the
// built-in file the coordinator and `wsyncctl plan` use.

#include "planner/node_rates.h"

#include <catch2/catch.hpp>
#include <fstream>
#include <map>
#include <sstream>

#include "nlohmann/json.hpp"
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
      {R"({"machine":"m","date":"d","command":"c","curves":{"bf16/gpu/ring":{"gbps":[[1,2]]}}})", "bf16/gpu/ring"},
      {R"({"machine":"m","date":"d","command":"c","curves":{"bf16/host/ring":{"gbps":[[2,2],[1,3]]}}})",
       "curves.bf16/host/ring ranks must increase"},
      {R"({"machine":"m","date":"d","command":"c","curves":{"bf16/host/ring":{"gbps":[[1,2]],"tp":0}}})", "\"tp\""},
      {R"({"machine":"m","date":"d","command":"c","curves":{}})", "non-empty object"},
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
  REQUIRE(ApplyNodeRates(*ParseNodeRates(kGood, "good.json"), TrainerTensors::kHost, PushedWeights::kBf16, &cp).ok());
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
  REQUIRE(ApplyNodeRates(*ParseNodeRates(kGood, "good.json"), TrainerTensors::kHost, PushedWeights::kBf16, &cp).ok());
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
    REQUIRE(ApplyNodeRates(*ParseNodeRates(kGood, "good.json"), TrainerTensors::kHost, PushedWeights::kBf16, &po.cost)
                .ok());
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
  // The curves the planner picks from, each a function of ranks (not one figure), each naming where it was measured.
  for (const char* name : {"bf16/host/ring", "bf16/host/placement", "bf16/cuda/placement"}) {
    INFO(name);
    REQUIRE(r->curves.count(name) == 1);
    CHECK(r->curves.at(name).gbps.size() >= 2);
    CHECK_FALSE(r->curves.at(name).source.empty());
  }
  // What `wsyncctl plan` predicts with by default (CUDA tensors, bf16): that file's bf16/cuda/placement curve, read
  // here from the file itself.
  std::ifstream f(std::string(WSYNC_SOURCE_DIR) + "/bench/node/results/default.json");
  REQUIRE(f.good());
  std::stringstream text;
  text << f.rdbuf();
  const nlohmann::json j = nlohmann::json::parse(text.str());
  CostParams cp;
  REQUIRE(ApplyNodeRates(*r, TrainerTensors::kCuda, PushedWeights::kBf16, &cp).ok());
  std::vector<std::pair<int, double>> want;
  for (const auto& p : j["curves"]["bf16/cuda/placement"]["gbps"])
    want.emplace_back(p[0].get<int>(), p[1].get<double>());
  CHECK(cp.node_load_gbps == want);
  CHECK(cp.d2h_gbps == j["d2h_gbps"].get<double>());
}

// A file whose every rate is distinct, so a prediction shows which one it used.
constexpr const char* kCurves = R"({"machine": "m16", "date": "2026-12-05", "command": "bench_node",
  "d2h_gbps": 55.0, "curves": {
  "bf16/host/ring": {"gbps": [[1, 4.5], [8, 17.5]], "tp": 8, "source": "ring.txt"},
  "bf16/host/placement": {"gbps": [[1, 7.25], [8, 25.5]], "tp": 8, "source": "place.txt"},
  "bf16/cuda/ring": {"gbps": [[1, 6.125], [8, 21.75]], "tp": 8, "source": "cuda.txt"},
  "bf16/cuda/placement": {"gbps": [[1, 53.5], [8, 53.75]], "tp": 8, "source": "cuda.txt"},
  "fp8-passthrough/cuda/placement": {"gbps": [[1, 46.25], [4, 47.125]], "tp": 8, "source": "kimi.txt"},
  "fp8-quantize/host/ring": {"gbps": [[1, 1.5]], "source": "dsv3.txt"}}})";

TEST_CASE("node rates: the curve for where the trainer's tensors are and what it pushes is the one predicted with",
          "[planner][node_rates]") {
  auto rates = ParseNodeRates(kCurves, "curves.json");
  REQUIRE(rates.ok());
  struct Want {
    TrainerTensors tensors;
    PushedWeights weights;
    std::string curve, wanted;
  };
  const std::vector<Want> wants = {
      {TrainerTensors::kCuda, PushedWeights::kBf16, "bf16/cuda/placement", ""},
      {TrainerTensors::kHost, PushedWeights::kBf16, "bf16/host/placement", ""},
      {TrainerTensors::kCuda, PushedWeights::kFp8PassThrough, "fp8-passthrough/cuda/placement", ""},
      // No host FP8 curve: host bf16 placement stands in (the same copies, no conversion), and says so.
      {TrainerTensors::kHost, PushedWeights::kFp8PassThrough, "bf16/host/placement", "fp8-passthrough/host/placement"},
  };
  // One trainer node of 8 ranks, one engine of TP 8: each source's load time is its bytes over its share of the
  // node's rate at 8 ranks, taken from the file's curve (read here from the JSON, not from the parser).
  testing::SyntheticShape shape;
  const PlanInput in = testing::MakeInput(shape);
  PlanOptions po;
  po.min_source_bytes = 0;
  auto plan = BuildPlan(in, po);
  REQUIRE(plan.ok());
  const nlohmann::json j = nlohmann::json::parse(kCurves);
  for (const Want& w : wants) {
    INFO(w.curve);
    auto c = ChooseNodeCurve(*rates, w.tensors, w.weights);
    REQUIRE(c.ok());
    CHECK(c->name == w.curve);
    CHECK(c->wanted == w.wanted);
    CostParams cp;
    cp.include_gather = false;
    cp.executor = Executor::kPipelined;
    REQUIRE(ApplyNodeRates(*rates, w.tensors, w.weights, &cp).ok());
    const nlohmann::json& points = j["curves"][w.curve]["gbps"];
    const double at8 = points.back()[1].get<double>();  // each curve here ends at R = 8, or earlier and stays flat
    CHECK(cp.rates_origin.find(w.curve) != std::string::npos);
    CHECK(cp.rates_origin.find(j["curves"][w.curve]["source"].get<std::string>()) != std::string::npos);
    CHECK(cp.rates_origin.find("m16") != std::string::npos);
    CHECK((cp.rates_origin.find("stands in for") != std::string::npos) == !w.wanted.empty());
    CHECK(cp.d2h_gbps == 55.0);
    const Prediction p = PredictPlan(in, *plan, cp);
    REQUIRE(p.sources.size() == 8);
    for (const SourceTime& st : p.sources)
      CHECK(st.load_s == Approx(plan->sources[st.source].load_bytes / (at8 * 1e9 / 8)));
  }
  // An older file's one curve stands in for everything, and says what it stands in for.
  auto old = ChooseNodeCurve(*ParseNodeRates(kGood, "good.json"), TrainerTensors::kCuda, PushedWeights::kBf16);
  REQUIRE(old.ok());
  CHECK(old->name == "node_load_gbps");
  CHECK(old->wanted == "bf16/cuda/placement");
  // Only a quantizing curve: nothing stands in for bf16 pushes.
  auto q = ParseNodeRates(R"({"machine":"m","date":"d","command":"c","curves":{"fp8-quantize/host/ring":
    {"gbps":[[1,1.5]]}}})",
                          "q.json");
  REQUIRE(q.ok());
  CHECK(ChooseNodeCurve(*q, TrainerTensors::kHost, PushedWeights::kBf16).status().code() ==
        absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace wsync::planner
