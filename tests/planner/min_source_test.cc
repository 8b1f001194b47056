// balanced's automatic source count (PlanOptions::min_source_bytes unset): a stage uses a source only when the cost
// model predicts the stage faster with it; --min-source-mib N still forces the byte floor. Expectations come from
// the inputs' byte counts and the NIC rate computed here, not from the planner's selection code.
#include <algorithm>
#include <catch2/catch.hpp>
#include <string>

#include "planner/cost.h"
#include "planner/model_input.h"
#include "synthetic.h"

namespace wsync::planner {
namespace {

int UsedSources(const Plan& plan) {
  int n = 0;
  for (const SourcePlan& s : plan.sources) n += s.active();
  return n;
}

Plan MustPlan(const PlanInput& in, std::optional<uint64_t> min_source, const CostParams& cp = {}) {
  PlanOptions o;
  o.min_source_bytes = min_source;
  o.cost = cp;
  auto p = BuildPlan(in, o);
  INFO(p.status().ToString());
  REQUIRE(p.ok());
  REQUIRE(VerifyPlan(in, *p).ok());
  return *p;
}

uint64_t CopyBytes(const PlanInput& in) {
  uint64_t b = 0;
  for (const LayoutInfo& l : in.layouts)
    for (const ParamInfo& p : l.params) b += p.bytes;
  return b;
}

// The emulated cluster bench's 4x4 shape (bench/cluster): 4 source nodes of one trainer rank, 4 engines at TP=2 on
// their own nodes, one NIC per node; model bench/cluster/models/qwen3-0.6b-4l (184 MiB per engine copy).
PlanInput Bench4x4(double nic_gbps) {
  auto cfg = replica::ModelConfig::FromFile(std::string(WSYNC_BENCH_MODELS_DIR) + "/qwen3-0.6b-4l/config.json");
  INFO(cfg.status().ToString());
  REQUIRE(cfg.ok());
  ClusterSpec c;
  c.trainer.nodes = 4, c.trainer.gpus_per_node = 1;
  c.engine.instances = 4, c.engine.tp = 2, c.engine.nodes = 4;
  c.nic.per_node = 1, c.nic.gbps = nic_gbps;
  auto in = BuildModelInput(*cfg, c, {});
  INFO(in.status().ToString());
  REQUIRE(in.ok());
  return *in;
}

TEST_CASE("auto: the bench's 4x4 shape uses all 4 sources and beats the 64 MiB floor", "[planner][min_source]") {
  // At the bench's measured 375 Mbit/s and at the coordinator's default --nic 1x400Gbps: both keep every source.
  for (double gbps : {0.375, 400.0}) {
    INFO("NIC " << gbps << " Gb/s");
    const PlanInput in = Bench4x4(gbps);
    const uint64_t copy = CopyBytes(in);
    REQUIRE(copy > (180ull << 20));
    REQUIRE(copy < (190ull << 20));
    const Plan autop = MustPlan(in, std::nullopt);
    const Plan floor64 = MustPlan(in, 64ull << 20);
    CHECK(UsedSources(autop) == 4);
    CHECK(UsedSources(floor64) == 3);  // ceil(184 MiB / 64 MiB): the old default
    CostParams cp;
    cp.include_gather = false;
    const Prediction pa = PredictPlan(in, autop, cp), pf = PredictPlan(in, floor64, cp);
    CHECK(pa.total_s < pf.total_s);
    if (gbps < 1) {
      // Link-bound: each source NIC carries about a quarter of the model to each of 4 engines = one copy, as does
      // every target NIC; the floor's three sources carry 4/3 of that (docs/planner.md: 4.25 s vs 5.75 s).
      const double copy_s = copy / (gbps * 1e9 / 8);
      CHECK(pa.bound_s < 1.05 * copy_s);
      CHECK(pf.bound_s > 1.3 * copy_s);
    }
  }
}

testing::SyntheticShape Tiny() {
  testing::SyntheticShape s;  // 8 sources on one node, 2 engines at TP=2: about 1 MiB per engine copy
  s.instances = 2, s.engine_tp = 2, s.engine_nodes = 1;
  s.params_per_stage = 8;
  s.param_bytes = 24 << 10;
  return s;
}

TEST_CASE("auto: a tiny model uses fewer sources than it has", "[planner][min_source]") {
  const PlanInput in = testing::MakeInput(Tiny());
  const uint64_t copy = CopyBytes(in);
  REQUIRE(copy > (900ull << 10));
  REQUIRE(copy < (1200ull << 10));
  CostParams cp;
  cp.include_gather = false;
  const Plan autop = MustPlan(in, std::nullopt);
  const Plan every = MustPlan(in, 0);
  CHECK(UsedSources(every) == 8);
  CHECK(UsedSources(autop) < 8);
  CHECK(UsedSources(autop) >= 1);
  // The choice is the cheaper one by the same cost model.
  CHECK(PredictPlan(in, autop, cp).total_s < PredictPlan(in, every, cp).total_s);
  // Without a per-session cost nothing argues against a source: every one that gets bytes is used.
  CostParams free = cp;
  free.session_ms = 0;
  CHECK(UsedSources(MustPlan(in, std::nullopt, free)) == UsedSources(every));
  // Large shares keep every source (64 MiB per parameter: seconds of load per source).
  testing::SyntheticShape big = Tiny();
  big.param_bytes = 64ull << 20;
  CHECK(UsedSources(MustPlan(testing::MakeInput(big), std::nullopt)) == 8);
}

// Where auto keeps every source, its plan is the one every-source planning builds: same cuts, tasks, push filters and
// figures, whether all configured instances are active or a subset (the evaluation's work is reused only when it
// is the same plan).
TEST_CASE("auto with every source kept equals --min-source-mib 0", "[planner][min_source]") {
  testing::SyntheticShape shapes[3];
  shapes[0].instances = 4, shapes[0].engine_nodes = 4;                   // 8 sources, 4 x TP8
  shapes[1].pp = 2, shapes[1].train_nodes = 2, shapes[1].instances = 2;  // 2 stages
  shapes[1].engine_nodes = 2;
  shapes[2].pp = 2, shapes[2].nics = 1, shapes[2].instances = 2;  // stages share a NIC
  shapes[2].engine_nodes = 2;
  for (const auto& shape : shapes) {
    for (bool subset : {false, true}) {
      PlanInput in = testing::MakeInput(shape);
      if (subset) in.instances = {1};
      const Plan a = MustPlan(in, std::nullopt), b = MustPlan(in, 0);
      REQUIRE(UsedSources(a) == static_cast<int>(a.sources.size()));
      REQUIRE(a.sources.size() == b.sources.size());
      for (size_t k = 0; k < a.sources.size(); ++k) {
        INFO("pp " << shape.pp << " nics " << shape.nics << " subset " << subset << " source " << k);
        CHECK(a.sources[k].assignments == b.sources[k].assignments);
        CHECK(a.sources[k].tasks == b.sources[k].tasks);
        CHECK(a.sources[k].push_filter == b.sources[k].push_filter);
        CHECK(a.sources[k].bytes_out == b.sources[k].bytes_out);
        CHECK(a.sources[k].load_bytes == b.sources[k].load_bytes);
        CHECK(a.sources[k].sessions == b.sources[k].sessions);
        CHECK(a.sources[k].trainer_rank == b.sources[k].trainer_rank);
      }
      CHECK(a.target_bytes == b.target_bytes);
    }
  }
}

TEST_CASE("explicit --min-source-mib still sets the floor", "[planner][min_source]") {
  testing::SyntheticShape s;  // 8 sources, one engine at TP=8
  s.params_per_stage = 4;
  s.param_bytes = 4ull << 20;
  const PlanInput in = testing::MakeInput(s);
  const uint64_t copy = CopyBytes(in);
  for (uint64_t mib : {16, 40, 100, 1000}) {
    INFO(mib << " MiB, copy " << copy);
    const uint64_t m = mib << 20;
    const int expect = static_cast<int>(std::min<uint64_t>(8, std::max<uint64_t>(1, (copy + m - 1) / m)));
    CHECK(UsedSources(MustPlan(in, m)) == expect);
  }
  CHECK(UsedSources(MustPlan(in, 0)) == 8);
}

// The exhaustive choice, computed here: every count u of every stage, the stage planned on its own with u sources
// (BuildStagePlan: the plan is cut, materialized and accounted) and predicted by the cost model on that plan
// (PredictTransfer); the fewest sources with the lowest (transfer, slowest source). The planner instead computes
// each count's figure from the cut alone and stops scanning at a lower bound; both must agree: the chosen counts,
// the sources BuildPlan uses, and (every_figure) each count's figure to the bit.
void CheckExhaustive(const PlanInput& in, const CostParams& cp, bool every_figure) {
  PlanOptions o;
  o.cost = cp;
  auto counts = AutoSourceCounts(in, o);
  INFO(counts.status().ToString());
  REQUIRE(counts.ok());
  const Plan plan = MustPlan(in, std::nullopt, cp);
  const int pp = in.cluster.trainer.pp, S = in.cluster.trainer.sources_per_stage();
  REQUIRE(static_cast<int>(counts->size()) == pp);
  for (int p = 0; p < pp; ++p) {
    int best_u = 0;
    double best_t = 0, best_s = 0;
    for (int u = 1; u <= S; ++u) {
      auto stage = BuildStagePlan(in, o, p, u);
      REQUIRE(stage.ok());
      const Prediction pr = PredictTransfer(in, *stage, cp);
      double slowest = 0;
      for (const SourceTime& st : pr.sources) slowest = std::max(slowest, st.total_s);
      if (best_u == 0 || pr.transfer_s < best_t || (pr.transfer_s == best_t && slowest < best_s)) {
        best_u = u, best_t = pr.transfer_s, best_s = slowest;
      }
      if (every_figure) {
        auto fig = PredictStageCount(in, o, p, u);
        REQUIRE(fig.ok());
        INFO("stage " << p << " count " << u);
        CHECK(fig->transfer_s == pr.transfer_s);
        CHECK(fig->sources_s == slowest);
      }
    }
    INFO("stage " << p << " of " << pp << ", " << S << " sources");
    CHECK((*counts)[p] == best_u);
    int active = 0;
    for (int j = 0; j < S; ++j) active += plan.sources[p * S + j].active();
    CHECK(active == best_u);
  }
}

// Zero-byte parameters (given to the stage's first source) on a rank inside and one after its segment.
PlanInput WithEmptyParams(PlanInput in) {
  in.layouts[1].params[3].bytes = 0;
  in.layouts.back().params.back().bytes = 0;
  return in;
}

TEST_CASE("auto: the chosen count is the exhaustive choice on the test shapes", "[planner][min_source]") {
  CostParams serial, pipelined, slow, node;
  pipelined.executor = Executor::kPipelined;
  slow.session_ms = 40;  // sessions weigh more: fewer sources win on more shapes
  // wsync's daemon: a node's ranks share its measured load rate (here one that barely grows with ranks, so the
  // node's sources compete for it and fewer sources can win).
  node.executor = Executor::kPipelined;
  node.node_load_gbps = {{1, 2.0}, {4, 3.0}, {8, 3.5}};
  for (const CostParams& cp : {serial, pipelined, slow, node}) {
    INFO("executor " << (cp.executor == Executor::kSerial ? "serial" : "pipelined") << " session " << cp.session_ms);
    int n = 0;
    for (const auto& shape : testing::CoverageShapes()) {
      INFO("coverage shape " << n++);
      CheckExhaustive(testing::MakeInput(shape), cp, true);
    }
    CheckExhaustive(Bench4x4(0.375), cp, true);
    CheckExhaustive(Bench4x4(400), cp, true);
    CheckExhaustive(testing::MakeInput(Tiny()), cp, true);
    CheckExhaustive(WithEmptyParams(testing::MakeInput(Tiny())), cp, true);
    testing::SyntheticShape big = Tiny();
    big.param_bytes = 64ull << 20;
    CheckExhaustive(testing::MakeInput(big), cp, true);
    testing::SyntheticShape shared[2];  // stages sharing NICs; 2 GPUs per NIC
    shared[0].pp = 2, shared[0].nics = 1, shared[0].instances = 2, shared[0].engine_nodes = 2;
    shared[1].nics = 4, shared[1].params_per_stage = 6, shared[1].param_bytes = 64 << 10;
    for (const auto& shape : shared) CheckExhaustive(testing::MakeInput(shape), cp, true);
  }
}

// bench_planner's shapes: Kimi-K2 (fp8, 64-blocks) from 256 trainer ranks (TP8 PP8 CP4 EP32, 32 nodes) into
// 8 x TP32 engines, and from 192 (CP3 EP24, 24 nodes) into one TP32 engine; 8x400 Gb/s NICs.
PlanInput KimiBench(bool uneven) {
  auto cfg =
      replica::ModelConfig::FromFile(std::string(WSYNC_MODELS_DIR) + "/moonshotai__Kimi-K2-Instruct/config.json");
  INFO(cfg.status().ToString());
  REQUIRE(cfg.ok());
  ClusterSpec c;
  c.trainer = uneven ? TrainerSpec{8, 8, 3, 24, 1, 24, 8} : TrainerSpec{8, 8, 4, 32, 1, 32, 8};
  c.engine.instances = uneven ? 1 : 8, c.engine.tp = 32, c.engine.ep = 32, c.engine.nodes = uneven ? 4 : 32;
  c.nic.per_node = 8, c.nic.gbps = 400;
  ModelInputOptions o;
  o.quant.mode = replica::QuantSpec::Mode::kFp8Block;
  o.quant.block_n = o.quant.block_k = 64;
  o.format = replica::CheckpointFormat::kFp8PassThrough;
  auto in = BuildModelInput(*cfg, c, o);
  INFO(in.status().ToString());
  REQUIRE(in.ok());
  return *in;
}

TEST_CASE("auto: the chosen count is the exhaustive choice on the bench's Kimi-K2 shapes", "[planner][min_source]") {
  for (bool uneven : {false, true}) {
    INFO((uneven ? "192x32" : "256x256"));
    CheckExhaustive(KimiBench(uneven), {}, false);
  }
}

TEST_CASE("--min-source-mib parses auto or MiB and names itself on bad input", "[planner][min_source]") {
  CHECK(!ParseMinSourceMib("auto")->has_value());
  CHECK(!ParseMinSourceMib("AUTO")->has_value());
  CHECK(**ParseMinSourceMib("0") == 0);
  CHECK(**ParseMinSourceMib("64") == (64ull << 20));
  for (const char* bad : {"", "-1", "64MiB", "1.5", "99999999999999999999"}) {
    auto r = ParseMinSourceMib(bad);
    INFO(bad);
    REQUIRE(!r.ok());
    CHECK(std::string(r.status().message()).find("--min-source-mib") != std::string::npos);
  }
  CHECK(FormatMinSourceMib(std::nullopt) == "auto");
  CHECK(FormatMinSourceMib(64ull << 20) == "64");
}

}  // namespace
}  // namespace wsync::planner
