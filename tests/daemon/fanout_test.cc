// The coordinator's phase fan-out (daemon/coordinator/fanout.h) and its typed update and engine states
// (daemon/coordinator/update_state.h): bounded workers, a phase deadline, cancellation, and the transitions table.
#include "daemon/coordinator/fanout.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/coordinator/update_state.h"

namespace wsync::daemon {
namespace {

using namespace std::chrono_literals;

// A peer call that blocks until it is cancelled (per item) or released, as a hung peer does.
class HungCalls {
 public:
  absl::Status Call(size_t i) {
    std::unique_lock<std::mutex> l(mu_);
    ++started_;
    cv_.notify_all();
    cv_.wait(l, [&] { return cancelled_.count(i) > 0 || released_; });
    return released_ ? absl::OkStatus() : absl::CancelledError("cancelled at the peer");
  }
  void Cancel(size_t i) {
    std::lock_guard<std::mutex> l(mu_);
    cancelled_.insert(i);
    cv_.notify_all();
  }
  void Release() {
    std::lock_guard<std::mutex> l(mu_);
    released_ = true;
    cv_.notify_all();
  }
  bool AwaitStarted(int n) {
    std::unique_lock<std::mutex> l(mu_);
    return cv_.wait_for(l, 5s, [&] { return started_ >= n; });
  }
  int started() {
    std::lock_guard<std::mutex> l(mu_);
    return started_;
  }
  size_t cancels() {
    std::lock_guard<std::mutex> l(mu_);
    return cancelled_.size();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int started_ = 0;
  std::set<size_t> cancelled_;
  bool released_ = false;
};

TEST_CASE("fanout: every item runs once, at most max_parallel at a time, on that many threads") {
  constexpr size_t kItems = 1000;
  std::atomic<int> running{0}, most{0};
  std::mutex ids_mu;
  std::set<std::thread::id> threads;
  std::vector<std::atomic<int>> runs(kItems);
  FanoutOptions o;
  o.max_parallel = 8;
  const auto out = RunFanout(
      kItems,
      [&](size_t i) {
        const int now = ++running;
        int seen = most.load();
        while (now > seen && !most.compare_exchange_weak(seen, now)) {
        }
        {
          std::lock_guard<std::mutex> l(ids_mu);
          threads.insert(std::this_thread::get_id());
        }
        std::this_thread::sleep_for(100us);  // a round trip
        ++runs[i];
        --running;
        return i % 100 == 7 ? absl::UnavailableError(absl::StrCat("peer ", i, " refused")) : absl::OkStatus();
      },
      o);
  REQUIRE(out.size() == kItems);
  for (size_t i = 0; i < kItems; ++i) {
    INFO(i);
    CHECK(runs[i] == 1);
    CHECK(out[i].ok() == (i % 100 != 7));
  }
  CHECK(most.load() <= 8);
  CHECK(most.load() > 1);  // they do overlap
  CHECK(threads.size() <= 8);
  // The phase's result names every failure, with the first one's code.
  const absl::Status all = CombineStatuses(out);
  CHECK(all.code() == absl::StatusCode::kUnavailable);
  CHECK(absl::StrContains(all.message(), "10 of 1000 calls failed"));
  CHECK(absl::StrContains(all.message(), "peer 7 refused"));
  CHECK(absl::StrContains(all.message(), "peer 907 refused"));
  CHECK(CombineStatuses({absl::OkStatus(), absl::OkStatus()}).ok());
  CHECK(RunFanout(
            0, [](size_t) { return absl::OkStatus(); }, o)
            .empty());
}

TEST_CASE("fanout: at the phase deadline running calls are cancelled and queued ones are not called") {
  HungCalls peers;
  FanoutOptions o;
  o.max_parallel = 2;
  o.deadline = absl::Milliseconds(200);
  o.phase = "pause";
  o.cancel_running = [&](size_t i) { peers.Cancel(i); };
  const absl::Time t0 = absl::Now();
  const auto out = RunFanout(
      5, [&](size_t i) { return peers.Call(i); }, o);
  const absl::Duration took = absl::Now() - t0;
  CHECK(took >= absl::Milliseconds(200));
  CHECK(took < absl::Seconds(2));
  CHECK(peers.started() == 2);  // only two workers, both hung: the three others never reached a peer
  CHECK(peers.cancels() == 2);
  for (size_t i = 0; i < 2; ++i) CHECK(out[i].code() == absl::StatusCode::kCancelled);
  for (size_t i = 2; i < 5; ++i) {
    INFO(out[i].ToString());
    CHECK(out[i].code() == absl::StatusCode::kDeadlineExceeded);
    CHECK(absl::StrContains(out[i].message(), "pause ran past its deadline"));
  }
}

TEST_CASE("fanout: a cancellation raised during the phase cancels running calls and skips the rest at once") {
  HungCalls peers;
  auto cancel = std::make_shared<Cancellation>();
  FanoutOptions o;
  o.max_parallel = 3;
  o.cancellation = cancel;
  o.phase = "continue";
  o.cancel_running = [&](size_t i) { peers.Cancel(i); };
  std::vector<absl::Status> out;
  std::thread phase([&] {
    out = RunFanout(
        10, [&](size_t i) { return peers.Call(i); }, o);
  });
  REQUIRE(peers.AwaitStarted(3));
  const absl::Time t0 = absl::Now();
  cancel->Cancel("update 7 aborted by the operator");
  phase.join();
  CHECK(absl::Now() - t0 < absl::Seconds(1));
  CHECK(peers.started() == 3);
  REQUIRE(out.size() == 10);
  for (size_t i = 3; i < 10; ++i) {
    INFO(out[i].ToString());
    CHECK(out[i].code() == absl::StatusCode::kCancelled);
    CHECK(absl::StrContains(out[i].message(), "continue was cancelled (update 7 aborted by the operator)"));
  }
  // Raised before the phase starts: nothing is called.
  int calls = 0;
  const auto none = RunFanout(
      4,
      [&](size_t) {
        ++calls;
        return absl::OkStatus();
      },
      o);
  CHECK(calls == 0);
  for (const auto& s : none) CHECK(s.code() == absl::StatusCode::kCancelled);
}

TEST_CASE("fanout: without a deadline or cancellation a slow call is waited for") {
  HungCalls peers;
  FanoutOptions o;
  o.max_parallel = 4;
  std::vector<absl::Status> out;
  std::thread phase([&] {
    out = RunFanout(
        2, [&](size_t i) { return peers.Call(i); }, o);
  });
  REQUIRE(peers.AwaitStarted(2));
  std::this_thread::sleep_for(50ms);
  peers.Release();
  phase.join();
  CHECK(CombineStatuses(out).ok());
}

TEST_CASE("update states: names round-trip, unknown ones are refused, transitions follow the lifecycle") {
  using S = UpdateState;
  for (S s : {S::kIdle, S::kBeginning, S::kUpdating, S::kCommitting, S::kAborting, S::kFailed}) {
    auto back = ParseUpdateState(UpdateStateName(s));
    REQUIRE(back.ok());
    CHECK(*back == s);
  }
  CHECK(ParseUpdateState("paused").status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(UpdateInProgress(S::kAborting));
  CHECK_FALSE(UpdateInProgress(S::kFailed));
  // The happy path and its alternatives.
  CHECK(LegalUpdateTransition(S::kIdle, S::kBeginning));
  CHECK(LegalUpdateTransition(S::kBeginning, S::kUpdating));
  CHECK(LegalUpdateTransition(S::kUpdating, S::kCommitting));
  CHECK(LegalUpdateTransition(S::kCommitting, S::kIdle));
  CHECK(LegalUpdateTransition(S::kCommitting, S::kFailed));
  CHECK(LegalUpdateTransition(S::kUpdating, S::kAborting));
  CHECK(LegalUpdateTransition(S::kAborting, S::kFailed));
  CHECK(LegalUpdateTransition(S::kFailed, S::kBeginning));
  // What must never happen: committing without an open update, skipping the commit, leaving an abort half done.
  CHECK_FALSE(LegalUpdateTransition(S::kIdle, S::kCommitting));
  CHECK_FALSE(LegalUpdateTransition(S::kBeginning, S::kCommitting));
  CHECK_FALSE(LegalUpdateTransition(S::kUpdating, S::kIdle));
  CHECK_FALSE(LegalUpdateTransition(S::kAborting, S::kIdle));
  CHECK_FALSE(LegalUpdateTransition(S::kIdle, S::kIdle));
  CHECK_FALSE(LegalUpdateTransition(S::kFailed, S::kIdle));
}

TEST_CASE("engine states: the stored form is unchanged and parses back") {
  for (const char* name : {"registered", "paused", "serving", "failed: pause", "failed: continue"}) {
    auto v = ParseEngineState(name);
    REQUIRE(v.ok());
    CHECK(EngineStateName(*v) == name);
  }
  auto failed = ParseEngineState("failed: set_version");
  REQUIRE(failed.ok());
  CHECK(failed->state == EngineState::kFailed);
  CHECK(failed->failed_phase == "set_version");
  CHECK(ParseEngineState("resting").status().code() == absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace wsync::daemon
