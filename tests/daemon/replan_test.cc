// The coordinator's re-plan as a pure function (daemon/coordinator/replan.h): at Kimi-K2's scale (32 source nodes x
// 8 trainer ranks, 8 engines x 32 ranks, every rank's real parameter table), timed; kept groups; what it refuses;
// quantization from what the engines report, never from parameter names (daemon/common/quantization.h).

#include "daemon/coordinator/replan.h"

#include <time.h>
#include <xxhash.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>

#include "absl/strings/str_format.h"
#include "daemon/common/config_digest.h"
#include "daemon/common/quantization.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "nlohmann/json.hpp"
#include "replica/model_config.h"
#include "tools/testdata/planned_layout.h"

namespace wsync::daemon {
namespace {

// CPU seconds this thread has run (the planner is single-threaded).
double CpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + ts.tv_nsec * 1e-9;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  REQUIRE(in.good());
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string ModelConfig(const std::string& dir) {
  return ReadFile(std::string(WSYNC_MODELS_DIR) + "/" + dir + "/config.json");
}

v1::RegisterNodeRequest Source(int i, int ranks, int stage = 0) {
  v1::RegisterNodeRequest r;
  r.set_node_id("train" + std::to_string(100 + i));  // ids sort in index order
  r.set_role("source");
  r.set_address(r.node_id() + ":7700");
  r.set_trainer_ranks(ranks);
  r.set_pp_stage(stage);
  return r;
}

// A target node with one engine whose ranks report `ranks`.
v1::RegisterNodeRequest Target(const std::string& id, const std::vector<v1::RankLayout>& ranks) {
  v1::RegisterNodeRequest r;
  r.set_node_id(id);
  r.set_role("target");
  r.set_address(id + ":7701");
  auto* e = r.add_engines();
  e->set_engine_id("engine-" + id);
  e->set_control_address(id + ":30000");
  e->set_kind("reference");
  for (const auto& l : ranks) *e->add_ranks() = l;
  return r;
}

std::vector<v1::RankLayout> Layouts(const std::string& config_json, int tp, int ep, const replica::QuantSpec& q) {
  auto cfg = replica::ModelConfig::FromJson(config_json);
  REQUIRE(cfg.ok());
  std::vector<v1::RankLayout> out;
  for (int rank = 0; rank < tp; ++rank) {
    auto l = testdata::PlannedRankLayout(*cfg, replica::RankParallelism::ForTp(tp, rank, ep), q);
    INFO(l.status().ToString());
    REQUIRE(l.ok());
    out.push_back(*std::move(l));
  }
  return out;
}

struct Membership {
  std::map<std::string, v1::RegisterNodeRequest> nodes;
  std::set<std::string> drained_engines, drained_nodes;
  ReplanInput Input(const std::string& config_json, int64_t epoch) const {
    ReplanInput in;
    in.nodes = &nodes;
    in.drained_engines = &drained_engines;
    in.drained_nodes = &drained_nodes;
    in.membership_epoch = epoch;
    in.model_config_json = config_json;
    return in;
  }
};

// Bytes per (engine, rank) the plan writes, and whether every write lies inside its parameter.
std::map<std::pair<std::string, int>, uint64_t> Written(const Replanned& r) {
  std::map<std::pair<std::string, int>, uint64_t> out;
  for (const auto& p : r.plan) {
    std::map<std::string, uint64_t> sizes;
    REQUIRE(p.layout != nullptr);
    for (const auto& d : p.layout->params()) sizes[d.name()] = d.bytes();
    uint64_t sum = 0;
    for (const auto& w : p.assignment->writes()) {
      auto it = sizes.find(w.param());
      REQUIRE(it != sizes.end());
      REQUIRE(w.offset() + w.length() <= it->second);
      sum += w.length();
    }
    CHECK(sum == p.bytes);
    out[{p.assignment->engine_id(), p.assignment->rank()}] += sum;
  }
  return out;
}

// Kimi-K2's config.json with the 64x64 FP8 blocks its TP32 engines need (128-row blocks do not divide its TP32
// shards), as tests/daemon/message_limits_test.cc uses it.
std::string KimiConfig() {
  auto j = nlohmann::json::parse(ModelConfig("moonshotai__Kimi-K2-Instruct"));
  j["quantization_config"]["weight_block_size"] = {64, 64};
  return j.dump();
}

TEST_CASE(
    "replan: Kimi-K2, 32 source nodes x 8 ranks, 8 engines x 32 ranks: every byte of every rank planned once, "
    "kept when nothing changed") {
  const std::string config = KimiConfig();
  replica::QuantSpec q;
  q.mode = replica::QuantSpec::Mode::kFp8Block;
  q.block_n = q.block_k = 64;
  const std::vector<v1::RankLayout> layouts = Layouts(config, 32, 32, q);
  Membership m;
  constexpr int kEngines = 8, kSources = 32, kRanks = 8;
  for (int e = 0; e < kEngines; ++e) {
    const std::string id = "infer" + std::to_string(e);
    m.nodes[id] = Target(id, layouts);
  }
  for (int s = 0; s < kSources; ++s) {
    v1::RegisterNodeRequest r = Source(s, kRanks);
    m.nodes[r.node_id()] = r;
  }
  uint64_t rank_bytes = 0;  // the independent expectation: what each engine rank's layout holds
  for (const auto& d : layouts[0].params()) rank_bytes += d.bytes();

  const auto t0 = std::chrono::steady_clock::now();
  const double c0 = CpuSeconds();
  auto r = PlanMembership(m.Input(config, 7));
  const double first_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double first_cpu = CpuSeconds() - c0;
  INFO(r.status().ToString());
  REQUIRE(r.ok());
  CHECK(r->sources == kSources);
  CHECK(r->ranks_per_node == kRanks);
  CHECK(r->groups.size() == 1);
  CHECK(r->replanned.size() == 1);
  CHECK(QuantizationName(r->quantization) == "fp8_block [64, 64]");
  const auto written = Written(*r);
  REQUIRE(written.size() == kEngines * 32);
  for (const auto& [who, bytes] : written) {
    INFO(who.first << " rank " << who.second);
    uint64_t want = 0;
    for (const auto& d : layouts[who.second].params()) want += d.bytes();
    CHECK(bytes == want);
  }
  // Every source node gets push lists for its 8 ranks (the automatic source count may leave some empty), and
  // together they push every tensor of the trainer's checkpoint.
  REQUIRE(r->push_filters.size() == kSources);
  std::set<std::string> pushed;
  for (const auto& [id, f] : r->push_filters) {
    REQUIRE(f.size() == kRanks);
    for (const auto& rf : f) pushed.insert(rf.tensor_names().begin(), rf.tensor_names().end());
  }
  auto kimi = replica::ModelConfig::FromJson(config);
  REQUIRE(kimi.ok());
  auto checkpoint = replica::CheckpointTensors(*kimi);
  REQUIRE(checkpoint.ok());
  std::set<std::string> want;
  for (const auto& t : *checkpoint) want.insert(t.name);
  CHECK(pushed == want);
  // What the sources are told: the reported quantization, every assignment of theirs.
  auto configs = SourceConfigurations(m.nodes, config, r->plan, r->push_filters, r->quantization,
                                      [](const PlannedAssignment& p) { return p.Wire(); });
  REQUIRE(configs.size() == kSources);
  size_t targets = 0;
  for (const auto& [id, c] : configs) {
    CHECK(c.quantization() == "fp8_block");
    CHECK(c.weight_block_size_size() == 2);
    CHECK(c.weight_block_size(0) == 64);
    CHECK(c.scale_format().empty());
    targets += c.targets_size();
  }
  CHECK(targets == r->plan.size());
  // What a source's heartbeat reports and the coordinator compares (ConfigureSourceDigest): XXH3-128 of the request's
  // deterministic serialization without its epoch, for these requests of megabytes too (hashed in pieces, never
  // serialized whole), with or without the epoch set.
  size_t largest = 0;
  for (const auto& [id, c] : configs) {
    std::string bytes;
    {
      google::protobuf::io::StringOutputStream sos(&bytes);
      google::protobuf::io::CodedOutputStream cos(&sos);
      cos.SetSerializationDeterministic(true);
      c.SerializeToCodedStream(&cos);
    }
    largest = std::max(largest, bytes.size());
    const XXH128_hash_t h = XXH3_128bits(bytes.data(), bytes.size());
    CHECK(ConfigureSourceDigest(c) == absl::StrFormat("%016x%016x", h.high64, h.low64));
    v1::ConfigureSourceRequest with_epoch = c;
    with_epoch.set_plan_epoch(42);
    CHECK(ConfigureSourceDigest(with_epoch) == ConfigureSourceDigest(c));
  }
  CHECK(largest > (1u << 20));
  // Each assignment's digest was computed once, when the plan was built: a source's configuration key is made of them.
  size_t digest_mismatches = 0;
  for (const auto& p : r->plan) digest_mismatches += p.digest.empty() || p.digest != AssignmentDigest(*p.assignment);
  CHECK(digest_mismatches == 0);

  // Every engine's registration was digested by the first plan (no digests were handed in); the tables are shared
  // per engine rank, not copied per assignment.
  CHECK(r->engines_digested == kEngines);
  {
    std::set<const v1::RankLayout*> tables;
    for (const auto& p : r->plan) tables.insert(p.layout.get());
    CHECK(tables.size() == kEngines * 32);
    CHECK(r->plan.size() >= tables.size());
  }
  // What the coordinator hands in: each engine's digest, computed once when it registered.
  std::map<std::string, std::string> digests;
  for (const auto& [id, n] : m.nodes)
    for (const auto& e : n.engines()) digests[e.engine_id()] = EngineInputDigest(id, n.address(), e);

  // Unchanged membership: the group is kept (same epoch), nothing is planned again, no registration is serialized
  // (the digests handed in), and the kept assignments are the same objects, not copies: cheap by construction.
  const auto t1 = std::chrono::steady_clock::now();
  const double c1 = CpuSeconds();
  auto again = [&] {
    ReplanInput in = m.Input(config, 8);
    in.previous = &r->groups;
    in.engine_digests = &digests;
    return PlanMembership(in);
  }();
  const double kept_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  const double kept_cpu = CpuSeconds() - c1;
  REQUIRE(again.ok());
  CHECK(again->replanned.empty());
  CHECK(again->engines_digested == 0);
  REQUIRE(again->plan.size() == r->plan.size());
  for (size_t i = 0; i < r->plan.size(); ++i) {
    CHECK(again->plan[i].assignment.get() == r->plan[i].assignment.get());
    CHECK(again->plan[i].layout.get() == r->plan[i].layout.get());
    CHECK(again->plan[i].digest == r->plan[i].digest);
  }
  CHECK(again->groups.begin()->second.epoch == 7);
  // A digest that does not match the registrations (an engine re-registered with another table) plans afresh.
  {
    std::map<std::string, std::string> changed = digests;
    changed.begin()->second = "0";
    ReplanInput in = m.Input(config, 8);
    in.previous = &r->groups;
    in.engine_digests = &changed;
    auto replanned = PlanMembership(in);
    REQUIRE(replanned.ok());
    CHECK(replanned->replanned.size() == 1);
    CHECK(replanned->groups.begin()->second.epoch == 8);
  }

  // A drained engine leaves the plan; the others are planned afresh at the new epoch, still whole.
  m.drained_engines.insert("engine-infer3");
  ReplanInput in = m.Input(config, 9);
  in.previous = &r->groups;
  const auto t2 = std::chrono::steady_clock::now();
  const double c2 = CpuSeconds();
  auto drained = PlanMembership(in);
  const double drained_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t2).count();
  const double drained_cpu = CpuSeconds() - c2;
  REQUIRE(drained.ok());
  CHECK(drained->replanned.size() == 1);
  CHECK(drained->groups.begin()->second.epoch == 9);
  const auto w2 = Written(*drained);
  CHECK(w2.size() == (kEngines - 1) * 32);
  for (const auto& [who, bytes] : w2) CHECK(who.first != "engine-infer3");
  std::printf(
      "replan: Kimi-K2 fp8 64x64, %d sources x %d ranks, %d engines x 32 ranks (%zu assignments, %.1f GiB "
      "per engine rank): plan %.2f s (CPU %.2f s), kept %.2f s (CPU %.2f s), one engine drained %.2f s (CPU "
      "%.2f s)\n",
      kSources, kRanks, kEngines, r->plan.size(), rank_bytes / 1073741824.0, first_s, first_cpu, kept_s, kept_cpu,
      drained_s, drained_cpu);
  // The times are printed, not asserted (a loaded machine makes any bound flaky; bench_control measures the
  // coordinator's speed): what is asserted above is that nothing was planned again when nothing changed.
}

// A tiny FP8 model (32x32 blocks) at TP2, every rank reporting `report`.
Membership TinyFp8(const v1::WeightQuantization& report, int engines = 1) {
  const std::string config = ReadFile(WSYNC_TINY_FP8_MODEL);
  replica::QuantSpec q;
  q.mode = replica::QuantSpec::Mode::kFp8Block;
  q.block_n = q.block_k = 32;
  std::vector<v1::RankLayout> layouts = Layouts(config, 2, 1, q);
  for (auto& l : layouts) *l.mutable_quantization() = report;
  Membership m;
  for (int e = 0; e < engines; ++e) m.nodes["t" + std::to_string(e)] = Target("t" + std::to_string(e), layouts);
  for (int s = 0; s < 2; ++s) {
    auto src = Source(s, 1);
    m.nodes[src.node_id()] = src;
  }
  return m;
}

v1::WeightQuantization Fp8(int n, int k, const std::string& scale_format = "") {
  v1::WeightQuantization q;
  q.set_method("fp8_block");
  q.add_block_size(n);
  q.add_block_size(k);
  q.set_scale_format(scale_format);
  return q;
}

TEST_CASE("replan: the quantization is what the engines report; the sources are configured with it") {
  const std::string config = ReadFile(WSYNC_TINY_FP8_MODEL);
  for (const std::string fmt : {"", "ue8m0"}) {
    Membership m = TinyFp8(Fp8(32, 32, fmt));
    auto r = PlanMembership(m.Input(config, 1));
    INFO(r.status().ToString());
    REQUIRE(r.ok());
    auto configs = SourceConfigurations(m.nodes, config, r->plan, r->push_filters, r->quantization,
                                        [](const PlannedAssignment& p) { return p.Wire(); });
    REQUIRE(configs.size() == 2);
    for (const auto& [id, c] : configs) {
      CHECK(c.quantization() == "fp8_block");
      CHECK((c.weight_block_size_size() == 2 && c.weight_block_size(0) == 32 && c.weight_block_size(1) == 32));
      CHECK(c.scale_format() == fmt);  // ue8m0 reaches the sources: nothing guessed it before
    }
  }
}

TEST_CASE("replan: a layout whose parameters are FP8 block scales but that reports no quantization is refused") {
  const std::string config = ReadFile(WSYNC_TINY_FP8_MODEL);
  Membership m = TinyFp8(v1::WeightQuantization());
  auto r = PlanMembership(m.Input(config, 1));
  REQUIRE(!r.ok());
  CHECK(r.status().code() == absl::StatusCode::kFailedPrecondition);
  INFO(r.status().message());
  CHECK(r.status().message().find("engine engine-t0 rank 0: parameter ") != std::string::npos);
  CHECK(r.status().message().find("weight_scale_inv is an FP8 block scale but the engine reports no quantization") !=
        std::string::npos);
}

TEST_CASE(
    "replan: a report that does not match the layout, a malformed report, or engines that disagree are "
    "refused, naming the engine") {
  const std::string config = ReadFile(WSYNC_TINY_FP8_MODEL);
  SECTION("16x16 reported for a layout of 32x32 scales: the layout check names the scale parameter") {
    Membership m = TinyFp8(Fp8(16, 16));
    auto r = PlanMembership(m.Input(config, 1));
    REQUIRE(!r.ok());
    INFO(r.status().message());
    CHECK(r.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(r.status().message().find("weight_scale_inv has") != std::string::npos);
  }
  SECTION("unknown method") {
    v1::WeightQuantization q;
    q.set_method("vllm:awq");
    Membership m = TinyFp8(q);
    auto r = PlanMembership(m.Input(config, 1));
    REQUIRE(!r.ok());
    CHECK(r.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(r.status().message().find("engine engine-t0 rank 0: quantization: unknown method 'vllm:awq'") !=
          std::string::npos);
  }
  SECTION("fp8_block without a block size") {
    v1::WeightQuantization q;
    q.set_method("fp8_block");
    Membership m = TinyFp8(q);
    auto r = PlanMembership(m.Input(config, 1));
    REQUIRE(!r.ok());
    CHECK(r.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(r.status().message().find("block_size [block_n, block_k]") != std::string::npos);
  }
  SECTION("two engines of one group report different scale formats") {
    Membership m = TinyFp8(Fp8(32, 32), 2);
    for (auto& l : *m.nodes["t1"].mutable_engines(0)->mutable_ranks())
      l.mutable_quantization()->set_scale_format("ue8m0");
    auto r = PlanMembership(m.Input(config, 1));
    REQUIRE(!r.ok());
    INFO(r.status().message());
    CHECK(r.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(r.status().message().find(
              "engine engine-t1 rank 0 reports quantization fp8_block [32, 32] ue8m0, engine engine-t0 rank 0 "
              "fp8_block [32, 32]") != std::string::npos);
  }
}

TEST_CASE("replan: membership refusals say why") {
  const std::string config = ReadFile(WSYNC_TINY_FP8_MODEL);
  Membership m = TinyFp8(Fp8(32, 32));
  SECTION("every engine drained") {
    m.drained_engines.insert("engine-t0");
    auto r = PlanMembership(m.Input(config, 1));
    REQUIRE(!r.ok());
    CHECK(r.status().message() == "every engine is drained");
  }
  SECTION("a stage without a node") {
    auto s = Source(5, 1, /*stage=*/2);
    m.nodes[s.node_id()] = s;
    auto r = PlanMembership(m.Input(config, 1));
    REQUIRE(!r.ok());
    CHECK(r.status().message().find("trainer stages must be 0..") != std::string::npos);
  }
  SECTION("strategy local with a drained source") {
    m.drained_nodes.insert("train100");
    ReplanInput in = m.Input(config, 1);
    in.options.strategy = "local";
    auto r = PlanMembership(in);
    REQUIRE(!r.ok());
    CHECK(r.status().message().find("hold their own shards") != std::string::npos);
  }
}

TEST_CASE("quantization: read from a config.json's quantization_config") {
  auto ds = QuantizationFromModelConfig(ModelConfig("deepseek-ai__DeepSeek-V3"));
  REQUIRE(ds.ok());
  CHECK(QuantizationName(*ds) == "fp8_block [128, 128]");
  auto qwen = QuantizationFromModelConfig(ModelConfig("Qwen__Qwen3-8B"));
  REQUIRE(qwen.ok());
  CHECK(QuantizationName(*qwen) == "none");
  auto ue = QuantizationFromModelConfig(
      R"({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}})");
  REQUIRE(ue.ok());
  CHECK(QuantizationName(*ue) == "fp8_block [128, 128] ue8m0");
  auto awq = QuantizationFromModelConfig(R"({"quantization_config": {"quant_method": "awq", "bits": 4}})");
  CHECK(awq.status().code() == absl::StatusCode::kUnimplemented);
  auto per_tensor = QuantizationFromModelConfig(R"({"quantization_config": {"quant_method": "fp8"}})");
  CHECK(per_tensor.status().code() == absl::StatusCode::kUnimplemented);
  auto bad = QuantizationFromModelConfig(R"({"quantization_config": {"quant_method": "fp8", "weight_block_size": 1}})");
  CHECK(bad.status().code() == absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace wsync::daemon
