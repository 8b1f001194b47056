// The CLI's config.json -> layout estimate must agree in bytes with the replica module's BuildParamTable.
#include <catch2/catch.hpp>

#include <cstdio>
#include <fstream>
#include <string>

#include "replica/model_config.h"
#include "replica/param_table.h"
#include "tools/plan_command.h"

namespace wsync::tools {
namespace {

const char* kMoe = R"({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 256, "num_hidden_layers": 4,
  "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32, "intermediate_size": 512,
  "moe_intermediate_size": 128, "num_experts": 16, "vocab_size": 1000, "torch_dtype": "bfloat16",
  "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": false})";

const char* kMla = R"({"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 256, "num_hidden_layers": 3,
  "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 512, "moe_intermediate_size": 128,
  "n_routed_experts": 16, "n_shared_experts": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
  "q_lora_rank": 192, "kv_lora_rank": 128, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
  "vocab_size": 1024, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6, "rope_theta": 10000,
  "tie_word_embeddings": false})";

void Compare(const char* json, int tp, int ep, int fp8_block) {
  char name[] = "/tmp/wsync_xcheck_XXXXXX";
  const int fd = mkstemp(name);
  REQUIRE(fd >= 0);
  close(fd);
  std::ofstream(name) << json;
  auto cfg = replica::ModelConfig::FromFile(name);
  REQUIRE(cfg.ok());
  planner::ClusterSpec c;
  c.engine.tp = tp;
  c.engine.ep = ep;
  auto in = PlanInputFromModel(name, c, {fp8_block});
  std::remove(name);
  REQUIRE(in.ok());
  replica::QuantSpec q;
  if (fp8_block > 0) q.mode = replica::QuantSpec::Mode::kFp8Block, q.block_n = q.block_k = fp8_block;
  for (int r = 0; r < tp; ++r) {
    auto table = replica::BuildParamTable(*cfg, replica::RankParallelism::ForTp(tp, r, ep), q);
    REQUIRE(table.ok());
    uint64_t want = 0, got = 0;
    for (const auto& p : table->params()) want += p.bytes;
    for (const auto& p : in->layouts[r].params) got += p.bytes;
    INFO("tp " << tp << " ep " << ep << " rank " << r << " replica params " << table->params().size()
               << " estimate params " << in->layouts[r].params.size());
    CHECK(got == want);
  }
}

TEST_CASE("layout estimate matches replica::BuildParamTable in bytes", "[planner][replica]") {
  Compare(kMoe, 4, 4, 0);
  Compare(kMoe, 8, 2, 0);
  Compare(kMla, 4, 4, 0);
  Compare(kMla, 4, 4, 32);
}

}  // namespace
}  // namespace wsync::tools
