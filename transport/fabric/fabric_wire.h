#pragma once
// The fabric backend's blobs: endpoint connection info (Endpoint::LocalInfo) and region descriptors
// (LocalRegion::Descriptor). Both are versioned, little-endian, bounds-checked on decode; a blob of another
// transport is recognised as such and refused with a message that says so.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace wsync::transport::fabric {

// What a region looks like to a peer writing into it: the remote address of byte 0 (the region's virtual address
// when the provider addresses by it, FI_MR_VIRT_ADDR; 0 for offset addressing) and, for each domain (NIC) of the
// owner in its order, the key of the MR peers write through there (a writer uses the key of the domain its peer
// endpoint is on, ConnInfo::domain_index). A source's memory carries the keys of MRs without remote access: writes
// through them are refused by the receiving provider.
struct RegionDesc {
  uint64_t transport_id = 0;
  std::string owner;     // for errors: "host/pid N/tXXXX [provider]"
  std::string provider;  // e.g. "tcp;ofi_rxm"
  uint64_t region_id = 0;
  uint64_t length = 0;
  uint64_t addr_base = 0;
  std::vector<uint64_t> keys;  // one per domain of the owner, at least one
};

// One region of a write grant: the key of the MR registered for this connection only.
struct GrantedRegion {
  uint64_t region_id = 0;
  uint64_t key = 0;
};

struct ConnInfo {
  uint64_t transport_id = 0;
  std::string owner;
  std::string provider;
  std::string fabric;  // fabric name (e.g. the IP subnet for tcp): peers must share it
  uint32_t addr_format = 0;
  std::string address;  // fi_getname of the endpoint, raw
  uint32_t domain_index = 0;  // which of the owner's domains (NICs) the endpoint is on: the key to write with
  std::string domain;         // that domain's name, for errors
  bool granted = false;
  std::vector<GrantedRegion> grant;
};

std::string EncodeConnInfo(const ConnInfo& info);
// InvalidArgument for anything that is not a fabric connection info; names the transport a foreign blob belongs to
// when it recognises one (tcp, verbs).
absl::StatusOr<ConnInfo> DecodeConnInfo(const std::string& blob);
std::string EncodeRegionDesc(const RegionDesc& d);
absl::StatusOr<RegionDesc> DecodeRegionDesc(const std::string& blob);

}  // namespace wsync::transport::fabric
