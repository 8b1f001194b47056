#include "transport/fabric/fabric_domains.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <fstream>
#include <set>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

namespace wsync::transport::fabric {
namespace {

bool SameFabric(const DomainOffer& a, const DomainOffer& b) {
  return a.provider == b.provider && a.fabric == b.fabric && a.addr_format == b.addr_format;
}

std::string OfferedDomains(absl::Span<const DomainOffer> offers) {
  std::vector<std::string> names;
  std::set<std::string> seen;
  for (const DomainOffer& o : offers)
    if (seen.insert(o.provider + "/" + o.domain).second)
      names.push_back(absl::StrCat(o.domain, " (", o.provider, ", fabric ", o.fabric, ")"));
  return absl::StrJoin(names, ", ");
}

int ReadNode(const std::string& path) {
  std::ifstream f(path);
  int node = -1;
  if (!(f >> node)) return -1;
  return node < 0 ? -1 : node;  // sysfs says -1 on single-node hosts
}

}  // namespace

absl::StatusOr<std::vector<size_t>> PickDomains(absl::Span<const DomainOffer> offers,
                                                absl::Span<const std::string> wanted) {
  if (offers.empty()) return absl::FailedPreconditionError("fabric: the provider offered no domain");
  std::vector<size_t> out;
  if (wanted.empty()) {
    if (!offers[0].pci_nic) return std::vector<size_t>{0};
    std::set<std::string> seen;
    for (size_t i = 0; i < offers.size(); ++i)
      if (offers[i].pci_nic && SameFabric(offers[i], offers[0]) && seen.insert(offers[i].domain).second)
        out.push_back(i);
    return out;
  }
  std::set<std::string> seen;
  for (const std::string& name : wanted) {
    if (!seen.insert(name).second)
      return absl::InvalidArgumentError(absl::StrCat("fabric: domain \"", name, "\" is named twice"));
    size_t found = offers.size();
    for (size_t i = 0; i < offers.size() && found == offers.size(); ++i)
      if (offers[i].domain == name && (out.empty() || SameFabric(offers[i], offers[out[0]]))) found = i;
    if (found == offers.size()) {
      bool elsewhere = false;
      for (const DomainOffer& o : offers) elsewhere |= o.domain == name;
      if (elsewhere) {
        const DomainOffer& first = offers[out[0]];
        return absl::FailedPreconditionError(absl::StrCat(
            "fabric: domain \"", name, "\" is not on the fabric of \"", first.domain, "\" (", first.provider,
            ", fabric ", first.fabric,
            "): endpoints on different fabrics cannot reach each other; domains offered: ", OfferedDomains(offers)));
      }
      return absl::NotFoundError(
          absl::StrCat("fabric: no domain \"", name, "\" is offered; domains offered: ", OfferedDomains(offers)));
    }
    out.push_back(found);
  }
  return out;
}

size_t PickEndpointDomain(absl::Span<const int> domain_numa, int memory_numa, uint64_t sequence) {
  if (domain_numa.empty()) return 0;
  std::vector<size_t> local;
  if (memory_numa >= 0)
    for (size_t i = 0; i < domain_numa.size(); ++i)
      if (domain_numa[i] == memory_numa) local.push_back(i);
  if (local.empty()) return static_cast<size_t>(sequence % domain_numa.size());
  return local[sequence % local.size()];
}

int NicNumaNode(const std::string& domain_name, const std::string& pci_address) {
  if (!pci_address.empty()) {
    int node = ReadNode(absl::StrCat("/sys/bus/pci/devices/", pci_address, "/numa_node"));
    if (node >= 0) return node;
  }
  // efa names its RDM domain after the device with a suffix ("rdmap16s27-rdm", "-dgrm").
  std::string device(domain_name);
  for (absl::string_view suffix : {"-rdm", "-dgrm"}) {
    if (absl::EndsWith(device, suffix)) device.resize(device.size() - suffix.size());
  }
  if (device.empty() || absl::StrContains(device, "/") || device == "." || device == "..") return -1;
  for (const char* cls : {"/sys/class/infiniband/", "/sys/class/net/"}) {
    int node = ReadNode(absl::StrCat(cls, device, "/device/numa_node"));
    if (node >= 0) return node;
  }
  return -1;
}

int MemoryNumaNode(const void* addr) {
  // MPOL_F_NODE | MPOL_F_ADDR: the node of the page at addr. Called through syscall: libnuma is not a dependency.
  constexpr unsigned long kNodeOfAddr = (1 << 0) | (1 << 1);
  int node = -1;
  if (addr == nullptr) return -1;
  if (syscall(SYS_get_mempolicy, &node, nullptr, 0, const_cast<void*>(addr), kNodeOfAddr) != 0) return -1;
  return node;
}

}  // namespace wsync::transport::fabric
