#pragma once
// Pieces of the verbs backend shared by its .cc files (not part of the public interface).

#include <cstdint>
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

class VerbsLocalRegion final : public LocalRegion {
 public:
  VerbsLocalRegion(std::shared_ptr<DeviceSet> devices, Identity id, void* addr, uint64_t len, uint64_t chunk,
                   std::vector<MrPtr> mrs, std::vector<int> preferred)
      : devices_(std::move(devices)),
        id_(std::move(id)),
        addr_(addr),
        len_(len),
        chunk_(chunk),
        mrs_(std::move(mrs)),
        preferred_(std::move(preferred)) {}

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

 private:
  std::shared_ptr<DeviceSet> devices_;  // first: released after every MR below
  Identity id_;
  void* addr_;
  uint64_t len_;
  uint64_t chunk_;
  std::vector<MrPtr> mrs_;  // [device * num_chunks + chunk]
  std::vector<int> preferred_;
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
// per QP: a QP carries IBV_ACCESS_REMOTE_WRITE only while the window is open. Closing clears the flag on every live
// QP (an RTS→RTS modify, no reconnection); a peer's write then draws a NAK (its batch fails, nothing is written)
// and the responder QP goes to the error state: that connection is dead and counted as refused; the peer
// reconnects. Idle connections survive a close/open cycle unchanged.
// Thread-safe. A QP's access flags change only under mu, so Add/Remove/Set never race a QP's state transitions.
class WriteWindow {
 public:
  // Access flags a QP is given at INIT (and keeps, until the next Set).
  int Access() const;
  // Until the first Set the window is open and not enforced (a transport used as a sender, tests, benchmarks).
  absl::Status Set(bool open);
  // Registers a QP in INIT (its flags are set here, under the lock) / forgets it before it is destroyed.
  absl::Status Add(ibv_qp* qp);
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
  int AccessLocked() const;
  void CountLocked();
  mutable std::mutex mu_;
  bool enforced_ = false;
  bool open_ = true;
  std::map<ibv_qp*, bool> qps_;  // → already counted as refused
  uint64_t refused_ = 0;
};

// Creates an endpoint with its QPs in INIT (defined in verbs_endpoint.cc), registered with `window`.
absl::StatusOr<std::unique_ptr<Endpoint>> NewVerbsEndpoint(std::shared_ptr<DeviceSet> devices, const Config& cfg,
                                                           const Identity& id, std::shared_ptr<WriteWindow> window);
std::optional<VerbsEndpointStats> GetVerbsEndpointStatsImpl(const Endpoint& endpoint);

}  // namespace wsync::transport::verbs
