// The verbs write window and send-only source regions (docs/security.md, "Write windows (verbs)"), on a real RDMA
// device (soft-RoCE in the test VM): a write inside the window lands, a write after the window closed fails at the
// sender with the receiver's bytes unchanged, and a write after it re-opened lands; a source's replica cannot be
// written by a peer at all; a granted connection (Transport::CreateGrantedEndpoint) writes only into its grant.

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "tests/transport/verbs_test_util.h"
#include "transport/transport.h"
#include "transport/verbs/verbs_transport.h"

namespace {

using wsync::transport::Endpoint;
using wsync::transport::LocalRegion;
using wsync::transport::RemoteRegion;
using wsync::transport::Transport;
using wsync::transport::WriteRequest;

const absl::Duration kTimeout = absl::Seconds(30);
constexpr uint64_t kLen = 64 << 10;

// FNV-1a over the bytes: the receiver's memory as the test itself reads it, independent of the transport.
uint64_t Checksum(const std::vector<uint8_t>& b) {
  uint64_t h = 1469598103934665603ull;
  for (uint8_t c : b) h = (h ^ c) * 1099511628211ull;
  return h;
}

std::vector<uint8_t> Fill(uint8_t seed) {
  std::vector<uint8_t> v(kLen);
  for (uint64_t i = 0; i < kLen; ++i) v[i] = static_cast<uint8_t>(i * 29 + seed * 101 + (i >> 8));
  return v;
}

std::unique_ptr<Transport> Make() {
  auto t = wsync::transport::verbs::CreateVerbsTransport({});
  INFO(t.status().ToString());
  REQUIRE(t.ok());
  wsync::transport::verbs::testing::SkipUnlessViable(**t);
  return std::move(*t);
}

struct Link {
  std::unique_ptr<Endpoint> src, dst;
};

Link Connect(Transport& a, Transport& b) {
  auto ea = a.CreateEndpoint();
  auto eb = b.CreateEndpoint();
  REQUIRE(ea.ok());
  REQUIRE(eb.ok());
  Link l{std::move(*ea), std::move(*eb)};
  REQUIRE(l.src->Connect(l.dst->LocalInfo(), kTimeout).ok());
  REQUIRE(l.dst->Connect(l.src->LocalInfo(), kTimeout).ok());
  return l;
}

std::unique_ptr<LocalRegion> Reg(absl::StatusOr<std::unique_ptr<LocalRegion>> r) {
  INFO(r.status().ToString());
  REQUIRE(r.ok());
  return std::move(*r);
}

std::unique_ptr<RemoteRegion> Import(Transport& t, const LocalRegion& r) {
  auto rr = t.ImportRegion(r.Descriptor());
  REQUIRE(rr.ok());
  return std::move(*rr);
}

}  // namespace

TEST_CASE("verbs window: writes land only while the receiver's window is open", "[verbs][window]") {
  auto sender = Make();
  auto receiver = Make();
  std::vector<uint8_t> one = Fill(1), two = Fill(2), three = Fill(3);
  std::vector<uint8_t> engine(kLen, 0xEE);
  auto r1 = Reg(sender->RegisterSourceMemory(one.data(), kLen));
  auto r2 = Reg(sender->RegisterSourceMemory(two.data(), kLen));
  auto r3 = Reg(sender->RegisterSourceMemory(three.data(), kLen));
  auto dst = Reg(receiver->RegisterMemory(engine.data(), kLen));
  auto remote = Import(*sender, *dst);
  auto write_from = [&](const LocalRegion* src) { return std::vector<WriteRequest>{{src, 0, remote.get(), 0, kLen}}; };

  REQUIRE(receiver->SetWriteWindow(false).ok());
  CHECK(receiver->refused_writes() == 0);
  // A connection made while the window is closed carries writes once it opens.
  Link link = Connect(*sender, *receiver);
  Link idle = Connect(*sender, *receiver);
  REQUIRE(receiver->SetWriteWindow(true).ok());
  {
    absl::Status s = link.src->Write(write_from(r1.get()), kTimeout);
    INFO(s.ToString());
    REQUIRE(s.ok());
  }
  CHECK(engine == one);

  // Closed: the sender's batch fails, nothing lands, the refusal is counted.
  REQUIRE(receiver->SetWriteWindow(false).ok());
  const uint64_t before = Checksum(engine);
  absl::Status refused = link.src->Write(write_from(r2.get()), kTimeout);
  INFO(refused.ToString());
  CHECK(refused.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(refused.message(), link.src->PeerName()));
  CHECK(absl::StrContains(refused.message(), "write window"));
  WARN("refused write as the sender sees it: " << refused.ToString());
  CHECK(Checksum(engine) == before);
  CHECK(engine == one);
  CHECK(receiver->refused_writes() == 1);

  // Re-opened: the refused connection is dead (the sender re-creates it), a connection that stayed idle through the
  // closed period writes without reconnecting, and a fresh one writes too.
  REQUIRE(receiver->SetWriteWindow(true).ok());
  CHECK(absl::StrContains(link.src->Post(write_from(r2.get())).status().message(), "re-create"));
  {
    absl::Status s = idle.src->Write(write_from(r2.get()), kTimeout);
    INFO(s.ToString());
    REQUIRE(s.ok());
  }
  CHECK(engine == two);
  link = Connect(*sender, *receiver);
  {
    absl::Status s = link.src->Write(write_from(r3.get()), kTimeout);
    INFO(s.ToString());
    REQUIRE(s.ok());
  }
  CHECK(engine == three);
  CHECK(receiver->refused_writes() == 1);
}

TEST_CASE("verbs window: a source's replica is registered without remote access", "[verbs][window]") {
  auto source = Make();
  auto peer = Make();
  std::vector<uint8_t> replica = Fill(4), attacker = Fill(5), target(kLen, 0xEE);
  auto replica_region = Reg(source->RegisterSourceMemory(replica.data(), kLen));
  auto target_region = Reg(peer->RegisterMemory(target.data(), kLen));
  auto attacker_region = Reg(peer->RegisterSourceMemory(attacker.data(), kLen));

  // The peer imports the replica's descriptor and tries to write into it over a connected pair of QPs.
  auto replica_remote = Import(*peer, *replica_region);
  Link back = Connect(*peer, *source);
  const uint64_t before = Checksum(replica);
  absl::Status s = back.src->Write({{attacker_region.get(), 0, replica_remote.get(), 0, kLen}}, kTimeout);
  INFO(s.ToString());
  CHECK(s.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(Checksum(replica) == before);
  CHECK(replica == Fill(4));

  // The replica still serves as a write source.
  auto target_remote = Import(*source, *target_region);
  Link fwd = Connect(*source, *peer);
  absl::Status ok = fwd.src->Write({{replica_region.get(), 0, target_remote.get(), 0, kLen}}, kTimeout);
  INFO(ok.ToString());
  REQUIRE(ok.ok());
  CHECK(target == replica);
}

namespace {

// A target-side connection granted `regions` (as the target daemon's ConnectTarget makes it) and the source's side.
Link ConnectGranted(Transport& source, Transport& target, const std::string& scope,
                    std::vector<const LocalRegion*> regions) {
  Transport::WriteGrant g;
  g.peer = "source:s0";
  g.scope = scope;
  g.regions = std::move(regions);
  auto et = target.CreateGrantedEndpoint(g);
  INFO(et.status().ToString());
  REQUIRE(et.ok());
  auto es = source.CreateEndpoint();
  REQUIRE(es.ok());
  Link l{std::move(*es), std::move(*et)};
  REQUIRE(l.src->Connect(l.dst->LocalInfo(), kTimeout).ok());
  REQUIRE(l.dst->Connect(l.src->LocalInfo(), kTimeout).ok());
  return l;
}

}  // namespace

TEST_CASE("verbs grants: a granted connection writes only its regions, while the window is open", "[verbs][grants]") {
  auto source = Make();
  auto target = Make();
  std::vector<uint8_t> one = Fill(6), two = Fill(7), three = Fill(8);
  std::vector<uint8_t> rank0(kLen, 0xA0), rank1(kLen, 0xA1);  // two engine ranks' memory on the target
  auto s1 = Reg(source->RegisterSourceMemory(one.data(), kLen));
  auto s2 = Reg(source->RegisterSourceMemory(two.data(), kLen));
  auto s3 = Reg(source->RegisterSourceMemory(three.data(), kLen));
  auto r0 = Reg(target->RegisterMemory(rank0.data(), kLen));
  auto r1 = Reg(target->RegisterMemory(rank1.data(), kLen));
  auto remote0 = Import(*source, *r0);
  auto remote1 = Import(*source, *r1);
  auto write = [&](const LocalRegion* src, const RemoteRegion* dst) {
    return std::vector<WriteRequest>{{src, 0, dst, 0, kLen}};
  };

  // As a target daemon starts: grants required, window closed.
  REQUIRE(target->RequireGrants(true).ok());
  REQUIRE(target->SetWriteWindow(false).ok());
  Link granted0 = ConnectGranted(*source, *target, "engine0/0", {r0.get()});
  Link plain = Connect(*source, *target);
  REQUIRE(target->SetWriteWindow(true).ok());

  // Inside the grant: lands.
  {
    absl::Status s = granted0.src->Write(write(s1.get(), remote0.get()), kTimeout);
    INFO(s.ToString());
    REQUIRE(s.ok());
  }
  CHECK(rank0 == one);

  // Outside the grant (rank 1's region through rank 0's connection), window open: the NIC refuses it.
  const uint64_t before1 = Checksum(rank1);
  absl::Status outside = granted0.src->Write(write(s2.get(), remote1.get()), kTimeout);
  WARN("write outside the grant as the sender sees it: " << outside.ToString());
  CHECK(outside.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(outside.message(), granted0.src->PeerName()));
  CHECK(absl::StrContains(outside.message(), "outside the write grant"));
  CHECK(Checksum(rank1) == before1);
  CHECK(rank1 == std::vector<uint8_t>(kLen, 0xA1));
  CHECK(rank0 == one);
  CHECK(target->refused_writes() == 1);

  // A connection without a grant gets no remote write at all once grants are required.
  absl::Status ungranted = plain.src->Write(write(s2.get(), remote0.get()), kTimeout);
  INFO(ungranted.ToString());
  CHECK(ungranted.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(rank0 == one);
  CHECK(target->refused_writes() == 2);

  // A source's own memory cannot be granted.
  {
    Transport::WriteGrant g{"source:s0", "engine0/0", {s1.get()}};
    auto bad = source->CreateGrantedEndpoint(g);
    CHECK(bad.status().code() == absl::StatusCode::kInvalidArgument);
  }

  // Grants change at the next window: the new plan gives rank 1 (not rank 0) to this source. Rank 0's grant is
  // revoked before the window opens (its idle connection is refused from its next write), a new connection is
  // granted rank 1 and writes there.
  REQUIRE(target->SetWriteWindow(false).ok());
  Link idle0 = ConnectGranted(*source, *target, "engine0/0", {r0.get()});  // connected, never written, then revoked
  int revoked = 0;
  target->RevokeGrants([&](const Transport::WriteGrant& g) {
    const bool keep = g.scope == "engine0/1";
    revoked += !keep;
    return keep;
  });
  CHECK(revoked == 2);  // granted0's (its connection is dead, its endpoint still alive) and idle0's
  Link granted1 = ConnectGranted(*source, *target, "engine0/1", {r1.get()});
  REQUIRE(target->SetWriteWindow(true).ok());
  {
    absl::Status s = granted1.src->Write(write(s3.get(), remote1.get()), kTimeout);
    INFO(s.ToString());
    REQUIRE(s.ok());
  }
  CHECK(rank1 == three);
  const uint64_t before0 = Checksum(rank0);
  absl::Status revoked_write = idle0.src->Write(write(s3.get(), remote0.get()), kTimeout);
  INFO(revoked_write.ToString());
  CHECK(revoked_write.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(Checksum(rank0) == before0);
  CHECK(rank0 == one);
  CHECK(target->refused_writes() == 3);
}

namespace {

// Device memory as verbs sees it without GPUDirect: writes land in a host mirror, copied to the "device" on Settle.
class MirrorSink final : public wsync::transport::RegionSink {
 public:
  explicit MirrorSink(std::vector<uint8_t>* device) : device_(device), mirror_(*device) {}
  uint64_t length() const override { return device_->size(); }
  uint64_t chunk_bytes() const override { return 4096; }
  absl::StatusOr<Staging> Acquire() override { return absl::UnimplementedError("verbs does not stage"); }
  absl::Status Submit(const Staging&, uint64_t, uint64_t) override { return absl::UnimplementedError("no staging"); }
  void Cancel(const Staging&) override {}
  absl::Status Flush() override { return absl::OkStatus(); }
  std::string Describe() const override { return "test device memory"; }
  absl::StatusOr<uint8_t*> HostMirror() override { return mirror_.data(); }
  absl::Status CopyMirror() override {
    std::memcpy(device_->data(), mirror_.data(), mirror_.size());
    return absl::OkStatus();
  }

 private:
  std::vector<uint8_t>* device_;
  std::vector<uint8_t> mirror_;
};

}  // namespace

TEST_CASE("verbs grants: device memory written through a host mirror can be granted", "[verbs][grants]") {
  auto source = Make();
  auto target = Make();
  std::vector<uint8_t> one = Fill(9), two = Fill(10);
  std::vector<uint8_t> dev0(kLen, 0xD0), dev1(kLen, 0xD1);
  auto s1 = Reg(source->RegisterSourceMemory(one.data(), kLen));
  auto s2 = Reg(source->RegisterSourceMemory(two.data(), kLen));
  auto r0 = Reg(target->RegisterSink(std::make_shared<MirrorSink>(&dev0)));
  auto r1 = Reg(target->RegisterSink(std::make_shared<MirrorSink>(&dev1)));
  auto remote0 = Import(*source, *r0);
  auto remote1 = Import(*source, *r1);
  REQUIRE(target->RequireGrants(true).ok());
  REQUIRE(target->SetWriteWindow(false).ok());
  Link granted = ConnectGranted(*source, *target, "engine0/0", {r0.get()});
  REQUIRE(target->SetWriteWindow(true).ok());
  {
    absl::Status s = granted.src->Write({{s1.get(), 0, remote0.get(), 0, kLen}}, kTimeout);
    INFO(s.ToString());
    REQUIRE(s.ok());
  }
  absl::Status outside = granted.src->Write({{s2.get(), 0, remote1.get(), 0, kLen}}, kTimeout);
  INFO(outside.ToString());
  CHECK(outside.code() == absl::StatusCode::kFailedPrecondition);
  REQUIRE(r0->Settle().ok());
  REQUIRE(r1->Settle().ok());
  CHECK(dev0 == one);
  CHECK(dev1 == std::vector<uint8_t>(kLen, 0xD1));
  CHECK(target->refused_writes() == 1);
}
