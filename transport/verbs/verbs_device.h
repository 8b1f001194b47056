#pragma once
// RDMA device discovery for the verbs backend: which devices/ports to use, their GID, limits and NUMA node.

#include <infiniband/verbs.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "transport/verbs/verbs_handles.h"

namespace wsync::transport::verbs {

// One opened device port with its protection domain. Members are released in reverse order (pd, then context).
struct Device {
  std::string name;
  int index = 0;  // position in DeviceSet::devices; travels in connection info and region descriptors
  uint8_t port = 1;
  int gid_index = 0;
  ibv_gid gid{};
  uint16_t lid = 0;
  ibv_mtu active_mtu = IBV_MTU_1024;
  uint8_t link_layer = IBV_LINK_LAYER_UNSPECIFIED;
  int numa_node = -1;  // -1: unknown
  uint64_t max_mr_size = 0;
  uint32_t max_qp_wr = 0;
  uint32_t max_msg_sz = 0;
  ContextPtr context;
  PdPtr pd;
};

// The devices a transport uses, shared by its regions and endpoints so that the PDs outlive every MR and QP.
struct DeviceSet {
  std::vector<std::unique_ptr<Device>> devices;
  bool explicit_list = false;  // the caller named the devices: stripe over all of them
};

// Opens the devices named in `wanted` ("name" or "name:port"), or every device with an active port when empty.
// `gid_index` < 0 picks a RoCE v2 IPv4-mapped GID (then any RoCE v2, then any valid GID) on Ethernet ports.
// FailedPrecondition / Unavailable with a human-readable reason when no usable device exists (never crashes).
absl::StatusOr<std::shared_ptr<DeviceSet>> OpenDevices(const std::vector<std::string>& wanted, int gid_index);

// NUMA node of an RDMA device from sysfs, -1 when unknown.
int DeviceNumaNode(const std::string& device_name);

// NUMA node holding the page at `addr` (get_mempolicy), -1 when unknown.
int MemoryNumaNode(const void* addr);

// Picks the devices a region at `addr` should use: all of them for an explicit device list; otherwise those on the
// memory's NUMA node, else the first device.
std::vector<int> PreferredDevices(const DeviceSet& set, const void* addr);

}  // namespace wsync::transport::verbs
