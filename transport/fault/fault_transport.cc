#include "transport/fault/fault_transport.h"

#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "spdlog/spdlog.h"
#include "transport/tcp/tcp_socket.h"

namespace wsync::transport {
namespace {

// Shared by a wrapped transport and every endpoint it created (an endpoint may outlive its transport object).
struct FaultState {
  explicit FaultState(FaultSpec s) : spec(s) {}
  const FaultSpec spec;
  std::atomic<uint64_t> posted{0};     // batches numbered so far, across all endpoints
  std::atomic<uint64_t> endpoints{0};  // endpoints created so far (each seeds its jitter with its number)
};

// Used by one owner thread at a time (Post, Wait), like every endpoint; Cancel and CompletionFd from any thread.
// With a delay in the spec, every batch gets an id of this endpoint's own: a held batch has no inner id until it is
// handed on, which the owner's Post or Wait does once its time has come (Post never sleeps: transport.h).
class FaultEndpoint : public Endpoint {
 public:
  FaultEndpoint(std::unique_ptr<Endpoint> inner, std::shared_ptr<FaultState> state)
      : inner_(std::move(inner)),
        state_(std::move(state)),
        delaying_(state_->spec.delays()),
        jitter_rng_(state_->spec.seed * 1000003 + state_->endpoints.fetch_add(1)) {
    if (!delaying_) return;
    // CompletionFd: an epoll set readable when the inner endpoint's fd is, when the first held batch is due
    // (timerfd) or after Cancel (eventfd). Without an inner fd (a provider the owner polls), none: the owner's
    // Wait(batch, slice) calls hand on what is due.
    timer_ = tcp::Fd(timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC));
    cancel_fd_ = tcp::Fd(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (inner_->CompletionFd() < 0) return;
    epoll_ = tcp::Fd(epoll_create1(EPOLL_CLOEXEC));
    for (int fd : {inner_->CompletionFd(), timer_.get(), cancel_fd_.get()}) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.fd = fd;
      if (epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev) != 0)
        spdlog::warn("fault transport: epoll_ctl({}) failed: {}", fd, tcp::ErrnoText(errno));
    }
  }

  std::string LocalInfo() const override { return inner_->LocalInfo(); }
  absl::Status Connect(const std::string& peer_info, absl::Duration timeout) override {
    return inner_->Connect(peer_info, timeout);
  }
  std::string PeerName() const override { return inner_->PeerName(); }
  void Cancel(const absl::Status& why) override {
    inner_->Cancel(why);
    if (!delaying_) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (cancelled_.ok()) cancelled_ = why.ok() ? absl::CancelledError("cancelled") : why;
    }
    const uint64_t one = 1;
    ssize_t r = write(cancel_fd_.get(), &one, sizeof(one));
    (void)r;  // only EAGAIN (already readable) can fail it
  }
  bool Reusable(const std::string& peer_info) const override { return inner_->Reusable(peer_info); }
  int CompletionFd() const override { return delaying_ ? epoll_.get() : inner_->CompletionFd(); }

  absl::StatusOr<BatchId> Post(absl::Span<const WriteRequest> writes) override {
    if (!broken_.ok()) return Broken();
    if (absl::Status c = Cancelled(); !c.ok()) return c;
    // Invalid requests keep their own error and do not consume a batch number, so specs stay predictable.
    for (const WriteRequest& w : writes)
      if (absl::Status st = ValidateWrite(w); !st.ok()) return st;
    const uint64_t n = state_->posted.fetch_add(1) + 1;
    if (n == state_->spec.fail_post) {
      broken_ = absl::UnavailableError(
          absl::StrCat("injected fault: posting batch ", n, " to ", PeerName(), " failed (nothing was sent)"));
      spdlog::warn("{}", std::string(broken_.message()));
      return broken_;
    }
    BatchId id;
    const FaultSpec& spec = state_->spec;
    const std::string peer = delaying_ ? PeerName() : std::string();
    if (delaying_ && (spec.delay_peer.empty() || absl::StrContains(peer, spec.delay_peer))) {
      // A link that carries one batch per `delay`: each is handed on `delay` after the previous one was, or after
      // its Post. Logged when the hold starts, so that a test can act while a batch is on its way (an event).
      const absl::Time now = absl::Now();
      absl::Duration extra = absl::ZeroDuration();
      if (spec.jitter > absl::ZeroDuration())
        extra = absl::Microseconds(std::uniform_int_distribution<int64_t>(
            0, absl::ToInt64Microseconds(spec.jitter))(jitter_rng_));
      last_due_ = std::max(now, last_due_) + spec.delay + extra;
      id = next_id_++;
      held_.push_back(Held{id, last_due_, std::vector<WriteRequest>(writes.begin(), writes.end())});
      spdlog::info("injected fault: holding a batch of {} writes to {} for {} ms", writes.size(), peer,
                   absl::ToInt64Milliseconds(last_due_ - now));
      ArmTimer();
    } else {
      absl::StatusOr<BatchId> inner_id = inner_->Post(writes);
      if (!inner_id.ok()) return inner_id.status();
      id = *inner_id;
      if (delaying_) {
        id = next_id_++;
        inner_ids_[id] = *inner_id;
      }
    }
    if (n == spec.fail_wait) doomed_[id] = n;
    return id;
  }

  absl::Status Wait(BatchId batch, absl::Duration timeout) override {
    if (!broken_.ok()) return Broken();
    if (!delaying_) return Doom(batch, inner_->Wait(batch, timeout));
    const absl::Time deadline = absl::Now() + std::max(timeout, absl::ZeroDuration());
    uint64_t drained;
    for (int fd : {timer_.get(), cancel_fd_.get()})
      while (read(fd, &drained, sizeof(drained)) == static_cast<ssize_t>(sizeof(drained))) {
      }
    for (;;) {
      const absl::Status cancelled = Cancelled();
      if (!cancelled.ok()) held_.clear();  // never handed on
      HandOnDue();
      if (auto f = failed_.find(batch); f != failed_.end()) {
        absl::Status st = f->second;
        failed_.erase(f);
        return Doom(batch, st);
      }
      if (auto it = inner_ids_.find(batch); it != inner_ids_.end()) {
        absl::Status st = inner_->Wait(it->second, std::max(deadline - absl::Now(), absl::ZeroDuration()));
        if (absl::IsDeadlineExceeded(st)) return st;
        inner_ids_.erase(it);
        return Doom(batch, st);
      }
      auto held = std::find_if(held_.begin(), held_.end(), [&](const Held& h) { return h.id == batch; });
      // Not one the inner endpoint answers for: its news is consumed all the same (its fd is in CompletionFd's set).
      inner_->Wait(kNoBatch, absl::ZeroDuration()).IgnoreError();
      if (held == held_.end()) {
        if (!cancelled.ok() && batch < next_id_) return cancelled;
        return absl::NotFoundError(absl::StrCat("unknown batch ", batch, " (never posted, or already waited for)"));
      }
      const absl::Time now = absl::Now();
      if (now >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat("batch ", batch, " to ", PeerName(),
                                                        " is held by the fault transport's delay for ",
                                                        absl::FormatDuration(held->due - now), " more"));
      }
      // Sleeps in Wait, which may block up to its timeout, until the batch is due; a Cancel wakes it.
      const absl::Duration nap = std::min(held->due, deadline) - now;
      pollfd p{cancel_fd_.get(), POLLIN, 0};
      ::poll(&p, 1, static_cast<int>(std::max<int64_t>(1, absl::ToInt64Milliseconds(nap + absl::Milliseconds(1)))));
    }
  }

 private:
  static constexpr BatchId kNoBatch = ~BatchId{0};  // asked for to advance the inner endpoint (NotFound)

  struct Held {
    BatchId id;
    absl::Time due;
    std::vector<WriteRequest> writes;
  };

  absl::Status Cancelled() {
    if (!delaying_) return absl::OkStatus();
    std::lock_guard<std::mutex> lock(mu_);
    return cancelled_;
  }

  // Hands the due held batches to the inner endpoint, in order; re-arms the timer for the next one.
  void HandOnDue() {
    const absl::Time now = absl::Now();
    while (!held_.empty() && held_.front().due <= now) {
      Held h = std::move(held_.front());
      held_.pop_front();
      absl::StatusOr<BatchId> inner_id = inner_->Post(h.writes);
      if (inner_id.ok()) {
        inner_ids_[h.id] = *inner_id;
      } else {
        failed_[h.id] = inner_id.status();
      }
    }
    ArmTimer();
  }

  void ArmTimer() {
    itimerspec spec{};
    if (!held_.empty()) {
      const int64_t ns = std::max<int64_t>(1, absl::ToInt64Nanoseconds(held_.front().due - absl::Now()));
      spec.it_value.tv_sec = ns / 1000000000;
      spec.it_value.tv_nsec = ns % 1000000000;
    }
    timerfd_settime(timer_.get(), 0, &spec, nullptr);
  }

  // A batch whose Wait the spec fails (fail_wait), once it has an answer.
  absl::Status Doom(BatchId batch, absl::Status st) {
    auto it = doomed_.find(batch);
    if (it == doomed_.end() || absl::IsDeadlineExceeded(st)) return st;
    const uint64_t n = it->second;
    doomed_.erase(it);
    broken_ =
        absl::UnavailableError(absl::StrCat("injected fault: completion error for batch ", n, " to ", PeerName()));
    spdlog::warn("{}", std::string(broken_.message()));
    return broken_;
  }

  // Like a real backend after an error: the endpoint stays unusable until the caller re-creates it.
  absl::Status Broken() const {
    return absl::FailedPreconditionError(
        absl::StrCat("endpoint to ", PeerName(), " failed earlier (", broken_.message(), "); it must be re-created"));
  }

  std::unique_ptr<Endpoint> inner_;
  std::shared_ptr<FaultState> state_;
  const bool delaying_;  // the spec has a delay or a jitter: batches get this endpoint's ids (below)
  std::mt19937_64 jitter_rng_;  // used by the owner's Post only
  absl::Status broken_;
  std::map<BatchId, uint64_t> doomed_;  // batch id -> batch number whose Wait must fail
  // With a delay only:
  tcp::Fd timer_, cancel_fd_, epoll_;
  BatchId next_id_ = 1;
  absl::Time last_due_ = absl::InfinitePast();
  std::deque<Held> held_;                   // in the order they are due
  std::map<BatchId, BatchId> inner_ids_;    // handed on: this endpoint's id -> the inner endpoint's
  std::map<BatchId, absl::Status> failed_;  // the inner Post refused them when they were handed on
  std::mutex mu_;
  absl::Status cancelled_;  // guarded by mu_: Cancel comes from any thread
};

class FaultTransport : public Transport {
 public:
  FaultTransport(std::unique_ptr<Transport> inner, FaultSpec spec)
      : inner_(std::move(inner)), state_(std::make_shared<FaultState>(spec)) {}

  std::string name() const override { return inner_->name(); }
  bool viable() const override { return inner_->viable(); }
  std::string reason() const override { return inner_->reason(); }
  Capabilities Query() const override { return inner_->Query(); }
  absl::StatusOr<std::unique_ptr<LocalRegion>> RegisterMemory(void* addr, uint64_t len) override {
    return inner_->RegisterMemory(addr, len);
  }
  absl::StatusOr<std::unique_ptr<LocalRegion>> RegisterSourceMemory(void* addr, uint64_t len) override {
    return inner_->RegisterSourceMemory(addr, len);
  }
  absl::StatusOr<std::unique_ptr<LocalRegion>> RegisterSink(std::shared_ptr<RegionSink> sink) override {
    return inner_->RegisterSink(std::move(sink));
  }
  absl::StatusOr<std::unique_ptr<RemoteRegion>> ImportRegion(const std::string& descriptor) override {
    return inner_->ImportRegion(descriptor);
  }
  absl::Status SetWriteWindow(bool open) override { return inner_->SetWriteWindow(open); }
  uint64_t refused_writes() const override { return inner_->refused_writes(); }
  absl::StatusOr<std::unique_ptr<Endpoint>> CreateGrantedEndpoint(const WriteGrant& grant) override {
    return inner_->CreateGrantedEndpoint(grant);  // receiving side: faults are injected on the sender only
  }
  void RevokeGrants(const std::function<bool(const WriteGrant&)>& keep) override { inner_->RevokeGrants(keep); }
  absl::Status RequireGrants(bool require) override { return inner_->RequireGrants(require); }
  absl::StatusOr<std::unique_ptr<Endpoint>> CreateEndpoint() override {
    absl::StatusOr<std::unique_ptr<Endpoint>> ep = inner_->CreateEndpoint();
    if (!ep.ok()) return ep.status();
    return std::unique_ptr<Endpoint>(std::make_unique<FaultEndpoint>(*std::move(ep), state_));
  }

 private:
  std::unique_ptr<Transport> inner_;
  std::shared_ptr<FaultState> state_;
};

}  // namespace

std::string FaultSpec::ToString() const {
  std::vector<std::string> items;
  if (fail_post > 0) items.push_back(absl::StrCat("fail_post=", fail_post));
  if (fail_wait > 0) items.push_back(absl::StrCat("fail_wait=", fail_wait));
  if (delay > absl::ZeroDuration()) items.push_back(absl::StrCat("delay_ms=", absl::ToInt64Milliseconds(delay)));
  if (jitter > absl::ZeroDuration()) items.push_back(absl::StrCat("jitter_ms=", absl::ToInt64Milliseconds(jitter)));
  if (jitter > absl::ZeroDuration() && seed > 0) items.push_back(absl::StrCat("seed=", seed));
  if (delays() && !delay_peer.empty()) items.push_back(absl::StrCat("delay_peer=", delay_peer));
  return absl::StrJoin(items, ",");
}

absl::StatusOr<FaultSpec> ParseFaultSpec(const std::string& text) {
  FaultSpec spec;
  std::set<std::string> seen;
  if (absl::StripAsciiWhitespace(text).empty()) return spec;
  std::string peer_item;  // the delay_peer item, named if it turns out to lack a delay
  std::string seed_item;  // the seed item, named if it turns out to lack a jitter
  auto bad_item = [&](absl::string_view item, absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("fault spec '", text, "': item '", item, "': ", why,
                     " (expected fail_post=N, fail_wait=N, delay_ms=MS, jitter_ms=MS, seed=N, delay_peer=TEXT)"));
  };
  for (absl::string_view raw : absl::StrSplit(text, ',')) {
    absl::string_view item = absl::StripAsciiWhitespace(raw);
    auto bad = [&](absl::string_view why) { return bad_item(item, why); };
    if (item.empty()) return bad("empty item");
    std::vector<std::string> kv = absl::StrSplit(item, absl::MaxSplits('=', 1));
    if (kv.size() != 2) return bad("missing '='");
    const std::string key(absl::StripAsciiWhitespace(kv[0]));
    const std::string value(absl::StripAsciiWhitespace(kv[1]));
    if (!seen.insert(key).second) return bad("key given twice");
    uint64_t n = 0;
    if (key != "fail_post" && key != "fail_wait" && key != "delay_ms" && key != "jitter_ms" && key != "seed" &&
        key != "delay_peer")
      return bad("unknown key");
    if (key == "delay_peer") {
      if (value.empty()) return bad("value is empty (a part of the peer's name)");
      spec.delay_peer = value;
      peer_item = std::string(item);
      continue;
    }
    if (value.empty() || !absl::SimpleAtoi(value, &n) || value[0] == '-' || value[0] == '+')
      return bad("value is not a non-negative integer");
    if (key == "fail_post" || key == "fail_wait") {
      if (n == 0) return bad("batch numbers start at 1");
      (key == "fail_post" ? spec.fail_post : spec.fail_wait) = n;
    } else if (key == "seed") {
      spec.seed = n;
      seed_item = std::string(item);
    } else {
      if (n > 600000) return bad("delay over 10 minutes");
      (key == "delay_ms" ? spec.delay : spec.jitter) = absl::Milliseconds(n);
    }
  }
  if (!spec.delay_peer.empty() && !spec.delays())
    return bad_item(peer_item, "delay_peer needs a delay_ms or jitter_ms above 0");
  if (!seed_item.empty() && spec.jitter == absl::ZeroDuration())
    return bad_item(seed_item, "seed needs a jitter_ms above 0");
  return spec;
}

std::unique_ptr<Transport> WrapWithFaults(std::unique_ptr<Transport> inner, FaultSpec spec) {
  return std::make_unique<FaultTransport>(std::move(inner), spec);
}

}  // namespace wsync::transport
