#include "replica/mapper.h"

#include <catch2/catch.hpp>

#include <set>

#include "absl/strings/match.h"
#include "replica/layout_plan.h"
#include "tests/replica/test_models.h"

namespace wsync::replica {
namespace {

using testing::IndexNames;
using testing::LoadModel;

HfMapping MapOk(const ParamMapper& m, const std::string& name) {
  auto r = m.Map(name);
  INFO(name << ": " << r.status().ToString());
  REQUIRE(r.ok());
  return *r;
}

TEST_CASE("stacked, expert and MLA mappings", "[replica][mapper]") {
  auto qm = ParamMapper::Create(LoadModel("Qwen__Qwen3-30B-A3B"), /*ep_size=*/4);
  REQUIRE(qm.ok());
  HfMapping k = MapOk(*qm, "model.layers.3.self_attn.k_proj.weight");
  CHECK(k.engine_name == "model.layers.3.self_attn.qkv_proj.weight");
  CHECK(k.shard_id == "k");
  CHECK(k.num_shards == 3);
  HfMapping up = MapOk(*qm, "model.layers.3.mlp.experts.77.up_proj.weight");
  CHECK(up.engine_name == "model.layers.3.mlp.experts.w13_weight");
  CHECK(up.shard_id == "w3");
  CHECK(up.num_shards == 2);
  CHECK(up.expert_id == 77);
  CHECK(up.num_local_experts == 32);
  HfMapping down = MapOk(*qm, "model.layers.3.mlp.experts.0.down_proj.weight");
  CHECK(down.engine_name == "model.layers.3.mlp.experts.w2_weight");
  CHECK(down.num_shards == 1);
  CHECK(MapOk(*qm, "model.layers.3.mlp.gate.weight").engine_name == "model.layers.3.mlp.gate.weight");
  CHECK(MapOk(*qm, "model.layers.3.self_attn.q_norm.weight").num_shards == 1);

  auto dm = ParamMapper::Create(LoadModel("deepseek-ai__DeepSeek-V3"));
  REQUIRE(dm.ok());
  HfMapping qa = MapOk(*dm, "model.layers.0.self_attn.q_a_proj.weight");
  CHECK(qa.engine_name == "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight");
  CHECK(qa.shard_id == "0");
  HfMapping kva = MapOk(*dm, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv");
  CHECK(kva.engine_name == "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight_scale_inv");
  CHECK(kva.shard_id == "1");
  CHECK(MapOk(*dm, "model.layers.5.mlp.experts.255.gate_proj.weight_scale_inv").engine_name ==
        "model.layers.5.mlp.experts.w13_weight_scale_inv");
  CHECK(MapOk(*dm, "model.layers.5.mlp.shared_experts.up_proj.weight").engine_name ==
        "model.layers.5.mlp.shared_experts.gate_up_proj.weight");
  CHECK(MapOk(*dm, "model.layers.1.mlp.gate_proj.weight").engine_name == "model.layers.1.mlp.gate_up_proj.weight");
  CHECK(MapOk(*dm, "model.layers.61.enorm.weight").skip == SkipRule::kMtpLayer);
  CHECK(MapOk(*dm, "model.layers.4.self_attn.rotary_emb.inv_freq").skip == SkipRule::kRotary);

  // Without q_lora (Moonlight) q_proj stays its own parameter and kv_a_proj_with_mqa is not fused.
  auto mm = ParamMapper::Create(LoadModel("moonshotai__Moonlight-16B-A3B"));
  REQUIRE(mm.ok());
  CHECK(MapOk(*mm, "model.layers.0.self_attn.q_proj.weight").engine_name == "model.layers.0.self_attn.q_proj.weight");
  CHECK(MapOk(*mm, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight").engine_name ==
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight");

  // GLM4 dense ships gate_up_proj fused: the name is kept (SGLang splits it by output size).
  auto gm = ParamMapper::Create(LoadModel("THUDM__GLM-Z1-9B-0414"));
  REQUIRE(gm.ok());
  HfMapping gu = MapOk(*gm, "model.layers.2.mlp.gate_up_proj.weight");
  CHECK(gu.engine_name == "model.layers.2.mlp.gate_up_proj.weight");
  CHECK(gu.num_shards == 1);
  CHECK(MapOk(*gm, "model.layers.2.self_attn.v_proj.bias").engine_name == "model.layers.2.self_attn.qkv_proj.bias");
  CHECK(MapOk(*gm, "model.layers.2.post_mlp_layernorm.weight").num_shards == 1);

  auto tied = ParamMapper::Create(LoadModel("Qwen__Qwen3-0.6B"));
  REQUIRE(tied.ok());
  CHECK(MapOk(*tied, "lm_head.weight").skip == SkipRule::kTiedHead);
}

TEST_CASE("shared-expert fusion maps shared_experts to expert n_routed", "[replica][mapper]") {
  auto m = ParamMapper::Create(LoadModel("deepseek-ai__DeepSeek-V3"), /*ep_size=*/1, /*num_fused_shared_experts=*/1);
  REQUIRE(m.ok());
  HfMapping s = MapOk(*m, "model.layers.5.mlp.shared_experts.down_proj.weight");
  CHECK(s.engine_name == "model.layers.5.mlp.experts.w2_weight");
  CHECK(s.expert_id == 256);
  CHECK(s.num_local_experts == 257);
}

TEST_CASE("mapper errors name the tensor", "[replica][mapper]") {
  auto m = ParamMapper::Create(LoadModel("Qwen__Qwen3-30B-A3B"));
  REQUIRE(m.ok());
  auto unknown = m->Map("model.layers.0.self_attn.foo_proj.weight");
  REQUIRE_FALSE(unknown.ok());
  CHECK_THAT(std::string(unknown.status().message()), Catch::Contains("model.layers.0.self_attn.foo_proj.weight"));
  auto range = m->Map("model.layers.0.mlp.experts.128.up_proj.weight");
  REQUIRE_FALSE(range.ok());
  CHECK(range.status().code() == absl::StatusCode::kOutOfRange);
  CHECK_THAT(std::string(range.status().message()), Catch::Contains("experts.128.up_proj"));
  // A dense model has no experts; a dense layer of DeepSeek neither.
  auto dm = ParamMapper::Create(LoadModel("deepseek-ai__DeepSeek-V3"));
  CHECK_FALSE(dm->Map("model.layers.0.mlp.experts.3.up_proj.weight").ok());
  CHECK_FALSE(m->Map("model.norm.bias").ok());
}

// Every index.json name maps (or is skipped by a rule), and the mapped names are exactly CheckpointTensors.
TEST_CASE("index.json names all map and equal CheckpointTensors", "[replica][mapper][models]") {
  for (const std::string& model : testing::AllModels()) {
    std::vector<std::string> names = IndexNames(model);
    if (names.empty()) continue;
    INFO(model);
    ModelConfig c = LoadModel(model);
    auto m = ParamMapper::Create(c);
    REQUIRE(m.ok());
    const bool fp8 = !c.weight_block_size.empty();
    std::set<std::string> kept, kept_bf16;
    int unmapped = 0, skipped = 0;
    for (const std::string& n : names) {
      auto r = m->Map(n);
      if (!r.ok()) {
        UNSCOPED_INFO("unmapped: " << r.status().ToString());
        ++unmapped;
        continue;
      }
      if (r->skip != SkipRule::kNone) {
        ++skipped;
        continue;
      }
      kept.insert(n);
      if (!absl::EndsWith(n, "_scale_inv")) kept_bf16.insert(n);
    }
    CHECK(unmapped == 0);
    auto list = CheckpointTensors(c, fp8 ? CheckpointFormat::kFp8PassThrough : CheckpointFormat::kTrainer);
    REQUIRE(list.ok());
    std::set<std::string> derived;
    for (const TensorSpec& t : *list) derived.insert(t.name);
    CHECK(derived.size() == list->size());  // no duplicates
    CHECK(derived == kept);
    auto trainer = CheckpointTensors(c);
    REQUIRE(trainer.ok());
    std::set<std::string> derived_bf16;
    for (const TensorSpec& t : *trainer) derived_bf16.insert(t.name);
    CHECK(derived_bf16 == kept_bf16);
  }
}

TEST_CASE("known index sizes and skip counts", "[replica][mapper][models]") {
  // DeepSeek-V3: 91,991 names, of which the MTP layer 61 is skipped.
  ModelConfig d = LoadModel("deepseek-ai__DeepSeek-V3");
  auto m = ParamMapper::Create(d);
  int mtp = 0;
  for (const std::string& n : IndexNames("deepseek-ai__DeepSeek-V3")) {
    if (m->Map(n)->skip == SkipRule::kMtpLayer) ++mtp;
  }
  CHECK(mtp > 0);
  auto list = CheckpointTensors(d, CheckpointFormat::kFp8PassThrough);
  CHECK(static_cast<int>(list->size()) + mtp == 91991);
  // Qwen3-0.6B stores lm_head although tied: 311 names, 310 pushed.
  CHECK(CheckpointTensors(LoadModel("Qwen__Qwen3-0.6B"))->size() == 310);
}

TEST_CASE("Kimi-K2 checkpoint list matches the published tensor count", "[replica][mapper][models]") {
  // The published listing counts 139,644 tensors, 61 of them rotary inv_freq (skipped by rule). By hand: layer 0
  // dense = 12 attention (5 of them scales) + 2 norms + 6 MLP = 20; layers 1-60 MoE = 12 + 2 + router 2 +
  // 384 experts x 6 + shared 6 = 2,326; + embed, norm, lm_head: 20 + 60 * 2,326 + 3 = 139,583 = 139,644 - 61.
  ModelConfig k = LoadModel("moonshotai__Kimi-K2-Instruct");
  auto fp8 = CheckpointTensors(k, CheckpointFormat::kFp8PassThrough);
  REQUIRE(fp8.ok());
  CHECK(fp8->size() + 61 == 139644);
  // Trainer format drops the scales: 8 in layer 0, 5 + 384 * 3 + 3 in each MoE layer.
  CHECK(CheckpointTensors(k)->size() == 139583 - 8 - 60 * (5 + 384 * 3 + 3));
  auto m = ParamMapper::Create(k, 32);
  REQUIRE(m.ok());
  for (const TensorSpec& t : *fp8) {
    auto r = m->Map(t.name);
    if (!r.ok()) FAIL(r.status().ToString());
    REQUIRE(r->skip == SkipRule::kNone);
  }
  CHECK(m->Map("model.layers.7.self_attn.rotary_emb.inv_freq")->skip == SkipRule::kRotary);
}

// The next-n draft (SGLang's DeepseekV3ForCausalLMNextN names; the bytes are checked against SGLang itself by
// replica_sglang_oracle_test's draft cases).
TEST_CASE("draft mapper: DeepSeek-V3's MTP layer maps to SGLang's NextN parameters", "[replica][mapper][draft]") {
  const ModelConfig c = LoadModel("deepseek-ai__DeepSeek-V3");
  CHECK(DraftLayerIndex(c) == 61);
  auto m = ParamMapper::Create(c, /*ep_size=*/1, /*num_fused_shared_experts=*/0, WeightSet::kDraft);
  INFO(m.status().ToString());
  REQUIRE(m.ok());
  CHECK(MapOk(*m, "model.layers.61.enorm.weight").engine_name == "model.enorm.weight");
  CHECK(MapOk(*m, "model.layers.61.hnorm.weight").engine_name == "model.hnorm.weight");
  CHECK(MapOk(*m, "model.layers.61.eh_proj.weight").engine_name == "model.eh_proj.weight");
  CHECK(MapOk(*m, "model.layers.61.shared_head.norm.weight").engine_name == "model.shared_head.norm.weight");
  CHECK(MapOk(*m, "model.layers.61.input_layernorm.weight").engine_name == "model.decoder.input_layernorm.weight");
  HfMapping qa = MapOk(*m, "model.layers.61.self_attn.q_a_proj.weight_scale_inv");
  CHECK(qa.engine_name == "model.decoder.self_attn.fused_qkv_a_proj_with_mqa.weight_scale_inv");
  CHECK(qa.shard_id == "0");
  CHECK(qa.num_shards == 2);
  HfMapping up = MapOk(*m, "model.layers.61.mlp.experts.255.up_proj.weight");
  CHECK(up.engine_name == "model.decoder.mlp.experts.w13_weight");
  CHECK(up.shard_id == "w3");
  CHECK(up.expert_id == 255);
  CHECK(up.num_local_experts == 256);
  CHECK(MapOk(*m, "model.layers.61.mlp.shared_experts.gate_proj.weight").engine_name ==
        "model.decoder.mlp.shared_experts.gate_up_proj.weight");
  // The draft uses the target's embedding and lm_head; the target's tensors belong to the target.
  CHECK(MapOk(*m, "model.layers.61.embed_tokens.weight").skip == SkipRule::kSharedWithTarget);
  CHECK(MapOk(*m, "model.layers.61.shared_head.head.weight").skip == SkipRule::kSharedWithTarget);
  CHECK(MapOk(*m, "model.embed_tokens.weight").skip == SkipRule::kTargetOnly);
  CHECK(MapOk(*m, "lm_head.weight").skip == SkipRule::kTargetOnly);
  CHECK(MapOk(*m, "model.layers.3.mlp.experts.7.down_proj.weight").skip == SkipRule::kTargetOnly);
  // Still an error: a name neither model has, in the draft layer or elsewhere, and an expert out of range.
  auto bad = m->Map("model.layers.61.self_attn.foo_proj.weight");
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(std::string(bad.status().message()), Catch::Contains("model.layers.61.self_attn.foo_proj.weight"));
  CHECK_FALSE(m->Map("model.layers.0.self_attn.foo_proj.weight").ok());
  CHECK(m->Map("model.layers.61.mlp.experts.256.up_proj.weight").status().code() == absl::StatusCode::kOutOfRange);
  // A target mapper is unchanged: the MTP layer is skipped.
  auto t = ParamMapper::Create(c);
  REQUIRE(t.ok());
  CHECK(MapOk(*t, "model.layers.61.self_attn.q_a_proj.weight").skip == SkipRule::kMtpLayer);
}

// Every DeepSeek-V3 index.json name of layer 61 maps under a draft mapper, the loaded ones are exactly the draft's
// CheckpointTensors (FP8 pass-through: eh_proj stays bf16), and every other name is the target's.
TEST_CASE("draft mapper: DeepSeek-V3 index.json's MTP layer equals the draft's CheckpointTensors",
          "[replica][mapper][draft][models]") {
  const ModelConfig c = LoadModel("deepseek-ai__DeepSeek-V3");
  auto m = ParamMapper::Create(c, 1, 0, WeightSet::kDraft);
  REQUIRE(m.ok());
  std::set<std::string> kept;
  int shared = 0, target = 0;
  for (const std::string& n : IndexNames("deepseek-ai__DeepSeek-V3")) {
    auto r = m->Map(n);
    INFO(n << ": " << r.status().ToString());
    REQUIRE(r.ok());
    if (r->skip == SkipRule::kSharedWithTarget) ++shared;
    if (r->skip == SkipRule::kTargetOnly) ++target;
    if (r->skip == SkipRule::kNone) {
      CHECK(absl::StartsWith(n, "model.layers.61."));
      kept.insert(n);
    }
  }
  CHECK(shared == 2);
  auto list = CheckpointTensors(c, CheckpointFormat::kFp8PassThrough, 128, 128, WeightSet::kDraft);
  REQUIRE(list.ok());
  std::set<std::string> derived;
  for (const TensorSpec& t : *list) {
    derived.insert(t.name);
    if (t.name == "model.layers.61.eh_proj.weight") CHECK(t.dtype == DType::kBF16);
  }
  CHECK(derived.size() == list->size());
  CHECK(derived == kept);
  auto target_list = CheckpointTensors(c, CheckpointFormat::kFp8PassThrough);
  REQUIRE(target_list.ok());
  CHECK(static_cast<size_t>(target) == target_list->size());
  CHECK(target_list->size() + kept.size() + shared == 91991);
}

TEST_CASE("draft mapper: GLM-4.5-Air's and GLM-4.7-Flash's next-n layer", "[replica][mapper][draft]") {
  auto g = ParamMapper::Create(LoadModel("zai-org__GLM-4.5-Air"), 1, 0, WeightSet::kDraft);
  INFO(g.status().ToString());
  REQUIRE(g.ok());
  HfMapping k = MapOk(*g, "model.layers.46.self_attn.k_proj.bias");
  CHECK(k.engine_name == "model.decoder.self_attn.qkv_proj.bias");
  CHECK(k.shard_id == "k");
  CHECK(MapOk(*g, "model.layers.46.mlp.experts.127.down_proj.weight").engine_name ==
        "model.decoder.mlp.experts.w2_weight");
  CHECK(MapOk(*g, "model.layers.46.mlp.gate.e_score_correction_bias").engine_name ==
        "model.decoder.mlp.gate.e_score_correction_bias");
  CHECK(MapOk(*g, "model.layers.46.eh_proj.weight").engine_name == "model.eh_proj.weight");
  auto f = ParamMapper::Create(LoadModel("zai-org__GLM-4.7-Flash"), 1, 0, WeightSet::kDraft);
  INFO(f.status().ToString());
  REQUIRE(f.ok());
  CHECK(MapOk(*f, "model.layers.47.self_attn.kv_a_proj_with_mqa.weight").engine_name ==
        "model.decoder.self_attn.fused_qkv_a_proj_with_mqa.weight");
}

TEST_CASE("a draft for a model without one is refused, naming the model", "[replica][mapper][draft]") {
  for (const char* model : {"moonshotai__Kimi-K2-Instruct", "Qwen__Qwen3-8B", "moonshotai__Moonlight-16B-A3B"}) {
    INFO(model);
    const ModelConfig c = LoadModel(model);
    CHECK(DraftLayerIndex(c) == -1);
    auto m = ParamMapper::Create(c, 1, 0, WeightSet::kDraft);
    REQUIRE_FALSE(m.ok());
    CHECK(m.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(m.status().message()), Catch::Contains(c.architecture));
    CHECK_THAT(std::string(m.status().message()), Catch::Contains("'" + c.model_type + "'"));
    CHECK_THAT(std::string(m.status().message()), Catch::Contains("num_nextn_predict_layers"));
    RankParallelism r = RankParallelism::ForTp(2, 0);
    r.weights = WeightSet::kDraft;
    auto plan = PlanLayout(c, r, QuantSpec{});
    CHECK(plan.status().code() == absl::StatusCode::kInvalidArgument);
    // Its target is unaffected.
    CHECK(ParamMapper::Create(c).ok());
  }
}

}  // namespace
}  // namespace wsync::replica
