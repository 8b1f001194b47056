// The transport registry (transport/registry.h): every backend listed once with a factory, the names the factories
// and the daemon accept, the segment kinds. What an instance reports (Transport::Query) against what it does: the
// conformance suite (conformance_test.cc).
#include "transport/registry.h"

#include <catch2/catch.hpp>
#include <set>
#include <string>

#include "transport/mooncake/mooncake_transport.h"

namespace wsync::transport {

TEST_CASE("registry: names, factories and segment kinds") {
  std::set<std::string> names;
  for (const TransportEntry& e : RegisteredTransports()) {
    CHECK(names.insert(e.name).second);
    CHECK(e.create != nullptr);
    CHECK(FindTransport(e.name) == &e);
    // A backend that connects to the region's owner itself must say how to find it in a descriptor.
    CHECK((e.caps.needs_target_daemon || e.region_peer != nullptr));
    if (e.segment_kind.has_value()) CHECK(TransportForSegmentKind(*e.segment_kind) == &e);
    // Nothing that depends on the host is promised per backend: that is each instance's answer.
    CHECK(e.caps.provider.empty());
    CHECK_FALSE(e.caps.write_windows);
    CHECK_FALSE(e.caps.write_grants);
    CHECK_FALSE(e.caps.refusals_counted);
    CHECK_FALSE(e.caps.writes_into_device);
  }
  CHECK(names == std::set<std::string>{"tcp", "verbs", "fabric", "mooncake"});
  CHECK(KnownTransports() == "tcp, verbs, fabric, mooncake");
  CHECK(KnownTransports(/*daemon_only=*/true) == "tcp, verbs, fabric");
  CHECK(FindTransport("carrier-pigeon") == nullptr);
  CHECK(TransportForSegmentKind(SegmentKind::kHost) == nullptr);
  CHECK(TransportForSegmentKind(SegmentKind::kCuda) == nullptr);
  auto bad = CreateFirstViableTransport("tcp,carrier-pigeon", {});
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(bad.status().message()), Catch::Contains("known: tcp, verbs, fabric, mooncake"));
  // A name the registry lacks (a test double) declares the defaults.
  CHECK(CapabilitiesOf("null").needs_target_daemon);
  CHECK_FALSE(CapabilitiesOf("null").one_sided_only);
}

// What each backend declares is held against what it does by the conformance suite (conformance_test.cc: write
// windows, grants, refusal counts, cancel, reuse), linked once per backend. Here only what needs no peer: a backend
// with no receiving side in wsync exports nothing a peer could import.
TEST_CASE("registry: every backend builds under its name; a one-sided backend exports nothing") {
  for (const TransportEntry& e : RegisteredTransports()) {
    INFO(e.name);
    auto t = e.create(TransportOptions{});
    REQUIRE(t.ok());
    CHECK((*t)->name() == e.name);
    if (!(*t)->viable()) {
      WARN(e.name << " is not viable here (" << (*t)->reason() << ")");
      continue;
    }
    // An instance reports what it runs on, and agrees with its registry entry on what every instance shares.
    const Capabilities q = (*t)->Query();
    CHECK_FALSE(q.provider.empty());
    CHECK(q.needs_target_daemon == e.caps.needs_target_daemon);
    CHECK(q.one_sided_only == e.caps.one_sided_only);
    CHECK(q.writes_from_host == e.caps.writes_from_host);
    if (q.one_sided_only) {
      std::vector<uint8_t> mem(64);
      auto r = (*t)->RegisterMemory(mem.data(), mem.size());
      REQUIRE(r.ok());
      CHECK((*r)->Descriptor().empty());
      CHECK_FALSE((*t)->ImportRegion("").ok());
    }
  }
}

TEST_CASE("registry: the mooncake backend names the peer a region descriptor points at") {
  const TransportEntry* e = TransportForSegmentKind(SegmentKind::kMooncake);
  REQUIRE(e != nullptr);
  CHECK_FALSE(e->caps.needs_target_daemon);
  CHECK(e->caps.one_sided_only);
  auto d = mooncake::MakeRegionDescriptor("10.0.0.7:15452", 0x7fc324ccf000ull, 4096);
  REQUIRE(d.ok());
  auto peer = e->region_peer(*d);
  REQUIRE(peer.ok());
  CHECK(*peer == "10.0.0.7:15452");
  CHECK(e->region_peer("tcp/1 127.0.0.1:1 0").status().code() == absl::StatusCode::kInvalidArgument);
}

// Segment and memory kinds are names only on the wire and the command line: parsed once, an unknown one refused
// naming it and the known ones.
TEST_CASE("segment and memory kinds: names round-trip, an unknown name is refused naming the known ones") {
  for (SegmentKind k : {SegmentKind::kHost, SegmentKind::kCuda, SegmentKind::kMooncake}) {
    auto parsed = ParseSegmentKind(SegmentKindName(k));
    REQUIRE(parsed.ok());
    CHECK(*parsed == k);
  }
  CHECK(SegmentKindName(SegmentKind::kCuda) == "cuda");
  CHECK(MemoryOf(SegmentKind::kHost) == MemoryKind::kHost);
  CHECK(MemoryOf(SegmentKind::kMooncake) == MemoryKind::kCuda);
  for (MemoryKind k : {MemoryKind::kHost, MemoryKind::kCuda}) {
    auto parsed = ParseMemoryKind(MemoryKindName(k));
    REQUIRE(parsed.ok());
    CHECK(*parsed == k);
  }
  for (const char* bad : {"", "CUDA", "gpu", "host "}) {
    INFO(bad);
    auto s = ParseSegmentKind(bad);
    REQUIRE_FALSE(s.ok());
    CHECK(s.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(s.status().message()), Catch::Contains(std::string("\"") + bad + "\""));
    CHECK_THAT(std::string(s.status().message()), Catch::Contains("known: host, cuda, mooncake"));
    CHECK(ParseMemoryKind(bad).status().code() == absl::StatusCode::kInvalidArgument);
  }
  CHECK_FALSE(ParseMemoryKind("mooncake").ok());  // a segment kind, not a memory kind
}

}  // namespace wsync::transport
