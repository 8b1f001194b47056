// Deadlines flow down (issue 39): the source's dials to target daemons end by the deadline of the call they serve
// (Configure's, StartUpdate's reconnects), not by fixed timeouts of their own. The dial is injected: it records the
// deadline it was handed and, when told to hang, waits for it (or 20 s at most, so a dial handed no deadline shows
// as a call that outlived its caller's deadline, not as a hung test).

#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>

#include "absl/strings/match.h"
#include "daemon/node/source_node.h"
#include "tests/daemon/null_source.h"

namespace wsync::daemon {
namespace {

constexpr int64_t kPlan = 3;
constexpr absl::Duration kHangAtMost = absl::Seconds(20);

struct Dial {
  std::mutex mu;
  std::condition_variable cv;
  bool hang = false;
  int calls = 0;
  absl::Time last_deadline = absl::InfinitePast();

  absl::StatusOr<v1::ConnectTargetReply> operator()(const std::string& daemon, const v1::ConnectTargetRequest&,
                                                    absl::Time deadline) {
    std::unique_lock<std::mutex> l(mu);
    ++calls;
    last_deadline = deadline;
    if (!hang) {
      v1::ConnectTargetReply out;
      out.set_target_endpoint_info("null");
      return out;
    }
    const absl::Time until = std::min(deadline, absl::Now() + kHangAtMost);
    cv.wait_until(l, absl::ToChronoTime(until), [&] { return !hang; });
    return absl::DeadlineExceededError(absl::StrCat("ConnectTarget to ", daemon, ": deadline passed"));
  }
};

struct Source {
  testing::NullTransport transport;
  Dial dial;
  std::unique_ptr<SourceNode> node;
  Source() {
    SourceOptions o;
    o.node_id = "src";
    o.ring_bytes = 8 << 20;
    node =
        std::make_unique<SourceNode>(o, &transport,
                                     ConnectTargetByFn([this](const std::string& d, const v1::ConnectTargetRequest& r,
                                                              absl::Time deadline) { return dial(d, r, deadline); }));
  }
  void Hang(bool h) {
    std::lock_guard<std::mutex> l(dial.mu);
    dial.hang = h;
    dial.cv.notify_all();
  }
  absl::Time LastDeadline() {
    std::lock_guard<std::mutex> l(dial.mu);
    return dial.last_deadline;
  }
};

v1::StartUpdateRequest Start(int64_t v) {
  v1::StartUpdateRequest r;
  r.set_version(v);
  r.set_plan_epoch(kPlan);
  return r;
}

TEST_CASE("deadlines: Configure's dials end by the caller's deadline, naming the target") {
  Source s;
  s.Hang(true);
  const absl::Time t0 = absl::Now();
  const absl::Time deadline = t0 + absl::Milliseconds(800);
  auto c = s.node->Configure(testing::TinyPlan(WSYNC_TINY_MODEL, kPlan), deadline);
  const absl::Duration took = absl::Now() - t0;
  INFO(c.status().ToString() << " after " << absl::FormatDuration(took));
  REQUIRE_FALSE(c.ok());
  CHECK(absl::StrContains(c.status().message(), "engine e0 rank 0"));
  CHECK(s.LastDeadline() <= deadline);
  CHECK(took < absl::Seconds(5));
  // The same call with time to spare connects.
  s.Hang(false);
  auto ok = s.node->Configure(testing::TinyPlan(WSYNC_TINY_MODEL, kPlan), absl::Now() + absl::Seconds(30));
  INFO(ok.status().ToString());
  CHECK(ok.ok());
}

TEST_CASE("deadlines: StartUpdate's reconnects end by the caller's deadline; a later StartUpdate reconnects") {
  Source s;
  REQUIRE(s.node->Configure(testing::TinyPlan(WSYNC_TINY_MODEL, kPlan)).ok());
  // An aborted update cancels every endpoint: the next StartUpdate connects them again first.
  REQUIRE(s.node->StartUpdate(Start(1)).ok());
  v1::AbortSourceUpdateRequest ab;
  ab.set_version(1);
  ab.set_reason("operator");
  REQUIRE(s.node->AbortUpdate(ab).ok());

  s.Hang(true);
  const absl::Time t0 = absl::Now();
  const absl::Time deadline = t0 + absl::Milliseconds(800);
  const absl::Status st = s.node->StartUpdate(Start(2), deadline);
  const absl::Duration took = absl::Now() - t0;
  INFO(st.ToString() << " after " << absl::FormatDuration(took));
  REQUIRE_FALSE(st.ok());
  CHECK(absl::StrContains(st.message(), "engine e0 rank 0"));
  CHECK(s.LastDeadline() <= deadline);
  CHECK(took < absl::Seconds(5));

  s.Hang(false);
  const absl::Status again = s.node->StartUpdate(Start(3), absl::Now() + absl::Seconds(30));
  INFO(again.ToString());
  CHECK(again.ok());
}

}  // namespace
}  // namespace wsync::daemon
