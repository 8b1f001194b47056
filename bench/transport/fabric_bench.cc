#include "bench/transport/fabric_bench.h"

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "transport/fabric/fi_api.h"

namespace wsync::bench {
namespace {

using transport::fabric::Fi;
using transport::fabric::FiError;

// One side: fabric, domain, AV, CQ, endpoint, closed in reverse order.
struct Side {
  fi_info* info = nullptr;
  fid_fabric* fabric = nullptr;
  fid_domain* domain = nullptr;
  fid_av* av = nullptr;
  fid_cq* cq = nullptr;
  fid_ep* ep = nullptr;
  fid_mr* mr = nullptr;
  fi_addr_t peer = FI_ADDR_NOTAVAIL;
  std::string name;
  ~Side() {
    if (mr) fi_close(&mr->fid);
    if (ep) fi_close(&ep->fid);
    if (cq) fi_close(&cq->fid);
    if (av) fi_close(&av->fid);
    if (domain) fi_close(&domain->fid);
    if (fabric) fi_close(&fabric->fid);
    if (info) Fi().freeinfo(info);
  }
};

absl::Status Check(int rc, const char* what) {
  if (rc == 0) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(what, ": ", FiError(rc)));
}

absl::Status Open(const std::string& provider, bool delivery_complete, Side* s) {
  fi_info* hints = Fi().dupinfo(nullptr);
  hints->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE;
  hints->ep_attr->type = FI_EP_RDM;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
  hints->domain_attr->threading = FI_THREAD_SAFE;
  if (delivery_complete) hints->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
  if (!provider.empty()) hints->fabric_attr->prov_name = strdup(provider.c_str());
  int rc = Fi().getinfo(FI_VERSION(1, 9), nullptr, nullptr, 0, hints, &s->info);
  Fi().freeinfo(hints);
  if (rc != 0) return Check(rc, "fi_getinfo");
  if (auto st = Check(Fi().fabric(s->info->fabric_attr, &s->fabric, nullptr), "fi_fabric"); !st.ok()) return st;
  if (auto st = Check(fi_domain(s->fabric, s->info, &s->domain, nullptr), "fi_domain"); !st.ok()) return st;
  fi_av_attr aa{};
  aa.type = FI_AV_TABLE;
  if (auto st = Check(fi_av_open(s->domain, &aa, &s->av, nullptr), "fi_av_open"); !st.ok()) return st;
  fi_cq_attr ca{};
  ca.format = FI_CQ_FORMAT_CONTEXT;
  ca.size = 4096;
  if (auto st = Check(fi_cq_open(s->domain, &ca, &s->cq, nullptr), "fi_cq_open"); !st.ok()) return st;
  if (auto st = Check(fi_endpoint(s->domain, s->info, &s->ep, nullptr), "fi_endpoint"); !st.ok()) return st;
  if (auto st = Check(fi_ep_bind(s->ep, &s->av->fid, 0), "fi_ep_bind av"); !st.ok()) return st;
  if (auto st = Check(fi_ep_bind(s->ep, &s->cq->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind cq"); !st.ok()) return st;
  if (auto st = Check(fi_enable(s->ep), "fi_enable"); !st.ok()) return st;
  s->name.resize(256);
  size_t len = s->name.size();
  if (auto st = Check(fi_getname(&s->ep->fid, s->name.data(), &len), "fi_getname"); !st.ok()) return st;
  s->name.resize(len);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<SizePoint>> RunRawFabricSweep(const RawFabricOptions& opts, std::string* provider) {
  auto api = transport::fabric::LoadFabric();
  if (!api.ok()) return api.status();
  auto txp = std::make_unique<Side>();
  bool dc = true;  // delivery-complete writes where the provider offers them, as the transport asks
  if (!Open(opts.provider, true, txp.get()).ok()) {
    dc = false;
    txp = std::make_unique<Side>();
    if (auto st = Open(opts.provider, false, txp.get()); !st.ok()) return st;
  }
  Side& tx = *txp;
  Side rx;
  if (auto st = Open(opts.provider, dc, &rx); !st.ok()) return st;
  *provider = tx.info->fabric_attr->prov_name;
  if (fi_av_insert(tx.av, rx.name.data(), 1, &tx.peer, 0, nullptr) != 1)
    return absl::UnavailableError("fi_av_insert of the receiver's address failed");
  if (fi_av_insert(rx.av, tx.name.data(), 1, &rx.peer, 0, nullptr) != 1)
    return absl::UnavailableError("fi_av_insert of the sender's address failed");

  uint64_t len = 0;
  for (uint64_t s : opts.sizes) len = std::max(len, s);
  const uint64_t slots = 4;  // the window rotates over a few destinations so writes do not all hit one buffer
  std::vector<char> src(len * slots, 'w'), dst(len * slots, 0);
  for (size_t i = 0; i < src.size(); i += 4096) src[i] = static_cast<char>(i >> 12);
  const uint64_t mm = tx.info->domain_attr->mr_mode;
  if (auto st = Check(fi_mr_reg(tx.domain, src.data(), src.size(), FI_WRITE, 0, 1, 0, &tx.mr, nullptr), "fi_mr_reg");
      !st.ok())
    return st;
  if (auto st =
          Check(fi_mr_reg(rx.domain, dst.data(), dst.size(), FI_REMOTE_WRITE, 0, 2, 0, &rx.mr, nullptr), "fi_mr_reg");
      !st.ok())
    return st;
  const uint64_t key = fi_mr_key(rx.mr);
  const uint64_t base = (mm & FI_MR_VIRT_ADDR) ? reinterpret_cast<uintptr_t>(dst.data()) : 0;
  void* desc = (mm & FI_MR_LOCAL) ? fi_mr_desc(tx.mr) : nullptr;
  const uint32_t window = static_cast<uint32_t>(
      std::max<uint64_t>(1, std::min<uint64_t>(opts.window, tx.info->tx_attr->size ? tx.info->tx_attr->size : 64)));
  const uint64_t max_msg = tx.info->ep_attr->max_msg_size ? tx.info->ep_attr->max_msg_size : len;
  const uint64_t flags = FI_COMPLETION | (dc ? FI_DELIVERY_COMPLETE : 0);

  // The receiver's CPU progresses incoming writes where the provider needs it.
  std::atomic<bool> stop{false};
  std::thread progress([&] {
    fi_cq_entry e[8];
    while (!stop.load(std::memory_order_relaxed)) {
      fi_cq_read(rx.cq, e, 8);
      if (opts.progress_pause_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(opts.progress_pause_us));
    }
  });
  std::vector<fi_context2> ctx(window);
  absl::Status failed;
  std::vector<SizePoint> points;
  for (uint64_t size : opts.sizes) {
    if (size > max_msg) {
      failed = absl::InvalidArgumentError(absl::StrCat("message of ", size, " bytes exceeds max_msg_size ", max_msg));
      break;
    }
    SizePoint p;
    p.message_bytes = size;
    p.writes_per_batch = window;
    uint64_t posted = 0, completed = 0;
    const absl::Time start = absl::Now();
    const absl::Time stop_at = start + opts.per_size;
    bool posting = true;
    while (failed.ok() && (posting || completed < posted)) {
      if (posting && absl::Now() >= stop_at) posting = false;
      while (posting && posted - completed < window) {
        const uint64_t off = (posted % slots) * size;
        iovec iov{src.data() + off, size};
        fi_rma_iov rma{base + off, size, key};
        fi_msg_rma msg{};
        msg.msg_iov = &iov;
        msg.desc = &desc;
        msg.iov_count = 1;
        msg.addr = tx.peer;
        msg.rma_iov = &rma;
        msg.rma_iov_count = 1;
        msg.context = &ctx[posted % window];
        ssize_t rc = fi_writemsg(tx.ep, &msg, flags);
        if (rc == -FI_EAGAIN) break;
        if (rc != 0) {
          failed = absl::UnavailableError(absl::StrCat("fi_writemsg: ", FiError(rc)));
          break;
        }
        ++posted;
      }
      fi_cq_entry e[32];
      ssize_t n = fi_cq_read(tx.cq, e, 32);
      if (n > 0) completed += n;
      if (n == -FI_EAVAIL) {
        fi_cq_err_entry err{};
        fi_cq_readerr(tx.cq, &err, 0);
        failed = absl::UnavailableError(absl::StrCat("write completion: ", FiError(err.err)));
      }
    }
    p.seconds = absl::ToDoubleSeconds(absl::Now() - start);
    p.bytes = completed * size;
    points.push_back(p);
  }
  stop.store(true);
  progress.join();
  if (!failed.ok()) return failed;
  return points;
}

}  // namespace wsync::bench
