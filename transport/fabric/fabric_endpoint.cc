// FabricEndpoint: one FI_EP_RDM endpoint, RMA writes (fi_writemsg) and completion tracking.

#include <rdma/fi_cm.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "base/status.h"
#include "spdlog/spdlog.h"
#include "transport/fabric/fabric_internal.h"

namespace wsync::transport::fabric {
namespace {

constexpr int kPollBatch = 32;

template <typename T>
struct FidCloser {
  const char* what;
  void operator()(T* p) const { CloseFid(&p->fid, what); }
};
template <typename T>
using FidPtr = std::unique_ptr<T, FidCloser<T>>;

absl::StatusCode CodeForError(int err) {
  switch (err) {
    case FI_ECONNREFUSED:
    case FI_ECONNRESET:
    case FI_ECONNABORTED:
    case FI_ENOTCONN:
    case FI_EHOSTUNREACH:
    case FI_ENETUNREACH:
    case FI_ETIMEDOUT:
    case FI_EIO:
    case FI_ESHUTDOWN:
    case FI_ENOENT:  // sockets: fi_writemsg to a peer whose process is gone (no connection to it can be made)
      return absl::StatusCode::kUnavailable;  // peer gone or unreachable: reconnect and retry
    case FI_EACCES:
    case FI_EPERM:
    case FI_EKEYREJECTED:
    case FI_EINVAL:
    case FI_ECANCELED:  // tcp;ofi_rxm: the peer dropped a write whose key or range it refused
      return absl::StatusCode::kFailedPrecondition;
    default:
      return absl::StatusCode::kInternal;
  }
}

const char* HintForError(int err) {
  switch (err) {
    case FI_ECONNREFUSED:
    case FI_ECONNRESET:
    case FI_ENOTCONN:
    case FI_EHOSTUNREACH:
    case FI_ETIMEDOUT:
    case FI_EIO:
    case FI_ENOENT:
      return "; the peer did not answer (its endpoint closed, process gone or unreachable)";
    case FI_EACCES:
    case FI_EPERM:
    case FI_EKEYREJECTED:
    case FI_ECANCELED:
      return "; the peer refused the write (its write window is closed, this connection's grant was revoked or does "
             "not cover the region, the region is a source's memory, or its key or bounds do not match)";
    default:
      return "";
  }
}

// The error a failed completion stands for. tcp;ofi_rxm cancels the writes queued on a connection it lost with
// FI_ECANCELED, the socket's errno in prov_errno (ENOTCONN, ECONNRESET, EPIPE: the peer is gone); a write the peer
// refused is FI_ECANCELED too, but with another prov_errno (ENOENT: no such key).
int EffectiveError(int err, int prov_errno) {
  if (err != FI_ECANCELED) return err;
  switch (prov_errno) {
    case ENOTCONN:
    case ECONNRESET:
    case EPIPE:
    case ECONNREFUSED:
    case ECONNABORTED:
    case EHOSTUNREACH:
    case ETIMEDOUT:
      return FI_ENOTCONN;
    default:
      return err;
  }
}

class FabricEndpoint final : public Endpoint {
 public:
  FabricEndpoint(std::shared_ptr<Domain> dom, std::shared_ptr<Gate> gate, const Identity& id, uint32_t domain_index)
      : dom_(std::move(dom)), gate_(std::move(gate)), id_(id), domain_index_(domain_index) {}
  ~FabricEndpoint() override {
    // The grant's MRs are bound to ep_ (FI_MR_ENDPOINT): closed before it.
    if (grant_ != nullptr) gate_->RemoveGrant(grant_);
    if (bound_plain_) gate_->UnbindPlain(ep_.get());
    local_mrs_.clear();
    auto pause = dom_->PauseProgress();
    ep_.reset();
  }

  absl::Status Init(const GrantRequest* grant) {
    const std::string prov = dom_->provider();
    ops_.resize(dom_->tx_depth());
    for (size_t i = 0; i < ops_.size(); ++i) free_.push_back(&ops_[i]);
    fid_ep* ep = nullptr;
    if (int rc = fi_endpoint(dom_->domain(), dom_->info(), &ep, nullptr); rc != 0)
      return absl::UnavailableError(absl::StrCat("fabric: fi_endpoint (", prov, "): ", FiError(rc)));
    ep_.reset(ep);
    fi_av_attr aa{};
    aa.type = FI_AV_TABLE;
    aa.count = 4;
    fid_av* av = nullptr;
    if (int rc = fi_av_open(dom_->domain(), &aa, &av, nullptr); rc != 0)
      return absl::UnavailableError(absl::StrCat("fabric: fi_av_open (", prov, "): ", FiError(rc)));
    av_.reset(av);
    fi_cq_attr ca{};
    ca.format = FI_CQ_FORMAT_CONTEXT;
    ca.size = ops_.size() + 16;
    ca.wait_obj = FI_WAIT_NONE;
    fid_cq* cq = nullptr;
    if (int rc = fi_cq_open(dom_->domain(), &ca, &cq, nullptr); rc != 0)
      return absl::UnavailableError(absl::StrCat("fabric: fi_cq_open (", prov, "): ", FiError(rc)));
    cq_.reset(cq);
    if (int rc = fi_ep_bind(ep_.get(), &av_->fid, 0); rc != 0)
      return absl::UnavailableError(absl::StrCat("fabric: fi_ep_bind(av) (", prov, "): ", FiError(rc)));
    if (int rc = fi_ep_bind(ep_.get(), &cq_->fid, FI_TRANSMIT); rc != 0)
      return absl::UnavailableError(absl::StrCat("fabric: fi_ep_bind(tx cq) (", prov, "): ", FiError(rc)));
    {
      auto pause = dom_->PauseProgress();
      if (int rc = fi_ep_bind(ep_.get(), &dom_->progress_cq()->fid, FI_RECV); rc != 0)
        return absl::UnavailableError(absl::StrCat("fabric: fi_ep_bind(rx cq) (", prov, "): ", FiError(rc)));
      if (int rc = fi_enable(ep_.get()); rc != 0) {
        return absl::UnavailableError(absl::StrCat(
            "fabric: fi_enable (", prov, "): ", FiError(rc),
            rc == -FI_EINVAL && absl::StrContains(prov, "ofi_rxm")
                ? " (ofi_rxm sizes its completion queues for FI_UNIVERSE_SIZE peers, default 256: a device with "
                  "fewer completion queue entries, such as rxe, needs a smaller FI_UNIVERSE_SIZE)"
                : ""));
      }
    }
    std::string name(256, '\0');
    size_t len = name.size();
    int rc = fi_getname(&ep_->fid, name.data(), &len);
    if (rc == -FI_ETOOSMALL) {
      name.resize(len);
      rc = fi_getname(&ep_->fid, name.data(), &len);
    }
    if (rc != 0) return absl::UnavailableError(absl::StrCat("fabric: fi_getname (", prov, "): ", FiError(rc)));
    name.resize(len);
    address_ = std::move(name);
    if (grant != nullptr) {
      std::vector<uint64_t> ids;
      std::vector<Gate::Range> ranges;
      for (const FabricLocalRegion* r : grant->regions) {
        ids.push_back(r->region_id());
        ranges.push_back(Gate::Range{r->addr(), r->length(), r->device()});
      }
      WSYNC_ASSIGN_OR_RETURN(grant_, gate_->AddGrant(grant->info, std::move(ids), std::move(ranges), ep_.get()));
    } else if (dom_->endpoint_mr()) {
      // FI_MR_ENDPOINT: the regions' own remote MRs cannot serve this endpoint; it gets MRs bound to it.
      bound_plain_ = true;
      WSYNC_RETURN_IF_ERROR(gate_->BindPlain(ep_.get()));
    }
    return absl::OkStatus();
  }

  std::string LocalInfo() const override {
    ConnInfo info;
    info.transport_id = id_.transport_id;
    info.owner = id_.owner;
    info.provider = dom_->provider();
    info.fabric = dom_->fabric_name();
    info.addr_format = dom_->info()->addr_format;
    info.address = address_;
    info.domain_index = domain_index_;
    info.domain = dom_->info()->domain_attr->name != nullptr ? dom_->info()->domain_attr->name : "";
    if (grant_ != nullptr) {
      info.granted = true;
      info.grant = gate_->GrantKeys(*grant_);
    } else if (bound_plain_) {
      // Per-connection keys like a grant's, for every region registered before this endpoint.
      info.granted = true;
      info.grant = gate_->BoundKeys(ep_.get());
    }
    return EncodeConnInfo(info);
  }

  absl::Status Connect(const std::string& peer_info, absl::Duration timeout) override {
    (void)timeout;  // connectionless: inserting the address does not wait for the peer
    if (connected_) return absl::FailedPreconditionError(absl::StrCat("already connected to ", peer_.owner));
    if (CheckCancel()) return Annotate(cancel_, "fabric endpoint was cancelled before it connected");
    const std::string prov = dom_->provider();
    auto decoded = DecodeConnInfo(peer_info);
    if (!decoded.ok())
      return Annotate(decoded.status(),
                      absl::StrCat("fabric endpoint ", id_.owner, " (provider ", prov, ") cannot connect to the peer"));
    ConnInfo peer = *std::move(decoded);
    if (peer.provider != prov || peer.addr_format != dom_->info()->addr_format || peer.fabric != dom_->fabric_name()) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "fabric peer %s uses provider \"%s\" on fabric \"%s\" (address format %d); this endpoint %s uses \"%s\" on "
          "\"%s\" (address format %d): both sides must run the same provider on the same fabric "
          "(--fabric-provider)",
          peer.owner, peer.provider, peer.fabric, peer.addr_format, id_.owner, prov, dom_->fabric_name(),
          dom_->info()->addr_format));
    }
    fi_addr_t addr = FI_ADDR_NOTAVAIL;
    const int n = fi_av_insert(av_.get(), peer.address.data(), 1, &addr, 0, nullptr);
    if (n != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("fabric: the address of peer ", peer.owner, " (provider ", prov, ", fabric ", peer.fabric,
                       ") was refused by fi_av_insert: ", n < 0 ? FiError(n) : "not inserted"));
    }
    peer_addr_ = addr;
    peer_ = std::move(peer);
    for (const GrantedRegion& g : peer_.grant) peer_grant_[g.region_id] = g.key;
    connected_ = true;
    spdlog::debug("fabric: endpoint {} connected to {}", id_.owner, peer_.owner);
    return absl::OkStatus();
  }

  // Connectionless: any sender endpoint holding the grant's keys writes through this one (Endpoint::Reusable).
  // connected_ is set by Connect before the endpoint is shared; the gate answers for the grant under its own lock.
  bool Reusable(const std::string& peer_info) const override {
    (void)peer_info;
    return grant_ != nullptr && connected_ && !cancelled_.load(std::memory_order_acquire) && gate_->GrantLive(*grant_);
  }

  absl::StatusOr<BatchId> Post(absl::Span<const WriteRequest> writes) override;
  absl::Status Wait(BatchId batch, absl::Duration timeout) override;
  int CompletionFd() const override { return -1; }
  std::string PeerName() const override {
    return connected_ ? absl::StrCat(peer_.owner, " (fabric)") : "(unconnected fabric peer)";
  }

  // From any thread. The provider cannot take back writes it was handed, so Cancel only releases the thread using
  // the endpoint (it sees the flag at its next poll) and fails every later call; the writes in flight finish or
  // fail inside the provider until the endpoint is destroyed. Nothing of the backlog is handed on after it.
  void Cancel(const absl::Status& why) override {
    {
      std::lock_guard<std::mutex> l(cancel_mu_);
      if (!cancel_why_.ok()) return;
      cancel_why_ = why.ok() ? absl::CancelledError("cancelled") : why;
    }
    cancelled_.store(true, std::memory_order_release);
  }

 private:
  // One write posted to the provider. `ctx` first: the completion's op_context points at it.
  struct Op {
    fi_context2 ctx;
    BatchId batch = 0;
    uint32_t write_index = 0;
    uint64_t dst_offset = 0;
    uint64_t length = 0;
    uint64_t region_id = 0;
  };
  static_assert(offsetof(Op, ctx) == 0, "a completion's op_context is the address of its Op");
  struct Batch {
    uint64_t pending = 0;  // pieces in the backlog or in the provider's hands
    absl::Status status;
  };
  // A piece of a write not yet handed to the provider.
  struct Piece {
    BatchId batch;
    uint32_t write_index;
    uint8_t* src;
    void* desc;
    uint64_t dst_addr;
    uint64_t key;
    uint64_t dst_offset;
    uint64_t length;
    uint64_t region_id;
  };
  // Hands backlog pieces to the provider while it takes them; never waits.
  void Pump();
  // Fails every backlog piece's batch with broken_ and drops them (nothing of them was handed to the provider).
  void FailBacklog();
  // Breaks the endpoint when work waits and no completion came for the provider's timeout.
  void CheckStall();

  void Break(const absl::Status& s) {
    if (broken_.ok()) {
      broken_ = s;
      spdlog::error("fabric: endpoint to {} failed: {}", PeerName(), std::string(s.message()));
    }
  }

  bool CheckCancel() {
    if (!cancelled_.load(std::memory_order_acquire)) return false;
    if (cancel_.ok()) {
      {
        std::lock_guard<std::mutex> l(cancel_mu_);
        cancel_ = cancel_why_;
      }
      if (broken_.ok()) broken_ = cancel_;
      spdlog::info("fabric: endpoint to {} cancelled: {}", PeerName(), std::string(cancel_.message()));
    }
    return true;
  }

  void Finish(Op* op, const absl::Status& s) {
    auto b = batches_.find(op->batch);
    if (b != batches_.end()) {
      if (b->second.pending > 0) --b->second.pending;
      if (!s.ok() && b->second.status.ok()) b->second.status = s;
    }
    free_.push_back(op);
  }

  absl::Status CompletionError(const fi_cq_err_entry& e, const Op* op) {
    char buf[256] = {};
    const char* prov_msg = fi_cq_strerror(cq_.get(), e.prov_errno, e.err_data, buf, sizeof(buf));
    std::string where;
    if (op != nullptr) {
      where = absl::StrFormat(", write #%d (dst offset %d, %d bytes) of batch %d", op->write_index, op->dst_offset,
                              op->length, op->batch);
      if (peer_.granted && peer_grant_.count(op->region_id) == 0)
        where += "; that region is outside the write grant of this connection";
    }
    const int err = EffectiveError(e.err, e.prov_errno);
    return absl::Status(CodeForError(err),
                        absl::StrCat("fabric write to peer ", PeerName(), " failed on provider ", dom_->provider(),
                                     ": ", FiError(e.err), " (provider: ", prov_msg ? prov_msg : "?", ", prov_errno ",
                                     e.prov_errno, ")", where, HintForError(err)));
  }

  // Reads the completion queue once (which also progresses the endpoint). Returns the completions handled.
  int Poll() {
    fi_cq_entry entries[kPollBatch];
    ssize_t n = fi_cq_read(cq_.get(), entries, kPollBatch);
    if (n > 0) {
      reached_peer_ = true;
      last_progress_ = absl::Now();
      for (ssize_t i = 0; i < n; ++i) Finish(static_cast<Op*>(entries[i].op_context), absl::OkStatus());
      return static_cast<int>(n);
    }
    if (n == -FI_EAGAIN) return 0;
    if (n == -FI_EAVAIL) {
      fi_cq_err_entry e{};
      if (fi_cq_readerr(cq_.get(), &e, 0) != 1) return 0;
      Op* op = static_cast<Op*>(e.op_context);
      CheckCancel();
      absl::Status err = !cancel_.ok() ? cancel_ : CompletionError(e, op);
      Break(err);
      if (op != nullptr) Finish(op, err);
      return 1;
    }
    Break(absl::InternalError(absl::StrCat("fabric: fi_cq_read to ", PeerName(), ": ", FiError(n))));
    return 0;
  }

  static void Backoff(int empty_polls) {
    if (empty_polls < 64) return;
    if (empty_polls < 4096) {
      sched_yield();
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }

  // The local MR descriptor a write from `src` is posted with (FI_MR_LOCAL), or null when the provider needs none.
  absl::StatusOr<void*> SourceDesc(const FabricLocalRegion* src) {
    if (!dom_->local_mr()) return nullptr;
    if (!dom_->endpoint_mr()) return src->desc(domain_index_);
    // FI_MR_ENDPOINT: an MR serves only the endpoint it is bound to; registered once per (endpoint, region).
    auto it = local_mrs_.find(src->region_id());
    if (it == local_mrs_.end()) {
      WSYNC_ASSIGN_OR_RETURN(MrPtr mr, dom_->RegisterMr(src->addr(), src->length(), FI_WRITE, 0, ep_.get(),
                                                        "local access, bound to an endpoint", src->device()));
      it = local_mrs_.emplace(src->region_id(), std::move(mr)).first;
    }
    return fi_mr_desc(it->second.get());
  }

  std::shared_ptr<Domain> dom_;
  std::shared_ptr<Gate> gate_;
  Identity id_;
  uint32_t domain_index_;
  std::vector<Op> ops_;  // before the endpoint and queue: a late completion never points at freed memory
  std::vector<Op*> free_;
  FidPtr<fid_cq> cq_{nullptr, {"completion queue"}};
  FidPtr<fid_av> av_{nullptr, {"address vector"}};
  FidPtr<fid_ep> ep_{nullptr, {"endpoint"}};
  std::unordered_map<uint64_t, MrPtr> local_mrs_;  // FI_MR_ENDPOINT only; closed before ep_
  std::shared_ptr<Gate::Grant> grant_;             // null for a plain endpoint
  bool bound_plain_ = false;                       // FI_MR_ENDPOINT plain endpoint: the gate holds MRs bound to ep_
  std::string address_;
  bool connected_ = false;
  bool reached_peer_ = false;  // a write to the peer has completed
  ConnInfo peer_;
  fi_addr_t peer_addr_ = FI_ADDR_NOTAVAIL;
  std::unordered_map<uint64_t, uint64_t> peer_grant_;  // region id → the key of this connection's MR
  absl::Status broken_;
  BatchId next_batch_ = 1;
  std::map<BatchId, Batch> batches_;
  std::deque<Piece> backlog_;
  absl::Time last_progress_;  // the last completion, or the Post that gave an idle endpoint work
  absl::Status cancel_;
  std::atomic<bool> cancelled_{false};
  std::mutex cancel_mu_;
  absl::Status cancel_why_;
};

absl::StatusOr<BatchId> FabricEndpoint::Post(absl::Span<const WriteRequest> writes) {
  if (CheckCancel())
    return Annotate(cancel_, absl::StrCat("fabric endpoint to ", PeerName(), " was cancelled; re-create it"));
  if (!connected_) return absl::FailedPreconditionError("fabric endpoint is not connected");
  if (!broken_.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("fabric endpoint to ", PeerName(), " failed earlier; re-create it: ", broken_.message()));
  }
  std::vector<void*> descs(writes.size(), nullptr);
  for (size_t i = 0; i < writes.size(); ++i) {
    const WriteRequest& w = writes[i];
    WSYNC_RETURN_IF_ERROR_CTX(ValidateWrite(w), "write #", i);
    const auto* src = dynamic_cast<const FabricLocalRegion*>(w.src);
    const auto* dst = dynamic_cast<const FabricRemoteRegion*>(w.dst);
    if (src == nullptr || dst == nullptr)
      return absl::InvalidArgumentError(absl::StrCat("write #", i, ": regions do not belong to the fabric transport"));
    if (src->transport_id() != id_.transport_id)
      return absl::InvalidArgumentError(
          absl::StrCat("write #", i, ": source region was registered with another fabric transport"));
    if (dst->desc().transport_id != peer_.transport_id)
      return absl::InvalidArgumentError(absl::StrCat("write #", i, ": destination region belongs to ",
                                                     dst->desc().owner, ", but this endpoint is connected to ",
                                                     peer_.owner));
    if (peer_.domain_index >= dst->desc().keys.size())
      return absl::InvalidArgumentError(absl::StrCat(
          "write #", i, ": the descriptor of ", dst->desc().owner, " has keys for ", dst->desc().keys.size(),
          " domain(s), but the peer endpoint is on its domain #", peer_.domain_index, " (", peer_.domain, ")"));
    WSYNC_ASSIGN_OR_RETURN(descs[i], SourceDesc(src));
  }

  // Post never blocks (transport.h): the writes are cut into pieces that wait in the endpoint's backlog, what the
  // provider takes now is handed to it, and the rest follows from Wait as completions free transmit slots.
  const BatchId id = next_batch_++;
  Batch& batch = batches_[id];
  const uint64_t max_piece = std::max<uint64_t>(1, std::min(dom_->max_msg_size(), dom_->config().max_piece));
  for (size_t i = 0; i < writes.size(); ++i) {
    const WriteRequest& w = writes[i];
    const auto* src = static_cast<const FabricLocalRegion*>(w.src);
    const RegionDesc& d = static_cast<const FabricRemoteRegion*>(w.dst)->desc();
    uint64_t key = d.keys[peer_.domain_index];
    if (auto g = peer_grant_.find(d.region_id); g != peer_grant_.end()) key = g->second;
    for (uint64_t done = 0; done < w.length;) {
      const uint64_t piece = std::min(w.length - done, max_piece);
      backlog_.push_back(Piece{id, static_cast<uint32_t>(i), static_cast<uint8_t*>(src->addr()) + w.src_offset + done,
                               descs[i], d.addr_base + w.dst_offset + done, key, w.dst_offset + done, piece,
                               d.region_id});
      ++batch.pending;
      done += piece;
    }
  }
  if (backlog_.size() == batch.pending) last_progress_ = absl::Now();  // nothing was waiting before this batch
  Domain::Driving driving(*dom_);
  Pump();
  return id;
}

void FabricEndpoint::Pump() {
  const uint64_t flags = FI_COMPLETION | (dom_->delivery_complete() ? FI_DELIVERY_COMPLETE : 0);
  while (!backlog_.empty() && !free_.empty() && !CheckCancel() && broken_.ok()) {
    const Piece& p = backlog_.front();
    Op* op = free_.back();
    op->batch = p.batch;
    op->write_index = p.write_index;
    op->dst_offset = p.dst_offset;
    op->length = p.length;
    op->region_id = p.region_id;
    iovec iov{p.src, p.length};
    void* desc = p.desc;
    fi_rma_iov rma{p.dst_addr, p.length, p.key};
    fi_msg_rma msg{};
    msg.msg_iov = &iov;
    msg.desc = &desc;
    msg.iov_count = 1;
    msg.addr = peer_addr_;
    msg.rma_iov = &rma;
    msg.rma_iov_count = 1;
    msg.context = &op->ctx;
    const ssize_t rc = fi_writemsg(ep_.get(), &msg, flags);
    if (rc == -FI_EAGAIN) break;  // the provider's queue is full: the next completion makes room
    if (rc != 0) {
      Break(absl::Status(CodeForError(static_cast<int>(-rc)),
                         absl::StrCat("fi_writemsg to peer ", PeerName(), " on provider ", dom_->provider(),
                                      " failed: ", FiError(rc), ", write #", p.write_index, " (dst offset ",
                                      p.dst_offset, ", ", p.length, " bytes) of batch ", p.batch,
                                      HintForError(static_cast<int>(-rc)))));
      break;
    }
    free_.pop_back();
    backlog_.pop_front();
  }
  if (!broken_.ok()) FailBacklog();
}

void FabricEndpoint::FailBacklog() {
  for (const Piece& p : backlog_) {
    auto b = batches_.find(p.batch);
    if (b == batches_.end()) continue;
    if (b->second.pending > 0) --b->second.pending;
    if (b->second.status.ok()) b->second.status = broken_;
  }
  backlog_.clear();
}

void FabricEndpoint::CheckStall() {
  if (backlog_.empty() && free_.size() == ops_.size()) return;  // nothing waits on the provider
  // Nothing in flight and nothing accepted: the provider cannot reach the peer (tcp;ofi_rxm keeps answering
  // FI_EAGAIN while its connection attempts to a closed endpoint fail), which needs no io_timeout to tell.
  // Only for a peer reached before: setting up a connection may take longer (ofi_rxm over emulated verbs).
  const bool idle = free_.size() == ops_.size();
  const absl::Duration limit = idle && reached_peer_ ? dom_->config().peer_timeout : dom_->config().io_timeout;
  if (absl::Now() - last_progress_ <= limit) return;
  Break(absl::Status(idle ? absl::StatusCode::kUnavailable : absl::StatusCode::kDeadlineExceeded,
                     absl::StrCat("fabric writes to peer ", PeerName(), " made no progress for ",
                                  absl::FormatDuration(limit),
                                  idle ? ": the provider accepted none (peer gone or unreachable)" : "")));
  FailBacklog();
}

absl::Status FabricEndpoint::Wait(BatchId batch, absl::Duration timeout) {
  auto it = batches_.find(batch);
  if (it == batches_.end()) {
    return absl::NotFoundError(
        absl::StrCat("fabric endpoint to ", PeerName(), ": unknown or already waited batch ", batch));
  }
  const absl::Time deadline = absl::Now() + timeout;
  int empty = 0;
  Domain::Driving driving(*dom_);
  while (it->second.pending > 0 && it->second.status.ok()) {
    if (CheckCancel()) break;
    if (!broken_.ok()) {
      it->second.status =
          absl::Status(broken_.code(), absl::StrCat("batch ", batch, " not completed: ", broken_.message()));
      break;
    }
    const bool progressed = Poll() > 0;
    Pump();
    if (!progressed) CheckStall();
    if (it->second.pending == 0 || !it->second.status.ok()) break;
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("fabric batch ", batch, " to ", PeerName(), " still has ",
                                                      it->second.pending, " write(s) outstanding after ",
                                                      absl::FormatDuration(timeout)));
    }
    if (progressed) {
      empty = 0;
    } else {
      Backoff(++empty);
    }
  }
  if (CheckCancel()) {
    batches_.erase(it);
    return Annotate(cancel_, absl::StrCat("fabric batch ", batch, " to ", PeerName(), " cancelled"));
  }
  absl::Status s = it->second.status;
  // A failed batch's writes still in the provider's hands complete later into free ops; the batch record goes now.
  batches_.erase(it);
  return s;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Endpoint>> NewFabricEndpoint(std::shared_ptr<Domain> dom, std::shared_ptr<Gate> gate,
                                                            const Identity& id, const GrantRequest* grant,
                                                            uint32_t domain_index) {
  auto ep = std::make_unique<FabricEndpoint>(std::move(dom), std::move(gate), id, domain_index);
  WSYNC_RETURN_IF_ERROR(ep->Init(grant));
  return std::unique_ptr<Endpoint>(std::move(ep));
}

}  // namespace wsync::transport::fabric
