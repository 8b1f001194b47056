// Adapter-only models (ModelConfig::lora_adapter): the adapter's tensors, shapes from the base config's modules,
// and the refusals the coordinator reports at attach/begin.
#include <catch2/catch.hpp>

#include "replica/layout_plan.h"
#include "replica/model_config.h"
#include "tests/replica/test_models.h"

namespace wsync::replica {
namespace {

ModelConfig WithAdapter(const char* model, int64_t r, std::vector<std::string> targets) {
  ModelConfig c = testing::LoadModel(model);
  c.lora_adapter = ModelConfig::LoraAdapter{r, std::move(targets)};
  return c;
}

RankParallelism VllmRank(int tp, int rank) {
  RankParallelism r = RankParallelism::ForTp(tp, rank);
  r.dialect = EngineDialect::kVllm;
  return r;
}

TEST_CASE("lora_adapter parses from config.json", "[replica][lora]") {
  auto c = ModelConfig::FromJson(R"({"architectures":["Qwen3ForCausalLM"],"model_type":"qwen3","hidden_size":256,
      "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":64,"intermediate_size":512,
      "vocab_size":4096,"torch_dtype":"bfloat16","lora_adapter":{"r":8,"target_modules":["q_proj","down_proj"]}})");
  REQUIRE(c.ok());
  REQUIRE(c->lora_adapter.has_value());
  CHECK(c->lora_adapter->rank == 8);
  CHECK(c->lora_adapter->target_modules == std::vector<std::string>{"q_proj", "down_proj"});
  auto bad = ModelConfig::FromJson(R"({"architectures":["Qwen3ForCausalLM"],"model_type":"qwen3","hidden_size":256,
      "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":64,"intermediate_size":512,
      "vocab_size":4096,"lora_adapter":{"r":0,"target_modules":["q_proj"]}})");
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(std::string(bad.status().message()), Catch::Contains("rank"));
}

TEST_CASE("an adapter's layout is its A/B tensors with the base modules' shapes, whole on every rank",
          "[replica][lora]") {
  // Qwen3-0.6B: hidden 1024, 16 heads x 128, 8 kv heads, intermediate 3072, 28 layers.
  ModelConfig c = WithAdapter("Qwen__Qwen3-0.6B", 16, {"down_proj", "q_proj", "v_proj", "o_proj"});
  for (int rank = 0; rank < 2; ++rank) {
    auto plan = PlanLayout(c, VllmRank(2, rank), QuantSpec{});
    REQUIRE(plan.ok());
    const auto& params = plan->table.params();
    REQUIRE(params.size() == 28u * 4 * 2);
    const std::string l3 = "base_model.model.model.layers.3.";
    auto shape = [&](const std::string& n) { return plan->table.Find(n)->shape; };
    CHECK(shape(l3 + "self_attn.q_proj.lora_A.weight") == std::vector<int64_t>{16, 1024});
    CHECK(shape(l3 + "self_attn.q_proj.lora_B.weight") == std::vector<int64_t>{2048, 16});
    CHECK(shape(l3 + "self_attn.v_proj.lora_B.weight") == std::vector<int64_t>{1024, 16});
    CHECK(shape(l3 + "self_attn.o_proj.lora_A.weight") == std::vector<int64_t>{16, 2048});
    CHECK(shape(l3 + "mlp.down_proj.lora_A.weight") == std::vector<int64_t>{16, 3072});
    CHECK(shape(l3 + "mlp.down_proj.lora_B.weight") == std::vector<int64_t>{1024, 16});
    CHECK(plan->table.Find(l3 + "self_attn.k_proj.lora_A.weight") == nullptr);
    CHECK(plan->table.Find("model.embed_tokens.weight") == nullptr);
    for (const auto& p : params) CHECK(p.dtype == DType::kBF16);
  }
  auto ck = CheckpointTensors(c);
  REQUIRE(ck.ok());
  CHECK(ck->size() == 28u * 4 * 2);
  uint64_t bytes = 0;
  for (const auto& t : *ck) bytes += t.bytes();
  // per layer: q (16*1024 + 2048*16) + v (16*1024 + 1024*16) + o (16*2048 + 1024*16) + down (16*3072 + 1024*16)
  CHECK(bytes == 28u * 2 * (16 * 1024 + 2048 * 16 + 16 * 1024 + 1024 * 16 + 16 * 2048 + 1024 * 16 + 16 * 3072 +
                            1024 * 16));
}

TEST_CASE("adapters the base model cannot take are refused with the reason", "[replica][lora]") {
  auto unknown = PlanLayout(WithAdapter("Qwen__Qwen3-0.6B", 8, {"q_proj", "qkv_projection"}), VllmRank(1, 0), {});
  REQUIRE_FALSE(unknown.ok());
  CHECK_THAT(std::string(unknown.status().message()), Catch::Contains("'qkv_projection' is not a linear layer"));
  auto moe = PlanLayout(WithAdapter("Qwen__Qwen3-30B-A3B", 8, {"q_proj"}), VllmRank(1, 0), {});
  REQUIRE_FALSE(moe.ok());
  CHECK(moe.status().code() == absl::StatusCode::kUnimplemented);
  auto sglang = PlanLayout(WithAdapter("Qwen__Qwen3-0.6B", 8, {"q_proj"}), RankParallelism::ForTp(1, 0), {});
  REQUIRE_FALSE(sglang.ok());
  CHECK_THAT(std::string(sglang.status().message()), Catch::Contains("vLLM engines only"));
  RankParallelism draft = VllmRank(1, 0);
  draft.weights = WeightSet::kDraft;
  CHECK_FALSE(PlanLayout(WithAdapter("Qwen__Qwen3-0.6B", 8, {"q_proj"}), draft, {}).ok());
}

}  // namespace
}  // namespace wsync::replica
