// The planner's model input comes from replica/'s layout walk: every engine parameter of every rank, with its bytes
// and the checkpoint tensors it is loaded from, and PP stages split as documented.
#include <catch2/catch.hpp>

#include <map>
#include <set>
#include <string>

#include "planner/model_input.h"
#include "replica/param_table.h"

namespace wsync::planner {
namespace {

replica::ModelConfig Load(const std::string& name) {
  auto c = replica::ModelConfig::FromFile(std::string(WSYNC_MODELS_DIR) + "/" + name + "/config.json");
  REQUIRE(c.ok());
  return *c;
}

ClusterSpec Cluster(int pp, int tp, int ep = 1, int dp = 1) {
  ClusterSpec c;
  c.trainer.pp = pp;
  c.trainer.nodes = 1;
  c.trainer.gpus_per_node = 2 * pp;
  c.engine.tp = tp;
  c.engine.ep = ep;
  c.engine.dp_attention = dp;
  return c;
}

// Every rank's layout lists exactly BuildParamTable's parameters (names, order, bytes) for the same parallelism.
void CheckAgainstTables(const replica::ModelConfig& cfg, const ClusterSpec& c, const replica::QuantSpec& q) {
  ModelInputOptions o;
  o.quant = q;
  auto in = BuildModelInput(cfg, c, o);
  INFO(in.status().ToString());
  REQUIRE(in.ok());
  REQUIRE(in->layouts.size() == static_cast<size_t>(c.engine.tp));
  for (int r = 0; r < c.engine.tp; ++r) {
    auto table = replica::BuildParamTable(cfg, EngineRankParallelism(c.engine, r), q);
    REQUIRE(table.ok());
    const auto& params = in->layouts[r].params;
    REQUIRE(params.size() == table->params().size());
    for (size_t i = 0; i < params.size(); ++i) {
      INFO("rank " << r << " param " << params[i].name);
      CHECK(params[i].name == table->params()[i].name);
      CHECK(params[i].bytes == table->params()[i].bytes);
      CHECK_FALSE(params[i].inputs.empty());
    }
  }
}

TEST_CASE("model input: layouts are the replica's tables", "[planner][model]") {
  replica::QuantSpec none;
  CheckAgainstTables(Load("Qwen__Qwen3-0.6B"), Cluster(1, 2), none);
  CheckAgainstTables(Load("Qwen__Qwen3-30B-A3B"), Cluster(2, 4, 2), none);
  CheckAgainstTables(Load("deepseek-ai__DeepSeek-V3"), Cluster(1, 8, 8), none);
  replica::QuantSpec fp8;
  fp8.mode = replica::QuantSpec::Mode::kFp8Block;
  CheckAgainstTables(Load("deepseek-ai__DeepSeek-V3"), Cluster(1, 8, 8), fp8);
}

TEST_CASE("model input: inputs, stages and expert flags", "[planner][model]") {
  const auto cfg = Load("Qwen__Qwen3-30B-A3B");
  auto in = BuildModelInput(cfg, Cluster(2, 2, 2));
  REQUIRE(in.ok());
  std::map<std::string, int> hf;
  for (size_t i = 0; i < in->hf_tensors.size(); ++i) hf[in->hf_tensors[i].name] = static_cast<int>(i);
  const int layers = static_cast<int>(cfg.num_layers);
  // Stages: layers [0, L/2) on stage 0, the rest on stage 1; embeddings first, head and final norm last.
  CHECK(in->hf_tensors[hf.at("model.embed_tokens.weight")].stage == 0);
  CHECK(in->hf_tensors[hf.at("lm_head.weight")].stage == 1);
  CHECK(in->hf_tensors[hf.at("model.norm.weight")].stage == 1);
  CHECK(in->hf_tensors[hf.at("model.layers.0.self_attn.q_proj.weight")].stage == 0);
  CHECK(in->hf_tensors[hf.at("model.layers." + std::to_string(layers / 2 - 1) + ".self_attn.q_proj.weight")].stage == 0);
  CHECK(in->hf_tensors[hf.at("model.layers." + std::to_string(layers / 2) + ".self_attn.q_proj.weight")].stage == 1);
  CHECK(in->hf_tensors[hf.at("model.layers.0.mlp.experts.5.up_proj.weight")].expert);
  CHECK_FALSE(in->hf_tensors[hf.at("model.layers.0.mlp.gate.weight")].expert);
  // qkv_proj is loaded from q, k and v; EP rank 1 (engine rank 1 at tp2 ep2) holds the second half of the experts.
  std::map<std::string, const ParamInfo*> r1;
  for (const auto& p : in->layouts[1].params) r1[p.name] = &p;
  std::set<std::string> qkv;
  for (int i : r1.at("model.layers.3.self_attn.qkv_proj.weight")->inputs) qkv.insert(in->hf_tensors[i].name);
  CHECK(qkv == std::set<std::string>{"model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
                                     "model.layers.3.self_attn.v_proj.weight"});
  const auto* w13 = r1.at("model.layers.3.mlp.experts.w13_weight");
  CHECK(w13->inputs.size() == static_cast<size_t>(cfg.num_experts));  // gate and up of E/2 experts
  for (int i : w13->inputs) {
    const std::string& n = in->hf_tensors[i].name;
    const int e = std::stoi(n.substr(n.find("experts.") + 8));
    CHECK(e >= cfg.num_experts / 2);
  }
  // Trainer bytes (the all-gather's) equal transfer bytes in bf16.
  for (const auto& h : in->hf_tensors) CHECK(h.train_bytes == h.bytes);
}

TEST_CASE("model input: bad parallelism is an error naming the rank", "[planner][model]") {
  auto in = BuildModelInput(Load("Qwen__Qwen3-30B-A3B"), Cluster(1, 4, 3));
  REQUIRE_FALSE(in.ok());
}

}  // namespace
}  // namespace wsync::planner
