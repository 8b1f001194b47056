#pragma once
// Wire formats of the verbs backend's opaque blobs: connection info (Endpoint::LocalInfo) and region descriptors
// (LocalRegion::Descriptor). Both are plain bytes without pointers into the producing process (the region base is
// the remote virtual address RDMA WRITE targets), so they can cross processes and hosts through the control plane.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace wsync::transport::verbs {

// Blobs are written field by field in host order; every supported host is little-endian.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "verbs blobs are encoded little-endian");

// One RC queue pair as the peer needs to see it.
struct WireQp {
  uint32_t qpn = 0;
  uint32_t psn = 0;  // initial packet sequence number (24 bits)
  uint8_t gid[16] = {};
  uint16_t lid = 0;
  uint8_t port = 0;
  uint8_t mtu = 0;  // enum ibv_mtu of the port
  uint8_t link_layer = 0;
  uint8_t device_index = 0;  // index of the QP's device in its transport (selects the region rkeys)
  uint16_t reserved = 0;
};
// Fixed size: a peer built from another commit must parse the same bytes (the version field guards changes).
static_assert(sizeof(WireQp) == 32, "WireQp is part of the wire format");

// A region a granted connection may write into (docs/security.md, "Write grants (verbs)"): the same memory as the
// region's descriptor (base, length, chunking), registered again in that connection's own protection domains; a
// write through the connection must use these rkeys, the descriptor's are refused by the receiver's NIC.
struct GrantedRegion {
  uint64_t base = 0;
  uint64_t length = 0;
  uint64_t chunk_size = 0;
  uint32_t num_devices = 0;
  uint32_t num_chunks = 0;
  std::vector<uint32_t> rkeys;  // [device * num_chunks + chunk]
};

struct ConnInfo {
  uint64_t transport_id = 0;  // random per transport instance; matches region descriptors of the same peer
  std::string owner;          // human-readable peer name (host, pid, devices)
  std::vector<WireQp> qps;
  // A granted endpoint's info (blob version 2): its QPs reach only these regions. Version 1 blobs (plain
  // endpoints) have no list.
  bool granted = false;
  std::vector<GrantedRegion> grant;
};

struct RegionDesc {
  uint64_t transport_id = 0;
  std::string owner;
  uint64_t base = 0;  // remote virtual address of byte 0
  uint64_t length = 0;
  uint64_t chunk_size = 0;  // every MR covers [i*chunk_size, min((i+1)*chunk_size, length))
  uint32_t num_devices = 0;
  uint32_t num_chunks = 0;
  std::vector<uint32_t> rkeys;  // [device * num_chunks + chunk]
};

std::string EncodeConnInfo(const ConnInfo& info);
absl::StatusOr<ConnInfo> DecodeConnInfo(const std::string& blob);

std::string EncodeRegionDesc(const RegionDesc& desc);
absl::StatusOr<RegionDesc> DecodeRegionDesc(const std::string& blob);

}  // namespace wsync::transport::verbs
