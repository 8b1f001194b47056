// The fabric backend beyond the conformance suite: what the receiving provider refuses (a write past the registered
// memory, into a source's memory, through a closed window, outside a grant or after its revocation), blobs of
// another transport or provider, a missing provider or library, and the fallback list. Every refused write is
// checked against the receiver's memory as the test reads it: unchanged.

#include <rdma/fabric.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "tests/transport/fabric_test_util.h"
#include "tests/transport/pattern.h"
#include "tests/transport/peer_process.h"
#include "transport/fabric/fabric_transport.h"
#include "transport/fabric/fabric_wire.h"
#include "transport/transport.h"

namespace {

using wsync::transport::Endpoint;
using wsync::transport::LocalRegion;
using wsync::transport::RemoteRegion;
using wsync::transport::Transport;
using wsync::transport::WriteRequest;
using wsync::transport::fabric::testing::MakeFabric;
using wsync::transport::testing::PatternByte;

const absl::Duration kTimeout = absl::Seconds(20);
// A refused write: tcp;ofi_rxm and sockets fail it at once; a provider that drops it silently (shm) leaves the
// batch outstanding, which this bound turns into DeadlineExceeded.
const absl::Duration kRefusedTimeout = absl::Seconds(5);
constexpr uint64_t kLen = 64 << 10;
constexpr uint8_t kUntouched = 0xEE;

std::unique_ptr<Transport> Viable() {
  auto t = MakeFabric();
  INFO(t->reason());
  REQUIRE(t->viable());
  return t;
}

struct Buffer {
  std::vector<uint8_t> bytes;
  std::unique_ptr<LocalRegion> region;
};

Buffer Source(Transport& t, uint64_t seed) {
  Buffer b;
  b.bytes.resize(kLen);
  for (uint64_t i = 0; i < kLen; ++i) b.bytes[i] = PatternByte(seed, i);
  auto r = t.RegisterMemory(b.bytes.data(), kLen);
  REQUIRE(r.ok());
  b.region = std::move(*r);
  return b;
}

Buffer Target(Transport& t, uint64_t len = kLen) {
  Buffer b;
  b.bytes.assign(len, kUntouched);
  auto r = t.RegisterMemory(b.bytes.data(), len);
  REQUIRE(r.ok());
  b.region = std::move(*r);
  return b;
}

bool Untouched(const std::vector<uint8_t>& v) {
  for (uint8_t b : v)
    if (b != kUntouched) return false;
  return true;
}

bool HoldsPattern(const uint8_t* p, uint64_t n, uint64_t seed) {
  for (uint64_t i = 0; i < n; ++i)
    if (p[i] != PatternByte(seed, i)) return false;
  return true;
}

std::unique_ptr<RemoteRegion> Import(Transport& t, const std::string& desc) {
  auto r = t.ImportRegion(desc);
  INFO(r.status().ToString());
  REQUIRE(r.ok());
  return std::move(*r);
}

// Connects a sender's endpoint to `dst` (a receiver's endpoint, plain or granted).
std::unique_ptr<Endpoint> ConnectTo(Transport& sender, Endpoint& dst) {
  auto src = sender.CreateEndpoint();
  REQUIRE(src.ok());
  absl::Status a = dst.Connect((*src)->LocalInfo(), kTimeout);
  absl::Status b = (*src)->Connect(dst.LocalInfo(), kTimeout);
  INFO(a.ToString() << " / " << b.ToString());
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  return std::move(*src);
}

absl::Status WriteAll(Endpoint& ep, const LocalRegion& src, const RemoteRegion& dst, absl::Duration timeout) {
  WriteRequest w{&src, 0, &dst, 0, kLen};
  return ep.Write({&w, 1}, timeout);
}

// A refused write fails (never reported as landed) with a status naming the peer.
void RequireRefused(const absl::Status& s, const Endpoint& ep) {
  INFO(s.ToString());
  REQUIRE_FALSE(s.ok());
  if (s.code() != absl::StatusCode::kDeadlineExceeded) CHECK(absl::StrContains(s.message(), ep.PeerName()));
}

}  // namespace

TEST_CASE("the provider negotiated is the one asked for, with RMA", "[fabric]") {
  auto t = Viable();
  auto info = wsync::transport::fabric::GetFabricInfo(*t);
  REQUIRE(info.has_value());
  INFO(info->provider << " mr_mode " << info->mr_mode);
  CHECK(info->provider == wsync::transport::fabric::testing::TestProvider());
  CHECK(info->tx_depth >= 1);
  CHECK(info->max_piece >= 1);
  // ofi_rxm with a shared receive context (libfabric 1.17's connection teardown crashes without one on verbs).
  const char* srx = std::getenv("FI_OFI_RXM_USE_SRX");
  REQUIRE(srx != nullptr);
  CHECK(std::string(srx) == "1");
  // What the forced run asked for is what the backend honours.
  if (const char* f = std::getenv("WSYNC_FABRIC_FORCE_MR_MODE"); f != nullptr && *f != '\0') {
    auto bits = wsync::transport::fabric::ParseForcedMrMode(f);
    REQUIRE(bits.ok());
    CHECK((info->mr_mode & *bits) == *bits);
    CHECK(info->app_keys == !absl::StrContains(f, "prov_key"));
  }
}

TEST_CASE("a write past the registered memory is refused by the receiving provider", "[fabric][errors]") {
  auto sender = Viable();
  auto receiver = Viable();
  Buffer src = Source(*sender, 1);
  // Only the first half of the receiver's buffer is registered; a descriptor claiming the whole buffer is forged.
  std::vector<uint8_t> mem(2 * kLen, kUntouched);
  auto half = receiver->RegisterMemory(mem.data(), kLen);
  REQUIRE(half.ok());
  auto desc = wsync::transport::fabric::DecodeRegionDesc((*half)->Descriptor());
  REQUIRE(desc.ok());
  desc->length = 2 * kLen;
  auto forged = Import(*sender, wsync::transport::fabric::EncodeRegionDesc(*desc));
  auto rx = receiver->CreateEndpoint();
  REQUIRE(rx.ok());
  auto ep = ConnectTo(*sender, **rx);
  // The sender's own bounds check passes (the forged length); the receiver's provider refuses the range.
  WriteRequest w{src.region.get(), 0, forged.get(), kLen, kLen};
  RequireRefused(ep->Write({&w, 1}, kRefusedTimeout), *ep);
  CHECK(Untouched(mem));
}

TEST_CASE("a source's memory is read-only for peers", "[fabric][errors]") {
  auto sender = Viable();
  auto receiver = Viable();
  Buffer src = Source(*sender, 2);
  std::vector<uint8_t> replica(kLen, kUntouched);
  auto ro = receiver->RegisterSourceMemory(replica.data(), kLen);
  REQUIRE(ro.ok());
  auto remote = Import(*sender, (*ro)->Descriptor());
  auto rx = receiver->CreateEndpoint();
  REQUIRE(rx.ok());
  auto ep = ConnectTo(*sender, **rx);
  RequireRefused(WriteAll(*ep, *src.region, *remote, kRefusedTimeout), *ep);
  CHECK(Untouched(replica));
}

TEST_CASE("the write window: closed refuses, re-opened lands under the same descriptor", "[fabric][window]") {
  auto sender = Viable();
  auto receiver = Viable();
  auto info = wsync::transport::fabric::GetFabricInfo(*receiver);
  REQUIRE(info.has_value());
  Buffer src = Source(*sender, 3);
  Buffer dst = Target(*receiver);
  auto remote = Import(*sender, dst.region->Descriptor());
  if (!info->app_keys) {
    // The provider picks keys: re-registering on open would change them, so the window is not enforced.
    absl::Status s = receiver->SetWriteWindow(false);
    INFO(s.ToString());
    CHECK(s.code() == absl::StatusCode::kUnimplemented);
    CHECK(absl::StrContains(s.message(), info->provider));
    auto rx = receiver->CreateEndpoint();
    REQUIRE(rx.ok());
    auto ep = ConnectTo(*sender, **rx);
    REQUIRE(WriteAll(*ep, *src.region, *remote, kTimeout).ok());
    CHECK(HoldsPattern(dst.bytes.data(), kLen, 3));
    return;
  }
  auto rx = receiver->CreateEndpoint();
  REQUIRE(rx.ok());
  auto ep = ConnectTo(*sender, **rx);
  REQUIRE(receiver->SetWriteWindow(true).ok());
  REQUIRE(WriteAll(*ep, *src.region, *remote, kTimeout).ok());
  CHECK(HoldsPattern(dst.bytes.data(), kLen, 3));

  std::fill(dst.bytes.begin(), dst.bytes.end(), kUntouched);
  REQUIRE(receiver->SetWriteWindow(false).ok());
  RequireRefused(WriteAll(*ep, *src.region, *remote, kRefusedTimeout), *ep);
  CHECK(Untouched(dst.bytes));

  // Re-opened: the descriptor the sender imported before still works (the same key), on a fresh connection (a
  // refused write may have cost the old one, as a NAK does on verbs).
  REQUIRE(receiver->SetWriteWindow(true).ok());
  auto rx2 = receiver->CreateEndpoint();
  REQUIRE(rx2.ok());
  auto ep2 = ConnectTo(*sender, **rx2);
  absl::Status s = WriteAll(*ep2, *src.region, *remote, kTimeout);
  INFO(s.ToString());
  REQUIRE(s.ok());
  CHECK(HoldsPattern(dst.bytes.data(), kLen, 3));
}

TEST_CASE("write grants: only the granted regions, only while the grant lives", "[fabric][grants]") {
  auto sender = Viable();
  auto receiver = Viable();
  Buffer src = Source(*sender, 4);
  Buffer granted = Target(*receiver);
  Buffer other = Target(*receiver);
  auto remote_granted = Import(*sender, granted.region->Descriptor());
  auto remote_other = Import(*sender, other.region->Descriptor());
  REQUIRE(receiver->RequireGrants(true).ok());

  SECTION("a plain connection cannot write once grants are required") {
    auto rx = receiver->CreateEndpoint();
    REQUIRE(rx.ok());
    auto ep = ConnectTo(*sender, **rx);
    RequireRefused(WriteAll(*ep, *src.region, *remote_granted, kRefusedTimeout), *ep);
    CHECK(Untouched(granted.bytes));
  }
  SECTION("a granted connection writes its regions, not others") {
    Transport::WriteGrant g{"source:train0", "engine0/0", {granted.region.get()}};
    auto rx = receiver->CreateGrantedEndpoint(g);
    INFO(rx.status().ToString());
    REQUIRE(rx.ok());
    auto ep = ConnectTo(*sender, **rx);
    REQUIRE(WriteAll(*ep, *src.region, *remote_granted, kTimeout).ok());
    CHECK(HoldsPattern(granted.bytes.data(), kLen, 4));
    absl::Status s = WriteAll(*ep, *src.region, *remote_other, kRefusedTimeout);
    RequireRefused(s, *ep);
    CHECK(Untouched(other.bytes));
  }
  SECTION("a revoked grant writes nothing more") {
    Transport::WriteGrant g{"source:train0", "engine0/0", {granted.region.get()}};
    auto rx = receiver->CreateGrantedEndpoint(g);
    REQUIRE(rx.ok());
    auto ep = ConnectTo(*sender, **rx);
    REQUIRE(WriteAll(*ep, *src.region, *remote_granted, kTimeout).ok());
    std::fill(granted.bytes.begin(), granted.bytes.end(), kUntouched);
    receiver->RevokeGrants([](const Transport::WriteGrant& w) { return w.peer != "source:train0"; });
    RequireRefused(WriteAll(*ep, *src.region, *remote_granted, kRefusedTimeout), *ep);
    CHECK(Untouched(granted.bytes));
  }
  SECTION("a grant cannot name a source's memory") {
    std::vector<uint8_t> replica(kLen);
    auto ro = receiver->RegisterSourceMemory(replica.data(), kLen);
    REQUIRE(ro.ok());
    Transport::WriteGrant g{"source:train0", "engine0/0", {ro->get()}};
    auto rx = receiver->CreateGrantedEndpoint(g);
    CHECK(rx.status().code() == absl::StatusCode::kInvalidArgument);
  }
}

namespace {

// A transport acting as if its provider required FI_MR_ENDPOINT (and FI_MR_LOCAL), as cxi does: whatever the
// run's environment forces otherwise.
std::unique_ptr<Transport> EndpointMrFabric() {
  wsync::transport::TransportOptions opts;
  opts.io_timeout = absl::Seconds(15);
  opts.fabric_provider = wsync::transport::fabric::testing::TestProvider();
  wsync::transport::fabric::FabricOptions fopts;
  fopts.force_mr_mode = "local,endpoint";
  auto t = wsync::transport::fabric::CreateFabricTransport(opts, fopts);
  REQUIRE(t.ok());
  INFO((*t)->reason());
  REQUIRE((*t)->viable());
  return std::move(*t);
}

// The per-connection key `ep`'s connection info gives for the region with descriptor `desc` (0: none).
uint64_t ConnectionKey(const Endpoint& ep, const std::string& desc) {
  auto info = wsync::transport::fabric::DecodeConnInfo(ep.LocalInfo());
  REQUIRE(info.ok());
  auto d = wsync::transport::fabric::DecodeRegionDesc(desc);
  REQUIRE(d.ok());
  for (const auto& g : info->grant)
    if (g.region_id == d->region_id) return g.key;
  return 0;
}

// Connects a fresh sender endpoint to `dst`, but writing with `key` for region `desc` (a key of another
// connection): what a peer that learned that key could do.
std::unique_ptr<Endpoint> ConnectWithKey(Transport& sender, Endpoint& dst, const std::string& desc, uint64_t key) {
  auto info = wsync::transport::fabric::DecodeConnInfo(dst.LocalInfo());
  REQUIRE(info.ok());
  auto d = wsync::transport::fabric::DecodeRegionDesc(desc);
  REQUIRE(d.ok());
  for (auto& g : info->grant)
    if (g.region_id == d->region_id) g.key = key;
  auto src = sender.CreateEndpoint();
  REQUIRE(src.ok());
  REQUIRE(dst.Connect((*src)->LocalInfo(), kTimeout).ok());
  REQUIRE((*src)->Connect(wsync::transport::fabric::EncodeConnInfo(*info), kTimeout).ok());
  return std::move(*src);
}

}  // namespace

TEST_CASE("FI_MR_ENDPOINT: every receiving endpoint writes through MRs of its own, closed with it", "[fabric][mr]") {
  auto sender = EndpointMrFabric();
  auto receiver = EndpointMrFabric();
  auto info = wsync::transport::fabric::GetFabricInfo(*receiver);
  REQUIRE(info.has_value());
  REQUIRE((info->mr_mode & FI_MR_ENDPOINT) != 0);
  Buffer src = Source(*sender, 11);
  Buffer dst = Target(*receiver);
  const std::string desc = dst.region->Descriptor();
  auto remote = Import(*sender, desc);
  auto rx1 = receiver->CreateEndpoint();
  auto rx2 = receiver->CreateEndpoint();
  REQUIRE(rx1.ok());
  REQUIRE(rx2.ok());
  // Each endpoint has its own key for the region, and neither is the descriptor's (which has no MR behind it).
  const uint64_t k1 = ConnectionKey(**rx1, desc), k2 = ConnectionKey(**rx2, desc);
  auto d = wsync::transport::fabric::DecodeRegionDesc(desc);
  REQUIRE(d.ok());
  CHECK(k1 != 0);
  CHECK(k2 != 0);
  CHECK(k1 != k2);
  CHECK(k1 != d->keys[0]);

  // A receiving endpoint takes one connection: `fresh` makes another one.
  auto fresh = [&] {
    auto rx = receiver->CreateEndpoint();
    REQUIRE(rx.ok());
    return std::move(*rx);
  };

  SECTION("writes land through each endpoint's own key; the descriptor's key alone writes nothing") {
    auto ep1 = ConnectTo(*sender, **rx1);
    REQUIRE(WriteAll(*ep1, *src.region, *remote, kTimeout).ok());
    CHECK(HoldsPattern(dst.bytes.data(), kLen, 11));
    std::fill(dst.bytes.begin(), dst.bytes.end(), kUntouched);
    auto ep2 = ConnectTo(*sender, **rx2);
    REQUIRE(WriteAll(*ep2, *src.region, *remote, kTimeout).ok());
    CHECK(HoldsPattern(dst.bytes.data(), kLen, 11));
    std::fill(dst.bytes.begin(), dst.bytes.end(), kUntouched);
    auto rx3 = fresh();
    auto bare = ConnectWithKey(*sender, *rx3, desc, d->keys[0]);
    RequireRefused(WriteAll(*bare, *src.region, *remote, kRefusedTimeout), *bare);
    CHECK(Untouched(dst.bytes));
  }
  SECTION("a destroyed endpoint's MRs are closed: its key writes nothing more") {
    // While rx1 lives its key is registered; this provider does not check the binding (FI_MR_ENDPOINT forced), one
    // that requires FI_MR_ENDPOINT refuses the key on another endpoint already.
    auto before = ConnectWithKey(*sender, **rx2, desc, k1);
    if (WriteAll(*before, *src.region, *remote, kTimeout).ok()) CHECK(HoldsPattern(dst.bytes.data(), kLen, 11));
    std::fill(dst.bytes.begin(), dst.bytes.end(), kUntouched);
    rx1->reset();
    auto rx3 = fresh();
    auto after = ConnectWithKey(*sender, *rx3, desc, k1);
    RequireRefused(WriteAll(*after, *src.region, *remote, kRefusedTimeout), *after);
    CHECK(Untouched(dst.bytes));
  }
  SECTION("a region registered after the endpoint is not writable through it") {
    Buffer late = Target(*receiver);
    auto late_remote = Import(*sender, late.region->Descriptor());
    CHECK(ConnectionKey(**rx1, late.region->Descriptor()) == 0);
    auto ep1 = ConnectTo(*sender, **rx1);
    RequireRefused(WriteAll(*ep1, *src.region, *late_remote, kRefusedTimeout), *ep1);
    CHECK(Untouched(late.bytes));
    // An endpoint made after it is.
    auto rx3 = fresh();
    auto ep3 = ConnectTo(*sender, *rx3);
    REQUIRE(WriteAll(*ep3, *src.region, *late_remote, kTimeout).ok());
    CHECK(HoldsPattern(late.bytes.data(), kLen, 11));
  }
  SECTION("the window and grant rules hold for the endpoints' MRs") {
    REQUIRE(receiver->RequireGrants(true).ok());
    auto ep1 = ConnectTo(*sender, **rx1);
    RequireRefused(WriteAll(*ep1, *src.region, *remote, kRefusedTimeout), *ep1);
    CHECK(Untouched(dst.bytes));
    REQUIRE(receiver->RequireGrants(false).ok());
    auto ep2 = ConnectTo(*sender, **rx2);
    REQUIRE(WriteAll(*ep2, *src.region, *remote, kTimeout).ok());
    CHECK(HoldsPattern(dst.bytes.data(), kLen, 11));
    if (info->app_keys) {
      std::fill(dst.bytes.begin(), dst.bytes.end(), kUntouched);
      REQUIRE(receiver->SetWriteWindow(false).ok());
      auto rx3 = fresh();
      auto ep3 = ConnectTo(*sender, *rx3);
      RequireRefused(WriteAll(*ep3, *src.region, *remote, kRefusedTimeout), *ep3);
      CHECK(Untouched(dst.bytes));
    }
  }
}

TEST_CASE("blobs of another transport or provider are refused naming both sides", "[fabric][errors]") {
  auto fabric = Viable();
  wsync::transport::TransportOptions topts;
  auto tcp = wsync::transport::CreateTransport("tcp", topts);
  REQUIRE(tcp.ok());
  auto tcp_ep = (*tcp)->CreateEndpoint();
  REQUIRE(tcp_ep.ok());
  auto ep = fabric->CreateEndpoint();
  REQUIRE(ep.ok());
  absl::Status s = (*ep)->Connect((*tcp_ep)->LocalInfo(), kTimeout);
  INFO(s.ToString());
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(s.message(), "tcp transport"));
  CHECK(absl::StrContains(s.message(), wsync::transport::fabric::testing::TestProvider()));

  std::vector<uint8_t> mem(4096);
  auto tcp_region = (*tcp)->RegisterMemory(mem.data(), mem.size());
  REQUIRE(tcp_region.ok());
  auto imported = fabric->ImportRegion((*tcp_region)->Descriptor());
  INFO(imported.status().ToString());
  CHECK(imported.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(imported.status().message(), "tcp transport"));

  // A fabric peer on another provider: the address cannot be used, and the error names both providers.
  const std::string other_provider =
      wsync::transport::fabric::testing::TestProvider() == "sockets" ? "tcp;ofi_rxm" : "sockets";
  auto other = MakeFabric(other_provider);
  REQUIRE(other->viable());
  auto other_ep = other->CreateEndpoint();
  REQUIRE(other_ep.ok());
  auto ep2 = fabric->CreateEndpoint();
  REQUIRE(ep2.ok());
  s = (*ep2)->Connect((*other_ep)->LocalInfo(), kTimeout);
  INFO(s.ToString());
  CHECK(s.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(s.message(), other_provider));
  CHECK(absl::StrContains(s.message(), wsync::transport::fabric::testing::TestProvider()));
}

TEST_CASE("a provider that is not here makes the transport not viable, naming it; the fallback list skips it",
          "[fabric][errors]") {
  auto efa = MakeFabric("efa");
  CHECK_FALSE(efa->viable());
  INFO(efa->reason());
  CHECK(absl::StrContains(efa->reason(), "\"efa\""));
  CHECK(absl::StrContains(efa->reason(), "providers present"));
  CHECK_FALSE(efa->RegisterMemory(nullptr, 0).ok());

  wsync::transport::TransportOptions opts;
  opts.fabric_provider = "efa";
  auto first = wsync::transport::CreateFirstViableTransport("fabric,tcp", opts);
  REQUIRE(first.ok());
  CHECK((*first)->name() == "tcp");
  auto only = wsync::transport::CreateFirstViableTransport("fabric", opts);
  INFO(only.status().ToString());
  CHECK(only.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(only.status().message(), "efa"));
  opts.fabric_provider = wsync::transport::fabric::testing::TestProvider();
  auto fab = wsync::transport::CreateFirstViableTransport("fabric,tcp", opts);
  REQUIRE(fab.ok());
  CHECK((*fab)->name() == "fabric");
}

// Run alone with WSYNC_FABRIC_LIB pointing at a missing file (the library is loaded once per process).
TEST_CASE("no libfabric: not viable, naming the library", "[.nolib]") {
  const char* lib = std::getenv("WSYNC_FABRIC_LIB");
  REQUIRE(lib != nullptr);
  auto t = MakeFabric();
  CHECK_FALSE(t->viable());
  INFO(t->reason());
  CHECK(absl::StrContains(t->reason(), lib));
  CHECK(absl::StrContains(t->reason(), "libfabric1"));
  wsync::transport::TransportOptions opts;
  auto tcp = wsync::transport::CreateFirstViableTransport("fabric,tcp", opts);
  REQUIRE(tcp.ok());
  CHECK((*tcp)->name() == "tcp");
}

// Run by transport_fabric_domains_netns_test inside a network namespace with two interfaces on one subnet
// (fabric_netns.sh): tcp;ofi_rxm offers one domain per interface, WSYNC_FABRIC_DOMAINS names both.
TEST_CASE("two NICs: endpoints spread over both domains, every pairing writes its bytes", "[.domains]") {
  const char* want = std::getenv("WSYNC_FABRIC_DOMAINS");
  REQUIRE(want != nullptr);
  const std::vector<std::string> domains = absl::StrSplit(want, ',');
  REQUIRE(domains.size() == 2);
  auto sender = Viable();
  auto receiver = Viable();
  for (Transport* t : {sender.get(), receiver.get()}) {
    auto info = wsync::transport::fabric::GetFabricInfo(*t);
    REQUIRE(info.has_value());
    CHECK(info->domains == domains);
  }
  constexpr int kEndpoints = 4;
  std::vector<std::unique_ptr<Endpoint>> tx, rx;
  std::vector<uint32_t> tx_dom, rx_dom;
  std::vector<std::string> tx_addr;
  for (int i = 0; i < kEndpoints; ++i) {
    auto s = sender->CreateEndpoint();
    auto r = receiver->CreateEndpoint();
    REQUIRE(s.ok());
    REQUIRE(r.ok());
    auto si = wsync::transport::fabric::DecodeConnInfo((*s)->LocalInfo());
    auto ri = wsync::transport::fabric::DecodeConnInfo((*r)->LocalInfo());
    REQUIRE(si.ok());
    REQUIRE(ri.ok());
    CHECK(si->domain == domains[si->domain_index]);
    tx_dom.push_back(si->domain_index);
    rx_dom.push_back(ri->domain_index);
    tx_addr.push_back(si->address);
    tx.push_back(std::move(*s));
    rx.push_back(std::move(*r));
  }
  // Nothing ties the memory to a NUMA node with a NIC here: the endpoints alternate between the two domains.
  CHECK(tx_dom == std::vector<uint32_t>{0, 1, 0, 1});
  CHECK(rx_dom == std::vector<uint32_t>{0, 1, 0, 1});
  // Each domain's endpoints have that interface's address (the provider binds to it).
  for (const std::string& a : tx_addr) REQUIRE(a.size() >= 8);
  CHECK(tx_addr[0].substr(4, 4) == tx_addr[2].substr(4, 4));  // sockaddr_in: sin_addr at offset 4
  CHECK(tx_addr[0].substr(4, 4) != tx_addr[1].substr(4, 4));

  // Every (sender NIC, receiver NIC) pairing once: (0,0), (1,1), (0,1), (1,0). Each writes its own quarter.
  const std::vector<std::pair<int, int>> pairs = {{0, 0}, {1, 1}, {2, 3}, {3, 2}};
  Buffer src = Source(*sender, 11);
  Buffer dst = Target(*receiver, 4 * kLen);
  auto remote = Import(*sender, dst.region->Descriptor());
  for (size_t p = 0; p < pairs.size(); ++p) {
    auto [s, r] = pairs[p];
    INFO("sender domain " << tx_dom[s] << " -> receiver domain " << rx_dom[r]);
    REQUIRE(rx[r]->Connect(tx[s]->LocalInfo(), kTimeout).ok());
    REQUIRE(tx[s]->Connect(rx[r]->LocalInfo(), kTimeout).ok());
    WriteRequest w{src.region.get(), 0, remote.get(), p * kLen, kLen};
    absl::Status st = tx[s]->Write({&w, 1}, kTimeout);
    INFO(st.ToString());
    REQUIRE(st.ok());
  }
  for (size_t p = 0; p < pairs.size(); ++p) CHECK(HoldsPattern(dst.bytes.data() + p * kLen, kLen, 11));

  // A grant is minted in the domain of its endpoint: writes through it land, and its revocation refuses them.
  REQUIRE(receiver->RequireGrants(true).ok());
  Buffer granted = Target(*receiver);
  auto remote_granted = Import(*sender, granted.region->Descriptor());
  Transport::WriteGrant g{"source:train0", "engine0/0", {granted.region.get()}};
  auto grx = receiver->CreateGrantedEndpoint(g);  // the fifth endpoint: domain 0
  REQUIRE(grx.ok());
  auto gtx = ConnectTo(*sender, **grx);  // the fifth: domain 0; the sixth would be 1
  REQUIRE(WriteAll(*gtx, *src.region, *remote_granted, kTimeout).ok());
  CHECK(HoldsPattern(granted.bytes.data(), kLen, 11));
  std::fill(granted.bytes.begin(), granted.bytes.end(), kUntouched);
  receiver->RevokeGrants([](const Transport::WriteGrant&) { return false; });
  RequireRefused(WriteAll(*gtx, *src.region, *remote_granted, kRefusedTimeout), *gtx);
  CHECK(Untouched(granted.bytes));
}

namespace {

using wsync::transport::testing::FromHex;
using wsync::transport::testing::PeerProcess;
using wsync::transport::testing::ToHex;

}  // namespace

// The receiving peer of the dead-peer test, in its own process: prints its endpoint and region, connects to the
// sender, says when the sender's pattern landed, then waits to be killed.
TEST_CASE("(peer process) a receiver that waits to be killed", "[.peer]") {
  auto t = Viable();
  std::vector<uint8_t> mem(kLen, kUntouched);
  auto region = t->RegisterMemory(mem.data(), kLen);
  REQUIRE(region.ok());
  auto ep = t->CreateEndpoint();
  REQUIRE(ep.ok());
  printf("PEER info %s\nPEER region %s\n", ToHex((*ep)->LocalInfo()).c_str(), ToHex((*region)->Descriptor()).c_str());
  fflush(stdout);
  std::string sender;
  REQUIRE(std::getline(std::cin, sender));
  REQUIRE((*ep)->Connect(FromHex(sender), kTimeout).ok());
  const volatile uint8_t* p = mem.data();
  for (;;) {
    bool landed = true;
    for (uint64_t i = 0; i < kLen && landed; ++i) landed = p[i] == PatternByte(21, i);
    if (landed) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  printf("PEER landed yes\n");
  fflush(stdout);
  std::this_thread::sleep_for(std::chrono::minutes(5));
}

TEST_CASE("a write to a peer whose process was killed fails with the cause, in bounded time",
          "[fabric][errors][dead]") {
  PeerProcess peer("fabric_peer", "[.peer]");
  const std::string info = FromHex(peer.Next("info"));
  const std::string region = FromHex(peer.Next("region"));
  REQUIRE_FALSE(info.empty());
  REQUIRE_FALSE(region.empty());
  auto sender = Viable();
  Buffer src = Source(*sender, 21);
  auto remote = Import(*sender, region);
  auto made = sender->CreateEndpoint();
  REQUIRE(made.ok());
  auto& ep = *made;
  REQUIRE(ep->Connect(info, kTimeout).ok());
  peer.Send(ToHex(ep->LocalInfo()));
  // Alive: the write lands in the other process (it checks the bytes and says so).
  REQUIRE(WriteAll(*ep, *src.region, *remote, kTimeout).ok());
  REQUIRE(peer.Next("landed") == "yes");

  peer.Kill();
  const absl::Time start = absl::Now();
  absl::Status s = WriteAll(*ep, *src.region, *remote, absl::Seconds(60));
  const absl::Duration took = absl::Now() - start;
  INFO(s.ToString() << " after " << absl::FormatDuration(took));
  REQUIRE_FALSE(s.ok());
  CHECK(s.code() == absl::StatusCode::kUnavailable);
  CHECK(absl::StrContains(s.message(), ep->PeerName()));
  CHECK(took < absl::Seconds(8));
  // The endpoint stays failed with the cause.
  absl::Status again = WriteAll(*ep, *src.region, *remote, kTimeout);
  CHECK(absl::StrContains(again.message(), ep->PeerName()));
}

namespace {
double ProcessCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}
}  // namespace

// Between updates a daemon's transport sits idle for minutes: whatever drives the provider must not keep a core busy.
TEST_CASE("idle transports with live connections use little CPU", "[fabric][idle]") {
  auto sender = Viable();
  auto receiver = Viable();
  Buffer src = Source(*sender, 31);
  Buffer dst = Target(*receiver);
  auto remote = Import(*sender, dst.region->Descriptor());
  auto rx = receiver->CreateEndpoint();
  REQUIRE(rx.ok());
  auto ep = ConnectTo(*sender, **rx);
  REQUIRE(WriteAll(*ep, *src.region, *remote, kTimeout).ok());
  REQUIRE(HoldsPattern(dst.bytes.data(), kLen, 31));

  // The least of three 1 s windows: a progress loop that keeps a core busy while idle (a spin, or the earlier 50 us
  // pauses throughout, 6.6-9.5 % here) costs that in every window; on a loaded machine one window alone can catch a
  // short burst of reads that noise made look dear (a clean-clone CI run measured 18.7 % once, 1 run in 3 here).
  double share = 1e9;
  for (int w = 0; w < 3; ++w) {
    const double cpu0 = ProcessCpuSeconds();
    const absl::Time t0 = absl::Now();
    std::this_thread::sleep_for(std::chrono::milliseconds(1000));
    const double s = (ProcessCpuSeconds() - cpu0) / absl::ToDoubleSeconds(absl::Now() - t0);
    std::printf("idle CPU of two fabric transports (%s), one connection, window %d: %.2f%% of a core\n",
                wsync::transport::fabric::testing::TestProvider().c_str(), w + 1, 100 * s);
    share = std::min(share, s);
  }
  CHECK(share < 0.04);

  // And they still deliver at once after the pause.
  std::fill(dst.bytes.begin(), dst.bytes.end(), kUntouched);
  const absl::Time w0 = absl::Now();
  REQUIRE(WriteAll(*ep, *src.region, *remote, kTimeout).ok());
  CHECK(absl::Now() - w0 < absl::Milliseconds(500));
  CHECK(HoldsPattern(dst.bytes.data(), kLen, 31));
}

namespace {

// "Device" memory the test can read: a plain buffer, with a separate host mirror (as a GPU sink has).
class HostBackedSink final : public wsync::transport::RegionSink {
 public:
  explicit HostBackedSink(uint64_t len) : device_(len, kUntouched), mirror_(len, kUntouched) {}
  uint64_t length() const override { return device_.size(); }
  uint64_t chunk_bytes() const override { return device_.size(); }
  absl::StatusOr<Staging> Acquire() override { return absl::UnimplementedError("not staged"); }
  absl::Status Submit(const Staging&, uint64_t, uint64_t) override { return absl::UnimplementedError("not staged"); }
  void Cancel(const Staging&) override {}
  absl::Status Flush() override { return absl::OkStatus(); }
  std::string Describe() const override { return "test sink (host-backed)"; }
  absl::StatusOr<uint8_t*> HostMirror() override { return mirror_.data(); }
  absl::Status CopyMirror() override {
    device_ = mirror_;
    ++copies_;
    return absl::OkStatus();
  }
  std::vector<uint8_t> device_, mirror_;
  int copies_ = 0;
};

}  // namespace

TEST_CASE("device memory without FI_HMEM goes through the host mirror, saying why", "[fabric][hmem]") {
  auto sender = Viable();
  auto receiver = Viable();
  auto info = wsync::transport::fabric::GetFabricInfo(*receiver);
  REQUIRE(info.has_value());
  REQUIRE_FALSE(info->hmem);  // tcp and sockets have no device memory registration
  auto sink = std::make_shared<HostBackedSink>(kLen);
  auto region = receiver->RegisterSink(sink);
  INFO(region.status().ToString());
  REQUIRE(region.ok());
  INFO((*region)->DevicePath());
  CHECK(absl::StrContains((*region)->DevicePath(), "host mirror"));
  CHECK(absl::StrContains((*region)->DevicePath(), "provider " + info->provider + " offers no device memory"));
  Buffer src = Source(*sender, 41);
  auto remote = Import(*sender, (*region)->Descriptor());
  auto rx = receiver->CreateEndpoint();
  REQUIRE(rx.ok());
  auto ep = ConnectTo(*sender, **rx);
  REQUIRE(WriteAll(*ep, *src.region, *remote, kTimeout).ok());
  CHECK(HoldsPattern(sink->mirror_.data(), kLen, 41));
  CHECK(Untouched(sink->device_));  // reaches the device when the update settles, not before
  REQUIRE((*region)->Settle().ok());
  CHECK(sink->copies_ == 1);
  CHECK(HoldsPattern(sink->device_.data(), kLen, 41));
}

TEST_CASE("WSYNC_FABRIC_HMEM=1 without FI_HMEM: registering device memory fails naming the provider",
          "[fabric][hmem]") {
  setenv("WSYNC_FABRIC_HMEM", "1", 1);
  auto receiver = Viable();
  unsetenv("WSYNC_FABRIC_HMEM");
  auto info = wsync::transport::fabric::GetFabricInfo(*receiver);
  REQUIRE(info.has_value());
  REQUIRE_FALSE(info->hmem);
  auto sink = std::make_shared<HostBackedSink>(kLen);
  auto region = receiver->RegisterSink(sink);
  INFO(region.status().ToString());
  CHECK(region.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(region.status().message(), info->provider));
  CHECK(absl::StrContains(region.status().message(), "WSYNC_FABRIC_HMEM=1"));
  CHECK(sink->copies_ == 0);

  setenv("WSYNC_FABRIC_HMEM", "sometimes", 1);
  wsync::transport::TransportOptions opts;
  opts.fabric_provider = wsync::transport::fabric::testing::TestProvider();
  auto bad = wsync::transport::CreateTransport("fabric", opts);
  unsetenv("WSYNC_FABRIC_HMEM");
  INFO(bad.status().ToString());
  CHECK(bad.status().code() == absl::StatusCode::kInvalidArgument);
}
