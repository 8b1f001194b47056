// The mooncake transport against the real Mooncake Transfer Engine: tests/engines/mooncake_peer.py (one
// SGLang-shaped TP rank whose memory the engine registered) is the receiver and the oracle: the test builds region
// descriptors from what the peer's bootstrap publishes, writes independently generated patterns, and compares the
// sha256 the peer computes over its own memory with the sha256 of the same patterns computed here.
//
// Run through tests/engines/run_mooncake_test.sh, which installs the pinned engine into the cache and sets
// WSYNC_MOONCAKE_PYTHON / WSYNC_MOONCAKE_PEER. Without them the test fails (it never skips: nothing here needs
// hardware this machine could lack).

#include <netinet/in.h>
#include <openssl/sha.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <catch2/catch.hpp>

#include "tests/transport/mooncake_peer.h"
#include "tests/transport/pattern.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "nlohmann/json.hpp"
#include "transport/mooncake/mooncake_transport.h"
#include "transport/tcp/tcp_socket.h"
#include "transport/transport.h"

namespace {

using namespace wsync::transport;  // NOLINT: test brevity
using nlohmann::json;
using testing::Http;
using testing::Layout;
using testing::Param;
using testing::Peer;

const absl::Duration kTimeout = absl::Seconds(60);

using wsync::transport::testing::PatternByte;

uint64_t SeedOf(const std::string& step, const std::string& name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (char c : absl::StrCat(step, "/", name)) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  return h;
}

std::string PatternSha256(uint64_t seed, uint64_t n) {
  std::vector<uint8_t> bytes(n);
  for (uint64_t i = 0; i < n; ++i) bytes[i] = PatternByte(seed, i);
  uint8_t md[SHA256_DIGEST_LENGTH];
  SHA256(bytes.data(), bytes.size(), md);
  std::string hex;
  for (uint8_t b : md) absl::StrAppendFormat(&hex, "%02x", b);
  return hex;
}

void RequireOk(const absl::Status& s) {
  INFO(s.ToString());
  REQUIRE(s.ok());
}

std::unique_ptr<Transport> MakeMooncake(uint64_t chunk_bytes = 1 << 20, bool check_peer_buffers = true) {
  TransportOptions opts;
  opts.io_timeout = absl::Seconds(20);
  mooncake::MooncakeOptions m;
  m.chunk_bytes = chunk_bytes;
  m.check_peer_buffers = check_peer_buffers;
  auto t = mooncake::CreateMooncakeTransport(opts, m);
  REQUIRE(t.ok());
  REQUIRE((*t)->viable());
  return std::move(*t);
}

std::unique_ptr<RemoteRegion> ImportRange(Transport& t, const std::string& session, uint64_t base, uint64_t len) {
  auto d = mooncake::MakeRegionDescriptor(session, base, len);
  RequireOk(d.status());
  auto r = t.ImportRegion(*d);
  RequireOk(r.status());
  return std::move(*r);
}

std::unique_ptr<Endpoint> ConnectTo(Transport& t, const std::string& session) {
  auto ep = t.CreateEndpoint();
  RequireOk(ep.status());
  RequireOk((*ep)->Connect(session, absl::Seconds(20)));
  return std::move(*ep);
}

// Source memory holding each named parameter's pattern for one step, registered with the transport.
struct Source {
  std::vector<uint8_t> bytes;
  std::map<std::string, uint64_t> offset;
  std::unique_ptr<LocalRegion> region;
};

Source MakeSource(Transport& t, const Peer& peer, const std::vector<std::string>& names, const std::string& step) {
  Source s;
  uint64_t total = 0;
  for (const auto& n : names) {
    s.offset[n] = total;
    total += peer.param(n).bytes + 7;  // odd spacing: source offsets are unaligned too
  }
  s.bytes.assign(total, 0);
  for (const auto& n : names) {
    const uint64_t seed = SeedOf(step, n);
    const uint64_t len = peer.param(n).bytes;
    uint8_t* out = s.bytes.data() + s.offset[n];
    for (uint64_t i = 0; i < len; ++i) out[i] = PatternByte(seed, i);
  }
  auto r = t.RegisterMemory(s.bytes.data(), s.bytes.size());
  RequireOk(r.status());
  s.region = std::move(*r);
  return s;
}

}  // namespace

TEST_CASE("writes land in the real Mooncake peer: per-parameter and whole-buffer regions, chunked, twice",
          "[mooncake]") {
  // Region 0: one parameter of ~6.7 MB (7 chunks of 1 MiB, unaligned tail), a 6-byte one, a mid-sized one, and
  // one never written. Region 1: written through one descriptor covering the whole registered buffer (offsets
  // inside a buffer), plus one never written between them.
  Peer peer(Layout({{{"big", 3'500'001, 2}, {"tiny", 3, 2}, {"mid", 64 * 192, 2}, {"untouched.a", 1000, 4}},
                    {{"o_proj", 64 * 64, 2}, {"untouched.b", 77, 2}, {"gate_up", 2 * 256 * 64, 2},
                     {"norm", 64, 4}}}));
  auto t = MakeMooncake();
  auto ep = ConnectTo(*t, peer.session_id());
  CHECK(ep->PeerName() == absl::StrCat("mooncake peer ", peer.session_id()));
  CHECK(ep->LocalInfo().empty());

  const std::vector<std::string> per_param = {"big", "tiny", "mid"};
  const std::vector<std::string> in_buffer = {"o_proj", "gate_up", "norm"};
  std::map<std::string, std::unique_ptr<RemoteRegion>> dst;
  for (const auto& n : per_param) dst[n] = ImportRange(*t, peer.session_id(), peer.param(n).ptr, peer.param(n).bytes);
  REQUIRE(peer.regions().size() == 2);
  const auto [buf1, buf1_len] = peer.regions()[1];
  auto whole1 = ImportRange(*t, peer.session_id(), buf1, buf1_len);

  const auto initial = peer.Checksums("initial");
  REQUIRE(peer.Checksums() == initial);
  std::vector<std::string> all = per_param;
  all.insert(all.end(), in_buffer.begin(), in_buffer.end());

  for (const std::string step : {"step1", "step2"}) {  // the second update reuses the endpoint's connections
    Source src = MakeSource(*t, peer, all, step);
    std::vector<WriteRequest> b1, b2;
    for (const auto& n : per_param) {
      b1.push_back({src.region.get(), src.offset[n], dst[n].get(), 0, peer.param(n).bytes});
    }
    for (const auto& n : in_buffer) {
      const Param& p = peer.param(n);
      REQUIRE(p.ptr >= buf1);
      b2.push_back({src.region.get(), src.offset[n], whole1.get(), p.ptr - buf1, p.bytes});
    }
    b2.push_back({src.region.get(), 0, whole1.get(), 0, 0});  // zero-length: completes locally, nothing sent
    auto id1 = ep->Post(b1);
    auto id2 = ep->Post(b2);  // two batches outstanding at once
    RequireOk(id1.status());
    RequireOk(id2.status());
    RequireOk(ep->Wait(*id2, kTimeout));
    RequireOk(ep->Wait(*id1, kTimeout));

    const auto got = peer.Checksums();
    for (const auto& n : all) {
      INFO(step << " " << n << " (" << peer.param(n).bytes << " B)");
      const std::string want = PatternSha256(SeedOf(step, n), peer.param(n).bytes);
      CHECK(want != initial.at(n));
      CHECK(got.at(n) == want);
    }
    CHECK(got.at("untouched.a") == initial.at("untouched.a"));
    CHECK(got.at("untouched.b") == initial.at("untouched.b"));
  }
}

TEST_CASE("a write outside every registered buffer is refused before sending; the peer's own rejection",
          "[mooncake][errors]") {
  Peer peer(Layout({{{"w", 4096, 2}}, {{"x", 100, 1}}}));
  const auto [base, len] = peer.regions()[1];
  const std::string addr_hex = absl::StrFormat("0x%x", base + len - 16);
  const auto initial = peer.Checksums("initial");

  std::vector<uint8_t> bytes(64, 0x5A);
  {
    auto t = MakeMooncake();
    auto ep = ConnectTo(*t, peer.session_id());
    auto src = t->RegisterMemory(bytes.data(), bytes.size());
    RequireOk(src.status());
    auto past_end = ImportRange(*t, peer.session_id(), base + len - 16, 17);  // 1 byte past the buffer
    WriteRequest w{src->get(), 0, past_end.get(), 0, 17};
    auto id = ep->Post({&w, 1});
    INFO(id.status().ToString());
    REQUIRE(id.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(absl::StrContains(id.status().message(), peer.session_id()));
    CHECK(absl::StrContains(id.status().message(), addr_hex));
    CHECK(absl::StrContains(id.status().message(), "+17 B"));

    // Refused before anything was sent: the endpoint is still good.
    auto x = ImportRange(*t, peer.session_id(), peer.param("x").ptr, 100);
    WriteRequest ok{src->get(), 0, x.get(), 0, 64};
    RequireOk(ep->Write({&ok, 1}, kTimeout));

    // A region on another session is not this endpoint's.
    auto other = ImportRange(*t, "127.0.0.1:1", peer.param("x").ptr, 100);
    WriteRequest wrong{src->get(), 0, other.get(), 0, 8};
    CHECK(ep->Post({&wrong, 1}).status().code() == absl::StatusCode::kInvalidArgument);
  }
  {
    // With the check off, the request reaches the peer, which answers status 1 and closes.
    auto t = MakeMooncake(1 << 20, /*check_peer_buffers=*/false);
    auto ep = ConnectTo(*t, peer.session_id());
    auto src = t->RegisterMemory(bytes.data(), bytes.size());
    RequireOk(src.status());
    auto past_end = ImportRange(*t, peer.session_id(), base + len - 16, 17);
    WriteRequest w{src->get(), 0, past_end.get(), 0, 17};
    absl::Status s = ep->Write({&w, 1}, kTimeout);
    INFO(s.ToString());
    CHECK(s.code() == absl::StatusCode::kFailedPrecondition);
    CHECK(absl::StrContains(s.message(), "address rejected"));
    CHECK(absl::StrContains(s.message(), peer.session_id()));
    CHECK(absl::StrContains(s.message(), addr_hex));
    CHECK(absl::StrContains(s.message(), "+17 B"));
    CHECK(!ep->Post({&w, 1}).ok());  // the endpoint is done after an error
  }
  const auto got = peer.Checksums();
  CHECK(got.at("w") == initial.at("w"));
}

TEST_CASE("descriptors and session ids: malformed ones are rejected", "[mooncake][errors]") {
  auto t = MakeMooncake();
  CHECK(!t->ImportRegion("").ok());
  CHECK(!t->ImportRegion("garbage").ok());
  CHECK(!t->ImportRegion("mooncake/1 127.0.0.1:15000 0x1000").ok());
  CHECK(!t->ImportRegion("mooncake/1 127.0.0.1:15000 4096 10").ok());
  CHECK(!mooncake::MakeRegionDescriptor("127.0.0.1", 0x1000, 10).ok());
  CHECK(!mooncake::MakeRegionDescriptor("127.0.0.1:15000", 0x1000, 0).ok());
  CHECK(!mooncake::MakeRegionDescriptor("127.0.0.1:15000", ~0ull - 4, 10).ok());
  auto d = mooncake::MakeRegionDescriptor("127.0.0.1:15000", 0x7fc324ccf000, 353280);
  RequireOk(d.status());
  CHECK(*d == "mooncake/1 127.0.0.1:15000 0x7fc324ccf000 353280");
  auto r = t->ImportRegion(*d);
  RequireOk(r.status());
  CHECK((*r)->length() == 353280);
  auto v6 = mooncake::ParseSessionId("[::1]:15001");
  RequireOk(v6.status());
  CHECK(v6->host == "::1");
  CHECK(v6->port == 15001);
  // The backend only writes: its own regions have no descriptor.
  uint8_t b[8];
  auto local = t->RegisterMemory(b, sizeof(b));
  RequireOk(local.status());
  CHECK((*local)->Descriptor().empty());
  CHECK(!t->ImportRegion((*local)->Descriptor()).ok());
}

TEST_CASE("a wrong session port is a clear Unavailable", "[mooncake][errors]") {
  int port = 0;
  {
    auto l = tcp::Listen("127.0.0.1", 0, &port);  // a port nobody listens on once this closes
    REQUIRE(l.ok());
  }
  auto t = MakeMooncake();
  auto ep = t->CreateEndpoint();
  RequireOk(ep.status());
  const std::string session = absl::StrCat("127.0.0.1:", port);
  absl::Status s = (*ep)->Connect(session, absl::Seconds(5));
  INFO(s.ToString());
  CHECK(s.code() == absl::StatusCode::kUnavailable);
  CHECK(absl::StrContains(s.message(), session));
  CHECK(absl::StrContains(s.message(), "handshake"));
}

TEST_CASE("the peer killed mid-run: Unavailable naming the peer, never a hang", "[mooncake][errors]") {
  Peer peer(Layout({{{"huge", 16 << 20, 2}}}));  // 32 MiB
  const Param& p = peer.param("huge");
  auto t = MakeMooncake(4 << 20);
  auto ep = ConnectTo(*t, peer.session_id());
  std::vector<uint8_t> bytes(p.bytes, 0x11);
  auto src = t->RegisterMemory(bytes.data(), bytes.size());
  RequireOk(src.status());
  auto dst = ImportRange(*t, peer.session_id(), p.ptr, p.bytes);
  WriteRequest w{src->get(), 0, dst.get(), 0, p.bytes};
  RequireOk(ep->Write({&w, 1}, kTimeout));  // connections are open and pooled now

  std::vector<WriteRequest> many(40, w);  // ~1.3 GB: still running when the peer dies
  auto id = ep->Post(many);
  RequireOk(id.status());
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  peer.Kill();
  absl::Status s = ep->Wait(*id, kTimeout);
  INFO("batch in flight when the peer died: " << s.ToString());
  CHECK(s.code() != absl::StatusCode::kDeadlineExceeded);
  if (!s.ok()) {
    CHECK(s.code() == absl::StatusCode::kUnavailable);
    CHECK(absl::StrContains(s.message(), peer.session_id()));
  }
  // Whatever the race above did, the next write fails Unavailable, naming the peer.
  absl::StatusOr<BatchId> next = ep->Post({&w, 1});
  absl::Status s2 = next.ok() ? ep->Wait(*next, kTimeout) : next.status();
  INFO("after the peer died: " << s2.ToString());
  CHECK(s2.code() == absl::StatusCode::kUnavailable);
  CHECK(absl::StrContains(s2.message(), peer.session_id()));
}

// The pinned engine always answers version 2, so the refusal of an older one is shown with a one-shot stand-in
// for the handshake port that replays the captured reply with the version field changed.
TEST_CASE("a peer whose tcp data protocol is not version 2 is refused at Connect", "[mooncake][errors]") {
  for (const std::string version_field : {"", ",\"tcp_proto_version\":1", ",\"tcp_proto_version\":3"}) {
    int port = 0;
    auto l = tcp::Listen("127.0.0.1", 0, &port);
    REQUIRE(l.ok());
    const std::string session = absl::StrCat("127.0.0.1:", port);
    std::thread server([&] {
      tcp::Fd c(::accept(l->get(), nullptr, nullptr));
      uint64_t len = 0;
      if (!tcp::RecvAll(c.get(), &len, 8).ok() || len > 4096) return;
      std::string req(len, '\0');
      if (!tcp::RecvAll(c.get(), req.data(), len).ok()) return;
      const std::string json_text =
          absl::StrCat("{\"buffers\":[{\"addr\":140476112760832,\"length\":353280,\"name\":\"", session,
                       "\"}],\"name\":\"", session, "\",\"protocol\":\"tcp\",\"tcp_data_port\":15334",
                       version_field, "}\n");
      std::string frame = std::string(1, '\x01') + json_text;
      uint64_t n = frame.size();
      iovec iov[2] = {{&n, 8}, {frame.data(), frame.size()}};
      tcp::SendAll(c.get(), iov, 2).IgnoreError();
    });
    auto t = MakeMooncake();
    auto ep = t->CreateEndpoint();
    RequireOk(ep.status());
    absl::Status s = (*ep)->Connect(session, absl::Seconds(5));
    server.join();
    INFO(version_field << ": " << s.ToString());
    CHECK(s.code() == absl::StatusCode::kFailedPrecondition);
    CHECK(absl::StrContains(s.message(), "version"));
    CHECK(absl::StrContains(s.message(), session));
  }
}

namespace {

const absl::Status kCancelReason = absl::AbortedError("update 7 aborted: node n1 lost its lease");

void CheckCancelReason(const absl::Status& s) {
  INFO(s.ToString());
  CHECK(s.code() == absl::StatusCode::kAborted);
  CHECK(absl::StrContains(s.message(), "node n1 lost its lease"));
}

// Cancels `ep` from another thread `after` from now; *at: when it was called.
std::thread CancelLater(Endpoint& ep, absl::Duration after, absl::Time* at) {
  return std::thread([&ep, after, at] {
    absl::SleepFor(after);
    *at = absl::Now();
    ep.Cancel(kCancelReason);
  });
}

}  // namespace

TEST_CASE("Cancel during a large batch to the real peer: the Wait returns at once with the reason, the endpoint "
          "refuses more, a new one lands the bytes", "[mooncake][cancel]") {
  Peer peer(Layout({{{"huge", 16 << 20, 2}}}));  // 32 MiB
  const Param& p = peer.param("huge");
  auto t = MakeMooncake(4 << 20);
  auto ep = ConnectTo(*t, peer.session_id());
  Source src = MakeSource(*t, peer, {"huge"}, "after-cancel");
  std::vector<uint8_t> other(p.bytes, 0x11);
  auto other_region = t->RegisterMemory(other.data(), other.size());
  RequireOk(other_region.status());
  auto dst = ImportRange(*t, peer.session_id(), p.ptr, p.bytes);
  WriteRequest w{other_region->get(), 0, dst.get(), 0, p.bytes};
  RequireOk(ep->Write({&w, 1}, kTimeout));  // connections are open and pooled now

  std::vector<WriteRequest> many(40, w);  // ~1.3 GB: still running when the Cancel comes
  auto id = ep->Post(many);
  RequireOk(id.status());
  absl::Time cancelled_at;
  std::thread canceller = CancelLater(*ep, absl::Milliseconds(50), &cancelled_at);
  absl::Status s = ep->Wait(*id, kTimeout);  // concurrent with the Cancel
  const absl::Time returned = absl::Now();
  canceller.join();
  CheckCancelReason(s);
  CHECK(absl::StrContains(s.message(), peer.session_id()));
  WARN("the batch failed " << absl::FormatDuration(returned - cancelled_at) << " after the Cancel");
  CHECK(returned - cancelled_at < absl::Seconds(1));

  auto again = ep->Post({&w, 1});
  CheckCancelReason(again.status());
  CHECK(absl::StrContains(again.status().message(), "re-create"));
  ep->Cancel(absl::InternalError("a second reason"));  // later calls change nothing
  CheckCancelReason(ep->Post({&w, 1}).status());
  // Requests that were on the wire end on their worker threads; destruction does not wait on the peer.
  const absl::Time d0 = absl::Now();
  ep.reset();
  CHECK(absl::Now() - d0 < absl::Seconds(2));

  // A new endpoint to the same peer lands a full write: the peer's memory is checked against the pattern.
  auto fresh = ConnectTo(*t, peer.session_id());
  WriteRequest last{src.region.get(), src.offset["huge"], dst.get(), 0, p.bytes};
  RequireOk(fresh->Write({&last, 1}, kTimeout));
  CHECK(peer.Checksums().at("huge") == PatternSha256(SeedOf("after-cancel", "huge"), p.bytes));
}

namespace {

// A stand-in for a peer that stopped reading (its host hangs, its link is gone): its handshake port answers one
// Metadata request with a buffer at kStalledBase and a data port whose connections complete in the backlog and are
// never read.
constexpr uint64_t kStalledBase = 0x7f0000000000ull;
constexpr uint64_t kStalledLen = 64 << 20;

struct StalledSession {
  StalledSession() {
    data = tcp::Listen("127.0.0.1", 0, &data_port);
    REQUIRE(data.ok());
    handshake = tcp::Listen("127.0.0.1", 0, &port);
    REQUIRE(handshake.ok());
    session = absl::StrCat("127.0.0.1:", port);
    server = std::thread([this] {
      tcp::Fd c(::accept(handshake->get(), nullptr, nullptr));
      uint64_t len = 0;
      if (!tcp::RecvAll(c.get(), &len, 8).ok() || len > 4096) return;
      std::string req(len, '\0');
      if (!tcp::RecvAll(c.get(), req.data(), len).ok()) return;
      const std::string json_text = absl::StrCat(
          "{\"buffers\":[{\"addr\":", kStalledBase, ",\"length\":", kStalledLen, "}],\"name\":\"", session,
          "\",\"protocol\":\"tcp\",\"tcp_proto_version\":2,\"tcp_data_port\":", data_port, "}\n");
      std::string frame = std::string(1, '\x01') + json_text;
      uint64_t n = frame.size();
      iovec iov[2] = {{&n, 8}, {frame.data(), frame.size()}};
      tcp::SendAll(c.get(), iov, 2).IgnoreError();
    });
  }
  ~StalledSession() {
    if (server.joinable()) server.join();
  }
  std::unique_ptr<Endpoint> Connect(Transport& t) {
    auto ep = ConnectTo(t, session);
    server.join();
    return ep;
  }

  int data_port = 0;
  int port = 0;
  absl::StatusOr<tcp::Fd> data, handshake;
  std::string session;
  std::thread server;
};

}  // namespace

// A peer that stops reading is what Cancel is for: the workers are blocked in send.
TEST_CASE("Cancel releases a batch blocked on a peer that stopped reading, and the endpoint's workers",
          "[mooncake][cancel]") {
  StalledSession stalled;
  const std::string session = stalled.session;
  constexpr uint64_t kBase = kStalledBase;
  constexpr uint64_t kLen = kStalledLen;
  TransportOptions opts;
  opts.io_timeout = absl::Seconds(60);  // without Cancel the batch would hang this long
  auto t = mooncake::CreateMooncakeTransport(opts, {});
  RequireOk(t.status());
  auto ep = stalled.Connect(**t);
  std::vector<uint8_t> bytes(kLen, 0x22);
  auto src = (*t)->RegisterMemory(bytes.data(), bytes.size());
  RequireOk(src.status());
  auto dst = ImportRange(**t, session, kBase, kLen);
  WriteRequest w{src->get(), 0, dst.get(), 0, kLen};
  auto id = ep->Post({&w, 1});
  RequireOk(id.status());
  CHECK(ep->Wait(*id, absl::Milliseconds(300)).code() == absl::StatusCode::kDeadlineExceeded);
  auto id2 = ep->Post({&w, 1});  // queued behind the blocked requests
  RequireOk(id2.status());

  absl::Time cancelled_at;
  std::thread canceller = CancelLater(*ep, absl::Milliseconds(200), &cancelled_at);
  absl::Status s = ep->Wait(*id, kTimeout);
  const absl::Time returned = absl::Now();
  canceller.join();
  CheckCancelReason(s);
  CHECK(absl::StrContains(s.message(), session));
  WARN("the blocked batch failed " << absl::FormatDuration(returned - cancelled_at) << " after the Cancel");
  CHECK(returned - cancelled_at < absl::Seconds(1));
  CheckCancelReason(ep->Wait(*id2, kTimeout));
  CheckCancelReason(ep->Post({&w, 1}).status());
  // The workers were blocked in send: the shut-down connections release them, so destruction is prompt (and no
  // worker reconnects after the Cancel).
  const absl::Time d0 = absl::Now();
  ep.reset();
  CHECK(absl::Now() - d0 < absl::Seconds(2));
}

// Without a Cancel, the i/o timeout fails the stalled batch with a terminal code: Unavailable naming the peer, never
// DeadlineExceeded, which Wait's contract (transport.h) reserves for a batch still outstanding.
TEST_CASE("a peer that stopped reading fails the batch at the i/o timeout: Unavailable naming it, not outstanding",
          "[mooncake][errors]") {
  StalledSession stalled;
  TransportOptions opts;
  opts.io_timeout = absl::Seconds(1);
  auto t = mooncake::CreateMooncakeTransport(opts, {});
  RequireOk(t.status());
  auto ep = stalled.Connect(**t);
  std::vector<uint8_t> bytes(kStalledLen, 0x33);
  auto src = (*t)->RegisterMemory(bytes.data(), bytes.size());
  RequireOk(src.status());
  auto dst = ImportRange(**t, stalled.session, kStalledBase, kStalledLen);
  WriteRequest w{src->get(), 0, dst.get(), 0, kStalledLen};
  auto id = ep->Post({&w, 1});
  RequireOk(id.status());
  const absl::Time t0 = absl::Now();
  const absl::Status s = ep->Wait(*id, absl::Seconds(20));
  INFO(s.ToString() << " after " << absl::FormatDuration(absl::Now() - t0));
  CHECK(s.code() == absl::StatusCode::kUnavailable);
  CHECK(absl::StrContains(s.message(), stalled.session));
  CHECK(absl::Now() - t0 < absl::Seconds(10));
  CHECK(ep->Wait(*id, absl::ZeroDuration()).code() == absl::StatusCode::kNotFound);  // answered: not outstanding
}

// ---- protocol rdma: the real engine initialized with "rdma" on a soft-RoCE device, inside the VM
// (tests/transport/run_in_rxe_vm.sh sets RXE_DEV / RXE_IP). Hidden tag: run with "[rdma]".

namespace {

struct RxeEnv {
  std::string dev, ip;
};

RxeEnv Rxe() {
  const char* dev = std::getenv("RXE_DEV");
  const char* ip = std::getenv("RXE_IP");
  INFO("the [rdma] cases run inside the soft-RoCE VM (CTest transport_mooncake_rdma_vm_test), which sets RXE_DEV and "
       "RXE_IP");
  REQUIRE(dev != nullptr);
  REQUIRE(ip != nullptr);
  return {dev, ip};
}

std::vector<std::string> RdmaPeerArgs(const RxeEnv& e) {
  return {"--protocol", "rdma", "--device", e.dev, "--local-ip", e.ip};
}

std::unique_ptr<Transport> MakeMooncakeRdma(const RxeEnv& e, int qps = 2) {
  TransportOptions opts;
  opts.io_timeout = absl::Seconds(20);
  opts.devices = {e.dev};
  mooncake::MooncakeOptions m;
  m.protocol = "rdma";
  m.rdma_qps = qps;
  auto t = mooncake::CreateMooncakeTransport(opts, m);
  RequireOk(t.status());
  INFO((*t)->reason());
  REQUIRE((*t)->viable());
  return std::move(*t);
}

}  // namespace

TEST_CASE("rdma: RC WRITEs land in the real Mooncake peer (rdma protocol), per-parameter and whole-buffer, twice",
          "[.rdma]") {
  const RxeEnv e = Rxe();
  Peer peer(Layout({{{"big", 1'500'001, 2}, {"tiny", 3, 2}, {"mid", 64 * 192, 2}, {"untouched.a", 1000, 4}},
                    {{"o_proj", 64 * 64, 2}, {"untouched.b", 77, 2}, {"gate_up", 2 * 256 * 64, 2},
                     {"norm", 64, 4}}}),
            RdmaPeerArgs(e));
  auto t = MakeMooncakeRdma(e);
  CHECK(absl::StrContains(t->reason(), "rdma"));
  auto ep = ConnectTo(*t, peer.session_id());
  CHECK(absl::StrContains(ep->PeerName(), absl::StrCat(peer.session_id(), "@", e.dev)));

  const std::vector<std::string> per_param = {"big", "tiny", "mid"};
  const std::vector<std::string> in_buffer = {"o_proj", "gate_up", "norm"};
  std::map<std::string, std::unique_ptr<RemoteRegion>> dst;
  for (const auto& n : per_param) dst[n] = ImportRange(*t, peer.session_id(), peer.param(n).ptr, peer.param(n).bytes);
  REQUIRE(peer.regions().size() == 2);
  const auto [buf1, buf1_len] = peer.regions()[1];
  auto whole1 = ImportRange(*t, peer.session_id(), buf1, buf1_len);
  const auto initial = peer.Checksums("initial");
  REQUIRE(peer.Checksums() == initial);
  std::vector<std::string> all = per_param;
  all.insert(all.end(), in_buffer.begin(), in_buffer.end());

  for (const std::string step : {"step1", "step2"}) {  // the second update reuses the connected queue pairs
    Source src = MakeSource(*t, peer, all, step);
    std::vector<WriteRequest> b1, b2;
    uint64_t bytes = 0;
    for (const auto& n : per_param) {
      b1.push_back({src.region.get(), src.offset[n], dst[n].get(), 0, peer.param(n).bytes});
      bytes += peer.param(n).bytes;
    }
    for (const auto& n : in_buffer) {
      const Param& p = peer.param(n);
      b2.push_back({src.region.get(), src.offset[n], whole1.get(), p.ptr - buf1, p.bytes});
      bytes += p.bytes;
    }
    b2.push_back({src.region.get(), 0, whole1.get(), 0, 0});  // zero-length: completes locally
    const absl::Time t0 = absl::Now();
    auto id1 = ep->Post(b1);
    auto id2 = ep->Post(b2);
    RequireOk(id1.status());
    RequireOk(id2.status());
    RequireOk(ep->Wait(*id2, kTimeout));
    RequireOk(ep->Wait(*id1, kTimeout));
    const double secs = absl::ToDoubleSeconds(absl::Now() - t0);
    std::printf("mooncake rdma %s: %llu bytes in %.3f s (%.1f MB/s, soft-RoCE under emulation)\n", step.c_str(),
                static_cast<unsigned long long>(bytes), secs, bytes / secs / 1e6);

    const auto got = peer.Checksums();
    for (const auto& n : all) {
      INFO(step << " " << n << " (" << peer.param(n).bytes << " B)");
      CHECK(got.at(n) == PatternSha256(SeedOf(step, n), peer.param(n).bytes));
    }
    CHECK(got.at("untouched.a") == initial.at("untouched.a"));
    CHECK(got.at("untouched.b") == initial.at("untouched.b"));
  }
}

TEST_CASE("rdma: refusals before and during the queue-pair exchange; a dead peer fails, never hangs", "[.rdma]") {
  const RxeEnv e = Rxe();
  Peer peer(Layout({{{"w", 4096, 2}}}), RdmaPeerArgs(e));
  const Param& p = peer.param("w");

  SECTION("a tcp-configured transport against an rdma engine says which protocol the engine runs") {
    auto t = MakeMooncake();
    auto ep = t->CreateEndpoint();
    RequireOk(ep.status());
    absl::Status s = (*ep)->Connect(peer.session_id(), absl::Seconds(20));
    INFO(s.ToString());
    CHECK(s.code() == absl::StatusCode::kFailedPrecondition);
    CHECK(absl::StrContains(s.message(), "protocol \"rdma\""));
  }
  SECTION("a queue-pair count the engine does not use is refused by the engine, its reason surfaced") {
    auto t = MakeMooncakeRdma(e, /*qps=*/1);
    auto ep = t->CreateEndpoint();
    RequireOk(ep.status());
    absl::Status s = (*ep)->Connect(peer.session_id(), absl::Seconds(20));
    INFO(s.ToString());
    CHECK(s.code() == absl::StatusCode::kFailedPrecondition);
    CHECK(absl::StrContains(s.message(), "refused the queue-pair exchange"));
    CHECK(absl::StrContains(s.message(), "QP count mismatch"));
  }
  SECTION("outside every registered buffer: refused before anything is posted; then the peer dies") {
    auto t = MakeMooncakeRdma(e);
    auto ep = ConnectTo(*t, peer.session_id());
    std::vector<uint8_t> bytes(p.bytes + 64, 0x5a);
    auto src = t->RegisterMemory(bytes.data(), bytes.size());
    RequireOk(src.status());
    auto past = ImportRange(*t, peer.session_id(), p.ptr, p.bytes + 4096);
    WriteRequest bad{src->get(), 0, past.get(), 0, 16};
    auto id = ep->Post({&bad, 1});
    INFO(id.status().ToString());
    CHECK(id.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(absl::StrContains(id.status().message(), "outside every one"));

    auto dst = ImportRange(*t, peer.session_id(), p.ptr, p.bytes);
    WriteRequest w{src->get(), 0, dst.get(), 0, p.bytes};
    RequireOk(ep->Write({&w, 1}, kTimeout));
    CHECK(peer.Checksums().at("w") != peer.Checksums("initial").at("w"));
    peer.Kill();
    const absl::Time t0 = absl::Now();
    absl::Status s = ep->Write({&w, 1}, kTimeout);
    INFO(s.ToString());
    CHECK(!s.ok());
    CHECK(s.code() != absl::StatusCode::kDeadlineExceeded);
    CHECK(absl::StrContains(s.message(), peer.session_id()));
    CHECK(absl::Now() - t0 < absl::Seconds(30));
  }
}

TEST_CASE("rdma: Cancel during a large batch to the real peer returns at once with the reason; a new endpoint "
          "lands the bytes", "[.rdma]") {
  const RxeEnv e = Rxe();
  // Small parameters (the peer fills them in Python inside the emulated guest); the batch writes "huge" 8 times over:
  // 32 MiB, ~1 s of soft-RoCE under emulation. "check" is what the new endpoint writes afterwards.
  Peer peer(Layout({{{"huge", 2 << 20, 2}, {"check", 256 << 10, 2}}}), RdmaPeerArgs(e));
  const Param& p = peer.param("huge");
  const Param& c = peer.param("check");
  auto t = MakeMooncakeRdma(e);
  auto ep = ConnectTo(*t, peer.session_id());
  Source src = MakeSource(*t, peer, {"check"}, "after-cancel");
  std::vector<uint8_t> other(p.bytes, 0x11);
  auto other_region = t->RegisterMemory(other.data(), other.size());
  RequireOk(other_region.status());
  auto dst = ImportRange(*t, peer.session_id(), p.ptr, p.bytes);
  std::vector<WriteRequest> pieces;
  // 64 KiB pieces: 2 MiB per linked list. rxe sends a list inside ibv_post_send, in the kernel, which the guest's one
  // emulated CPU does not leave for the cancelling thread: a list is how late a Cancel can be noticed there.
  for (int round = 0; round < 8; ++round) {
    for (uint64_t off = 0; off < p.bytes; off += 64 << 10) {
      pieces.push_back({other_region->get(), off, dst.get(), off, std::min<uint64_t>(64 << 10, p.bytes - off)});
    }
  }

  // The Cancel comes during the Post or the Wait.
  absl::Time cancelled_at;
  std::thread canceller = CancelLater(*ep, absl::Milliseconds(100), &cancelled_at);
  auto id = ep->Post(pieces);
  absl::Status s = id.ok() ? ep->Wait(*id, kTimeout) : id.status();
  const absl::Time returned = absl::Now();
  canceller.join();
  CheckCancelReason(s);
  WARN("the batch failed " << absl::FormatDuration(returned - cancelled_at) << " after the Cancel");
  CHECK(returned - cancelled_at < absl::Seconds(1));
  CheckCancelReason(ep->Post(pieces).status());
  ep.reset();

  auto fresh = ConnectTo(*t, peer.session_id());
  auto check = ImportRange(*t, peer.session_id(), c.ptr, c.bytes);
  WriteRequest last{src.region.get(), src.offset["check"], check.get(), 0, c.bytes};
  RequireOk(fresh->Write({&last, 1}, kTimeout));
  CHECK(peer.Checksums().at("check") == PatternSha256(SeedOf("after-cancel", "check"), c.bytes));
}
