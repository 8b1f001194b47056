// The fabric transport's choice of domains (one per NIC) and of the domain each endpoint uses, on fi_getinfo answers
// written down as a multi-NIC host gives them (efa on an 8-NIC AWS instance, verbs;ofi_rxm on two mlx5 ports, tcp
// on several interfaces). The real two-domain case runs in transport_fabric_domains_netns_test.

#include "transport/fabric/fabric_domains.h"

#include <catch2/catch.hpp>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "transport/fabric/fabric_hmem.h"

namespace {

using wsync::transport::fabric::DomainOffer;
using wsync::transport::fabric::PickDomains;
using wsync::transport::fabric::PickEndpointDomain;

constexpr uint32_t kEfaAddr = 12;  // FI_ADDR_EFA
constexpr uint32_t kSockAddr = 2;  // FI_SOCKADDR_IN
constexpr uint32_t kIbAddr = 9;    // FI_ADDR_IB_UD

// An EFA host's answer: each NIC's RDM domain several times (one entry per capability set), then its datagram
// domains on another provider-fabric pair, then shm.
std::vector<DomainOffer> EfaHost(int nics) {
  std::vector<DomainOffer> out;
  for (int i = 0; i < nics; ++i) {
    const std::string dev = "rdmap" + std::to_string(16 + 16 * i) + "s27";
    for (int dup = 0; dup < 2; ++dup) out.push_back({"efa", "efa", dev + "-rdm", kEfaAddr, i < nics / 2 ? 0 : 1, true});
  }
  for (int i = 0; i < nics; ++i)
    out.push_back({"efa", "efa-direct", "rdmap" + std::to_string(16 + 16 * i) + "s27-dgrm", kEfaAddr, -1, true});
  out.push_back({"shm", "shm", "shm", 22, -1});
  return out;
}

std::vector<std::string> Names(const std::vector<DomainOffer>& offers, const std::vector<size_t>& idx) {
  std::vector<std::string> out;
  for (size_t i : idx) out.push_back(offers[i].domain);
  return out;
}

}  // namespace

TEST_CASE("every domain on the preferred fabric, once each, in offered order", "[fabric][domains]") {
  auto offers = EfaHost(8);
  auto picked = PickDomains(offers, {});
  REQUIRE(picked.ok());
  CHECK(Names(offers, *picked) == std::vector<std::string>{"rdmap16s27-rdm", "rdmap32s27-rdm", "rdmap48s27-rdm",
                                                           "rdmap64s27-rdm", "rdmap80s27-rdm", "rdmap96s27-rdm",
                                                           "rdmap112s27-rdm", "rdmap128s27-rdm"});
  // The first entry of each domain is the one opened.
  for (size_t i : *picked) CHECK((i == 0 || offers[i - 1].domain != offers[i].domain));
}

TEST_CASE("another fabric, provider or address format is left out", "[fabric][domains]") {
  std::vector<DomainOffer> offers = {
      {"verbs;ofi_rxm", "IB-0xfe80", "mlx5_0", kIbAddr, 0, true},
      {"verbs;ofi_rxm", "IB-0xfe81", "mlx5_1", kIbAddr, 0, true},
      {"verbs;ofi_rxm", "IB-0xfe80", "mlx5_2", kIbAddr, 1, true},
      {"verbs;ofi_rxm", "IB-0xfe80", "mlx5_3", kSockAddr, 1, true},
      {"tcp;ofi_rxm", "IB-0xfe80", "mlx5_4", kIbAddr, 1, true},
      {"verbs;ofi_rxm", "IB-0xfe80", "mlx5_0", kIbAddr, 0, true},
      {"verbs;ofi_rxm", "IB-0xfe80", "soft0", kIbAddr, -1, false},  // no PCI device (a software one)
  };
  auto picked = PickDomains(offers, {});
  REQUIRE(picked.ok());
  CHECK(*picked == std::vector<size_t>{0, 2});
}

TEST_CASE("interfaces of a socket provider are not spread over unasked", "[fabric][domains]") {
  // tcp: one domain per interface, no PCI NIC reported; link-local subnets look alike on every interface.
  std::vector<DomainOffer> offers = {
      {"tcp;ofi_rxm", "fe80::/64", "veth3", 3, -1, false},
      {"tcp;ofi_rxm", "fe80::/64", "veth2", 3, -1, false},
      {"tcp;ofi_rxm", "10.9.0.0/24", "v0", kSockAddr, -1, false},
      {"tcp;ofi_rxm", "10.9.0.0/24", "v1", kSockAddr, -1, false},
  };
  auto picked = PickDomains(offers, {});
  REQUIRE(picked.ok());
  CHECK(*picked == std::vector<size_t>{0});
  // Named, they are used together.
  picked = PickDomains(offers, std::vector<std::string>{"v1", "v0"});
  REQUIRE(picked.ok());
  CHECK(*picked == std::vector<size_t>{3, 2});
}

TEST_CASE("named domains: exactly those, in that order, on one fabric", "[fabric][domains]") {
  std::vector<DomainOffer> offers = {
      {"verbs;ofi_rxm", "IB-0xfe80000000000000", "mlx5_0", kIbAddr, 0, true},
      {"verbs;ofi_rxm", "IB-0xfe80000000000000", "mlx5_1", kIbAddr, 1, true},
      {"verbs;ofi_rxm", "IB-0xfe80000000000000", "mlx5_2", kIbAddr, 1, true},
      {"verbs;ofi_rxm", "IB-0xfe80000000000001", "mlx5_3", kIbAddr, 0, true},
  };
  SECTION("a subset, reordered") {
    auto picked = PickDomains(offers, {"mlx5_2", "mlx5_0"});
    REQUIRE(picked.ok());
    CHECK(*picked == std::vector<size_t>{2, 0});
  }
  SECTION("an unknown name lists what is offered") {
    auto picked = PickDomains(offers, {"mlx5_0", "mlx5_9"});
    INFO(picked.status().ToString());
    CHECK(picked.status().code() == absl::StatusCode::kNotFound);
    CHECK(absl::StrContains(picked.status().message(), "\"mlx5_9\""));
    CHECK(absl::StrContains(picked.status().message(), "mlx5_1 (verbs;ofi_rxm"));
  }
  SECTION("a domain of another fabric cannot join") {
    auto picked = PickDomains(offers, {"mlx5_0", "mlx5_3"});
    INFO(picked.status().ToString());
    CHECK(picked.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(absl::StrContains(picked.status().message(), "\"mlx5_3\" is not on the fabric of \"mlx5_0\""));
  }
  SECTION("a name twice") {
    auto picked = PickDomains(offers, {"mlx5_1", "mlx5_1"});
    CHECK(picked.status().code() == absl::StatusCode::kInvalidArgument);
  }
  SECTION("the first named decides the fabric, even when libfabric prefers another") {
    auto picked = PickDomains(offers, {"mlx5_3"});
    REQUIRE(picked.ok());
    CHECK(*picked == std::vector<size_t>{3});
  }
}

TEST_CASE("nothing offered", "[fabric][domains]") {
  CHECK(PickDomains({}, {}).status().code() == absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("endpoints go round-robin to the NICs on their memory's NUMA node, else to all", "[fabric][domains]") {
  const std::vector<int> numa = {0, 0, 0, 0, 1, 1, 1, 1};  // an 8-NIC host, four per socket
  std::map<size_t, int> uses;
  for (uint64_t seq = 0; seq < 400; ++seq) {
    size_t d = PickEndpointDomain(numa, 1, seq);
    REQUIRE(d < numa.size());
    CHECK(numa[d] == 1);
    ++uses[d];
  }
  CHECK(uses.size() == 4);
  for (const auto& [d, n] : uses) CHECK(n == 100);  // evenly

  // Memory on a node with no NIC, or unknown: every NIC in turn.
  std::vector<size_t> seen;
  for (uint64_t seq = 0; seq < 8; ++seq) seen.push_back(PickEndpointDomain(numa, 3, seq));
  CHECK(seen == std::vector<size_t>{0, 1, 2, 3, 4, 5, 6, 7});
  CHECK(PickEndpointDomain({-1, -1}, -1, 5) == 1);
  CHECK(PickEndpointDomain({}, 0, 5) == 0);
  // One NIC on the node: it takes every endpoint of that memory.
  for (uint64_t seq = 0; seq < 4; ++seq) CHECK(PickEndpointDomain({0, 1, 0}, 1, seq) == 1);
}

TEST_CASE("NIC NUMA node: unknown names read nothing outside sysfs", "[fabric][domains]") {
  CHECK(wsync::transport::fabric::NicNumaNode("../../etc", "") == -1);
  CHECK(wsync::transport::fabric::NicNumaNode("no-such-nic-rdm", "") == -1);
  CHECK(wsync::transport::fabric::NicNumaNode("", "0000:ff:ff.7") == -1);
  // lo has no device directory: unknown, not an error.
  CHECK(wsync::transport::fabric::NicNumaNode("lo", "") == -1);
}

TEST_CASE("device memory: registered directly only where the provider, the mode and the pointer allow",
          "[fabric][hmem]") {
  using wsync::transport::fabric::ChooseDeviceMemoryPath;
  using wsync::transport::fabric::HmemMode;
  const absl::Status found = absl::OkStatus();
  CHECK(ChooseDeviceMemoryPath("efa", true, HmemMode::kAuto, found).direct);
  CHECK(ChooseDeviceMemoryPath("efa", true, HmemMode::kRequired, found).direct);
  auto off = ChooseDeviceMemoryPath("efa", true, HmemMode::kOff, found);
  CHECK_FALSE(off.direct);
  CHECK(absl::StrContains(off.reason, "WSYNC_FABRIC_HMEM=0"));
  auto tcp = ChooseDeviceMemoryPath("tcp;ofi_rxm", false, HmemMode::kAuto, found);
  CHECK_FALSE(tcp.direct);
  CHECK(absl::StrContains(tcp.reason, "provider tcp;ofi_rxm offers no device memory registration"));
  auto no_ptr =
      ChooseDeviceMemoryPath("efa", true, HmemMode::kAuto, absl::FailedPreconditionError("libcuda.so.1 missing"));
  CHECK_FALSE(no_ptr.direct);
  CHECK(absl::StrContains(no_ptr.reason, "libcuda.so.1 missing"));

  using wsync::transport::fabric::ParseHmemMode;
  CHECK(*ParseHmemMode(nullptr) == HmemMode::kAuto);
  CHECK(*ParseHmemMode("auto") == HmemMode::kAuto);
  CHECK(*ParseHmemMode("0") == HmemMode::kOff);
  CHECK(*ParseHmemMode("1") == HmemMode::kRequired);
  CHECK(ParseHmemMode("yes").status().code() == absl::StatusCode::kInvalidArgument);
  // No CUDA driver on a build host: the lookup says so instead of crashing.
  auto ordinal = wsync::transport::fabric::CudaDeviceOrdinal(0x1000);
  CHECK_FALSE(ordinal.ok());
}
