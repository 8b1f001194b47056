#include "daemon/node/coordinator_link.h"

#include <algorithm>
#include <chrono>

#include <grpcpp/grpcpp.h>

#include "daemon/common/serve.h"
#include "proto/status_convert.h"
#include "proto/tls.h"

namespace wsync::daemon {

absl::Status Register(Coordinators& coordinators, const v1::RegisterNodeRequest& req, int attempts) {
  absl::Status last;
  for (int i = 1; i <= attempts; ++i) {
    grpc::ClientContext ctx;
    // Short attempts, so that a signal is noticed within about a second wherever the daemon is.
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
    ctx.set_wait_for_ready(true);
    v1::RegisterNodeReply out;
    last = FromGrpcStatus(coordinators.stub()->RegisterNode(&ctx, req, &out));
    if (last.ok()) {
      spdlog::info("registered with coordinator {} (membership epoch {})", coordinators.current(),
                   out.membership_epoch());
      return last;
    }
    if (last.code() != absl::StatusCode::kUnavailable && last.code() != absl::StatusCode::kDeadlineExceeded)
      return last;
    spdlog::warn("registration with coordinator {} failed (attempt {}/{}): {}{}", coordinators.current(), i, attempts,
                 last.ToString(), i < attempts ? "; retrying in 0.5 s" : "");
    coordinators.Next(last);
    if (i < attempts && daemon::TerminationRequested(500))
      return absl::CancelledError("terminated by a signal while registering");
  }
  return last;
}

void HoldLease(Coordinators& coordinators, const v1::RegisterNodeRequest& reg,
               const std::function<v1::RegisterNodeRequest()>& fresh_registration,
               const std::function<void(v1::HeartbeatRequest*)>& report) {
  v1::HeartbeatRequest hb;
  hb.set_node_id(reg.node_id());
  hb.set_address(reg.address());
  int interval_ms = 2000;
  int wait_ms = interval_ms;
  bool down = false;
  while (!daemon::TerminationRequested(wait_ms)) {
    wait_ms = interval_ms;
    if (report) report(&hb);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    v1::HeartbeatReply rep;
    grpc::Status s = coordinators.stub()->Heartbeat(&ctx, hb, &rep);
    if (!s.ok()) {
      if (s.error_code() == grpc::StatusCode::UNIMPLEMENTED) continue;  // an older coordinator: no leases
      if (!down) spdlog::warn("coordinator {} unreachable ({}); will register again when it is back",
                              coordinators.current(), s.error_message());
      down = true;
      if (coordinators.Next(FromGrpcStatus(s))) wait_ms = 200;
      continue;
    }
    if (down) spdlog::info("coordinator {} is reachable again", coordinators.current());
    down = false;
    if (rep.interval_seconds() > 0) interval_ms = std::clamp(static_cast<int>(rep.interval_seconds() * 1000), 100, 60000);
    wait_ms = interval_ms;
    if (rep.known()) continue;
    spdlog::warn("coordinator {} does not know node {} (restarted or dropped it): registering again",
                 coordinators.current(), reg.node_id());
    if (auto st = Register(coordinators, fresh_registration(), 1); !st.ok())
      spdlog::warn("registering again failed: {}; next try in {} ms", st.ToString(), interval_ms);
  }
}

FailureReporter::FailureReporter(const std::string& coordinators, std::string node_id, absl::Duration call_timeout)
    : coordinators_(coordinators), node_id_(std::move(node_id)), call_timeout_(call_timeout) {
  thread_ = std::thread([this] { Run(); });
}

FailureReporter::~FailureReporter() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void FailureReporter::Report(int64_t version, const absl::Status& err) {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (stop_) return;
    queue_.emplace_back(version, err.ToString());
  }
  cv_.notify_all();
}

void FailureReporter::Run() {
  std::unique_lock<std::mutex> l(mu_);
  for (;;) {
    cv_.wait(l, [this] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    auto [version, error] = std::move(queue_.front());
    queue_.pop_front();
    l.unlock();
    Send(version, error);
    l.lock();
  }
}

void FailureReporter::Send(int64_t version, const std::string& error) {
  v1::ReportUpdateFailureRequest req;
  req.set_node_id(node_id_);
  req.set_version(version);
  req.set_error(error.substr(0, 4000));
  absl::Status last;
  for (size_t attempt = 0; attempt < 2 * std::max<size_t>(coordinators_.size(), 1); ++attempt) {
    if (coordinators_.stub() == nullptr) {
      last = coordinators_.dial_status();
      if (!coordinators_.Next(last)) break;
      continue;
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + call_timeout_));
    v1::ReportUpdateFailureReply out;
    last = FromGrpcStatus(coordinators_.stub()->ReportUpdateFailure(&ctx, req, &out));
    if (last.ok()) {
      if (out.ended())
        spdlog::info("update {}: reported this source's failure to coordinator {}; the update ended", version,
                     coordinators_.current());
      else
        spdlog::info("update {}: reported this source's failure to coordinator {}; not ended by it: {}", version,
                     coordinators_.current(), out.detail());
      return;
    }
    if (last.code() != absl::StatusCode::kUnavailable || !coordinators_.Next(last)) break;
  }
  spdlog::warn("update {}: could not report this source's failure to the coordinator ({}); it ends at the commit",
               version, last.ToString());
}

}  // namespace wsync::daemon
