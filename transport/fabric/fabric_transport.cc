#include "transport/fabric/fabric_transport.h"

#include <rdma/fi_cm.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "base/status.h"
#include "spdlog/spdlog.h"
#include "transport/fabric/fabric_domains.h"
#include "transport/fabric/fabric_internal.h"
#include "transport/fabric/fabric_progress.h"
#include "transport/registry.h"

namespace wsync::transport::fabric {

void CloseFid(fid* f, const char* what) {
  if (f == nullptr) return;
  if (int rc = fi_close(f); rc != 0) spdlog::warn("fabric: closing a {} failed: {}", what, FiError(rc));
}

namespace {

// Every bit this backend knows how to honour; the provider answers with those it requires.
constexpr uint64_t kSupportedMrMode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
constexpr uint64_t kRmaCaps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE;

uint64_t RandomKey(size_t key_size) {
  static thread_local std::mt19937_64 rng(std::random_device{}() ^ (static_cast<uint64_t>(getpid()) << 32));
  uint64_t k = rng();
  if (key_size > 0 && key_size < 8) k &= (uint64_t{1} << (8 * key_size)) - 1;
  return k == 0 ? 1 : k;  // 0 means "none yet" in this backend
}

std::string MrModeString(uint64_t m) {
  std::vector<std::string> bits;
  if (m & FI_MR_LOCAL) bits.push_back("FI_MR_LOCAL");
  if (m & FI_MR_VIRT_ADDR) bits.push_back("FI_MR_VIRT_ADDR");
  if (m & FI_MR_ALLOCATED) bits.push_back("FI_MR_ALLOCATED");
  if (m & FI_MR_PROV_KEY) bits.push_back("FI_MR_PROV_KEY");
  if (m & FI_MR_ENDPOINT) bits.push_back("FI_MR_ENDPOINT");
  if (m & FI_MR_HMEM) bits.push_back("FI_MR_HMEM");
  return bits.empty() ? "none (offset addressing, keys chosen by the application)" : absl::StrJoin(bits, "|");
}

}  // namespace

absl::StatusOr<uint64_t> ParseForcedMrMode(const std::string& list) {
  uint64_t bits = 0;
  for (absl::string_view part : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    if (part == "local") {
      bits |= FI_MR_LOCAL;
    } else if (part == "endpoint") {
      bits |= FI_MR_ENDPOINT;
    } else if (part == "prov_key") {
      bits |= FI_MR_PROV_KEY;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("fabric: unknown mr_mode bit \"", part, "\" to force (known: local, prov_key, endpoint)"));
    }
  }
  return bits;
}

// ---- Domain ----

Domain::~Domain() {
  {
    std::lock_guard<std::mutex> l(stop_mu_);
    stop_.store(true);
  }
  stop_cv_.notify_all();
  if (progress_.joinable()) progress_.join();
  if (progress_cq_ != nullptr) CloseFid(&progress_cq_->fid, "completion queue");
  if (domain_ != nullptr) CloseFid(&domain_->fid, "domain");
  if (fabric_ != nullptr) CloseFid(&fabric_->fid, "fabric");
  if (info_ != nullptr) Fi().freeinfo(info_);
}

std::string Domain::provider() const { return info_->fabric_attr->prov_name; }
std::string Domain::fabric_name() const { return info_->fabric_attr->name != nullptr ? info_->fabric_attr->name : ""; }

absl::StatusOr<std::shared_ptr<Domain>> Domain::Open(fi_info* info, const Config& cfg) {
  std::shared_ptr<Domain> d(new Domain());
  d->info_ = info;
  d->cfg_ = cfg;
  d->mr_mode_ = (info->domain_attr->mr_mode & (kSupportedMrMode | FI_MR_HMEM)) | cfg.forced_mr_mode;
  d->delivery_complete_ = (info->tx_attr->op_flags & FI_DELIVERY_COMPLETE) != 0;
  d->max_msg_ = info->ep_attr->max_msg_size == 0 ? (uint64_t{1} << 30) : info->ep_attr->max_msg_size;
  d->tx_depth_ = static_cast<uint32_t>(std::max<uint64_t>(
      1, std::min<uint64_t>(cfg.tx_depth, info->tx_attr->size == 0 ? cfg.tx_depth : info->tx_attr->size)));
  const std::string prov = d->provider();
  if (int rc = Fi().fabric(info->fabric_attr, &d->fabric_, nullptr); rc != 0)
    return absl::UnavailableError(absl::StrCat("fabric: fi_fabric (", prov, "): ", FiError(rc)));
  if (int rc = fi_domain(d->fabric_, info, &d->domain_, nullptr); rc != 0)
    return absl::UnavailableError(
        absl::StrCat("fabric: fi_domain (", prov, " ", info->domain_attr->name, "): ", FiError(rc)));
  // Every endpoint binds its receive side to this queue. Nothing is ever posted to receive, so it holds no entries;
  // reading it is what progresses incoming writes on a provider that needs the receiver's CPU (FI_PROGRESS_MANUAL).
  // Polled, not waited on (fi_cq_sread): libfabric 1.17's tcp;ofi_rxm crashes in a wait on a queue whose endpoint
  // was closed, and efa offers no wait objects at all.
  fi_cq_attr ca{};
  ca.format = FI_CQ_FORMAT_CONTEXT;
  ca.size = 64;
  ca.wait_obj = FI_WAIT_NONE;
  if (int rc = fi_cq_open(d->domain_, &ca, &d->progress_cq_, nullptr); rc != 0)
    return absl::UnavailableError(absl::StrCat("fabric: fi_cq_open (", prov, "): ", FiError(rc)));
  if (info->domain_attr->data_progress == FI_PROGRESS_MANUAL) {
    Domain* raw = d.get();
    d->progress_ = std::thread([raw] { raw->ProgressLoop(); });
  }
  return d;
}

void Domain::ProgressLoop() {
  // Incoming writes leave no entry to tell activity by, and the queue's wait object cannot be used (libfabric 1.17's
  // tcp;ofi_rxm calls back into closed endpoints from fi_trywait, and never clears the descriptor without it): the
  // pacer tells activity by what a read cost this thread and decides when to read next (fabric_progress.h).
  auto cpu_now = [] {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return std::chrono::nanoseconds(int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec);
  };
  fi_cq_entry e[8];
  ProgressPacer pacer;
  while (!stop_.load(std::memory_order_relaxed)) {
    ssize_t n;
    const auto start = cpu_now();
    {
      std::lock_guard<std::mutex> l(progress_mu_);
      n = fi_cq_read(progress_cq_, e, 8);
      if (n == -FI_EAVAIL) {
        fi_cq_err_entry err{};
        if (fi_cq_readerr(progress_cq_, &err, 0) > 0)
          spdlog::warn("fabric: receive-side completion error: {}", FiError(err.err));
      }
    }
    ProgressRead read;
    read.entries_or_error = n != -FI_EAGAIN;
    read.cpu = cpu_now() - start;
    read.now = std::chrono::steady_clock::now();
    read.driven = driving_.load(std::memory_order_relaxed) > 0;
    read.expected = expect_writes_.load(std::memory_order_relaxed);
    const ProgressPacer::Step step = pacer.Next(read);
    if (step.kind == ProgressPacer::Step::kRead) continue;
    if (step.kind == ProgressPacer::Step::kYield) {
      sched_yield();
      continue;
    }
    std::unique_lock<std::mutex> l(stop_mu_);
    stop_cv_.wait_for(l, step.pause, [this] { return stop_.load(); });
  }
}

absl::StatusOr<MrPtr> Domain::RegisterMr(void* addr, uint64_t len, uint64_t access, uint64_t key, fid_ep* ep,
                                         const char* what, const DeviceMemory& dev) {
  const size_t key_size = info_->domain_attr->mr_key_size;
  const bool provider_keys = (info_->domain_attr->mr_mode & FI_MR_PROV_KEY) != 0;
  for (int attempt = 0;; ++attempt) {
    // The provider ignores the requested key when it picks keys; a forced prov_key asks for a fresh one every time.
    uint64_t want = provider_keys ? 0 : (key != 0 && !prov_key() ? key : RandomKey(key_size));
    fid_mr* mr = nullptr;
    int rc;
    if (dev.on_device) {
      iovec iov{addr, len};
      fi_mr_attr attr{};
      attr.mr_iov = &iov;
      attr.iov_count = 1;
      attr.access = access;
      attr.requested_key = want;
      attr.iface = FI_HMEM_CUDA;
      attr.device.cuda = dev.cuda_ordinal;
      rc = fi_mr_regattr(domain_, &attr, 0, &mr);
    } else {
      rc = fi_mr_reg(domain_, addr, len, access, 0, want, 0, &mr, nullptr);
    }
    if (rc == -FI_ENOKEY && !provider_keys && (key == 0 || prov_key()) && attempt < 8) continue;  // key taken
    if (rc != 0) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "fabric: ", dev.on_device ? "fi_mr_regattr(FI_HMEM_CUDA, cuda:" : "fi_mr_reg",
          dev.on_device ? absl::StrCat(dev.cuda_ordinal, ")") : "", " of ", len, " bytes at ", absl::Hex(addr), " (",
          what, ") on ", provider(), ": ", FiError(rc), rc == -FI_ENOMEM ? " (check ulimit -l)" : ""));
    }
    MrPtr out(mr);
    if (binds_mr_to_endpoint() && ep != nullptr) {
      if (int b = fi_mr_bind(mr, &ep->fid, 0); b != 0)
        return absl::UnavailableError(absl::StrCat("fabric: fi_mr_bind (", what, "): ", FiError(b)));
      if (int en = fi_mr_enable(mr); en != 0)
        return absl::UnavailableError(absl::StrCat("fabric: fi_mr_enable (", what, "): ", FiError(en)));
    }
    return out;
  }
}

// ---- Gate ----

absl::Status Gate::SyncLocked(Entry& e, bool wanted, const char* what) {
  // Under FI_MR_ENDPOINT an MR must be bound to an endpoint: a region's own remote MR has none to bind to.
  if (dom_->endpoint_mr() && e.ep == nullptr) wanted = false;
  if (!wanted) {
    e.mr.reset();
    return absl::OkStatus();
  }
  if (e.mr != nullptr) return absl::OkStatus();
  WSYNC_ASSIGN_OR_RETURN(e.mr, dom_->RegisterMr(e.addr, e.len, FI_REMOTE_WRITE, e.key, e.ep, what, e.dev));
  const uint64_t key = fi_mr_key(e.mr.get());
  if (e.key != 0 && key != e.key)
    spdlog::warn(
        "fabric: {} registered again under a new key (the provider picks keys): peers holding the old key "
        "are refused",
        what);
  e.key = key;
  return absl::OkStatus();
}

absl::Status Gate::ApplyLocked() {
  absl::Status first;
  for (auto& p : plain_) {
    absl::Status s = SyncLocked(p->e, PlainWantedLocked(), "a region's remote-write MR");
    if (first.ok()) first = s;
    for (Entry& b : p->bound) {
      s = SyncLocked(b, PlainWantedLocked(), "a region's remote-write MR bound to an endpoint");
      if (first.ok()) first = s;
    }
  }
  for (auto& g : grants_) {
    for (Entry& e : g->entries) {
      absl::Status s = SyncLocked(e, GrantWantedLocked(*g), "a write grant's MR");
      if (first.ok()) first = s;
    }
  }
  return first;
}

absl::StatusOr<std::shared_ptr<Gate::Plain>> Gate::AddPlain(uint64_t region_id, void* addr, uint64_t len,
                                                            const DeviceMemory& dev) {
  auto p = std::make_shared<Plain>();
  p->region_id = region_id;
  p->e.addr = addr;
  p->e.len = len;
  p->e.dev = dev;
  if (!dom_->prov_key()) p->e.key = RandomKey(dom_->info()->domain_attr->mr_key_size);
  std::lock_guard<std::mutex> l(mu_);
  WSYNC_RETURN_IF_ERROR(SyncLocked(p->e, PlainWantedLocked(), "a region's remote-write MR"));
  plain_.push_back(p);
  return p;
}

void Gate::RemovePlain(const std::shared_ptr<Plain>& p) {
  std::lock_guard<std::mutex> l(mu_);
  plain_.erase(std::remove(plain_.begin(), plain_.end(), p), plain_.end());
  p->e.mr.reset();
  p->bound.clear();
}

absl::Status Gate::BindPlain(fid_ep* ep) {
  std::lock_guard<std::mutex> l(mu_);
  for (auto& p : plain_) {
    Entry b;
    b.addr = p->e.addr;
    b.len = p->e.len;
    b.dev = p->e.dev;
    b.ep = ep;
    if (!dom_->prov_key()) b.key = RandomKey(dom_->info()->domain_attr->mr_key_size);
    p->bound.push_back(std::move(b));
    WSYNC_RETURN_IF_ERROR(
        SyncLocked(p->bound.back(), PlainWantedLocked(), "a region's remote-write MR bound to an endpoint"));
  }
  return absl::OkStatus();
}

std::vector<GrantedRegion> Gate::BoundKeys(fid_ep* ep) const {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<GrantedRegion> out;
  for (const auto& p : plain_) {
    for (const Entry& b : p->bound)
      if (b.ep == ep) out.push_back(GrantedRegion{p->region_id, b.key});
  }
  return out;
}

void Gate::UnbindPlain(fid_ep* ep) {
  std::lock_guard<std::mutex> l(mu_);
  for (auto& p : plain_) {
    p->bound.erase(std::remove_if(p->bound.begin(), p->bound.end(), [ep](const Entry& b) { return b.ep == ep; }),
                   p->bound.end());
  }
}

uint64_t Gate::PlainKey(const Plain& p) const {
  std::lock_guard<std::mutex> l(mu_);
  return p.e.key;
}

absl::StatusOr<std::shared_ptr<Gate::Grant>> Gate::AddGrant(Transport::WriteGrant info, std::vector<uint64_t> ids,
                                                            std::vector<Range> ranges, fid_ep* ep) {
  auto g = std::make_shared<Grant>();
  g->info = std::move(info);
  g->region_ids = std::move(ids);
  for (const Range& r : ranges) {
    Entry e;
    e.addr = r.addr;
    e.len = r.len;
    e.dev = r.dev;
    e.ep = ep;
    if (!dom_->prov_key()) e.key = RandomKey(dom_->info()->domain_attr->mr_key_size);
    g->entries.push_back(std::move(e));
  }
  std::lock_guard<std::mutex> l(mu_);
  for (Entry& e : g->entries) WSYNC_RETURN_IF_ERROR(SyncLocked(e, GrantWantedLocked(*g), "a write grant's MR"));
  grants_.push_back(g);
  return g;
}

void Gate::RemoveGrant(const std::shared_ptr<Grant>& g) {
  std::lock_guard<std::mutex> l(mu_);
  grants_.erase(std::remove(grants_.begin(), grants_.end(), g), grants_.end());
  for (Entry& e : g->entries) e.mr.reset();
}

bool Gate::GrantLive(const Grant& g) const {
  std::lock_guard<std::mutex> l(mu_);
  return g.live && std::any_of(grants_.begin(), grants_.end(), [&](const auto& x) { return x.get() == &g; });
}

std::vector<GrantedRegion> Gate::GrantKeys(const Grant& g) const {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<GrantedRegion> out;
  for (size_t i = 0; i < g.entries.size(); ++i) out.push_back(GrantedRegion{g.region_ids[i], g.entries[i].key});
  return out;
}

absl::Status Gate::SetWindow(bool open) {
  std::lock_guard<std::mutex> l(mu_);
  enforced_ = true;
  open_ = open;
  return ApplyLocked();
}

absl::Status Gate::RequireGrants(bool require) {
  std::lock_guard<std::mutex> l(mu_);
  require_grants_ = require;
  return ApplyLocked();
}

void Gate::Revoke(const std::function<bool(const Transport::WriteGrant&)>& keep) {
  std::lock_guard<std::mutex> l(mu_);
  for (auto& g : grants_) {
    if (!g->live || keep(g->info)) continue;
    g->live = false;
    spdlog::info("fabric: write grant for {} ({}) revoked", g->info.peer, g->info.scope);
  }
  absl::Status s = ApplyLocked();
  if (!s.ok()) spdlog::error("fabric: revoking write grants: {}", std::string(s.message()));
}

// ---- Regions ----

std::string FabricLocalRegion::Descriptor() const {
  RegionDesc d;
  d.transport_id = id_.transport_id;
  d.owner = id_.owner;
  d.provider = doms_[0]->provider();
  d.region_id = region_id_;
  d.length = len_;
  d.addr_base = addr_base();
  // A source's memory gives its local MRs' keys, which have no remote access: a peer's write through one is refused
  // by this side's provider, not merely by the writer's good manners.
  for (size_t i = 0; i < doms_.size(); ++i) {
    if (!plain_.empty()) {
      d.keys.push_back(gates_[i]->PlainKey(*plain_[i]));
    } else {
      d.keys.push_back(i < local_.size() && local_[i] ? fi_mr_key(local_[i].get()) : 0);
    }
  }
  return EncodeRegionDesc(d);
}

namespace {

// Device memory registered through RegisterSink: the device memory itself (FI_HMEM: the NIC writes it), or the
// sink's page-locked host mirror, copied to the device when the receiving side settles an update.
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

template <typename T>
absl::Status FromEnv(const char* name, T current, T* out) {
  if (current > 0) {
    *out = current;
    return absl::OkStatus();
  }
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return absl::OkStatus();
  uint64_t parsed = 0;
  if (!absl::SimpleAtoi(v, &parsed) || parsed == 0)
    return absl::InvalidArgumentError(absl::StrCat(name, "='", v, "' is not a positive integer"));
  *out = static_cast<T>(parsed);
  return absl::OkStatus();
}

absl::StatusOr<Config> ResolveConfig(const TransportOptions& opts, const FabricOptions& f) {
  Config c;
  c.io_timeout = opts.io_timeout;
  c.peer_timeout = std::min(opts.send_progress_timeout, opts.io_timeout);
  WSYNC_RETURN_IF_ERROR(FromEnv<uint64_t>("WSYNC_FABRIC_MAX_PIECE", f.max_piece, &c.max_piece));
  WSYNC_RETURN_IF_ERROR(FromEnv<uint32_t>("WSYNC_FABRIC_TX_DEPTH", f.tx_depth, &c.tx_depth));
  std::string force = f.force_mr_mode;
  if (force.empty()) {
    const char* v = std::getenv("WSYNC_FABRIC_FORCE_MR_MODE");
    if (v != nullptr) force = v;
  }
  WSYNC_ASSIGN_OR_RETURN(c.forced_mr_mode, ParseForcedMrMode(force));
  WSYNC_ASSIGN_OR_RETURN(c.hmem, ParseHmemMode(std::getenv("WSYNC_FABRIC_HMEM")));
  c.domains = f.domains;
  if (c.domains.empty()) {
    const char* v = std::getenv("WSYNC_FABRIC_DOMAINS");
    if (v != nullptr) c.domains = absl::StrSplit(v, ',', absl::SkipWhitespace());
  }
  c.tx_depth = std::min<uint32_t>(c.tx_depth, 1 << 16);
  return c;
}

std::string HostName() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown-host";
  return buf;
}

struct InfoDeleter {
  void operator()(fi_info* i) const {
    if (i != nullptr) Fi().freeinfo(i);
  }
};
using InfoPtr = std::unique_ptr<fi_info, InfoDeleter>;

// fi_getinfo for RDM endpoints with RMA writes on `provider` (empty: any), optionally delivery-complete.
int GetInfo(const std::string& provider, bool rma, bool delivery_complete, InfoPtr* out, bool hmem = false) {
  InfoPtr hints(Fi().dupinfo(nullptr));
  if (hints == nullptr) return -FI_ENOMEM;
  hints->caps = rma ? kRmaCaps : 0;
  hints->ep_attr->type = FI_EP_RDM;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  hints->domain_attr->mr_mode = kSupportedMrMode;
  if (hmem) {
    hints->caps |= FI_HMEM;
    hints->domain_attr->mr_mode |= FI_MR_HMEM;
  }
  hints->domain_attr->threading = FI_THREAD_SAFE;
  if (delivery_complete) hints->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
  if (!provider.empty()) hints->fabric_attr->prov_name = strdup(provider.c_str());  // freed by fi_freeinfo
  fi_info* info = nullptr;
  int rc = Fi().getinfo(FI_VERSION(1, 9), nullptr, nullptr, 0, hints.get(), &info);
  out->reset(rc == 0 ? info : nullptr);
  return rc;
}

// The PCI address of the NIC behind an answer ("0000:10:00.0"), empty when the provider reports none.
std::string PciAddress(const fi_info* i) {
  if (i->nic == nullptr || i->nic->bus_attr == nullptr || i->nic->bus_attr->bus_type != FI_BUS_PCI) return "";
  const fi_pci_attr& a = i->nic->bus_attr->attr.pci;
  return absl::StrFormat("%04x:%02x:%02x.%x", a.domain_id, a.bus_id, a.device_id, a.function_id);
}

// Why no usable provider was found: whether `provider` exists here at all, lacks RMA, and which providers exist.
std::string DiagnoseProvider(const std::string& provider, int rc) {
  std::set<std::string> present, with_rma;
  InfoPtr all, rma;
  if (GetInfo("", false, false, &all) == 0)
    for (fi_info* i = all.get(); i != nullptr; i = i->next) present.insert(i->fabric_attr->prov_name);
  if (GetInfo("", true, false, &rma) == 0)
    for (fi_info* i = rma.get(); i != nullptr; i = i->next) with_rma.insert(i->fabric_attr->prov_name);
  const std::string which =
      provider.empty() ? std::string("no libfabric provider") : "no libfabric provider \"" + provider + "\"";
  std::string why;
  InfoPtr plain;
  if (!provider.empty() && GetInfo(provider, false, false, &plain) == 0) {
    why = absl::StrCat("libfabric provider \"", provider,
                       "\" offers no RMA writes on reliable-datagram endpoints (FI_EP_RDM with FI_RMA)");
  } else {
    why = absl::StrCat(which, provider.empty() ? " with RMA writes on reliable-datagram endpoints" : "",
                       " is available here (fi_getinfo: ", FiError(rc), ")");
  }
  return absl::StrCat(why, "; providers present: [", absl::StrJoin(present, ", "), "], with RMA: [",
                      absl::StrJoin(with_rma, ", "), "]",
                      provider == "efa" ? " (efa needs an EFA device: AWS only)" : "");
}

class FabricTransport final : public Transport {
 public:
  // `doms`: one per NIC (empty: not viable, `reason` says why); `numa`: each domain's NUMA node.
  FabricTransport(std::vector<std::shared_ptr<Domain>> doms, std::vector<int> numa, std::string reason)
      : doms_(std::move(doms)), domain_numa_(std::move(numa)), reason_(std::move(reason)) {
    std::random_device rd;
    id_.transport_id = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    id_.owner = absl::StrFormat("%s/pid %d/t%04x [%s]", HostName(), getpid(), id_.transport_id & 0xffff,
                                doms_.empty() ? std::string("fabric") : doms_[0]->provider());
    for (const auto& d : doms_) gates_.push_back(std::make_shared<Gate>(d));
  }

  std::string name() const override { return "fabric"; }
  bool viable() const override { return !doms_.empty(); }
  std::string reason() const override { return reason_; }
  // Decided by the provider libfabric picked: a write window is enforced by re-keying memory, which needs keys wsync
  // chooses (not FI_MR_PROV_KEY, efa's mode); grants are endpoint MRs of their own on every provider; device memory
  // through FI_HMEM or a host mirror, unless WSYNC_FABRIC_HMEM=1 demands FI_HMEM of a provider without it. Keys are
  // checked by the provider (a NIC for efa): refusals are not counted.
  Capabilities Query() const override {
    Capabilities c = CapabilitiesOf(name());
    if (!viable()) return c;
    const Domain& d = *doms_[0];  // every domain has the same provider and attributes
    c.provider = absl::StrCat("fabric (", d.provider(), ")");
    c.writes_into_device = d.hmem() || d.config().hmem != HmemMode::kRequired;
    c.write_windows = !d.prov_key();
    c.write_grants = true;
    return c;
  }

  absl::StatusOr<std::unique_ptr<LocalRegion>> RegisterMemory(void* addr, uint64_t len) override {
    return Register(addr, len, /*remote_write=*/true);
  }
  absl::StatusOr<std::unique_ptr<LocalRegion>> RegisterSourceMemory(void* addr, uint64_t len) override {
    return Register(addr, len, /*remote_write=*/false);
  }

  absl::StatusOr<std::unique_ptr<LocalRegion>> RegisterSink(std::shared_ptr<RegionSink> sink) override {
    WSYNC_RETURN_IF_ERROR(CheckViable());
    if (sink == nullptr) return absl::InvalidArgumentError("fabric: RegisterSink of a null sink");
    const Domain& d = *doms_[0];
    const HmemMode mode = d.config().hmem;
    absl::Status pointer = absl::FailedPreconditionError("not looked up");
    RegionSink::Dmabuf buf;
    DeviceMemory dev;
    if (d.hmem() && mode != HmemMode::kOff) {
      // The sink's dma-buf export is how it names its device pointer; libfabric 1.17 registers by pointer.
      auto exported = sink->ExportDmabuf();
      pointer = exported.status();
      if (exported.ok()) {
        buf = *exported;
        close(buf.fd);
        auto ordinal = CudaDeviceOrdinal(buf.iova);
        pointer = ordinal.status();
        if (ordinal.ok()) dev = DeviceMemory{true, *ordinal};
      }
    }
    DeviceMemoryChoice choice = ChooseDeviceMemoryPath(d.provider(), d.hmem(), mode, pointer);
    if (choice.direct) {
      auto region = Register(reinterpret_cast<void*>(buf.iova), sink->length(), /*remote_write=*/true, dev);
      if (region.ok()) {
        spdlog::info("fabric: {} registered as device memory (FI_HMEM, cuda:{}): the NIC writes it", sink->Describe(),
                     dev.cuda_ordinal);
        return std::unique_ptr<LocalRegion>(std::make_unique<SinkRegion>(
            std::move(sink), *std::move(region), absl::StrCat("fabric FI_HMEM (cuda:", dev.cuda_ordinal, ")"), false));
      }
      choice = {false, std::string(region.status().message())};
    }
    if (mode == HmemMode::kRequired) {
      return absl::FailedPreconditionError(
          absl::StrCat("fabric: ", sink->Describe(), " cannot be registered as device memory on provider ",
                       d.provider(), " (WSYNC_FABRIC_HMEM=1 requires it): ", choice.reason));
    }
    WSYNC_ASSIGN_OR_RETURN(uint8_t * mirror, sink->HostMirror());
    WSYNC_ASSIGN_OR_RETURN(auto region, RegisterMemory(mirror, sink->length()));
    spdlog::warn(
        "fabric: {} is written through a host mirror and copied to the device when an update is committed ({})",
        sink->Describe(), choice.reason);
    return std::unique_ptr<LocalRegion>(std::make_unique<SinkRegion>(
        std::move(sink), std::move(region), absl::StrCat("staging (fabric host mirror: ", choice.reason, ")"), true));
  }

  absl::StatusOr<std::unique_ptr<RemoteRegion>> ImportRegion(const std::string& descriptor) override {
    WSYNC_RETURN_IF_ERROR(CheckViable());
    WSYNC_ASSIGN_OR_RETURN(RegionDesc d, DecodeRegionDesc(descriptor));
    if (d.provider != doms_[0]->provider())
      return absl::InvalidArgumentError(absl::StrCat("fabric: region of ", d.owner, " is registered with provider \"",
                                                     d.provider, "\", this transport uses \"", doms_[0]->provider(),
                                                     "\""));
    return std::unique_ptr<RemoteRegion>(std::make_unique<FabricRemoteRegion>(std::move(d)));
  }

  absl::StatusOr<std::unique_ptr<Endpoint>> CreateEndpoint() override {
    WSYNC_RETURN_IF_ERROR(CheckViable());
    const uint32_t k = NextDomain();
    return NewFabricEndpoint(doms_[k], gates_[k], id_, nullptr, k);
  }

  absl::StatusOr<std::unique_ptr<Endpoint>> CreateGrantedEndpoint(const WriteGrant& grant) override {
    WSYNC_RETURN_IF_ERROR(CheckViable());
    GrantRequest req;
    req.info = grant;
    for (const LocalRegion* region : grant.regions) {
      const FabricLocalRegion* r = AsFabricRegion(region);
      if (r == nullptr || r->transport_id() != id_.transport_id)
        return absl::InvalidArgumentError(absl::StrCat("fabric: the write grant of ", grant.peer, " (", grant.scope,
                                                       ") names a region of another transport"));
      if (!r->remote_write())
        return absl::InvalidArgumentError(absl::StrCat("fabric: the write grant of ", grant.peer, " (", grant.scope,
                                                       ") names a source's memory, which peers may not write"));
      req.regions.push_back(r);
    }
    absl::Time start = absl::Now();
    const uint32_t k = NextDomain();
    WSYNC_ASSIGN_OR_RETURN(auto ep, NewFabricEndpoint(doms_[k], gates_[k], id_, &req, k));
    spdlog::info("fabric: write grant minted for {} ({}, {} regions, own MR keys) in {:.3f} ms", grant.peer,
                 grant.scope, grant.regions.size(), absl::ToDoubleMilliseconds(absl::Now() - start));
    return ep;
  }

  void RevokeGrants(const std::function<bool(const WriteGrant&)>& keep) override {
    for (const auto& g : gates_) g->Revoke(keep);
  }

  absl::Status RequireGrants(bool require) override {
    WSYNC_RETURN_IF_ERROR(CheckViable());
    absl::Status first;
    for (const auto& g : gates_) first.Update(g->RequireGrants(require));
    return first;
  }

  absl::Status SetWriteWindow(bool open) override {
    WSYNC_RETURN_IF_ERROR(CheckViable());
    // Writes are expected while the window is open, whether or not this provider lets it be enforced: the
    // progress threads keep reading without pauses until it closes.
    for (const auto& d : doms_) d->ExpectWrites(open);
    if (doms_[0]->prov_key()) {
      // Re-registering on open would hand out new keys, which connected peers never learn.
      return absl::UnimplementedError(
          absl::StrCat("the fabric transport does not enforce write windows on provider ", doms_[0]->provider(),
                       " (it picks memory keys, FI_MR_PROV_KEY; write grants and their revocation are enforced)"));
    }
    absl::Time start = absl::Now();
    absl::Status st;
    for (const auto& g : gates_) st.Update(g->SetWindow(open));
    spdlog::info("fabric: write window {} in {:.3f} ms", open ? "opened" : "closed",
                 absl::ToDoubleMilliseconds(absl::Now() - start));
    return st;
  }

  FabricInfo Info() const {
    const Domain& d = *doms_[0];  // every domain has the same provider, fabric and attributes
    FabricInfo i;
    i.provider = d.provider();
    i.fabric = d.fabric_name();
    i.domain = d.info()->domain_attr->name != nullptr ? d.info()->domain_attr->name : "";
    for (size_t k = 0; k < doms_.size(); ++k) {
      const char* n = doms_[k]->info()->domain_attr->name;
      i.domains.push_back(n != nullptr ? n : "");
    }
    i.domain_numa = domain_numa_;
    i.hmem = d.hmem();
    i.mr_mode = d.mr_mode();
    i.delivery_complete = d.delivery_complete();
    i.manual_progress = d.info()->domain_attr->data_progress == FI_PROGRESS_MANUAL;
    i.app_keys = !d.prov_key();
    i.max_msg_size = d.max_msg_size();
    i.max_piece = std::min(d.max_msg_size(), d.config().max_piece);
    i.tx_depth = d.tx_depth();
    return i;
  }

 private:
  absl::StatusOr<std::unique_ptr<LocalRegion>> Register(void* addr, uint64_t len, bool remote_write,
                                                        const DeviceMemory& dev = {}) {
    WSYNC_RETURN_IF_ERROR(CheckViable());
    // FI_MR_ALLOCATED (efa): only memory that exists may be registered; never a null range.
    if (addr == nullptr && len > 0) return absl::InvalidArgumentError("fabric: RegisterMemory of a null address");
    absl::Time start = absl::Now();
    const uint64_t region_id = RandomKey(8);
    // Registered in every domain: an endpoint on any NIC can write from it, a peer on any NIC into it.
    std::vector<MrPtr> local(doms_.size());
    std::vector<std::shared_ptr<Gate::Plain>> plain;
    auto release_plain = [&] {
      for (size_t i = 0; i < plain.size(); ++i) gates_[i]->RemovePlain(plain[i]);
    };
    for (size_t i = 0; i < doms_.size() && len > 0; ++i) {
      // Under FI_MR_ENDPOINT the local MRs are registered per endpoint (bound to it) when it first writes from here.
      if (!doms_[i]->endpoint_mr()) {
        auto mr = doms_[i]->RegisterMr(addr, len, FI_WRITE, 0, nullptr, "local access", dev);
        if (!mr.ok()) {
          release_plain();
          return mr.status();
        }
        local[i] = *std::move(mr);
      }
      if (remote_write) {
        auto p = gates_[i]->AddPlain(region_id, addr, len, dev);
        if (!p.ok()) {
          release_plain();
          return p.status();
        }
        plain.push_back(*std::move(p));
      }
    }
    if (len > 0 && !dev.on_device) NoteMemory(addr, len);
    const double ms = absl::ToDoubleMilliseconds(absl::Now() - start);
    spdlog::info("fabric: registered {} bytes at {} ({}) on {} ({} domain(s)) in {:.3f} ms", len, addr,
                 remote_write ? "remote write" : "source, no remote access", doms_[0]->provider(), doms_.size(), ms);
    return std::unique_ptr<LocalRegion>(std::make_unique<FabricLocalRegion>(doms_, gates_, id_, region_id, addr, len,
                                                                            std::move(local), std::move(plain), dev));
  }

  // Counts registered bytes per NUMA node: endpoints go to the NICs beside most of the memory they will move.
  void NoteMemory(void* addr, uint64_t len) {
    if (doms_.size() < 2) return;
    const int node = MemoryNumaNode(addr);
    std::lock_guard<std::mutex> l(numa_mu_);
    bytes_by_node_[node] += len;
  }

  uint32_t NextDomain() {
    int node = -1;
    {
      std::lock_guard<std::mutex> l(numa_mu_);
      uint64_t most = 0;
      for (const auto& [n, bytes] : bytes_by_node_) {
        if (n >= 0 && bytes > most) {
          most = bytes;
          node = n;
        }
      }
    }
    return static_cast<uint32_t>(PickEndpointDomain(domain_numa_, node, next_endpoint_.fetch_add(1)));
  }

  static const FabricLocalRegion* AsFabricRegion(const LocalRegion* region) {
    if (const auto* r = dynamic_cast<const FabricLocalRegion*>(region)) return r;
    if (const auto* s = dynamic_cast<const SinkRegion*>(region))
      return dynamic_cast<const FabricLocalRegion*>(&s->registered());
    return nullptr;
  }

  absl::Status CheckViable() const {
    if (viable()) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat("fabric transport not viable: ", reason_));
  }

  std::vector<std::shared_ptr<Domain>> doms_;
  std::vector<int> domain_numa_;
  std::string reason_;
  Identity id_;
  std::vector<std::shared_ptr<Gate>> gates_;  // one per domain
  std::atomic<uint64_t> next_endpoint_{0};
  std::mutex numa_mu_;
  std::map<int, uint64_t> bytes_by_node_;  // registered bytes per NUMA node (-1: unknown)
};

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateFabricTransport(const TransportOptions& opts,
                                                                 const FabricOptions& fabric_opts) {
  WSYNC_ASSIGN_OR_RETURN(Config cfg, ResolveConfig(opts, fabric_opts));
  auto not_viable = [](std::string why) {
    spdlog::info("fabric: transport not viable: {}", why);
    return std::unique_ptr<Transport>(
        std::make_unique<FabricTransport>(std::vector<std::shared_ptr<Domain>>{}, std::vector<int>{}, std::move(why)));
  };
  absl::StatusOr<const FiApi*> api = LoadFabric();
  if (!api.ok()) return not_viable(std::string(api.status().message()));
  const std::string& provider = opts.fabric_provider;
  InfoPtr info;
  bool delivery_complete = true;
  int rc = GetInfo(provider, true, true, &info);
  if (rc != 0) {  // no delivery-complete: transmit-complete is all there is
    delivery_complete = false;
    rc = GetInfo(provider, true, false, &info);
  }
  if (rc != 0 || info == nullptr) return not_viable(DiagnoseProvider(provider, rc));
  // The first answer is libfabric's preference: it fixes provider and fabric; one domain per NIC on that fabric.
  std::vector<fi_info*> entries;
  std::vector<DomainOffer> offers;
  for (fi_info* i = info.get(); i != nullptr; i = i->next) {
    entries.push_back(i);
    offers.push_back(DomainOffer{i->fabric_attr->prov_name != nullptr ? i->fabric_attr->prov_name : "",
                                 i->fabric_attr->name != nullptr ? i->fabric_attr->name : "",
                                 i->domain_attr->name != nullptr ? i->domain_attr->name : "", i->addr_format, -1,
                                 !PciAddress(i).empty()});
  }
  WSYNC_ASSIGN_OR_RETURN(std::vector<size_t> picked, PickDomains(offers, cfg.domains));
  // The same domains with device memory registration (FI_HMEM), where the provider offers it for every one of them.
  // Asked only now, of the provider already chosen: asking first would steer libfabric's pick towards providers
  // with FI_HMEM (shm, for one, which reaches no other host).
  InfoPtr hmem_info;
  if (cfg.hmem != HmemMode::kOff &&
      GetInfo(offers[picked[0]].provider, true, delivery_complete, &hmem_info, /*hmem=*/true) == 0) {
    std::vector<fi_info*> hmem_entries;
    std::vector<DomainOffer> hmem_offers;
    for (fi_info* i = hmem_info.get(); i != nullptr; i = i->next) {
      hmem_entries.push_back(i);
      hmem_offers.push_back(DomainOffer{i->fabric_attr->prov_name != nullptr ? i->fabric_attr->prov_name : "",
                                        i->fabric_attr->name != nullptr ? i->fabric_attr->name : "",
                                        i->domain_attr->name != nullptr ? i->domain_attr->name : "", i->addr_format, -1,
                                        !PciAddress(i).empty()});
    }
    std::vector<std::string> names;
    for (size_t idx : picked) names.push_back(offers[idx].domain);
    auto again = PickDomains(hmem_offers, names);
    if (again.ok() && hmem_offers[(*again)[0]].fabric == offers[picked[0]].fabric) {
      entries = std::move(hmem_entries);
      offers = std::move(hmem_offers);
      picked = *std::move(again);
    }
  }
  std::vector<std::shared_ptr<Domain>> doms;
  std::vector<int> numa;
  for (size_t idx : picked) {
    const fi_info* e = entries[idx];
    fi_info* chosen = Fi().dupinfo(e);
    if (chosen == nullptr) return absl::ResourceExhaustedError("fabric: fi_dupinfo failed");
    auto dom = Domain::Open(chosen, cfg);
    if (!dom.ok()) return not_viable(std::string(dom.status().message()));
    doms.push_back(*std::move(dom));
    numa.push_back(NicNumaNode(offers[idx].domain, PciAddress(e)));
  }
  const Domain& d = *doms[0];
  const fi_info* chosen = d.info();
  std::vector<std::string> names;
  for (size_t k = 0; k < doms.size(); ++k)
    names.push_back(absl::StrCat(offers[picked[k]].domain, numa[k] >= 0 ? absl::StrCat(" (NUMA ", numa[k], ")") : ""));
  spdlog::info(
      "fabric: provider {} fabric {} domain(s) {}: mr_mode {}{}, max_msg_size {}, tx depth {}, {} progress{}",
      d.provider(), d.fabric_name(), absl::StrJoin(names, ", "), MrModeString(d.mr_mode()),
      cfg.forced_mr_mode ? absl::StrCat(" (forced: ", MrModeString(cfg.forced_mr_mode), ")") : "", d.max_msg_size(),
      d.tx_depth(),
      chosen->domain_attr->data_progress == FI_PROGRESS_MANUAL ? "manual (one thread drives receives)" : "automatic",
      d.delivery_complete() ? ", delivery-complete writes" : ", transmit-complete writes only");
  return std::unique_ptr<Transport>(std::make_unique<FabricTransport>(std::move(doms), std::move(numa), ""));
}

absl::StatusOr<std::unique_ptr<Transport>> CreateFabricTransport(const TransportOptions& opts) {
  return CreateFabricTransport(opts, FabricOptions{});
}

std::optional<FabricInfo> GetFabricInfo(const Transport& transport) {
  const auto* t = dynamic_cast<const FabricTransport*>(&transport);
  if (t == nullptr || !t->viable()) return std::nullopt;
  return t->Info();
}

}  // namespace wsync::transport::fabric
