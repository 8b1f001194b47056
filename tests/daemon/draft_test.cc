// Speculative drafts end to end (docs/engines.md, "Speculative drafts"): a reference engine whose ranks hold the
// DeepSeek-V3 next-n (MTP) draft beside the target (--draft: a draft segment per rank, weights: draft) is one set of
// targets of the same update. After each update both the target and the draft equal the pushed step: checked by the
// engine's own loader (Verify), by `wsyncctl verify` against the sources' write checksums, and, for the draft, against
// bytes this test builds itself from the generated checkpoint tensors of the MTP layer (the NextN rename of
// docs/engines.md: norms and eh_proj whole, the router whole, each rank's experts stacked as [gate; up] / down). A
// trainer that leaves the MTP layer out fails the update, naming the draft of each engine rank; the engine is not
// switched to it.

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
#include <xxhash.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "client/coordinator_client.h"
#include "client/trainer_client.h"
#include "nlohmann/json.hpp"
#include "replica/model_config.h"
#include "tests/daemon/cluster.h"
#include "tests/daemon/helpers.h"
#include "tools/testdata/weight_gen.h"
#include "wsync/v1/engine.grpc.pb.h"

namespace wsync {
namespace {

using testing::Cluster;
using testing::ClusterOptions;

const char* kBin = WSYNC_BIN_DIR;
const char* kModel = WSYNC_TINY_MTP_MODEL;
constexpr int kTp = 2, kEp = 2;

// The checkpoint a trainer holds: the target's tensors and the MTP layer's.
std::map<std::string, replica::TensorSpec> AllSpecs(const replica::ModelConfig& cfg) {
  auto specs = replica::CheckpointTensors(cfg, replica::CheckpointFormat::kTrainer, 128, 128, replica::WeightSet::kAll);
  REQUIRE(specs.ok());
  std::map<std::string, replica::TensorSpec> out;
  for (auto& s : *specs) out[s.name] = s;
  return out;
}

std::vector<uint8_t> Generated(const replica::TensorSpec& s, int64_t step) {
  std::vector<uint8_t> out(s.bytes());
  tools::GenerateTensor(s.name, step, s.dtype, s.bytes() / DTypeSize(s.dtype), out.data());
  return out;
}

std::string Xxh128(const std::vector<uint8_t>& b) {
  const XXH128_hash_t h = XXH3_128bits(b.data(), b.size());
  return absl::StrFormat("%016x%016x", h.high64, h.low64);
}

// "rank/draft parameter" → XXH3-128 of what the draft must hold after step `step`, built here from the generated
// tensors of checkpoint layer L = num_hidden_layers (tp 2, ep 2: moe_tp 1, rank r holds experts [r*E/2, (r+1)*E/2)
// whole, w13 = [gate; up] per expert).
std::map<std::string, std::string> DraftExpectation(const replica::ModelConfig& cfg,
                                                    const std::map<std::string, replica::TensorSpec>& specs,
                                                    int64_t step) {
  const std::string hf = absl::StrCat("model.layers.", cfg.num_layers, ".");
  const std::vector<std::pair<std::string, std::string>> whole = {
      {"model.enorm.weight", hf + "enorm.weight"},
      {"model.hnorm.weight", hf + "hnorm.weight"},
      {"model.eh_proj.weight", hf + "eh_proj.weight"},
      {"model.shared_head.norm.weight", hf + "shared_head.norm.weight"},
      {"model.decoder.input_layernorm.weight", hf + "input_layernorm.weight"},
      {"model.decoder.post_attention_layernorm.weight", hf + "post_attention_layernorm.weight"},
      {"model.decoder.self_attn.kv_a_layernorm.weight", hf + "self_attn.kv_a_layernorm.weight"},
      {"model.decoder.mlp.gate.weight", hf + "mlp.gate.weight"},
      {"model.decoder.mlp.gate.e_score_correction_bias", hf + "mlp.gate.e_score_correction_bias"},
  };
  std::map<std::string, std::string> out;
  const int64_t local = cfg.num_experts / kEp;
  for (int r = 0; r < kTp; ++r) {
    for (const auto& [engine, name] : whole)
      out[absl::StrCat(r, "/", engine)] = Xxh128(Generated(specs.at(name), step));
    std::vector<uint8_t> w13, w2;
    for (int64_t e = r * local; e < (r + 1) * local; ++e) {
      const std::string x = absl::StrCat(hf, "mlp.experts.", e, ".");
      for (const char* part : {"gate_proj.weight", "up_proj.weight"}) {
        const auto b = Generated(specs.at(x + part), step);
        w13.insert(w13.end(), b.begin(), b.end());
      }
      const auto d = Generated(specs.at(x + "down_proj.weight"), step);
      w2.insert(w2.end(), d.begin(), d.end());
    }
    out[absl::StrCat(r, "/model.decoder.mlp.experts.w13_weight")] = Xxh128(w13);
    out[absl::StrCat(r, "/model.decoder.mlp.experts.w2_weight")] = Xxh128(w2);
  }
  return out;
}

// Keeps the first 64 bytes of one of an engine's memfd segments (found by name among the engine process's fds)
// overwritten with a pattern until destroyed: whatever the sources write there is replaced.
class Overwriter {
 public:
  Overwriter(pid_t pid, const std::string& segment) {
    for (int fd = 0; fd < 4096 && fd_ < 0; ++fd) {
      const std::string path = absl::StrCat("/proc/", pid, "/fd/", fd);
      char target[512];
      const ssize_t n = readlink(path.c_str(), target, sizeof(target) - 1);
      if (n <= 0) continue;
      target[n] = 0;
      if (absl::StartsWith(target, absl::StrCat("/memfd:", segment, " "))) fd_ = open(path.c_str(), O_RDWR);
    }
    REQUIRE(fd_ >= 0);
    void* p = mmap(nullptr, 64, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    REQUIRE(p != MAP_FAILED);
    bytes_ = static_cast<uint8_t*>(p);
    writer_ = std::thread([this] {
      uint8_t pattern[64];
      std::memset(pattern, 0x5A, sizeof(pattern));
      while (!stop_.load()) {
        if (std::memcmp(bytes_, pattern, sizeof(pattern)) != 0) std::memcpy(bytes_, pattern, sizeof(pattern));
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    });
  }
  ~Overwriter() {
    stop_ = true;
    writer_.join();
    munmap(bytes_, 64);
    close(fd_);
  }

 private:
  int fd_ = -1;
  uint8_t* bytes_ = nullptr;
  std::atomic<bool> stop_{false};
  std::thread writer_;
};

// `wsyncctl verify -w json`: exit status and the parameters it compared.
std::pair<int, nlohmann::json> CtlVerify(Cluster& cl) {
  const std::string out = cl.dir() + "/verify.json";
  const int rc = cl.Run(
      "wsyncctl-verify",
      {"/bin/sh", "-c", std::string(kBin) + "/wsyncctl --endpoints " + cl.coordinator + " verify -w json > " + out},
      std::chrono::seconds(60));
  nlohmann::json j = nlohmann::json::parse(testing::ReadFile(out), nullptr, false);
  return {rc, j};
}

TEST_CASE(
    "draft: the next-n draft is written, verified and switched with the target; a missing MTP layer fails the "
    "update naming each rank's draft") {
  auto cfg = replica::ModelConfig::FromFile(kModel);
  REQUIRE(cfg.ok());
  REQUIRE(cfg->num_nextn_predict_layers == 1);
  const auto specs = AllSpecs(*cfg);
  const std::string mtp = absl::StrCat("model.layers.", cfg->num_layers, ".");

  ClusterOptions o;
  o.bin_dir = kBin;
  o.model = kModel;
  o.tp = kTp;
  o.ep = kEp;
  o.engine_args = {"--draft", "--staging"};
  o.coordinator_args = {"--strategy", "balanced", "--min-source-mib", "0"};
  Cluster cl(o);
  INFO("cluster logs in " << cl.dir());
  auto trainer = testing::ConnectTrainer(cl.trainer_sockets[0]);
  REQUIRE(trainer.ok());
  client::CoordinatorClient coord(cl.coordinator);

  // Each rank reports its draft as a segment of its own, typed (two copies with --staging).
  int draft_segment = -1, shift = 0;
  {
    const v1::RankLayout layout = testing::Layout(cl.engines[0], 1);
    shift = layout.staging_segment_shift();
    REQUIRE(shift > 0);
    std::set<int> draft_segments;
    for (const auto& s : layout.segments())
      if (s.weights() == v1::WEIGHT_SET_DRAFT) draft_segments.insert(s.id());
    REQUIRE(draft_segments.size() == 2);
    draft_segment = *draft_segments.begin();
    CHECK(draft_segments.count(draft_segment + shift) == 1);
    int drafted = 0;
    for (const auto& p : layout.params())
      if (draft_segments.count(p.segment())) {
        ++drafted;
        CHECK((absl::StartsWith(p.name(), "model.decoder.") || p.name() == "model.enorm.weight" ||
               p.name() == "model.hnorm.weight" || p.name() == "model.eh_proj.weight" ||
               p.name() == "model.shared_head.norm.weight"));
      }
    CHECK(drafted > 10);
  }

  // One update of step v; `skip` leaves the tensors whose name starts with it out of the push.
  auto update = [&](int64_t v, const std::string& skip, const std::string& mode = "",
                    const std::function<void()>& pushed = {}) -> absl::StatusOr<v1::UpdateRecord> {
    auto b = coord.BeginUpdate(v, "", mode);
    if (!b.ok()) return b.status();
    auto names = (*trainer)->BeginPush(v);
    if (!names.ok()) return names.status();
    int mtp_names = 0;
    for (const auto& n : *names) {
      if (absl::StartsWith(n, mtp)) ++mtp_names;
      if (!skip.empty() && absl::StartsWith(n, skip)) continue;
      const replica::TensorSpec& s = specs.at(n);
      WSYNC_RETURN_IF_ERROR((*trainer)->PushWith(s.name, s.dtype, s.shape, s.bytes(), [&](uint8_t* dst) {
        tools::GenerateTensor(s.name, v, s.dtype, s.bytes() / DTypeSize(s.dtype), dst);
      }));
    }
    CHECK(mtp_names > 10);  // the push filter asks for the MTP layer
    WSYNC_RETURN_IF_ERROR((*trainer)->EndPush(v));
    if (pushed) pushed();
    return coord.CommitUpdate(v, 30);
  };
  auto draft_now = [&]() {
    std::map<std::string, std::string> out;
    for (const auto& [k, h] : testing::Checksums(cl.engines[0], kTp))
      if (absl::StrContains(k, "/model.decoder.") || absl::StrContains(k, "/model.enorm.") ||
          absl::StrContains(k, "/model.hnorm.") || absl::StrContains(k, "/model.eh_proj.") ||
          absl::StrContains(k, "/model.shared_head."))
        out[k] = h;
    return out;
  };
  auto check_step = [&](int64_t v) {
    CHECK(testing::Info(cl.engines[0]).weight_version() == std::to_string(v));
    // The engine's own loader: every target and draft parameter of both ranks.
    auto ver = testing::Verify(cl.engines[0], v);
    CHECK(ver.ok());
    // The draft against this test's own expectation.
    const auto have = draft_now();
    for (const auto& [k, want] : DraftExpectation(*cfg, specs, v)) {
      INFO(k);
      REQUIRE(have.count(k) == 1);
      CHECK(have.at(k) == want);
    }
    // The sources' write checksums cover the draft's bytes.
    auto [rc, j] = CtlVerify(cl);
    CHECK(rc == 0);
    REQUIRE(j.is_object());
    int draft_matched = 0;
    for (const auto& p : j["params"])
      if (have.count(absl::StrCat(p["rank"].get<int>(), "/", p["param"].get<std::string>())))
        draft_matched += p["result"] == "MATCH";
    CHECK(draft_matched == static_cast<int>(have.size()));
    return have;
  };

  auto r1 = update(1, "");
  REQUIRE(r1.ok());
  INFO(r1->error());
  REQUIRE(r1->success());
  const auto draft1 = check_step(1);

  auto r2 = update(2, "");
  REQUIRE(r2.ok());
  INFO(r2->error());
  REQUIRE(r2->success());
  const auto draft2 = check_step(2);
  for (const auto& [k, h] : draft1) CHECK(draft2.at(k) != h);  // the draft moved with the version

  // Staged: the draft is staged and verified with the target, and switched with it.
  auto r3 = update(3, "", "staged");
  REQUIRE(r3.ok());
  INFO(r3->error());
  REQUIRE(r3->success());
  CHECK(r3->mode() == "staged");
  REQUIRE(r3->switched_size() == 1);
  CHECK(testing::Info(cl.engines[0]).live_set() == 1);
  const auto draft3 = check_step(3);
  for (const auto& [k, h] : draft2) CHECK(draft3.at(k) != h);

  // Staged, rank 1's draft overwritten in its staging copy after the sources wrote it: the staged verify finds it and
  // the engine is left out, serving version 3, target and draft.
  {
    const int staging_copy = 1 - testing::Info(cl.engines[0]).live_set();
    Overwriter bad(cl.engine_pids[0], absl::StrCat("wsync-engine-engine0-r1-s", draft_segment + staging_copy * shift));
    auto r4 = update(4, "", "staged");
    const std::string why = r4.ok() ? absl::StrJoin(r4->stale(), "; ") : r4.status().ToString();
    INFO(why);
    CHECK((!r4.ok() || r4->switched_size() == 0));  // the only engine: no switch, the update fails
    CHECK(absl::StrContains(why, "engine0: staging not verified"));
    CHECK(absl::StrContains(why, "rank 1: model.enorm.weight"));  // the draft's first parameter, named
  }
  CHECK(testing::Info(cl.engines[0]).weight_version() == "3");
  CHECK(testing::Verify(cl.engines[0], 3).ok());
  CHECK(draft_now() == draft3);

  // A trainer that pushes everything but the MTP layer: the update fails for the engine, naming the draft.
  auto r5 = update(5, mtp);
  const std::string error = r5.ok() ? r5->error() : r5.status().ToString();
  INFO(error);
  CHECK((!r5.ok() || !r5->success()));
  CHECK(absl::StrContains(error, "draft of engine engine0 rank"));
  CHECK(testing::Info(cl.engines[0]).weight_version() == "3");
}

}  // namespace
}  // namespace wsync
