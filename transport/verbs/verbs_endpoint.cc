// VerbsEndpoint: RC queue pairs, batched RDMA WRITE posting and completion tracking.

#include <fcntl.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "base/status.h"
#include "spdlog/spdlog.h"
#include "transport/verbs/verbs_internal.h"
#include "transport/verbs/verbs_transport.h"

namespace wsync::transport::verbs {
namespace {

// wr_id = (signal record sequence << kSeqShift) | position of the WR in its linked list.
constexpr int kSeqShift = 16;
constexpr uint64_t kPosMask = (uint64_t{1} << kSeqShift) - 1;
constexpr uint32_t kMaxListLen = 4096;
static_assert(kMaxListLen <= kPosMask, "a WR's position in its linked list must fit in the low wr_id bits");
constexpr int kPollBatch = 32;

absl::StatusCode CodeForCompletion(ibv_wc_status s) {
  switch (s) {
    case IBV_WC_RETRY_EXC_ERR:
    case IBV_WC_RNR_RETRY_EXC_ERR:
      return absl::StatusCode::kUnavailable;  // peer gone or unreachable: reconnect and retry
    case IBV_WC_REM_ACCESS_ERR:
    case IBV_WC_REM_INV_REQ_ERR:
    case IBV_WC_LOC_PROT_ERR:
      return absl::StatusCode::kFailedPrecondition;  // stale or mismatched registration: fix state first
    case IBV_WC_WR_FLUSH_ERR:
      return absl::StatusCode::kAborted;
    default:
      return absl::StatusCode::kInternal;
  }
}

const char* HintForCompletion(ibv_wc_status s) {
  switch (s) {
    case IBV_WC_RETRY_EXC_ERR:
      return "; the peer did not acknowledge (vanished, QP destroyed or unreachable)";
    case IBV_WC_RNR_RETRY_EXC_ERR:
      return "; the peer was not ready to receive";
    case IBV_WC_REM_ACCESS_ERR:
      return "; the peer rejected the access (region deregistered, not writable, outside this connection's write "
             "grant, or rkey/bounds mismatch)";
    case IBV_WC_REM_INV_REQ_ERR:
      return "; the peer refused the write (its write window is closed, or this connection's write grant was revoked "
             "or never given) or found the request invalid";
    default:
      return "";
  }
}

std::string QpStateName(ibv_qp_state s) {
  switch (s) {
    case IBV_QPS_RESET:
      return "RESET";
    case IBV_QPS_INIT:
      return "INIT";
    case IBV_QPS_RTR:
      return "RTR";
    case IBV_QPS_RTS:
      return "RTS";
    case IBV_QPS_SQD:
      return "SQD";
    case IBV_QPS_SQE:
      return "SQE";
    case IBV_QPS_ERR:
      return "ERR";
    default:
      return "UNKNOWN";
  }
}

class VerbsEndpoint final : public Endpoint {
 public:
  VerbsEndpoint(std::shared_ptr<DeviceSet> devices, const Config& cfg, const Identity& id,
                std::shared_ptr<WriteWindow> window, std::shared_ptr<GrantDomain> grant)
      : devices_(std::move(devices)), cfg_(cfg), id_(id), window_(std::move(window)), grant_(std::move(grant)) {}
  ~VerbsEndpoint() override {
    for (const Qp& qp : qps_)
      if (qp.qp) window_->Remove(qp.qp.get());
    if (epoll_fd_ >= 0) close(epoll_fd_);
    if (event_fd_ >= 0) close(event_fd_);
  }

  absl::Status Init() {
    std::random_device rd;
    std::mt19937 rng(rd());
    // CompletionFd: an epoll set over one completion channel per device (every CQ raises an event on its device's
    // channel once armed) and an eventfd Cancel writes.
    epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
    event_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (epoll_fd_ < 0 || event_fd_ < 0)
      return absl::UnavailableError(absl::StrCat("verbs endpoint: epoll/eventfd: ", std::strerror(errno)));
    WSYNC_RETURN_IF_ERROR(Watch(event_fd_));
    channels_.resize(devices_->devices.size());
    for (const auto& dev : devices_->devices) {
      CompChannelPtr& channel = channels_[dev->index];
      channel.reset(Ibv().create_comp_channel(dev->context.get()));
      if (!channel)
        return absl::UnavailableError(
            absl::StrCat("ibv_create_comp_channel on ", dev->name, ": ", std::strerror(errno)));
      if (fcntl(channel->fd, F_SETFL, fcntl(channel->fd, F_GETFL) | O_NONBLOCK) != 0)
        return absl::UnavailableError(absl::StrCat("completion channel of ", dev->name, ": ", std::strerror(errno)));
      WSYNC_RETURN_IF_ERROR(Watch(channel->fd));
    }
    for (const auto& dev : devices_->devices) {
      uint32_t max_wr = std::max<uint32_t>(1, std::min<uint32_t>(cfg_.max_send_wr, dev->max_qp_wr));
      for (int q = 0; q < cfg_.qps_per_device; ++q) {
        Qp qp;
        qp.dev = dev.get();
        qp.max_wr = max_wr;
        qp.psn = cfg_.zero_psn ? 0 : (rng() & 0xffffff);
        // Only signaled WRs complete normally, but a QP in error flushes every outstanding WR: size for all of them.
        qp.cq.reset(Ibv().create_cq(dev->context.get(), static_cast<int>(max_wr) + 1, nullptr,
                                    channels_[dev->index].get(), 0));
        if (!qp.cq) {
          return absl::UnavailableError(absl::StrCat("ibv_create_cq on ", dev->name, ": ", std::strerror(errno)));
        }
        if (int rc = ibv_req_notify_cq(qp.cq.get(), 0); rc != 0)
          return absl::UnavailableError(absl::StrCat("ibv_req_notify_cq on ", dev->name, ": ", std::strerror(rc)));
        ibv_qp_init_attr init{};
        init.send_cq = qp.cq.get();
        init.recv_cq = qp.cq.get();
        init.qp_type = IBV_QPT_RC;
        init.sq_sig_all = 0;
        init.cap.max_send_wr = max_wr;
        init.cap.max_recv_wr = 1;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        // A granted endpoint's QPs live in the grant's own PD: they reach only the granted regions' MRs.
        ibv_pd* pd = grant_ ? grant_->pds[dev->index].get() : dev->pd.get();
        qp.qp.reset(Ibv().create_qp(pd, &init));
        if (!qp.qp) {
          return absl::UnavailableError(
              absl::StrCat("ibv_create_qp on ", dev->name, " (max_send_wr ", max_wr, "): ", std::strerror(errno)));
        }
        ibv_qp_attr attr{};
        attr.qp_state = IBV_QPS_INIT;
        attr.pkey_index = 0;
        attr.port_num = dev->port;
        // The peer writes into our regions through this QP, while the write window is open (WriteWindow).
        attr.qp_access_flags = window_->Access();
        if (int rc =
                Ibv().modify_qp(qp.qp.get(), &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
            rc != 0) {
          return absl::UnavailableError(absl::StrCat("ibv_modify_qp(INIT) on ", dev->name, ": ", std::strerror(rc)));
        }
        qps_.push_back(std::move(qp));
        WSYNC_RETURN_IF_ERROR(window_->Add(qps_.back().qp.get(), grant_ ? grant_->live : nullptr));
      }
    }
    return absl::OkStatus();
  }

  std::string LocalInfo() const override {
    ConnInfo info;
    info.transport_id = id_.transport_id;
    info.owner = id_.owner;
    for (const Qp& qp : qps_) {
      WireQp w;
      w.qpn = qp.qp->qp_num;
      w.psn = qp.psn;
      std::memcpy(w.gid, qp.dev->gid.raw, sizeof(w.gid));
      w.lid = qp.dev->lid;
      w.port = qp.dev->port;
      w.mtu = static_cast<uint8_t>(qp.dev->active_mtu);
      w.link_layer = qp.dev->link_layer;
      w.device_index = static_cast<uint8_t>(qp.dev->index);
      info.qps.push_back(w);
    }
    if (grant_) {
      info.granted = true;
      info.grant = grant_->regions;
    }
    return EncodeConnInfo(info);
  }

  absl::Status Connect(const std::string& peer_info, absl::Duration timeout) override {
    if (connected_) return absl::FailedPreconditionError(absl::StrCat("already connected to ", peer_.owner));
    if (CheckCancel()) return Annotate(cancel_, "verbs endpoint was cancelled before it connected");
    WSYNC_ASSIGN_OR_RETURN(ConnInfo peer, DecodeConnInfo(peer_info));
    size_t n = std::min(qps_.size(), peer.qps.size());
    // Under the window's lock: a window change (or a Cancel) never sees a QP between INIT and RTS.
    absl::Status connected = window_->Locked([&]() -> absl::Status {
      for (size_t i = 0; i < n; ++i) {
        absl::Status s = ConnectQp(qps_[i], peer.qps[i]);
        if (!s.ok()) {
          return Annotate(s, absl::StrCat("connecting qp ", i, " (", qps_[i].dev->name, ") to ", peer.owner));
        }
      }
      return absl::OkStatus();
    });
    if (!connected.ok()) {
      // A Cancel that moved the QPs to the error state says more than the failed transition.
      if (CheckCancel()) return Annotate(cancel_, "verbs endpoint was cancelled while it connected");
      return connected;
    }
    active_ = n;
    backlog_.resize(n);
    peer_info_ = peer_info;
    peer_ = std::move(peer);
    for (const GrantedRegion& g : peer_.grant) peer_grant_[g.base] = &g;
    connected_ = true;
    spdlog::debug("verbs: endpoint {} connected to {} over {} QP(s)", id_.owner, peer_.owner, active_);
    return absl::OkStatus();
  }

  absl::StatusOr<BatchId> Post(absl::Span<const WriteRequest> writes) override;
  absl::Status Wait(BatchId batch, absl::Duration timeout) override;
  int CompletionFd() const override { return epoll_fd_; }
  std::string PeerName() const override { return connected_ ? peer_.owner : "(unconnected verbs peer)"; }

  // An RC QP pair serves the sender endpoint it was connected with alone (Endpoint::Reusable): a retried
  // ConnectTarget of that endpoint is answered with this one; any other sender endpoint needs a new pair.
  // connected_ and peer_info_ are set by Connect before the endpoint is shared.
  bool Reusable(const std::string& peer_info) const override {
    return grant_ != nullptr && connected_ && peer_info == peer_info_ && !cancelled_.load(std::memory_order_acquire) &&
           grant_->live->load();
  }

  // From any thread. Moves every QP (connected or not: qps_ is fixed after Init) to the error state, so the NIC
  // sends nothing more of this endpoint and flushes its queued WRs; the thread using the endpoint sees the flag at
  // its next poll (Wait and Post check it on every turn of their loops) and adopts the reason (CheckCancel).
  void Cancel(const absl::Status& why) override {
    {
      std::lock_guard<std::mutex> l(cancel_mu_);
      if (!cancel_why_.ok()) return;
      cancel_why_ = why.ok() ? absl::CancelledError("cancelled") : why;
    }
    // Before the QPs change state: a flush completion is then never taken for a failure of the link.
    cancelled_.store(true, std::memory_order_release);
    for (const Qp& qp : qps_) {
      absl::Status s = window_->Kill(qp.qp.get());
      if (!s.ok()) spdlog::warn("verbs: cancelling endpoint {}: {}", id_.owner, std::string(s.message()));
    }
    const uint64_t one = 1;
    ssize_t r = write(event_fd_, &one, sizeof(one));
    (void)r;  // only EAGAIN (the counter is full: readable already) can fail it
  }

  VerbsEndpointStats Stats() const {
    VerbsEndpointStats s = stats_;
    for (const Qp& qp : qps_) s.outstanding_wrs += qp.outstanding;
    s.cancelled = cancelled_.load(std::memory_order_acquire);
    for (size_t i = 0; i < active_; ++i) {
      s.qp_devices.push_back(qps_[i].dev->name);
      s.wrs_per_qp.push_back(qps_[i].wrs);
      s.bytes_per_qp.push_back(qps_[i].bytes);
    }
    return s;
  }

 private:
  // Members in acquisition order: devices (contexts, PDs) outlive every CQ and QP.
  struct Qp {
    Device* dev = nullptr;
    CqPtr cq;
    QpPtr qp;  // after cq: destroyed first
    uint32_t psn = 0;
    uint32_t max_wr = 0;
    uint32_t outstanding = 0;  // WRs posted and not yet retired by a signaled completion
    int remote_device = 0;
    uint64_t wrs = 0;
    uint64_t bytes = 0;
  };
  // One piece of a write, posted as one WR.
  struct Seg {
    uint32_t write_index;
    uint64_t src_offset;
    uint64_t dst_offset;
    uint64_t length;
    uint64_t dst_base;            // the destination region's address (errors name the region)
    const VerbsLocalRegion* src;  // the caller keeps both regions alive until the batch completed
    const VerbsRemoteRegion* dst;
  };
  // A linked list not yet posted: it waits in its QP's backlog for send-queue room (Post never blocks).
  struct Pending {
    BatchId batch;
    std::vector<Seg> segs;
  };
  // One linked list of WRs whose last WR is signaled.
  struct Signal {
    BatchId batch;
    uint32_t qp;
    std::vector<Seg> segs;
  };
  struct Batch {
    uint64_t pending = 0;  // signal records not yet completed
    absl::Status status;
  };

  absl::Status ConnectQp(Qp& qp, const WireQp& remote) {
    if (remote.link_layer != qp.dev->link_layer) {
      return absl::FailedPreconditionError("link layers differ (RoCE vs InfiniBand)");
    }
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_RTR;
    attr.path_mtu = static_cast<ibv_mtu>(std::min<int>(remote.mtu, qp.dev->active_mtu));
    attr.dest_qp_num = remote.qpn;
    attr.rq_psn = remote.psn;
    attr.max_dest_rd_atomic = 1;
    attr.min_rnr_timer = 12;
    attr.ah_attr.port_num = qp.dev->port;
    attr.ah_attr.dlid = remote.lid;
    bool any_gid = false;
    for (uint8_t b : remote.gid) any_gid |= (b != 0);
    if (qp.dev->link_layer == IBV_LINK_LAYER_ETHERNET || any_gid) {
      // RoCE always routes by GID; on InfiniBand a GRH is harmless when the peer has a GID.
      attr.ah_attr.is_global = 1;
      std::memcpy(attr.ah_attr.grh.dgid.raw, remote.gid, sizeof(remote.gid));
      attr.ah_attr.grh.sgid_index = static_cast<uint8_t>(qp.dev->gid_index);
      attr.ah_attr.grh.hop_limit = 64;
    }
    if (int rc = Ibv().modify_qp(qp.qp.get(), &attr,
                               IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                   IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
        rc != 0) {
      return absl::UnavailableError(absl::StrCat("ibv_modify_qp(RTR): ", std::strerror(rc)));
    }
    ibv_qp_attr rts{};
    rts.qp_state = IBV_QPS_RTS;
    rts.sq_psn = qp.psn;
    rts.timeout = cfg_.qp_timeout;
    rts.retry_cnt = cfg_.retry_cnt;
    rts.rnr_retry = 7;
    rts.max_rd_atomic = 1;
    if (int rc = Ibv().modify_qp(qp.qp.get(), &rts,
                               IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                   IBV_QP_MAX_QP_RD_ATOMIC);
        rc != 0) {
      return absl::UnavailableError(absl::StrCat("ibv_modify_qp(RTS): ", std::strerror(rc)));
    }
    qp.remote_device = remote.device_index;
    return absl::OkStatus();
  }

  // Marks the endpoint failed; the first failure is what every later call reports.
  void Break(const absl::Status& s) {
    if (broken_.ok()) {
      broken_ = s;
      spdlog::error("verbs: endpoint to {} failed: {}", PeerName(), std::string(s.message()));
    }
  }

  // The using thread's view of Cancel: true once it was called; the first time, the endpoint adopts its reason
  // (cancel_, and broken_ unless an earlier failure set it), so every loop that stops on broken_ stops.
  bool CheckCancel() {
    if (!cancelled_.load(std::memory_order_acquire)) return false;
    if (cancel_.ok()) {
      {
        std::lock_guard<std::mutex> l(cancel_mu_);
        cancel_ = cancel_why_;
      }
      if (broken_.ok()) broken_ = cancel_;
      spdlog::info("verbs: endpoint to {} cancelled: {}", PeerName(), std::string(cancel_.message()));
    }
    return true;
  }

  absl::Status Watch(int fd) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0)
      return absl::UnavailableError(absl::StrCat("verbs endpoint: epoll_ctl: ", std::strerror(errno)));
    return absl::OkStatus();
  }

  // Consumes CompletionFd's news before the CQs are polled: takes and acknowledges every channel event and re-arms
  // its CQ, so a completion after this raises a new event (one before it is found by the poll that follows).
  void ConsumeEvents() {
    uint64_t n;
    while (read(event_fd_, &n, sizeof(n)) == static_cast<ssize_t>(sizeof(n))) {
    }
    for (const CompChannelPtr& channel : channels_) {
      ibv_cq* cq = nullptr;
      void* ctx = nullptr;
      while (Ibv().get_cq_event(channel.get(), &cq, &ctx) == 0) {
        Ibv().ack_cq_events(cq, 1);
        if (int rc = ibv_req_notify_cq(cq, 0); rc != 0)
          Break(absl::InternalError(absl::StrCat("ibv_req_notify_cq to ", PeerName(), ": ", std::strerror(rc))));
      }
    }
  }

  // Retires what the CQs hold now (after a Cancel: the flushed WRs), without waiting.
  void DrainCompletions() {
    while (PollAll() > 0) {
    }
  }

  std::string QpLabel(uint32_t q) const {
    const Qp& qp = qps_[q];
    return absl::StrCat("qp ", q, " (", qp.dev->name, " qpn ", qp.qp->qp_num, ")");
  }

  absl::Status CompletionError(const ibv_wc& wc, uint32_t q, const Signal* sig) const {
    std::string where;
    if (sig != nullptr) {
      uint64_t pos = wc.wr_id & kPosMask;
      if (pos < sig->segs.size()) {
        const Seg& seg = sig->segs[pos];
        where = absl::StrFormat(", write #%d (dst offset %d, %d bytes, dst region at 0x%x) of batch %d",
                                seg.write_index, seg.dst_offset, seg.length, seg.dst_base, sig->batch);
        if (peer_.granted && peer_grant_.count(seg.dst_base) == 0)
          where += "; that region is outside the write grant of this connection";
      } else {
        where = absl::StrCat(", batch ", sig->batch);
      }
    }
    ibv_qp_attr attr{};
    ibv_qp_init_attr init{};
    std::string state;
    if (Ibv().query_qp(qps_[q].qp.get(), &attr, IBV_QP_STATE, &init) == 0) {
      state = absl::StrCat(", qp state ", QpStateName(attr.qp_state));
    }
    auto status = static_cast<ibv_wc_status>(wc.status);
    return absl::Status(CodeForCompletion(status),
                        absl::StrFormat("verbs write to peer %s failed: %s (wc status %d, vendor_err 0x%x) on %s%s%s%s",
                                        PeerName(), Ibv().wc_status_str(status), static_cast<int>(wc.status),
                                        wc.vendor_err, QpLabel(q), state, where, HintForCompletion(status)));
  }

  // Polls one QP's CQ once. Returns the number of completions handled.
  int PollQp(uint32_t q) {
    ibv_wc wcs[kPollBatch];
    int n = ibv_poll_cq(qps_[q].cq.get(), kPollBatch, wcs);
    if (n < 0) {
      Break(absl::InternalError(absl::StrCat("ibv_poll_cq on ", QpLabel(q), " to ", PeerName(), " failed")));
      return 0;
    }
    // An error completion is looked at only after Cancel's flag: a WR flushed by Cancel is the caller's reason.
    if (n > 0) CheckCancel();
    for (int i = 0; i < n; ++i) {
      const ibv_wc& wc = wcs[i];
      auto it = signals_.find(wc.wr_id >> kSeqShift);
      if (wc.status == IBV_WC_SUCCESS) {
        if (it != signals_.end()) Retire(q, it);
        continue;
      }
      const Signal* sig = it == signals_.end() ? nullptr : &it->second;
      absl::Status err;
      if (wc.status == IBV_WC_WR_FLUSH_ERR && !cancel_.ok()) {
        err = cancel_;
      } else if (wc.status == IBV_WC_WR_FLUSH_ERR && !broken_.ok()) {
        // Flushed because of an earlier failure: report the cause, not the flush.
        err = absl::AbortedError(absl::StrCat("flushed after an earlier failure: ", broken_.message()));
      } else {
        err = CompletionError(wc, q, sig);
      }
      Break(err);
      if (sig != nullptr) {
        auto b = batches_.find(sig->batch);
        if (b != batches_.end() && b->second.status.ok()) b->second.status = err;
        // The last WR of a list completes (with an error or flushed) after every earlier one: the list is done.
        if ((wc.wr_id & kPosMask) + 1 == sig->segs.size()) Retire(q, it);
      }
    }
    return n;
  }

  // A signaled list is finished: its WRs leave the send queue and its batch waits for one list fewer.
  void Retire(uint32_t q, std::unordered_map<uint64_t, Signal>::iterator it) {
    last_progress_ = absl::Now();
    qps_[q].outstanding -= static_cast<uint32_t>(it->second.segs.size());
    auto b = batches_.find(it->second.batch);
    if (b != batches_.end() && b->second.pending > 0) --b->second.pending;
    signals_.erase(it);
  }

  int PollAll() {
    int n = 0;
    for (uint32_t q = 0; q < active_; ++q) n += PollQp(q);
    return n;
  }

  // Backs off between empty polls: spin briefly, then yield, then sleep (the completion may need this CPU).
  static void Backoff(int empty_polls) {
    if (empty_polls < 64) return;
    if (empty_polls < 4096) {
      sched_yield();
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }

  // Posts `segs` on QP q as one linked list, last WR signaled.
  absl::Status PostList(uint32_t q, BatchId batch, std::vector<Seg> segs);
  // Posts backlog lists, one per QP in turn, while their send queues have room; never waits.
  void Pump();
  // Fails every backlog list's batch with broken_ and drops them (nothing of them was posted).
  void FailBacklog();
  // Breaks the endpoint when lists wait for room and no completion came for io_timeout.
  void CheckStall();

  std::shared_ptr<DeviceSet> devices_;
  Config cfg_;
  Identity id_;
  std::shared_ptr<WriteWindow> window_;  // before qps_: every QP is removed from it before it is destroyed
  std::shared_ptr<GrantDomain> grant_;   // before qps_: its PDs outlive the QPs created in them; null if plain
  std::vector<CompChannelPtr> channels_;  // [device index]; before qps_: every CQ is destroyed before its channel
  int epoll_fd_ = -1;                     // CompletionFd
  int event_fd_ = -1;                     // written by Cancel
  std::vector<Qp> qps_;
  size_t active_ = 0;  // QPs paired with a peer QP (a prefix of qps_)
  bool connected_ = false;
  std::string peer_info_;  // the LocalInfo of the sender endpoint Connect paired this one with
  ConnInfo peer_;
  // A granted peer's regions by base address (into peer_.grant): writes into them use the grant's rkeys.
  std::unordered_map<uint64_t, const GrantedRegion*> peer_grant_;
  absl::Status broken_;
  BatchId next_batch_ = 1;
  uint64_t next_seq_ = 1;
  size_t rr_cursor_ = 0;
  std::unordered_map<uint64_t, Signal> signals_;
  std::map<BatchId, Batch> batches_;
  std::vector<std::deque<Pending>> backlog_;  // [qp]: lists waiting for room in its send queue
  absl::Time last_progress_;                  // the last completion, or the Post that gave an idle endpoint work
  VerbsEndpointStats stats_;
  absl::Status cancel_;  // the using thread's copy of cancel_why_, once CheckCancel saw the flag
  // Cancel's side, shared with other threads: the flag is read on every poll, the reason under the lock.
  std::atomic<bool> cancelled_{false};
  std::mutex cancel_mu_;
  absl::Status cancel_why_;
  std::vector<ibv_send_wr> wr_buf_;
  std::vector<ibv_sge> sge_buf_;
};

absl::Status VerbsEndpoint::PostList(uint32_t q, BatchId batch, std::vector<Seg> segs) {
  Qp& qp = qps_[q];
  size_t n = segs.size();
  wr_buf_.assign(n, ibv_send_wr{});
  sge_buf_.assign(n, ibv_sge{});
  uint64_t seq = next_seq_++;
  Signal sig{batch, q, std::move(segs)};
  for (size_t k = 0; k < n; ++k) {
    const Seg& seg = sig.segs[k];
    const VerbsLocalRegion* src = seg.src;
    const VerbsRemoteRegion* dst = seg.dst;
    ibv_sge& sge = sge_buf_[k];
    sge.addr = reinterpret_cast<uintptr_t>(src->addr()) + seg.src_offset;
    sge.length = static_cast<uint32_t>(seg.length);
    sge.lkey = src->lkey(qp.dev->index, seg.src_offset / src->chunk_size());
    ibv_send_wr& wr = wr_buf_[k];
    wr.wr_id = (seq << kSeqShift) | k;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.send_flags = (k + 1 == n) ? IBV_SEND_SIGNALED : 0;
    wr.wr.rdma.remote_addr = dst->desc().base + seg.dst_offset;
    const uint64_t chunk = seg.dst_offset / dst->desc().chunk_size;
    wr.wr.rdma.rkey = dst->rkey(qp.remote_device, chunk);
    if (!peer_grant_.empty()) {
      // The peer granted this connection its own MRs; a region outside the grant keeps the descriptor's rkey,
      // which the peer's NIC refuses on this connection.
      auto g = peer_grant_.find(dst->desc().base);
      if (g != peer_grant_.end() && g->second->length == dst->desc().length &&
          g->second->chunk_size == dst->desc().chunk_size &&
          static_cast<uint32_t>(qp.remote_device) < g->second->num_devices)
        wr.wr.rdma.rkey = g->second->rkeys[qp.remote_device * g->second->num_chunks + chunk];
    }
    wr.next = (k + 1 == n) ? nullptr : &wr_buf_[k + 1];
    qp.bytes += seg.length;
  }
  ibv_send_wr* bad = nullptr;
  int rc = ibv_post_send(qp.qp.get(), wr_buf_.data(), &bad);
  ++stats_.post_calls;
  if (rc != 0) {
    size_t bad_pos = bad == nullptr ? 0 : static_cast<size_t>(bad - wr_buf_.data());
    const Seg& seg = sig.segs[std::min(bad_pos, n - 1)];
    return absl::UnavailableError(absl::StrCat("ibv_post_send to peer ", PeerName(), " on ", QpLabel(q),
                                               " failed: ", std::strerror(rc), ", write #", seg.write_index,
                                               " (dst offset ", seg.dst_offset, ")"));
  }
  qp.outstanding += static_cast<uint32_t>(n);
  qp.wrs += n;
  ++stats_.signaled_wrs;
  signals_.emplace(seq, std::move(sig));
  return absl::OkStatus();
}

void VerbsEndpoint::Pump() {
  bool more = true;
  bool full = false;
  while (more && broken_.ok() && !CheckCancel()) {
    more = false;
    for (uint32_t q = 0; q < active_ && broken_.ok(); ++q) {
      std::deque<Pending>& queue = backlog_[q];
      if (queue.empty()) continue;
      if (qps_[q].max_wr - qps_[q].outstanding < queue.front().segs.size()) {
        full = true;  // a completion of this QP makes room
        continue;
      }
      Pending p = std::move(queue.front());
      queue.pop_front();
      absl::Status s = PostList(q, p.batch, std::move(p.segs));
      if (!s.ok()) {
        // The list counted in its batch and was not posted: it fails the batch as the backlog does.
        Break(s);
        auto b = batches_.find(p.batch);
        if (b != batches_.end()) {
          if (b->second.pending > 0) --b->second.pending;
          if (b->second.status.ok()) b->second.status = s;
        }
        break;
      }
      more |= !queue.empty();
    }
  }
  if (full) ++stats_.send_queue_full_waits;
  if (!broken_.ok()) FailBacklog();
}

void VerbsEndpoint::FailBacklog() {
  for (std::deque<Pending>& queue : backlog_) {
    for (const Pending& p : queue) {
      auto b = batches_.find(p.batch);
      if (b == batches_.end()) continue;
      if (b->second.pending > 0) --b->second.pending;
      if (b->second.status.ok()) b->second.status = broken_;
    }
    queue.clear();
  }
}

void VerbsEndpoint::CheckStall() {
  bool waiting = false;
  for (const std::deque<Pending>& queue : backlog_) waiting |= !queue.empty();
  if (!waiting || absl::Now() - last_progress_ <= cfg_.io_timeout) return;
  Break(absl::DeadlineExceededError(absl::StrCat("verbs send queues to peer ", PeerName(), " made no progress for ",
                                                 absl::FormatDuration(cfg_.io_timeout))));
  FailBacklog();
}

absl::StatusOr<BatchId> VerbsEndpoint::Post(absl::Span<const WriteRequest> writes) {
  if (CheckCancel()) {
    DrainCompletions();
    return Annotate(cancel_, absl::StrCat("verbs endpoint to ", PeerName(), " was cancelled; re-create it"));
  }
  if (!connected_) return absl::FailedPreconditionError("verbs endpoint is not connected");
  if (!broken_.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("verbs endpoint to ", PeerName(), " failed earlier; re-create it: ", broken_.message()));
  }
  // Validate everything before posting anything.
  for (size_t i = 0; i < writes.size(); ++i) {
    const WriteRequest& w = writes[i];
    WSYNC_RETURN_IF_ERROR_CTX(ValidateWrite(w), "write #", i);
    const auto* src = dynamic_cast<const VerbsLocalRegion*>(w.src);
    const auto* dst = dynamic_cast<const VerbsRemoteRegion*>(w.dst);
    if (src == nullptr || dst == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("write #", i, ": regions do not belong to the verbs transport"));
    }
    if (src->transport_id() != id_.transport_id) {
      return absl::InvalidArgumentError(
          absl::StrCat("write #", i, ": source region was registered with another verbs transport"));
    }
    if (dst->desc().transport_id != peer_.transport_id) {
      return absl::InvalidArgumentError(absl::StrCat("write #", i, ": destination region belongs to ",
                                                     dst->desc().owner, ", but this endpoint is connected to ",
                                                     peer_.owner));
    }
    for (size_t q = 0; q < active_; ++q) {
      if (static_cast<uint32_t>(qps_[q].remote_device) >= dst->desc().num_devices) {
        return absl::InvalidArgumentError(absl::StrCat("write #", i, ": destination descriptor lists ",
                                                       dst->desc().num_devices, " device(s), peer qp ", q,
                                                       " uses device ", qps_[q].remote_device));
      }
    }
  }

  // Cut writes into WR-sized pieces: at source and destination MR chunk boundaries, at stripe_bytes and at the
  // port's max message size; spread the pieces round-robin over the QPs of the source's preferred devices.
  std::vector<std::vector<Seg>> per_qp(active_);
  std::vector<uint32_t> eligible;
  const VerbsLocalRegion* eligible_for = nullptr;
  for (size_t i = 0; i < writes.size(); ++i) {
    const WriteRequest& w = writes[i];
    const auto* src = static_cast<const VerbsLocalRegion*>(w.src);
    const auto* dst = static_cast<const VerbsRemoteRegion*>(w.dst);
    if (src != eligible_for) {
      eligible.clear();
      const auto& pref = src->preferred_devices();
      for (uint32_t q = 0; q < active_; ++q) {
        if (std::find(pref.begin(), pref.end(), qps_[q].dev->index) != pref.end()) eligible.push_back(q);
      }
      if (eligible.empty()) {  // peer offered fewer QPs than we have devices: use what is connected
        for (uint32_t q = 0; q < active_; ++q) eligible.push_back(q);
      }
      eligible_for = src;
    }
    uint64_t done = 0;
    while (done < w.length) {
      uint64_t s_off = w.src_offset + done;
      uint64_t d_off = w.dst_offset + done;
      uint32_t q = eligible[rr_cursor_++ % eligible.size()];
      uint64_t piece = std::min<uint64_t>(w.length - done, cfg_.stripe_bytes);
      piece = std::min(piece, src->chunk_size() - s_off % src->chunk_size());
      piece = std::min(piece, dst->desc().chunk_size - d_off % dst->desc().chunk_size);
      piece = std::min<uint64_t>(piece, qps_[q].dev->max_msg_sz == 0 ? (1u << 30) : qps_[q].dev->max_msg_sz);
      per_qp[q].push_back(Seg{static_cast<uint32_t>(i), s_off, d_off, piece, dst->desc().base, src, dst});
      done += piece;
    }
  }

  // Post never blocks (transport.h): the lists wait in their QP's backlog, what the send queues take now is posted,
  // and the rest follows from Wait as completions make room.
  BatchId id = next_batch_++;
  Batch& batch = batches_[id];
  bool idle = true;
  for (const std::deque<Pending>& queue : backlog_) idle &= queue.empty();
  if (idle) last_progress_ = absl::Now();
  for (uint32_t q = 0; q < active_; ++q) {
    const std::vector<Seg>& segs = per_qp[q];
    const size_t list = std::min<size_t>(cfg_.signal_every, qps_[q].max_wr);
    for (size_t begin = 0; begin < segs.size(); begin += list) {
      const size_t end = std::min(segs.size(), begin + list);
      backlog_[q].push_back(Pending{id, std::vector<Seg>(segs.begin() + begin, segs.begin() + end)});
      ++batch.pending;
    }
  }
  Pump();
  return id;
}

absl::Status VerbsEndpoint::Wait(BatchId batch, absl::Duration timeout) {
  ConsumeEvents();  // first: whatever the answer, this Wait is the owner's look (transport.h, CompletionFd)
  auto it = batches_.find(batch);
  if (it == batches_.end()) {
    return absl::NotFoundError(
        absl::StrCat("verbs endpoint to ", PeerName(), ": unknown or already waited batch ", batch));
  }
  absl::Time deadline = absl::Now() + timeout;
  int empty = 0;
  while (it->second.pending > 0 && it->second.status.ok()) {
    if (CheckCancel()) break;
    if (!broken_.ok()) {
      // Collect what already completed, then fail the rest with the endpoint's first error.
      while (PollAll() > 0) {
      }
      if (it->second.pending > 0 && it->second.status.ok()) {
        it->second.status =
            absl::Status(broken_.code(), absl::StrCat("batch ", batch, " not completed: ", broken_.message()));
      }
      break;
    }
    bool progressed = PollAll() > 0;
    Pump();
    if (!progressed) CheckStall();
    if (it->second.pending == 0 || !it->second.status.ok()) break;
    // Checked even while completions arrive, so a short timeout is honoured on a busy endpoint.
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("verbs batch ", batch, " to ", PeerName(), " still has ",
                                                      it->second.pending, " signaled list(s) outstanding after ",
                                                      absl::FormatDuration(timeout)));
    }
    if (progressed) {
      empty = 0;
    } else {
      Backoff(++empty);
    }
  }
  if (CheckCancel()) {
    // Whatever completed, the caller gave up on this batch: it is never reported as landed.
    batches_.erase(it);
    DrainCompletions();
    return Annotate(cancel_, absl::StrCat("verbs batch ", batch, " to ", PeerName(), " cancelled"));
  }
  absl::Status s = it->second.status;
  batches_.erase(it);
  return s;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Endpoint>> NewVerbsEndpoint(std::shared_ptr<DeviceSet> devices, const Config& cfg,
                                                           const Identity& id, std::shared_ptr<WriteWindow> window,
                                                           std::shared_ptr<GrantDomain> grant) {
  auto ep = std::make_unique<VerbsEndpoint>(std::move(devices), cfg, id, std::move(window), std::move(grant));
  WSYNC_RETURN_IF_ERROR(ep->Init());
  return std::unique_ptr<Endpoint>(std::move(ep));
}

std::optional<VerbsEndpointStats> GetVerbsEndpointStatsImpl(const Endpoint& endpoint) {
  const auto* ep = dynamic_cast<const VerbsEndpoint*>(&endpoint);
  if (ep == nullptr) return std::nullopt;
  return ep->Stats();
}

}  // namespace wsync::transport::verbs
