// The fault-injecting decorator on top of the tcp backend: spec parsing, which batch fails and how, that a failed
// Post sends nothing, that the endpoint stays broken until re-created, that counting is per transport, and that a
// per-peer delay holds only that peer's Posts.

#include <poll.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "spdlog/sinks/base_sink.h"
#include "spdlog/spdlog.h"
#include "transport/fault/fault_transport.h"

namespace {

using wsync::transport::BatchId;
using wsync::transport::Endpoint;
using wsync::transport::FaultSpec;
using wsync::transport::LocalRegion;
using wsync::transport::ParseFaultSpec;
using wsync::transport::RemoteRegion;
using wsync::transport::Transport;
using wsync::transport::WrapWithFaults;
using wsync::transport::WriteRequest;

const absl::Duration kTimeout = absl::Seconds(20);
constexpr uint64_t kLen = 4096;

std::unique_ptr<Transport> Tcp() {
  wsync::transport::TransportOptions opts;
  opts.bind_host = "127.0.0.1";
  opts.io_timeout = absl::Seconds(15);
  auto t = wsync::transport::CreateTransport("tcp", opts);
  REQUIRE(t.ok());
  return std::move(*t);
}

FaultSpec Spec(const std::string& text) {
  auto s = ParseFaultSpec(text);
  INFO(s.status().ToString());
  REQUIRE(s.ok());
  return *s;
}

// A connected endpoint of `from` to `to`; the receiving end goes to `keep`.
std::unique_ptr<Endpoint> Handshake(Transport& from, Transport& to, std::vector<std::unique_ptr<Endpoint>>* keep) {
  auto a = from.CreateEndpoint();
  auto b = to.CreateEndpoint();
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  std::unique_ptr<Endpoint> theirs = std::move(*b);
  const std::string a_info = (*a)->LocalInfo();
  absl::Status bs;
  std::thread t([&] { bs = theirs->Connect(a_info, kTimeout); });
  absl::Status as = (*a)->Connect(theirs->LocalInfo(), kTimeout);
  t.join();
  INFO(as.ToString() << " / " << bs.ToString());
  REQUIRE(as.ok());
  REQUIRE(bs.ok());
  keep->push_back(std::move(theirs));
  return std::move(*a);
}

// A wrapped sender and a plain tcp receiver, each side with kLen bytes registered; endpoints made on demand.
struct Pair {
  explicit Pair(const FaultSpec& spec) : sender(WrapWithFaults(Tcp(), spec)), receiver(Tcp()) {
    src_bytes.assign(kLen, 0xAB);
    dst_bytes.assign(kLen, 0x00);
    auto s = sender->RegisterMemory(src_bytes.data(), kLen);
    auto d = receiver->RegisterMemory(dst_bytes.data(), kLen);
    REQUIRE(s.ok());
    REQUIRE(d.ok());
    src = std::move(*s);
    dst = std::move(*d);
    auto r = sender->ImportRegion(dst->Descriptor());
    REQUIRE(r.ok());
    remote = std::move(*r);
  }

  std::unique_ptr<Endpoint> Connect() { return Handshake(*sender, *receiver, &peers); }

  // One write of `len` bytes to `offset` (same offset on both sides).
  std::vector<WriteRequest> One(uint64_t offset, uint64_t len) const {
    return {WriteRequest{src.get(), offset, remote.get(), offset, len}};
  }

  bool Landed(uint64_t offset, uint64_t len) const {
    for (uint64_t i = offset; i < offset + len; ++i)
      if (dst_bytes[i] != 0xAB) return false;
    return true;
  }
  bool Untouched(uint64_t offset, uint64_t len) const {
    for (uint64_t i = offset; i < offset + len; ++i)
      if (dst_bytes[i] != 0x00) return false;
    return true;
  }

  std::vector<uint8_t> src_bytes, dst_bytes;
  std::unique_ptr<Transport> sender, receiver;
  std::unique_ptr<LocalRegion> src, dst;
  std::unique_ptr<RemoteRegion> remote;
  std::vector<std::unique_ptr<Endpoint>> peers;
};

// Every message logged through spdlog's default logger while alive, for a test that acts when one appears (create
// it before the transports whose threads log, destroy it after them).
class LogLines {
 public:
  LogLines() : sink_(std::make_shared<Sink>()), old_(spdlog::default_logger()) {
    auto logger = std::make_shared<spdlog::logger>("captured", sink_);
    logger->set_level(spdlog::level::info);
    spdlog::set_default_logger(logger);
  }
  ~LogLines() { spdlog::set_default_logger(old_); }
  // Waits until a message containing both texts was logged; false after `timeout`.
  bool WaitFor(const std::string& a, const std::string& b, absl::Duration timeout) {
    std::unique_lock<std::mutex> l(sink_->lines_mu);
    return sink_->logged.wait_for(l, absl::ToChronoNanoseconds(timeout), [&] { return CountLocked(a, b) > 0; });
  }
  int Count(const std::string& a, const std::string& b) {
    std::lock_guard<std::mutex> l(sink_->lines_mu);
    return CountLocked(a, b);
  }

 private:
  struct Sink : spdlog::sinks::base_sink<std::mutex> {
    std::mutex lines_mu;
    std::condition_variable logged;
    std::vector<std::string> lines;  // guarded by lines_mu
    void sink_it_(const spdlog::details::log_msg& msg) override {
      {
        std::lock_guard<std::mutex> l(lines_mu);
        lines.emplace_back(msg.payload.data(), msg.payload.size());
      }
      logged.notify_all();
    }
    void flush_() override {}
  };
  int CountLocked(const std::string& a, const std::string& b) const {
    int n = 0;
    for (const std::string& line : sink_->lines) n += absl::StrContains(line, a) && absl::StrContains(line, b);
    return n;
  }
  std::shared_ptr<Sink> sink_;
  std::shared_ptr<spdlog::logger> old_;
};

TEST_CASE("fault spec: parse, print, reject with the offending item", "[transport][fault]") {
  CHECK(Spec("").empty());
  CHECK(Spec("  ").empty());
  FaultSpec s = Spec("fail_post=3,fail_wait=5,delay_ms=10");
  CHECK(s.fail_post == 3);
  CHECK(s.fail_wait == 5);
  CHECK(s.delay == absl::Milliseconds(10));
  CHECK(s.ToString() == "fail_post=3,fail_wait=5,delay_ms=10");
  CHECK(Spec(" fail_wait = 2 ").fail_wait == 2);
  CHECK(Spec(Spec("delay_ms=7,fail_post=1").ToString()).ToString() == "fail_post=1,delay_ms=7");
  FaultSpec peer = Spec("delay_peer = 10.0.0.7:5000 ,delay_ms=20");
  CHECK(peer.delay_peer == "10.0.0.7:5000");
  CHECK(peer.delay == absl::Milliseconds(20));
  CHECK(peer.ToString() == "delay_ms=20,delay_peer=10.0.0.7:5000");
  CHECK(Spec(peer.ToString()).delay_peer == "10.0.0.7:5000");
  CHECK(Spec("delay_ms=5").delay_peer.empty());
  FaultSpec jit = Spec("seed=42, jitter_ms=3");
  CHECK(jit.jitter == absl::Milliseconds(3));
  CHECK(jit.seed == 42);
  CHECK(jit.delays());
  CHECK_FALSE(jit.empty());
  CHECK(jit.ToString() == "jitter_ms=3,seed=42");
  CHECK(Spec("jitter_ms=4,delay_peer=h").ToString() == "jitter_ms=4,delay_peer=h");

  struct Bad {
    std::string spec, item, why;
  };
  for (const Bad& b : std::vector<Bad>{{"fail_post=0", "fail_post=0", "start at 1"},
                                       {"fail_post=x", "fail_post=x", "not a non-negative integer"},
                                       {"fail_post=-1", "fail_post=-1", "not a non-negative integer"},
                                       {"fail_post=", "fail_post=", "not a non-negative integer"},
                                       {"fail_post", "fail_post", "missing '='"},
                                       {"bogus=1", "bogus=1", "unknown key"},
                                       {"fail_post=1,fail_post=2", "fail_post=2", "given twice"},
                                       {"fail_post=1,,delay_ms=3", "", "empty item"},
                                       {"delay_ms=99999999", "delay_ms=99999999", "over 10 minutes"},
                                       {"delay_ms=5,delay_peer=", "delay_peer=", "value is empty"},
                                       {"delay_peer=host", "delay_peer=host", "needs a delay_ms or jitter_ms above 0"},
                                       {"delay_peer=host,delay_ms=0", "delay_peer=host", "needs a delay_ms or jitter_ms above 0"},
                                       {"seed=3", "seed=3", "seed needs a jitter_ms above 0"},
                                       {"jitter_ms=2,seed=x", "seed=x", "not a non-negative integer"},
                                       {"delay_ms=5,delay_peer=a,delay_peer=b", "delay_peer=b", "given twice"},
                                       {"delay_peers=a", "delay_peers=a", "unknown key"}}) {
    auto r = ParseFaultSpec(b.spec);
    INFO(b.spec << " -> " << r.status().ToString());
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StrContains(r.status().message(), "item '" + b.item + "'"));
    CHECK(absl::StrContains(r.status().message(), b.why));
  }
}

TEST_CASE("fail_post: the Nth batch is refused unsent, the endpoint stays broken, a new one works",
          "[transport][fault]") {
  Pair p(Spec("fail_post=2"));
  auto ep = p.Connect();
  CHECK(p.sender->name() == "tcp");
  REQUIRE(ep->Write(p.One(0, 1024), kTimeout).ok());  // batch 1
  CHECK(p.Landed(0, 1024));

  auto id = ep->Post(p.One(1024, 1024));  // batch 2
  REQUIRE_FALSE(id.ok());
  CHECK(id.status().code() == absl::StatusCode::kUnavailable);
  CHECK(absl::StrContains(id.status().message(), ep->PeerName()));
  CHECK(absl::StrContains(id.status().message(), "nothing was sent"));

  auto again = ep->Post(p.One(2048, 1024));
  REQUIRE_FALSE(again.ok());
  CHECK(again.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(again.status().message(), "re-created"));
  absl::SleepFor(absl::Milliseconds(100));  // give a wrongly sent write time to land
  CHECK(p.Untouched(1024, 2048));

  auto fresh = p.Connect();
  REQUIRE(fresh->Write(p.One(1024, 1024), kTimeout).ok());  // batch 3: the fault fires once
  CHECK(p.Landed(1024, 1024));
}

TEST_CASE("invalid requests keep their own error and do not consume a batch number", "[transport][fault]") {
  Pair p(Spec("fail_post=1"));
  auto ep = p.Connect();
  auto oob = ep->Post(p.One(kLen - 8, 16));
  REQUIRE_FALSE(oob.ok());
  CHECK(oob.status().code() != absl::StatusCode::kUnavailable);
  auto id = ep->Post(p.One(0, 16));  // still batch 1
  REQUIRE_FALSE(id.ok());
  CHECK(id.status().code() == absl::StatusCode::kUnavailable);
}

TEST_CASE("fail_wait: the Nth batch's Wait reports a completion error naming the peer", "[transport][fault]") {
  Pair p(Spec("fail_wait=2"));
  auto ep = p.Connect();
  auto b1 = ep->Post(p.One(0, 512));
  auto b2 = ep->Post(p.One(512, 512));
  REQUIRE(b1.ok());
  REQUIRE(b2.ok());
  CHECK(ep->Wait(*b1, kTimeout).ok());
  absl::Status st = ep->Wait(*b2, kTimeout);
  CHECK(st.code() == absl::StatusCode::kUnavailable);
  CHECK(absl::StrContains(st.message(), ep->PeerName()));
  CHECK(absl::StrContains(st.message(), "batch 2"));
  auto after = ep->Post(p.One(1024, 16));
  CHECK(after.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(p.Landed(0, 512));  // faults are failures, not corruption: nothing else changed
  CHECK(p.Untouched(1024, kLen - 1024));
}

TEST_CASE("batch numbers are counted per wrapped transport, across its endpoints and threads", "[transport][fault]") {
  Pair p(Spec("fail_post=7"));
  Pair other(Spec("fail_post=7"));
  constexpr int kThreads = 4, kPerThread = 5;
  std::vector<std::unique_ptr<Endpoint>> eps;
  for (int i = 0; i < kThreads; ++i) eps.push_back(p.Connect());
  std::atomic<int> failed{0}, ok{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i)
    threads.emplace_back([&, i] {
      for (int j = 0; j < kPerThread; ++j) {
        absl::Status st = eps[i]->Write(p.One(i * 64, 64), kTimeout);
        (st.ok() ? ok : failed)++;
        if (!st.ok()) return;  // the endpoint is broken now
      }
    });
  for (auto& t : threads) t.join();
  CHECK(failed == 1);
  CHECK(ok >= (kThreads - 1) * kPerThread);  // the three threads without the fault finished all their batches
  // The other transport's counter is untouched: its 6 first batches succeed.
  auto oep = other.Connect();
  for (int i = 0; i < 6; ++i) CHECK(oep->Write(other.One(0, 64), kTimeout).ok());
  CHECK_FALSE(oep->Write(other.One(0, 64), kTimeout).ok());
}

// delay_ms models a slow link without blocking the caller (transport.h: Post never waits): Post returns at once, the
// batches land one per delay after their Posts, found by Wait(batch, 0) calls made when CompletionFd polls readable;
// a Cancel drops the batches still held, and none of their bytes lands later. Fails when Post sleeps the delay (the
// three Posts take 3 x 300 ms), when a due batch does not signal the fd (the poll times out) or is not handed on by
// Wait, when the batches overlap instead of following one another, or when a cancelled held batch is still sent.
TEST_CASE("delay_ms: Post returns at once, batches land one per delay through Wait and the fd; Cancel drops the held",
          "[transport][fault]") {
  const absl::Duration kDelay = absl::Milliseconds(300);
  Pair p(Spec("delay_ms=300"));
  auto ep = p.Connect();
  const int fd = ep->CompletionFd();
  REQUIRE(fd >= 0);
  const absl::Time t0 = absl::Now();
  std::vector<BatchId> ids;
  for (int i = 0; i < 3; ++i) {
    auto id = ep->Post(p.One(i * 100, 100));
    REQUIRE(id.ok());
    ids.push_back(*id);
  }
  const absl::Duration posting = absl::Now() - t0;
  INFO("three Posts took " << absl::FormatDuration(posting));
  CHECK(posting < kDelay / 2);
  CHECK(ep->Wait(ids[0], absl::ZeroDuration()).code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(p.Untouched(0, kLen));
  std::vector<absl::Duration> landed;
  while (landed.size() < ids.size()) {
    pollfd pf{fd, POLLIN, 0};
    INFO("waiting for batch " << landed.size());
    REQUIRE(poll(&pf, 1, static_cast<int>(absl::ToInt64Milliseconds(kTimeout))) == 1);
    const absl::Status st = ep->Wait(ids[landed.size()], absl::ZeroDuration());
    if (absl::IsDeadlineExceeded(st)) continue;
    INFO(st.ToString());
    REQUIRE(st.ok());
    landed.push_back(absl::Now() - t0);
    CHECK(p.Landed(0, 100 * landed.size()));
  }
  for (size_t i = 0; i < landed.size(); ++i) {
    INFO("batch " << i << " landed after " << absl::FormatDuration(landed[i]));
    CHECK(landed[i] >= kDelay * static_cast<double>(i + 1));
  }
  CHECK(p.Untouched(300, kLen - 300));

  auto held = ep->Post(p.One(400, 100));
  REQUIRE(held.ok());
  const absl::Time cancelled_at = absl::Now();
  ep->Cancel(absl::CancelledError("test: the update was aborted"));
  const absl::Status st = ep->Wait(*held, kTimeout);
  INFO(st.ToString());
  CHECK(absl::StrContains(st.message(), "test: the update was aborted"));
  CHECK(absl::Now() - cancelled_at < kDelay);
  // Nothing of it lands when its time comes: an absence, so checked once that time has passed.
  std::this_thread::sleep_for(absl::ToChronoNanoseconds(kDelay * 2));
  CHECK(p.Untouched(300, kLen - 300));
}

TEST_CASE("delay_peer holds the Posts to that peer only", "[transport][fault]") {
  LogLines log;  // before the transports: their threads log
  // Two receivers; the name a sender's endpoint gives each (its listener's address) is learned through a plain tcp
  // endpoint first, so that the spec can name one of them.
  std::unique_ptr<Transport> slow_rx = Tcp(), fast_rx = Tcp(), probe = Tcp();
  std::vector<std::unique_ptr<Endpoint>> peers;
  const std::string slow_name = Handshake(*probe, *slow_rx, &peers)->PeerName();
  const std::string fast_name = Handshake(*probe, *fast_rx, &peers)->PeerName();
  INFO(slow_name << " / " << fast_name);
  REQUIRE_FALSE(absl::StrContains(fast_name, slow_name));
  REQUIRE_FALSE(absl::StrContains(slow_name, fast_name));

  // Long enough that the undelayed write surely ends inside the hold; the test waits for events, not for it.
  const absl::Duration kDelay = absl::Seconds(5);
  std::unique_ptr<Transport> sender = WrapWithFaults(
      Tcp(), Spec(absl::StrCat("delay_ms=", absl::ToInt64Milliseconds(kDelay), ",delay_peer=", slow_name)));
  std::vector<uint8_t> src_bytes(kLen, 0xAB), slow_bytes(kLen, 0), fast_bytes(kLen, 0);
  auto src = sender->RegisterMemory(src_bytes.data(), kLen);
  auto slow_dst = slow_rx->RegisterMemory(slow_bytes.data(), kLen);
  auto fast_dst = fast_rx->RegisterMemory(fast_bytes.data(), kLen);
  REQUIRE(src.ok());
  REQUIRE(slow_dst.ok());
  REQUIRE(fast_dst.ok());
  auto slow_remote = sender->ImportRegion((*slow_dst)->Descriptor());
  auto fast_remote = sender->ImportRegion((*fast_dst)->Descriptor());
  REQUIRE(slow_remote.ok());
  REQUIRE(fast_remote.ok());
  auto to_slow = Handshake(*sender, *slow_rx, &peers);
  auto to_fast = Handshake(*sender, *fast_rx, &peers);
  CHECK(to_slow->PeerName() == slow_name);
  CHECK(to_fast->PeerName() == fast_name);

  std::atomic<bool> slow_done{false};
  absl::Status slow_st;
  absl::Duration slow_took;
  std::thread slow([&] {
    const WriteRequest w{src->get(), 0, slow_remote->get(), 0, kLen};
    const absl::Time t0 = absl::Now();
    slow_st = to_slow->Write({&w, 1}, kTimeout);
    slow_took = absl::Now() - t0;
    slow_done = true;
  });
  // The hold has begun: the undelayed peer's write goes through meanwhile, and ends before the hold does.
  const bool held = log.WaitFor("injected fault: holding a batch", slow_name, kTimeout);
  CHECK(held);
  const WriteRequest w{src->get(), 0, fast_remote->get(), 0, kLen};
  CHECK(to_fast->Write({&w, 1}, kTimeout).ok());
  CHECK_FALSE(slow_done.load());
  CHECK(fast_bytes == src_bytes);
  slow.join();
  CHECK(slow_st.ok());
  CHECK(slow_took >= kDelay);
  CHECK(slow_bytes == src_bytes);
  CHECK(log.Count("injected fault: holding a batch", slow_name) == 1);
  CHECK(log.Count("injected fault: holding a batch", fast_name) == 0);
}

}  // namespace
