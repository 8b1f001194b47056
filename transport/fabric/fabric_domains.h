#pragma once
// Which libfabric domains (one per NIC) a fabric transport opens, and which of them a new endpoint uses. Pure
// functions over what fi_getinfo offered, so the choice is tested on synthetic lists (a host with several EFA or
// mlx5 NICs cannot be had here); fabric_transport.cc turns fi_info entries into DomainOffers and acts on the answer.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace wsync::transport::fabric {

// One fi_getinfo answer, reduced to what the choice needs. fi_getinfo lists a domain several times (one entry per
// protocol or capability set); the first entry of a domain is the one opened.
struct DomainOffer {
  std::string provider;  // fabric_attr->prov_name, e.g. "efa", "verbs;ofi_rxm"
  std::string fabric;    // fabric_attr->name: endpoints reach each other only within one fabric
  std::string domain;    // domain_attr->name: one per NIC ("rdmap16s27-rdm", "mlx5_0", an interface for tcp)
  uint32_t addr_format = 0;
  int numa_node = -1;  // the NIC's NUMA node, -1 when unknown
  // The provider reports a NIC with a PCI address for it (efa, verbs): a domain is a device, not a software one
  // over an IP interface (tcp, sockets: every interface of a subnet, link-local ones included, is a "domain").
  bool pci_nic = false;
};

// The offers (indices into `offers`) a transport opens, one per domain, in the order libfabric offered them.
//   * `wanted` empty: the first offer (libfabric's preference) fixes provider, fabric and address format. When it
//     is a PCI NIC, every PCI NIC domain offered with the same three is used; otherwise that one domain alone
//     (interfaces are not spread over unasked: several on one subnet need not reach the same peers).
//   * `wanted` names domains: exactly those, in that order; they must share provider, fabric and address format
//     (an endpoint on one could not reach the peer's endpoint on another). An unknown or repeated name is an error
//     naming the domains offered.
// FailedPrecondition when nothing is offered.
absl::StatusOr<std::vector<size_t>> PickDomains(absl::Span<const DomainOffer> offers,
                                                absl::Span<const std::string> wanted);

// The domain (index into `domain_numa`, the NUMA node of each opened domain) the `sequence`-th endpoint of a
// transport uses: round-robin over the domains on `memory_numa` (the node holding most of the transport's
// registered memory), else over all of them (memory node unknown, or no NIC on it). Never fails for a non-empty
// list; 0 for an empty one.
size_t PickEndpointDomain(absl::Span<const int> domain_numa, int memory_numa, uint64_t sequence);

// The NUMA node of a NIC from sysfs: its PCI device (when the provider reports a PCI bus address), else an RDMA
// device or a network interface named like the domain ("mlx5_0", "eth0"; efa's "rdmap16s27-rdm" without "-rdm").
// -1 when unknown. Reads the filesystem (not pure): kept here beside the choice it feeds.
int NicNumaNode(const std::string& domain_name, const std::string& pci_address);

// The NUMA node holding the page at `addr` (get_mempolicy), -1 when unknown.
int MemoryNumaNode(const void* addr);

}  // namespace wsync::transport::fabric
