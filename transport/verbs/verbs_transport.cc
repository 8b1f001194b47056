#include "transport/verbs/verbs_transport.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "base/fd_passing.h"
#include "base/status.h"
#include "spdlog/spdlog.h"
#include "transport/registry.h"
#include "transport/verbs/verbs_internal.h"

namespace wsync::transport::verbs {

std::string VerbsLocalRegion::Descriptor() const {
  RegionDesc d;
  d.transport_id = id_.transport_id;
  d.owner = id_.owner;
  d.base = reinterpret_cast<uintptr_t>(addr_);
  d.length = len_;
  d.chunk_size = chunk_;
  d.num_devices = static_cast<uint32_t>(devices_->devices.size());
  d.num_chunks = num_chunks();
  d.rkeys.reserve(mrs_.size());
  for (const MrPtr& mr : mrs_) d.rkeys.push_back(mr->rkey);
  return EncodeRegionDesc(d);
}

bool GpuDirectAllowed(const char* env) { return env == nullptr || std::string(env) != "0"; }

GpuDirectChoice ChooseGpuDirect(const IbvApi& api, const absl::Status& dmabuf, const char* env) {
  if (!GpuDirectAllowed(env)) return {false, "disabled by WSYNC_VERBS_GPUDIRECT=0"};
  if (api.reg_dmabuf_mr == nullptr)
    return {false, absl::StrCat(IbvLibraryName(), " has no ibv_reg_dmabuf_mr (rdma-core older than v34)")};
  if (!dmabuf.ok()) return {false, absl::StrCat("no dma-buf for the memory: ", dmabuf.message())};
  return {true, ""};
}

namespace {
constexpr int kAllowWrite = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
// LOCAL_WRITE even where the NIC only reads (a source region): it makes the kernel pin the pages for writing, so a
// page the CPU writes after registration (the replica is rewritten every update) is never a copy-on-write page the
// NIC no longer sees.
constexpr int kDenyWrite = IBV_ACCESS_LOCAL_WRITE;
}  // namespace

int WriteWindow::Access() const {
  std::lock_guard<std::mutex> l(mu_);
  return open_ && !require_grants_ ? kAllowWrite : kDenyWrite;
}

int WriteWindow::AccessLocked(const QpEntry& e) const {
  if (!open_) return kDenyWrite;
  if (e.grant_live != nullptr) return e.grant_live->load() ? kAllowWrite : kDenyWrite;
  return require_grants_ ? kDenyWrite : kAllowWrite;
}

absl::Status WriteWindow::Add(ibv_qp* qp, std::shared_ptr<std::atomic<bool>> grant_live) {
  std::lock_guard<std::mutex> l(mu_);
  QpEntry e;
  e.grant_live = std::move(grant_live);
  ibv_qp_attr attr{};
  attr.qp_access_flags = AccessLocked(e);
  if (int rc = Ibv().modify_qp(qp, &attr, IBV_QP_ACCESS_FLAGS); rc != 0)
    return absl::UnavailableError(absl::StrCat("ibv_modify_qp(INIT access flags): ", std::strerror(rc)));
  qps_.emplace(qp, std::move(e));
  return absl::OkStatus();
}

void WriteWindow::Remove(ibv_qp* qp) {
  std::lock_guard<std::mutex> l(mu_);
  qps_.erase(qp);
}

absl::Status WriteWindow::Kill(ibv_qp* qp) {
  std::lock_guard<std::mutex> l(mu_);
  qps_.erase(qp);
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_ERR;
  if (int rc = Ibv().modify_qp(qp, &attr, IBV_QP_STATE); rc != 0) {
    return absl::InternalError(absl::StrCat("ibv_modify_qp(ERR) on qpn ", qp->qp_num, ": ", std::strerror(rc)));
  }
  return absl::OkStatus();
}

void WriteWindow::CountLocked() {
  if (!enforced_) return;
  for (auto& [qp, e] : qps_) {
    if (e.counted) continue;
    ibv_qp_attr attr{};
    ibv_qp_init_attr init{};
    if (Ibv().query_qp(qp, &attr, IBV_QP_STATE, &init) == 0 && attr.qp_state == IBV_QPS_ERR) {
      e.counted = true;
      ++refused_;
    }
  }
}

uint64_t WriteWindow::Refused() {
  std::lock_guard<std::mutex> l(mu_);
  CountLocked();
  return refused_;
}

absl::Status WriteWindow::ApplyLocked(const char* what) {
  absl::Status first;
  for (auto& [qp, e] : qps_) {
    ibv_qp_attr cur{};
    ibv_qp_init_attr init{};
    if (Ibv().query_qp(qp, &cur, IBV_QP_STATE, &init) != 0) continue;
    // INIT → INIT and RTS → RTS may change the access flags; a QP in error is a dead connection (its peer
    // reconnects), in RESET it grants nothing.
    if (cur.qp_state != IBV_QPS_INIT && cur.qp_state != IBV_QPS_RTS) continue;
    ibv_qp_attr attr{};
    attr.qp_access_flags = AccessLocked(e);
    if (int rc = Ibv().modify_qp(qp, &attr, IBV_QP_ACCESS_FLAGS); rc != 0 && first.ok()) {
      first = absl::InternalError(absl::StrCat("verbs: ", what, " on qpn ", qp->qp_num,
                                               " failed: ibv_modify_qp(access flags): ", std::strerror(rc)));
    }
  }
  return first;
}

absl::Status WriteWindow::Set(bool open) {
  std::lock_guard<std::mutex> l(mu_);
  CountLocked();  // refusals of the closed period are counted before the flags change
  enforced_ = true;
  open_ = open;
  return ApplyLocked(open ? "opening the write window" : "closing the write window");
}

absl::Status WriteWindow::RequireGrants(bool require) {
  std::lock_guard<std::mutex> l(mu_);
  require_grants_ = require;
  return ApplyLocked("requiring write grants");
}

absl::Status WriteWindow::Refresh() {
  std::lock_guard<std::mutex> l(mu_);
  CountLocked();
  return ApplyLocked("revoking write grants");
}

namespace {

// Device memory registered through RegisterSink: the verbs region (of the device memory itself, or of the sink's
// host mirror) plus how writes reach the device. The sink outlives the region's MRs (member order).
class SinkRegion final : public LocalRegion {
 public:
  SinkRegion(std::shared_ptr<RegionSink> sink, std::unique_ptr<LocalRegion> region, std::string path, bool mirror)
      : sink_(std::move(sink)), region_(std::move(region)), path_(std::move(path)), mirror_(mirror) {}
  void* addr() const override { return region_->addr(); }
  uint64_t length() const override { return region_->length(); }
  std::string Descriptor() const override { return region_->Descriptor(); }
  absl::Status Settle() override { return mirror_ ? sink_->CopyMirror() : absl::OkStatus(); }
  std::string DevicePath() const override { return path_; }
  const LocalRegion& registered() const { return *region_; }

 private:
  std::shared_ptr<RegionSink> sink_;
  std::unique_ptr<LocalRegion> region_;
  std::string path_;
  bool mirror_;
};

// Reads an unsigned WSYNC_VERBS_* variable into *out when `current` is unset (0); InvalidArgument if unparsable.
template <typename T>
absl::Status FromEnv(const char* name, T current, T* out) {
  if (current > 0) {
    *out = current;
    return absl::OkStatus();
  }
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return absl::OkStatus();
  uint64_t parsed = 0;
  if (!absl::SimpleAtoi(v, &parsed) || parsed == 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, "='", v, "' is not a positive integer"));
  }
  *out = static_cast<T>(parsed);
  return absl::OkStatus();
}

// Like FromEnv for small fields where 0 is meaningful: `current` < 0 means unset.
absl::Status SmallFromEnv(const char* name, int current, int max, uint8_t* out) {
  int value = current;
  if (value < 0) {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == '\0') return absl::OkStatus();
    if (!absl::SimpleAtoi(v, &value)) {
      return absl::InvalidArgumentError(absl::StrCat(name, "='", v, "' is not an integer"));
    }
  }
  if (value < 0 || value > max) {
    return absl::InvalidArgumentError(absl::StrCat("verbs: ", name, " must be in [0, ", max, "], got ", value));
  }
  *out = static_cast<uint8_t>(value);
  return absl::OkStatus();
}

absl::StatusOr<Config> ResolveConfig(const TransportOptions& opts, const VerbsOptions& v) {
  Config c;
  c.io_timeout = opts.io_timeout;
  c.zero_psn = v.zero_psn;
  WSYNC_RETURN_IF_ERROR(FromEnv<uint64_t>("WSYNC_VERBS_MAX_MR_SIZE", v.max_mr_chunk, &c.max_mr_chunk));
  WSYNC_RETURN_IF_ERROR(FromEnv<int>("WSYNC_VERBS_QPS_PER_DEVICE", v.qps_per_device, &c.qps_per_device));
  WSYNC_RETURN_IF_ERROR(FromEnv<uint64_t>("WSYNC_VERBS_STRIPE_BYTES", v.stripe_bytes, &c.stripe_bytes));
  WSYNC_RETURN_IF_ERROR(FromEnv<uint32_t>("WSYNC_VERBS_MAX_SEND_WR", v.max_send_wr, &c.max_send_wr));
  WSYNC_RETURN_IF_ERROR(FromEnv<uint32_t>("WSYNC_VERBS_SIGNAL_EVERY", v.signal_every, &c.signal_every));
  WSYNC_RETURN_IF_ERROR(SmallFromEnv("WSYNC_VERBS_QP_TIMEOUT", v.qp_timeout, 31, &c.qp_timeout));
  WSYNC_RETURN_IF_ERROR(SmallFromEnv("WSYNC_VERBS_RETRY_CNT", v.retry_cnt, 7, &c.retry_cnt));
  if (c.qps_per_device > 64) return absl::InvalidArgumentError("verbs: qps_per_device must be at most 64");
  c.signal_every = std::min<uint32_t>(c.signal_every, 4096);
  if (c.stripe_bytes > (1u << 31)) c.stripe_bytes = 1u << 31;
  return c;
}

std::string HostName() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown-host";
  return buf;
}

class VerbsTransport final : public Transport {
 public:
  VerbsTransport(absl::StatusOr<std::shared_ptr<DeviceSet>> devices, Config cfg) : cfg_(cfg) {
    std::random_device rd;
    id_.transport_id = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    std::vector<std::string> names;
    if (devices.ok()) {
      devices_ = std::move(*devices);
      for (const auto& d : devices_->devices) names.push_back(d->name);
    } else {
      reason_ = std::string(devices.status().message());
    }
    id_.owner = absl::StrFormat("%s/pid %d/t%04x [%s]", HostName(), getpid(), id_.transport_id & 0xffff,
                                absl::StrJoin(names, ","));
  }

  std::string name() const override { return "verbs"; }
  bool viable() const override { return devices_ != nullptr; }
  std::string reason() const override { return reason_; }
  // On the devices opened: windows and grants are the QPs' remote-write rights and the grants' own protection
  // domains, which the NIC enforces (so a refusal is not seen by this CPU: only refused connections are counted);
  // device memory through GPUDirect RDMA or a host mirror. A stand-in without devices promises nothing.
  Capabilities Query() const override {
    Capabilities c = CapabilitiesOf(name());
    if (!viable()) return c;
    c.provider = absl::StrCat("verbs (", absl::StrJoin(DeviceNames(), ","), ")");
    c.writes_into_device = true;
    c.write_windows = true;
    c.write_grants = true;
    return c;
  }
  std::vector<std::string> DeviceNames() const {
    std::vector<std::string> out;
    if (devices_) {
      for (const auto& d : devices_->devices) out.push_back(d->name);
    }
    return out;
  }

  absl::StatusOr<std::unique_ptr<LocalRegion>> RegisterMemory(void* addr, uint64_t len) override {
    return Register(addr, len, /*send_only=*/false);
  }
  absl::StatusOr<std::unique_ptr<LocalRegion>> RegisterSourceMemory(void* addr, uint64_t len) override {
    return Register(addr, len, /*send_only=*/true);
  }

  absl::StatusOr<std::unique_ptr<RemoteRegion>> ImportRegion(const std::string& descriptor) override {
    WSYNC_RETURN_IF_ERROR(CheckViable());
    WSYNC_ASSIGN_OR_RETURN(RegionDesc d, DecodeRegionDesc(descriptor));
    return std::unique_ptr<RemoteRegion>(std::make_unique<VerbsRemoteRegion>(std::move(d)));
  }

  absl::StatusOr<std::unique_ptr<Endpoint>> CreateEndpoint() override {
    WSYNC_RETURN_IF_ERROR(CheckViable());
    return NewVerbsEndpoint(devices_, cfg_, id_, window_);
  }

  absl::StatusOr<std::unique_ptr<Endpoint>> CreateGrantedEndpoint(const WriteGrant& grant) override {
    WSYNC_RETURN_IF_ERROR(CheckViable());
    absl::Time start = absl::Now();
    auto dom = std::make_shared<GrantDomain>();
    dom->devices = devices_;
    dom->info = grant;
    for (const auto& d : devices_->devices) {
      PdPtr pd(Ibv().alloc_pd(d->context.get()));
      if (!pd) {
        return absl::ResourceExhaustedError(absl::StrCat("verbs: ibv_alloc_pd on ", d->name, " for the write grant of ",
                                                         grant.peer, " (", grant.scope, "): ", std::strerror(errno)));
      }
      dom->pds.push_back(std::move(pd));
    }
    uint64_t bytes = 0;
    for (const LocalRegion* region : grant.regions) {
      const VerbsLocalRegion* r = AsVerbsRegion(region);
      if (r == nullptr || r->transport_id() != id_.transport_id)
        return absl::InvalidArgumentError(absl::StrCat("verbs: the write grant of ", grant.peer, " (", grant.scope,
                                                       ") names a region of another transport"));
      if (!r->remote_write())
        return absl::InvalidArgumentError(absl::StrCat("verbs: the write grant of ", grant.peer, " (", grant.scope,
                                                       ") names a source's memory, which peers may not write"));
      GrantedRegion g;
      g.base = r->base();
      g.length = r->length();
      g.chunk_size = r->chunk_size();
      g.num_devices = static_cast<uint32_t>(devices_->devices.size());
      g.num_chunks = r->num_chunks();
      for (size_t d = 0; d < devices_->devices.size(); ++d) {
        for (uint32_t c = 0; c < g.num_chunks; ++c) {
          const uint64_t off = c * g.chunk_size;
          const uint64_t n = std::min(g.chunk_size, g.length - off);
          MrPtr mr(r->Register(dom->pds[d].get(), off, n));
          if (!mr) {
            const int err = errno;
            return absl::ResourceExhaustedError(absl::StrCat(
                "verbs: registering ", n, " bytes at offset ", off, " of a region for the write grant of ", grant.peer,
                " (", grant.scope, ") on ", devices_->devices[d]->name, " failed: ", std::strerror(err)));
          }
          g.rkeys.push_back(mr->rkey);
          dom->mrs.push_back(std::move(mr));
        }
      }
      bytes += g.length;
      dom->regions.push_back(std::move(g));
    }
    {
      std::lock_guard<std::mutex> l(grants_mu_);
      grants_.erase(std::remove_if(grants_.begin(), grants_.end(), [](const auto& w) { return w.expired(); }),
                    grants_.end());
      grants_.push_back(dom);
    }
    const size_t nmrs = dom->mrs.size();
    WSYNC_ASSIGN_OR_RETURN(auto ep, NewVerbsEndpoint(devices_, cfg_, id_, window_, std::move(dom)));
    spdlog::info(
        "verbs: write grant minted for {} ({}, {} regions, {} bytes, {} MRs in its own protection domain) "
        "in {:.3f} ms",
        grant.peer, grant.scope, grant.regions.size(), bytes, nmrs, absl::ToDoubleMilliseconds(absl::Now() - start));
    return ep;
  }

  void RevokeGrants(const std::function<bool(const WriteGrant&)>& keep) override {
    if (!viable()) return;
    {
      std::lock_guard<std::mutex> l(grants_mu_);
      for (const auto& w : grants_) {
        std::shared_ptr<GrantDomain> dom = w.lock();
        if (dom == nullptr || !dom->live->load() || keep(dom->info)) continue;
        dom->live->store(false);
        spdlog::info("verbs: write grant for {} ({}) revoked", dom->info.peer, dom->info.scope);
      }
    }
    absl::Status st = window_->Refresh();
    if (!st.ok()) spdlog::error("{}", std::string(st.message()));
  }

  absl::Status RequireGrants(bool require) override {
    WSYNC_RETURN_IF_ERROR(CheckViable());
    return window_->RequireGrants(require);
  }

  absl::Status SetWriteWindow(bool open) override {
    WSYNC_RETURN_IF_ERROR(CheckViable());
    absl::Time start = absl::Now();
    absl::Status st = window_->Set(open);
    spdlog::info("verbs: write window {} in {:.3f} ms", open ? "opened" : "closed",
                 absl::ToDoubleMilliseconds(absl::Now() - start));
    return st;
  }
  uint64_t refused_writes() const override { return window_->Refused(); }

  absl::StatusOr<std::unique_ptr<LocalRegion>> RegisterSink(std::shared_ptr<RegionSink> sink) override {
    WSYNC_RETURN_IF_ERROR(CheckViable());
    if (sink == nullptr) return absl::InvalidArgumentError("verbs: RegisterSink of a null sink");
    const uint64_t len = sink->length();
    const char* env = std::getenv("WSYNC_VERBS_GPUDIRECT");
    const bool have = Ibv().reg_dmabuf_mr != nullptr;
    absl::StatusOr<RegionSink::Dmabuf> buf = absl::CancelledError("not tried");
    if (have && GpuDirectAllowed(env)) buf = sink->ExportDmabuf();
    GpuDirectChoice choice = ChooseGpuDirect(Ibv(), buf.status(), env);
    if (choice.gpu_direct) {
      // Kept open with the region: a write grant registers the same memory again in its own protection domain.
      auto fd = std::make_shared<ScopedFd>(buf->fd);
      const RegionSink::Dmabuf d = *buf;
      auto region =
          RegisterMrs(reinterpret_cast<void*>(d.iova), len, "ibv_reg_dmabuf_mr", "GPUDirect, remote write", {0}, true,
                      [fd, d](ibv_pd* pd, uint64_t off, uint64_t n) {
                        return Ibv().reg_dmabuf_mr(pd, d.offset + off, n, d.iova + off, fd->get(), kAllowWrite);
                      });
      if (region.ok()) {
        spdlog::info("verbs: {} registered for GPUDirect RDMA (dma-buf, {} bytes): the NIC writes the device memory",
                     sink->Describe(), len);
        return std::unique_ptr<LocalRegion>(
            std::make_unique<SinkRegion>(std::move(sink), *std::move(region), "gpudirect", false));
      }
      choice = {false, std::string(region.status().message())};
    }
    spdlog::warn("verbs: {} is written through a page-locked host mirror and copied to the device when an update is "
                 "committed (no GPUDirect RDMA: {})",
                 sink->Describe(), choice.reason);
    WSYNC_ASSIGN_OR_RETURN(uint8_t* mirror, sink->HostMirror());
    WSYNC_ASSIGN_OR_RETURN(auto region, RegisterMemory(mirror, len));
    return std::unique_ptr<LocalRegion>(std::make_unique<SinkRegion>(
        std::move(sink), std::move(region), absl::StrCat("staging (no GPUDirect: ", choice.reason, ")"), true));
  }

 private:
  // send_only: a source's memory (the replica) is registered without remote access: no peer can write into it.
  absl::StatusOr<std::unique_ptr<LocalRegion>> Register(void* addr, uint64_t len, bool send_only) {
    WSYNC_RETURN_IF_ERROR(CheckViable());
    if (addr == nullptr && len > 0) return absl::InvalidArgumentError("verbs: RegisterMemory of a null address");
    const int access = send_only ? kDenyWrite : kAllowWrite;
    return RegisterMrs(addr, len, "ibv_reg_mr", send_only ? "source, no remote access" : "remote write",
                       PreferredDevices(*devices_, addr), !send_only,
                       [addr, access](ibv_pd* pd, uint64_t off, uint64_t n) {
                         return Ibv().reg_mr(pd, static_cast<char*>(addr) + off, n, access);
                       });
  }

  // Registers [0, len) on every device in chunks of at most the devices' max_mr_size, `reg` making one MR.
  absl::StatusOr<std::unique_ptr<LocalRegion>> RegisterMrs(void* addr, uint64_t len, const char* call, const char* what,
                                                           std::vector<int> preferred, bool remote_write,
                                                           ReRegister reg) {
    uint64_t chunk = UINT64_MAX;
    for (const auto& d : devices_->devices) chunk = std::min(chunk, d->max_mr_size);
    if (cfg_.max_mr_chunk > 0) chunk = std::min(chunk, cfg_.max_mr_chunk);
    chunk = std::max<uint64_t>(1, std::min(chunk, len));  // one MR covers a region within the limit
    uint64_t nchunks = len == 0 ? 0 : (len - 1) / chunk + 1;
    if (nchunks > (uint64_t{1} << 24)) {
      return absl::InvalidArgumentError(absl::StrCat("verbs: registering ", len, " bytes in ", chunk,
                                                     "-byte chunks needs too many MRs (", nchunks, ")"));
    }
    absl::Time start = absl::Now();
    std::vector<MrPtr> mrs;
    mrs.reserve(nchunks * devices_->devices.size());
    for (const auto& d : devices_->devices) {
      for (uint64_t c = 0; c < nchunks; ++c) {
        uint64_t off = c * chunk;
        uint64_t n = std::min(chunk, len - off);
        MrPtr mr(reg(d->pd.get(), off, n));
        if (!mr) {
          int err = errno;
          // Already registered chunks are released by `mrs`.
          return absl::ResourceExhaustedError(absl::StrCat(
              "verbs: ", call, " on ", d->name, " of chunk ", c, " (", n, " bytes at offset ", off, " of ", len,
              ") failed: ", std::strerror(err), err == ENOMEM ? " (check the locked-memory limit, ulimit -l)" : ""));
        }
        mrs.push_back(std::move(mr));
      }
    }
    double ms = absl::ToDoubleMilliseconds(absl::Now() - start);
    std::vector<std::string> pref_names;
    for (int i : preferred) pref_names.push_back(devices_->devices[i]->name);
    spdlog::info(
        "verbs: registered {} bytes at {} ({}) as {} MR(s) of up to {} bytes on {} device(s) in {:.3f} ms "
        "({:.2f} GB/s); writes from it use [{}]",
        len, addr, what, mrs.size(), chunk, devices_->devices.size(), ms, ms > 0 ? len / ms / 1e6 : 0.0,
        absl::StrJoin(pref_names, ","));
    return std::unique_ptr<LocalRegion>(std::make_unique<VerbsLocalRegion>(
        devices_, id_, addr, len, chunk, std::move(mrs), std::move(preferred), remote_write, std::move(reg)));
  }

  // The verbs region behind a LocalRegion of this backend (a sink's registered memory for RegisterSink), or null.
  static const VerbsLocalRegion* AsVerbsRegion(const LocalRegion* region) {
    if (const auto* r = dynamic_cast<const VerbsLocalRegion*>(region)) return r;
    if (const auto* s = dynamic_cast<const SinkRegion*>(region))
      return dynamic_cast<const VerbsLocalRegion*>(&s->registered());
    return nullptr;
  }

  absl::Status CheckViable() const {
    if (viable()) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat("verbs transport not viable: ", reason_));
  }

  std::shared_ptr<DeviceSet> devices_;
  std::string reason_;
  Config cfg_;
  Identity id_;
  std::shared_ptr<WriteWindow> window_ = std::make_shared<WriteWindow>();
  std::mutex grants_mu_;
  std::vector<std::weak_ptr<GrantDomain>> grants_;  // live while their endpoint is (RevokeGrants)
};

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateVerbsTransport(const TransportOptions& opts,
                                                                const VerbsOptions& verbs_opts) {
  WSYNC_ASSIGN_OR_RETURN(Config cfg, ResolveConfig(opts, verbs_opts));
  auto devices = OpenDevices(opts.devices, opts.gid_index);
  if (!devices.ok() && devices.status().code() == absl::StatusCode::kInvalidArgument) return devices.status();
  if (!devices.ok()) spdlog::info("verbs: transport not viable: {}", std::string(devices.status().message()));
  return std::unique_ptr<Transport>(std::make_unique<VerbsTransport>(std::move(devices), cfg));
}

absl::StatusOr<std::unique_ptr<Transport>> CreateVerbsTransport(const TransportOptions& opts) {
  return CreateVerbsTransport(opts, VerbsOptions{});
}

std::optional<VerbsRegionInfo> GetVerbsRegionInfo(const LocalRegion& region) {
  const auto* r = dynamic_cast<const VerbsLocalRegion*>(&region);
  if (r == nullptr) return std::nullopt;
  VerbsRegionInfo info;
  info.chunk_size = r->chunk_size();
  info.num_chunks = r->num_chunks();
  for (const auto& d : r->devices().devices) info.devices.push_back(d->name);
  for (int i : r->preferred_devices()) info.preferred_devices.push_back(r->devices().devices[i]->name);
  return info;
}

std::vector<std::string> GetVerbsTransportDevices(const Transport& transport) {
  const auto* t = dynamic_cast<const VerbsTransport*>(&transport);
  return t == nullptr ? std::vector<std::string>{} : t->DeviceNames();
}

std::optional<VerbsEndpointStats> GetVerbsEndpointStats(const Endpoint& endpoint) {
  return GetVerbsEndpointStatsImpl(endpoint);
}

}  // namespace wsync::transport::verbs
