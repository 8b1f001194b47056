// Relay plans on a real model's layouts: Kimi-K2 (FP8 64x64, every engine rank's parameter table from replica/) at
// the seed's trainer shape, 8 and 32 engine instances, at the cost model's default rates (wsync's pipelined
// executor, per-source replica loads: no measured node rates, so the figures do not move with a result file).

#include <catch2/catch.hpp>
#include <string>

#include "planner/cost.h"
#include "planner/model_input.h"
#include "planner/relay.h"

namespace wsync::planner {
namespace {

PlanInput Kimi(int instances) {
  auto cfg =
      replica::ModelConfig::FromFile(std::string(WSYNC_MODELS_DIR) + "/moonshotai__Kimi-K2-Instruct/config.json");
  INFO(cfg.status().ToString());
  REQUIRE(cfg.ok());
  ClusterSpec c;
  c.trainer = {8, 8, 4, 32, 1, 32, 8};  // tp pp cp ep etp nodes gpus
  c.engine.instances = instances, c.engine.tp = 32, c.engine.ep = 32, c.engine.nodes = instances * 32 / 8;
  ModelInputOptions o;
  o.quant.mode = replica::QuantSpec::Mode::kFp8Block;
  o.quant.block_n = o.quant.block_k = 64;
  o.format = replica::CheckpointFormat::kFp8PassThrough;
  auto in = BuildModelInput(*cfg, c, o);
  INFO(in.status().ToString());
  REQUIRE(in.ok());
  return *in;
}

uint64_t CopyBytes(const PlanInput& in) {
  uint64_t b = 0;
  for (const auto& l : in.layouts)
    for (const auto& p : l.params) b += p.bytes;
  return b;
}

TEST_CASE("relay: Kimi-K2 at 8 and 32 instances, one copy from the trainer", "[planner][relay]") {
  PlanOptions opt;
  opt.strategy = Strategy::kLocal;
  opt.cost.executor = Executor::kPipelined;
  PlanInput one = Kimi(8);
  one.instances = {0};
  const double single = PredictPlan(one, *BuildPlan(one, opt), opt.cost).total_s;
  for (int n : {8, 32}) {
    INFO(n << " instances");
    const PlanInput in = Kimi(n);
    RelayOptions chain;
    chain.mode = RelayMode::kDegree;
    chain.degree = 1;
    auto rp = BuildRelayPlan(in, opt, chain);
    REQUIRE(rp.ok());
    REQUIRE(rp->relayed);
    const absl::Status v = VerifyRelayPlan(in, *rp);
    INFO(v.message());
    CHECK(v.ok());
    CHECK(rp->trainer_egress_bytes == CopyBytes(in));
    CHECK(rp->trees[0].depth == n - 1);
    const RelayPrediction pr = PredictRelay(in, *rp, opt.cost);
    auto direct = BuildPlan(in, opt);
    REQUIRE(direct.ok());
    const double direct_s = PredictPlan(in, *direct, opt.cost).total_s;
    INFO("one instance " << single << " s, relay " << pr.total_s << " s, direct " << direct_s << " s");
    CHECK(pr.total_s <= 1.15 * single);
    if (n == 32) {
      // 32 copies over the trainer's links bind the direct plan; auto relays.
      CHECK(direct_s > 2 * single);
      RelayOptions a;
      a.mode = RelayMode::kAuto;
      auto ap = BuildRelayPlan(in, opt, a);
      REQUIRE(ap.ok());
      CHECK(ap->relayed);
      CHECK(PredictRelay(in, *ap, opt.cost).total_s < direct_s);
    }
  }
}

}  // namespace
}  // namespace wsync::planner
