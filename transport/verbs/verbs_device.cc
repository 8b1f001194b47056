#include "transport/verbs/verbs_device.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/status.h"
#include "spdlog/spdlog.h"

namespace wsync::transport::verbs {
namespace {

// From linux/mempolicy.h; spelled out to avoid depending on libnuma.
constexpr unsigned long kMpolFNode = 1UL << 0;
constexpr unsigned long kMpolFAddr = 1UL << 1;

bool IsIpv4Mapped(const ibv_gid& gid) {
  static constexpr uint8_t kPrefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return std::memcmp(gid.raw, kPrefix, sizeof(kPrefix)) == 0;
}

bool IsZero(const ibv_gid& gid) {
  for (uint8_t b : gid.raw) {
    if (b != 0) return false;
  }
  return true;
}

const char* PortStateName(ibv_port_state s) { return Ibv().port_state_str(s); }

// Chooses the GID index on an Ethernet (RoCE) port.
absl::StatusOr<int> PickRoceGid(ibv_context* ctx, uint8_t port, int table_len) {
  int first_v2 = -1;
  int first_any = -1;
  for (int i = 0; i < table_len; ++i) {
    ibv_gid_entry entry{};
    if (Ibv().QueryGidEx(ctx, port, i, &entry) != 0) continue;  // empty slot (ENODATA)
    ibv_gid gid;
    std::memcpy(gid.raw, entry.gid.raw, sizeof(gid.raw));
    if (IsZero(gid)) continue;
    if (entry.gid_type == IBV_GID_TYPE_ROCE_V2) {
      if (IsIpv4Mapped(gid)) return i;
      if (first_v2 < 0) first_v2 = i;
    }
    if (first_any < 0) first_any = i;
  }
  if (first_v2 >= 0) return first_v2;
  if (first_any >= 0) return first_any;
  return absl::FailedPreconditionError(absl::StrCat("port ", port, " has no valid GID (is an IP address configured?)"));
}

// Opens one device port; fills everything but `index`.
absl::StatusOr<std::unique_ptr<Device>> OpenDevice(ibv_device* dev, int want_port, int gid_index) {
  auto d = std::make_unique<Device>();
  d->name = Ibv().get_device_name(dev);
  d->context.reset(Ibv().open_device(dev));
  if (!d->context) {
    return absl::UnavailableError(absl::StrCat("ibv_open_device(", d->name, "): ", std::strerror(errno)));
  }
  ibv_device_attr attr{};
  if (int rc = Ibv().query_device(d->context.get(), &attr); rc != 0) {
    return absl::UnavailableError(absl::StrCat("ibv_query_device(", d->name, "): ", std::strerror(rc)));
  }
  d->max_mr_size = attr.max_mr_size;
  d->max_qp_wr = static_cast<uint32_t>(attr.max_qp_wr);

  ibv_port_attr pattr{};
  bool found = false;
  std::vector<std::string> states;
  for (int p = 1; p <= attr.phys_port_cnt; ++p) {
    if (want_port > 0 && p != want_port) continue;
    if (Ibv().QueryPort(d->context.get(), p, &pattr) != 0) continue;
    states.push_back(absl::StrCat("port ", p, " ", PortStateName(pattr.state)));
    if (pattr.state == IBV_PORT_ACTIVE) {
      d->port = static_cast<uint8_t>(p);
      found = true;
      break;
    }
  }
  if (!found) {
    return absl::UnavailableError(
        absl::StrCat(d->name, " has no active port (", states.empty() ? "none" : absl::StrJoin(states, ", "), ")"));
  }
  d->lid = pattr.lid;
  d->active_mtu = pattr.active_mtu;
  d->link_layer = pattr.link_layer;
  d->max_msg_sz = pattr.max_msg_sz;

  if (gid_index >= 0) {
    d->gid_index = gid_index;
  } else if (d->link_layer == IBV_LINK_LAYER_ETHERNET) {
    auto idx = PickRoceGid(d->context.get(), d->port, pattr.gid_tbl_len);
    if (!idx.ok()) return absl::Status(idx.status().code(), absl::StrCat(d->name, ": ", idx.status().message()));
    d->gid_index = *idx;
  } else {
    d->gid_index = 0;  // InfiniBand: addressed by LID, GID 0 is the port GID
  }
  if (int rc = Ibv().query_gid(d->context.get(), d->port, d->gid_index, &d->gid); rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("ibv_query_gid(", d->name, " port ", d->port, " index ", d->gid_index, ") failed"));
  }
  if (d->link_layer == IBV_LINK_LAYER_ETHERNET && IsZero(d->gid)) {
    return absl::FailedPreconditionError(absl::StrCat(d->name, ": GID index ", d->gid_index, " is empty"));
  }

  d->pd.reset(Ibv().alloc_pd(d->context.get()));
  if (!d->pd) return absl::UnavailableError(absl::StrCat("ibv_alloc_pd(", d->name, "): ", std::strerror(errno)));
  d->numa_node = DeviceNumaNode(d->name);
  return d;
}

}  // namespace

int DeviceNumaNode(const std::string& device_name) {
  std::ifstream in("/sys/class/infiniband/" + device_name + "/device/numa_node");
  int node = -1;
  if (!(in >> node)) return -1;
  return node;  // the kernel reports -1 itself when the bus has no affinity
}

int MemoryNumaNode(const void* addr) {
  int node = -1;
  long rc = syscall(SYS_get_mempolicy, &node, nullptr, 0UL, const_cast<void*>(addr), kMpolFNode | kMpolFAddr);
  return rc == 0 ? node : -1;
}

std::vector<int> PreferredDevices(const DeviceSet& set, const void* addr) {
  std::vector<int> out;
  if (set.devices.empty()) return out;
  if (set.explicit_list) {
    for (const auto& d : set.devices) out.push_back(d->index);
    return out;
  }
  int mem_node = MemoryNumaNode(addr);
  if (mem_node >= 0) {
    for (const auto& d : set.devices) {
      if (d->numa_node == mem_node) out.push_back(d->index);
    }
  }
  if (out.empty()) out.push_back(set.devices.front()->index);
  return out;
}

absl::StatusOr<std::shared_ptr<DeviceSet>> OpenDevices(const std::vector<std::string>& wanted, int gid_index) {
  // Without libibverbs this is where the verbs transport stops: not viable, with the loader's reason.
  WSYNC_RETURN_IF_ERROR(LoadIbv().status());
  int num = 0;
  errno = 0;
  DeviceListPtr list(Ibv().get_device_list(&num));
  if (!list) {
    int err = errno;
    std::string why = absl::StrCat("ibv_get_device_list failed: ", std::strerror(err));
    if (err == ENOSYS) absl::StrAppend(&why, " (this kernel has no RDMA support)");
    return absl::FailedPreconditionError(why);
  }
  if (num == 0) return absl::FailedPreconditionError("no RDMA devices found (ibv_get_device_list returned none)");

  std::vector<std::string> available;
  for (int i = 0; i < num; ++i) available.push_back(Ibv().get_device_name(list.get()[i]));

  auto set = std::make_shared<DeviceSet>();
  set->explicit_list = !wanted.empty();
  std::vector<std::string> problems;
  auto add = [&](ibv_device* dev, int port) {
    auto d = OpenDevice(dev, port, gid_index);
    if (!d.ok()) {
      problems.push_back(std::string(d.status().message()));
      return;
    }
    (*d)->index = static_cast<int>(set->devices.size());
    set->devices.push_back(std::move(*d));
  };

  if (wanted.empty()) {
    for (int i = 0; i < num; ++i) add(list.get()[i], 0);
  } else {
    for (const std::string& spec : wanted) {
      std::vector<std::string> parts = absl::StrSplit(spec, absl::MaxSplits(':', 1));
      int port = 0;
      if (parts.size() == 2 && !absl::SimpleAtoi(parts[1], &port)) {
        return absl::InvalidArgumentError(absl::StrCat("bad RDMA device spec '", spec, "' (want NAME or NAME:PORT)"));
      }
      ibv_device* match = nullptr;
      for (int i = 0; i < num; ++i) {
        if (parts[0] == Ibv().get_device_name(list.get()[i])) match = list.get()[i];
      }
      if (match == nullptr) {
        // An explicitly requested device must exist: using fewer NICs than configured silently would hide a fault.
        return absl::FailedPreconditionError(
            absl::StrCat("RDMA device '", parts[0], "' not found (available: ", absl::StrJoin(available, ", "), ")"));
      }
      add(match, port);
    }
    if (!problems.empty()) {
      return absl::FailedPreconditionError(absl::StrCat("RDMA device unusable: ", absl::StrJoin(problems, "; ")));
    }
  }
  if (set->devices.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("no usable RDMA device: ", absl::StrJoin(problems, "; ")));
  }
  for (const std::string& p : problems) spdlog::info("verbs: skipping {}", p);
  for (const auto& d : set->devices) {
    spdlog::info(
        "verbs: using {} port {} ({}), gid index {}, active mtu {}, numa node {}, max_mr_size {}, "
        "max_qp_wr {}",
        d->name, d->port, d->link_layer == IBV_LINK_LAYER_ETHERNET ? "RoCE" : "IB", d->gid_index, 128 << d->active_mtu,
        d->numa_node, d->max_mr_size, d->max_qp_wr);
  }
  return set;
}

}  // namespace wsync::transport::verbs
