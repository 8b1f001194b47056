// The source's write pipeline (daemon/node/source_writer.h): a writer per target owns its endpoint; producers block
// on its credits, never on a Post; the first failure fails the update and cancels what is queued; a drain waits for
// the writers' completions; one target's stuck network holds up no other target.
#include "daemon/node/source_writer.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <condition_variable>
#include <future>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/match.h"

namespace wsync::daemon {
namespace {

using transport::BatchId;
using transport::WriteRequest;

// An endpoint whose Posts the test lets through one by one (`gate`), whose batches complete when the test says
// (`complete`), and that can fail a chosen Post. Records the order of the batches it was handed (their first write's
// dst_offset). With `with_fd`, a CompletionFd as transport.h defines it (written on a completion and a Cancel,
// consumed by Wait): the writer then sleeps on it instead of waiting in Wait slices.
class GatedEndpoint : public transport::Endpoint {
 public:
  explicit GatedEndpoint(bool with_fd = true) : efd(with_fd ? eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC) : -1) {}
  ~GatedEndpoint() override {
    if (efd >= 0) close(efd);
  }
  int CompletionFd() const override { return efd; }
  void Signal() {
    const uint64_t one = 1;
    if (efd >= 0 && write(efd, &one, sizeof(one)) < 0) FAIL("eventfd write");
  }
  std::string LocalInfo() const override { return "gated"; }
  absl::Status Connect(const std::string&, absl::Duration) override { return absl::OkStatus(); }
  absl::StatusOr<BatchId> Post(absl::Span<const WriteRequest> writes) override {
    std::unique_lock<std::mutex> l(mu);
    ++posting;
    cv.notify_all();
    cv.wait(l, [&] { return open_posts > 0 || !cancelled.ok(); });
    --posting;
    if (!cancelled.ok()) return cancelled;
    --open_posts;
    posted.push_back(writes.empty() ? 0 : writes[0].dst_offset);
    if (static_cast<int>(posted.size()) == fail_post) return absl::UnavailableError("injected: peer gone");
    cv.notify_all();
    return static_cast<BatchId>(posted.size());
  }
  absl::Status Wait(BatchId id, absl::Duration timeout) override {
    uint64_t n;
    while (efd >= 0 && read(efd, &n, sizeof(n)) == static_cast<ssize_t>(sizeof(n))) {
    }
    std::unique_lock<std::mutex> l(mu);
    if (!cv.wait_for(l, absl::ToChronoNanoseconds(timeout),
                     [&] { return completed >= static_cast<int>(id) || !cancelled.ok(); }))
      return absl::DeadlineExceededError("not yet");
    if (!cancelled.ok()) return cancelled;
    ++waited;
    cv.notify_all();
    return absl::OkStatus();
  }
  std::string PeerName() const override { return "gated peer"; }
  void Cancel(const absl::Status& why) override {
    std::lock_guard<std::mutex> l(mu);
    if (cancelled.ok()) cancelled = why;
    cv.notify_all();
    Signal();
  }

  // Test side.
  void AllowPosts(int n) {
    std::lock_guard<std::mutex> l(mu);
    open_posts += n;
    cv.notify_all();
  }
  void Complete(int upto) {
    std::lock_guard<std::mutex> l(mu);
    completed = upto;
    cv.notify_all();
    Signal();
  }
  template <typename Pred>
  bool WaitFor(Pred pred) {
    std::unique_lock<std::mutex> l(mu);
    return cv.wait_for(l, std::chrono::seconds(20), pred);
  }

  std::mutex mu;
  std::condition_variable cv;
  int open_posts = 0, posting = 0, completed = 0, waited = 0, fail_post = -1;
  std::vector<uint64_t> posted;
  absl::Status cancelled;
  const int efd;
};

// With a CompletionFd the writer sleeps until it fires or a Submit wakes it: a lost wake-up must show as a hang (the
// test's 20 s waits), not as a pause of sleep_cap.
TargetWriter::Options FdOptions(int credits) {
  TargetWriter::Options o;
  o.credits = credits;
  o.sleep_cap = absl::Seconds(120);
  return o;
}

std::vector<WriteRequest> Batch(uint64_t tag) { return {WriteRequest{nullptr, 0, nullptr, tag, 0}}; }

struct Failures {
  std::mutex mu;
  std::vector<std::pair<int64_t, absl::Status>> seen;
  UpdateWrites::FailureFn fn() {
    return [this](int64_t v, const absl::Status& st) {
      std::lock_guard<std::mutex> l(mu);
      seen.emplace_back(v, st);
    };
  }
};

TEST_CASE("writer: producers block on credits, not on a Post; batches are posted in order and drained") {
  Failures f;
  UpdateWrites updates(f.fn());
  updates.Begin(1);
  const bool with_fd = GENERATE(true, false);
  INFO((with_fd ? "the writer sleeps on the endpoint's CompletionFd" : "the endpoint has no CompletionFd"));
  auto owned = std::make_unique<GatedEndpoint>(with_fd);
  GatedEndpoint* ep = owned.get();
  TargetWriter w(std::move(owned), "writing to t0", &updates, FdOptions(3));

  // The first Post is stuck in the network: the producer's Submit returned all the same, and two more fit.
  for (uint64_t i = 1; i <= 3; ++i) REQUIRE(w.Submit(1, Batch(i)).ok());
  REQUIRE(ep->WaitFor([&] { return ep->posting == 1; }));
  CHECK(w.busy() == 3);
  // A fourth waits for a credit.
  auto fourth = std::async(std::launch::async, [&] { return w.Submit(1, Batch(4)); });
  CHECK(fourth.wait_for(std::chrono::milliseconds(200)) == std::future_status::timeout);
  CHECK_FALSE(updates.WaitDrained(absl::Now() + absl::Milliseconds(50)));
  // The network moves: posts go through, and the first batch's completion frees the fourth's credit.
  ep->AllowPosts(4);
  REQUIRE(ep->WaitFor([&] { return ep->posted.size() == 3; }));
  CHECK(fourth.wait_for(std::chrono::milliseconds(200)) == std::future_status::timeout);  // none completed yet
  ep->Complete(1);
  REQUIRE(fourth.get().ok());
  ep->Complete(4);
  REQUIRE(updates.WaitDrained(absl::Now() + absl::Seconds(20)));
  CHECK(updates.error(1).ok());
  CHECK(w.busy() == 0);
  CHECK(ep->posted == std::vector<uint64_t>{1, 2, 3, 4});
  CHECK(ep->waited == 4);
  CHECK(f.seen.empty());
}

TEST_CASE("writer: the first failed Post fails the update once, drops what is queued and wakes blocked producers") {
  Failures f;
  UpdateWrites updates(f.fn());
  updates.Begin(7);
  auto owned = std::make_unique<GatedEndpoint>();
  GatedEndpoint* ep = owned.get();
  ep->fail_post = 2;
  TargetWriter::Options o;
  o.credits = 4;
  TargetWriter w(std::move(owned), "writing to engine e rank 0", &updates, o);
  for (uint64_t i = 1; i <= 4; ++i) REQUIRE(w.Submit(7, Batch(i)).ok());
  auto blocked = std::async(std::launch::async, [&] { return w.Submit(7, Batch(5)); });
  CHECK(blocked.wait_for(std::chrono::milliseconds(100)) == std::future_status::timeout);
  ep->AllowPosts(10);  // the second Post fails
  REQUIRE(updates.WaitDrained(absl::Now() + absl::Seconds(20)));
  // The blocked producer is refused (the writer broke), nothing after the failure was posted.
  const absl::Status b = blocked.get();
  INFO(b.ToString());
  CHECK_FALSE(b.ok());
  CHECK(ep->posted.size() == 2);
  const absl::Status err = updates.error(7);
  INFO(err.ToString());
  CHECK(absl::StrContains(err.message(), "writing to engine e rank 0: injected: peer gone"));
  CHECK(absl::StrContains(w.broken().message(), "injected: peer gone"));
  {
    std::lock_guard<std::mutex> l(f.mu);
    REQUIRE(f.seen.size() == 1);  // once, with the first cause
    CHECK(f.seen[0].first == 7);
    CHECK(f.seen[0].second == err);
  }
  // Later submits are refused at once.
  CHECK(w.Submit(7, Batch(9)).code() == absl::StatusCode::kUnavailable);
}

TEST_CASE("writer: a cancel releases batches stuck in the network and producers waiting for credits") {
  Failures f;
  UpdateWrites updates(f.fn());
  updates.Begin(3);
  auto owned = std::make_unique<GatedEndpoint>();
  GatedEndpoint* ep = owned.get();
  TargetWriter w(std::move(owned), "writing to t", &updates, FdOptions(2));
  REQUIRE(w.Submit(3, Batch(1)).ok());
  REQUIRE(w.Submit(3, Batch(2)).ok());
  ep->AllowPosts(1);  // batch 1 is posted and never completes; batch 2 is stuck in its Post
  REQUIRE(ep->WaitFor([&] { return ep->posted.size() == 1 && ep->posting == 1; }));
  auto blocked = std::async(std::launch::async, [&] { return w.Submit(3, Batch(3)); });
  CHECK(blocked.wait_for(std::chrono::milliseconds(100)) == std::future_status::timeout);
  // The source fails the update itself (UpdateWrites::Fail, no callback), then cancels its writers.
  const absl::Time t0 = absl::Now();
  updates.Fail(3, absl::AbortedError("update 3 was aborted: operator"));
  w.Cancel(absl::AbortedError("update 3 was aborted: operator"));
  CHECK_FALSE(blocked.get().ok());
  REQUIRE(updates.WaitDrained(absl::Now() + absl::Seconds(20)));
  CHECK(absl::Now() - t0 < absl::Seconds(5));
  CHECK(ep->posted.size() == 1);  // the stuck Post was failed by the cancel, nothing posted after it
  CHECK(absl::StrContains(w.broken().message(), "aborted: operator"));
  CHECK(updates.error(3).message() == "update 3 was aborted: operator");
  CHECK(f.seen.empty());  // the canceller failed the update: nobody is called back
}

TEST_CASE("writer: one target's stuck network holds up no other target's writes") {
  Failures f;
  UpdateWrites updates(f.fn());
  updates.Begin(1);
  auto slow_owned = std::make_unique<GatedEndpoint>(), fast_owned = std::make_unique<GatedEndpoint>();
  GatedEndpoint* slow = slow_owned.get();
  GatedEndpoint* fast = fast_owned.get();
  TargetWriter ws(std::move(slow_owned), "writing to slow", &updates, FdOptions(2));
  TargetWriter wf(std::move(fast_owned), "writing to fast", &updates, FdOptions(2));
  fast->AllowPosts(100);
  fast->Complete(100);
  // One producer alternates between both targets; the slow one's credits fill, the fast one's writes go on.
  REQUIRE(ws.Submit(1, Batch(1)).ok());
  REQUIRE(ws.Submit(1, Batch(2)).ok());
  for (uint64_t i = 1; i <= 20; ++i) REQUIRE(wf.Submit(1, Batch(i)).ok());
  REQUIRE(fast->WaitFor([&] { return fast->waited == 20; }));
  CHECK(slow->posted.empty());
  CHECK_FALSE(updates.WaitDrained(absl::Now() + absl::Milliseconds(50)));
  slow->AllowPosts(2);
  slow->Complete(2);
  REQUIRE(updates.WaitDrained(absl::Now() + absl::Seconds(20)));
  CHECK(updates.error(1).ok());
}

TEST_CASE("writer: an earlier update's late completions do not count in the next one") {
  Failures f;
  UpdateWrites updates(f.fn());
  updates.Begin(1);
  auto owned = std::make_unique<GatedEndpoint>();
  GatedEndpoint* ep = owned.get();
  TargetWriter w(std::move(owned), "writing to t", &updates);
  REQUIRE(w.Submit(1, Batch(1)).ok());
  CHECK(updates.pending() == 1);
  updates.Begin(2);  // update 1 ended without its batch (abandoned)
  CHECK(updates.pending() == 0);
  ep->fail_post = 1;
  ep->AllowPosts(1);
  REQUIRE(ep->WaitFor([&] { return ep->posted.size() == 1; }));
  CHECK(updates.WaitDrained(absl::Now() + absl::Seconds(20)));
  CHECK(updates.error(2).ok());  // update 1's failure is not update 2's
  CHECK_FALSE(updates.Add(1));   // nor can update 1 queue more
  std::lock_guard<std::mutex> l(f.mu);
  CHECK(f.seen.empty());
}

}  // namespace
}  // namespace wsync::daemon
