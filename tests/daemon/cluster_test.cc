// End-to-end tests on a real local cluster (separate processes): updates verified bit-exactly by the reference
// engine's own loader, bad input rejected with an error naming the tensor and nothing written to any engine, a
// trainer dying mid-bucket, and the lifecycle recorded in the coordinator's history.

#include <catch2/catch.hpp>

#include "absl/strings/match.h"

#include <grpcpp/grpcpp.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <thread>
#include <tuple>

#include "absl/strings/match.h"
#include "client/coordinator_client.h"
#include "client/trainer_client.h"
#include "proto/status_convert.h"
#include "replica/model_config.h"
#include "tests/daemon/cluster.h"
#include "tests/daemon/helpers.h"
#include "tools/testdata/weight_gen.h"
#include "wsync/v1/daemon.grpc.pb.h"
#include "wsync/v1/engine.grpc.pb.h"

namespace wsync {
namespace {

using testing::Cluster;
using testing::ClusterOptions;
using testing::Checksums;
using testing::Info;
using testing::PushGenerated;
using testing::Verify;

const char* kBin = WSYNC_BIN_DIR;
const char* kModel = WSYNC_TINY_MODEL;

// The data-path transport under test: tcp by default; the rdma CTest runs the [verbs] case inside a soft-RoCE VM
// with WSYNC_TEST_TRANSPORT=verbs.
std::string TransportUnderTest() {
  const char* t = std::getenv("WSYNC_TEST_TRANSPORT");
  return t ? t : "tcp";
}

// One full update from an in-process trainer rank.
void GoodUpdate(Cluster& cl, client::TrainerClient& trainer, int64_t v) {
  static const auto specs = testing::Specs(kModel);
  client::CoordinatorClient coord(cl.coordinator);
  auto b = coord.BeginUpdate(v);
  REQUIRE(b.ok());
  auto names = trainer.BeginPush(v);
  REQUIRE(names.ok());
  REQUIRE(!names->empty());
  for (const auto& n : *names) REQUIRE(PushGenerated(trainer, specs.at(n), v).ok());
  REQUIRE(trainer.EndPush(v).ok());
  auto rec = coord.CommitUpdate(v, 30);
  INFO((rec.ok() ? "" : rec.status().ToString()));
  REQUIRE(rec.ok());
  CHECK(rec->success());
}

// The coordinator committed `step` and engine 0's own loader verifies every parameter of it.
void CheckCommittedAndVerified(Cluster& cl, int64_t step) {
  client::CoordinatorClient coord(cl.coordinator);
  auto st = coord.Status();
  REQUIRE(st.ok());
  CHECK(st->current_version() == std::to_string(step));
  auto v = Verify(cl.engines[0], step);
  CHECK(v.ok());
  CHECK(v.params_checked() > 0);
}

TEST_CASE("cluster: updates land bit-exactly; bad buckets are rejected whole and write nothing") {
  ClusterOptions o;
  o.bin_dir = kBin;
  o.model = kModel;
  o.transport = TransportUnderTest();
  Cluster cl(o);
  INFO("cluster logs in " << cl.dir());
  const auto specs = testing::Specs(kModel);
  auto trainer = testing::ConnectTrainer(cl.trainer_sockets[0]);
  REQUIRE(trainer.ok());
  client::CoordinatorClient coord(cl.coordinator);

  GoodUpdate(cl, **trainer, 1);
  auto ok1 = Verify(cl.engines[0], 1);
  CHECK(ok1.ok());
  CHECK(ok1.params_checked() > 0);
  {
    // The engine's ranks attached several memfd segments each; status shows the engine as the coordinator sees it.
    auto st = coord.Status();
    REQUIRE(st.ok());
    int engines = 0;
    for (const auto& n : st->nodes())
      for (const auto& e : n.engine_details()) {
        ++engines;
        CHECK(e.engine_id() == "engine0");
        CHECK(e.kind() == "reference");
        CHECK(e.address() == cl.engines[0]);
        CHECK(e.state() == "serving");
        CHECK(e.ranks() == 2);
      }
    CHECK(engines == 1);
    const std::string log = cl.Log("target0");
    CHECK(absl::StrContains(log, "engine engine0 rank 1 attached (kind reference, mode direct)"));
    CHECK(absl::StrContains(log, "in 3 segments"));
  }
  CHECK(Verify(cl.engines[0], 2).ok() == false);  // the check can fail: step 2's weights differ
  CHECK(Info(cl.engines[0]).weight_version() == "1");
  CHECK_FALSE(Info(cl.engines[0]).paused());
  const auto before = Checksums(cl.engines[0], 2);

  // Each bad bucket also carries good tensors that complete parameters on their own (the norms): nothing of the
  // bucket may reach the engine.
  const replica::TensorSpec& norm = specs.at("model.norm.weight");
  const replica::TensorSpec& q = specs.at("model.layers.0.self_attn.q_proj.weight");
  struct Bad {
    std::string what, expect;
    std::function<absl::Status(client::TrainerClient&, int64_t)> push;
  };
  std::vector<Bad> bad = {
      {"unknown tensor name", "model.layers.0.self_attn.bogus.weight",
       [&](client::TrainerClient& t, int64_t v) {
         replica::TensorSpec s = norm;
         s.name = "model.layers.0.self_attn.bogus.weight";
         return PushGenerated(t, s, v);
       }},
      {"wrong shape", "q_proj",
       [&](client::TrainerClient& t, int64_t v) {
         replica::TensorSpec s = q;
         s.shape = {s.shape[0] / 2, s.shape[1] * 2};  // same bytes, wrong shape
         return PushGenerated(t, s, v);
       }},
      {"wrong dtype", "q_proj",
       [&](client::TrainerClient& t, int64_t v) {
         replica::TensorSpec s = q;
         s.dtype = DType::kI32;
         s.shape = {s.shape[0], s.shape[1] / 2};
         return PushGenerated(t, s, v);
       }},
      {"duplicate tensor", "model.norm.weight",
       [&](client::TrainerClient& t, int64_t v) { return PushGenerated(t, norm, v); }},
  };
  int64_t v = 2;
  for (const auto& b : bad) {
    INFO("case: " << b.what);
    REQUIRE(coord.BeginUpdate(v).ok());
    REQUIRE((*trainer)->BeginPush(v).ok());
    REQUIRE(PushGenerated(**trainer, norm, v).ok());
    REQUIRE(PushGenerated(**trainer, specs.at("model.layers.0.input_layernorm.weight"), v).ok());
    REQUIRE(b.push(**trainer, v).ok());  // the ring takes anything well-formed; the daemon judges it
    absl::Status st = (*trainer)->Flush();
    INFO(st.ToString());
    CHECK(st.code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(st.message()).find(b.expect) != std::string::npos);
    CHECK(std::string(st.message()).find("nothing from it was written") != std::string::npos);
    // The source failed the update at the rejected bucket and told the coordinator, which ended it at once (the
    // push row): the trainer's EndPush may come before or after that, the commit answers the recorded failure.
    const absl::Status ended = (*trainer)->EndPush(v);
    CHECK((ended.ok() || ended.code() == absl::StatusCode::kFailedPrecondition));
    auto rec = coord.CommitUpdate(v, 10);
    CHECK(rec.status().code() == absl::StatusCode::kAborted);
    CHECK(absl::StrContains(rec.status().message(), "source node train0"));
    CHECK(Checksums(cl.engines[0], 2) == before);
    auto info = Info(cl.engines[0]);
    CHECK(info.weight_version() == "1");
    // Nothing of it was written (the checksums above): the push row resumed the engine at version 1.
    CHECK_FALSE(info.paused());
    ++v;
  }
  CHECK(Verify(cl.engines[0], 1).ok());

  // A bucket committed after the update ended is refused and writes nothing.
  GoodUpdate(cl, **trainer, v);
  CHECK(Verify(cl.engines[0], v).ok());
  const auto after_good = Checksums(cl.engines[0], 2);
  REQUIRE(PushGenerated(**trainer, norm, v + 1).ok());
  absl::Status late = (*trainer)->Flush();
  CHECK(late.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(std::string(late.message()).find("no update is open") != std::string::npos);
  CHECK(Checksums(cl.engines[0], 2) == after_good);

  // History: every update recorded, failures with their error, successes with per-phase timings.
  auto h = coord.History(100);
  REQUIRE(h.ok());
  REQUIRE(h->records_size() == static_cast<int>(bad.size()) + 2);
  CHECK(h->records(0).success());
  CHECK_FALSE(h->records(1).success());
  CHECK(h->records(1).error().find("rejected") != std::string::npos);
  std::map<std::string, double> phases;
  for (const auto& p : h->records(0).phases()) phases[p.phase()] = p.seconds();
  for (const char* p : {"pause", "configure", "push", "post_process", "set_version", "continue"})
    CHECK(phases.count(p) == 1);
  CHECK(h->records(0).bytes() > 0);
}

TEST_CASE("cluster: a trainer that dies mid-bucket corrupts nothing; its rank reconnects and the update completes") {
  ClusterOptions o;
  o.bin_dir = kBin;
  o.model = kModel;
  o.transport = TransportUnderTest();
  o.trainer_ranks = 2;
  Cluster cl(o);
  INFO("cluster logs in " << cl.dir());
  client::CoordinatorClient coord(cl.coordinator);
  REQUIRE(coord.BeginUpdate(1).ok());
  // Rank 1 pushes its share normally; rank 0 dies half-way through a tensor, then a new process takes its place.
  const std::vector<std::string> common = {std::string(kBin) + "/wsync-trainer-demo", "--daemon", cl.trainer_sockets[0],
                                           "--model", kModel, "--updates", "1"};
  auto args = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = common;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  CHECK(cl.Run("trainer0-dies", args({"--local-rank", "0", "--crash-after-bytes", "20000"}),
               std::chrono::seconds(60)) == 3);
  // Back within the source's --rank-grace (5 s), so the update goes on.
  CHECK(cl.Run("trainer0", args({"--local-rank", "0"}), std::chrono::seconds(60)) == 0);
  CHECK(cl.Run("trainer1", args({"--local-rank", "1", "--global-rank", "1"}), std::chrono::seconds(60)) == 0);
  auto rec = coord.CommitUpdate(1, 30);
  INFO((rec.ok() ? "" : rec.status().ToString()));
  REQUIRE(rec.ok());
  auto v = Verify(cl.engines[0], 1);
  for (const auto& m : v.mismatches()) UNSCOPED_INFO(m);
  CHECK(v.ok());
}

TEST_CASE("cluster: a trainer rank that dies and stays away fails the update within seconds, naming rank and node") {
  ClusterOptions o;
  o.bin_dir = kBin;
  o.model = kModel;
  o.transport = "tcp";
  o.trainer_ranks = 2;
  Cluster cl(o);
  INFO("cluster logs in " << cl.dir());
  client::CoordinatorClient coord(cl.coordinator);
  const std::string initial_version = Info(cl.engines[0]).weight_version();
  const std::vector<std::string> common = {std::string(kBin) + "/wsync-trainer-demo", "--daemon", cl.trainer_sockets[0],
                                           "--model", kModel, "--updates", "1"};
  auto args = [&](int64_t v, std::vector<std::string> extra) {
    std::vector<std::string> a = common;
    a.insert(a.end(), {"--first-version", std::to_string(v)});
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  REQUIRE(coord.BeginUpdate(1).ok());
  CHECK(cl.Run("trainer1", args(1, {"--local-rank", "1", "--global-rank", "1"}), std::chrono::seconds(60)) == 0);
  CHECK(cl.Run("trainer0-dies", args(1, {"--local-rank", "0", "--crash-after-bytes", "20000"}),
               std::chrono::seconds(60)) == 3);
  const auto t0 = std::chrono::steady_clock::now();
  auto rec = coord.CommitUpdate(1, 120);  // the commit's own timeout is far longer than the rank grace
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO("commit after " << waited << " s: " << rec.status().ToString());
  REQUIRE_FALSE(rec.ok());
  const std::string msg(rec.status().message());
  CHECK(absl::StrContains(msg, "trainer rank 0 on node train0 exited"));
  CHECK(waited < 15);
  auto info = Info(cl.engines[0]);
  CHECK(info.paused());
  CHECK(info.weight_version() == initial_version);  // never labelled or resumed with a partial update

  // Both ranks come back for update 2, which lands bit-exactly.
  REQUIRE(coord.BeginUpdate(2).ok());
  CHECK(cl.Run("trainer0", args(2, {"--local-rank", "0"}), std::chrono::seconds(60)) == 0);
  CHECK(cl.Run("trainer1b", args(2, {"--local-rank", "1", "--global-rank", "1"}), std::chrono::seconds(60)) == 0);
  auto rec2 = coord.CommitUpdate(2, 30);
  INFO((rec2.ok() ? "" : rec2.status().ToString()));
  REQUIRE(rec2.ok());
  CHECK(Verify(cl.engines[0], 2).ok());
}

TEST_CASE("cluster: two engine instances share a source replica; three updates verified") {
  ClusterOptions o;
  o.bin_dir = kBin;
  o.model = kModel;
  o.transport = TransportUnderTest();
  o.engines = 2;
  o.sources = 2;
  o.trainer_ranks = 2;
  Cluster cl(o);
  INFO("cluster logs in " << cl.dir());
  std::vector<std::unique_ptr<testing::Process>> trainers;
  for (int s = 0; s < 2; ++s)
    for (int r = 0; r < 2; ++r) {
      std::vector<std::string> a = {std::string(kBin) + "/wsync-trainer-demo", "--daemon", cl.trainer_sockets[s], "--model",
                                    kModel, "--local-rank", std::to_string(r), "--global-rank",
                                    std::to_string(s * 2 + r), "--updates", "3"};
      if (s == 0 && r == 0)
        for (const std::string& x : {std::string("--drive"), std::string("--coordinator"), cl.coordinator,
                                    std::string("--verify-engine"), cl.engines[0], std::string("--verify-engine"),
                                    cl.engines[1]})
          a.push_back(x);
      trainers.push_back(std::make_unique<testing::Process>(a, cl.dir() + "/trainer" + std::to_string(s * 2 + r) + ".log"));
    }
  CHECK(cl.WaitAll(trainers, std::chrono::seconds(120)));
  client::CoordinatorClient coord(cl.coordinator);
  auto st = coord.Status();
  REQUIRE(st.ok());
  CHECK(st->current_version() == "3");
  CHECK(st->plan_size() == 4);
  for (const auto& e : cl.engines) CHECK(Verify(e, 3).ok());
}

// Runs `updates` updates on `cl` with every trainer rank a separate process (rank 0 drives and asks every engine to
// verify itself); returns when all exited.
void RunTrainers(Cluster& cl, const ClusterOptions& o, int updates, const std::vector<std::string>& extra = {}) {
  const std::string model = o.model;
  std::vector<std::unique_ptr<testing::Process>> trainers;
  for (int s = 0; s < o.sources; ++s)
    for (int r = 0; r < o.trainer_ranks; ++r) {
      const int g = s * o.trainer_ranks + r;
      std::vector<std::string> a = {std::string(kBin) + "/wsync-trainer-demo", "--daemon", cl.trainer_sockets[s], "--model",
                                    model, "--local-rank", std::to_string(r), "--global-rank", std::to_string(g),
                                    "--updates", std::to_string(updates)};
      a.insert(a.end(), extra.begin(), extra.end());
      if (g == 0) {
        a.insert(a.end(), {"--drive", "--coordinator", cl.coordinator});
        for (const auto& e : cl.engines) a.insert(a.end(), {"--verify-engine", e});
      }
      trainers.push_back(std::make_unique<testing::Process>(a, cl.dir() + "/trainer" + std::to_string(g) + ".log"));
    }
  CHECK(cl.WaitAll(trainers, std::chrono::seconds(120)));
}

TEST_CASE("cluster: a balanced plan splits parameters across sources; updates verified") {
  ClusterOptions o;
  o.bin_dir = kBin;
  o.model = kModel;
  o.transport = TransportUnderTest();
  o.engines = 2;
  o.sources = 3;  // one rank per node: a parameter split between ranks is split between nodes
  o.trainer_ranks = 1;
  o.coordinator_args = {"--strategy", "balanced", "--min-source-mib", "0", "--snap-kib", "0"};
  Cluster cl(o);
  INFO("cluster logs in " << cl.dir());
  RunTrainers(cl, o, 2);
  client::CoordinatorClient coord(cl.coordinator);
  auto st = coord.Status();
  REQUIRE(st.ok());
  CHECK(st->current_version() == "2");
  std::set<std::string> sources_used;
  for (const auto& p : st->plan()) sources_used.insert(p.source_node());
  CHECK(sources_used.size() == 3);  // every node writes
  CHECK(st->plan_size() > 4);       // some engine rank is written by two sources
  for (const auto& e : cl.engines) CHECK(Verify(e, 2).ok());
}

TEST_CASE("cluster: a Qwen3-MoE engine with expert parallelism (tp2 ep2) behind a balanced plan; verified") {
  // The reference engine's own loader places every expert (stacked w13/w2 per EP rank, router) independently of
  // wsync's replica; the coordinator checks the engine's reported layout against replica/'s before configuring.
  ClusterOptions o;
  o.bin_dir = kBin;
  o.model = WSYNC_TINY_MOE_MODEL;
  o.transport = TransportUnderTest();
  o.engines = 1;
  o.ep = 2;
  o.sources = 2;
  o.trainer_ranks = 1;
  o.coordinator_args = {"--min-source-mib", "0", "--snap-kib", "0"};
  Cluster cl(o);
  INFO("cluster logs in " << cl.dir());
  RunTrainers(cl, o, 2);
  client::CoordinatorClient coord(cl.coordinator);
  auto st = coord.Status();
  REQUIRE(st.ok());
  CHECK(st->current_version() == "2");
  CHECK(Verify(cl.engines[0], 2).ok());
}

TEST_CASE("cluster: an FP8 block-quantized engine: the sources quantize bf16 pushes; verified by the engine's own "
          "encoder") {
  // The engine's layout carries fp8 weights and float32 weight_scale_inv (32x32 blocks) and reports that
  // quantization (RankLayout.quantization); the coordinator configures the sources to quantize to it. The engine checks codes and scales with its own naive encoder.
  ClusterOptions o;
  o.bin_dir = kBin;
  o.model = WSYNC_TINY_FP8_MODEL;
  o.transport = TransportUnderTest();
  o.engines = 1;
  o.sources = 2;
  o.trainer_ranks = 1;
  o.coordinator_args = {"--min-source-mib", "0", "--snap-kib", "0"};
  Cluster cl(o);
  INFO("cluster logs in " << cl.dir());
  RunTrainers(cl, o, 2);
  CheckCommittedAndVerified(cl, 2);
}

TEST_CASE("cluster: an FP8 engine whose trainer ranks push pre-quantized weights (BeginPush's FP8 offer); verified by "
          "the engine's own encoder") {
  // The ranks quantize every tensor the daemon offers themselves (codes + `_scale_inv`, as a GPU rank with gpu_fp8
  // does; here with the CPU quantizer) and push the rest as bf16; the sources pass the codes through.
  ClusterOptions o;
  o.bin_dir = kBin;
  o.model = WSYNC_TINY_FP8_MODEL;
  o.transport = TransportUnderTest();
  o.engines = 1;
  o.sources = 2;
  o.trainer_ranks = 1;
  o.coordinator_args = {"--min-source-mib", "0", "--snap-kib", "0"};
  Cluster cl(o);
  INFO("cluster logs in " << cl.dir());
  RunTrainers(cl, o, 2, {"--prequantize", "host"});
  CheckCommittedAndVerified(cl, 2);
  // Every rank was offered tensors and pushed them quantized (the demo fails when an FP8 update offers none).
  int offered = 0;
  for (int g = 0; g < 2; ++g) {
    std::ifstream f(cl.dir() + "/trainer" + std::to_string(g) + ".log");
    std::string line;
    while (std::getline(f, line)) {
      int pushed = 0, off = 0;
      if (std::sscanf(line.c_str(), "update 2: %d tensors pushed pre-quantized to FP8 (host; %d offered)", &pushed,
                      &off) == 2) {
        CHECK(pushed == off);
        offered += off;
      }
    }
  }
  CHECK(offered >= 14);  // 2 layers x 7 linear weights, split over the two sources
}

// DeepSeek-V3-shaped MLA model (q_lora: fused_qkv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj; a dense first layer
// then MoE layers with a shared expert and the noaux_tc router bias in float32), tp2 ep2, three sources under a
// balanced plan that splits parameters between them. The reference engine's own loader computes every expected byte.
TEST_CASE("cluster: a DeepSeek-V3-shaped MLA + MoE engine (tp2 ep2) behind a balanced plan over three sources; "
          "verified") {
  ClusterOptions o;
  o.bin_dir = kBin;
  o.model = WSYNC_TINY_MLA_MODEL;
  o.transport = TransportUnderTest();
  o.engines = 1;
  o.ep = 2;
  o.sources = 3;
  o.trainer_ranks = 1;
  o.coordinator_args = {"--strategy", "balanced", "--min-source-mib", "0", "--snap-kib", "0"};
  Cluster cl(o);
  INFO("cluster logs in " << cl.dir());
  RunTrainers(cl, o, 2);
  client::CoordinatorClient coord(cl.coordinator);
  auto st = coord.Status();
  REQUIRE(st.ok());
  CHECK(st->current_version() == "2");
  std::set<std::string> sources_used;
  std::set<std::pair<std::string, int>> engine_ranks;
  for (const auto& p : st->plan()) {
    sources_used.insert(p.source_node());
    engine_ranks.insert({p.engine_id(), p.rank()});
  }
  CHECK(sources_used.size() == 3);
  CHECK(st->plan_size() > static_cast<int>(engine_ranks.size()));  // some engine rank is written by two sources
  auto v = Verify(cl.engines[0], 2);
  CHECK(v.ok());
  CHECK(v.ranks() == 2);
  CHECK(v.params_checked() > 0);
  // The check can fail: the weights of step 2 are not those of step 1.
  CHECK_FALSE(Verify(cl.engines[0], 1).ok());
}

// The same model FP8 block-quantized (16x16 blocks): every MLA projection, dense MLP, shared and routed expert as fp8
// codes with float32 block scales (per expert, the up half's scales in their own block rows), the four FP8 KV-cache
// scales of SGLang's MLA attention modules; router, norms and embeddings stay bf16. The sources quantize the bf16
// pushes; the engine checks with its own encoder.
TEST_CASE("cluster: a DeepSeek-V3-shaped FP8 engine (tp2 ep2): MLA, shared and routed experts block-quantized by the "
          "sources; verified by the engine's own encoder") {
  ClusterOptions o;
  o.bin_dir = kBin;
  o.model = WSYNC_TINY_MLA_FP8_MODEL;
  o.transport = TransportUnderTest();
  o.engines = 1;
  o.ep = 2;
  o.sources = 2;
  o.trainer_ranks = 1;
  o.coordinator_args = {"--strategy", "balanced", "--min-source-mib", "0", "--snap-kib", "0"};
  Cluster cl(o);
  INFO("cluster logs in " << cl.dir());
  RunTrainers(cl, o, 2);
  CheckCommittedAndVerified(cl, 2);
  CHECK_FALSE(Verify(cl.engines[0], 1).ok());
}

// DeepSeek-V2-Lite-shaped MLA without q_lora (q_proj and kv_a_proj_with_mqa as separate parameters), greedy routing
// (no correction bias), tp2 without expert parallelism, a PP=2 trainer.
TEST_CASE("cluster: a DeepSeek-V2-Lite-shaped MLA engine (no q_lora, tp2) with a PP=2 trainer; verified") {
  ClusterOptions o;
  o.bin_dir = kBin;
  o.model = WSYNC_TINY_MLA_NOQLORA_MODEL;
  o.transport = TransportUnderTest();
  o.engines = 1;
  o.sources = 2;
  o.pp = 2;
  o.trainer_ranks = 1;
  o.coordinator_args = {"--min-source-mib", "0", "--snap-kib", "0"};
  Cluster cl(o);
  INFO("cluster logs in " << cl.dir());
  RunTrainers(cl, o, 2);
  CheckCommittedAndVerified(cl, 2);
}

// Runs updates [first, first + n) with one trainer process per (source, rank); rank 0 drives and asks `verify` to
// verify themselves after every update. Returns whether every trainer exited 0.
bool RunUpdates(Cluster& cl, const ClusterOptions& o, int64_t first, int n, const std::vector<std::string>& verify) {
  std::vector<std::unique_ptr<testing::Process>> trainers;
  for (int s = 0; s < o.sources; ++s)
    for (int r = 0; r < o.trainer_ranks; ++r) {
      const int g = s * o.trainer_ranks + r;
      std::vector<std::string> a = {std::string(kBin) + "/wsync-trainer-demo", "--daemon", cl.trainer_sockets[s],
                                    "--model", o.model, "--local-rank", std::to_string(r), "--global-rank",
                                    std::to_string(g), "--updates", std::to_string(n), "--first-version",
                                    std::to_string(first)};
      if (g == 0) {
        a.insert(a.end(), {"--drive", "--coordinator", cl.coordinator});
        for (const auto& e : verify) a.insert(a.end(), {"--verify-engine", e});
      }
      trainers.push_back(std::make_unique<testing::Process>(
          a, cl.dir() + "/trainer" + std::to_string(g) + "-v" + std::to_string(first) + ".log"));
    }
  return cl.WaitAll(trainers, std::chrono::seconds(120));
}

// (source node, rank, bytes, plan epoch) of every planned task of `engine`.
std::set<std::tuple<std::string, int, uint64_t, int64_t>> PlanOf(const v1::ClusterStatus& st, const std::string& engine) {
  std::set<std::tuple<std::string, int, uint64_t, int64_t>> out;
  for (const auto& t : st.plan())
    if (t.engine_id() == engine) out.insert({t.source_node(), t.rank(), t.bytes(), t.plan_epoch()});
  return out;
}

int64_t GroupEpoch(const v1::ClusterStatus& st, const std::string& engine) {
  for (const auto& g : st.groups())
    for (const auto& e : g.engines())
      if (e == engine) return g.plan_epoch();
  return -2;
}

const v1::EngineSummary* EngineIn(const v1::ClusterStatus& st, const std::string& engine) {
  for (const auto& n : st.nodes())
    for (const auto& e : n.engine_details())
      if (e.engine_id() == engine) return &e;
  return nullptr;
}

TEST_CASE("cluster: an engine joins: only its group is re-planned; drain and undrain an engine and a source node "
          "through wsyncctl; every update verified") {
  ClusterOptions o;
  o.bin_dir = kBin;
  o.model = kModel;
  o.transport = TransportUnderTest();
  o.engines = 2;
  o.engine_tp = {2, 1};  // two groups: engine0 (tp2) and engine1 (tp1)
  o.sources = 2;
  o.trainer_ranks = 1;
  o.coordinator_args = {"--strategy", "balanced", "--min-source-mib", "0", "--snap-kib", "0"};
  Cluster cl(o);
  INFO("cluster logs in " << cl.dir());
  client::CoordinatorClient coord(cl.coordinator);
  auto status = [&] {
    auto st = coord.Status();
    REQUIRE(st.ok());
    return *st;
  };
  REQUIRE(RunUpdates(cl, o, 1, 1, cl.engines));
  const v1::ClusterStatus s1 = status();
  REQUIRE(s1.groups_size() == 2);
  const auto plan0 = PlanOf(s1, "engine0");
  REQUIRE(!plan0.empty());

  // engine2 (tp1) joins engine1's group.
  cl.AddEngine(1);
  for (int i = 0; i < 200 && EngineIn(status(), "engine2") == nullptr; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  REQUIRE(EngineIn(status(), "engine2") != nullptr);
  REQUIRE(RunUpdates(cl, o, 2, 1, cl.engines));
  const v1::ClusterStatus s2 = status();
  CHECK(s2.current_version() == "2");
  CHECK(GroupEpoch(s2, "engine0") == GroupEpoch(s1, "engine0"));  // untouched: same epoch, same tasks
  CHECK(PlanOf(s2, "engine0") == plan0);
  CHECK(GroupEpoch(s2, "engine2") > GroupEpoch(s1, "engine1"));  // the joined group was re-planned
  CHECK(GroupEpoch(s2, "engine1") == GroupEpoch(s2, "engine2"));
  CHECK(!PlanOf(s2, "engine2").empty());
  for (const auto& e : cl.engines) CHECK(Verify(e, 2).ok());
  CHECK(s2.source_plan_epochs_size() == 2);

  // Refused while an update is open, with the reason; the update is then aborted (nothing written) and the engines
  // resumed at version 2.
  const std::string ctl = std::string(kBin) + "/wsyncctl";
  REQUIRE(coord.BeginUpdate(3).ok());
  CHECK(cl.Run("drain-open", {ctl, "--endpoints", cl.coordinator, "drain", "engine1"}, std::chrono::seconds(30)) != 0);
  CHECK(absl::StrContains(cl.Log("drain-open"), "drain between updates"));
  auto aborted = coord.AbortUpdate(3, "drain test");
  REQUIRE(aborted.ok());
  REQUIRE(aborted->engines_resumable());
  REQUIRE(coord.ResumeEngines().ok());
  CHECK(!EngineIn(status(), "engine1")->drained());

  // Drain engine1 and source node train1 with the CLI.
  CHECK(cl.Run("drain-engine1", {ctl, "--endpoints", cl.coordinator, "drain", "engine1"}, std::chrono::seconds(30)) == 0);
  CHECK(cl.Run("drain-train1", {ctl, "--endpoints", cl.coordinator, "drain", "train1"}, std::chrono::seconds(30)) == 0);
  CHECK(cl.Run("drain-nobody", {ctl, "--endpoints", cl.coordinator, "drain", "nobody"}, std::chrono::seconds(30)) != 0);
  CHECK(absl::StrContains(cl.Log("drain-nobody"), "no engine or node 'nobody'"));
  // The last source node cannot go: nothing could push the tensors.
  CHECK(cl.Run("drain-train0", {ctl, "--endpoints", cl.coordinator, "drain", "train0"}, std::chrono::seconds(30)) != 0);
  CHECK(absl::StrContains(cl.Log("drain-train0"), "cannot drain source node train0"));
  {
    const v1::ClusterStatus s = status();
    REQUIRE(EngineIn(s, "engine1") != nullptr);
    CHECK(EngineIn(s, "engine1")->state() == "drained");
    CHECK(EngineIn(s, "engine1")->weight_version() == "2");
  }
  REQUIRE(RunUpdates(cl, o, 4, 1, {cl.engines[0], cl.engines[2]}));
  {
    const v1::ClusterStatus s3 = status();
    CHECK(s3.current_version() == "4");
    CHECK(PlanOf(s3, "engine1").empty());
    for (const auto& t : s3.plan()) CHECK(t.source_node() == "train0");
    CHECK(Verify(cl.engines[0], 4).ok());
    CHECK(Verify(cl.engines[2], 4).ok());
    // The drained engine was neither paused nor written: it still serves version 2, whole, under its label.
    auto v2 = Verify(cl.engines[1], 2);
    CHECK(v2.ok());
    CHECK_FALSE(Verify(cl.engines[1], 4).ok());
    const v1::EngineInfo info = Info(cl.engines[1]);
    CHECK(info.weight_version() == "2");
    CHECK_FALSE(info.paused());
    CHECK(EngineIn(s3, "engine1")->weight_version() == "2");
  }

  // Undrain both; the next update writes engine1 whole again.
  CHECK(cl.Run("undrain-engine1", {ctl, "--endpoints", cl.coordinator, "undrain", "engine1"}, std::chrono::seconds(30)) == 0);
  CHECK(cl.Run("undrain-train1", {ctl, "--endpoints", cl.coordinator, "undrain", "train1"}, std::chrono::seconds(30)) == 0);
  REQUIRE(RunUpdates(cl, o, 5, 1, cl.engines));
  const v1::ClusterStatus s4 = status();
  CHECK(s4.current_version() == "5");
  CHECK(!PlanOf(s4, "engine1").empty());
  for (const auto& e : cl.engines) CHECK(Verify(e, 5).ok());
  CHECK(EngineIn(s4, "engine1")->state() == "serving");
  CHECK(EngineIn(s4, "engine1")->weight_version() == "5");
}

TEST_CASE("cluster: an engine that stops answering fails the update within the configured pause deadline, named") {
  ClusterOptions o;
  o.bin_dir = kBin;
  o.model = kModel;
  o.transport = TransportUnderTest();
  o.engines = 2;
  o.coordinator_args = {"--pause-timeout", "2"};
  Cluster cl(o);
  INFO("cluster logs in " << cl.dir());
  client::CoordinatorClient coord(cl.coordinator);
  ::kill(cl.engine_pids[1], SIGSTOP);  // alive but not answering
  const auto t0 = std::chrono::steady_clock::now();
  auto begun = coord.BeginUpdate(1);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ::kill(cl.engine_pids[1], SIGCONT);
  INFO(begun.status().ToString() << " after " << took << " s");
  REQUIRE_FALSE(begun.ok());
  CHECK(took < 15);
  const std::string msg(begun.status().message());
  CHECK(msg.find("pause engine engine1") != std::string::npos);
  CHECK(msg.find("node infer1") != std::string::npos);
  auto st = coord.Status();
  REQUIRE(st.ok());
  CHECK(st->current_version().empty());  // nothing committed
  // Once the engine answers again, the next update opens (every engine pauses); it is then aborted.
  auto again = coord.BeginUpdate(2);
  INFO(again.status().ToString());
  CHECK(again.ok());
  if (again.ok()) CHECK(coord.AbortUpdate(2, "test").ok());
}

TEST_CASE("cluster: a PP=2 trainer, each stage on its own source node; updates verified") {
  ClusterOptions o;
  o.bin_dir = kBin;
  o.model = kModel;
  o.transport = TransportUnderTest();
  o.engines = 1;
  o.sources = 2;
  o.pp = 2;
  o.trainer_ranks = 2;
  o.coordinator_args = {"--min-source-mib", "0"};
  Cluster cl(o);
  INFO("cluster logs in " << cl.dir());
  RunTrainers(cl, o, 2);
  client::CoordinatorClient coord(cl.coordinator);
  auto st = coord.Status();
  REQUIRE(st.ok());
  CHECK(st->current_version() == "2");
  std::set<std::string> sources_used;
  for (const auto& p : st->plan()) sources_used.insert(p.source_node());
  CHECK(sources_used.size() == 2);  // the stages' layers come from different nodes
  CHECK(Verify(cl.engines[0], 2).ok());
}

TEST_CASE("cluster: two daemons exchange updates over the selected transport", "[verbs]") {
  ClusterOptions o;
  o.bin_dir = kBin;
  o.model = kModel;
  o.transport = TransportUnderTest();
  Cluster cl(o);
  INFO("cluster logs in " << cl.dir());
  client::CoordinatorClient coord(cl.coordinator);
  auto st = coord.Status();
  REQUIRE(st.ok());
  for (const auto& n : st->nodes()) CHECK(n.transport() == o.transport);  // no silent fallback
  client::TrainerOptions to;
  to.daemon = cl.trainer_sockets[0];
  auto trainer = client::TrainerClient::Connect(to);
  REQUIRE(trainer.ok());
  for (int64_t v = 1; v <= 2; ++v) {
    GoodUpdate(cl, **trainer, v);
    auto r = Verify(cl.engines[0], v);
    for (const auto& m : r.mismatches()) UNSCOPED_INFO(m);
    CHECK(r.ok());
  }
  // Both updates went through the target's write window, enforced by this transport (verbs: remote write per QP
  // only while open), and it is closed again; the second update reused connections that sat idle while it was
  // closed, and nothing was refused.
  auto target = v1::NodeDaemon::NewStub(grpc::CreateChannel(cl.targets[0], grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::NodeStatus ns;
  REQUIRE(target->GetNodeStatus(&ctx, v1::NodeStatusRequest(), &ns).ok());
  CHECK(ns.transport() == o.transport);
  CHECK(ns.write_window() == "closed");
  CHECK(ns.refused_writes() == 0);
  // The source's connections were granted per engine rank (tcp: a write secret; verbs: the rank's MRs in the
  // connection's own protection domain), never plain ones.
  const std::string target_log = cl.Log("target0");
  CHECK(absl::StrContains(target_log, "write grant minted for"));
  CHECK_FALSE(absl::StrContains(target_log, "needs no per-connection secret"));
}

}  // namespace
}  // namespace wsync
