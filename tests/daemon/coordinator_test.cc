// The coordinator's plan and lifecycle against fake peers (no servers): which engine calls happen in which order,
// what a failure leaves behind, how the seed plan places targets, and the exactly-once update lifecycle under
// retries and concurrent drivers.

#include "daemon/coordinator/coordinator.h"

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <condition_variable>
#include <cstdio>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "client/coordinator_client.h"
#include "daemon/coordinator/state_objects.h"
#include "nlohmann/json.hpp"
#include "planner/model_input.h"
#include "tests/daemon/fake_layouts.h"

namespace wsync::daemon {
namespace {

using testing::FillLayout;
using testing::TinyConfigJson;

class FakePeers : public Peers {
 public:
  absl::StatusOr<v1::ConfigureSourceReply> ConfigureSource(const std::string& addr,
                                                          const v1::ConfigureSourceRequest& req) override {
    std::lock_guard<std::mutex> l(mu);
    if (fail_configure) return absl::UnavailableError("source " + addr + " is gone");
    configured[addr] = req;
    return v1::ConfigureSourceReply();
  }
  absl::Status StartUpdate(const std::string& addr, const v1::StartUpdateRequest& req) override {
    Log("start " + addr);
    {
      std::lock_guard<std::mutex> l(mu);
      start_deltas.push_back(req.delta());
    }
    return absl::OkStatus();
  }
  absl::StatusOr<v1::FinishUpdateReply> FinishUpdate(const std::string& addr,
                                                     const v1::FinishUpdateRequest& req) override {
    Log("finish " + addr);
    {
      // Holds every FinishUpdate while `hold_finish` is set, so a test can act while a commit is running.
      std::unique_lock<std::mutex> l(mu);
      ++finishing;
      cv.notify_all();
      cv.wait(l, [&] { return (!hold_finish && !unanswered.count(addr)) || cancelled.count(addr); });
      --finishing;
      if (cancelled.count(addr)) return absl::CancelledError("call cancelled by the coordinator");
      if (fail_versions.count(req.version()))
        return absl::DataLossError(absl::StrCat("write to engine e1 rank 0 failed in update ", req.version()));
      finish_plan_epochs.insert(req.plan_epoch());
    }
    if (fail_finish) return absl::DataLossError("write to engine e1 rank 0 failed");
    v1::FinishUpdateReply r;
    r.set_bytes_written(100);
    return r;
  }
  absl::StatusOr<v1::AbortSourceUpdateReply> AbortSourceUpdate(const std::string& addr,
                                                               const v1::AbortSourceUpdateRequest& req) override {
    Log("abort " + addr + " " + std::to_string(req.version()));
    if (fail_abort) return absl::UnavailableError("source " + addr + " is gone");
    v1::AbortSourceUpdateReply r;
    r.set_was_open(true);
    r.set_quiescent(true);
    r.set_bytes_written(abort_bytes);
    return r;
  }
  absl::StatusOr<v1::SetWriteWindowReply> SetWriteWindow(const std::string& addr,
                                                          const v1::SetWriteWindowRequest& req) override {
    std::lock_guard<std::mutex> l(mu);
    windows.push_back(absl::StrCat(req.open() ? "open " : "close ", addr));
    return v1::SetWriteWindowReply();
  }
  absl::StatusOr<v1::EngineInfo> EngineInfo(const std::string& addr) override {
    v1::EngineInfo i;
    i.set_model_config_json(TinyConfigJson());
    return i;
  }
  absl::Status Pause(const std::string& addr, const std::string& mode) override { return Log("pause " + addr); }
  absl::Status PostProcess(const std::string& addr, const std::string& v) override {
    return Log("post_process " + addr + " " + v);
  }
  absl::Status SetWeightVersion(const std::string& addr, const std::string& v) override {
    {
      std::lock_guard<std::mutex> l(mu);
      labels[addr].push_back(std::stoll(v));
    }
    return Log("set_version " + addr + " " + v);
  }
  absl::Status Continue(const std::string& addr) override { return Log("continue " + addr); }
  void CancelCalls(const std::string& addr) override {
    std::lock_guard<std::mutex> l(mu);
    cancelled.insert(addr);
    calls.push_back("cancel_calls " + addr);
    cv.notify_all();
  }

  absl::Status Log(const std::string& s) {
    std::lock_guard<std::mutex> l(mu);
    calls.push_back(s);
    return absl::OkStatus();
  }
  int Count(const std::string& prefix) {
    std::lock_guard<std::mutex> l(mu);
    int n = 0;
    for (const auto& c : calls) n += c.rfind(prefix, 0) == 0;
    return n;
  }

  // Blocks until `n` FinishUpdate calls are being held.
  void AwaitFinishing(int n) {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return finishing >= n; });
  }
  void Release() {
    std::lock_guard<std::mutex> l(mu);
    hold_finish = false;
    cv.notify_all();
  }

  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::string> calls;
  std::vector<std::string> windows;  // "open ADDR" / "close ADDR", in order
  std::map<std::string, v1::ConfigureSourceRequest> configured;
  std::vector<std::string> start_deltas;  // StartUpdateRequest.delta, in call order
  std::atomic<bool> fail_finish{false};
  std::atomic<bool> fail_configure{false};
  std::atomic<bool> fail_abort{false};
  std::atomic<uint64_t> abort_bytes{0};
  bool hold_finish = false;             // guarded by mu
  int finishing = 0;                    // guarded by mu
  std::set<int64_t> fail_versions;      // guarded by mu
  std::set<int64_t> finish_plan_epochs; // guarded by mu
  std::set<std::string> unanswered;     // guarded by mu: FinishUpdate to these never returns unless cancelled
  std::set<std::string> cancelled;      // guarded by mu: CancelCalls was called for these
  std::map<std::string, std::vector<int64_t>> labels;  // engine → every version label set on it, in order
};

v1::RegisterNodeRequest Source(const std::string& id, int ranks = 1, int stage = 0) {
  return testing::SourceRegistration(id, ranks, stage);
}

v1::RegisterNodeRequest Target(const std::string& id, const std::string& engine, int ranks) {
  return testing::TargetRegistration(id, engine, ranks);
}

struct Fixture {
  FakePeers* peers;
  std::unique_ptr<Coordinator> c;
  // Heartbeats from `ids` (node "X" at "X:1") every 50 ms for `how_long`: the other nodes' leases run out.
  void RenewLeases(std::initializer_list<const char*> ids, absl::Duration how_long) {
    const absl::Time until = absl::Now() + how_long;
    while (absl::Now() < until) {
      for (const char* id : ids) {
        v1::HeartbeatRequest hb;
        hb.set_node_id(id);
        hb.set_address(std::string(id) + ":1");
        REQUIRE(c->Heartbeat(hb).known());
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  Fixture(int sources, int engines, int ranks, CoordinatorOptions opts = CoordinatorOptions()) {
    auto p = std::make_unique<FakePeers>();
    peers = p.get();
    c = std::make_unique<Coordinator>(opts, std::move(p));
    for (int s = 0; s < sources; ++s) REQUIRE(c->RegisterNode(Source("s" + std::to_string(s))).ok());
    for (int e = 0; e < engines; ++e)
      REQUIRE(c->RegisterNode(Target("t" + std::to_string(e), "e" + std::to_string(e), ranks)).ok());
  }
  absl::Status Begin(int64_t v) {
    v1::BeginUpdateRequest r;
    r.set_version(v);
    return c->BeginUpdate(r).status();
  }
  absl::StatusOr<v1::CommitUpdateReply> Commit(int64_t v) {
    v1::CommitUpdateRequest r;
    r.set_version(v);
    return c->CommitUpdate(r);
  }
};

CoordinatorOptions Seed() {
  CoordinatorOptions o;
  o.strategy = "seed";
  return o;
}

TEST_CASE("coordinator: seed plan keeps identical engine ranks on the source that already serves them") {
  Fixture f(2, 3, 2, Seed());  // 2 sources, 3 engines x 2 ranks
  REQUIRE(f.Begin(1).ok());
  std::map<std::string, std::set<int>> ranks_by_source;
  int targets = 0;
  for (const auto& [addr, req] : f.peers->configured) {
    for (const auto& t : req.targets()) {
      ranks_by_source[addr].insert(t.rank());
      ++targets;
    }
  }
  CHECK(targets == 6);                      // every (engine, rank) exactly once
  CHECK(ranks_by_source.size() == 2);
  for (const auto& [addr, ranks] : ranks_by_source) CHECK(ranks.size() == 1);  // one replica layout per source
}

TEST_CASE("coordinator: with an anchor every 3 updates, every third update since the last dense one is dense") {
  CoordinatorOptions o;
  o.delta_anchor_every = 3;
  Fixture f(1, 1, 1, o);
  std::vector<std::string> modes;
  for (int64_t v = 1; v <= 7; ++v) {
    v1::BeginUpdateRequest r;
    r.set_version(v);
    if (v == 4) r.set_delta("off");  // a dense update asked for restarts the count
    REQUIRE(f.c->BeginUpdate(r).ok());
    auto rec = f.Commit(v);
    REQUIRE(rec.ok());
    modes.push_back(rec->record().delta_mode());
  }
  CHECK(modes == std::vector<std::string>{"auto", "auto", "anchor", "off", "auto", "auto", "anchor"});
  CHECK(f.peers->start_deltas == std::vector<std::string>{"auto", "auto", "off", "off", "auto", "auto", "off"});
}

TEST_CASE("coordinator: lifecycle order, history and version checks") {
  Fixture f(1, 2, 1);
  CHECK(f.Commit(1).status().code() == absl::StatusCode::kFailedPrecondition);  // nothing open
  REQUIRE(f.Begin(1).ok());
  CHECK(f.Begin(2).code() == absl::StatusCode::kFailedPrecondition);            // one update at a time
  CHECK(f.peers->Count("pause ") == 2);
  CHECK(f.peers->Count("start ") == 1);
  auto rec = f.Commit(1);
  REQUIRE(rec.ok());
  CHECK(rec->record().success());
  CHECK(rec->record().bytes() == 100);
  CHECK(f.peers->Count("post_process ") == 2);
  CHECK(f.peers->Count("set_version ") == 2);
  CHECK(f.peers->Count("continue ") == 2);
  std::vector<std::string> phases;
  for (const auto& p : rec->record().phases()) phases.push_back(p.phase());
  CHECK(phases == std::vector<std::string>{"pause", "configure", "push", "apply_delta", "post_process", "set_version",
                                           "continue"});
  CHECK(f.Begin(1).code() == absl::StatusCode::kFailedPrecondition);  // not newer than the current version
  REQUIRE(f.Begin(2).ok());
  REQUIRE(f.Commit(2).ok());
  CHECK(f.peers->configured.size() == 1);  // membership unchanged: configured once
  CHECK(f.c->Status().current_version() == "2");
  CHECK(f.c->History(v1::HistoryRequest()).records_size() == 2);
}

TEST_CASE("coordinator: a failed source leaves the engines paused at their old version") {
  Fixture f(1, 2, 1);
  REQUIRE(f.Begin(1).ok());
  REQUIRE(f.Commit(1).ok());
  f.peers->fail_finish = true;
  REQUIRE(f.Begin(2).ok());
  auto rec = f.Commit(2);
  CHECK(rec.status().code() == absl::StatusCode::kAborted);
  CHECK(std::string(rec.status().message()).find("engine e1 rank 0") != std::string::npos);
  CHECK(f.peers->Count("set_version ") == 2);  // only from update 1
  CHECK(f.peers->Count("continue ") == 2);
  auto st = f.c->Status();
  CHECK(st.current_version() == "1");
  CHECK(st.state() == "failed");
  auto h = f.c->History(v1::HistoryRequest());
  REQUIRE(h.records_size() == 2);
  CHECK_FALSE(h.records(1).success());
  f.peers->fail_finish = false;
  REQUIRE(f.Begin(3).ok());  // a failed update does not block the next one
  REQUIRE(f.Commit(3).ok());
  CHECK(f.c->Status().current_version() == "3");
}

TEST_CASE("coordinator: a failed configure fails the update and the coordinator keeps answering") {
  Fixture f(1, 2, 1);
  f.peers->fail_configure = true;
  auto begun = std::async(std::launch::async, [&] { return f.Begin(1); });
  // Fail() once locked the mutex the configure phase still held: the coordinator hung here for good.
  REQUIRE(begun.wait_for(std::chrono::seconds(5)) == std::future_status::ready);
  absl::Status st = begun.get();
  CHECK(st.code() == absl::StatusCode::kAborted);
  CHECK(std::string(st.message()).find("configure source") != std::string::npos);
  auto status = std::async(std::launch::async, [&] { return f.c->Status(); });
  REQUIRE(status.wait_for(std::chrono::seconds(1)) == std::future_status::ready);
  CHECK(status.get().state() == "failed");
  f.peers->fail_configure = false;
  REQUIRE(f.Begin(2).ok());  // configured again, since the failed attempt left it unknown
  REQUIRE(f.Commit(2).ok());
  CHECK(f.c->Status().current_version() == "2");
}

TEST_CASE("coordinator: registration is validated and membership changes trigger a new plan") {
  Fixture f(1, 1, 1);
  v1::RegisterNodeRequest bad = Source("");
  CHECK(f.c->RegisterNode(bad).status().code() == absl::StatusCode::kInvalidArgument);
  bad = Source("x");
  bad.set_role("router");
  CHECK(f.c->RegisterNode(bad).status().code() == absl::StatusCode::kInvalidArgument);
  // The same engine served by two nodes is refused.
  CHECK(f.c->RegisterNode(Target("t9", "e0", 1)).status().code() == absl::StatusCode::kAlreadyExists);
  REQUIRE(f.Begin(1).ok());
  REQUIRE(f.Commit(1).ok());
  REQUIRE(f.c->RegisterNode(Target("t1", "e1", 1)).ok());
  REQUIRE(f.Begin(2).ok());
  REQUIRE(f.Commit(2).ok());
  int targets = 0;
  for (const auto& [a, req] : f.peers->configured) targets += req.targets_size();
  CHECK(targets == 2);  // reconfigured with the new engine
}

bool Contains(const absl::Status& st, const std::string& what) {
  return std::string(st.message()).find(what) != std::string::npos;
}

TEST_CASE("lifecycle: a commit for any version but the open one is refused, naming both") {
  Fixture f(1, 2, 1);
  REQUIRE(f.Begin(1).ok());
  for (int64_t asked : {0, 2, 7}) {
    auto r = f.Commit(asked);
    INFO(r.status().ToString());
    CHECK(r.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(Contains(r.status(), absl::StrCat("cannot commit update ", asked)));
    CHECK(Contains(r.status(), "update 1 is updating"));
  }
  CHECK(f.peers->Count("finish ") == 0);
  CHECK(f.c->Status().state() == "updating");
  REQUIRE(f.Commit(1).ok());
  CHECK(f.c->Status().state() == "idle");
  auto late = f.Commit(2);  // never begun, nothing open
  CHECK(late.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(Contains(late.status(), "no update is open"));
}

TEST_CASE("lifecycle: a CommitUpdate repeated after success returns the recorded result, not a second commit") {
  Fixture f(1, 2, 1);
  REQUIRE(f.Begin(1).ok());
  auto first = f.Commit(1);
  REQUIRE(first.ok());
  for (int i = 0; i < 3; ++i) {
    auto again = f.Commit(1);
    REQUIRE(again.ok());
    CHECK(again->record().SerializeAsString() == first->record().SerializeAsString());
  }
  CHECK(f.peers->Count("finish ") == 1);
  CHECK(f.peers->Count("post_process ") == 2);
  CHECK(f.peers->Count("set_version ") == 2);
  CHECK(f.peers->Count("continue ") == 2);
  CHECK(f.c->History(v1::HistoryRequest()).records_size() == 1);
  // Also after the next update has committed.
  REQUIRE(f.Begin(2).ok());
  REQUIRE(f.Commit(2).ok());
  auto late = f.Commit(1);
  REQUIRE(late.ok());
  CHECK(late->record().version() == 1);
  CHECK(f.c->Status().current_version() == "2");
  CHECK(f.c->History(v1::HistoryRequest()).records_size() == 2);
}

TEST_CASE("lifecycle: the reported bug: 2 fails, 3 commits, a late CommitUpdate(2) neither succeeds nor moves back") {
  Fixture f(1, 2, 1);
  REQUIRE(f.Begin(1).ok());
  REQUIRE(f.Commit(1).ok());
  {
    std::lock_guard<std::mutex> l(f.peers->mu);
    f.peers->fail_versions.insert(2);
  }
  REQUIRE(f.Begin(2).ok());
  auto r2 = f.Commit(2);
  CHECK(r2.status().code() == absl::StatusCode::kAborted);
  CHECK(Contains(r2.status(), "update 2 failed"));
  REQUIRE(f.Begin(3).ok());
  REQUIRE(f.Commit(3).ok());
  auto late = f.Commit(2);
  INFO(late.status().ToString());
  CHECK(late.status().code() == absl::StatusCode::kAborted);
  CHECK(Contains(late.status(), "update 2 failed"));
  CHECK(late.status() == r2.status());  // the first result, recorded
  auto again = f.Begin(2);              // a failed version is not reused either
  CHECK(again.code() == absl::StatusCode::kAborted);
  auto st = f.c->Status();
  CHECK(st.current_version() == "3");
  CHECK(st.state() == "idle");
  auto h = f.c->History(v1::HistoryRequest());
  REQUIRE(h.records_size() == 3);
  CHECK(h.records(0).version() == 1);
  CHECK(h.records(1).version() == 2);
  CHECK_FALSE(h.records(1).success());
  CHECK(h.records(2).version() == 3);
  CHECK(h.records(2).success());
  for (const auto& [engine, labels] : f.peers->labels) CHECK(labels == std::vector<int64_t>{1, 3});
}

TEST_CASE("lifecycle: a second CommitUpdate(v) while v commits waits for the first and returns its result") {
  Fixture f(2, 2, 1);
  REQUIRE(f.Begin(1).ok());
  {
    std::lock_guard<std::mutex> l(f.peers->mu);
    f.peers->hold_finish = true;
  }
  absl::StatusOr<v1::CommitUpdateReply> a, b;
  std::thread ta([&] { a = f.Commit(1); });
  f.peers->AwaitFinishing(2);  // both sources of the first commit are in FinishUpdate
  CHECK(f.c->Status().state() == "committing");
  std::atomic<bool> b_done{false};
  std::thread tb([&] {
    b = f.Commit(1);
    b_done = true;
  });
  // Other calls meanwhile: no registration, no begin, no other commit.
  CHECK(f.c->RegisterNode(Source("late")).status().code() == absl::StatusCode::kUnavailable);
  CHECK(f.Begin(2).code() == absl::StatusCode::kFailedPrecondition);
  CHECK(f.Commit(2).status().code() == absl::StatusCode::kFailedPrecondition);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  CHECK_FALSE(b_done.load());                 // waiting for the first, not refused, not committing again
  CHECK(f.peers->Count("finish ") == 2);      // one FinishUpdate per source: one commit
  f.peers->Release();
  ta.join();
  tb.join();
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(a->record().SerializeAsString() == b->record().SerializeAsString());
  CHECK(f.peers->Count("finish ") == 2);
  CHECK(f.peers->Count("set_version ") == 2);
  CHECK(f.peers->Count("continue ") == 2);
}

TEST_CASE("liveness: a target lost during the commit fails it at once, naming the node and its engine ranks") {
  CoordinatorOptions o = Seed();
  o.heartbeat_seconds = 0.1;  // lease lost after 0.3 s without a heartbeat
  Fixture f(2, 2, 2, o);
  REQUIRE(f.Begin(1).ok());
  {
    std::lock_guard<std::mutex> l(f.peers->mu);
    f.peers->hold_finish = true;  // the sources' drains are blocked on the lost target's link
  }
  absl::StatusOr<v1::CommitUpdateReply> commit = absl::UnknownError("not run");
  std::thread tc([&] { commit = f.Commit(1); });
  f.peers->AwaitFinishing(2);
  REQUIRE(f.c->Status().state() == "committing");
  CHECK_FALSE(f.c->CheckLeases());  // every lease is fresh
  f.RenewLeases({"s0", "s1", "t0"}, absl::Milliseconds(450));  // every node but t1
  const int aborts_before = f.peers->Count("abort ");
  CHECK(f.c->CheckLeases());  // t1 lost its lease while the update commits: the sources are told
  CHECK(f.peers->Count("abort s0:1 1") == 1);
  CHECK(f.peers->Count("abort s1:1 1") == 1);
  CHECK(f.peers->Count("abort ") == aborts_before + 2);
  CHECK_FALSE(f.c->CheckLeases());  // told once per lost node
  {
    // What a source does when told: its drain's writes are cancelled, its FinishUpdate fails.
    std::lock_guard<std::mutex> l(f.peers->mu);
    f.peers->fail_versions.insert(1);
  }
  f.peers->Release();
  tc.join();
  INFO(commit.status().ToString());
  REQUIRE_FALSE(commit.ok());
  const std::string err(commit.status().message());
  CHECK(err.find("target node t1") != std::string::npos);
  CHECK(err.find("lost its lease") != std::string::npos);
  CHECK(err.find("engine e1 rank 0") != std::string::npos);
  CHECK(err.find("engine e1 rank 1") != std::string::npos);
  {
    std::lock_guard<std::mutex> l(f.peers->mu);
    // The lost target's window is not closed in line (a call to it would hold the failure for its deadline).
    CHECK(std::count(f.peers->windows.begin(), f.peers->windows.end(), "close t0:1") == 1);
    CHECK(std::count(f.peers->windows.begin(), f.peers->windows.end(), "close t1:1") == 0);
  }
  CHECK(f.peers->Count("continue ") == 0);  // no engine resumed
  CHECK(f.c->Status().current_version() != "1");
}

TEST_CASE("liveness: a source lost during the commit: its FinishUpdate is cancelled, the commit fails at once") {
  CoordinatorOptions o = Seed();
  o.heartbeat_seconds = 0.1;  // lease lost after 0.3 s without a heartbeat
  Fixture f(2, 2, 2, o);
  REQUIRE(f.Begin(1).ok());
  {
    std::lock_guard<std::mutex> l(f.peers->mu);
    f.peers->hold_finish = true;
    f.peers->unanswered.insert("s1:1");  // a vanished source: its FinishUpdate would hang until its deadline
  }
  auto commit = std::async(std::launch::async, [&] { return f.Commit(1); });
  f.peers->AwaitFinishing(2);
  f.RenewLeases({"s0", "t0", "t1"}, absl::Milliseconds(450));  // every node but s1
  CHECK(f.c->CheckLeases());
  CHECK(f.peers->Count("abort s0:1 1") == 1);
  CHECK(f.peers->Count("cancel_calls s1:1") == 1);
  f.peers->Release();  // s0 finishes; s1 answers only because its call was cancelled
  const bool ended = commit.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  CHECK(ended);
  if (!ended) f.peers->CancelCalls("s1:1");  // let the test end
  auto rec = commit.get();
  REQUIRE_FALSE(rec.ok());
  const std::string err(rec.status().message());
  INFO(err);
  CHECK(err.find("source node s1") != std::string::npos);
  CHECK(err.find("lost its lease") != std::string::npos);
  CHECK(f.peers->Count("continue ") == 0);
}

TEST_CASE("lifecycle: a retried BeginUpdate(v) returns the open update's reply; versions are single-use") {
  Fixture f(1, 1, 1);
  v1::BeginUpdateRequest r;
  r.set_version(5);
  auto first = f.c->BeginUpdate(r);
  REQUIRE(first.ok());
  auto again = f.c->BeginUpdate(r);
  REQUIRE(again.ok());
  CHECK(again->SerializeAsString() == first->SerializeAsString());
  CHECK(f.peers->Count("pause ") == 1);
  CHECK(f.peers->Count("start ") == 1);
  REQUIRE(f.Commit(5).ok());
  CHECK(f.Begin(5).code() == absl::StatusCode::kFailedPrecondition);  // committed
  CHECK(f.Begin(4).code() == absl::StatusCode::kFailedPrecondition);  // older
  CHECK(f.Begin(-1).code() == absl::StatusCode::kInvalidArgument);
  REQUIRE(f.Begin(6).ok());
  {
    std::lock_guard<std::mutex> l(f.peers->mu);
    CHECK(f.peers->finish_plan_epochs.size() == 1);  // FinishUpdate carried the plan epoch StartUpdate had
    CHECK(*f.peers->finish_plan_epochs.begin() == f.c->Status().plan_epoch());
  }
}

TEST_CASE("lifecycle: several drivers hammer BeginUpdate/CommitUpdate/retries: one commit per version, no regress") {
  constexpr int kEngines = 3, kThreads = 8, kVersions = 40;
  Fixture f(2, kEngines, 1);
  {
    std::lock_guard<std::mutex> l(f.peers->mu);
    for (int v = 4; v <= kVersions; v += 5) f.peers->fail_versions.insert(v);
  }
  std::atomic<bool> stop{false}, regressed{false};
  std::thread watcher([&] {
    int64_t seen = -1;
    while (!stop) {
      auto cv = f.c->Status().current_version();
      const int64_t now = cv.empty() ? -1 : std::stoll(cv);
      if (now < seen) regressed = true;
      seen = now;
      std::this_thread::yield();
    }
  });
  std::mutex res_mu;
  std::map<int64_t, std::set<std::string>> ok_records;  // version → distinct successful commit records returned
  bool wrong_version = false;                           // a commit answered with another version's record
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t) {
    ts.emplace_back([&, t] {
      for (int64_t v = 1; v <= kVersions; ++v) {
        (void)f.Begin(v);
        for (int64_t asked : {v, v, v - 1 - (t % 3)}) {  // a commit, a retry, a stale one
          auto r = f.Commit(asked);
          if (!r.ok()) continue;
          std::lock_guard<std::mutex> l(res_mu);  // Catch2 assertions are not thread-safe: checked after the join
          if (r->record().version() != asked) wrong_version = true;
          ok_records[asked].insert(r->record().SerializeAsString());
        }
      }
    });
  }
  for (auto& th : ts) th.join();
  stop = true;
  watcher.join();
  CHECK_FALSE(wrong_version);
  CHECK_FALSE(regressed.load());

  auto h = f.c->History(v1::HistoryRequest());
  std::map<int64_t, bool> success;
  int64_t prev = -1;
  for (const auto& rec : h.records()) {
    CHECK(rec.version() > prev);  // one record per version, in increasing order
    prev = rec.version();
    success[rec.version()] = rec.success();
  }
  std::map<int64_t, int> labelled;  // version → engines that were given it as their label
  for (const auto& [engine, labels] : f.peers->labels) {
    for (size_t i = 0; i < labels.size(); ++i) {
      ++labelled[labels[i]];
      if (i > 0) CHECK(labels[i] > labels[i - 1]);  // an engine's label only moves forward
    }
  }
  int64_t newest_ok = -1;
  for (int64_t v = 0; v <= kVersions; ++v) {
    INFO("version " << v);
    const bool ok = success.count(v) && success[v];
    CHECK(labelled[v] == (ok ? kEngines : 0));      // exactly one commit reached the engines
    CHECK(ok_records[v].size() == (ok ? 1u : 0u));  // every OK answer for v is the one recorded result
    if (ok) newest_ok = v;
  }
  CHECK(newest_ok > 0);
  CHECK(f.c->Status().current_version() == std::to_string(newest_ok));
}

TEST_CASE("lifecycle: the client's deadlines exceed the coordinator's worst case") {
  for (double timeout : {0.0, 1.0, 30.0, 120.0, 600.0}) {
    INFO("timeout " << timeout);
    CHECK(absl::ToDoubleSeconds(client::CommitUpdateDeadline(timeout, absl::ZeroDuration())) >
          CommitWorstCaseSeconds(timeout));
  }
  CHECK(absl::ToDoubleSeconds(client::BeginUpdateDeadline(absl::ZeroDuration())) > BeginWorstCaseSeconds());
  CHECK(client::kDefaultCommitTimeoutSeconds == kDefaultCommitTimeoutSeconds);
}

}  // namespace
}  // namespace wsync::daemon

namespace wsync::daemon {
namespace {

absl::StatusOr<v1::AbortUpdateReply> Abort(Fixture& f, int64_t v) {
  v1::AbortUpdateRequest r;
  r.set_version(v);
  r.set_reason("trainer crashed");
  return f.c->AbortUpdate(r);
}

TEST_CASE("abort: closes the open update, records it; resumes the engines only when nothing was written") {
  Fixture f(2, 2, 1);
  REQUIRE(f.Begin(1).ok());
  REQUIRE(f.Commit(1).ok());
  const int continues = f.peers->Count("continue ");
  CHECK(Abort(f, 2).status().code() == absl::StatusCode::kFailedPrecondition);  // nothing open
  CHECK(Abort(f, 1).status().code() == absl::StatusCode::kFailedPrecondition);  // committed already

  // Update 2 aborted before any byte was written: the abort resumes the engines at version 1 itself (the phase
  // table's push row), and says they are resumable.
  REQUIRE(f.Begin(2).ok());
  auto a = Abort(f, 2);
  REQUIRE(a.ok());
  CHECK(a->record().aborted());
  CHECK_FALSE(a->record().success());
  CHECK(a->record().error().find("trainer crashed") != std::string::npos);
  CHECK(a->bytes_written() == 0);
  CHECK(a->engines_resumable());
  CHECK(f.peers->Count("abort ") == 2);                          // every source told
  CHECK(f.peers->Count("continue ") == continues + 2);           // both engines resumed by the abort
  CHECK(a->record().error().find("engines were resumed at version 1") != std::string::npos);
  CHECK(f.c->Status().current_version() == "1");
  CHECK(f.c->Status().state() == "failed");
  CHECK(f.Commit(2).status().code() == absl::StatusCode::kAborted);  // a late commit of it is refused
  auto again = Abort(f, 2);                                       // a repeat answers the record, calls nothing
  REQUIRE(again.ok());
  CHECK(f.peers->Count("abort ") == 2);
  auto r = f.c->ResumeEngines(v1::ResumeEnginesRequest());
  REQUIRE(r.ok());
  CHECK(r->version() == "1");
  CHECK(f.peers->Count("continue ") == continues + 4);  // a repeat is harmless

  // Update 3 aborted after bytes reached the engines: resume refused until an update succeeds.
  REQUIRE(f.Begin(3).ok());
  f.peers->abort_bytes = 4096;
  a = Abort(f, 3);
  REQUIRE(a.ok());
  CHECK(a->bytes_written() == 2 * 4096);
  CHECK_FALSE(a->engines_resumable());
  CHECK(f.c->Status().engines_hold_partial_writes());
  auto refused = f.c->ResumeEngines(v1::ResumeEnginesRequest());
  CHECK(refused.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(std::string(refused.status().message()).find("mixed weights") != std::string::npos);
  // Update 4 aborted with nothing written: the engines still hold update 3's partial bytes.
  f.peers->abort_bytes = 0;
  REQUIRE(f.Begin(4).ok());
  a = Abort(f, 4);
  REQUIRE(a.ok());
  CHECK_FALSE(a->engines_resumable());
  // A successful update clears it.
  REQUIRE(f.Begin(5).ok());
  REQUIRE(f.Commit(5).ok());
  CHECK_FALSE(f.c->Status().engines_hold_partial_writes());
  CHECK(f.c->ResumeEngines(v1::ResumeEnginesRequest()).ok());
  auto h = f.c->History(v1::HistoryRequest());
  std::vector<bool> aborted;
  for (const auto& rec : h.records()) aborted.push_back(rec.aborted());
  CHECK(aborted == std::vector<bool>{false, true, true, true, false});
}

TEST_CASE("abort: a source that cannot be reached counts as written; a commit running is aborted at once") {
  Fixture f(1, 1, 1);
  REQUIRE(f.Begin(1).ok());
  f.peers->fail_abort = true;
  auto a = Abort(f, 1);
  REQUIRE(a.ok());
  CHECK_FALSE(a->engines_resumable());
  CHECK(a->record().error().find("is gone") != std::string::npos);
  f.peers->fail_abort = false;
  REQUIRE(f.Begin(2).ok());
  {
    std::lock_guard<std::mutex> l(f.peers->mu);
    f.peers->hold_finish = true;
  }
  absl::Status committed = absl::UnknownError("not run");
  std::thread commit([&] { committed = f.Commit(2).status(); });  // checked after the join (Catch2 is not thread-safe)
  f.peers->AwaitFinishing(1);
  // Committing: the FinishUpdate in flight is cancelled and the update ends as aborted, engines paused.
  auto aborted = Abort(f, 2);
  commit.join();
  INFO(aborted.status().ToString());
  REQUIRE(aborted.ok());
  CHECK(aborted->record().aborted());
  CHECK(f.peers->Count("cancel_calls s0:1") >= 1);
  CHECK(committed.code() == absl::StatusCode::kAborted);
  CHECK(f.peers->Count("continue ") == 0);
  CHECK(f.c->ResumeEngines(v1::ResumeEnginesRequest()).status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(f.c->Status().current_version().empty());
}

}  // namespace
}  // namespace wsync::daemon

namespace wsync::daemon {
namespace {

TEST_CASE("remove: a node is deregistered only between updates; the next update re-plans without it") {
  CoordinatorOptions floor;
  floor.min_source_bytes = 64ull << 20;  // the tiny model on one source (see below)
  Fixture f(2, 1, 2, floor);
  v1::RemoveNodeRequest r;
  r.set_node_id("nope");
  CHECK(f.c->RemoveNode(r).status().code() == absl::StatusCode::kNotFound);
  REQUIRE(f.Begin(1).ok());
  r.set_node_id("s1");
  CHECK(f.c->RemoveNode(r).status().code() == absl::StatusCode::kFailedPrecondition);  // update open
  REQUIRE(f.Commit(1).ok());
  const int64_t epoch = f.c->Status().membership_epoch();
  auto out = f.c->RemoveNode(r);
  REQUIRE(out.ok());
  CHECK(out->membership_epoch() == epoch + 1);
  CHECK(f.c->Status().nodes_size() == 2);  // s0 and t0
  f.peers->configured.clear();
  REQUIRE(f.Begin(2).ok());
  // Re-planned onto the remaining source only. With a 64 MiB minimum per source, s0 wrote this tiny model
  // alone already: its configuration did not change, so it is not configured again.
  CHECK(f.peers->configured.empty());
  {
    const v1::ClusterStatus st = f.c->Status();
    CHECK(st.plan_size() == 2);
    for (const auto& t : st.plan()) CHECK(t.source_node() == "s0");
  }
  REQUIRE(f.Commit(2).ok());
  r.set_node_id("t0");
  out = f.c->RemoveNode(r);
  REQUIRE(out.ok());
  CHECK(out->engines_size() == 1);
  CHECK(f.Begin(3).code() == absl::StatusCode::kFailedPrecondition);  // no engine left
}

}  // namespace
}  // namespace wsync::daemon

namespace wsync::daemon {
namespace {

// (source node, engine, rank, param, offset, length): one byte range one source writes.
using Write = std::tuple<std::string, std::string, int, std::string, uint64_t, uint64_t>;

std::set<Write> ConfiguredWrites(FakePeers* peers) {
  std::set<Write> out;
  for (const auto& [addr, req] : peers->configured)
    for (const auto& t : req.targets())
      for (const auto& w : t.writes())
        out.insert({addr.substr(0, addr.find(':')), t.engine_id(), t.rank(), w.param(), w.offset(), w.length()});
  return out;
}

// Every byte of every engine rank's layout is written exactly once (over all sources).
void CheckCoverage(const std::set<Write>& writes, int engines, int tp) {
  std::map<std::tuple<std::string, int, std::string>, std::vector<std::pair<uint64_t, uint64_t>>> by_param;
  for (const auto& [src, e, r, p, off, len] : writes) by_param[{e, r, p}].push_back({off, len});
  for (int e = 0; e < engines; ++e)
    for (int r = 0; r < tp; ++r) {
      v1::RankLayout l;
      FillLayout(&l, tp, r);
      for (const auto& p : l.params()) {
        auto it = by_param.find({"e" + std::to_string(e), r, p.name()});
        INFO("engine e" << e << " rank " << r << " param " << p.name());
        REQUIRE(it != by_param.end());
        auto ranges = it->second;
        std::sort(ranges.begin(), ranges.end());
        uint64_t at = 0;
        for (const auto& [off, len] : ranges) {
          CHECK(off == at);  // no gap, no overlap
          at = off + len;
        }
        CHECK(at == p.bytes());
      }
    }
}

CoordinatorOptions BalancedEverySource() {
  CoordinatorOptions o;
  o.strategy = "balanced";
  o.min_source_bytes = 0;
  o.snap_bytes = 0;
  return o;
}

TEST_CASE("coordinator: the balanced plan splits parameters, covers every byte once, and is wsyncctl plan's plan") {
  auto peers = std::make_unique<FakePeers>();
  FakePeers* fp = peers.get();
  Coordinator c(BalancedEverySource(), std::move(peers));
  for (int s = 0; s < 2; ++s) REQUIRE(c.RegisterNode(Source("s" + std::to_string(s), 3)).ok());
  for (int e = 0; e < 2; ++e) REQUIRE(c.RegisterNode(Target("t" + std::to_string(e), "e" + std::to_string(e), 2)).ok());
  v1::BeginUpdateRequest b;
  b.set_version(1);
  auto begun = c.BeginUpdate(b);
  INFO(begun.status().ToString());
  REQUIRE(begun.ok());
  const std::set<Write> writes = ConfiguredWrites(fp);
  CheckCoverage(writes, 2, 2);
  bool split = false;
  for (const auto& w : writes) split |= std::get<4>(w) != 0;
  CHECK(split);  // some parameter is written in ranges by two sources

  // Push filters: every local rank listed, no tensor twice on a node, and a node pushes every input of what it
  // writes (qkv_proj needs q, k and v; gate_up_proj gate and up).
  for (const auto& [addr, req] : fp->configured) {
    REQUIRE(req.push_filters_size() == 3);
    std::set<std::string> names;
    for (const auto& f : req.push_filters())
      for (const auto& n : f.tensor_names()) CHECK(names.insert(n).second);
    for (const auto& t : req.targets())
      for (const auto& w : t.writes()) {
        if (w.param().find("qkv_proj") == std::string::npos) continue;
        const std::string layer = w.param().substr(0, w.param().find("self_attn"));
        for (const char* x : {"q_proj", "k_proj", "v_proj"}) CHECK(names.count(layer + "self_attn." + x + ".weight"));
      }
  }

  // wsyncctl plan, given the same cluster shape and options, plans the same byte ranges on the same nodes.
  const std::string cmd = std::string(WSYNC_BIN_DIR) + "/wsyncctl plan --model " + WSYNC_MODELS_DIR +
                          "/tiny-qwen3/config.json --train tp=1,nodes=2,gpus=3 --infer instances=2,tp=2 --nic 1x100 "
                          "--min-source-mib 0 --snap-kib 0 -w json --tasks";
  FILE* pipe = popen(cmd.c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, pipe)) out.append(buf, n);
  REQUIRE(pclose(pipe) == 0);
  auto j = nlohmann::json::parse(out);
  std::set<Write> cli;
  for (const auto& s : j["sources"]) {
    const std::string node = "s" + std::to_string(s["trainer_rank"].get<int>() / 3);
    for (const auto& task : s["tasks"])
      for (const auto& p : task["params"])
        cli.insert({node, "e" + std::to_string(task["instance"].get<int>()), task["rank"].get<int>(),
                    p["param"].get<std::string>(), p["offset"].get<uint64_t>(), p["length"].get<uint64_t>()});
  }
  CHECK(cli == writes);
}

std::set<Write> CliWrites(const std::string& args, int ranks_per_node) {
  const std::string cmd = std::string(WSYNC_BIN_DIR) + "/wsyncctl plan --model " + WSYNC_MODELS_DIR +
                          "/tiny-qwen3/config.json " + args + " -w json --tasks";
  FILE* pipe = popen(cmd.c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, pipe)) out.append(buf, n);
  REQUIRE(pclose(pipe) == 0);
  auto j = nlohmann::json::parse(out);
  std::set<Write> cli;
  for (const auto& s : j["sources"]) {
    const std::string node = "s" + std::to_string(s["trainer_rank"].get<int>() / ranks_per_node);
    for (const auto& task : s["tasks"])
      for (const auto& p : task["params"])
        cli.insert({node, "e" + std::to_string(task["instance"].get<int>()), task["rank"].get<int>(),
                    p["param"].get<std::string>(), p["offset"].get<uint64_t>(), p["length"].get<uint64_t>()});
  }
  return cli;
}

TEST_CASE("coordinator: the automatic source count is wsyncctl plan's at the coordinator's --nic") {
  // --min-source-mib auto (the default), 4 source nodes, 4 engines of TP=2 each on its own node, parameters split
  // anywhere: the coordinator plans with its engines' node count, as `wsyncctl plan --infer ...,nodes=4` does. Here
  // that keeps all 4 sources; counted on one engine node, whose NIC would take every session, it would keep 2.
  for (const char* nic : {"1x400Gbps", "1x0.001Gbps"}) {
    CoordinatorOptions o;
    o.nic = nic;
    o.snap_bytes = 0;
    Fixture f(4, 4, 2, o);
    REQUIRE(f.Begin(1).ok());
    const std::set<Write> writes = ConfiguredWrites(f.peers);
    CheckCoverage(writes, 4, 2);
    std::set<std::string> sources;
    for (const Write& w : writes) sources.insert(std::get<0>(w));
    INFO("--nic " << nic);
    CHECK(sources.size() == 4);
    CHECK(writes == CliWrites(std::string("--train tp=1,nodes=4,gpus=1 --infer instances=4,tp=2,nodes=4 --snap-kib 0 "
                                          "--nic ") + nic, 1));
    CHECK(writes != CliWrites(std::string("--train tp=1,nodes=4,gpus=1 --infer instances=4,tp=2,nodes=1 --snap-kib 0 "
                                          "--nic ") + nic, 1));
  }
  // A malformed --nic fails planning naming the flag.
  CoordinatorOptions bad;
  bad.nic = "fast";
  Fixture f(1, 1, 2, bad);
  const absl::Status st = f.Begin(1);
  CHECK(!st.ok());
  CHECK(std::string(st.message()).find("--nic") != std::string::npos);
}

TEST_CASE("coordinator: a PP=2 trainer: each stage's nodes push only their stage's tensors") {
  auto peers = std::make_unique<FakePeers>();
  FakePeers* fp = peers.get();
  Coordinator c(BalancedEverySource(), std::move(peers));
  REQUIRE(c.RegisterNode(Source("s0", 2, 0)).ok());
  REQUIRE(c.RegisterNode(Source("s1", 2, 1)).ok());
  REQUIRE(c.RegisterNode(Target("t0", "e0", 2)).ok());
  v1::BeginUpdateRequest b;
  b.set_version(1);
  auto begun = c.BeginUpdate(b);
  INFO(begun.status().ToString());
  REQUIRE(begun.ok());
  CheckCoverage(ConfiguredWrites(fp), 1, 2);
  auto cfg = replica::ModelConfig::FromJson(TinyConfigJson());
  REQUIRE(cfg.ok());
  for (const auto& [addr, req] : fp->configured) {
    const int stage = addr.rfind("s1", 0) == 0 ? 1 : 0;
    int pushed = 0;
    for (const auto& f : req.push_filters())
      for (const auto& n : f.tensor_names()) {
        INFO(addr << " pushes " << n);
        CHECK(planner::TrainerStageOf(*cfg, n, 2) == stage);
        ++pushed;
      }
    CHECK(pushed > 0);
  }
  // Stages that do not match up are refused with the reason.
  Coordinator bad(BalancedEverySource(), std::make_unique<FakePeers>());
  REQUIRE(bad.RegisterNode(Source("s0", 2, 0)).ok());
  REQUIRE(bad.RegisterNode(Source("s2", 2, 2)).ok());
  REQUIRE(bad.RegisterNode(Target("t0", "e0", 2)).ok());
  auto st = bad.BeginUpdate(b);
  CHECK_FALSE(st.ok());
  CHECK(std::string(st.status().message()).find("trainer stages") != std::string::npos);
}

// (source node, engine, rank, bytes, plan epoch) of the plan's tasks for `engine`.
std::set<std::tuple<std::string, std::string, int, uint64_t, int64_t>> TasksOf(const v1::ClusterStatus& st,
                                                                             const std::string& engine) {
  std::set<std::tuple<std::string, std::string, int, uint64_t, int64_t>> out;
  for (const auto& t : st.plan())
    if (t.engine_id() == engine) out.insert({t.source_node(), t.engine_id(), t.rank(), t.bytes(), t.plan_epoch()});
  return out;
}

const v1::EngineGroupPlan* GroupOf(const v1::ClusterStatus& st, const std::string& engine) {
  for (const auto& g : st.groups())
    for (const auto& e : g.engines())
      if (e == engine) return &g;
  return nullptr;
}

TEST_CASE("replan: an engine that joins re-plans only its own group; sources whose configuration is unchanged are "
          "not configured again") {
  // Group tp=2 (e0) and group tp=1 (e1); e2 (tp=1) joins the second group.
  Fixture f(3, 0, 1, Seed());
  REQUIRE(f.c->RegisterNode(Target("t0", "e0", 2)).ok());
  REQUIRE(f.c->RegisterNode(Target("t1", "e1", 1)).ok());
  REQUIRE(f.Begin(1).ok());
  REQUIRE(f.Commit(1).ok());
  const v1::ClusterStatus before = f.c->Status();
  REQUIRE(before.groups_size() == 2);
  const auto before_configured = f.peers->configured;
  CHECK(before_configured.size() == 3);  // the first plan configures every source
  const auto e0_tasks = TasksOf(before, "e0");
  REQUIRE(!e0_tasks.empty());
  const int64_t e0_epoch = GroupOf(before, "e0")->plan_epoch();
  const int64_t e1_epoch = GroupOf(before, "e1")->plan_epoch();

  REQUIRE(f.c->RegisterNode(Target("t2", "e2", 1)).ok());
  f.peers->configured.clear();
  {
    std::lock_guard<std::mutex> l(f.peers->mu);
    f.peers->finish_plan_epochs.clear();
  }
  REQUIRE(f.Begin(2).ok());
  REQUIRE(f.Commit(2).ok());
  const v1::ClusterStatus after = f.c->Status();
  REQUIRE(after.groups_size() == 2);
  // The tp=2 group: the same tasks, the same epoch.
  CHECK(GroupOf(after, "e0")->plan_epoch() == e0_epoch);
  CHECK(TasksOf(after, "e0") == e0_tasks);
  // The tp=1 group was re-planned for e1 and e2.
  const v1::EngineGroupPlan* g1 = GroupOf(after, "e2");
  REQUIRE(g1 != nullptr);
  CHECK(g1->plan_epoch() > e1_epoch);
  CHECK(g1->engines_size() == 2);
  CHECK(!TasksOf(after, "e2").empty());
  // Only sources whose configuration changed got a ConfigureSource; each one really differs from before.
  CHECK(!f.peers->configured.empty());
  CHECK(f.peers->configured.size() < 3);
  for (const auto& [addr, req] : f.peers->configured) {
    v1::ConfigureSourceRequest a = req, b = before_configured.at(addr);
    a.clear_plan_epoch();
    b.clear_plan_epoch();
    CHECK(a.SerializeAsString() != b.SerializeAsString());
  }
  // The sources left alone keep their epoch, and are started and finished under it.
  std::set<int64_t> kept;
  for (const auto& [id, epoch] : after.source_plan_epochs()) {
    if (f.peers->configured.count(id + ":1")) {
      CHECK(epoch == after.plan_epoch());
    } else {
      CHECK(epoch == before.source_plan_epochs().at(id));
      kept.insert(epoch);
    }
  }
  CHECK(!kept.empty());
  std::lock_guard<std::mutex> l(f.peers->mu);
  for (int64_t e : kept) CHECK(f.peers->finish_plan_epochs.count(e) == 1);
}

TEST_CASE(
    "replan: a target registering again keeps its group's plan when its tables are the same, and re-plans "
    "(here: refuses) when they differ") {
  Fixture f(2, 0, 1, Seed());
  REQUIRE(f.c->RegisterNode(Target("t0", "e0", 2)).ok());
  REQUIRE(f.Begin(1).ok());
  REQUIRE(f.Commit(1).ok());
  const int64_t epoch = GroupOf(f.c->Status(), "e0")->plan_epoch();

  // A restarted daemon with the same registration: the plan (its epoch) is kept.
  REQUIRE(f.c->RegisterNode(Target("t0", "e0", 2)).ok());
  REQUIRE(f.Begin(2).ok());
  REQUIRE(f.Commit(2).ok());
  CHECK(GroupOf(f.c->Status(), "e0")->plan_epoch() == epoch);

  // The same engine now reports a table without one of its parameters: what the group was planned from changed
  // (the registration's digest is dropped with it), so it is planned again, which refuses the table.
  v1::RegisterNodeRequest changed = Target("t0", "e0", 2);
  auto* params = changed.mutable_engines(0)->mutable_ranks(0)->mutable_params();
  REQUIRE(params->size() > 1);
  const std::string dropped = params->Get(params->size() - 1).name();
  params->RemoveLast();
  REQUIRE(f.c->RegisterNode(changed).ok());
  const absl::Status st = f.Begin(3);
  INFO(st.ToString());
  CHECK_FALSE(st.ok());
  CHECK(st.message().find("lacks parameter " + dropped) != std::string::npos);
}

// Holds every ConfigureSource until `expected` are in flight, so that every request of the phase is alive at once,
// and records, per (engine, rank), the address and bytes of each layout it was sent.
class LayoutRecordingPeers : public FakePeers {
 public:
  explicit LayoutRecordingPeers(int expected) : expected_(expected) {}
  absl::StatusOr<v1::ConfigureSourceReply> ConfigureSource(const std::string& addr,
                                                           const v1::ConfigureSourceRequest& req) override {
    {
      std::unique_lock<std::mutex> l(mu);
      for (const auto& t : req.targets())
        if (t.has_layout())
          layouts[{t.engine_id(), t.rank()}].emplace_back(&t.layout(), t.layout().SerializeAsString());
      ++arrived_;
      cv.notify_all();
      all_in_flight = cv.wait_for(l, std::chrono::seconds(10), [&] { return arrived_ >= expected_; });
    }
    return FakePeers::ConfigureSource(addr, req);
  }
  std::map<std::pair<std::string, int>, std::vector<std::pair<const v1::RankLayout*, std::string>>> layouts;
  bool all_in_flight = false;  // guarded by mu

 private:
  const int expected_;
  int arrived_ = 0;  // guarded by mu
};

TEST_CASE("configure: the sources writing one engine rank are sent the plan's one table of it, not a copy each") {
  constexpr int kSources = 3;
  auto p = std::make_unique<LayoutRecordingPeers>(kSources);
  LayoutRecordingPeers* peers = p.get();
  CoordinatorOptions opts;  // balanced, every source used: each writes a share of the engine's one rank
  opts.min_source_bytes = 1;
  Coordinator c(opts, std::move(p));
  for (int s = 0; s < kSources; ++s) REQUIRE(c.RegisterNode(Source("s" + std::to_string(s))).ok());
  const v1::RegisterNodeRequest target = Target("t0", "e0", 1);
  REQUIRE(c.RegisterNode(target).ok());
  v1::BeginUpdateRequest b;
  b.set_version(1);
  REQUIRE(c.BeginUpdate(b).ok());
  std::lock_guard<std::mutex> l(peers->mu);
  CHECK(peers->all_in_flight);  // every request was alive at once: copies could not share an address
  REQUIRE(peers->layouts.size() == 1);
  for (const auto& [who, seen] : peers->layouts) {
    INFO("engine " << who.first << " rank " << who.second);
    CHECK(seen.size() == kSources);
    // The table as the engine registered it (the independent expectation), at one address in every request.
    const std::string registered = target.engines(0).ranks(who.second).SerializeAsString();
    for (const auto& [ptr, bytes] : seen) {
      CHECK(ptr == seen.front().first);
      CHECK(bytes == registered);
    }
  }
}

// Records, per target and opening, where the request's first write-window assignment lives.
class WindowRecordingPeers : public FakePeers {
 public:
  absl::StatusOr<v1::SetWriteWindowReply> SetWriteWindow(const std::string& addr,
                                                         const v1::SetWriteWindowRequest& req) override {
    if (req.open() && req.assignments_size() > 0) {
      std::lock_guard<std::mutex> l(mu);
      first_assignment[addr].push_back(&req.assignments(0));
      digests[addr].push_back(req.assignments_digest());
    }
    return FakePeers::SetWriteWindow(addr, req);
  }
  std::map<std::string, std::vector<const v1::WindowAssignment*>> first_assignment;  // guarded by mu
  std::map<std::string, std::vector<std::string>> digests;                           // guarded by mu
};

TEST_CASE(
    "windows: a membership change that keeps the plan keeps each target's open-window request (no copy of its write "
    "ranges); a new plan builds them again") {
  auto p = std::make_unique<WindowRecordingPeers>();
  WindowRecordingPeers* peers = p.get();
  Coordinator c(CoordinatorOptions(), std::move(p));
  for (int s = 0; s < 2; ++s) REQUIRE(c.RegisterNode(Source("s" + std::to_string(s))).ok());
  REQUIRE(c.RegisterNode(Target("t0", "e0", 2)).ok());
  REQUIRE(c.RegisterNode(Target("t1", "e1", 2)).ok());
  auto update = [&](int64_t v) {
    v1::BeginUpdateRequest b;
    b.set_version(v);
    REQUIRE(c.BeginUpdate(b).ok());
    v1::CommitUpdateRequest cr;
    cr.set_version(v);
    REQUIRE(c.CommitUpdate(cr).ok());
  };
  update(1);
  // t1's daemon restarts with the same registration: the membership changed, the plan is kept.
  REQUIRE(c.RegisterNode(Target("t1", "e1", 2)).ok());
  update(2);
  // A source leaves: the plan is made again.
  v1::RemoveNodeRequest rm;
  rm.set_node_id("s1");
  REQUIRE(c.RemoveNode(rm).ok());
  update(3);
  std::lock_guard<std::mutex> l(peers->mu);
  for (const char* t : {"t0:1", "t1:1"}) {
    INFO(t);
    const auto& at = peers->first_assignment[t];
    REQUIRE(at.size() == 3);
    CHECK(at[1] == at[0]);  // the same request object: kept
    CHECK(at[2] != at[0]);  // built again for the new plan
    CHECK(peers->digests[t][1] == peers->digests[t][0]);
    CHECK(peers->digests[t][2] != peers->digests[t][0]);
  }
}

TEST_CASE(
    "state objects: a save after a membership change splits only the nodes whose registration changed; the objects "
    "are those of splitting every node") {
  v1::CoordinatorState st;
  for (int s = 0; s < 3; ++s) *st.add_nodes() = Source("s" + std::to_string(s));
  *st.add_nodes() = Target("t0", "e0", 2);
  *st.add_nodes() = Target("t1", "e1", 2);  // the same tables as t0's: stored once
  constexpr size_t kPart = 512;             // several parts per table
  StateObjectSet set("test", kPart);
  REQUIRE(set.UseNodes(st, true).ok());
  CHECK(set.nodes_split() == 5);
  CHECK(set.node_objects() == SplitNodes(st.nodes(), kPart));
  // The same registrations again (another node's change was saved): none is split, the objects are the same.
  REQUIRE(set.UseNodes(st, true).ok());
  CHECK(set.nodes_split() == 0);
  CHECK(set.node_objects() == SplitNodes(st.nodes(), kPart));
  // t1 registers again with another table, s2 leaves, s3 joins: those two are split, t0 keeps the shared table.
  st.mutable_nodes(4)->mutable_engines(0)->mutable_ranks(0)->mutable_params()->RemoveLast();
  st.mutable_nodes()->DeleteSubrange(2, 1);
  *st.add_nodes() = Source("s3");
  REQUIRE(set.UseNodes(st, true).ok());
  CHECK(set.nodes_split() == 2);
  CHECK(set.node_objects() == SplitNodes(st.nodes(), kPart));
  // t0 leaves: the table only it had left is gone with it.
  st.mutable_nodes()->DeleteSubrange(2, 1);
  REQUIRE(set.UseNodes(st, true).ok());
  CHECK(set.nodes_split() == 0);
  CHECK(set.node_objects() == SplitNodes(st.nodes(), kPart));
}

TEST_CASE("replan: a restarted source daemon is configured again even when its plan did not change") {
  Fixture f(2, 1, 2, Seed());
  REQUIRE(f.Begin(1).ok());
  REQUIRE(f.Commit(1).ok());
  REQUIRE(f.c->RegisterNode(Source("s1")).ok());  // same registration, new process
  f.peers->configured.clear();
  REQUIRE(f.Begin(2).ok());
  CHECK(f.peers->configured.count("s1:1") == 1);
  CHECK(f.peers->configured.count("s0:1") == 0);
  REQUIRE(f.Commit(2).ok());
}

TEST_CASE("drain: a drained engine is re-planned as a leave, never paused or updated; undrain re-includes it") {
  Fixture f(2, 0, 1, Seed());
  REQUIRE(f.c->RegisterNode(Target("t0", "e0", 2)).ok());
  REQUIRE(f.c->RegisterNode(Target("t1", "e1", 1)).ok());
  REQUIRE(f.c->RegisterNode(Target("t2", "e2", 1)).ok());
  REQUIRE(f.Begin(1).ok());
  REQUIRE(f.Commit(1).ok());
  const auto e0_tasks = TasksOf(f.c->Status(), "e0");

  v1::DrainRequest d;
  CHECK(f.c->Drain(d, true).status().code() == absl::StatusCode::kInvalidArgument);  // neither engine nor node
  d.set_engine_id("nope");
  CHECK(f.c->Drain(d, true).status().code() == absl::StatusCode::kNotFound);
  d.set_engine_id("e2");
  auto r = f.c->Drain(d, true);
  REQUIRE(r.ok());
  CHECK(r->engines_size() == 1);
  CHECK(f.c->Drain(d, true).ok());  // repeated: nothing changes
  f.peers->calls.clear();
  REQUIRE(f.Begin(2).ok());
  // Refused during an update, with the reason.
  auto during = f.c->Drain(d, false);
  CHECK(during.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(std::string(during.status().message()).find("between updates") != std::string::npos);
  REQUIRE(f.Commit(2).ok());
  CHECK(f.peers->Count("pause e2") == 0);
  CHECK(f.peers->Count("set_version e2") == 0);
  CHECK(f.peers->Count("continue e2") == 0);
  CHECK(f.peers->Count("set_version e1:2 2") == 1);
  v1::ClusterStatus st = f.c->Status();
  CHECK(TasksOf(st, "e2").empty());
  CHECK(TasksOf(st, "e0") == e0_tasks);  // the other group is untouched
  for (const auto& n : st.nodes())
    for (const auto& e : n.engine_details())
      if (e.engine_id() == "e2") {
        CHECK(e.drained());
        CHECK(e.state() == "drained");
        CHECK(e.weight_version() == "1");  // it kept serving version 1
      }
  // ResumeEngines never resumes a drained engine.
  f.peers->calls.clear();
  auto res = f.c->ResumeEngines(v1::ResumeEnginesRequest());
  REQUIRE(res.ok());
  CHECK(f.peers->Count("continue e2") == 0);

  REQUIRE(f.c->Drain(d, false).ok());
  f.peers->calls.clear();
  REQUIRE(f.Begin(3).ok());
  REQUIRE(f.Commit(3).ok());
  CHECK(f.peers->Count("pause e2") == 1);
  CHECK(f.peers->Count("set_version e2:2 3") == 1);
  st = f.c->Status();
  CHECK(!TasksOf(st, "e2").empty());
  CHECK(TasksOf(st, "e0") == e0_tasks);
}

TEST_CASE("drain: a target node drains its engines; a source node only if the others can push every tensor") {
  auto peers = std::make_unique<FakePeers>();
  FakePeers* fp = peers.get();
  Coordinator c(BalancedEverySource(), std::move(peers));
  REQUIRE(c.RegisterNode(Source("s0", 1, 0)).ok());
  REQUIRE(c.RegisterNode(Source("s1", 1, 0)).ok());
  REQUIRE(c.RegisterNode(Target("t0", "e0", 2)).ok());
  REQUIRE(c.RegisterNode(Target("t1", "e1", 2)).ok());
  v1::BeginUpdateRequest b;
  v1::CommitUpdateRequest cm;
  b.set_version(1);
  cm.set_version(1);
  REQUIRE(c.BeginUpdate(b).ok());
  REQUIRE(c.CommitUpdate(cm).ok());

  v1::DrainRequest d;
  d.set_node_id("t1");
  auto r = c.Drain(d, true);
  REQUIRE(r.ok());
  CHECK(r->engines_size() == 1);
  d.set_node_id("s1");
  REQUIRE(c.Drain(d, true).ok());
  // The last source node cannot go.
  d.set_node_id("s0");
  auto refused = c.Drain(d, true);
  CHECK(refused.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(std::string(refused.status().message()).find("cannot drain source node s0") != std::string::npos);

  fp->configured.clear();
  fp->calls.clear();
  b.set_version(2);
  cm.set_version(2);
  REQUIRE(c.BeginUpdate(b).ok());
  REQUIRE(c.CommitUpdate(cm).ok());
  CheckCoverage(ConfiguredWrites(fp), 1, 2);  // e0 whole, from s0 alone
  for (const auto& w : ConfiguredWrites(fp)) {
    CHECK(std::get<0>(w) == "s0");
    CHECK(std::get<1>(w) == "e0");
  }
  // The drained source is configured with nothing to write and nothing to push.
  REQUIRE(fp->configured.count("s1:1") == 1);
  CHECK(fp->configured.at("s1:1").targets_size() == 0);
  for (const auto& f : fp->configured.at("s1:1").push_filters()) CHECK(f.tensor_names_size() == 0);
  CHECK(fp->Count("pause e1") == 0);
  const v1::ClusterStatus st = c.Status();
  CHECK(st.drained_nodes_size() == 2);
  d.set_node_id("t1");
  REQUIRE(c.Drain(d, false).ok());
  d.set_node_id("s1");
  REQUIRE(c.Drain(d, false).ok());
  CHECK(c.Status().drained_nodes_size() == 0);

  // A PP=2 trainer: a stage's only node cannot go; a drain that leaves the stages unequal cannot either.
  Coordinator pp(BalancedEverySource(), std::make_unique<FakePeers>());
  REQUIRE(pp.RegisterNode(Source("s0", 1, 0)).ok());
  REQUIRE(pp.RegisterNode(Source("s1", 1, 1)).ok());
  REQUIRE(pp.RegisterNode(Source("s2", 1, 1)).ok());
  REQUIRE(pp.RegisterNode(Source("s3", 1, 0)).ok());
  REQUIRE(pp.RegisterNode(Target("t0", "e0", 2)).ok());
  d.set_node_id("s1");
  refused = pp.Drain(d, true);
  CHECK(refused.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(std::string(refused.status().message()).find("same number of source nodes (not drained)") != std::string::npos);
  v1::RemoveNodeRequest rm;
  rm.set_node_id("s2");
  REQUIRE(pp.RemoveNode(rm).ok());
  rm.set_node_id("s3");
  REQUIRE(pp.RemoveNode(rm).ok());
  refused = pp.Drain(d, true);
  CHECK(refused.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(std::string(refused.status().message()).find("trainer stage 1 has no source node left") != std::string::npos);
}

}  // namespace
}  // namespace wsync::daemon
