#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <regex>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"
#include "planner/node_rates.h"
#include "tools/cli/plan_command.h"

namespace wsync::tools {
namespace {

int Run(std::vector<std::string> args) {
  args.insert(args.begin(), "plan");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return RunPlanCommand(static_cast<int>(argv.size()), argv.data());
}

std::string WriteConfig(const std::string& body) {
  char name[] = "/tmp/wsync_plan_cfg_XXXXXX";
  const int fd = mkstemp(name);
  REQUIRE(fd >= 0);
  close(fd);
  std::ofstream(name) << body;
  return name;
}

const char* kLlama = R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 512, "num_hidden_layers": 4,
  "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 1024, "vocab_size": 1024,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16"})";

const char* kMoe = R"({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 256, "num_hidden_layers": 4,
  "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32, "intermediate_size": 512,
  "moe_intermediate_size": 128, "num_experts": 16, "vocab_size": 1024, "torch_dtype": "bfloat16"})";

TEST_CASE("plan command: bad flags exit 2", "[planner][cli]") {
  const std::string cfg = WriteConfig(kLlama);
  const std::vector<std::string> ok = {"--model", cfg, "--train", "tp=2,pp=2,nodes=1", "--infer", "instances=2,tp=4"};
  CHECK(Run(ok) == 0);
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = ok;
    a.insert(a.end(), extra.begin(), extra.end());
    return Run(a);
  };
  CHECK(with({"--bogus"}) == 2);
  CHECK(with({"--strategy", "random"}) == 2);
  CHECK(with({"-w", "yaml"}) == 2);
  CHECK(with({"--nic", "fast"}) == 2);
  CHECK(with({"--weights", "int3"}) == 2);
  CHECK(with({"--executor", "magic"}) == 2);
  CHECK(with({"--replica-load-gbps", "0"}) == 2);
  CHECK(with({"--replica-load-gbps", "abc"}) == 2);
  CHECK(with({"--min-source-mib", "auto"}) == 0);
  CHECK(with({"--min-source-mib", "64"}) == 0);
  CHECK(with({"--min-source-mib", "lots"}) == 2);
  CHECK(with({"--min-source-mib", "-3"}) == 2);
  CHECK(with({"--session-ms", "0"}) == 0);
  CHECK(with({"--session-ms", "-1"}) == 2);
  CHECK(Run({"--model", cfg, "--train", "tp=2,pp=3", "--infer", "instances=1,tp=4"}) == 2);  // 8 ranks, pp=3
  CHECK(Run({"--model", cfg, "--train", "tq=2", "--infer", "instances=1,tp=4"}) == 2);
  CHECK(Run({"--model", cfg, "--train", "tp=2", "--infer", "instances=1,tp=4,ep=3"}) == 2);
  CHECK(Run({"--train", "tp=2", "--infer", "instances=1,tp=4"}) == 2);  // no --model
  CHECK(Run({"--seed-table"}) == 2);                                    // no --models-dir
  CHECK(Run({"--help"}) == 0);
  std::remove(cfg.c_str());
}

// Runs the plan command with its stdout in a file; returns what it printed.
std::string RunCaptured(std::vector<std::string> args, int* code) {
  char name[] = "/tmp/wsync_plan_out_XXXXXX";
  const int fd = mkstemp(name);
  REQUIRE(fd >= 0);
  std::fflush(stdout);
  const int saved = dup(1);
  dup2(fd, 1);
  *code = Run(std::move(args));
  std::fflush(stdout);
  dup2(saved, 1);
  close(saved);
  close(fd);
  std::ifstream f(name);
  std::string out((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::remove(name);
  return out;
}

TEST_CASE("plan command: says which rates it predicts with and where they were measured", "[planner][cli]") {
  const std::string cfg = WriteConfig(kLlama);
  const std::vector<std::string> base = {"--model", cfg, "--train", "tp=2,nodes=1", "--infer", "instances=1,tp=2"};
  auto with = [&](std::vector<std::string> extra, int* code) {
    std::vector<std::string> a = base;
    a.insert(a.end(), extra.begin(), extra.end());
    return RunCaptured(a, code);
  };
  int code = -1;
  // Without --executor the prediction is for wsync's own source daemon (pipelined), not the seed's serial one.
  std::string out = with({}, &code);
  CHECK(code == 0);
  CHECK(out.find("pipelined executor)") != std::string::npos);
  CHECK(with({"--executor", "serial"}, &code).find("serial executor)") != std::string::npos);
  // wsync's executor: the node rates measured by bench/node, when a result was compiled in; else the defaults.
  out = with({"--executor", "pipelined"}, &code);
  CHECK(code == 0);
  if (planner::BuiltinNodeRates().ok()) {
    CHECK(out.find("rates             replica load per node") != std::string::npos);
    CHECK(out.find("bench/node/results/default.json") != std::string::npos);
  } else {
    CHECK(out.find("rates             replica load 4.00 GB/s per source") != std::string::npos);
    with({"--executor", "pipelined", "--node-rates", "builtin"}, &code);
    CHECK(code == 2);  // asked for by name, its absence is an error
  }
  // The seed's executor: per-source rates, the documented defaults.
  out = with({"--executor", "serial"}, &code);
  CHECK(code == 0);
  CHECK(out.find("replica load 4.00 GB/s per source") != std::string::npos);
  CHECK(out.find("from the defaults") != std::string::npos);
  out = with({"--executor", "pipelined", "--replica-load-gbps", "3"}, &code);
  CHECK(code == 0);
  CHECK(out.find("replica load 3.00 GB/s per source") != std::string::npos);
  CHECK(out.find("from the command line") != std::string::npos);
  const std::string rates = WriteConfig(R"({"machine": "test box", "date": "d", "command": "c",
    "node_load_gbps": [[1, 2.5], [2, 4.5]]})");
  out = with({"--executor", "pipelined", "--node-rates", rates, "-w", "json"}, &code);
  CHECK(code == 0);
  CHECK(out.find("test box") != std::string::npos);
  CHECK(out.find("\"node_load_gbps\"") != std::string::npos);
  with({"--node-rates", rates, "--replica-load-gbps", "3"}, &code);
  CHECK(code == 2);  // two sources for one rate
  with({"--node-rates", "/nonexistent.json"}, &code);
  CHECK(code == 2);
  std::remove(rates.c_str());
  std::remove(cfg.c_str());
}

TEST_CASE("plan command: --trainer-tensors and --weights pick the measured curve it predicts with", "[planner][cli]") {
  const std::string cfg = WriteConfig(kLlama);
  const std::string rates = WriteConfig(R"({"machine": "curve box", "date": "d", "command": "c", "curves": {
    "bf16/host/ring": {"gbps": [[1, 2.5], [2, 4.5]], "source": "ring.txt"},
    "bf16/cuda/placement": {"gbps": [[1, 11.5], [2, 13.5]], "source": "cuda.txt"},
    "fp8-passthrough/cuda/placement": {"gbps": [[1, 7.25], [2, 9.75]], "source": "kimi.txt"}}})");
  const std::vector<std::string> base = {"--model",          cfg,          "--train",   "tp=2,nodes=1", "--infer",
                                         "instances=1,tp=2", "--executor", "pipelined", "--node-rates", rates};
  struct Want {
    std::vector<std::string> flags;
    std::string curve, text;
  };
  const std::vector<Want> wants = {
      {{}, "bf16/cuda/placement", "1 rank 11.5 GB/s, 2 ranks 13.5 GB/s"},  // the default: CUDA tensors
      {{"--trainer-tensors", "cuda"}, "bf16/cuda/placement", "1 rank 11.5 GB/s, 2 ranks 13.5 GB/s"},
      {{"--trainer-tensors", "host"}, "bf16/host/ring", "1 rank 2.5 GB/s, 2 ranks 4.5 GB/s"},
      {{"--weights", "fp8:64"}, "fp8-passthrough/cuda/placement", "1 rank 7.2 GB/s, 2 ranks 9.8 GB/s"},
  };
  for (const Want& w : wants) {
    INFO(w.curve);
    std::vector<std::string> a = base;
    a.insert(a.end(), w.flags.begin(), w.flags.end());
    int code = -1;
    const std::string table = RunCaptured(a, &code);
    REQUIRE(code == 0);
    CHECK(table.find(w.text) != std::string::npos);
    CHECK(table.find(w.curve) != std::string::npos);
    CHECK(table.find("curve box") != std::string::npos);
    a.insert(a.end(), {"-w", "json"});
    const std::string json = RunCaptured(a, &code);
    REQUIRE(code == 0);
    CHECK(json.find(w.curve) != std::string::npos);
  }
  // host tensors: no placement curve for them, the ring's stands in and the line says so.
  int code = -1;
  std::vector<std::string> a = base;
  a.insert(a.end(), {"--trainer-tensors", "host"});
  CHECK(RunCaptured(a, &code).find("stands in for bf16/host/placement") != std::string::npos);
  a = base;
  a.insert(a.end(), {"--trainer-tensors", "tpu"});
  RunCaptured(a, &code);
  CHECK(code == 2);
  std::remove(rates.c_str());
  std::remove(cfg.c_str());
}

// What a plan's output says regardless of how long building it took (the one figure that differs between runs).
std::string WithoutBuildTime(std::string out, bool json) {
  if (json) {
    auto j = nlohmann::json::parse(out);
    j.erase("build_ms");
    return j.dump(2);
  }
  return std::regex_replace(out, std::regex(R"(\(built in [0-9.]+ ms\))"), "(built in - ms)");
}

TEST_CASE("plan command: --relay off prints today's plan byte for byte", "[planner][cli][relay]") {
  const std::string cfg = WriteConfig(kMoe);
  for (const std::vector<std::string>& shape :
       {std::vector<std::string>{"--train", "tp=2,pp=2,nodes=1", "--infer", "instances=4,tp=2"},
        std::vector<std::string>{"--train", "ep=8", "--infer", "instances=3,tp=4,ep=4", "--strategy", "seed"},
        std::vector<std::string>{"--train", "tp=2,nodes=1,gpus=4", "--infer", "instances=8,tp=1", "--nic", "1x100"}}) {
    for (bool json : {false, true}) {
      std::vector<std::string> a = {"--model", cfg, "--tasks"};
      a.insert(a.end(), shape.begin(), shape.end());
      if (json) a.insert(a.end(), {"-w", "json"});
      int c1 = -1, c2 = -1;
      const std::string today = RunCaptured(a, &c1);
      a.insert(a.end(), {"--relay", "off"});
      const std::string off = RunCaptured(a, &c2);
      REQUIRE(c1 == 0);
      REQUIRE(c2 == 0);
      CHECK(today.find("relay") == std::string::npos);
      CHECK(WithoutBuildTime(off, json) == WithoutBuildTime(today, json));
    }
  }
  std::remove(cfg.c_str());
}

TEST_CASE("plan command: --relay prints the tree and per-hop times", "[planner][cli][relay]") {
  const std::string cfg = WriteConfig(kMoe);
  const std::vector<std::string> base = {"--model", cfg, "--train", "tp=2,nodes=1", "--infer", "instances=4,tp=2"};
  auto with = [&](std::vector<std::string> extra, int* code) {
    std::vector<std::string> a = base;
    a.insert(a.end(), extra.begin(), extra.end());
    return RunCaptured(a, code);
  };
  int code = -1;
  const std::string table = with({"--relay", "2"}, &code);
  REQUIRE(code == 0);
  for (const char* want : {"relay             2: 1 layout group", "trainer egress", "relay predicted",
                           "degree 2, depth 2", "sources -> 0", "0 -> 1", "0 -> 2", "1 -> 3"}) {
    INFO(want << "\n" << table);
    CHECK(table.find(want) != std::string::npos);
  }
  const std::string js = with({"--relay", "2", "-w", "json"}, &code);
  REQUIRE(code == 0);
  const auto j = nlohmann::json::parse(js);
  const auto& r = j.at("relay");
  CHECK(r.at("relayed") == true);
  CHECK(r.at("groups").size() == 1);
  CHECK(r.at("groups")[0].at("degree") == 2);
  CHECK(r.at("groups")[0].at("depth") == 2);
  CHECK(r.at("hops").size() == 4);
  // One copy leaves the trainer instead of four; the headline prediction is the relay's.
  CHECK(r.at("trainer_egress_bytes").get<uint64_t>() * 4 == r.at("direct_trainer_egress_bytes").get<uint64_t>());
  CHECK(j.at("predicted_s").get<double>() == r.at("predicted_s").get<double>());
  for (const auto& h : r.at("hops")) {
    if (h.at("parent") == -1) continue;
    CHECK(h.at("first_chunk_s").get<double>() > 0);
    // A hop's bytes part is one chunk (at most the copy); the rest is the per-hop check.
    CHECK(h.at("chunk_s").get<double>() - r.at("hop_ms").get<double>() / 1e3 <= h.at("copy_s").get<double>() + 1e-12);
  }
  // auto: says what it decided and why; one instance is never relayed.
  CHECK(with({"--relay", "auto"}, &code).find("relay             auto") != std::string::npos);
  CHECK(code == 0);
  // The link-rate model (what the coordinator's auto decides with): one trainer node's 8 NICs against 4 instances
  // of 2 ranks (one NIC each on an 8-NIC node): direct takes 4 copies over 8 NICs, less than one copy over an
  // instance's 2 NICs, so direct, as relay_shape.h's formulas say; its rows are printed and in the JSON.
  CHECK(table.find("link model        auto: direct predicted") != std::string::npos);
  const auto& lm = r.at("link_model");
  CHECK(lm.at("relayed") == false);
  CHECK(lm.at("links").at("instances") == 4);
  CHECK(lm.at("links").at("source_nics") == 8);
  CHECK(lm.at("links").at("instance_nics") == 2);
  CHECK(lm.at("candidates").size() == 3);
  CHECK(lm.at("direct").at("trainer_egress_bytes").get<uint64_t>() ==
        r.at("direct_trainer_egress_bytes").get<uint64_t>());
  CHECK(lm.at("chosen").at("trainer_egress_bytes").get<uint64_t>() ==
        r.at("direct_trainer_egress_bytes").get<uint64_t>());
  std::vector<std::string> one = {"--model",          cfg,       "--train", "tp=2,nodes=1", "--infer",
                                  "instances=1,tp=2", "--relay", "auto"};
  CHECK(RunCaptured(one, &code).find("direct (one instance") != std::string::npos);
  for (const std::vector<std::string>& bad :
       {std::vector<std::string>{"--relay", "0"}, std::vector<std::string>{"--relay", "wide"},
        std::vector<std::string>{"--relay", "2", "--relay-chunk-kib", "0"},
        std::vector<std::string>{"--relay", "2", "--relay-hop-ms", "-1"}}) {
    with(bad, &code);
    CHECK(code == 2);
  }
  std::remove(cfg.c_str());
}

TEST_CASE("plan command: model errors exit 1", "[planner][cli]") {
  CHECK(Run({"--model", "/nonexistent/config.json", "--train", "tp=1", "--infer", "instances=1,tp=1"}) == 1);
  const std::string bad = WriteConfig("{not json");
  CHECK(Run({"--model", bad, "--train", "tp=1", "--infer", "instances=1,tp=1"}) == 1);
  std::remove(bad.c_str());
  const std::string moe = WriteConfig(kMoe);
  CHECK(Run({"--model", moe, "--train", "tp=1", "--infer", "instances=1,tp=6,ep=3"}) == 1);  // 16 experts, ep 3
  CHECK(Run({"--model", moe, "--train", "ep=8", "--infer", "instances=2,tp=4,ep=4", "-w", "json", "--tasks"}) == 0);
  std::remove(moe.c_str());
}

TEST_CASE("model adapter: TP=1 engine layout holds exactly the checkpoint's bytes", "[planner][cli]") {
  const std::string cfg = WriteConfig(kLlama);
  planner::ClusterSpec c;
  c.trainer.pp = 2;
  c.engine.tp = 1;
  auto in = PlanInputFromModel(cfg, c, {});
  REQUIRE(in.ok());
  uint64_t hf = 0, engine = 0;
  for (const auto& h : in->hf_tensors) hf += h.bytes;
  for (const auto& p : in->layouts[0].params) engine += p.bytes;
  CHECK(hf == engine);
  CHECK(hf == 2ull * (2 * 1024 * 512 + 512 + 4 * (2 * 512 + 512 * (512 + 2 * 128) + 512 * 512 + 3 * 512 * 1024)));
  // Embeddings on the first stage, lm_head on the last, layers split evenly.
  for (const auto& p : in->layouts[0].params) {
    if (p.name == "model.embed_tokens.weight") CHECK(p.stage == 0);
    if (p.name == "lm_head.weight") CHECK(p.stage == 1);
    if (p.name.rfind("model.layers.1.", 0) == 0) CHECK(p.stage == 0);
    if (p.name.rfind("model.layers.2.", 0) == 0) CHECK(p.stage == 1);
  }
  // FP8: weights shrink to 1 byte per element plus float32 block scales.
  auto fp8 = PlanInputFromModel(cfg, c, {128});
  REQUIRE(fp8.ok());
  uint64_t q = 0;
  for (const auto& h : fp8->hf_tensors) q += h.bytes;
  CHECK(q < hf * 6 / 10);
  std::remove(cfg.c_str());
}

}  // namespace
}  // namespace wsync::tools
