// The coordinator's readers answer from its published model (daemon/coordinator/cluster_model.h), never from under
// its lock: Status, History, EngineStates and a WatchEngines stream (over a real gRPC server) answer while a test
// holds the coordinator's lock (Coordinator::HoldLockForTest; a reader that took it would wait until the bound and
// fail), and while a phase's peer call is blocked. From inside every peer call of classic updates, a failed one and
// an aborted one, the published model must be what the coordinator's state is at that moment
// (Coordinator::CheckModelForTest: a change not published shows as a difference), and after each transition Status
// reports the state it must (the expected values are written out here, not read back from the coordinator).

#include <grpcpp/grpcpp.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status.h"
#include "daemon/common/serve.h"
#include "daemon/coordinator/coordinator.h"
#include "daemon/coordinator/coordinator_service.h"
#include "tests/daemon/fake_layouts.h"
#include "tests/daemon/idle_peers.h"
#include "wsync/v1/coordinator.grpc.pb.h"

namespace wsync::daemon {
namespace {

using namespace std::chrono_literals;
// How long a reader may take while the lock is held: generous for a loaded machine; a reader taking the lock never
// answers before the holder lets go, so it fails this bound whatever it is.
constexpr auto kAnswerWithin = 10s;

// Peers that answer at once, check the published model from inside every call, and can hold one kind of call until
// released.
class ModelPeers : public testing::IdlePeers {
 public:
  ModelPeers() : IdlePeers(testing::TinyConfigJson()) {}
  Coordinator* c = nullptr;

  // The next call named `rpc` waits in the peer until Release(); Entered() waits until it is there.
  void Block(const std::string& rpc) {
    std::lock_guard<std::mutex> l(mu_);
    block_ = rpc;
    entered_ = released_ = false;
  }
  void Entered() {
    std::unique_lock<std::mutex> l(mu_);
    REQUIRE(cv_.wait_for(l, kAnswerWithin, [&] { return entered_; }));
  }
  void Release() {
    std::lock_guard<std::mutex> l(mu_);
    released_ = true;
    block_.clear();
    cv_.notify_all();
  }
  void Fail(const std::string& rpc) {
    std::lock_guard<std::mutex> l(mu_);
    fail_ = rpc;
  }
  int checks() {
    std::lock_guard<std::mutex> l(mu_);
    return checks_;
  }
  std::vector<std::string> mismatches() {
    std::lock_guard<std::mutex> l(mu_);
    return mismatches_;
  }

  absl::Status Pause(const std::string&, const std::string&) override { return Call("Pause"); }
  absl::Status PostProcess(const std::string&, const std::string&) override { return Call("PostProcess"); }
  absl::Status SetWeightVersion(const std::string&, const std::string&) override { return Call("SetWeightVersion"); }
  absl::Status Continue(const std::string&) override { return Call("Continue"); }
  absl::Status StartUpdate(const std::string&, const v1::StartUpdateRequest&) override { return Call("StartUpdate"); }
  absl::StatusOr<v1::FinishUpdateReply> FinishUpdate(const std::string&, const v1::FinishUpdateRequest&) override {
    WSYNC_RETURN_IF_ERROR(Call("FinishUpdate"));
    return v1::FinishUpdateReply();
  }
  absl::StatusOr<v1::AbortSourceUpdateReply> AbortSourceUpdate(const std::string&,
                                                               const v1::AbortSourceUpdateRequest&) override {
    WSYNC_RETURN_IF_ERROR(Call("AbortSourceUpdate"));
    v1::AbortSourceUpdateReply r;
    r.set_quiescent(true);
    return r;
  }
  absl::StatusOr<v1::ConfigureSourceReply> ConfigureSource(const std::string&,
                                                           const v1::ConfigureSourceRequest&) override {
    WSYNC_RETURN_IF_ERROR(Call("ConfigureSource"));
    return v1::ConfigureSourceReply();
  }
  absl::StatusOr<v1::SetWriteWindowReply> SetWriteWindow(const std::string&,
                                                         const v1::SetWriteWindowRequest& req) override {
    WSYNC_RETURN_IF_ERROR(Call(req.open() ? "OpenWindow" : "CloseWindow"));
    return v1::SetWriteWindowReply();
  }

 private:
  absl::Status Call(const std::string& rpc) {
    if (c != nullptr) {
      const absl::Status st = c->CheckModelForTest();
      std::lock_guard<std::mutex> l(mu_);
      ++checks_;
      if (!st.ok()) mismatches_.push_back(absl::StrCat("in ", rpc, ": ", st.message()));
    }
    std::unique_lock<std::mutex> l(mu_);
    if (rpc == block_) {
      entered_ = true;
      cv_.notify_all();
      cv_.wait(l, [&] { return released_; });
    }
    if (rpc == fail_) return absl::UnavailableError(absl::StrCat(rpc, " refused by the test"));
    return absl::OkStatus();
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::string block_, fail_;
  bool entered_ = false, released_ = false;
  int checks_ = 0;
  std::vector<std::string> mismatches_;
};

struct Cluster {
  ModelPeers* peers = new ModelPeers();
  Coordinator c{CoordinatorOptions(), std::unique_ptr<Peers>(peers)};
  CoordinatorService svc{&c};
  Served served;
  std::unique_ptr<v1::Coordinator::Stub> stub;
  Cluster() {
    peers->c = &c;
    REQUIRE(c.RegisterNode(testing::SourceRegistration("src")).ok());
    REQUIRE(c.RegisterNode(testing::TargetRegistration("tgt", "eng", 2)).ok());
    auto s = Serve("127.0.0.1:0", {&svc}, "");
    REQUIRE(s.ok());
    served = *std::move(s);
    stub = v1::Coordinator::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", served.port), grpc::InsecureChannelCredentials()));
  }
  ~Cluster() { served.server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5))); }
  absl::Status Begin(int64_t v) {
    v1::BeginUpdateRequest r;
    r.set_version(v);
    return c.BeginUpdate(r).status();
  }
  absl::Status Commit(int64_t v) {
    v1::CommitUpdateRequest r;
    r.set_version(v);
    return c.CommitUpdate(r).status();
  }
  // The one engine's details in Status.
  v1::EngineSummary Engine(const v1::ClusterStatus& s) {
    for (const auto& n : s.nodes())
      for (const auto& e : n.engine_details())
        if (e.engine_id() == "eng") return e;
    FAIL("engine eng is not in the status");
    return {};
  }
};

TEST_CASE("model: Status, History, EngineStates and WatchEngines answer while the coordinator's lock is held") {
  Cluster k;
  REQUIRE(k.Begin(1).ok());
  REQUIRE(k.Commit(1).ok());
  // The readers run on their own threads; the futures outlive the hold, so that a reader that waits for the lock
  // makes this test fail (answered false) instead of hanging it.
  std::future<v1::ClusterStatus> status;
  std::future<v1::HistoryReply> history;
  std::future<v1::EngineStates> states;
  std::future<uint64_t> generation;
  std::future<std::string> grpc_status, watched, scraped;
  std::vector<bool> answered;
  k.c.HoldLockForTest([&] {
    scraped = std::async(std::launch::async, [&] { return k.c.metrics().Render(); });
    status = std::async(std::launch::async, [&] { return k.c.Status(); });
    history = std::async(std::launch::async, [&] {
      v1::HistoryRequest r;
      return k.c.History(r);
    });
    states = std::async(std::launch::async, [&] { return k.c.EngineStates(); });
    generation = std::async(std::launch::async,
                            [&] { return k.c.WaitForChange(k.c.ChangeGeneration(), absl::Milliseconds(1)); });
    // Over the server: GetClusterStatus and a WatchEngines stream's first message.
    grpc_status = std::async(std::launch::async, [&] {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + kAnswerWithin);
      v1::ClusterStatus out;
      const grpc::Status st = k.stub->GetClusterStatus(&ctx, v1::ClusterStatusRequest(), &out);
      return st.ok() ? out.current_version() : absl::StrCat("error: ", st.error_message());
    });
    watched = std::async(std::launch::async, [&] {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + kAnswerWithin);
      v1::WatchEnginesRequest req;
      auto reader = k.stub->WatchEngines(&ctx, req);
      v1::EngineStates first;
      const bool got = reader->Read(&first);
      ctx.TryCancel();
      reader->Finish();
      return got ? first.current_version() : std::string("no message");
    });
    const auto by = std::chrono::steady_clock::now() + kAnswerWithin;
    answered = {status.wait_until(by) == std::future_status::ready,
                history.wait_until(by) == std::future_status::ready,
                states.wait_until(by) == std::future_status::ready,
                generation.wait_until(by) == std::future_status::ready,
                grpc_status.wait_until(by + 2s) == std::future_status::ready,
                watched.wait_until(by + 2s) == std::future_status::ready,
                scraped.wait_until(by) == std::future_status::ready};
  });
  // Status, History, EngineStates, WaitForChange, GetClusterStatus, WatchEngines, a /metrics scrape: each answered
  // while the lock was held.
  CHECK(answered == std::vector<bool>(7, true));
  const v1::ClusterStatus s = status.get();
  CHECK(s.current_version() == "1");
  CHECK(s.state() == "idle");
  CHECK(s.nodes_size() == 2);
  CHECK(s.plan_size() > 0);
  const v1::HistoryReply h = history.get();
  REQUIRE(h.records_size() == 1);
  CHECK(h.records(0).version() == 1);
  CHECK(h.records(0).success());
  const v1::EngineStates es = states.get();
  REQUIRE(es.engines_size() == 1);
  CHECK(es.engines(0).ready());
  CHECK(es.engines(0).weight_version() == "1");
  generation.get();
  CHECK(grpc_status.get() == "1");
  CHECK(watched.get() == "1");
  const std::string text = scraped.get();
  INFO(text);
  CHECK(absl::StrContains(text, "wsync_current_version 1\n"));
  CHECK(absl::StrContains(text, "wsync_update_in_progress 0\n"));
  CHECK(absl::StrContains(text, "wsync_engine_ready{engine=\"eng\"} 1\n"));
  CHECK(absl::StrContains(text, "wsync_engine_weight_version{engine=\"eng\"} 1\n"));
  CHECK(absl::StrContains(text, "wsync_engines{state=\"serving\"} 1\n"));
  CHECK(k.peers->mismatches().empty());
}

TEST_CASE("model: Status during blocked peer calls and after every transition is the coordinator's state") {
  Cluster k;
  // Update 1: begin blocked in its pause, commit blocked in its continue.
  k.peers->Block("Pause");
  auto begin = std::async(std::launch::async, [&] { return k.Begin(1); });
  k.peers->Entered();
  v1::ClusterStatus s = k.c.Status();
  CHECK(s.state() == "beginning");
  CHECK(s.open_version() == 1);
  CHECK(s.current_version().empty());
  k.peers->Release();
  REQUIRE(begin.get().ok());
  s = k.c.Status();
  CHECK(s.state() == "updating");
  CHECK(s.open_version() == 1);
  CHECK(k.Engine(s).state() == "paused");
  CHECK(s.source_plan_epochs().count("src") == 1);

  k.peers->Block("Continue");
  auto commit = std::async(std::launch::async, [&] { return k.Commit(1); });
  k.peers->Entered();
  s = k.c.Status();
  CHECK(s.state() == "committing");
  CHECK(s.current_version() == "1");  // past the commit point
  CHECK(k.Engine(s).weight_version() == "1");
  k.peers->Release();
  REQUIRE(commit.get().ok());
  s = k.c.Status();
  CHECK(s.state() == "idle");
  CHECK(s.open_version() == -1);
  CHECK(s.current_version() == "1");
  CHECK(k.Engine(s).state() == "serving");
  v1::HistoryRequest all;
  REQUIRE(k.c.History(all).records_size() == 1);

  // Update 2 fails in its post-process: failed, its record the last, the engine held paused and failed.
  k.peers->Fail("PostProcess");
  REQUIRE(k.Begin(2).ok());
  CHECK_FALSE(k.Commit(2).ok());
  s = k.c.Status();
  CHECK(s.state() == "failed");
  CHECK(s.failed_version() == 2);
  CHECK_FALSE(s.failure().empty());
  CHECK(s.current_version() == "1");
  CHECK(k.Engine(s).state() == "failed: post_process");
  v1::HistoryReply h = k.c.History(all);
  REQUIRE(h.records_size() == 2);
  CHECK_FALSE(h.records(1).success());
  k.peers->Fail("");

  // Update 3 is aborted by the operator while open; its sources are asked while the update is aborting.
  REQUIRE(k.Begin(3).ok());
  CHECK(k.c.Status().state() == "updating");
  k.peers->Block("AbortSourceUpdate");
  auto abort = std::async(std::launch::async, [&] {
    v1::AbortUpdateRequest r;
    r.set_version(3);
    r.set_reason("test");
    return k.c.AbortUpdate(r).status();
  });
  k.peers->Entered();
  s = k.c.Status();
  CHECK(s.state() == "aborting");
  CHECK(s.open_version() == 3);
  k.peers->Release();
  REQUIRE(abort.get().ok());
  s = k.c.Status();
  CHECK(s.state() == "failed");
  CHECK(s.failed_version() == 3);
  h = k.c.History(all);
  REQUIRE(h.records_size() == 3);
  CHECK(h.records(2).aborted());

  // Update 4 succeeds again: the engine serves 4.
  REQUIRE(k.Begin(4).ok());
  REQUIRE(k.Commit(4).ok());
  s = k.c.Status();
  CHECK(s.state() == "idle");
  CHECK(s.current_version() == "4");
  CHECK(k.Engine(s).weight_version() == "4");
  CHECK(k.c.History(all).records_size() == 4);
  CHECK(k.c.CheckModelForTest().ok());

  // Every peer call checked the published model against the state at that moment.
  CHECK(k.peers->checks() > 20);
  const std::vector<std::string> bad = k.peers->mismatches();
  for (const auto& m : bad) UNSCOPED_INFO(m);
  CHECK(bad.empty());
}

}  // namespace
}  // namespace wsync::daemon
