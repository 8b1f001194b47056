// The `local` strategy: every engine byte comes from a trainer node that already holds it (Megatron shards), the
// plan gathers only what no node holds, NICs stay balanced. Expectations are computed here from the rank order and
// tensor names directly, not with the planner's own shard code.
#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <regex>
#include <string>

#include "absl/strings/match.h"
#include "planner/cost.h"
#include "planner/model_input.h"

namespace wsync::planner {
namespace {

replica::ModelConfig Load(const std::string& path) {
  auto c = replica::ModelConfig::FromFile(path);
  INFO(path << ": " << c.status().ToString());
  REQUIRE(c.ok());
  return *c;
}

PlanInput KimiSeedInput() {
  ClusterSpec c;
  c.trainer = {8, 8, 4, 32, 1, 32, 8};  // tp pp cp ep etp nodes gpus
  c.engine.instances = 8, c.engine.tp = 32, c.engine.ep = 32, c.engine.nodes = 32;
  ModelInputOptions o;
  o.quant.mode = replica::QuantSpec::Mode::kFp8Block;
  o.quant.block_n = o.quant.block_k = 64;
  o.format = replica::CheckpointFormat::kFp8PassThrough;
  auto in = BuildModelInput(Load(std::string(WSYNC_MODELS_DIR) + "/moonshotai__Kimi-K2-Instruct/config.json"), c, o);
  INFO(in.status().ToString());
  REQUIRE(in.ok());
  return *in;
}

int ExpertOf(const std::string& name) {
  static const std::regex re(R"(\.mlp\.experts\.(\d+)\.)");
  std::smatch m;
  return std::regex_search(name, m, re) ? std::stoi(m[1]) : -1;
}

TEST_CASE("local: Kimi-K2 at the seed's shapes gathers nothing and sends every expert from its EP owner",
          "[planner][local]") {
  const PlanInput in = KimiSeedInput();
  PlanOptions o;
  o.strategy = Strategy::kLocal;
  auto plan = BuildPlan(in, o);
  INFO(plan.status().ToString());
  REQUIRE(plan.ok());
  const absl::Status v = VerifyPlan(in, *plan);
  INFO(v.ToString());
  REQUIRE(v.ok());
  CHECK(plan->gather_bytes == 0);
  CHECK(plan->expert_gather_bytes == 0);
  const int S = 32;  // ranks per stage; Megatron order tp-cp-ep-dp-pp with etp=1: EP rank = index % 32
  const int per_rank = 384 / 32;
  uint64_t expert_pushed = 0;
  for (const SourcePlan& s : plan->sources) {
    const int index = s.trainer_rank % S;
    for (const PushSlice& ps : s.push_slices) {
      CHECK(ps.gather_bytes == 0);
      const int e = ExpertOf(in.hf_tensors[ps.hf].name);
      if (e < 0) continue;
      INFO(in.hf_tensors[ps.hf].name << " pushed by trainer rank " << s.trainer_rank);
      CHECK(e / per_rank == index % 32);
      expert_pushed += ps.bytes;
    }
    // Stacked expert parameters of engine rank r go out from the node of the trainer rank that is EP rank r (its
    // daemon assembles them from the owner's slices).
    for (const Task& t : s.tasks)
      for (const ParamSlice& sl : t.slices)
        if (absl::StrContains(in.layouts[t.target.rank].params[sl.param].name, ".mlp.experts.w"))
          CHECK((s.stage * S + t.target.rank) / 8 == s.node);
  }
  uint64_t expert_total = 0;
  for (const HfTensorInfo& h : in.hf_tensors)
    if (ExpertOf(h.name) >= 0) expert_total += h.bytes;
  CHECK(expert_pushed == expert_total);  // every expert byte handed over once, by its owner
  // Coverage: every target receives its whole layout.
  for (size_t k = 0; k < plan->target_bytes.size(); ++k) {
    uint64_t want = 0;
    for (const ParamInfo& p : in.layouts[k % 32].params) want += p.bytes;
    CHECK(plan->target_bytes[k] == want);
  }
  // Balance: within each stage, no source sends more than 1 % over the stage's mean (experts are pinned to their
  // owners; the dense rest evens them out).
  for (int p = 0; p < 8; ++p) {
    uint64_t mx = 0, sum = 0;
    for (int j = 0; j < S; ++j) {
      const uint64_t b = plan->sources[p * S + j].bytes_out;
      mx = std::max(mx, b), sum += b;
    }
    INFO("stage " << p << " max " << mx << " mean " << sum / S);
    CHECK(mx <= 1.01 * (static_cast<double>(sum) / S));
  }
  // The cost model's gather term is what the plan gathers: nothing.
  CostParams cp;
  cp.executor = Executor::kPipelined;
  const Prediction pr = PredictPlan(in, *plan, cp);
  CHECK(pr.gather_s == 0);
  CHECK(pr.gather_bytes == 0);
  CHECK(PredictGather(in, cp) > 4.0);  // what seed/balanced pay for the full all-gather
  // With our measured rates (docs/planner.md: bench_replica 8.29 GB/s, bench_gpu D2H 55.1 GB/s) the update is
  // NIC-bound and under 1 s with the weights in place (the seed's 884 ms post-processing comes on top).
  cp.replica_load_gbps = 8.29;
  cp.d2h_gbps = 55.1;
  const Prediction fast = PredictPlan(in, *plan, cp);
  CHECK(fast.total_s <= 1.0);
  CHECK(fast.transfer_s == Approx(fast.bound_s));
}

TEST_CASE("local: a TP/EP group spread over two nodes gathers exactly the other node's half", "[planner][local]") {
  // Trainer tp=2, ep=2 on 2 nodes of 1 GPU: node n holds TP shard n of every split tensor and the experts of EP
  // rank n. One engine of tp=1 needs everything on whichever node sends each parameter, so every split tensor and
  // every expert is gathered exactly by half (vocab 512 = 2 x 256 rows), replicated tensors not at all.
  ClusterSpec c;
  c.trainer = {2, 1, 1, 2, 1, 2, 1};
  c.engine.instances = 1, c.engine.tp = 1;
  c.nic.per_node = 1;
  auto in = BuildModelInput(Load(std::string(WSYNC_TINY_DIR) + "/qwen3-moe-tiny.json"), c);
  REQUIRE(in.ok());
  PlanOptions o;
  o.strategy = Strategy::kLocal;
  auto plan = BuildPlan(*in, o);
  REQUIRE(plan.ok());
  REQUIRE(VerifyPlan(*in, *plan).ok());
  uint64_t want = 0, want_expert = 0;
  static const std::regex split(R"((q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|embed_tokens|lm_head)\.weight$)");
  for (const HfTensorInfo& h : in->hf_tensors) {
    const bool expert = ExpertOf(h.name) >= 0;
    if (expert || std::regex_search(h.name, split)) want += h.train_bytes / 2;
    if (expert) want_expert += h.train_bytes / 2;
  }
  CHECK(want > 0);
  CHECK(plan->gather_bytes == want);
  CHECK(plan->expert_gather_bytes == want_expert);
  // A gathered piece is always one the pushing node lacks; nothing a node holds is gathered.
  for (const SourcePlan& s : plan->sources)
    for (const PushSlice& ps : s.push_slices)
      if (std::regex_search(in->hf_tensors[ps.hf].name, std::regex(R"(norm\.weight$)"))) CHECK(ps.gather_bytes == 0);
  // The prediction gathers those bytes at the NIC line rate (one GPU per node owns the whole NIC).
  CostParams cp;
  const Prediction pr = PredictPlan(*in, *plan, cp);
  uint64_t worst = 0;
  for (const SourcePlan& s : plan->sources) worst = std::max(worst, s.gather_bytes);
  CHECK(pr.gather_s == Approx(worst / c.nic.bytes_per_second()));
}

TEST_CASE("local: engine TP finer than trainer TP on one node needs no gather at all", "[planner][local]") {
  // Qwen3-30B-A3B at the seed's row 4 (trainer tp4 ep8 on 2 nodes, 2 engines of tp8 ep8) and a coarser engine
  // (tp2) on one trainer node: the node holds every shard between its ranks, so slices are assembled, not gathered.
  const auto cfg = Load(std::string(WSYNC_MODELS_DIR) + "/Qwen__Qwen3-30B-A3B/config.json");
  for (int engine_tp : {8, 2}) {
    ClusterSpec c;
    c.trainer = {4, 1, 1, 8, 1, engine_tp == 8 ? 2 : 1, 8};
    c.engine.instances = engine_tp == 8 ? 2 : 1, c.engine.tp = engine_tp, c.engine.ep = engine_tp;
    c.engine.nodes = engine_tp == 8 ? 2 : 1;
    auto in = BuildModelInput(cfg, c);
    REQUIRE(in.ok());
    PlanOptions o;
    o.strategy = Strategy::kLocal;
    auto plan = BuildPlan(*in, o);
    REQUIRE(plan.ok());
    INFO("engine tp " << engine_tp);
    REQUIRE(VerifyPlan(*in, *plan).ok());
    CHECK(plan->gather_bytes == 0);
  }
}

TEST_CASE("HeldBox follows Megatron's tp-cp-ep-dp-pp order", "[planner][local]") {
  TrainerSpec t{2, 1, 2, 4, 1, 1, 8};  // tp2 cp2 ep4: 8 ranks in one stage
  HfTensorInfo q{"q", 0, 0, 0, false, 8, 4, TrainerSplit::kRows};
  HfTensorInfo o{"o", 0, 0, 0, false, 4, 8, TrainerSplit::kCols};
  HfTensorInfo e5{"e", 0, 0, 0, true, 4, 4, TrainerSplit::kRows, 1, 1, 5};  // expert 5 of 8: EP rank 2
  for (int j = 0; j < 8; ++j) {
    INFO("rank " << j);
    CHECK(HeldBox(t, 8, q, j) == Box{(j % 2) * 4, 4, 0, 4});
    CHECK(HeldBox(t, 8, o, j) == Box{0, 4, (j % 2) * 4, 4});
    CHECK(HeldBox(t, 8, e5, j).empty() == (j % 4 != 2));
  }
  t.etp = 2, t.ep = 2;  // expert-TP inside: EP rank (j / 2) % 2, expert-TP rank j % 2
  HfTensorInfo e1{"e", 0, 0, 0, true, 4, 4, TrainerSplit::kRows, 1, 1, 1};  // expert 1 of 8: EP rank 0
  for (int j = 0; j < 8; ++j) {
    INFO("rank " << j);
    if ((j / 2) % 2 == 0) {
      CHECK(HeldBox(t, 8, e1, j) == Box{(j % 2) * 2, 2, 0, 4});
    } else {
      CHECK(HeldBox(t, 8, e1, j).empty());
    }
  }
  // GLM4's fused gate_up_proj: a TP rank holds its share of gate and its share of up.
  HfTensorInfo gu{"gate_up", 0, 0, 0, false, 8, 4, TrainerSplit::kRows, 1, 2};
  t = TrainerSpec{2, 1, 1, 1, 1, 1, 2};
  CHECK(HeldBoxes(t, 0, gu, 1) == std::vector<Box>{Box{2, 2, 0, 4}, Box{6, 2, 0, 4}});
  CHECK(HeldBox(t, 0, gu, 1).empty());
  // Vocabulary shards are multiples of 128 rows; the last one is short.
  HfTensorInfo v{"embed", 0, 0, 0, false, 300, 2, TrainerSplit::kRows, 128};
  t = TrainerSpec{2, 1, 1, 1, 1, 1, 2};
  CHECK(HeldBox(t, 0, v, 0) == Box{0, 256, 0, 2});
  CHECK(HeldBox(t, 0, v, 1) == Box{256, 44, 0, 2});
}

TEST_CASE("local refuses inputs without geometry", "[planner][local]") {
  ClusterSpec c;
  c.engine.tp = 1;
  PlanInput in;
  in.cluster = c;
  in.hf_tensors.push_back({"w", 64, 0, 64});
  in.layouts.resize(1);
  in.layouts[0].params.push_back({"w", 64, 0, {0}});
  PlanOptions o;
  o.strategy = Strategy::kLocal;
  auto plan = BuildPlan(in, o);
  REQUIRE_FALSE(plan.ok());
  CHECK(plan.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(plan.status().message(), "geometry"));
}

}  // namespace
}  // namespace wsync::planner
