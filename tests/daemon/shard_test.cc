// Shard-aware pushes end to end (separate processes on 127.0.0.1): a Qwen3-MoE trainer with TP=2 and EP=2 over two
// source nodes of one rank each, a coordinator planning with `--strategy local`, and a reference engine (tp2 ep2)
// that verifies every parameter bit-exactly with its own loader. Each rank pushes only the slices of its own shard
// (cut here from the generated full tensors); nothing is gathered. Bad slices are rejected naming tensor and
// ranges; a parameter whose slices never cover it is never written.

#include <catch2/catch.hpp>

#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <sys/wait.h>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "client/coordinator_client.h"
#include "client/trainer_client.h"
#include "tests/daemon/cluster.h"
#include "tests/daemon/helpers.h"
#include "tools/testdata/weight_gen.h"

namespace wsync {
namespace {

using testing::Checksums;
using testing::Cluster;
using testing::ClusterOptions;
using testing::Info;
using testing::Verify;

const char* kBin = WSYNC_BIN_DIR;
const char* kModel = WSYNC_TINY_MOE_MODEL;

// The generated tensor `s` for `step`, whole.
std::vector<uint8_t> Generate(const replica::TensorSpec& s, int64_t step) {
  std::vector<uint8_t> out(s.bytes());
  tools::GenerateTensor(s.name, step, s.dtype, s.bytes() / DTypeSize(s.dtype), out.data());
  return out;
}

// The rectangle `sl` of a generated tensor (a range along dim 0, or a 2-D rectangle), row-major.
std::vector<uint8_t> Cut(const replica::TensorSpec& s, const TensorSlice& sl, int64_t step) {
  const std::vector<uint8_t> full = Generate(s, step);
  const size_t es = DTypeSize(s.dtype);
  std::vector<uint8_t> out(static_cast<size_t>(sl.rows * sl.cols) * es);
  for (int64_t r = 0; r < sl.rows; ++r)
    std::memcpy(out.data() + r * sl.cols * es, full.data() + ((sl.row0 + r) * sl.full_cols + sl.col0) * es,
                sl.cols * es);
  return out;
}

absl::Status PushAssigned(client::TrainerClient& t, const std::vector<std::string>& names,
                          const std::map<std::string, replica::TensorSpec>& specs, int64_t step) {
  for (const auto& n : names)
    if (absl::Status st = testing::PushGenerated(t, specs.at(n), step); !st.ok()) return st;
  for (const TensorSlice& sl : t.push_slices()) {
    const replica::TensorSpec& s = specs.at(sl.name);
    const std::vector<uint8_t> data = Cut(s, sl, step);
    if (absl::Status st = t.PushSlice(sl.name, s.dtype, sl.full_shape, sl.offsets, sl.extents, data.data(),
                                      data.size());
        !st.ok())
      return st;
  }
  return absl::OkStatus();
}

TEST_CASE("shard: trainer TP=2 / EP=2 ranks push only their shards; the engine verifies every parameter") {
  ClusterOptions o;
  o.bin_dir = kBin;
  o.model = kModel;
  o.engines = 1;
  o.tp = 2;
  o.ep = 2;
  o.sources = 2;
  o.trainer_ranks = 1;
  o.coordinator_args = {"--strategy", "local", "--trainer-parallelism", "tp=2,ep=2"};
  Cluster cl(o);
  INFO("cluster logs in " << cl.dir());
  const auto specs = testing::Specs(kModel);
  auto cfg = replica::ModelConfig::FromFile(kModel);
  REQUIRE(cfg.ok());
  std::vector<std::unique_ptr<client::TrainerClient>> ranks;
  for (int r = 0; r < 2; ++r) {
    client::TrainerOptions to;
    to.daemon = cl.trainer_sockets[r];
    to.global_rank = r;
    to.timeout = absl::Seconds(20);
    auto t = client::TrainerClient::Connect(to);
    REQUIRE(t.ok());
    ranks.push_back(*std::move(t));
  }
  client::CoordinatorClient coord(cl.coordinator);
  // Node r (one rank, trainer rank r) is TP rank r and EP rank r: experts [4r, 4r+4) of 8.
  auto good_update = [&](int64_t v) {
    REQUIRE(coord.BeginUpdate(v).ok());
    uint64_t pushed = 0, whole_split = 0;
    for (int r = 0; r < 2; ++r) {
      auto names = ranks[r]->BeginPush(v);
      REQUIRE(names.ok());
      for (const auto& n : *names) {
        INFO("rank " << r << " pushes " << n << " whole");
        // Whole tensors are only replicated ones (norms, router) or its own experts.
        const size_t e = n.find(".mlp.experts.");
        if (e != std::string::npos) {
          CHECK(std::stoi(n.substr(e + 13)) / 4 == r);
        } else {
          const bool split = absl::StrContains(n, "_proj.") || absl::StrContains(n, "embed_tokens") ||
                             absl::StartsWith(n, "lm_head");
          whole_split += split;
        }
      }
      for (const TensorSlice& sl : ranks[r]->push_slices()) {
        INFO("rank " << r << " slice of " << sl.name << " " << sl.Describe());
        // TP rank r holds half of every split dense tensor: rows (q/k/v, gate/up, vocab) or columns (o, down).
        const bool cols = absl::StrContains(sl.name, "o_proj") || absl::StrContains(sl.name, "down_proj");
        if (cols) {
          CHECK(sl.col0 >= r * sl.full_cols / 2);
          CHECK(sl.col0 + sl.cols <= (r + 1) * sl.full_cols / 2);
        } else {
          CHECK(sl.row0 >= r * sl.full_rows / 2);
          CHECK(sl.row0 + sl.rows <= (r + 1) * sl.full_rows / 2);
        }
        ++pushed;
      }
      REQUIRE(PushAssigned(*ranks[r], *names, specs, v).ok());
      REQUIRE(ranks[r]->EndPush(v).ok());
    }
    CHECK(pushed > 0);
    CHECK(whole_split == 0);  // no rank hands over a whole TP-split tensor: nothing is gathered
    auto rec = coord.CommitUpdate(v, 30);
    INFO((rec.ok() ? "" : rec.status().ToString()));
    REQUIRE(rec.ok());
    CHECK(rec->success());
    auto ver = Verify(cl.engines[0], v);
    CHECK(ver.ok());
    CHECK(ver.params_checked() > 0);
  };
  good_update(1);
  good_update(2);
  {
    // wsyncctl verify gathers the byte ranges both sources recorded writing (a shard-aware plan: ranges, not whole
    // parameters) and compares them with the engine's hashes of the same ranges of its memory.
    const std::string out = cl.dir() + "/verify.json";
    const int rc = std::system((std::string(kBin) + "/wsyncctl verify --endpoints " + cl.coordinator +
                                " -w json > " + out + " 2>&1").c_str());
    const std::string doc = testing::ReadFile(out);
    INFO(doc);
    REQUIRE(WIFEXITED(rc));
    CHECK(WEXITSTATUS(rc) == 0);
    auto j = nlohmann::json::parse(doc, nullptr, false);
    REQUIRE_FALSE(j.is_discarded());
    CHECK(j["ok"] == true);
    CHECK(j["version"] == 2);
    CHECK(j["sources"].size() == 2);
    CHECK(j["matched"].get<int64_t>() > 0);
    CHECK(j["mismatched"] == 0);
    CHECK(j["missing"] == 0);
    const int wrong = std::system((std::string(kBin) + "/wsyncctl verify --endpoints " + cl.coordinator +
                                   " --version 1 > /dev/null 2>&1").c_str());
    CHECK(WEXITSTATUS(wrong) == 1);  // the engine holds update 2's weights, not 1's
  }
  const auto before = Checksums(cl.engines[0], 2);

  // Bad slices: each fails its bucket, naming the tensor and the ranges; nothing reaches the engine.
  const replica::TensorSpec& q = specs.at("model.layers.0.self_attn.q_proj.weight");
  int64_t v = 3;
  struct Bad {
    std::string what, expect;
    std::function<absl::Status(client::TrainerClient&)> push;
  };
  const int64_t qr = q.shape[0], qc = q.shape[1];
  std::vector<Bad> bad = {
      {"overlapping slices", "overlaps",
       [&](client::TrainerClient& t) {
         std::vector<uint8_t> d(static_cast<size_t>(qr / 2 * qc) * 2);
         absl::Status st = t.PushSlice(q.name, q.dtype, q.shape, {0, 0}, {qr / 2, qc}, d.data(), d.size());
         if (!st.ok()) return st;
         return t.PushSlice(q.name, q.dtype, q.shape, {qr / 4, 0}, {qr / 2, qc}, d.data(), d.size());
       }},
      {"out of range (bypassing the client's check)", "outside",
       [&](client::TrainerClient& t) {
         std::vector<uint8_t> d(static_cast<size_t>(qr / 2 * qc) * 2);
         const std::vector<int64_t> ext = {qr / 2, qc};
         return t.Push(EncodeSliceName(q.name, q.shape, {qr - 1, 0}), q.dtype, ext, d.data(), d.size());
       }},
      {"wrong full shape", "shape",
       [&](client::TrainerClient& t) {
         std::vector<uint8_t> d(static_cast<size_t>(qr / 2 * qc) * 2);
         return t.PushSlice(q.name, q.dtype, {qr / 2, qc * 2}, {0, 0}, {qr / 2, qc}, d.data(), d.size());
       }},
  };
  for (const auto& b : bad) {
    INFO("case: " << b.what);
    REQUIRE(coord.BeginUpdate(v).ok());
    REQUIRE(ranks[0]->BeginPush(v).ok());
    REQUIRE(b.push(*ranks[0]).ok());
    absl::Status st = ranks[0]->Flush();
    INFO(st.ToString());
    CHECK(st.code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StrContains(st.message(), q.name));
    CHECK(absl::StrContains(st.message(), b.expect));
    CHECK(absl::StrContains(st.message(), "nothing from it was written"));
    // The source failed the update at the refused bucket and told the coordinator, which ends it at once: what the
    // ranks do next may come before or after that (refused as ended then), the commit answers the failure.
    auto ok_or_ended = [](const absl::Status& s) {
      return s.ok() || s.code() == absl::StatusCode::kFailedPrecondition;
    };
    CHECK(ok_or_ended(ranks[0]->EndPush(v)));
    if (ranks[1]->BeginPush(v).ok()) CHECK(ok_or_ended(ranks[1]->EndPush(v)));
    auto rec = coord.CommitUpdate(v, 10);
    CHECK_FALSE(rec.ok());
    CHECK(Checksums(cl.engines[0], 2) == before);
    CHECK(Info(cl.engines[0]).weight_version() == "2");
    ++v;
  }

  // A parameter whose slices never cover it is never written: rank 0 pushes everything but the second half of its
  // q_proj slice; the update fails naming the parameter and the engine stays paused at version 2.
  {
    REQUIRE(coord.BeginUpdate(v).ok());
    for (int r = 0; r < 2; ++r) {
      auto names = ranks[r]->BeginPush(v);
      REQUIRE(names.ok());
      for (const auto& n : *names) REQUIRE(testing::PushGenerated(*ranks[r], specs.at(n), v).ok());
      for (TensorSlice sl : ranks[r]->push_slices()) {
        const replica::TensorSpec& s = specs.at(sl.name);
        if (r == 0 && sl.name == q.name) {
          sl.extents[0] /= 2;
          REQUIRE(ValidateSlice(&sl).ok());
        }
        const std::vector<uint8_t> data = Cut(s, sl, v);
        REQUIRE(ranks[r]->PushSlice(sl.name, s.dtype, sl.full_shape, sl.offsets, sl.extents, data.data(),
                                    data.size()).ok());
      }
      REQUIRE(ranks[r]->EndPush(v).ok());
    }
    auto rec = coord.CommitUpdate(v, 10);
    INFO(rec.status().ToString());
    REQUIRE_FALSE(rec.ok());
    CHECK(absl::StrContains(rec.status().message(), "qkv_proj"));
    auto info = Info(cl.engines[0]);
    CHECK(info.weight_version() == "2");
    CHECK(info.paused());  // never resumed with partial weights
    // Parameters complete on their own were written (writes stream as parameters complete); the one whose slices
    // never covered it was not: rank 0's layer-0 qkv_proj still holds version 2's bytes.
    const auto after = Checksums(cl.engines[0], 2);
    const std::string qkv = "0/model.layers.0.self_attn.qkv_proj.weight";
    REQUIRE(before.count(qkv) == 1);
    CHECK(after.at(qkv) == before.at(qkv));
    CHECK(after.at("0/model.norm.weight") != before.at("0/model.norm.weight"));
    ++v;
  }
  good_update(v);
}

}  // namespace
}  // namespace wsync
