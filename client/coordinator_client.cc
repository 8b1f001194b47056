#include "client/coordinator_client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "proto/status_convert.h"
#include "proto/tls.h"

namespace wsync::client {
namespace {

void SetDeadline(grpc::ClientContext* ctx, absl::Duration d) {
  ctx->set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(d));
}

}  // namespace

std::vector<std::string> SplitEndpoints(const std::string& list) {
  std::vector<std::string> out;
  for (absl::string_view e : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    e = absl::StripAsciiWhitespace(e);
    if (!e.empty()) out.emplace_back(e);
  }
  return out;
}

std::string LeaderHint(const std::string& message) {
  const std::string kTag = "current leader: ";
  const size_t at = message.find(kTag);
  if (at == std::string::npos) return "";
  std::string h = message.substr(at + kTag.size());
  h = h.substr(0, h.find_first_of(" ;,)\n"));
  return h.empty() || h[0] == '(' ? "" : h;
}

CoordinatorClient::CoordinatorClient(const std::string& endpoints, absl::Duration dial_timeout, absl::Duration failover)
    : endpoints_(SplitEndpoints(endpoints)), dial_timeout_(dial_timeout), failover_(failover) {
  if (endpoints_.empty()) endpoints_.push_back(endpoints);  // the channel reports what is wrong with it
  // mTLS from WSYNC_TLS_* (or the binary's --tls-* flags); without TLS only a loopback endpoint is dialled.
  for (const auto& e : endpoints_) {
    auto channel = tls::Dial(e);
    if (channel.ok()) {
      stubs_.push_back(v1::Coordinator::NewStub(*std::move(channel)));
    } else {
      if (dial_status_.ok()) dial_status_ = channel.status();
      stubs_.push_back(nullptr);
    }
  }
}

template <typename Req, typename Rep>
absl::StatusOr<Rep> CoordinatorClient::Invoke(Method<Req, Rep> m, const Req& req, absl::Duration deadline) {
  const size_t n = endpoints_.size();
  const absl::Time give_up = absl::Now() + failover_;
  absl::Duration backoff = absl::Milliseconds(100);
  absl::Status last;
  for (size_t attempt = 0;; ++attempt) {
    const size_t i = current_.load();
    if (!stubs_[i]) return dial_status_;
    Rep rep;
    grpc::ClientContext ctx;
    SetDeadline(&ctx, deadline);
    grpc::Status s = (stubs_[i].get()->*m)(&ctx, req, &rep);
    if (s.ok()) return rep;
    absl::Status st = FromGrpcStatus(s);
    if (n == 1 || st.code() != absl::StatusCode::kUnavailable) return st;
    last = absl::UnavailableError(absl::StrCat(endpoints_[i], ": ", st.message()));
    size_t next = (i + 1) % n;
    const std::string hint = LeaderHint(std::string(st.message()));
    if (auto it = std::find(endpoints_.begin(), endpoints_.end(), hint);
        !hint.empty() && it != endpoints_.end() && static_cast<size_t>(it - endpoints_.begin()) != i)
      next = static_cast<size_t>(it - endpoints_.begin());
    current_.store(next);
    // Every endpoint asked once in this round: wait before the next round (an election takes a lease TTL).
    if ((attempt + 1) % n == 0) {
      if (absl::Now() + backoff > give_up)
        return absl::UnavailableError(absl::StrCat("no coordinator of ", n, " answered as the leader within ",
                                                   absl::FormatDuration(failover_), "; last: ", last.message()));
      absl::SleepFor(backoff);
      backoff = std::min(backoff * 2, absl::Seconds(2));
    }
  }
}

absl::StatusOr<v1::BeginUpdateReply> CoordinatorClient::BeginUpdate(int64_t version, const std::string& pause_mode,
                                                                    const std::string& mode,
                                                                    const std::string& delta) {
  v1::BeginUpdateRequest req;
  req.set_version(version);
  req.set_pause_mode(pause_mode);
  req.set_mode(mode);
  req.set_delta(delta);
  return Invoke(&v1::Coordinator::Stub::BeginUpdate, req, BeginUpdateDeadline(dial_timeout_));
}

absl::StatusOr<v1::UpdateRecord> CoordinatorClient::CommitUpdate(int64_t version, double timeout_seconds) {
  v1::CommitUpdateRequest req;
  req.set_version(version);
  req.set_timeout_seconds(timeout_seconds);
  auto rep = Invoke(&v1::Coordinator::Stub::CommitUpdate, req, CommitUpdateDeadline(timeout_seconds, dial_timeout_));
  if (!rep.ok()) return rep.status();
  return rep->record();
}

absl::StatusOr<v1::ClusterStatus> CoordinatorClient::Status() {
  return Invoke(&v1::Coordinator::Stub::GetClusterStatus, v1::ClusterStatusRequest(), dial_timeout_);
}

absl::StatusOr<v1::HistoryReply> CoordinatorClient::History(int limit) {
  v1::HistoryRequest req;
  req.set_limit(limit);
  return Invoke(&v1::Coordinator::Stub::GetHistory, req, dial_timeout_);
}

absl::StatusOr<v1::AbortUpdateReply> CoordinatorClient::AbortUpdate(int64_t version, const std::string& reason,
                                                                    const std::string& aborted_by) {
  v1::AbortUpdateRequest req;
  req.set_version(version);
  req.set_reason(reason);
  req.set_aborted_by(aborted_by);
  // The coordinator waits for every source's AbortSourceUpdate (a bucket being written, then the drain).
  return Invoke(&v1::Coordinator::Stub::AbortUpdate, req, dial_timeout_ + absl::Seconds(60 + kDeadlineMarginSeconds));
}

absl::StatusOr<v1::RemoveNodeReply> CoordinatorClient::RemoveNode(const std::string& node_id) {
  v1::RemoveNodeRequest req;
  req.set_node_id(node_id);
  return Invoke(&v1::Coordinator::Stub::RemoveNode, req, dial_timeout_);
}

absl::StatusOr<v1::DrainReply> CoordinatorClient::Drain(const std::string& engine_id, const std::string& node_id,
                                                         bool drain) {
  v1::DrainRequest req;
  req.set_engine_id(engine_id);
  req.set_node_id(node_id);
  return Invoke(drain ? &v1::Coordinator::Stub::Drain : &v1::Coordinator::Stub::Undrain, req, dial_timeout_);
}

absl::StatusOr<v1::ResumeEnginesReply> CoordinatorClient::ResumeEngines() {
  return Invoke(&v1::Coordinator::Stub::ResumeEngines, v1::ResumeEnginesRequest(),
                dial_timeout_ + absl::Seconds(30 + kDeadlineMarginSeconds));
}

absl::Status CoordinatorClient::WatchEngines(const std::function<bool(const v1::EngineStates&)>& on_change,
                                             double interval_seconds, absl::Duration duration) {
  const size_t i = current_.load();
  if (!stubs_[i]) return dial_status_;
  grpc::ClientContext ctx;
  if (duration > absl::ZeroDuration()) SetDeadline(&ctx, duration);
  v1::WatchEnginesRequest req;
  req.set_interval_seconds(interval_seconds);
  std::unique_ptr<grpc::ClientReader<v1::EngineStates>> reader = stubs_[i]->WatchEngines(&ctx, req);
  v1::EngineStates states;
  while (reader->Read(&states)) {
    if (!on_change(states)) {
      ctx.TryCancel();
      (void)reader->Finish();  // cancelled by us: its status says so
      return absl::OkStatus();
    }
  }
  grpc::Status s = reader->Finish();
  if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED && duration > absl::ZeroDuration())
    return absl::OkStatus();  // watched for `duration`
  return FromGrpcStatus(s);
}

}  // namespace wsync::client
