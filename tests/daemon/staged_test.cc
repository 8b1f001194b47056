// Staged updates on a real local cluster of reference engines started with --staging (docs/operations.md, "Staged
// updates"): the engines serve the old version, bit-exactly, while the new one is written into their staging copies;
// the fleet switches at one barrier; a rank whose staged bytes differ from what the sources wrote leaves its engine
// out (stale, serving the old version) while the others switch; an engine refuses a switch to a staging copy changed
// after it was verified; staged mode is refused for an engine without staging memory; an engine joining during the
// stage is not switched, and the next update brings it up.

#include <fcntl.h>
#include <httplib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "client/coordinator_client.h"
#include "client/trainer_client.h"
#include "tests/daemon/cluster.h"
#include "tests/daemon/helpers.h"

namespace wsync {
namespace {

using testing::Cluster;
using testing::ClusterOptions;
using testing::EngineStub;
using testing::Info;
using testing::PushGenerated;
using testing::Verify;

const char* kBin = WSYNC_BIN_DIR;
const char* kModel = WSYNC_TINY_MODEL;
constexpr int kTp = 2;

using Snapshot = std::map<std::string, std::string>;  // "rank/param" → XXH3-128 of the live weights

// One read of the live weights of rank `r` (under the engine's serving lock: one version); empty on an error.
Snapshot RankSnapshot(const std::string& engine, int r) {
  Snapshot out;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::RankRequest req;
    req.set_rank(r);
    v1::ChecksumReply rep;
    grpc::Status st = EngineStub(engine)->GetChecksums(&ctx, req, &rep);
    if (!st.ok()) return {{"error", st.error_message()}};
    for (const auto& p : rep.params()) out[std::to_string(r) + "/" + p.name()] = p.xxh128();
  }
  return out;
}

// Every rank's live weights, read one after another.
std::vector<Snapshot> LiveSnapshot(const std::string& engine) {
  std::vector<Snapshot> out;
  for (int r = 0; r < kTp; ++r) out.push_back(RankSnapshot(engine, r));
  return out;
}

// Reads the live weights of one engine again and again until stopped, noting for each read whether the commit had
// started yet; also notes whether the engine ever reported itself paused before the commit.
class Reader {
 public:
  explicit Reader(std::string engine) : engine_(std::move(engine)) {
    thread_ = std::thread([this] {
      while (!stop_) {
        const bool committing = committing_;
        const int rank = static_cast<int>(n_++ % kTp);
        Snapshot s = RankSnapshot(engine_, rank);
        if (!committing) {
          grpc::ClientContext ctx;
          v1::EngineInfo info;
          if (EngineStub(engine_)->GetInfo(&ctx, v1::GetEngineInfoRequest(), &info).ok() && info.paused())
            paused_before_commit_ = true;
        }
        std::lock_guard<std::mutex> l(mu_);
        reads_.push_back({committing, rank, std::move(s)});
      }
    });
  }
  ~Reader() { Stop(); }
  void CommitStarts() { committing_ = true; }
  void Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  // Every read of a rank saw exactly its `before` or its `after`; those before the commit started saw `before`.
  void Check(const std::vector<Snapshot>& before, const std::vector<Snapshot>& after) {
    std::lock_guard<std::mutex> l(mu_);
    int old_reads = 0, new_reads = 0;
    for (const auto& [committing, rank, s] : reads_) {
      INFO("rank " << rank << (s.count("error") ? ": " + s.at("error") : std::string()));
      REQUIRE(s.size() > 1);
      const bool is_old = s == before[rank], is_new = s == after[rank];
      CHECK((is_old || is_new));  // never a mix of two versions
      if (!committing) CHECK(is_old);
      old_reads += is_old;
      new_reads += is_new;
    }
    INFO(engine_ << ": " << old_reads << " reads of the old version, " << new_reads << " of the new");
    CHECK(old_reads > 0);
    CHECK_FALSE(paused_before_commit_);
  }

 private:
  std::string engine_;
  std::atomic<bool> stop_{false}, committing_{false}, paused_before_commit_{false};
  uint64_t n_ = 0;
  std::mutex mu_;
  struct Read {
    bool committing;
    int rank;
    Snapshot snapshot;
  };
  std::vector<Read> reads_;
  std::thread thread_;
};

// Keeps the first 64 bytes of one memfd segment of an engine process at a fixed pattern, writing through the memfd
// (a mapping of the same memory the target daemon writes), until destroyed.
class Corrupter {
 public:
  Corrupter(pid_t pid, const std::string& segment_name) {
    const std::string dir = "/proc/" + std::to_string(pid) + "/fd";
    for (int fd = 0; fd < 4096 && fd_ < 0; ++fd) {
      char link[512];
      const std::string path = dir + "/" + std::to_string(fd);
      const ssize_t n = readlink(path.c_str(), link, sizeof(link) - 1);
      if (n <= 0) continue;
      link[n] = 0;
      if (std::string(link).rfind("/memfd:" + segment_name + " ", 0) == 0) fd_ = open(path.c_str(), O_RDWR);
    }
    REQUIRE(fd_ >= 0);
    void* p = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    REQUIRE(p != MAP_FAILED);
    base_ = static_cast<uint8_t*>(p);
    std::memset(pattern_, 0xA5, sizeof(pattern_));
    std::memcpy(base_, pattern_, sizeof(pattern_));
    thread_ = std::thread([this] {
      while (!stop_) {
        if (std::memcmp(base_, pattern_, sizeof(pattern_)) != 0) std::memcpy(base_, pattern_, sizeof(pattern_));
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    });
  }
  ~Corrupter() {
    stop_ = true;
    thread_.join();
    munmap(base_, 4096);
    close(fd_);
  }

 private:
  int fd_ = -1;
  uint8_t* base_ = nullptr;
  uint8_t pattern_[64];
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

absl::StatusOr<v1::UpdateRecord> Update(Cluster& cl, client::TrainerClient& trainer, int64_t v, const std::string& mode,
                                        const std::function<void()>& staged = {}, const std::string& pause_mode = "") {
  static const auto specs = testing::Specs(kModel);
  client::CoordinatorClient coord(cl.coordinator);
  auto b = coord.BeginUpdate(v, pause_mode, mode);
  if (!b.ok()) return b.status();
  auto names = trainer.BeginPush(v);
  REQUIRE(names.ok());
  for (const auto& n : *names) REQUIRE(PushGenerated(trainer, specs.at(n), v).ok());
  REQUIRE(trainer.EndPush(v).ok());
  if (staged) staged();
  return coord.CommitUpdate(v, 30);
}

// `wsyncctl engines --watch --health-listen` against the cluster: a router's health endpoint per engine.
class HealthEndpoint {
 public:
  explicit HealthEndpoint(Cluster& cl)
      : log_(cl.dir() + "/health.log"),
        proc_({std::string(kBin) + "/wsyncctl", "--endpoints", cl.coordinator, "engines", "--watch", "-w", "json",
               "--health-listen", "127.0.0.1:0"},
              log_) {
    const std::string marker = "health endpoint on 127.0.0.1:";
    for (int i = 0; i < 200 && port_ == 0; ++i) {
      const std::string text = testing::ReadFile(log_);
      const size_t at = text.find(marker);
      if (at != std::string::npos && text.find('\n', at) != std::string::npos)
        port_ = std::stoi(text.substr(at + marker.size()));
      else
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    REQUIRE(port_ > 0);
  }
  // GET /engines/<id>/ready once the answer is `code` (the stream may lag by its poll interval), or the last answer.
  std::pair<int, std::string> Await(const std::string& id, int code) {
    std::pair<int, std::string> last{-1, ""};
    for (int i = 0; i < 100; ++i) {
      httplib::Client c("127.0.0.1", port_);
      auto r = c.Get(("/engines/" + id + "/ready").c_str());
      if (r) last = {r->status, r->body};
      if (last.first == code) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return last;
  }
  std::string Log() const { return testing::ReadFile(log_); }

 private:
  std::string log_;
  testing::Process proc_;
  int port_ = 0;
};

std::unique_ptr<client::TrainerClient> Trainer(Cluster& cl) {
  client::TrainerOptions to;
  to.daemon = cl.trainer_sockets[0];
  to.timeout = absl::Seconds(20);
  auto t = client::TrainerClient::Connect(to);
  REQUIRE(t.ok());
  return *std::move(t);
}

const v1::EngineSummary* Engine(const v1::ClusterStatus& st, const std::string& id) {
  for (const auto& n : st.nodes())
    for (const auto& e : n.engine_details())
      if (e.engine_id() == id) return &e;
  return nullptr;
}

// The staging digest of every rank of `engine` as it is now (what a coordinator sends back with Switch).
std::vector<std::string> StagingDigests(const std::string& engine) {
  std::vector<std::string> out;
  for (int r = 0; r < kTp; ++r) {
    grpc::ClientContext ctx;
    v1::RankRequest req;
    req.set_rank(r);
    req.set_staging(true);
    v1::ChecksumReply rep;
    REQUIRE(EngineStub(engine)->GetChecksums(&ctx, req, &rep).ok());
    REQUIRE(!rep.staging_digest().empty());
    out.push_back(rep.staging_digest());
  }
  return out;
}

TEST_CASE(
    "staged: engines serve the old version while the new one is staged, then switch together; a rank that "
    "fails verification leaves its engine out, stale") {
  ClusterOptions o;
  o.bin_dir = kBin;
  o.model = kModel;
  o.engines = 2;
  o.tp = kTp;
  o.engine_args = {"--staging"};
  Cluster cl(o);
  INFO("cluster logs in " << cl.dir());
  auto trainer = Trainer(cl);
  client::CoordinatorClient coord(cl.coordinator);

  // A classic update on engines with staging memory writes their live copy.
  auto r1 = Update(cl, *trainer, 1, "");
  REQUIRE(r1.ok());
  CHECK(r1->mode() == "classic");
  for (const auto& e : cl.engines) CHECK(Verify(e, 1).ok());

  // Staged: readers on every engine throughout; mid-stage the engines are unpaused and verify at the old version.
  std::map<std::string, std::vector<Snapshot>> before, after;
  for (const auto& e : cl.engines) before[e] = LiveSnapshot(e);
  std::vector<std::unique_ptr<Reader>> readers;
  for (const auto& e : cl.engines) readers.push_back(std::make_unique<Reader>(e));
  auto r2 = Update(cl, *trainer, 2, "staged", [&] {
    for (const auto& e : cl.engines) {
      CHECK_FALSE(Info(e).paused());
      CHECK(Verify(e, 1).ok());
      CHECK(Info(e).weight_version() == "1");
    }
    for (auto& r : readers) r->CommitStarts();
  });
  for (auto& r : readers) r->Stop();
  INFO((r2.ok() ? "" : r2.status().ToString()));
  REQUIRE(r2.ok());
  CHECK(r2->success());
  CHECK(r2->mode() == "staged");
  CHECK(r2->switched_size() == 2);
  CHECK(r2->stale_size() == 0);
  for (const auto& e : cl.engines) {
    CHECK(Verify(e, 2).ok());
    CHECK(Verify(e, 1).ok() == false);  // the check can fail
    CHECK(Info(e).weight_version() == "2");
    CHECK(Info(e).live_set() == 1);
    after[e] = LiveSnapshot(e);
    CHECK(after[e] != before[e]);
  }
  for (size_t i = 0; i < readers.size(); ++i) readers[i]->Check(before[cl.engines[i]], after[cl.engines[i]]);

  // Update 3: engine1 rank 1's staging copy (copy 0 now: copy 1 is live) is overwritten after the sources wrote it.
  {
    Corrupter bad(cl.engine_pids[1], "wsync-engine-engine1-r1-s0");
    auto r3 = Update(cl, *trainer, 3, "staged");
    INFO((r3.ok() ? "" : r3.status().ToString()));
    REQUIRE(r3.ok());
    CHECK(r3->success());
    REQUIRE(r3->switched_size() == 1);
    CHECK(r3->switched(0) == "engine0");
    REQUIRE(r3->stale_size() == 1);
    CHECK(absl::StartsWith(r3->stale(0), "engine1: staging not verified"));
    CHECK(absl::StrContains(r3->stale(0), "rank 1"));
  }
  CHECK(Verify(cl.engines[0], 3).ok());
  CHECK(Verify(cl.engines[1], 2).ok());  // left out: it serves the old version, untouched
  CHECK(Info(cl.engines[1]).weight_version() == "2");
  CHECK_FALSE(Info(cl.engines[1]).paused());
  {
    auto st = coord.Status();
    REQUIRE(st.ok());
    CHECK(st->current_version() == "3");
    const auto* e0 = Engine(*st, "engine0");
    const auto* e1 = Engine(*st, "engine1");
    REQUIRE(e0 != nullptr);
    REQUIRE(e1 != nullptr);
    CHECK_FALSE(e0->stale());
    CHECK(e0->weight_version() == "3");
    CHECK(e0->state() == "serving");
    CHECK(e1->stale());
    CHECK(e1->state() == "stale");
    CHECK(e1->weight_version() == "2");
    CHECK(e1->staging());
  }
  // A router's health check keeps the stale engine out of rotation, the switched one in.
  HealthEndpoint health(cl);
  {
    auto a0 = health.Await("engine0", 200);
    CHECK(a0.first == 200);
    CHECK(absl::StrContains(a0.second, "ready version 3"));
    auto a1 = health.Await("engine1", 503);
    CHECK(a1.first == 503);
    CHECK(absl::StrContains(a1.second, "stale: serves version 2, the current one is 3"));
    CHECK(health.Await("engine9", 404).first == 404);
  }

  // A switch whose staging copy changed after its digest was taken is refused, and nothing switches.
  {
    // Rank 0's staging copy holds update 3 as written (only rank 1 was overwritten): it changes after the digests.
    const auto digests = StagingDigests(cl.engines[1]);
    { Corrupter after_verify(cl.engine_pids[1], "wsync-engine-engine1-r0-s0"); }
    grpc::ClientContext ctx;
    v1::SwitchRequest req;
    req.set_version("3");
    for (const auto& d : digests) req.add_staging_digests(d);
    v1::EngineReply rep;
    grpc::Status s = EngineStub(cl.engines[1])->Switch(&ctx, req, &rep);
    CHECK(s.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK(absl::StrContains(s.error_message(), "rank 0's staging copy is not what was verified"));
    CHECK(Verify(cl.engines[1], 2).ok());
    CHECK(Info(cl.engines[1]).weight_version() == "2");
    CHECK(Info(cl.engines[1]).live_set() == 1);
    // The coordinator's order re-hashes in a prepare, before the pause: it refuses the change too, and the engine
    // was never paused for it.
    grpc::ClientContext pctx;
    grpc::Status p = EngineStub(cl.engines[1])->PrepareSwitch(&pctx, req, &rep);
    CHECK(p.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK(absl::StrContains(p.error_message(), "rank 0's staging copy is not what was verified"));
    CHECK_FALSE(Info(cl.engines[1]).paused());
    // A prepare with the digests of what is there now arms the switch; a switch with other digests (the verified
    // ones) is not armed by it, hashes, and is refused.
    grpc::ClientContext actx;
    v1::SwitchRequest now = req;
    now.clear_staging_digests();
    for (const auto& d : StagingDigests(cl.engines[1])) now.add_staging_digests(d);
    CHECK(EngineStub(cl.engines[1])->PrepareSwitch(&actx, now, &rep).ok());
    grpc::ClientContext sctx;
    CHECK(EngineStub(cl.engines[1])->Switch(&sctx, req, &rep).error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK(Info(cl.engines[1]).live_set() == 1);
  }

  // The next staged update writes every byte of every staging copy again: both switch, engine1 is no longer stale.
  auto r4 = Update(cl, *trainer, 4, "staged");
  INFO((r4.ok() ? "" : r4.status().ToString()));
  REQUIRE(r4.ok());
  CHECK(r4->switched_size() == 2);
  for (const auto& e : cl.engines) CHECK(Verify(e, 4).ok());
  auto st = coord.Status();
  REQUIRE(st.ok());
  CHECK_FALSE(Engine(*st, "engine1")->stale());
  CHECK(Engine(*st, "engine1")->weight_version() == "4");
  CHECK(health.Await("engine1", 200).first == 200);
  // The watch stream printed the stale state, and later the ready one.
  const std::string log = health.Log();
  CHECK(absl::StrContains(log, "\"stale\":true"));
  CHECK(absl::StrContains(log, "\"current_version\":\"4\""));
}

// How many times the source configured a plan, by its own log (one line per configuration applied).
int SourceConfigures(const Cluster& cl) {
  const std::string log = cl.Log("source0");
  int n = 0;
  for (size_t at = log.find("configured plan "); at != std::string::npos; at = log.find("configured plan ", at + 1))
    ++n;
  return n;
}

TEST_CASE("staged: steady staged updates configure no source; each writes the other copy, bit-exact") {
  ClusterOptions o;
  o.bin_dir = kBin;
  o.model = kModel;
  o.tp = kTp;
  o.engine_args = {"--staging"};
  Cluster cl(o);
  INFO("cluster logs in " << cl.dir());
  auto trainer = Trainer(cl);
  const std::string& e = cl.engines[0];
  auto r1 = Update(cl, *trainer, 1, "classic");
  REQUIRE(r1.ok());
  REQUIRE(Verify(e, 1).ok());
  REQUIRE(SourceConfigures(cl) == 1);
  // Three staged updates alternate the copy written (live copy 1, 0, 1 after each): the plan and the sources'
  // configuration stay; only StartUpdate names the copy.
  for (int64_t v = 2; v <= 4; ++v) {
    auto r = Update(cl, *trainer, v, "staged");
    INFO("update " << v << ": " << (r.ok() ? std::string() : r.status().ToString()));
    REQUIRE(r.ok());
    CHECK(r->success());
    CHECK(r->switched_size() == 1);
    for (const auto& p : r->phases()) CHECK(p.phase() != "configure");
    CHECK(Verify(e, v).ok());
    CHECK_FALSE(Verify(e, v - 1).ok());
    CHECK(Info(e).weight_version() == std::to_string(v));
    CHECK(Info(e).live_set() == (v % 2 == 0 ? 1 : 0));
  }
  CHECK(SourceConfigures(cl) == 1);
  // A classic update after them writes the live copy (0 or 1, whichever the last switch left), still unconfigured.
  auto r5 = Update(cl, *trainer, 5, "classic");
  REQUIRE(r5.ok());
  CHECK(Verify(e, 5).ok());
  CHECK(Info(e).live_set() == 1);
  CHECK(SourceConfigures(cl) == 1);

  // A staged update whose bucket the source refuses (a wrong shape): the source fails it and tells the coordinator,
  // which ends it at once with the push row's staged policy (serve on): the engine was never paused, keeps serving
  // version 5 from its live copy, and the coordinator reports it serving, not stale, at version 5.
  {
    static const auto specs = testing::Specs(kModel);
    client::CoordinatorClient coord(cl.coordinator);
    REQUIRE(coord.BeginUpdate(6, "", "staged").ok());
    REQUIRE(trainer->BeginPush(6).ok());
    replica::TensorSpec bad = specs.at("model.layers.0.self_attn.q_proj.weight");
    bad.shape = {bad.shape[0] / 2, bad.shape[1] * 2};  // same bytes, wrong shape
    REQUIRE(PushGenerated(*trainer, bad, 6).ok());  // the ring takes it; the daemon judges the bucket
    CHECK(trainer->Flush().code() == absl::StatusCode::kInvalidArgument);
    auto r6 = coord.CommitUpdate(6, 30);  // waits for the end the source's report started, if it is still running
    INFO(r6.status().ToString());
    CHECK(r6.status().code() == absl::StatusCode::kAborted);
    CHECK(absl::StrContains(r6.status().message(), "q_proj"));
    CHECK(Info(e).weight_version() == "5");
    CHECK_FALSE(Info(e).paused());
    CHECK(Verify(e, 5).ok());
    auto st = coord.Status();
    REQUIRE(st.ok());
    const auto* e0 = Engine(*st, "engine0");
    REQUIRE(e0 != nullptr);
    CHECK(e0->weight_version() == "5");
    CHECK_FALSE(e0->stale());
    CHECK(e0->state() == "serving");
    CHECK_FALSE(st->engines_hold_partial_writes());  // staging memory only was written: the live copy is whole
  }
}

TEST_CASE("staged: refused, naming the engine, when an engine offers no staging memory; classic still runs") {
  ClusterOptions o;
  o.bin_dir = kBin;
  o.model = kModel;
  o.tp = kTp;
  Cluster cl(o);
  INFO("cluster logs in " << cl.dir());
  auto trainer = Trainer(cl);
  client::CoordinatorClient coord(cl.coordinator);
  auto b = coord.BeginUpdate(1, "", "staged");
  REQUIRE_FALSE(b.ok());
  CHECK(b.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(b.status().message(),
                          "engine engine0 (reference, node infer0) offers no staging memory; use mode classic or start "
                          "it with --staging"));
  CHECK_FALSE(Info(cl.engines[0]).paused());
  CHECK_FALSE(coord.BeginUpdate(1, "", "fast").ok());
  // A pause mode no engine knows is refused before anything is paused (it was refused by each engine at its pause).
  auto bad = coord.BeginUpdate(1, "keep", "classic");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(bad.status().message(), "pause mode 'keep' is not retract, in_place or abort"));
  CHECK_FALSE(Info(cl.engines[0]).paused());
  // The refused version was not used up.
  auto r = Update(cl, *trainer, 1, "classic");
  REQUIRE(r.ok());
  CHECK(Verify(cl.engines[0], 1).ok());
}

TEST_CASE("staged: an engine joining during the stage is not switched; the next update brings it up") {
  ClusterOptions o;
  o.bin_dir = kBin;
  o.model = kModel;
  o.tp = kTp;
  o.engine_args = {"--staging"};
  Cluster cl(o);
  INFO("cluster logs in " << cl.dir());
  auto trainer = Trainer(cl);
  client::CoordinatorClient coord(cl.coordinator);
  // The second engine and its target daemon start during the stage; the daemon's registration is refused while the
  // update is in progress (it retries), so AddEngine returns only after the commit.
  std::thread joiner;
  auto r1 = Update(cl, *trainer, 1, "staged", [&] {
    joiner = std::thread([&] { cl.AddEngine(kTp); });
    bool refused = false;
    for (int i = 0; i < 400 && !refused; ++i) {
      refused = absl::StrContains(testing::ReadFile(cl.dir() + "/target1.log"), "is in progress");
      if (!refused) std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    CHECK(refused);
  });
  joiner.join();
  INFO((r1.ok() ? "" : r1.status().ToString()));
  REQUIRE(r1.ok());
  REQUIRE(r1->switched_size() == 1);
  CHECK(r1->switched(0) == "engine0");
  CHECK(Verify(cl.engines[0], 1).ok());
  // It registers once the update has ended (registrations wait for it), serving what it was started with.
  bool registered = false;
  for (int i = 0; i < 200 && !registered; ++i) {
    auto st = coord.Status();
    REQUIRE(st.ok());
    registered = Engine(*st, "engine1") != nullptr;
    if (!registered) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  REQUIRE(registered);
  CHECK(Info(cl.engines[1]).weight_version() == "0");
  CHECK(Verify(cl.engines[1], 1).ok() == false);
  // The switch pauses with the update's pause mode (in_place: running requests keep their place and KV).
  auto r2 = Update(cl, *trainer, 2, "staged", {}, "in_place");
  INFO((r2.ok() ? "" : r2.status().ToString()));
  REQUIRE(r2.ok());
  CHECK(r2->switched_size() == 2);
  CHECK(r2->pause_mode() == "in_place");
  CHECK(r1->pause_mode() == "retract");
  for (const auto& e : cl.engines) {
    CHECK(Verify(e, 2).ok());
    // What each engine was asked (its own log): retract at the first switch (engine0), in_place at this one.
    const std::string log = cl.Log(e == cl.engines[0] ? "engine0" : "engine1");
    CHECK(absl::StrContains(log, "paused (mode in_place)"));
  }
  CHECK(absl::StrContains(cl.Log("engine0"), "paused (mode retract)"));
}

TEST_CASE(
    "staged: the coordinator killed between stage and switch abandons the update; every engine serves on at "
    "the old version") {
  ClusterOptions o;
  o.bin_dir = kBin;
  o.model = kModel;
  o.engines = 2;
  o.tp = kTp;
  o.engine_args = {"--staging"};
  char tmpl[] = "/tmp/wsync-staged-state.XXXXXX";
  const std::string state_dir = mkdtemp(tmpl);
  o.coordinator_args = {"--state", state_dir + "/coordinator.db"};
  Cluster cl(o);
  INFO("cluster logs in " << cl.dir());
  auto trainer = Trainer(cl);
  auto r1 = Update(cl, *trainer, 1, "staged");
  INFO((r1.ok() ? "" : r1.status().ToString()));
  REQUIRE(r1.ok());
  REQUIRE(r1->switched_size() == 2);
  // Update 2 is staged (every byte written into the staging copies), then the coordinator dies before its commit.
  static const auto specs = testing::Specs(kModel);
  {
    client::CoordinatorClient coord(cl.coordinator);
    REQUIRE(coord.BeginUpdate(2, "", "staged").ok());
    auto names = trainer->BeginPush(2);
    REQUIRE(names.ok());
    for (const auto& n : *names) REQUIRE(PushGenerated(*trainer, specs.at(n), 2).ok());
    REQUIRE(trainer->EndPush(2).ok());
  }
  cl.RestartCoordinator();
  client::CoordinatorClient coord(cl.coordinator);
  auto st = coord.Status();
  REQUIRE(st.ok());
  CHECK(st->current_version() == "1");
  CHECK_FALSE(st->engines_hold_partial_writes());
  auto h = coord.History(1);
  REQUIRE(h.ok());
  REQUIRE(h->records_size() == 1);
  CHECK(h->records(0).version() == 2);
  CHECK_FALSE(h->records(0).success());
  CHECK(h->records(0).mode() == "staged");
  CHECK(absl::StrContains(h->records(0).error(), "abandoned before its switch"));
  for (const auto& e : cl.engines) {
    CHECK_FALSE(Info(e).paused());
    CHECK(Info(e).weight_version() == "1");
    CHECK(Verify(e, 1).ok());
  }
  // The next staged update runs and both engines switch to it.
  std::optional<absl::StatusOr<v1::UpdateRecord>> r3;
  for (int i = 0; i < 100; ++i) {  // the daemons renew their leases with the new coordinator first
    r3 = Update(cl, *trainer, 3 + i, "staged");
    if (r3->ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  INFO((r3->ok() ? "" : r3->status().ToString()));
  REQUIRE(r3->ok());
  CHECK((*r3)->switched_size() == 2);
  for (const auto& e : cl.engines) CHECK(Verify(e, (*r3)->version()).ok());
  std::system(("rm -rf " + state_dir).c_str());
}

}  // namespace
}  // namespace wsync
