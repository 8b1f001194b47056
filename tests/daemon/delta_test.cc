// Delta updates on a real local cluster (docs/delta.md): consecutive RL-like steps (tools/testdata/weight_gen.h
// sparse steps: ~2 % of the elements change per step) go to engine ranks holding the delta base as records the
// target daemons decode; every update is verified bit-exactly by the reference engine's own loader, and the bytes
// sent are compared with the dense bytes. Dense where the base is not known to be held: the first update, delta=off,
// a new engine (re-plan), a failed update, and a rank whose staged records ApplyDelta refused (wrong base).

#include <grpcpp/grpcpp.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/coordinator_client.h"
#include "client/trainer_client.h"
#include "proto/status_convert.h"
#include "tests/daemon/cluster.h"
#include "tests/daemon/helpers.h"
#include "tools/testdata/weight_gen.h"
#include "wsync/v1/daemon.grpc.pb.h"

namespace wsync {
namespace {

using testing::Cluster;
using testing::ClusterOptions;
using testing::PushGenerated;
using testing::Verify;

const char* kBin = WSYNC_BIN_DIR;
constexpr int64_t kBase = tools::kSparseStepBase;

std::unique_ptr<client::TrainerClient> ConnectTrainer(const Cluster& cl) {
  client::TrainerOptions to;
  to.daemon = cl.trainer_sockets[0];
  to.timeout = absl::Seconds(20);
  auto trainer = client::TrainerClient::Connect(to);
  REQUIRE(trainer.ok());
  return *std::move(trainer);
}

// Opens update `v` with `delta`, pushes step v of the model from the in-process trainer rank and commits.
absl::StatusOr<v1::UpdateRecord> RunUpdate(Cluster& cl, const std::string& model, client::TrainerClient& trainer,
                                           int64_t v, const std::string& delta = "") {
  const auto specs = testing::Specs(model);
  client::CoordinatorClient coord(cl.coordinator);
  auto b = coord.BeginUpdate(v, "", "", delta);
  if (!b.ok()) return b.status();
  auto names = trainer.BeginPush(v);
  REQUIRE(names.ok());
  absl::Status pushed;
  for (const auto& n : *names) {
    pushed = PushGenerated(trainer, specs.at(n), v);
    if (!pushed.ok()) break;
  }
  if (pushed.ok()) pushed = trainer.EndPush(v);
  UNSCOPED_INFO("trainer push of update " << v << ": " << pushed.ToString());
  auto rec = coord.CommitUpdate(v, 30);
  if (!rec.ok()) return rec.status();
  return *rec;
}

std::string Fallbacks(const v1::UpdateRecord& r) {
  std::string out;
  for (const auto& f : r.fallbacks()) absl::StrAppend(&out, f.rank(), ": ", f.reason(), "\n");
  return out;
}

// Every engine's own loader holds step `v`, and it does not hold `not_v` (the check can fail).
void VerifyAll(const Cluster& cl, int64_t v, int64_t not_v) {
  for (const auto& e : cl.engines) {
    INFO("engine " << e << " at step " << v);
    CHECK(Verify(e, v).ok());
    CHECK_FALSE(Verify(e, not_v).ok());
  }
}

// An update that took deltas on `ranks` engine ranks: a small fraction of the dense bytes sent.
void CheckDelta(const v1::UpdateRecord& r, int ranks, double max_ratio) {
  INFO("update " << r.version() << " fallbacks:\n" << Fallbacks(r));
  CHECK(r.success());
  CHECK(r.delta_ranks_size() == ranks);
  CHECK(r.fallbacks_size() == 0);
  REQUIRE(r.dense_bytes() > 0);
  const double ratio = static_cast<double>(r.sent_bytes()) / static_cast<double>(r.dense_bytes());
  std::printf("update %lld: %llu bytes sent for %llu dense (%.4f)\n", static_cast<long long>(r.version()),
              static_cast<unsigned long long>(r.sent_bytes()), static_cast<unsigned long long>(r.dense_bytes()), ratio);
  CHECK(ratio < max_ratio);
}

// A dense update: every rank fell back, each with a reason containing `why`.
void CheckDense(const v1::UpdateRecord& r, int ranks, const std::string& why) {
  INFO("update " << r.version() << " fallbacks:\n" << Fallbacks(r));
  CHECK(r.success());
  CHECK(r.delta_ranks_size() == 0);
  CHECK(r.fallbacks_size() == ranks);
  for (const auto& f : r.fallbacks()) CHECK(absl::StrContains(f.reason(), why));
  CHECK(r.sent_bytes() == r.dense_bytes());
}

ClusterOptions Options(const std::string& model) {
  ClusterOptions o;
  o.bin_dir = kBin;
  o.model = model;
  o.engines = 1;
  o.tp = 2;
  return o;
}

TEST_CASE(
    "delta: consecutive steps send only what changed, bit-exact; off, a new engine and a wrong base are "
    "dense") {
  const std::string model = WSYNC_TINY_MODEL;
  Cluster cl(Options(model));
  INFO("cluster logs in " << cl.dir() << " (WSYNC_TEST_KEEP=1 keeps them)");
  auto trainer = ConnectTrainer(cl);

  auto r = RunUpdate(cl, model, *trainer, kBase);
  REQUIRE(r.ok());
  CheckDense(*r, 2, "no complete version");  // a fresh plan: the source has no base yet
  VerifyAll(cl, kBase, kBase + 1);

  for (int64_t v = kBase + 1; v <= kBase + 2; ++v) {
    r = RunUpdate(cl, model, *trainer, v);
    INFO(r.status().ToString());
    REQUIRE(r.ok());
    CheckDelta(*r, 2, 0.10);
    VerifyAll(cl, v, v - 1);
  }

  r = RunUpdate(cl, model, *trainer, kBase + 3, "off");
  REQUIRE(r.ok());
  CheckDense(*r, 2, "delta=off");
  VerifyAll(cl, kBase + 3, kBase + 2);

  // A dense update still leaves base and ranks at one version: deltas again, also when demanded.
  r = RunUpdate(cl, model, *trainer, kBase + 4, "always");
  REQUIRE(r.ok());
  CheckDelta(*r, 2, 0.10);
  VerifyAll(cl, kBase + 4, kBase + 3);

  // Wrong base: the records of update kBase+4 applied again onto engine memory that already holds it (the sources'
  // FinishUpdate answers its recorded reply to a repeat). Apply's base checksum refuses the first record, names the
  // engine rank and parameter, and writes nothing.
  {
    client::CoordinatorClient coord(cl.coordinator);
    auto st = coord.Status();
    REQUIRE(st.ok());
    auto src = v1::NodeDaemon::NewStub(grpc::CreateChannel(cl.sources[0], grpc::InsecureChannelCredentials()));
    v1::FinishUpdateRequest freq;
    freq.set_version(kBase + 4);
    freq.set_plan_epoch(st->plan_epoch());
    v1::FinishUpdateReply fin;
    grpc::ClientContext c1;
    REQUIRE(src->FinishUpdate(&c1, freq, &fin).ok());
    v1::ApplyDeltaRequest areq;
    areq.set_version(kBase + 4);
    for (const auto& d : fin.ranks()) {
      if (d.records() == 0) continue;
      auto* s = areq.add_staged();
      s->set_source_node("train0");
      s->set_engine_id(d.engine_id());
      s->set_rank(d.rank());
      s->set_bytes(d.staged_bytes());
      s->set_records(d.records());
    }
    REQUIRE(areq.staged_size() == 2);
    auto tgt = v1::NodeDaemon::NewStub(grpc::CreateChannel(cl.targets[0], grpc::InsecureChannelCredentials()));
    {
      // Only rank 1's records: rank 0 keeps its held version.
      v1::ApplyDeltaRequest one = areq;
      one.clear_staged();
      for (const auto& s : areq.staged())
        if (s.rank() == 1) *one.add_staged() = s;
      v1::ApplyDeltaReply rep;
      grpc::ClientContext c2;
      grpc::Status gs = tgt->ApplyDelta(&c2, one, &rep);
      INFO(gs.error_message());
      CHECK(gs.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
      CHECK(absl::StrContains(gs.error_message(), "engine engine0 rank 1 parameter "));
      CHECK(absl::StrContains(gs.error_message(), "refused, nothing of it written"));
    }
    {
      // Records claimed for a source that staged nothing there are refused before anything is read.
      v1::ApplyDeltaRequest other = areq;
      other.mutable_staged(0)->set_source_node("train9");
      v1::ApplyDeltaReply rep;
      grpc::ClientContext c3;
      grpc::Status gs = tgt->ApplyDelta(&c3, other, &rep);
      CHECK_FALSE(gs.ok());
      CHECK(absl::StrContains(gs.error_message(), "staged by source train9"));
    }
    VerifyAll(cl, kBase + 4, kBase + 3);  // nothing was written
  }
  // The refused rank gets dense writes next; the other still takes deltas.
  r = RunUpdate(cl, model, *trainer, kBase + 5);
  REQUIRE(r.ok());
  {
    INFO(Fallbacks(*r));
    CHECK(r->delta_ranks_size() == 1);
    REQUIRE(r->fallbacks_size() == 1);
    CHECK(r->fallbacks(0).rank() == "engine0/1");
    CHECK(absl::StrContains(r->fallbacks(0).reason(), "holds no known version"));
  }
  VerifyAll(cl, kBase + 5, kBase + 4);

  // A new engine joins: the plan changes, the source's replica and base are new, so everything is dense once.
  cl.AddEngine(2);
  for (int i = 0; i < 100; ++i) {  // its target daemon registers the engine
    client::CoordinatorClient coord(cl.coordinator);
    auto st = coord.Status();
    int engines = 0;
    if (st.ok())
      for (const auto& n : st->nodes()) engines += n.engine_details_size();
    if (engines == 2) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  r = RunUpdate(cl, model, *trainer, kBase + 6);
  INFO(r.status().ToString());
  REQUIRE(r.ok());
  CheckDense(*r, 4, "");
  VerifyAll(cl, kBase + 6, kBase + 5);
  r = RunUpdate(cl, model, *trainer, kBase + 7, "always");
  REQUIRE(r.ok());
  CheckDelta(*r, 4, 0.10);
  VerifyAll(cl, kBase + 7, kBase + 6);

  // The history shows the figures.
  client::CoordinatorClient coord(cl.coordinator);
  auto h = coord.History(100);
  REQUIRE(h.ok());
  REQUIRE(h->records_size() == 8);
  CHECK(h->records(3).delta_mode() == "off");
  CHECK(h->records(4).delta_mode() == "always");
  bool applied = false;
  for (const auto& p : h->records(7).phases()) applied |= p.phase() == "apply_delta";
  CHECK(applied);
  // wsyncctl history: the bytes sent and the ranks with deltas per update, the reasons of the ranks written dense.
  REQUIRE(cl.Run("history", {std::string(kBin) + "/wsyncctl", "--endpoints", cl.coordinator, "history"},
                 std::chrono::seconds(30)) == 0);
  const std::string table = cl.Log("history");
  INFO(table);
  CHECK(absl::StrContains(table, "SENT_MiB"));
  CHECK(absl::StrContains(table, " 4/4 "));  // kBase+7: every rank of both engines took deltas
  CHECK(absl::StrContains(table, "dense engine0/1: the rank holds no known version"));  // kBase+5
}

TEST_CASE("delta: a failed update is followed by dense writes, then deltas again; bit-exact throughout") {
  // The second target's completion of update kBase+1 fails (fail_wait=4: one batch per engine rank per update, the
  // tiny model in one bucket): engine rank 0 has received update kBase+1's writes, rank 1 not all of them.
  const std::string model = WSYNC_TINY_MODEL;
  ClusterOptions o = Options(model);
  o.source_env = {"WSYNC_FAULTS=fail_wait=4"};
  Cluster cl(o);
  INFO("cluster logs in " << cl.dir() << " (WSYNC_TEST_KEEP=1 keeps them)");
  auto trainer = ConnectTrainer(cl);
  auto r = RunUpdate(cl, model, *trainer, kBase);
  REQUIRE(r.ok());
  VerifyAll(cl, kBase, kBase + 1);
  auto failed = RunUpdate(cl, model, *trainer, kBase + 1);
  REQUIRE_FALSE(failed.ok());
  CHECK(absl::StrContains(failed.status().message(), "injected fault"));
  r = RunUpdate(cl, model, *trainer, kBase + 2);
  INFO(r.status().ToString());
  REQUIRE(r.ok());
  CheckDense(*r, 2, "");  // neither the source's base nor the ranks hold one complete version
  VerifyAll(cl, kBase + 2, kBase + 1);
  r = RunUpdate(cl, model, *trainer, kBase + 3);
  REQUIRE(r.ok());
  CheckDelta(*r, 2, 0.10);
  VerifyAll(cl, kBase + 3, kBase + 2);
}

TEST_CASE("delta: an FP8 block-quantized engine takes deltas of its codes and scales; verified by its own loader") {
  const std::string model = WSYNC_TINY_FP8_MODEL;
  Cluster cl(Options(model));
  INFO("cluster logs in " << cl.dir() << " (WSYNC_TEST_KEEP=1 keeps them)");
  auto trainer = ConnectTrainer(cl);
  auto r = RunUpdate(cl, model, *trainer, kBase);
  REQUIRE(r.ok());
  VerifyAll(cl, kBase, kBase + 1);
  for (int64_t v = kBase + 1; v <= kBase + 2; ++v) {
    r = RunUpdate(cl, model, *trainer, v, "always");
    INFO(r.status().ToString());
    REQUIRE(r.ok());
    // FP8: a changed element moves its block's scale when it was the block's maximum, rewriting the block; the
    // figure is reported, and must beat dense.
    CheckDelta(*r, 2, 0.9);
    VerifyAll(cl, v, v - 1);
  }
}

}  // namespace
}  // namespace wsync
