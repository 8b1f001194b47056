#pragma once
// Pieces of the verbs backend shared by its .cc files (not part of the public interface).

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "transport/transport.h"
#include "transport/verbs/verbs_device.h"
#include "transport/verbs/verbs_handles.h"
#include "transport/verbs/verbs_transport.h"
#include "transport/verbs/verbs_wire.h"

namespace wsync::transport::verbs {

// VerbsOptions with the environment and defaults applied.
struct Config {
  uint64_t max_mr_chunk = 0;  // 0: device limit only
  int qps_per_device = 2;
  uint64_t stripe_bytes = 1 << 20;
  uint32_t max_send_wr = 256;
  uint32_t signal_every = 32;
  uint8_t qp_timeout = 14;
  // 6, not 7: soft-RoCE (rdma_rxe) treats retry_cnt 7 as "retry forever", so a vanished peer would hang.
  uint8_t retry_cnt = 6;
  absl::Duration io_timeout = absl::Seconds(30);  // Post gives up waiting for send-queue space after this
  bool zero_psn = false;                          // VerbsOptions::zero_psn
};

// Who a transport instance is, as peers see it in connection info and descriptors.
struct Identity {
  uint64_t transport_id = 0;
  std::string owner;  // "host/pid N/tXXXX [dev,...]"
};

// Registers [offset, offset + n) of a region's memory in a protection domain, with the region's access flags.
using ReRegister = std::function<ibv_mr*(ibv_pd*, uint64_t offset, uint64_t n)>;

class VerbsLocalRegion final : public LocalRegion {
 public:
  VerbsLocalRegion(std::shared_ptr<DeviceSet> devices, Identity id, void* addr, uint64_t len, uint64_t chunk,
                   std::vector<MrPtr> mrs, std::vector<int> preferred, bool remote_write, ReRegister reg)
      : devices_(std::move(devices)),
        id_(std::move(id)),
        addr_(addr),
        len_(len),
        chunk_(chunk),
        mrs_(std::move(mrs)),
        preferred_(std::move(preferred)),
        remote_write_(remote_write),
        reg_(std::move(reg)) {}

  void* addr() const override { return addr_; }
  uint64_t length() const override { return len_; }
  std::string Descriptor() const override;

  uint64_t chunk_size() const { return chunk_; }
  uint32_t num_chunks() const {
    return static_cast<uint32_t>(devices_->devices.empty() ? 0 : mrs_.size() / devices_->devices.size());
  }
  uint32_t lkey(int device, uint64_t chunk) const { return mrs_[device * num_chunks() + chunk]->lkey; }
  const std::vector<int>& preferred_devices() const { return preferred_; }
  const DeviceSet& devices() const { return *devices_; }
  uint64_t transport_id() const { return id_.transport_id; }
  // Whether peers may write into it (RegisterMemory/RegisterSink) or not (RegisterSourceMemory).
  bool remote_write() const { return remote_write_; }
  // The address remote writes target (the descriptor's base).
  uint64_t base() const { return reinterpret_cast<uintptr_t>(addr_); }
  // Registers a piece of the same memory in another protection domain (a write grant's).
  ibv_mr* Register(ibv_pd* pd, uint64_t offset, uint64_t n) const { return reg_(pd, offset, n); }

 private:
  std::shared_ptr<DeviceSet> devices_;  // first: released after every MR below
  Identity id_;
  void* addr_;
  uint64_t len_;
  uint64_t chunk_;
  std::vector<MrPtr> mrs_;  // [device * num_chunks + chunk]
  std::vector<int> preferred_;
  bool remote_write_;
  ReRegister reg_;  // may hold what the registration needs (a dma-buf fd)
};

// A write grant's own protection domains (one per device) with MRs for exactly the granted regions
// (docs/security.md, "Write grants (verbs)"). The granted endpoint's QPs are created in these PDs, so the NIC lets
// a peer write through them only into these MRs; the regions' own MRs (in the devices' PDs, whose rkeys travel in
// descriptors) are out of reach of these QPs. Registered once per grant (per source connection), never per update.
struct GrantDomain {
  std::shared_ptr<DeviceSet> devices;  // first: the device contexts outlive the PDs
  std::vector<PdPtr> pds;              // [device index]
  std::vector<MrPtr> mrs;              // after pds: deregistered first
  std::vector<GrantedRegion> regions;  // what the endpoint's LocalInfo tells the peer
  Transport::WriteGrant info;
  // False once revoked: the window then gives the grant's QPs no remote write.
  std::shared_ptr<std::atomic<bool>> live = std::make_shared<std::atomic<bool>>(true);
};

class VerbsRemoteRegion final : public RemoteRegion {
 public:
  explicit VerbsRemoteRegion(RegionDesc desc) : desc_(std::move(desc)) {}
  uint64_t length() const override { return desc_.length; }
  const RegionDesc& desc() const { return desc_; }
  uint32_t rkey(int device, uint64_t chunk) const { return desc_.rkeys[device * desc_.num_chunks + chunk]; }

 private:
  RegionDesc desc_;
};

// The receiving side's write window (docs/security.md, "Write windows (verbs)"), shared by a transport and every
// endpoint it made (endpoints may outlive the transport). Peers write through our QPs, so remote write is granted
// per QP: a QP carries IBV_ACCESS_REMOTE_WRITE only while the window is open — and, once grants are required, only
// if it belongs to a granted endpoint whose grant is live. Closing (or revoking) clears the flag on the QPs
// concerned (an RTS→RTS modify, no reconnection); a peer's write then draws a NAK (its batch fails, nothing is
// written) and the responder QP goes to the error state: that connection is dead and counted as refused; the peer
// reconnects. Idle connections survive a close/open cycle unchanged. A write through a granted QP into memory
// outside its grant is refused the same way (by the NIC's protection-domain check) and counted the same way.
// Thread-safe. A QP's access flags change only under mu, so Add/Remove/Set never race a QP's state transitions.
class WriteWindow {
 public:
  // Access flags a QP is given at INIT before Add sets its own.
  int Access() const;
  // Until the first Set the window is open and not enforced (a transport used as a sender, tests, benchmarks).
  absl::Status Set(bool open);
  // With `require`, QPs of plain (ungranted) endpoints get no remote write at all.
  absl::Status RequireGrants(bool require);
  // Re-applies every QP's flags (after grants were revoked).
  absl::Status Refresh();
  // Registers a QP in INIT (its flags are set here, under the lock) / forgets it before it is destroyed.
  // `grant_live`: the QP's grant (null for a plain endpoint's QP).
  absl::Status Add(ibv_qp* qp, std::shared_ptr<std::atomic<bool>> grant_live);
  void Remove(ibv_qp* qp);
  // Forgets a QP and moves it to the error state (Endpoint::Cancel): its outstanding WRs flush, it accepts no more
  // posts, and it is not counted as refused. Under the lock, so it never races Set's RTS → RTS modify. The QP's
  // owner still calls Remove (a no-op then).
  absl::Status Kill(ibv_qp* qp);
  // Runs `f` under the lock (the endpoint moves its QPs INIT → RTR → RTS inside it).
  template <typename F>
  auto Locked(F&& f) {
    std::lock_guard<std::mutex> l(mu_);
    return f();
  }
  // Connections refused so far: QPs found in the error state while the window was enforced (counted once each).
  uint64_t Refused();

 private:
  struct QpEntry {
    bool counted = false;                           // already counted as refused
    std::shared_ptr<std::atomic<bool>> grant_live;  // null: a plain endpoint's QP
  };
  int AccessLocked(const QpEntry& e) const;
  absl::Status ApplyLocked(const char* what);
  void CountLocked();
  mutable std::mutex mu_;
  bool enforced_ = false;
  bool open_ = true;
  bool require_grants_ = false;
  std::map<ibv_qp*, QpEntry> qps_;
  uint64_t refused_ = 0;
};

// Creates an endpoint with its QPs in INIT (defined in verbs_endpoint.cc), registered with `window`. With `grant`
// its QPs are created in the grant's protection domains and its LocalInfo lists the granted regions' rkeys.
absl::StatusOr<std::unique_ptr<Endpoint>> NewVerbsEndpoint(std::shared_ptr<DeviceSet> devices, const Config& cfg,
                                                           const Identity& id, std::shared_ptr<WriteWindow> window,
                                                           std::shared_ptr<GrantDomain> grant = nullptr);
std::optional<VerbsEndpointStats> GetVerbsEndpointStatsImpl(const Endpoint& endpoint);

}  // namespace wsync::transport::verbs
