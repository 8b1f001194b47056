#include "replica/param_table.h"

#include <catch2/catch.hpp>

#include <map>

#include "absl/strings/match.h"
#include "replica/layout_plan.h"
#include "tests/replica/test_models.h"

namespace wsync::replica {
namespace {

using testing::LoadModel;
using Shape = std::vector<int64_t>;

Shape ShapeOf(const ParamTable& t, const std::string& name) {
  const EngineParam* p = t.Find(name);
  if (p == nullptr) return {-1};
  return p->shape;
}

TEST_CASE("tiny Qwen3 tables at tp=2 and tp=4 (hand-computed)", "[replica][table]") {
  ModelConfig c = testing::TinyQwen3();
  auto t2 = BuildParamTable(c, RankParallelism::ForTp(2, 1), {});
  REQUIRE(t2.ok());
  // 4 heads / 2 = 2 q heads, 2 KV heads / 2 = 1 each: (2 + 1 + 1) * head_dim 2 = 8 rows.
  CHECK(ShapeOf(*t2, "model.layers.0.self_attn.qkv_proj.weight") == Shape{8, 8});
  CHECK(ShapeOf(*t2, "model.layers.0.self_attn.o_proj.weight") == Shape{8, 4});
  CHECK(ShapeOf(*t2, "model.layers.1.self_attn.q_norm.weight") == Shape{2});
  CHECK(ShapeOf(*t2, "model.layers.1.mlp.gate_up_proj.weight") == Shape{4, 8});
  CHECK(ShapeOf(*t2, "model.layers.1.mlp.down_proj.weight") == Shape{8, 2});
  CHECK(ShapeOf(*t2, "model.embed_tokens.weight") == Shape{64, 8});  // vocab 100 → 128 padded, / 2
  CHECK(ShapeOf(*t2, "lm_head.weight") == Shape{64, 8});
  CHECK(ShapeOf(*t2, "model.norm.weight") == Shape{8});
  // Per layer: qkv, o, q_norm, k_norm, gate_up, down, 2 norms = 8; + embed, norm, lm_head.
  CHECK(t2->params().size() == 2 * 8 + 3);

  auto t4 = BuildParamTable(c, RankParallelism::ForTp(4, 3), {});
  REQUIRE(t4.ok());
  // 1 q head, KV replicated: 1 k head + 1 v head → 3 heads * 2.
  CHECK(ShapeOf(*t4, "model.layers.0.self_attn.qkv_proj.weight") == Shape{6, 8});
  CHECK(ShapeOf(*t4, "model.layers.0.self_attn.o_proj.weight") == Shape{8, 2});
  CHECK(ShapeOf(*t4, "model.layers.0.mlp.down_proj.weight") == Shape{8, 1});
  CHECK(ShapeOf(*t4, "model.embed_tokens.weight") == Shape{32, 8});

  uint64_t end = 0;
  for (const EngineParam& p : t4->params()) {
    CHECK(p.offset % 64 == 0);
    CHECK(p.offset >= end);
    end = p.offset + p.bytes;
    CHECK(p.dtype == DType::kBF16);
  }
  CHECK(t4->total_bytes() == end);

  auto tied = BuildParamTable(testing::TinyQwen3(/*tied=*/true), RankParallelism::ForTp(2, 0), {});
  REQUIRE(tied.ok());
  CHECK(tied->Find("lm_head.weight") == nullptr);
  CHECK(tied->IndexOf("lm_head.weight") == -1);
}

TEST_CASE("tiny DeepSeek FP8 table (hand-computed)", "[replica][table][fp8]") {
  QuantSpec q;
  q.mode = QuantSpec::Mode::kFp8Block;
  q.block_n = q.block_k = 2;
  auto t = BuildParamTable(testing::TinyDeepseek(), RankParallelism::ForTp(2, 1), q);
  REQUIRE(t.ok());
  const std::string a = "model.layers.1.self_attn.";
  // q_lora 4 + kv_lora 4 + rope 2 rows, replicated.
  CHECK(ShapeOf(*t, a + "fused_qkv_a_proj_with_mqa.weight") == Shape{10, 8});
  CHECK(t->Find(a + "fused_qkv_a_proj_with_mqa.weight")->dtype == DType::kF8E4M3);
  CHECK(ShapeOf(*t, a + "fused_qkv_a_proj_with_mqa.weight_scale_inv") == Shape{5, 4});
  CHECK(t->Find(a + "fused_qkv_a_proj_with_mqa.weight_scale_inv")->dtype == DType::kF32);
  CHECK(ShapeOf(*t, a + "q_b_proj.weight") == Shape{8, 4});  // 2 local heads * (nope 2 + rope 2)
  CHECK(ShapeOf(*t, a + "kv_b_proj.weight") == Shape{8, 4});  // 2 local heads * (nope 2 + v 2)
  CHECK(ShapeOf(*t, a + "o_proj.weight") == Shape{8, 4});
  CHECK(ShapeOf(*t, a + "q_a_layernorm.weight") == Shape{4});
  CHECK(t->Find(a + "q_a_layernorm.weight")->dtype == DType::kBF16);
  CHECK(ShapeOf(*t, a + "kv_a_layernorm.weight") == Shape{4});
  const std::string m = "model.layers.1.mlp.";
  CHECK(ShapeOf(*t, m + "experts.w13_weight") == Shape{4, 4, 8});  // 4 experts, 2 * (4 / moe_tp 2)
  CHECK(ShapeOf(*t, m + "experts.w13_weight_scale_inv") == Shape{4, 2, 4});
  CHECK(ShapeOf(*t, m + "experts.w2_weight") == Shape{4, 8, 2});
  CHECK(ShapeOf(*t, m + "experts.w2_weight_scale_inv") == Shape{4, 4, 1});
  CHECK(ShapeOf(*t, m + "gate.weight") == Shape{4, 8});
  CHECK(t->Find(m + "gate.weight")->dtype == DType::kBF16);
  CHECK(t->Find(m + "gate.weight_scale_inv") == nullptr);
  CHECK(t->Find(m + "gate.e_score_correction_bias")->dtype == DType::kF32);
  CHECK(ShapeOf(*t, m + "shared_experts.gate_up_proj.weight") == Shape{4, 8});
  CHECK(ShapeOf(*t, "model.layers.0.mlp.gate_up_proj.weight_scale_inv") == Shape{4, 4});
  CHECK(t->Find("model.embed_tokens.weight")->dtype == DType::kBF16);
  CHECK(t->Find("lm_head.weight_scale_inv") == nullptr);

  // Without q_lora: q_proj and kv_a_proj_with_mqa are separate.
  auto nq = BuildParamTable(testing::TinyDeepseek(false), RankParallelism::ForTp(2, 0), {});
  REQUIRE(nq.ok());
  CHECK(ShapeOf(*nq, a + "q_proj.weight") == Shape{8, 8});
  CHECK(ShapeOf(*nq, a + "kv_a_proj_with_mqa.weight") == Shape{6, 8});
  CHECK(nq->Find(a + "fused_qkv_a_proj_with_mqa.weight") == nullptr);

  // moe_intermediate 4 / moe_tp 2 = 2 rows: not whole 4x4 blocks.
  q.block_n = q.block_k = 4;
  auto bad = BuildParamTable(testing::TinyDeepseek(), RankParallelism::ForTp(2, 0), q);
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(std::string(bad.status().message()), Catch::Contains("whole blocks"));
}

TEST_CASE("table errors", "[replica][table]") {
  ModelConfig c = testing::TinyQwen3();
  CHECK_FALSE(BuildParamTable(c, RankParallelism::ForTp(8, 0), {}).ok());  // 4 heads over 8 ranks
  CHECK_FALSE(BuildParamTable(c, RankParallelism::ForTp(3, 0), {}).ok());
  RankParallelism pp = RankParallelism::ForTp(2, 0);
  pp.pp_size = 2;
  CHECK(BuildParamTable(c, pp, {}).status().code() == absl::StatusCode::kUnimplemented);
  CHECK_FALSE(BuildParamTable(testing::TinyQwen3Moe(), RankParallelism::ForTp(4, 0, 8), {}).ok());
}

// Replication of an HF tensor across the ranks of one engine (how many ranks hold each element).
int64_t Replication(const ModelConfig& c, const std::string& name, int tp) {
  const bool mha = !c.is_mla();
  if (mha && (absl::StrContains(name, ".k_proj.") || absl::StrContains(name, ".v_proj."))) {
    return tp > c.num_kv_heads ? tp / c.num_kv_heads : 1;
  }
  if (absl::StrContains(name, "norm.") || absl::StrContains(name, "mlp.gate.") ||
      absl::StrContains(name, ".q_a_proj.") || absl::StrContains(name, ".kv_a_proj_with_mqa.") ||
      absl::StrContains(name, "o_proj.bias")) {
    return tp;
  }
  return 1;
}

// Over all ranks: every HF tensor is covered (replication) times, every parameter is tiled exactly (vocab padding
// aside), and every slice lies inside its tensor and parameter.
void CheckConsistency(const std::string& model, int tp, int ep, QuantSpec q = {}) {
  INFO(model << " tp=" << tp << " ep=" << ep << " fp8=" << (q.mode == QuantSpec::Mode::kFp8Block));
  ModelConfig c = LoadModel(model);
  std::map<std::string, int64_t> covered, full;
  uint64_t bytes = 0;
  for (int r = 0; r < tp; ++r) {
    auto plan = PlanLayout(c, RankParallelism::ForTp(tp, r, ep), q);
    if (!plan.ok()) FAIL(plan.status().ToString());
    const auto& params = plan->table.params();
    bytes += plan->table.total_bytes();
    std::vector<int64_t> filled(params.size(), 0);
    for (const SliceSource& s : plan->sources) {
      if (s.kind == SliceSource::Kind::kConstant) {
        INFO(params[s.param].name);
        CHECK(params[s.param].shape.empty());  // scalars, written by the replica itself
        filled[s.param] += 1;
        continue;
      }
      const int64_t hr = s.hf_shape[0], hc = s.hf_shape.size() > 1 ? s.hf_shape[1] : 1;
      REQUIRE(s.src_row0 + s.rows <= hr);
      REQUIRE(s.src_col0 + s.cols <= hc);
      covered[s.hf_name] += s.rows * s.cols;
      full[s.hf_name] = hr * hc;
      const Shape& ps = params[s.param].shape;
      const int64_t pr = ps.size() == 1 ? ps[0] : ps[ps.size() - 2], pc = ps.size() == 1 ? 1 : ps.back();
      REQUIRE(s.dst_row0 + s.rows <= pr);
      REQUIRE(s.dst_col0 + s.cols <= pc);
      REQUIRE(s.expert < (ps.size() == 3 ? ps[0] : 1));
      filled[s.param] += s.rows * s.cols;
    }
    for (size_t p = 0; p < params.size(); ++p) {
      int64_t numel = 1;
      for (int64_t d : params[p].shape) numel *= d;
      const bool vocab = params[p].name == "model.embed_tokens.weight" || params[p].name == "lm_head.weight";
      const bool quantized_scale = q.mode == QuantSpec::Mode::kFp8Block &&
                                   absl::EndsWith(params[p].name, "_scale_inv");
      INFO(params[p].name);
      if (vocab) {
        CHECK(filled[p] <= numel);
      } else if (!quantized_scale || filled[p] > 0) {
        CHECK(filled[p] == numel);
      }
    }
  }
  for (const auto& [name, n] : covered) {
    INFO(name);
    CHECK(n == full[name] * Replication(c, name, tp));
  }
  // Every checkpoint tensor is needed by some rank.
  auto list = CheckpointTensors(c, q.mode == QuantSpec::Mode::kFp8Block ? CheckpointFormat::kFp8PassThrough
                                                                         : CheckpointFormat::kTrainer,
                                q.block_n, q.block_k);
  REQUIRE(list.ok());
  CHECK(covered.size() == list->size());
  uint64_t ckpt = 0;
  for (const TensorSpec& t : *list) ckpt += t.bytes();
  // Sharding never loses bytes (replication and padding only add).
  CHECK(bytes >= ckpt);
}

TEST_CASE("per-rank tables are consistent for the real models", "[replica][table][models]") {
  QuantSpec fp8;
  fp8.mode = QuantSpec::Mode::kFp8Block;
  CheckConsistency("Qwen__Qwen3-0.6B", 2, 1);
  CheckConsistency("Qwen__Qwen3-8B", 8, 1);
  CheckConsistency("Qwen__Qwen3-8B", 16, 1);  // 8 KV heads over 16 ranks: replicated
  CheckConsistency("meta-llama__Llama-3.1-8B", 4, 1);
  CheckConsistency("THUDM__GLM-Z1-9B-0414", 4, 1);
  CheckConsistency("Qwen__Qwen3-30B-A3B", 4, 1);
  CheckConsistency("Qwen__Qwen3-30B-A3B", 8, 2);
  CheckConsistency("Qwen__Qwen3-30B-A3B", 8, 8, fp8);
  CheckConsistency("Qwen__Qwen3-235B-A22B", 16, 16);
  CheckConsistency("zai-org__GLM-4.5-Air", 8, 8);
  CheckConsistency("zai-org__GLM-4.7-Flash", 4, 4);
  CheckConsistency("moonshotai__Moonlight-16B-A3B", 8, 1);
  CheckConsistency("deepseek-ai__DeepSeek-V3", 8, 1, fp8);
  CheckConsistency("deepseek-ai__DeepSeek-V3", 16, 16, fp8);
}

TEST_CASE("Kimi-K2 at tp=32, ep=32", "[replica][table][models]") {
  QuantSpec fp8;
  fp8.mode = QuantSpec::Mode::kFp8Block;
  // 128x128 blocks cannot split the dense MLP (18432 / 32 = 576 rows) or the shared expert (2048 / 32 = 64).
  auto bad = BuildParamTable(LoadModel("moonshotai__Kimi-K2-Instruct"), RankParallelism::ForTp(32, 0, 32), fp8);
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(std::string(bad.status().message()), Catch::Contains("whole blocks"));
  fp8.block_n = fp8.block_k = 64;
  CheckConsistency("moonshotai__Kimi-K2-Instruct", 32, 32, fp8);
  CheckConsistency("moonshotai__Kimi-K2-Instruct", 32, 32);
  auto t = BuildParamTable(LoadModel("moonshotai__Kimi-K2-Instruct"), RankParallelism::ForTp(32, 5, 32), fp8);
  REQUIRE(t.ok());
  CHECK(ShapeOf(*t, "model.layers.1.mlp.experts.w13_weight") == Shape{12, 4096, 7168});
  CHECK(ShapeOf(*t, "model.layers.1.mlp.experts.w13_weight_scale_inv") == Shape{12, 64, 112});
  CHECK(ShapeOf(*t, "model.layers.1.self_attn.q_b_proj.weight") == Shape{2 * 192, 1536});
  CHECK(ShapeOf(*t, "model.layers.0.mlp.gate_up_proj.weight") == Shape{2 * 576, 7168});
  // ~1.03T parameters in fp8 over 32 ranks, plus replicated pieces: about 32-34 GB per rank.
  CHECK(t->total_bytes() > 30'000'000'000ull);
  CHECK(t->total_bytes() < 36'000'000'000ull);
}

}  // namespace
}  // namespace wsync::replica

namespace wsync::replica {
namespace {

TEST_CASE("DP-attention shards attention and the embedding by attn_tp", "[replica][table]") {
  RankParallelism r = RankParallelism::ForTp(4, 3);
  r.attn_tp_size = 2;
  r.attn_tp_rank = 1;
  r.attn_dp_size = 2;
  r.attn_dp_rank = 1;
  auto t = BuildParamTable(testing::TinyQwen3(), r, {});
  REQUIRE(t.ok());
  // Attention over 2 ranks: 2 q heads + 1 k + 1 v; MLP still over tp=4.
  CHECK(t->Find("model.layers.0.self_attn.qkv_proj.weight")->shape == std::vector<int64_t>{8, 8});
  CHECK(t->Find("model.layers.0.self_attn.o_proj.weight")->shape == std::vector<int64_t>{8, 4});
  CHECK(t->Find("model.layers.0.mlp.gate_up_proj.weight")->shape == std::vector<int64_t>{2, 8});
  // SGLang 0.5.23 splits embed_tokens over the attention-TP group (vocab 100 padded to 128, over 2); lm_head over tp.
  CHECK(t->Find("model.embed_tokens.weight")->shape == std::vector<int64_t>{64, 8});
  CHECK(t->Find("lm_head.weight")->shape == std::vector<int64_t>{32, 8});
  r.attn_dp_size = 3;  // 2 * 3 != 4
  CHECK_FALSE(BuildParamTable(testing::TinyQwen3(), r, {}).ok());
}

TEST_CASE("Llama has no DP attention in SGLang: attention and embedding stay on the whole TP group",
          "[replica][table]") {
  RankParallelism r = RankParallelism::ForTp(4, 3);
  r.attn_tp_size = 2;
  r.attn_tp_rank = 1;
  r.attn_dp_size = 2;
  r.attn_dp_rank = 1;
  const ModelConfig llama = *ModelConfig::FromJson(R"({"architectures":["LlamaForCausalLM"],"hidden_size":8,
    "num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":2,"intermediate_size":4,"vocab_size":100})");
  auto t = BuildParamTable(llama, r, {});
  REQUIRE(t.ok());
  // head_dim 2; over tp=4: 1 q head + 1 (replicated) k + 1 v head = 6 rows (over attn_tp=2 it would be 8).
  CHECK(t->Find("model.layers.0.self_attn.qkv_proj.weight")->shape == std::vector<int64_t>{6, 8});
  CHECK(t->Find("model.embed_tokens.weight")->shape == std::vector<int64_t>{32, 8});
}

TEST_CASE("FP8 MLA carries SGLang's KV-cache scales; GLM4-MoE's router is float32", "[replica][table]") {
  QuantSpec fp8;
  fp8.mode = QuantSpec::Mode::kFp8Block;
  fp8.block_n = fp8.block_k = 2;
  auto plan = PlanLayout(testing::TinyDeepseek(), RankParallelism::ForTp(2, 1), fp8);
  REQUIRE(plan.ok());
  const std::string a = "model.layers.1.self_attn.";
  for (const char* n : {"attn_mqa.k_scale", "attn_mqa.v_scale", "attn_mha.k_scale", "attn_mha.v_scale"}) {
    INFO(n);
    const EngineParam* p = plan->table.Find(a + n);
    REQUIRE(p != nullptr);
    CHECK(p->dtype == DType::kF32);
    CHECK(p->shape.empty());
    CHECK(p->bytes == 4);
  }
  int constants = 0;
  for (const SliceSource& s : plan->sources) {
    if (s.kind != SliceSource::Kind::kConstant) continue;
    ++constants;
    CHECK(s.value == 1.0f);
    CHECK(absl::EndsWith(s.hf_name, "self_attn.kv_b_proj.weight"));  // ready with (and planned with) kv_b_proj
  }
  CHECK(constants == 2 * 4);  // two layers
  // Unquantized: no KV-cache scales; DeepSeek's router stays in the model dtype.
  auto bf16 = BuildParamTable(testing::TinyDeepseek(), RankParallelism::ForTp(2, 1), {});
  REQUIRE(bf16.ok());
  CHECK(bf16->Find(a + "attn_mqa.k_scale") == nullptr);
  CHECK(bf16->Find("model.layers.1.mlp.gate.weight")->dtype == DType::kBF16);

  ModelConfig glm = LoadModel("zai-org__GLM-4.5-Air");
  auto g = BuildParamTable(glm, RankParallelism::ForTp(8, 0, 8), {});
  REQUIRE(g.ok());
  CHECK(g->Find("model.layers.1.mlp.gate.weight")->dtype == DType::kF32);
  CHECK(g->Find("model.layers.1.mlp.gate.e_score_correction_bias")->dtype == DType::kF32);
  // The checkpoint (what trainers push) keeps the router in bf16; loading widens it.
  auto ckpt = CheckpointTensors(glm);
  REQUIRE(ckpt.ok());
  for (const TensorSpec& t : *ckpt) {
    if (t.name == "model.layers.1.mlp.gate.weight") CHECK(t.dtype == DType::kBF16);
  }
}

TEST_CASE("SGLang cannot build Qwen3-MoE dense layers (mlp_only_layers): refused, vLLM keeps them", "[replica][table]") {
  ModelConfig c = testing::TinyQwen3Moe();
  c.mlp_only_layers = {1};
  auto s = BuildParamTable(c, RankParallelism::ForTp(1, 0), {});
  REQUIRE_FALSE(s.ok());
  CHECK(s.status().code() == absl::StatusCode::kUnimplemented);
  CHECK_THAT(std::string(s.status().message()), Catch::Contains("mlp_only_layers"));
  RankParallelism v = RankParallelism::ForTp(1, 0);
  v.dialect = EngineDialect::kVllm;
  auto t = BuildParamTable(c, v, {});
  REQUIRE(t.ok());
  CHECK(t->Find("model.layers.1.mlp.gate_up_proj.weight") != nullptr);
  CHECK(CheckpointTensors(c).ok());  // the checkpoint list itself is still known
}

TEST_CASE("shared-expert fusion is a rank option and is read from the engine's parameters", "[replica][table]") {
  const ModelConfig c = testing::TinyDeepseek();
  RankParallelism r = RankParallelism::ForTp(2, 0);
  auto plain = BuildParamTable(c, r, {});
  REQUIRE(plain.ok());
  r.num_fused_shared_experts = 1;
  auto fused = BuildParamTable(c, r, {});
  REQUIRE(fused.ok());
  CHECK(ShapeOf(*plain, "model.layers.1.mlp.experts.w13_weight")[0] == 4);
  CHECK(ShapeOf(*fused, "model.layers.1.mlp.experts.w13_weight")[0] == 5);
  CHECK(ShapeOf(*fused, "model.layers.1.mlp.experts.w2_weight")[0] == 5);
  CHECK(plain->Find("model.layers.1.mlp.shared_experts.gate_up_proj.weight") != nullptr);
  CHECK(fused->Find("model.layers.1.mlp.shared_experts.gate_up_proj.weight") == nullptr);
  CHECK_FALSE(RankParallelism::ForTp(2, 0) == r);  // a different layout

  auto names = [](const ParamTable& t) {
    std::vector<std::string> v;
    for (const EngineParam& p : t.params()) v.push_back(p.name);
    return v;
  };
  CHECK(*SharedExpertsFusionFromParams(c, names(*plain)) == 0);
  CHECK(*SharedExpertsFusionFromParams(c, names(*fused)) == 1);
  // Neither layout (no experts at all): an error that says what it saw.
  auto bad = SharedExpertsFusionFromParams(c, {"model.embed_tokens.weight"});
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(std::string(bad.status().message()), Catch::Contains("neither mlp.shared_experts"));
  // Fusion of a model without shared experts is refused.
  RankParallelism q = RankParallelism::ForTp(1, 0);
  q.num_fused_shared_experts = 1;
  CHECK_FALSE(BuildParamTable(testing::TinyQwen3Moe(), q, {}).ok());
  CHECK(*SharedExpertsFusionFromParams(testing::TinyQwen3Moe(), {}) == 0);
}

}  // namespace
}  // namespace wsync::replica
