// The fault-injecting decorator on top of the tcp backend: spec parsing, which batch fails and how, that a failed
// Post sends nothing, that the endpoint stays broken until re-created, and that counting is per transport.

#include <atomic>
#include <catch2/catch.hpp>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "transport/fault/fault_transport.h"

namespace {

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

  std::unique_ptr<Endpoint> Connect() {
    auto a = sender->CreateEndpoint();
    auto b = receiver->CreateEndpoint();
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
    peers.push_back(std::move(theirs));
    return std::move(*a);
  }

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
                                       {"delay_ms=99999999", "delay_ms=99999999", "over 10 minutes"}}) {
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

TEST_CASE("delay_ms slows every Post and changes nothing else", "[transport][fault]") {
  Pair p(Spec("delay_ms=50"));
  auto ep = p.Connect();
  const absl::Time t0 = absl::Now();
  for (int i = 0; i < 3; ++i) REQUIRE(ep->Write(p.One(i * 100, 100), kTimeout).ok());
  CHECK(absl::Now() - t0 >= absl::Milliseconds(150));
  CHECK(p.Landed(0, 300));
  CHECK(p.Untouched(300, kLen - 300));
}

}  // namespace
