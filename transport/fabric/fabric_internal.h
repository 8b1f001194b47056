#pragma once
// Pieces of the fabric backend shared by its .cc files (not part of the public interface).

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/fabric/fabric_hmem.h"
#include "transport/fabric/fabric_transport.h"
#include "transport/fabric/fabric_wire.h"
#include "transport/fabric/fi_api.h"
#include "transport/transport.h"

namespace wsync::transport::fabric {

// Closes any libfabric object (fi_close); logs a failure, never throws.
void CloseFid(fid* f, const char* what);

struct MrCloser {
  void operator()(fid_mr* mr) const { CloseFid(&mr->fid, "memory registration"); }
};
using MrPtr = std::unique_ptr<fid_mr, MrCloser>;

// Where registered memory lives: host memory, or CUDA device memory registered through FI_HMEM.
struct DeviceMemory {
  bool on_device = false;
  int cuda_ordinal = 0;
};

// FabricOptions with the environment and defaults applied, and what the provider negotiated.
struct Config {
  uint64_t max_piece = 4 << 20;
  uint32_t tx_depth = 64;
  uint64_t forced_mr_mode = 0;
  std::vector<std::string> domains;  // the domains (NICs) to open; empty: every one on the preferred fabric
  HmemMode hmem = HmemMode::kAuto;   // WSYNC_FABRIC_HMEM
  absl::Duration io_timeout = absl::Seconds(30);  // Post gives up waiting for room after this
  // A peer the provider accepts no write for, with nothing in flight, this long is taken for gone (Unavailable):
  // TransportOptions::send_progress_timeout, the tcp transport's bound for the same thing.
  absl::Duration peer_timeout = absl::Seconds(5);
};

// One fabric + domain (+ the completion queue that drives a manual-progress provider's receiving side). Shared by
// the transport, its regions and endpoints: closed after the last of them.
class Domain {
 public:
  ~Domain();
  // Opens the fabric and domain of `info` (owned from now on).
  static absl::StatusOr<std::shared_ptr<Domain>> Open(fi_info* info, const Config& cfg);

  fi_info* info() const { return info_; }
  fid_domain* domain() const { return domain_; }
  fid_cq* progress_cq() const { return progress_cq_; }
  const Config& config() const { return cfg_; }
  // The mr_mode bits this backend honours: the provider's plus the forced ones.
  uint64_t mr_mode() const { return mr_mode_; }
  bool local_mr() const { return (mr_mode_ & FI_MR_LOCAL) != 0; }
  bool virt_addr() const { return (mr_mode_ & FI_MR_VIRT_ADDR) != 0; }
  bool prov_key() const { return (mr_mode_ & FI_MR_PROV_KEY) != 0; }
  bool endpoint_mr() const { return (mr_mode_ & FI_MR_ENDPOINT) != 0; }
  // The provider itself requires FI_MR_ENDPOINT (not only forced): MRs are then bound to their endpoint with
  // fi_mr_bind and enabled. A forced bit keeps the per-endpoint bookkeeping but binds nothing: no provider Debian's
  // libfabric has implements fi_mr_bind to an endpoint (they answer FI_ENOSYS).
  bool binds_mr_to_endpoint() const { return (info_->domain_attr->mr_mode & FI_MR_ENDPOINT) != 0; }
  bool delivery_complete() const { return delivery_complete_; }
  // Device memory can be registered (the domain was opened with FI_HMEM).
  bool hmem() const { return (info_->caps & FI_HMEM) != 0; }
  uint64_t max_msg_size() const { return max_msg_; }
  uint32_t tx_depth() const { return tx_depth_; }
  std::string provider() const;
  std::string fabric_name() const;
  // Held while an endpoint is bound to or closed from the progress queue: the provider (tcp;ofi_rxm) does not
  // tolerate an endpoint going away while another thread progresses it through that queue.
  std::unique_lock<std::mutex> PauseProgress() { return std::unique_lock<std::mutex>(progress_mu_); }
  // Counts the threads polling an endpoint's own completion queue (in Post or Wait), which progresses that endpoint
  // as a read of the progress queue does: the progress thread does not spin beside them (fabric_progress.h).
  class Driving {
   public:
    explicit Driving(Domain& d) : d_(d) { d_.driving_.fetch_add(1, std::memory_order_relaxed); }
    ~Driving() { d_.driving_.fetch_sub(1, std::memory_order_relaxed); }
    Driving(const Driving&) = delete;
    Driving& operator=(const Driving&) = delete;

   private:
    Domain& d_;
  };

  // Whether writes are expected now (the transport's write window is open): the progress thread then never pauses
  // between reads (fabric_progress.h).
  void ExpectWrites(bool expected) { expect_writes_.store(expected, std::memory_order_relaxed); }

  // Registers [addr, addr+len) with `access`. With app keys the key is `key` (0: a fresh random one; a key in use
  // is retried with another), with provider keys it is the provider's (a forced prov_key still asks for a fresh
  // random key, never a remembered one). `ep` (FI_MR_ENDPOINT): the endpoint the MR is bound to before it is enabled.
  // Device memory (`dev`) is registered with fi_mr_regattr as FI_HMEM_CUDA memory.
  absl::StatusOr<MrPtr> RegisterMr(void* addr, uint64_t len, uint64_t access, uint64_t key, fid_ep* ep,
                                   const char* what, const DeviceMemory& dev = {});

 private:
  Domain() = default;
  void ProgressLoop();

  fi_info* info_ = nullptr;
  fid_fabric* fabric_ = nullptr;
  fid_domain* domain_ = nullptr;
  fid_cq* progress_cq_ = nullptr;
  std::mutex progress_mu_;  // held by the progress thread around each read of progress_cq_
  std::thread progress_;
  std::atomic<bool> stop_{false};
  std::atomic<int> driving_{0};  // see Driving
  std::atomic<bool> expect_writes_{false};  // see ExpectWrites
  std::mutex stop_mu_;  // with stop_cv_: an idle progress thread's pause ends at once on destruction
  std::condition_variable stop_cv_;
  Config cfg_;
  uint64_t mr_mode_ = 0;
  bool delivery_complete_ = false;
  uint64_t max_msg_ = 0;
  uint32_t tx_depth_ = 0;
};

// Who a transport instance is, as peers see it in connection info and descriptors.
struct Identity {
  uint64_t transport_id = 0;
  std::string owner;  // "host/pid N/tXXXX [provider]"
};

// The receiving side's remote-write MRs (the write window and the grants, see fabric_transport.h). Shared by the
// transport, its regions and granted endpoints. Thread-safe; an MR is registered or closed only under mu_.
class Gate {
 public:
  explicit Gate(std::shared_ptr<Domain> dom) : dom_(std::move(dom)) {}

  // One remote-writable MR: registered while `wanted` holds, under the same key when the transport chose it.
  struct Entry {
    void* addr = nullptr;
    uint64_t len = 0;
    uint64_t key = 0;      // 0 until first registered
    fid_ep* ep = nullptr;  // FI_MR_ENDPOINT: the granted endpoint it is bound to
    DeviceMemory dev;
    MrPtr mr;
  };
  // A region's own remote MR (its descriptor's key). Under FI_MR_ENDPOINT that one has no endpoint to be bound to
  // and stays unregistered; instead every plain endpoint gets an MR of its own for the region (`bound`), under
  // the same window rules, whose key travels in that endpoint's connection info.
  struct Plain {
    Entry e;
    uint64_t region_id = 0;
    std::vector<Entry> bound;
  };
  // A write grant: one MR per granted region, for one endpoint.
  struct Grant {
    Transport::WriteGrant info;
    std::vector<uint64_t> region_ids;
    std::vector<Entry> entries;
    bool live = true;
  };

  // Adds a region's own remote MR (registered now when the state allows) and returns it; the region removes it.
  absl::StatusOr<std::shared_ptr<Plain>> AddPlain(uint64_t region_id, void* addr, uint64_t len,
                                                  const DeviceMemory& dev = {});
  void RemovePlain(const std::shared_ptr<Plain>& p);
  struct Range {
    void* addr = nullptr;
    uint64_t len = 0;
    DeviceMemory dev;
  };
  absl::StatusOr<std::shared_ptr<Grant>> AddGrant(Transport::WriteGrant info, std::vector<uint64_t> ids,
                                                  std::vector<Range> ranges, fid_ep* ep);
  void RemoveGrant(const std::shared_ptr<Grant>& g);
  // False once `g` was revoked (Revoke) or removed.
  bool GrantLive(const Grant& g) const;
  // The keys a granted endpoint's LocalInfo carries.
  std::vector<GrantedRegion> GrantKeys(const Grant& g) const;
  uint64_t PlainKey(const Plain& p) const;
  // FI_MR_ENDPOINT: gives the plain endpoint `ep` an MR bound to it for every region registered so far (a region
  // registered later is not writable through it: its peer could not learn the key); BoundKeys lists their keys,
  // UnbindPlain closes them (before the endpoint is closed).
  absl::Status BindPlain(fid_ep* ep);
  std::vector<GrantedRegion> BoundKeys(fid_ep* ep) const;
  void UnbindPlain(fid_ep* ep);

  absl::Status SetWindow(bool open);
  absl::Status RequireGrants(bool require);
  // Revokes every grant for which `keep` is false (closes its MRs for good).
  void Revoke(const std::function<bool(const Transport::WriteGrant&)>& keep);

 private:
  bool PlainWantedLocked() const { return !require_grants_ && (open_ || !enforced_); }
  bool GrantWantedLocked(const Grant& g) const { return g.live && (open_ || !enforced_); }
  absl::Status SyncLocked(Entry& e, bool wanted, const char* what);
  absl::Status ApplyLocked();

  std::shared_ptr<Domain> dom_;
  mutable std::mutex mu_;
  bool enforced_ = false;
  bool open_ = true;
  bool require_grants_ = false;
  std::vector<std::shared_ptr<Plain>> plain_;
  std::vector<std::shared_ptr<Grant>> grants_;
};

// A region registered in every domain of its transport (one local MR and, unless it is a source's memory, one
// remote-write MR per domain, index for index).
class FabricLocalRegion final : public LocalRegion {
 public:
  FabricLocalRegion(std::vector<std::shared_ptr<Domain>> doms, std::vector<std::shared_ptr<Gate>> gates, Identity id,
                    uint64_t region_id, void* addr, uint64_t len, std::vector<MrPtr> local,
                    std::vector<std::shared_ptr<Gate::Plain>> plain, DeviceMemory dev = {})
      : doms_(std::move(doms)),
        gates_(std::move(gates)),
        id_(std::move(id)),
        region_id_(region_id),
        addr_(addr),
        len_(len),
        local_(std::move(local)),
        plain_(std::move(plain)),
        dev_(dev) {}
  ~FabricLocalRegion() override {
    for (size_t i = 0; i < plain_.size(); ++i) gates_[i]->RemovePlain(plain_[i]);
  }

  void* addr() const override { return addr_; }
  uint64_t length() const override { return len_; }
  std::string Descriptor() const override;

  uint64_t transport_id() const { return id_.transport_id; }
  uint64_t region_id() const { return region_id_; }
  bool remote_write() const { return !plain_.empty(); }
  const DeviceMemory& device() const { return dev_; }
  // The local MR's descriptor in domain `dom` for FI_MR_LOCAL (null when there is none: a zero-length region, or
  // FI_MR_ENDPOINT where endpoints register their own).
  void* desc(size_t dom) const { return dom < local_.size() && local_[dom] ? fi_mr_desc(local_[dom].get()) : nullptr; }
  // The address remote writes into this region start from (the descriptor's addr_base); one mr_mode for all domains.
  uint64_t addr_base() const { return doms_[0]->virt_addr() ? reinterpret_cast<uintptr_t>(addr_) : 0; }

 private:
  std::vector<std::shared_ptr<Domain>> doms_;  // first: released after the MRs below
  std::vector<std::shared_ptr<Gate>> gates_;
  Identity id_;
  uint64_t region_id_;
  void* addr_;
  uint64_t len_;
  std::vector<MrPtr> local_;                         // per domain; empty entries for a zero-length region
  std::vector<std::shared_ptr<Gate::Plain>> plain_;  // per domain; empty for a source's memory
  DeviceMemory dev_;
};

class FabricRemoteRegion final : public RemoteRegion {
 public:
  explicit FabricRemoteRegion(RegionDesc desc) : desc_(std::move(desc)) {}
  uint64_t length() const override { return desc_.length; }
  const RegionDesc& desc() const { return desc_; }

 private:
  RegionDesc desc_;
};

// Creates an endpoint on `dom`, the transport's domain number `domain_index`, whose remote-write MRs `gate` holds
// (defined in fabric_endpoint.cc). With `grant`, it registers the granted regions' MRs (bound to it under
// FI_MR_ENDPOINT) and its LocalInfo carries their keys; the grant is removed from `gate` with the endpoint.
struct GrantRequest {
  Transport::WriteGrant info;
  std::vector<const FabricLocalRegion*> regions;
};
absl::StatusOr<std::unique_ptr<Endpoint>> NewFabricEndpoint(std::shared_ptr<Domain> dom, std::shared_ptr<Gate> gate,
                                                            const Identity& id, const GrantRequest* grant,
                                                            uint32_t domain_index);

}  // namespace wsync::transport::fabric
