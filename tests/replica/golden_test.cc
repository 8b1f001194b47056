// Golden tests: the replica's engine-layout bytes against an independent numpy model (golden_oracle.py).
//
// For each small synthetic config (a real config.json with tiny dimensions) and set of engine ranks, the oracle writes
// the HF tensor list and the expected bytes of every engine parameter of every rank. This test generates the same HF
// tensors (the deterministic rule is implemented again here), loads them through Replica (Create → BeginUpdate →
// Ingest each → FinishUpdate) and compares parameter names, dtypes, shapes and every byte.
// Needs python3 with numpy (Debian: python3-numpy); exits 77 (skipped) without it.
//
// Built a second time with WSYNC_SGLANG_ORACLE as replica_sglang_oracle_test (label sglang): the same cases, with
// SGLang 0.5.23's own model classes and weight loaders as the oracle (sglang_oracle.py, same job/manifest format),
// run through sglang_venv.sh, which creates the pinned venv and sets WSYNC_PYTHON; one oracle process serves every
// case (OracleServer). Only there: the next-n draft cases (layouts with WeightSet::kDraft), SGLang's NextN classes
// loading a checkpoint that also holds the MTP layer.
#define CATCH_CONFIG_RUNNER
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "replica/mapper.h"
#include "replica/model_config.h"
#include "replica/replica.h"

namespace wsync::replica {
namespace {

using nlohmann::json;

std::string g_python;  // interpreter with numpy, found in main()

bool HasNumpy(const std::string& python) {
  const std::string cmd = "'" + python + "' -c 'import numpy' >/dev/null 2>&1";
  return std::system(cmd.c_str()) == 0;
}

#ifndef WSYNC_SGLANG_ORACLE
std::string FindPython() {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("WSYNC_PYTHON")) candidates.push_back(env);
#ifdef WSYNC_GOLDEN_PYTHON
  candidates.push_back(WSYNC_GOLDEN_PYTHON);
#endif
  candidates.push_back("python3");
  candidates.push_back("/usr/bin/python3");
  for (const std::string& c : candidates) {
    if (!c.empty() && HasNumpy(c)) return c;
  }
  return "";
}
#endif

// ---- the deterministic HF tensor rule (see golden_oracle.py) ----
uint64_t Fnv1a64(const std::string& s) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char b : s) {
    h ^= b;
    h *= 0x100000001B3ull;
  }
  return h;
}

uint64_t Mix(uint64_t seed, uint64_t i) {
  uint64_t z = seed ^ (i * 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t Exponent(uint64_t h) {
  uint64_t m = 24;
  for (int j = 1; j <= 4; ++j) m = std::min<uint64_t>(m, ((h >> (8 * j)) & 0xFF) % 24);
  return 110 + m;
}

std::vector<uint8_t> MakeTensor(const std::string& name, DType dtype, uint64_t n) {
  const uint64_t seed = Fnv1a64(name);
  std::vector<uint8_t> out(n * DTypeSize(dtype));
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t h = Mix(seed, i);
    const uint64_t sign = h >> 63;
    if (dtype == DType::kBF16) {
      const uint16_t bits = static_cast<uint16_t>((sign << 15) | (Exponent(h) << 7) | (h & 0x7F));
      std::memcpy(out.data() + 2 * i, &bits, 2);
    } else if (dtype == DType::kF32) {
      const uint32_t bits = static_cast<uint32_t>((sign << 31) | (Exponent(h) << 23) | ((h >> 40) & 0x7FFFFF));
      std::memcpy(out.data() + 4 * i, &bits, 4);
    } else {
      FAIL("no generation rule for dtype " << DTypeName(dtype) << " of " << name);
    }
  }
  return out;
}

// ---- scaffolding ----
struct TempDir {
  std::string path;
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/wsync_golden_XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (mkdtemp(buf.data()) != nullptr) path = buf.data();
  }
  ~TempDir() {
    if (!path.empty() && std::getenv("WSYNC_GOLDEN_KEEP") == nullptr) {
      (void)std::system(("rm -rf '" + path + "'").c_str());
    }
  }
};

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

json BaseConfig(const std::string& model_dir) {
  const std::string text = ReadFile(std::string(WSYNC_MODELS_DIR) + "/" + model_dir + "/config.json");
  REQUIRE(!text.empty());
  json j = json::parse(text);
  j.erase("_reconstructed");
  j.erase("_sources");
  return j;
}

json LayoutJson(const RankParallelism& r) {
  return json{{"tp_size", r.tp_size},           {"tp_rank", r.tp_rank},          {"ep_size", r.ep_size},
              {"ep_rank", r.ep_rank},           {"moe_tp_size", r.moe_tp_size},  {"moe_tp_rank", r.moe_tp_rank},
              {"attn_tp_size", r.attn_tp_size}, {"attn_tp_rank", r.attn_tp_rank}, {"attn_dp_size", r.attn_dp_size},
              {"num_fused_shared_experts", r.num_fused_shared_experts}};
}

std::vector<RankParallelism> AllRanks(int tp, int ep = 1) {
  std::vector<RankParallelism> v;
  for (int r = 0; r < tp; ++r) v.push_back(RankParallelism::ForTp(tp, r, ep));
  return v;
}

// DP attention: attention sharded over attn_tp = tp / dp; MoE over moe_tp = tp / ep.
std::vector<RankParallelism> DpAttentionRanks(int tp, int dp, int ep) {
  std::vector<RankParallelism> v;
  for (int r = 0; r < tp; ++r) {
    RankParallelism p = RankParallelism::ForTp(tp, r, ep);
    p.attn_tp_size = tp / dp;
    p.attn_tp_rank = r % (tp / dp);
    p.attn_dp_size = dp;
    p.attn_dp_rank = r / (tp / dp);
    v.push_back(p);
  }
  return v;
}

std::string LayoutName(const RankParallelism& r) {
  return absl::StrCat(r.weights == WeightSet::kDraft ? "draft " : "", "tp", r.tp_size, "/", r.tp_rank, " ep", r.ep_size, "/", r.ep_rank, " moe_tp", r.moe_tp_size, "/",
                      r.moe_tp_rank, " attn_tp", r.attn_tp_size, "/", r.attn_tp_rank);
}

std::string ShapeStr(const std::vector<int64_t>& s) { return "[" + absl::StrJoin(s, ", ") + "]"; }

#ifdef WSYNC_SGLANG_ORACLE
// One SGLang oracle process for every case (sglang_oracle.py --serve): it imports torch and SGLang once, which was
// most of each case's time when every job was a process of its own, and runs each job in a child forked from that
// freshly imported state, so no job sees what an earlier one set. Single-threaded use only (Catch2 runs cases in turn).
class OracleServer {
 public:
  ~OracleServer() {
    if (to_ != nullptr) fclose(to_);  // end of its input: the server exits
    if (from_ != nullptr) fclose(from_);
    if (pid_ > 0) waitpid(pid_, nullptr, 0);
  }

  // The job's exit status; -1 with the reason in *error when the server could not start or has gone.
  int Run(const std::string& job, const std::string& out_dir, const std::string& log, std::string* error) {
    if (pid_ == 0 && !Start(error)) return -1;
    if (to_ == nullptr || from_ == nullptr) {
      *error = "the SGLang oracle server did not start (its output is in the test's log)";
      return -1;
    }
    if (std::fprintf(to_, "%s\t%s\t%s\n", job.c_str(), out_dir.c_str(), log.c_str()) < 0 || std::fflush(to_) != 0) {
      *error = "the SGLang oracle server is gone (writing its request failed)";
      return -1;
    }
    std::string line;
    if (!ReadLine(&line)) {
      *error = "the SGLang oracle server is gone (no reply)";
      return -1;
    }
    return std::atoi(line.c_str());
  }

 private:
  bool Start(std::string* error) {
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) {
      *error = std::string("pipe2: ") + std::strerror(errno);
      return false;
    }
    pid_ = fork();
    if (pid_ == 0) {
      dup2(in[0], 0);
      dup2(out[1], 1);
      execl(g_python.c_str(), g_python.c_str(), WSYNC_GOLDEN_ORACLE, "--serve", static_cast<char*>(nullptr));
      _exit(127);
    }
    close(in[0]);
    close(out[1]);
    if (pid_ < 0) {
      close(in[1]);
      close(out[0]);
      *error = std::string("fork: ") + std::strerror(errno);
      return false;
    }
    to_ = fdopen(in[1], "w");
    from_ = fdopen(out[0], "r");
    std::string line;
    if (!ReadLine(&line) || line != "ready") {
      *error = "the SGLang oracle server did not start (its output is in the test's log)";
      return false;
    }
    return true;
  }

  bool ReadLine(std::string* line) {
    line->clear();
    int c;
    while ((c = std::fgetc(from_)) != EOF && c != '\n') line->push_back(static_cast<char>(c));
    return c == '\n';
  }

  pid_t pid_ = 0;
  FILE* to_ = nullptr;
  FILE* from_ = nullptr;
};
#endif

// Runs the oracle on one job file; its exit status, and its output in *output.
int RunOracle(const std::string& job, const std::string& out_dir, const std::string& log, std::string* output) {
#ifdef WSYNC_SGLANG_ORACLE
  static OracleServer server;
  std::string error;
  const int rc = server.Run(job, out_dir, log, &error);
  *output = rc < 0 ? error : ReadFile(log);
  return rc;
#else
  const std::string cmd = "'" + g_python + "' '" + std::string(WSYNC_GOLDEN_ORACLE) + "' '" + job + "' '" + out_dir +
                          "' >'" + log + "' 2>&1";
  const int rc = std::system(cmd.c_str());
  *output = "oracle: " + cmd + "\n" + ReadFile(log);
  return rc;
#endif
}

// Runs one golden case: config overrides applied to a real config, the given layouts, the given quantization.
void RunGolden(const std::string& model_dir, const json& overrides, const std::vector<RankParallelism>& layouts,
               const QuantSpec& quant) {
  TempDir tmp;
  REQUIRE(!tmp.path.empty());
  REQUIRE(!layouts.empty());
  const WeightSet weights = layouts[0].weights;
  for (const RankParallelism& r : layouts) REQUIRE(r.weights == weights);
  const bool draft = weights == WeightSet::kDraft;
  json cfg = BaseConfig(model_dir);
  cfg.merge_patch(overrides);
  const std::string cfg_path = tmp.path + "/config.json";
  WriteFile(cfg_path, cfg.dump(2));

  json job;
  job["config"] = cfg_path;
  job["layouts"] = json::array();
  for (const RankParallelism& r : layouts) job["layouts"].push_back(LayoutJson(r));
  job["quant"] = quant.mode == QuantSpec::Mode::kFp8Block
                     ? json{{"mode", "fp8_block"}, {"block_n", quant.block_n}, {"block_k", quant.block_k}}
                     : json{{"mode", "none"}};
  job["weights"] = std::string(WeightSetName(weights));
  WriteFile(tmp.path + "/job.json", job.dump(2));
  const std::string out_dir = tmp.path + "/out";
  REQUIRE(std::system(("mkdir -p '" + out_dir + "'").c_str()) == 0);
  std::string oracle_out;
  const int rc = RunOracle(tmp.path + "/job.json", out_dir, tmp.path + "/oracle.log", &oracle_out);
  INFO("oracle output: " << oracle_out);
  REQUIRE(rc == 0);
  const json manifest = json::parse(ReadFile(out_dir + "/manifest.json"));

  absl::StatusOr<ModelConfig> config = ModelConfig::FromJson(cfg.dump());
  INFO("config: " << config.status().ToString());
  REQUIRE(config.ok());

  // The HF tensor set the oracle assumed must be what the replica expects trainers to push: the target's, plus for a
  // draft its next-n layer, less the two tensors of that layer the draft does not load (the target's embedding and
  // lm_head serve it).
  absl::StatusOr<std::vector<TensorSpec>> ckpt = CheckpointTensors(*config);
  REQUIRE(ckpt.ok());
  absl::StatusOr<ParamMapper> mapper =
      ParamMapper::Create(*config, layouts[0].ep_size, layouts[0].num_fused_shared_experts, weights);
  INFO("ParamMapper::Create: " << mapper.status().ToString());
  REQUIRE(mapper.ok());
  if (draft) {
    absl::StatusOr<std::vector<TensorSpec>> d = CheckpointTensors(*config, CheckpointFormat::kTrainer, 128, 128, weights);
    INFO("draft CheckpointTensors: " << d.status().ToString());
    REQUIRE(d.ok());
    REQUIRE(!d->empty());
    ckpt->insert(ckpt->end(), d->begin(), d->end());
  }
  std::map<std::string, std::string> ours, theirs;
  for (const TensorSpec& t : *ckpt) ours[t.name] = absl::StrCat(DTypeName(t.dtype), ShapeStr(t.shape));
  for (const json& t : manifest["hf"]) {
    theirs[t["name"].get<std::string>()] =
        absl::StrCat(t["dtype"].get<std::string>(), ShapeStr(t["shape"].get<std::vector<int64_t>>()));
  }
  int shared_with_target = 0;
  for (const auto& [name, desc] : theirs) {
    INFO("HF tensor " << name << " (oracle " << desc << ")");
    if (draft && ours.count(name) == 0) {
      absl::StatusOr<HfMapping> m = mapper->Map(name);
      REQUIRE(m.ok());
      CHECK(m->skip == SkipRule::kSharedWithTarget);
      ++shared_with_target;
      continue;
    }
    CHECK(ours.count(name) == 1);
    if (ours.count(name)) CHECK(ours[name] == desc);
  }
  CHECK(shared_with_target == (draft ? 2 : 0));
  for (const auto& [name, desc] : ours) {
    INFO("HF tensor " << name << " (CheckpointTensors " << desc << ")");
    CHECK(theirs.count(name) == 1);
  }

  absl::StatusOr<std::unique_ptr<Replica>> replica = Replica::Create(*config, layouts, quant);
  INFO("Replica::Create: " << replica.status().ToString());
  REQUIRE(replica.ok());
  Replica& rep = **replica;
  REQUIRE(rep.num_layouts() == static_cast<int>(layouts.size()));

  rep.BeginUpdate();
  std::map<std::pair<int, int>, int> ready_count;
  for (const json& t : manifest["hf"]) {
    const std::string name = t["name"].get<std::string>();
    absl::StatusOr<DType> dtype = ParseDType(t["dtype"].get<std::string>());
    REQUIRE(dtype.ok());
    const std::vector<int64_t> shape = t["shape"].get<std::vector<int64_t>>();
    uint64_t numel = 1;
    for (int64_t d : shape) numel *= static_cast<uint64_t>(d);
    const std::vector<uint8_t> data = MakeTensor(name, *dtype, numel);
    HfTensor h;
    h.name = name;
    h.dtype = *dtype;
    h.shape = shape;
    h.data = data.data();
    h.bytes = data.size();
    absl::StatusOr<std::vector<ReadyParam>> ready = rep.Ingest(h);
    INFO("Ingest " << name << ": " << ready.status().ToString());
    REQUIRE(ready.ok());
    for (const ReadyParam& p : *ready) ready_count[{p.layout, p.param}]++;
  }
  const absl::Status finish = rep.FinishUpdate();
  INFO("FinishUpdate: " << finish.ToString());
  CHECK(finish.ok());

  for (int l = 0; l < rep.num_layouts(); ++l) {
    INFO("layout " << l << ": " << LayoutName(layouts[l]));
    const ParamTable& table = rep.table(l);
    const json& expected = manifest["layouts"][l];
    // The oracle's parameters that its loader filled; a draft's unloaded ones are the target's embedding and lm_head
    // (shared in a running engine, written with the target) and must not be in the draft's replica.
    std::set<std::string> want_names, have_names, unloaded;
    for (const json& p : expected) {
      (p.value("loaded", true) ? want_names : unloaded).insert(p["name"].get<std::string>());
    }
    CHECK(unloaded == (draft ? std::set<std::string>{"model.embed_tokens.weight", "lm_head.weight"}
                             : std::set<std::string>{}));
    for (const EngineParam& p : table.params()) have_names.insert(p.name);
    // The mapper names, for every tensor the replica loads, a parameter the oracle has.
    for (const auto& [name, desc] : theirs) {
      absl::StatusOr<HfMapping> m = mapper->Map(name);
      INFO("HF tensor " << name << ": " << m.status().ToString());
      REQUIRE(m.ok());
      if (m->skip != SkipRule::kNone) continue;
      INFO("mapped to " << m->engine_name);
      CHECK(want_names.count(m->engine_name) == 1);
    }
    for (const std::string& name : want_names) {
      INFO("engine parameter missing from the replica: " << name);
      CHECK(have_names.count(name) == 1);
    }
    for (const std::string& name : have_names) {
      INFO("engine parameter the oracle does not have: " << name);
      CHECK(want_names.count(name) == 1);
    }
    for (int i = 0; i < static_cast<int>(table.params().size()); ++i) {
      INFO("parameter " << table.params()[i].name << " reported ready this many times");
      CHECK(ready_count[{l, i}] == 1);
    }
    int byte_mismatches = 0;
    for (const json& p : expected) {
      const std::string name = p["name"].get<std::string>();
      const EngineParam* have = table.Find(name);
      if (have == nullptr || !p.value("loaded", true)) continue;
      const std::vector<int64_t> shape = p["shape"].get<std::vector<int64_t>>();
      INFO("parameter " << name << " oracle " << p["dtype"].get<std::string>() << ShapeStr(shape) << " replica "
                        << DTypeName(have->dtype) << ShapeStr(have->shape));
      CHECK(std::string(DTypeName(have->dtype)) == p["dtype"].get<std::string>());
      CHECK(have->shape == shape);
      const std::string want = ReadFile(out_dir + "/" + p["file"].get<std::string>());
      CHECK(have->bytes == want.size());
      if (have->bytes != want.size()) continue;
      const uint8_t* got = rep.data(l) + have->offset;
      if (std::memcmp(got, want.data(), want.size()) != 0) {
        uint64_t first = 0, count = 0;
        for (uint64_t b = 0; b < want.size(); ++b) {
          if (got[b] != static_cast<uint8_t>(want[b])) {
            if (count++ == 0) first = b;
          }
        }
        ++byte_mismatches;
        FAIL_CHECK("bytes differ: " << count << " of " << want.size() << ", first at byte " << first << " (replica 0x"
                                    << std::hex << int(got[first]) << ", oracle 0x"
                                    << int(static_cast<uint8_t>(want[first])) << std::dec << ")");
      }
    }
    CHECK(byte_mismatches == 0);
  }
}

QuantSpec NoQuant() { return QuantSpec{}; }
QuantSpec Fp8(int bn, int bk) {
  QuantSpec q;
  q.mode = QuantSpec::Mode::kFp8Block;
  q.block_n = bn;
  q.block_k = bk;
  return q;
}

// Tiny but real structure: 2-3 layers, 4 heads, 2 KV heads (so tp 4 replicates KV), vocab not a multiple of 64.
const json kDenseDims = {
    {"hidden_size", 64}, {"num_hidden_layers", 2},  {"num_attention_heads", 4}, {"num_key_value_heads", 2},
    {"head_dim", 16},    {"intermediate_size", 96}, {"vocab_size", 1000},       {"tie_word_embeddings", false}};

json With(json base, const json& more) {
  base.merge_patch(more);
  return base;
}

TEST_CASE("golden: Qwen3 dense, tp 1/2/4 (tp 4 replicates KV heads)", "[golden]") {
  for (int tp : {1, 2, 4}) {
    INFO("tp " << tp);
    RunGolden("Qwen__Qwen3-8B", kDenseDims, AllRanks(tp), NoQuant());
  }
}

TEST_CASE("golden: Qwen3 dense with tied embeddings", "[golden]") {
  RunGolden("Qwen__Qwen3-0.6B", With(kDenseDims, {{"tie_word_embeddings", true}}), AllRanks(2), NoQuant());
}

TEST_CASE("golden: Llama (head_dim from hidden/heads), tp 1/2", "[golden]") {
  json dims = kDenseDims;
  dims.erase("head_dim");
  for (int tp : {1, 2}) RunGolden("meta-llama__Llama-3.1-8B", dims, AllRanks(tp), NoQuant());
}

TEST_CASE("golden: Qwen2 (q/k/v bias), tp 2/4", "[golden]") {
  const json dims = With(kDenseDims, {{"architectures", json::array({"Qwen2ForCausalLM"})}, {"model_type", "qwen2"}});
  for (int tp : {2, 4}) RunGolden("Qwen__Qwen3-8B", dims, AllRanks(tp), NoQuant());
}

TEST_CASE("golden: GLM4 dense (fused gate_up in the checkpoint, post norms, qkv bias), tp 2/4", "[golden]") {
  for (int tp : {2, 4}) RunGolden("THUDM__GLM-Z1-9B-0414", kDenseDims, AllRanks(tp), NoQuant());
}

const json kQwenMoeDims =
    With(kDenseDims, {{"num_experts", 8}, {"moe_intermediate_size", 32}, {"mlp_only_layers", json::array()}});

TEST_CASE("golden: Qwen3-MoE, tp 4 ep 2 (moe_tp 2), tp 4 ep 4, tp 2 ep 1", "[golden]") {
  RunGolden("Qwen__Qwen3-30B-A3B", kQwenMoeDims, AllRanks(4, 2), NoQuant());
  RunGolden("Qwen__Qwen3-30B-A3B", kQwenMoeDims, AllRanks(4, 4), NoQuant());
  RunGolden("Qwen__Qwen3-30B-A3B", kQwenMoeDims, AllRanks(2, 1), NoQuant());
}

// SGLang 0.5.23's Qwen3-MoE builds every layer sparse and ignores mlp_only_layers / decoder_sparse_step (the SGLang
// oracle showed experts where the checkpoint has a dense MLP), so it cannot serve such a model: the replica refuses
// it for the SGLang dialect. No released Qwen3-MoE has dense layers.
TEST_CASE("golden: Qwen3-MoE with a dense layer (mlp_only_layers) is refused for SGLang", "[golden]") {
  json cfg = BaseConfig("Qwen__Qwen3-30B-A3B");
  cfg.merge_patch(With(kQwenMoeDims, {{"mlp_only_layers", json::array({1})}}));
  absl::StatusOr<ModelConfig> config = ModelConfig::FromJson(cfg.dump());
  REQUIRE(config.ok());
  absl::StatusOr<std::unique_ptr<Replica>> replica = Replica::Create(*config, AllRanks(2, 2), NoQuant());
  CHECK(replica.status().code() == absl::StatusCode::kUnimplemented);
}

TEST_CASE("golden: Qwen3-MoE with DP attention (tp 4, attn_tp 2, ep 2)", "[golden]") {
  RunGolden("Qwen__Qwen3-30B-A3B", kQwenMoeDims, DpAttentionRanks(4, 2, 2), NoQuant());
}

const json kGlmMoeDims = With(kDenseDims, {{"num_hidden_layers", 3},
                                           {"first_k_dense_replace", 1},
                                           {"n_routed_experts", 4},
                                           {"n_shared_experts", 1},
                                           {"moe_intermediate_size", 32},
                                           {"num_nextn_predict_layers", 1}});

TEST_CASE("golden: GLM4-MoE (first dense layer, shared experts, router bias), tp 2, tp 4 ep 2", "[golden]") {
  RunGolden("zai-org__GLM-4.5-Air", kGlmMoeDims, AllRanks(2, 1), NoQuant());
  RunGolden("zai-org__GLM-4.5-Air", kGlmMoeDims, AllRanks(4, 2), NoQuant());
}

// MLA: 4 heads, q_lora 48, kv_lora 32, nope 16, rope 8, v 16.
const json kMlaDims = {{"hidden_size", 64},
                       {"num_hidden_layers", 3},
                       {"first_k_dense_replace", 1},
                       {"num_attention_heads", 4},
                       {"num_key_value_heads", 4},
                       {"q_lora_rank", 48},
                       {"kv_lora_rank", 32},
                       {"qk_nope_head_dim", 16},
                       {"qk_rope_head_dim", 8},
                       {"v_head_dim", 16},
                       {"intermediate_size", 96},
                       {"moe_intermediate_size", 32},
                       {"n_routed_experts", 8},
                       {"n_shared_experts", 1},
                       {"vocab_size", 1000},
                       {"tie_word_embeddings", false},
                       {"quantization_config", nullptr},
                       {"num_nextn_predict_layers", 1}};

TEST_CASE("golden: DeepSeek-V3-style MLA with q_lora, shared experts, first_k_dense; tp 2, tp 4 ep 2, ep 4",
          "[golden]") {
  RunGolden("deepseek-ai__DeepSeek-V3", kMlaDims, AllRanks(2, 1), NoQuant());
  RunGolden("deepseek-ai__DeepSeek-V3", kMlaDims, AllRanks(4, 2), NoQuant());
  RunGolden("deepseek-ai__DeepSeek-V3", kMlaDims, AllRanks(4, 4), NoQuant());
}

TEST_CASE("golden: Kimi-K2-style MLA (its own config: 384-expert routing flags, yarn rope), tp 2 ep 2", "[golden]") {
  RunGolden("moonshotai__Kimi-K2-Instruct", kMlaDims, AllRanks(2, 2), NoQuant());
}

TEST_CASE("golden: Moonlight-style MLA without q_lora (2 shared experts), tp 2 ep 2", "[golden]") {
  RunGolden("moonshotai__Moonlight-16B-A3B", With(kMlaDims, {{"q_lora_rank", nullptr}, {"n_shared_experts", 2}}),
            AllRanks(2, 2), NoQuant());
}

TEST_CASE("golden: GLM-4.7-Flash-style (Glm4MoeLiteForCausalLM), tp 2, tp 4 ep 4", "[golden]") {
  RunGolden("zai-org__GLM-4.7-Flash", kMlaDims, AllRanks(2, 1), NoQuant());
  RunGolden("zai-org__GLM-4.7-Flash", kMlaDims, AllRanks(4, 4), NoQuant());
}

std::vector<RankParallelism> Fused(std::vector<RankParallelism> layouts, int n) {
  for (RankParallelism& r : layouts) r.num_fused_shared_experts = n;
  return layouts;
}

TEST_CASE("golden: shared-expert fusion (E+1 experts, no shared_experts.*): DeepSeek-V3 tp 2, tp 4 ep 2; GLM-4.5 tp 2",
          "[golden][fusion]") {
  RunGolden("deepseek-ai__DeepSeek-V3", kMlaDims, Fused(AllRanks(2, 1), 1), NoQuant());
  RunGolden("deepseek-ai__DeepSeek-V3", kMlaDims, Fused(AllRanks(4, 2), 1), NoQuant());
  RunGolden("zai-org__GLM-4.5-Air", kGlmMoeDims, Fused(AllRanks(2, 1), 1), NoQuant());
}

TEST_CASE("golden: DP attention with MLA and GLM4-MoE (tp 4, attn_tp 2): embed_tokens over the attention-TP group",
          "[golden][dp_attention]") {
  RunGolden("deepseek-ai__DeepSeek-V3", kMlaDims, DpAttentionRanks(4, 2, 2), NoQuant());
  RunGolden("zai-org__GLM-4.5-Air", kGlmMoeDims, DpAttentionRanks(4, 2, 4), NoQuant());
}

TEST_CASE("golden: FP8 128x128, Qwen3 dense tp 2", "[golden][fp8]") {
  const json dims = {
      {"hidden_size", 256}, {"num_hidden_layers", 2},   {"num_attention_heads", 4}, {"num_key_value_heads", 2},
      {"head_dim", 128},    {"intermediate_size", 512}, {"vocab_size", 1000},       {"tie_word_embeddings", false}};
  RunGolden("Qwen__Qwen3-8B", dims, AllRanks(2), Fp8(128, 128));
}

TEST_CASE("golden: FP8 64x64, Qwen3-MoE tp 4 ep 2 (KV replicated in whole blocks)", "[golden][fp8]") {
  const json dims = {{"hidden_size", 128},
                     {"num_hidden_layers", 2},
                     {"num_attention_heads", 4},
                     {"num_key_value_heads", 2},
                     {"head_dim", 64},
                     {"intermediate_size", 256},
                     {"vocab_size", 1000},
                     {"num_experts", 4},
                     {"moe_intermediate_size", 128},
                     {"mlp_only_layers", json::array()},
                     {"tie_word_embeddings", false}};
  RunGolden("Qwen__Qwen3-30B-A3B", dims, AllRanks(4, 2), Fp8(64, 64));
}

TEST_CASE("golden: FP8 64x64, DeepSeek-V3-style MLA tp 2 ep 2", "[golden][fp8]") {
  const json dims = {{"hidden_size", 128},
                     {"num_hidden_layers", 2},
                     {"first_k_dense_replace", 1},
                     {"num_attention_heads", 4},
                     {"num_key_value_heads", 4},
                     {"q_lora_rank", 64},
                     {"kv_lora_rank", 64},
                     {"qk_nope_head_dim", 32},
                     {"qk_rope_head_dim", 32},
                     {"v_head_dim", 32},
                     {"intermediate_size", 128},
                     {"moe_intermediate_size", 128},
                     {"n_routed_experts", 4},
                     {"n_shared_experts", 1},
                     {"vocab_size", 1000},
                     {"tie_word_embeddings", false},
                     {"quantization_config", nullptr}};
  RunGolden("deepseek-ai__DeepSeek-V3", dims, AllRanks(2, 2), Fp8(64, 64));
}

#ifdef WSYNC_SGLANG_ORACLE
// Next-n (MTP) drafts against SGLang's NextN classes: the checkpoint holds the MTP layer model.layers.<L>.*, SGLang's
// draft class loads it (renamed to model.decoder.* / model.enorm ...) and every parameter its loader fills must equal
// the draft replica's, bit-exact; its embed_tokens and lm_head stay unloaded (the target's serve it).
std::vector<RankParallelism> Draft(std::vector<RankParallelism> layouts) {
  for (RankParallelism& r : layouts) r.weights = WeightSet::kDraft;
  return layouts;
}

TEST_CASE("sglang draft: DeepSeek-V3 NextN (MLA, q_lora, shared expert), tp 1, tp 2, tp 4 ep 2", "[golden][draft]") {
  RunGolden("deepseek-ai__DeepSeek-V3", kMlaDims, Draft(AllRanks(1)), NoQuant());
  RunGolden("deepseek-ai__DeepSeek-V3", kMlaDims, Draft(AllRanks(2)), NoQuant());
  RunGolden("deepseek-ai__DeepSeek-V3", kMlaDims, Draft(AllRanks(4, 2)), NoQuant());
}

TEST_CASE("sglang draft: DeepSeek-V3 NextN with the shared expert fused, tp 2", "[golden][draft][fusion]") {
  RunGolden("deepseek-ai__DeepSeek-V3", kMlaDims, Fused(Draft(AllRanks(2)), 1), NoQuant());
}

TEST_CASE("sglang draft: DP attention (tp 4, attn_tp 2), DeepSeek-V3 and GLM-4.5 NextN", "[golden][draft][dp_attention]") {
  RunGolden("deepseek-ai__DeepSeek-V3", kMlaDims, Draft(DpAttentionRanks(4, 2, 2)), NoQuant());
  RunGolden("zai-org__GLM-4.5-Air", kGlmMoeDims, Draft(DpAttentionRanks(4, 2, 4)), NoQuant());
}

TEST_CASE("sglang draft: GLM-4.5 NextN (Glm4MoeForCausalLMNextN), tp 1, tp 2", "[golden][draft]") {
  RunGolden("zai-org__GLM-4.5-Air", kGlmMoeDims, Draft(AllRanks(1)), NoQuant());
  RunGolden("zai-org__GLM-4.5-Air", kGlmMoeDims, Draft(AllRanks(2)), NoQuant());
}

TEST_CASE("sglang draft: GLM-4.7-Flash NextN (Glm4MoeLiteForCausalLMNextN), tp 2", "[golden][draft]") {
  RunGolden("zai-org__GLM-4.7-Flash", kMlaDims, Draft(AllRanks(2)), NoQuant());
}

// FP8: the draft's decoder layer block-quantized as a target layer (its MLA KV-cache scales included), eh_proj not.
const json kMlaFp8Dims = {{"hidden_size", 128},
                          {"num_hidden_layers", 2},
                          {"first_k_dense_replace", 1},
                          {"num_attention_heads", 4},
                          {"num_key_value_heads", 4},
                          {"q_lora_rank", 64},
                          {"kv_lora_rank", 64},
                          {"qk_nope_head_dim", 32},
                          {"qk_rope_head_dim", 32},
                          {"v_head_dim", 32},
                          {"intermediate_size", 128},
                          {"moe_intermediate_size", 128},
                          {"n_routed_experts", 4},
                          {"n_shared_experts", 1},
                          {"vocab_size", 1000},
                          {"tie_word_embeddings", false},
                          {"quantization_config", nullptr},
                          {"num_nextn_predict_layers", 1}};

TEST_CASE("sglang draft: FP8 64x64, DeepSeek-V3 NextN tp 1, tp 2", "[golden][draft][fp8]") {
  RunGolden("deepseek-ai__DeepSeek-V3", kMlaFp8Dims, Draft(AllRanks(1)), Fp8(64, 64));
  RunGolden("deepseek-ai__DeepSeek-V3", kMlaFp8Dims, Draft(AllRanks(2)), Fp8(64, 64));
}

TEST_CASE("sglang draft: FP8 64x64, GLM-4.5 NextN tp 2", "[golden][draft][fp8]") {
  const json dims = {{"hidden_size", 128},         {"num_hidden_layers", 2},     {"first_k_dense_replace", 1},
                     {"num_attention_heads", 4},   {"num_key_value_heads", 2},   {"head_dim", 64},
                     {"intermediate_size", 256},   {"moe_intermediate_size", 128}, {"n_routed_experts", 4},
                     {"n_shared_experts", 1},      {"vocab_size", 1000},         {"tie_word_embeddings", false},
                     {"num_nextn_predict_layers", 1}};
  RunGolden("zai-org__GLM-4.5-Air", dims, Draft(AllRanks(2)), Fp8(64, 64));
}
#endif  // WSYNC_SGLANG_ORACLE

}  // namespace
}  // namespace wsync::replica

int main(int argc, char* argv[]) {
#ifdef WSYNC_SGLANG_ORACLE
  // The SGLang oracle runs in the venv tests/replica/sglang_venv.sh creates; that script runs this binary with
  // WSYNC_PYTHON set (and skips itself when the venv cannot be created). Without it this is a setup error.
  const char* venv_python = std::getenv("WSYNC_PYTHON");
  if (venv_python == nullptr || !wsync::replica::HasNumpy(venv_python)) {
    std::cerr << "SGLang oracle test: WSYNC_PYTHON must name the SGLang venv's python (run it through "
                 "tests/replica/sglang_venv.sh, as ctest does)\n";
    return 1;
  }
  wsync::replica::g_python = venv_python;
  std::signal(SIGPIPE, SIG_IGN);  // an oracle server that died is a failed case, not a killed test
#else
  wsync::replica::g_python = wsync::replica::FindPython();
#endif
  if (wsync::replica::g_python.empty()) {
    std::cerr << "golden tests skipped: no python3 with numpy found (install python3-numpy, or point WSYNC_PYTHON at "
                 "an interpreter that has numpy)\n";
    return 77;
  }
  return Catch::Session().run(argc, argv);
}
