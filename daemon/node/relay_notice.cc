#include "daemon/node/relay_notice.h"

#include <grpcpp/grpcpp.h>
#include <xxhash.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "base/status.h"
#include "daemon/common/serve.h"
#include "daemon/node/connect_target_client.h"
#include "proto/status_convert.h"
#include "proto/tls.h"
#include "spdlog/spdlog.h"
#include "wsync/v1/daemon.grpc.pb.h"

namespace wsync::daemon {

absl::Status CallRelayLanded(const std::string& daemon, const v1::RelayLandedRequest& req) {
  static Mutex mu;
  static auto* channels = new std::map<std::string, std::shared_ptr<grpc::Channel>>();
  std::shared_ptr<grpc::Channel> channel;
  {
    MutexLock l(&mu);
    auto it = channels->find(daemon);
    if (it == channels->end()) {
      WSYNC_ASSIGN_OR_RETURN(auto c, tls::Dial(daemon, kMaxControlMessageBytes));
      it = channels->emplace(daemon, std::move(c)).first;
    }
    channel = it->second;
  }
  auto stub = v1::NodeDaemon::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::RelayLandedReply out;
  return Annotate(FromGrpcStatus(stub->RelayLanded(&ctx, req, &out)), absl::StrCat("RelayLanded at ", daemon));
}

absl::StatusOr<v1::ConnectTargetReply> DialRelayChild(const std::string& daemon, const v1::ConnectTargetRequest& req) {
  return DialConnectTargetBy(daemon, req, absl::Now() + absl::Seconds(60));
}

RelayNotifier::RelayNotifier(std::string node_id, Notify notify)
    : node_id_(std::move(node_id)), notify_(std::move(notify)) {
  thread_ = std::thread([this] { Loop(); });
}

RelayNotifier::~RelayNotifier() {
  {
    MutexLock l(&mu_);
    stop_ = true;
    cv_.SignalAll();
  }
  thread_.join();
}

void RelayNotifier::Written(int64_t version, const std::string& daemon, const std::string& engine_id,
                            std::vector<Range> ranges) {
  MutexLock l(&mu_);
  queue_.push_back(Item{version, daemon, engine_id, std::move(ranges)});
  cv_.SignalAll();
}

absl::Status RelayNotifier::Flush(int64_t version, absl::Time deadline) {
  MutexLock l(&mu_);
  while (!queue_.empty() || busy_ > 0)
    if (cv_.WaitWithDeadline(&mu_, deadline)) break;
  if (!queue_.empty() || busy_ > 0)
    return absl::DeadlineExceededError(absl::StrCat("relay notices of update ", version, " still queued"));
  auto it = errors_.find(version);
  return it == errors_.end() ? absl::OkStatus() : it->second;
}

void RelayNotifier::Loop() {
  for (;;) {
    std::deque<Item> items;
    {
      MutexLock l(&mu_);
      while (!stop_ && queue_.empty()) cv_.Wait(&mu_);
      if (stop_) return;
      items.swap(queue_);
      busy_ = 1;
    }
    // One call per (update, daemon, engine) of what was queued meanwhile.
    std::map<std::tuple<int64_t, std::string, std::string>, v1::RelayLandedRequest> calls;
    const absl::Time t_hash = absl::Now();
    for (Item& it : items) {
      v1::RelayLandedRequest& req = calls[{it.version, it.daemon, it.engine_id}];
      for (const Range& r : it.ranges) {
        v1::LandedRange* g = req.add_ranges();
        g->set_rank(r.rank);
        g->set_param(r.param);
        g->set_offset(r.offset);
        g->set_length(r.length);
        const XXH128_hash_t h = XXH3_128bits(r.data, r.length);
        g->set_xxh128(absl::StrFormat("%016x%016x", h.high64, h.low64));
      }
    }
    for (auto& [key, req] : calls) {
      const auto& [version, daemon, engine] = key;
      req.set_version(version);
      req.set_engine_id(engine);
      req.set_from_node(node_id_);
      const absl::Time t_call = absl::Now();
      absl::Status st = notify_(daemon, req);
      spdlog::debug("relaytime source notice to {}: {} ranges from {} items, hashed {:.2f} ms, call {:.2f} ms", daemon,
                    req.ranges_size(), items.size(), absl::ToDoubleMilliseconds(t_call - t_hash),
                    absl::ToDoubleMilliseconds(absl::Now() - t_call));
      if (!st.ok()) {
        spdlog::error("update {}: telling relay root engine {} at {} what landed: {}", version, engine, daemon,
                      st.ToString());
        MutexLock l(&mu_);
        errors_.try_emplace(version, st);
        while (errors_.size() > 8) errors_.erase(errors_.begin());
      }
    }
    MutexLock l(&mu_);
    busy_ = 0;
    cv_.SignalAll();
  }
}

}  // namespace wsync::daemon
