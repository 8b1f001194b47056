// Bounded, deterministic fuzzing of the verbs backend's blob decoders (connection info and region descriptors),
// which parse bytes a peer sent through the control plane. Properties: valid blobs round-trip; every truncation
// and any trailing byte is rejected; a mutated blob is either rejected or decodes to values that re-encode to
// exactly the same bytes (only canonical encodings are accepted) and satisfy the format's invariants.
#include <random>
#include <string>

#include <catch2/catch.hpp>

#include "transport/verbs/verbs_wire.h"

namespace wsync::transport::verbs {
namespace {

std::string Mutate(std::mt19937_64& rng, std::string s) {
  const int n = 1 + static_cast<int>(rng() % 4);
  for (int i = 0; i < n && !s.empty(); ++i) {
    switch (rng() % 4) {
      case 0: s[rng() % s.size()] = static_cast<char>(rng()); break;
      case 1: s[rng() % s.size()] ^= static_cast<char>(1u << (rng() % 8)); break;
      case 2: s.erase(rng() % s.size(), 1 + rng() % 3); break;
      default: s.insert(rng() % (s.size() + 1), std::string(1 + rng() % 3, static_cast<char>(rng())));
    }
  }
  return s;
}

RegionDesc RandomRegion(std::mt19937_64& rng) {
  RegionDesc d;
  d.transport_id = rng();
  d.owner = std::string(rng() % 24, 'o');
  d.base = rng() >> 20;
  d.length = 1 + rng() % (1 << 20);
  d.chunk_size = 1 + rng() % (1 << 18);
  d.num_devices = 1 + static_cast<uint32_t>(rng() % 3);
  d.num_chunks = static_cast<uint32_t>((d.length - 1) / d.chunk_size + 1);
  if (d.num_chunks > 64) {  // keep blobs small: fewer, larger chunks
    d.chunk_size = (d.length + 63) / 64;
    d.num_chunks = static_cast<uint32_t>((d.length - 1) / d.chunk_size + 1);
  }
  d.rkeys.resize(static_cast<size_t>(d.num_devices) * d.num_chunks);
  for (auto& k : d.rkeys) k = static_cast<uint32_t>(rng());
  return d;
}

ConnInfo RandomConn(std::mt19937_64& rng) {
  ConnInfo c;
  c.transport_id = rng();
  c.owner = std::string(rng() % 24, 'h');
  c.qps.resize(1 + rng() % 4);
  for (auto& q : c.qps) {
    q.qpn = static_cast<uint32_t>(rng());
    q.psn = static_cast<uint32_t>(rng() & 0xffffff);
    for (auto& g : q.gid) g = static_cast<uint8_t>(rng());
    q.lid = static_cast<uint16_t>(rng());
    q.port = 1;
    q.mtu = 3;
    q.link_layer = 2;
  }
  if (rng() % 2) {  // a granted endpoint's info (version 2): the granted regions' rkeys follow the QPs
    c.granted = true;
    c.grant.resize(rng() % 3);
    for (auto& g : c.grant) {
      g.num_devices = 1 + rng() % 2;
      g.chunk_size = 1 + rng() % 4096;
      g.length = rng() % 20000;
      g.num_chunks = g.length == 0 ? 0 : static_cast<uint32_t>((g.length - 1) / g.chunk_size + 1);
      g.base = rng() % (uint64_t{1} << 40);
      g.rkeys.resize(static_cast<size_t>(g.num_devices) * g.num_chunks);
      for (auto& k : g.rkeys) k = static_cast<uint32_t>(rng());
    }
  }
  return c;
}

TEST_CASE("verbs wire fuzz: region descriptors") {
  std::mt19937_64 rng(21);
  int accepted = 0;
  for (int round = 0; round < 200; ++round) {
    const RegionDesc d = RandomRegion(rng);
    const std::string good = EncodeRegionDesc(d);
    auto back = DecodeRegionDesc(good);
    REQUIRE(back.ok());
    REQUIRE(back->rkeys == d.rkeys);
    REQUIRE(back->base == d.base);
    REQUIRE(back->length == d.length);
    for (size_t n = 0; n < good.size(); n += 1 + n / 8) REQUIRE_FALSE(DecodeRegionDesc(good.substr(0, n)).ok());
    REQUIRE_FALSE(DecodeRegionDesc(good + '\0').ok());
    for (int i = 0; i < 100; ++i) {
      const std::string m = Mutate(rng, good);
      auto r = DecodeRegionDesc(m);
      if (!r.ok()) continue;
      ++accepted;
      REQUIRE(EncodeRegionDesc(*r) == m);
      REQUIRE(r->rkeys.size() == static_cast<size_t>(r->num_devices) * r->num_chunks);
      REQUIRE(r->base + r->length >= r->base);
      if (r->length > 0) REQUIRE(r->num_chunks == (r->length - 1) / r->chunk_size + 1);
    }
  }
  REQUIRE(accepted > 0);  // rkey and address mutations stay well-formed
}

TEST_CASE("verbs wire fuzz: connection info") {
  std::mt19937_64 rng(22);
  int accepted = 0;
  for (int round = 0; round < 200; ++round) {
    const ConnInfo c = RandomConn(rng);
    const std::string good = EncodeConnInfo(c);
    auto back = DecodeConnInfo(good);
    REQUIRE(back.ok());
    REQUIRE(back->qps.size() == c.qps.size());
    REQUIRE(back->owner == c.owner);
    for (size_t n = 0; n < good.size(); ++n) REQUIRE_FALSE(DecodeConnInfo(good.substr(0, n)).ok());
    REQUIRE_FALSE(DecodeConnInfo(good + '\0').ok());
    for (int i = 0; i < 100; ++i) {
      const std::string m = Mutate(rng, good);
      auto r = DecodeConnInfo(m);
      if (!r.ok()) continue;
      ++accepted;
      REQUIRE(EncodeConnInfo(*r) == m);
      REQUIRE(!r->qps.empty());
    }
  }
  REQUIRE(accepted > 0);
  // Pure noise of every small size.
  for (int i = 0; i < 20000; ++i) {
    std::string junk(rng() % 96, '\0');
    for (auto& ch : junk) ch = static_cast<char>(rng());
    auto a = DecodeConnInfo(junk);
    if (a.ok()) REQUIRE(EncodeConnInfo(*a) == junk);
    auto b = DecodeRegionDesc(junk);
    if (b.ok()) REQUIRE(EncodeRegionDesc(*b) == junk);
  }
}

}  // namespace
}  // namespace wsync::transport::verbs
