#include "replica/model_config.h"

#include <catch2/catch.hpp>

#include "tests/replica/test_models.h"

namespace wsync::replica {
namespace {

using testing::LoadModel;

TEST_CASE("every real config parses into its family", "[replica][config]") {
  struct Want {
    const char* model;
    Family family;
  };
  for (const Want& w : {Want{"Qwen__Qwen3-0.6B", Family::kQwen3}, Want{"Qwen__Qwen3-8B", Family::kQwen3},
                        Want{"Qwen__Qwen3-30B-A3B", Family::kQwen3Moe}, Want{"Qwen__Qwen3-235B-A22B", Family::kQwen3Moe},
                        Want{"THUDM__GLM-Z1-9B-0414", Family::kGlm4},
                        Want{"deepseek-ai__DeepSeek-V3", Family::kDeepseekV2V3},
                        Want{"meta-llama__Llama-3.1-8B", Family::kLlama},
                        Want{"moonshotai__Kimi-K2-Instruct", Family::kDeepseekV2V3},
                        Want{"moonshotai__Moonlight-16B-A3B", Family::kDeepseekV2V3},
                        Want{"zai-org__GLM-4.5-Air", Family::kGlm4Moe},
                        Want{"zai-org__GLM-4.7-Flash", Family::kGlm4MoeLite}}) {
    INFO(w.model);
    ModelConfig c = LoadModel(w.model);
    CHECK(c.family == w.family);
    CHECK(c.dtype == DType::kBF16);
  }
}

TEST_CASE("config fields per family", "[replica][config]") {
  ModelConfig q = LoadModel("Qwen__Qwen3-0.6B");
  CHECK(q.hidden_size == 1024);
  CHECK(q.num_layers == 28);
  CHECK(q.num_kv_heads == 8);
  CHECK(q.head_dim == 128);
  CHECK(q.tie_word_embeddings);
  CHECK(q.qk_norm);
  CHECK_FALSE(q.attention_bias);

  ModelConfig l = LoadModel("meta-llama__Llama-3.1-8B");
  CHECK(l.head_dim == 128);  // hidden / heads: Llama has no head_dim key
  CHECK_FALSE(l.qk_norm);

  ModelConfig m = LoadModel("Qwen__Qwen3-30B-A3B");
  CHECK(m.num_experts == 128);
  CHECK(m.moe_intermediate_size == 768);
  CHECK(m.IsMoeLayer(0));
  CHECK(m.IsMoeLayer(47));

  ModelConfig g = LoadModel("THUDM__GLM-Z1-9B-0414");
  CHECK(g.attention_bias);
  CHECK(g.num_kv_heads == 2);

  ModelConfig ga = LoadModel("zai-org__GLM-4.5-Air");
  CHECK(ga.attention_bias);
  CHECK(ga.router_bias);
  CHECK(ga.router_fp32);  // Glm4MoeGate holds the router in float32
  CHECK_FALSE(ga.qk_norm);
  CHECK(ga.num_shared_experts == 1);
  CHECK(ga.first_k_dense == 1);
  CHECK_FALSE(ga.IsMoeLayer(0));
  CHECK(ga.IsMoeLayer(1));
  CHECK(ga.num_nextn_predict_layers == 1);

  ModelConfig d = LoadModel("deepseek-ai__DeepSeek-V3");
  CHECK(d.is_mla());
  CHECK(d.q_lora_rank == 1536);
  CHECK(d.kv_lora_rank == 512);
  CHECK(d.head_dim == 192);
  CHECK(d.first_k_dense == 3);
  CHECK(d.router_bias);
  CHECK_FALSE(d.router_fp32);  // DeepSeek's MoEGate: model dtype unless the config sets router_fp32
  CHECK(d.weight_block_size == std::vector<int64_t>{128, 128});

  ModelConfig ml = LoadModel("moonshotai__Moonlight-16B-A3B");
  CHECK(ml.q_lora_rank == 0);  // null in the config
  CHECK(ml.num_shared_experts == 2);
  CHECK(ml.weight_block_size.empty());

  ModelConfig f = LoadModel("zai-org__GLM-4.7-Flash");
  CHECK(f.q_lora_rank == 768);
  CHECK(f.qk_nope_head_dim == 192);
  CHECK(f.v_head_dim == 256);
  CHECK(f.router_bias);
  CHECK(f.router_fp32);  // Glm4MoeLiteGate
}

TEST_CASE("config errors are clear", "[replica][config]") {
  auto bad_arch = ModelConfig::FromJson(R"({"architectures":["MambaForCausalLM"],"hidden_size":8})");
  REQUIRE_FALSE(bad_arch.ok());
  CHECK(bad_arch.status().code() == absl::StatusCode::kUnimplemented);
  CHECK_THAT(std::string(bad_arch.status().message()), Catch::Contains("MambaForCausalLM"));

  auto missing = ModelConfig::FromJson(
      R"({"architectures":["Qwen3ForCausalLM"],"num_hidden_layers":2,"num_attention_heads":4,"vocab_size":10,
          "intermediate_size":4})");
  REQUIRE_FALSE(missing.ok());
  CHECK_THAT(std::string(missing.status().message()), Catch::Contains("'hidden_size'"));

  auto mla_missing = ModelConfig::FromJson(
      R"({"architectures":["DeepseekV3ForCausalLM"],"hidden_size":8,"num_hidden_layers":2,"num_attention_heads":4,
          "vocab_size":10,"intermediate_size":4})");
  REQUIRE_FALSE(mla_missing.ok());
  CHECK_THAT(std::string(mla_missing.status().message()), Catch::Contains("kv_lora_rank"));

  auto wrong_type = ModelConfig::FromJson(
      R"({"architectures":["LlamaForCausalLM"],"hidden_size":"8","num_hidden_layers":2,"num_attention_heads":4,
          "vocab_size":10,"intermediate_size":4})");
  REQUIRE_FALSE(wrong_type.ok());
  CHECK_THAT(std::string(wrong_type.status().message()), Catch::Contains("'hidden_size' must be an integer"));

  CHECK_FALSE(ModelConfig::FromJson("not json").ok());
  CHECK(ModelConfig::FromFile("/nonexistent/config.json").status().code() == absl::StatusCode::kNotFound);
}

TEST_CASE("RankParallelism::ForTp follows SGLang's moe_tp/ep split", "[replica][config]") {
  RankParallelism r = RankParallelism::ForTp(8, 5, 2);
  CHECK(r.moe_tp_size == 4);
  CHECK(r.ep_rank == 1);
  CHECK(r.moe_tp_rank == 1);
  CHECK(r.attn_tp_size == 8);
  CHECK(r.attn_tp_rank == 5);
  CHECK(r == RankParallelism::ForTp(8, 5, 2));
  CHECK_FALSE(r == RankParallelism::ForTp(8, 4, 2));
}

}  // namespace
}  // namespace wsync::replica
