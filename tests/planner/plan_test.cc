#include <catch2/catch.hpp>

#include <algorithm>
#include <set>

#include "planner/plan.h"
#include "synthetic.h"

namespace wsync::planner {
namespace {

using testing::MakeInput;
using testing::SyntheticShape;

Plan MustPlan(const PlanInput& in, Strategy s, PlanOptions opt = {}) {
  opt.strategy = s;
  auto p = BuildPlan(in, opt);
  REQUIRE(p.ok());
  return *std::move(p);
}

uint64_t StageCopyBytes(const PlanInput& in, int stage) {
  uint64_t b = 0;
  for (const auto& l : in.layouts)
    for (const auto& p : l.params)
      if (p.stage == stage) b += p.bytes;
  return b;
}

std::vector<SyntheticShape> Shapes() { return testing::CoverageShapes(); }

TEST_CASE("every target receives every parameter of its layout exactly once per stage", "[planner]") {
  for (const auto& shape : Shapes()) {
    const PlanInput in = MakeInput(shape);
    for (Strategy s : {Strategy::kSeed, Strategy::kBalanced}) {
      INFO("strategy " << StrategyName(s) << " sources/stage " << in.cluster.trainer.sources_per_stage()
                       << " targets " << shape.instances * shape.engine_tp);
      const Plan plan = MustPlan(in, s);
      const absl::Status v = VerifyPlan(in, plan);
      INFO(v.message());
      CHECK(v.ok());
      // Target bytes equal the layout's total bytes.
      for (uint64_t b : plan.target_bytes) {
        uint64_t want = 0;
        for (const auto& p : in.layouts[0].params) want += p.bytes;
        CHECK(b == want);
      }
    }
  }
}

TEST_CASE("no source sends a parameter of another stage or one it did not receive", "[planner]") {
  SyntheticShape shape;
  shape.train_nodes = 4, shape.pp = 2, shape.instances = 2, shape.engine_nodes = 2;
  const PlanInput in = MakeInput(shape);
  for (Strategy s : {Strategy::kSeed, Strategy::kBalanced}) {
    const Plan plan = MustPlan(in, s);
    for (const SourcePlan& src : plan.sources) {
      std::set<int> push(src.push_filter.begin(), src.push_filter.end());
      for (const Task& t : src.tasks) {
        for (const ParamSlice& sl : t.slices) {
          const ParamInfo& p = in.layouts[t.target.rank].params[sl.param];
          CHECK(p.stage == src.stage);
          for (int h : p.inputs) {
            CHECK(push.count(h) == 1);
            CHECK(in.hf_tensors[h].stage == src.stage);
          }
        }
      }
    }
    // The verifier catches a task moved to a source of another stage.
    Plan bad = plan;
    const int S = in.cluster.trainer.sources_per_stage();
    auto& from = bad.sources[0].tasks;
    REQUIRE(!from.empty());
    bad.sources[S].tasks.push_back(from.front());
    from.erase(from.begin());
    CHECK_FALSE(VerifyPlan(in, bad).ok());
  }
}

TEST_CASE("seed strategy reproduces the write-up's example mapping", "[planner][seed]") {
  // pp=4, 32 trainer ranks (8 sources per stage), 2 engines x 16 ranks:
  // src 0 -> engine rank 0 of both instances and engine rank 8 of both instances.
  SyntheticShape shape;
  shape.train_nodes = 4, shape.pp = 4, shape.instances = 2, shape.engine_tp = 16, shape.engine_nodes = 4;
  const PlanInput in = MakeInput(shape);
  const Plan plan = MustPlan(in, Strategy::kSeed);
  for (int p = 0; p < 4; ++p) {
    for (int j = 0; j < 8; ++j) {
      const SourcePlan& s = plan.sources[p * 8 + j];
      std::vector<Target> got;
      for (const Task& t : s.tasks) got.push_back(t.target);
      const std::vector<Target> want = {{0, j}, {1, j}, {0, j + 8}, {1, j + 8}};
      CHECK(got == want);
      CHECK(s.assignments.size() == 2);  // two replica loads serve four targets
    }
  }
}

TEST_CASE("seed strategy leaves sources idle or overloaded where balanced does not", "[planner][balance]") {
  SyntheticShape shape;  // 24 sources, 32 targets: the seed gives 8 sources two layouts
  shape.train_nodes = 3, shape.engine_tp = 32, shape.engine_nodes = 4;
  const PlanInput in = MakeInput(shape);
  const PlanStats seed = ComputeStats(in, MustPlan(in, Strategy::kSeed));
  const PlanStats bal = ComputeStats(in, MustPlan(in, Strategy::kBalanced));
  CHECK(seed.imbalance > 1.4);
  CHECK(bal.imbalance < 1.02);
  CHECK(bal.imbalance < seed.imbalance);
}

TEST_CASE("balanced stays within its stated bound", "[planner][balance]") {
  PlanOptions opt;
  opt.min_source_bytes = GENERATE(std::optional<uint64_t>(), std::optional<uint64_t>(64ull << 20));
  for (const auto& shape : Shapes()) {
    const PlanInput in = MakeInput(shape);
    const Plan plan = MustPlan(in, Strategy::kBalanced, opt);
    const int S = in.cluster.trainer.sources_per_stage();
    const int I = shape.instances;
    for (int p = 0; p < in.cluster.trainer.pp; ++p) {
      const uint64_t copy = StageCopyBytes(in, p);
      int used = 0;
      for (int j = 0; j < S; ++j) used += plan.sources[p * S + j].active();
      // Bound: each used source's bytes are within 2*(snap + align) per copy of its share.
      const double ideal = static_cast<double>(copy) / used;
      for (int j = 0; j < S; ++j) {
        const SourcePlan& s = plan.sources[p * S + j];
        if (!s.active()) continue;
        INFO("shape sources " << S << " stage " << p << " source " << j);
        CHECK(std::abs(static_cast<double>(s.bytes_out) / I - ideal) <=
              2.0 * (opt.snap_bytes + opt.align_bytes) + 1);
      }
      // Every source is used when each would still get min_source_bytes.
      if (opt.min_source_bytes && copy / S >= *opt.min_source_bytes) CHECK(used == S);
      // Replica loads: every parameter is loaded by one source, or two where a cut splits it.
      uint64_t load = 0;
      int splits = 0;
      for (int j = 0; j < S; ++j) {
        const SourcePlan& s = plan.sources[p * S + j];
        load += s.load_bytes;
        for (const auto& a : s.assignments)
          for (const auto& sl : a.slices) splits += (sl.offset != 0);
      }
      uint64_t max_param = 0;
      for (const auto& l : in.layouts)
        for (const auto& q : l.params) max_param = std::max(max_param, q.bytes);
      CHECK(load <= copy + static_cast<uint64_t>(splits) * max_param);
    }
  }
}

TEST_CASE("when targets outnumber sources, identical engine ranks stay on one source", "[planner][balance]") {
  SyntheticShape shape;  // 8 sources, 4 instances x 8 ranks
  shape.instances = 4, shape.engine_nodes = 4;
  const PlanInput in = MakeInput(shape);
  const Plan plan = MustPlan(in, Strategy::kBalanced);
  for (const SourcePlan& s : plan.sources) {
    REQUIRE(s.assignments.size() == 1);       // one replica layout...
    CHECK(s.sessions == 4);                   // ...serving the same rank of all 4 instances
    CHECK(s.bytes_out == 4 * s.assignments[0].bytes);
  }
}

TEST_CASE("when sources outnumber targets, a target's parameters are split so no source idles", "[planner][balance]") {
  SyntheticShape shape;  // 32 sources, 1 instance x 4 ranks
  shape.train_nodes = 4, shape.engine_tp = 4, shape.param_bytes = 32 << 20;
  const PlanInput in = MakeInput(shape);
  const Plan plan = MustPlan(in, Strategy::kBalanced);
  const PlanStats st = ComputeStats(in, plan);
  CHECK(st.sources_used == 32);
  CHECK(st.imbalance < 1.05);
  const PlanStats seed = ComputeStats(in, MustPlan(in, Strategy::kSeed));
  CHECK(seed.sources_used == 4);
}

TEST_CASE("plans are deterministic", "[planner]") {
  for (const auto& shape : Shapes()) {
    const PlanInput in = MakeInput(shape);
    for (Strategy s : {Strategy::kSeed, Strategy::kBalanced}) {
      const Plan a = MustPlan(in, s), b = MustPlan(in, s);
      REQUIRE(a.sources.size() == b.sources.size());
      for (size_t k = 0; k < a.sources.size(); ++k) {
        CHECK(a.sources[k].tasks == b.sources[k].tasks);
        CHECK(a.sources[k].push_filter == b.sources[k].push_filter);
      }
      CHECK(a.target_bytes == b.target_bytes);
    }
  }
}

void CheckSamePlan(const Plan& a, const Plan& b) {
  REQUIRE(a.sources.size() == b.sources.size());
  for (size_t k = 0; k < a.sources.size(); ++k) {
    CHECK(a.sources[k].tasks == b.sources[k].tasks);
    CHECK(a.sources[k].push_filter == b.sources[k].push_filter);
    CHECK(a.sources[k].bytes_out == b.sources[k].bytes_out);
    CHECK(a.sources[k].load_bytes == b.sources[k].load_bytes);
    CHECK(a.sources[k].sessions == b.sources[k].sessions);
  }
  CHECK(a.target_bytes == b.target_bytes);
  REQUIRE(a.source_nics.size() == b.source_nics.size());
  for (size_t k = 0; k < a.source_nics.size(); ++k) CHECK(a.source_nics[k].bytes == b.source_nics[k].bytes);
  REQUIRE(a.target_nics.size() == b.target_nics.size());
  for (size_t k = 0; k < a.target_nics.size(); ++k) CHECK(a.target_nics[k].bytes == b.target_nics[k].bytes);
}

std::vector<Task> WithoutInstance(const std::vector<Task>& tasks, int id) {
  std::vector<Task> out;
  for (const Task& t : tasks)
    if (t.target.instance != id) out.push_back(t);
  return out;
}

TEST_CASE("incremental replan equals full replan and only touches the instance's tasks", "[planner][incremental]") {
  SyntheticShape shape;
  shape.train_nodes = 4, shape.pp = 2, shape.instances = 5, shape.engine_nodes = 5;
  PlanInput in = MakeInput(shape);
  for (Strategy s : {Strategy::kBalanced, Strategy::kSeed}) {
    PlanOptions opt;
    opt.strategy = s;
    in.instances = {0, 1, 3};
    auto planner = Planner::Create(in, opt);
    REQUIRE(planner.ok());
    const Plan before = planner->plan();

    auto changed = planner->AddInstance(2);
    REQUIRE(changed.ok());
    CHECK(!changed->empty());
    PlanInput full = in;
    full.instances = {0, 1, 2, 3};
    CheckSamePlan(planner->plan(), MustPlan(full, s));
    CHECK(VerifyPlan(full, planner->plan()).ok());
    if (s == Strategy::kBalanced) {
      for (size_t k = 0; k < before.sources.size(); ++k) {
        CHECK(WithoutInstance(planner->plan().sources[k].tasks, 2) == before.sources[k].tasks);
      }
    }

    const Plan mid = planner->plan();
    REQUIRE(planner->RemoveInstance(1).ok());
    full.instances = {0, 2, 3};
    CheckSamePlan(planner->plan(), MustPlan(full, s));
    if (s == Strategy::kBalanced) {
      for (size_t k = 0; k < mid.sources.size(); ++k) {
        CHECK(planner->plan().sources[k].tasks == WithoutInstance(mid.sources[k].tasks, 1));
      }
    }
    CHECK(planner->AddInstance(2).status().code() == absl::StatusCode::kAlreadyExists);
    CHECK(planner->RemoveInstance(1).status().code() == absl::StatusCode::kNotFound);
    CHECK(planner->AddInstance(9).status().code() == absl::StatusCode::kInvalidArgument);
  }
}

TEST_CASE("invalid inputs are rejected with InvalidArgument", "[planner]") {
  PlanInput in = MakeInput(SyntheticShape{});
  in.layouts.pop_back();
  CHECK(BuildPlan(in, {}).status().code() == absl::StatusCode::kInvalidArgument);
  in = MakeInput(SyntheticShape{});
  in.layouts[0].params[0].stage = 3;
  CHECK(BuildPlan(in, {}).status().code() == absl::StatusCode::kInvalidArgument);
  in = MakeInput(SyntheticShape{});
  in.cluster.trainer.pp = 3;  // 8 ranks do not split into 3 stages
  CHECK(BuildPlan(in, {}).status().code() == absl::StatusCode::kInvalidArgument);
  in = MakeInput(SyntheticShape{});
  in.instances = {1, 0};
  CHECK(BuildPlan(in, {}).status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("cluster specs parse and reject bad text", "[planner][cli]") {
  auto t = ParseTrainerSpec("tp=8,pp=8,cp=4,ep=32,nodes=32");
  REQUIRE(t.ok());
  CHECK(t->tp == 8);
  CHECK(t->sources_per_stage() == 32);
  CHECK_FALSE(ParseTrainerSpec("tp=8,foo=1").ok());
  CHECK_FALSE(ParseTrainerSpec("tp=0").ok());
  CHECK_FALSE(ParseTrainerSpec("tp").ok());
  CHECK_FALSE(ParseTrainerSpec("tp=2,tp=4").ok());
  CHECK_FALSE(ParseTrainerSpec("").ok());
  auto e = ParseEngineSpec("instances=8,tp=32,ep=32");
  REQUIRE(e.ok());
  CHECK(e->nodes == 32);
  auto n = ParseNicSpec("8x400Gbps");
  REQUIRE(n.ok());
  CHECK(n->per_node == 8);
  CHECK(n->gbps == 400.0);
  CHECK(ParseNicSpec("4x200").ok());
  CHECK_FALSE(ParseNicSpec("400Gbps").ok());
  CHECK_FALSE(ParseNicSpec("0x400Gbps").ok());
  CHECK_FALSE(ParseNicSpec("8xfastGbps").ok());
  CHECK(ParseStrategy("seed").ok());
  CHECK_FALSE(ParseStrategy("random").ok());
}

}  // namespace
}  // namespace wsync::planner
