// LoRA adapter slots end to end (docs/engines.md, "LoRA adapters"): two reference engines serving a rank-8 adapter
// over the tiny Qwen3 (--lora-rank 8 --lora-targets q_proj,v_proj,down_proj: the adapter alone in their memory, the
// base config plus a "lora_adapter" section reported) behind a real coordinator, source and target daemons. The
// trainer pushes the adapter's lora_A/lora_B tensors alone, generated for step v; after classic and staged updates
// each engine's own loader (Verify: the adapter of step v by name, whole on every rank) finds it bit for bit, and the
// update record's bytes are the adapter's, per engine rank. A wrong-rank adapter is refused with nothing written;
// a stale adapter (step v - 1 pushed as version v) is caught by Verify; an engine refusing its switch is left out,
// serving the previous adapter, and rejoins at the next update.

#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "client/coordinator_client.h"
#include "client/trainer_client.h"
#include "nlohmann/json.hpp"
#include "tests/daemon/cluster.h"
#include "tests/daemon/helpers.h"
#include "tools/testdata/weight_gen.h"
#include "wsync/v1/engine.grpc.pb.h"

namespace wsync {
namespace {

using testing::Cluster;
using testing::ClusterOptions;

const char* kBin = WSYNC_BIN_DIR;
const char* kModel = WSYNC_TINY_MODEL;
constexpr int kTp = 2, kEngines = 2, kRank = 8;

// The adapter this test expects, from the tiny model's numbers (hidden 64, 4 heads and 2 kv heads of 16,
// intermediate 96, 2 layers): name → shape, for rank `r`.
std::map<std::string, std::vector<int64_t>> AdapterShapes(int64_t r) {
  const int64_t h = 64, kv = 2 * 16, inter = 96;
  std::map<std::string, std::vector<int64_t>> out;
  for (int layer = 0; layer < 2; ++layer) {
    const std::string p = absl::StrCat("base_model.model.model.layers.", layer, ".");
    for (const auto& [m, o, i] : std::vector<std::tuple<std::string, int64_t, int64_t>>{
             {"self_attn.q_proj", 4 * 16, h}, {"self_attn.v_proj", kv, h}, {"mlp.down_proj", h, inter}}) {
      out[p + m + ".lora_A.weight"] = {r, i};
      out[p + m + ".lora_B.weight"] = {o, r};
    }
  }
  return out;
}

uint64_t Bytes(const std::vector<int64_t>& shape) { return static_cast<uint64_t>(shape[0] * shape[1]) * 2; }  // bf16

// "rank/name" → XXH3-128 of every rank's staging copy.
std::map<std::string, std::string> StagingChecksums(const std::string& engine) {
  std::map<std::string, std::string> out;
  for (int r = 0; r < kTp; ++r) {
    grpc::ClientContext ctx;
    v1::RankRequest req;
    req.set_rank(r);
    req.set_staging(true);
    v1::ChecksumReply rep;
    REQUIRE(testing::EngineStub(engine)->GetChecksums(&ctx, req, &rep).ok());
    for (const auto& p : rep.params()) out[absl::StrCat(r, "/", p.name())] = p.xxh128();
  }
  return out;
}

TEST_CASE(
    "adapter: reference engines' adapter slots take classic and staged adapter-only updates bit-exact; a wrong-rank "
    "adapter is refused with nothing written; a stale adapter fails Verify; a refused switch leaves that engine on "
    "the previous adapter") {
  const auto shapes = AdapterShapes(kRank);
  uint64_t adapter_bytes = 0;
  for (const auto& [n, s] : shapes) adapter_bytes += Bytes(s);

  // The engines' fault knob (tools/testing/engine_ref/ref_faults.h), empty until the switch fault below.
  const std::string faults = absl::StrCat("/tmp/wsync-adapter-test-faults.", getpid());
  std::ofstream(faults).close();
  setenv("WSYNC_REF_FAULTS_FILE", faults.c_str(), 1);
  struct Remove {
    const std::string& path;
    ~Remove() { std::remove(path.c_str()); }
  } remove_faults{faults};

  ClusterOptions o;
  o.bin_dir = kBin;
  o.model = kModel;
  o.tp = kTp;
  o.engines = kEngines;
  o.engine_args = {"--lora-rank", std::to_string(kRank), "--lora-targets", "q_proj,v_proj,down_proj", "--staging"};
  Cluster cl(o);
  INFO("cluster logs in " << cl.dir());
  auto trainer = testing::ConnectTrainer(cl.trainer_sockets[0]);
  REQUIRE(trainer.ok());
  client::CoordinatorClient coord(cl.coordinator);

  // Each engine reports the base config plus the adapter's section, and holds the adapter alone on every rank.
  for (const auto& e : cl.engines) {
    const v1::EngineInfo info = testing::Info(e);
    const nlohmann::json cfg = nlohmann::json::parse(info.model_config_json());
    CHECK(cfg["lora_adapter"]["r"] == kRank);
    CHECK(cfg["lora_adapter"]["target_modules"] == nlohmann::json({"q_proj", "v_proj", "down_proj"}));
    CHECK(cfg["hidden_size"] == 64);
    for (int r = 0; r < kTp; ++r) {
      const v1::RankLayout layout = testing::Layout(e, r);
      std::map<std::string, std::vector<int64_t>> held;
      for (const auto& p : layout.params()) held[p.name()] = {p.shape().begin(), p.shape().end()};
      CHECK(held == shapes);
    }
  }

  uint64_t abort_bytes_written = ~0ull;  // of the last update the trainer gave up on
  // One update of version v pushing the adapter of step `step` at rank `rank` (the engines' own, unless testing a
  // wrong one).
  auto update = [&](int64_t v, int64_t step, const std::string& mode,
                    int64_t rank = kRank) -> absl::StatusOr<v1::UpdateRecord> {
    auto b = coord.BeginUpdate(v, "", mode);
    if (!b.ok()) return b.status();
    auto names = (*trainer)->BeginPush(v);
    if (!names.ok()) return names.status();
    CHECK(std::set<std::string>(names->begin(), names->end()).size() == shapes.size());  // the adapter, nothing else
    const auto push_shapes = AdapterShapes(rank);
    absl::Status pushed;
    for (const auto& n : *names) {
      REQUIRE(push_shapes.count(n) == 1);
      const std::vector<int64_t>& s = push_shapes.at(n);
      pushed = (*trainer)->PushWith(n, DType::kBF16, s, Bytes(s), [&](uint8_t* dst) {
        tools::GenerateTensor(n, step, DType::kBF16, Bytes(s) / 2, dst);
      });
      if (!pushed.ok()) break;
    }
    if (pushed.ok()) pushed = (*trainer)->EndPush(v);
    if (!pushed.ok()) {
      UNSCOPED_INFO("push of version " << v << ": " << pushed.ToString());
      // The trainer gives up on v: the coordinator fails it.
      auto a = coord.AbortUpdate(v, "trainer: " + pushed.ToString());
      if (!a.ok()) return a.status();
      abort_bytes_written = a->bytes_written();
      return pushed;
    }
    return coord.CommitUpdate(v, 30);
  };
  auto committed = [&](const absl::StatusOr<v1::UpdateRecord>& r, int64_t v) {
    REQUIRE(r.ok());
    INFO(r->error());
    REQUIRE(r->success());
    CHECK(r->bytes() == adapter_bytes * kTp * kEngines);  // the adapter's bytes on every engine rank, nothing more
    for (const auto& e : cl.engines) {
      CHECK(testing::Info(e).weight_version() == std::to_string(v));
      const v1::VerifyReply ver = testing::Verify(e, v);  // the engine's own loader, every rank
      CHECK(ver.ok());
      CHECK(ver.params_checked() == static_cast<int64_t>(shapes.size() * kTp));
      CHECK(ver.bytes_checked() == static_cast<int64_t>(adapter_bytes * kTp));
    }
  };

  // Classic, twice: the adapter moves with the version.
  committed(update(1, 1, "classic"), 1);
  const auto adapter1 = testing::Checksums(cl.engines[0], kTp);
  committed(update(2, 2, "classic"), 2);
  const auto adapter2 = testing::Checksums(cl.engines[0], kTp);
  for (const auto& [k, h] : adapter1) CHECK(adapter2.at(k) != h);

  // Staged: written into the staging copy while the engines serve version 2, verified, switched together.
  {
    auto r3 = update(3, 3, "staged");
    REQUIRE(r3.ok());
    CHECK(r3->mode() == "staged");
    CHECK(r3->switched_size() == kEngines);
    committed(r3, 3);
    for (const auto& e : cl.engines) CHECK(testing::Info(e).live_set() == 1);
  }

  // A wrong-rank adapter (rank 4 against the engines' 8): refused, nothing of it written anywhere; the engines keep
  // serving version 3.
  {
    std::map<std::string, std::map<std::string, std::string>> live, staging;
    for (const auto& e : cl.engines) {
      live[e] = testing::Checksums(e, kTp);
      staging[e] = StagingChecksums(e);
    }
    auto r4 = update(4, 4, "staged", 4);
    const std::string why = r4.ok() ? r4->error() : r4.status().ToString();
    INFO(why);
    CHECK((!r4.ok() || !r4->success()));
    CHECK(absl::StrContains(why, "nothing from it was written"));
    CHECK(absl::StrContains(why, "q_proj.lora_A.weight': shape [4, 64], expected [8, 64]"));
    CHECK(abort_bytes_written == 0);  // the coordinator's count over all sources
    for (const auto& e : cl.engines) {
      CHECK(testing::Info(e).weight_version() == "3");
      CHECK(testing::Info(e).paused() == false);
      CHECK(testing::Checksums(e, kTp) == live[e]);
      CHECK(StagingChecksums(e) == staging[e]);
      CHECK(testing::Verify(e, 3).ok());
    }
  }

  // The next good adapter goes through after the refusal.
  committed(update(5, 5, "staged"), 5);

  // Broken on purpose: a stale adapter (step 5's tensors again) pushed as version 6. wsync moves what it is given,
  // so the update commits; the engines' own loader finds every tensor differs from step 6's adapter.
  {
    auto r6 = update(6, 5, "classic");
    REQUIRE(r6.ok());
    REQUIRE(r6->success());
    for (const auto& e : cl.engines) {
      const v1::VerifyReply ver = testing::Verify(e, 6);
      CHECK_FALSE(ver.ok());
      REQUIRE(ver.mismatches_size() > 0);
      CHECK(absl::StrContains(ver.mismatches(0), "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"));
      CHECK(ver.mismatches_size() == static_cast<int>(std::min<size_t>(20, shapes.size() * kTp)));
      CHECK(testing::Verify(e, 5).ok());  // what it holds is step 5's adapter
    }
  }
  committed(update(7, 7, "staged"), 7);

  // A staged adapter update whose switch engine1 refuses: engine1 is left out, stale, serving adapter 7 from its live
  // copy, unpaused; engine0 serves adapter 8. The next staged update brings both to its adapter.
  std::ofstream(faults) << "engine1 switch error adapter\n";
  {
    auto r8 = update(8, 8, "staged");
    REQUIRE(r8.ok());
    INFO(r8->error() << " | stale: " << absl::StrJoin(r8->stale(), "; "));
    CHECK(r8->success());
    CHECK(r8->switched_size() == 1);
    CHECK(absl::StrContains(absl::StrJoin(r8->stale(), "; "), "engine1"));
    CHECK(testing::Info(cl.engines[0]).weight_version() == "8");
    CHECK(testing::Verify(cl.engines[0], 8).ok());
    const v1::EngineInfo e1 = testing::Info(cl.engines[1]);
    CHECK(e1.weight_version() == "7");
    CHECK_FALSE(e1.paused());
    CHECK(testing::Verify(cl.engines[1], 7).ok());
  }
  std::ofstream(faults).close();
  committed(update(9, 9, "staged"), 9);
}

}  // namespace
}  // namespace wsync
