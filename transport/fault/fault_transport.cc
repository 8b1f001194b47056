#include "transport/fault/fault_transport.h"

#include <atomic>
#include <map>
#include <set>
#include <thread>
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

namespace wsync::transport {
namespace {

// Shared by a wrapped transport and every endpoint it created (an endpoint may outlive its transport object).
struct FaultState {
  explicit FaultState(FaultSpec s) : spec(s) {}
  const FaultSpec spec;
  std::atomic<uint64_t> posted{0};  // batches numbered so far, across all endpoints
};

class FaultEndpoint : public Endpoint {
 public:
  FaultEndpoint(std::unique_ptr<Endpoint> inner, std::shared_ptr<FaultState> state)
      : inner_(std::move(inner)), state_(std::move(state)) {}

  std::string LocalInfo() const override { return inner_->LocalInfo(); }
  absl::Status Connect(const std::string& peer_info, absl::Duration timeout) override {
    return inner_->Connect(peer_info, timeout);
  }
  std::string PeerName() const override { return inner_->PeerName(); }
  void Cancel(const absl::Status& why) override { inner_->Cancel(why); }
  bool Reusable(const std::string& peer_info) const override { return inner_->Reusable(peer_info); }
  int CompletionFd() const override { return inner_->CompletionFd(); }

  absl::StatusOr<BatchId> Post(absl::Span<const WriteRequest> writes) override {
    if (!broken_.ok()) return Broken();
    // Invalid requests keep their own error and do not consume a batch number, so specs stay predictable.
    for (const WriteRequest& w : writes)
      if (absl::Status st = ValidateWrite(w); !st.ok()) return st;
    if (const FaultSpec& spec = state_->spec; spec.delay > absl::ZeroDuration()) {
      const std::string peer = PeerName();
      if (spec.delay_peer.empty() || absl::StrContains(peer, spec.delay_peer)) {
        // Logged when the hold starts, so that a test can act while a batch is on its way (an event, not a guess).
        spdlog::info("injected fault: holding a batch of {} writes to {} for {} ms", writes.size(), peer,
                     absl::ToInt64Milliseconds(spec.delay));
        std::this_thread::sleep_for(absl::ToChronoNanoseconds(spec.delay));
      }
    }
    const uint64_t n = state_->posted.fetch_add(1) + 1;
    if (n == state_->spec.fail_post) {
      broken_ = absl::UnavailableError(
          absl::StrCat("injected fault: posting batch ", n, " to ", PeerName(), " failed (nothing was sent)"));
      spdlog::warn("{}", std::string(broken_.message()));
      return broken_;
    }
    absl::StatusOr<BatchId> id = inner_->Post(writes);
    if (id.ok() && n == state_->spec.fail_wait) doomed_[*id] = n;
    return id;
  }

  absl::Status Wait(BatchId batch, absl::Duration timeout) override {
    if (!broken_.ok()) return Broken();
    absl::Status st = inner_->Wait(batch, timeout);
    auto it = doomed_.find(batch);
    if (it == doomed_.end() || absl::IsDeadlineExceeded(st)) return st;
    const uint64_t n = it->second;
    doomed_.erase(it);
    broken_ =
        absl::UnavailableError(absl::StrCat("injected fault: completion error for batch ", n, " to ", PeerName()));
    spdlog::warn("{}", std::string(broken_.message()));
    return broken_;
  }

 private:
  // Like a real backend after an error: the endpoint stays unusable until the caller re-creates it.
  absl::Status Broken() const {
    return absl::FailedPreconditionError(
        absl::StrCat("endpoint to ", PeerName(), " failed earlier (", broken_.message(), "); it must be re-created"));
  }

  std::unique_ptr<Endpoint> inner_;
  std::shared_ptr<FaultState> state_;
  absl::Status broken_;
  std::map<BatchId, uint64_t> doomed_;  // inner batch id -> batch number whose Wait must fail
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
  if (delay > absl::ZeroDuration() && !delay_peer.empty()) items.push_back(absl::StrCat("delay_peer=", delay_peer));
  return absl::StrJoin(items, ",");
}

absl::StatusOr<FaultSpec> ParseFaultSpec(const std::string& text) {
  FaultSpec spec;
  std::set<std::string> seen;
  if (absl::StripAsciiWhitespace(text).empty()) return spec;
  std::string peer_item;  // the delay_peer item, named if it turns out to lack a delay
  auto bad_item = [&](absl::string_view item, absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("fault spec '", text, "': item '", item, "': ", why,
                     " (expected fail_post=N, fail_wait=N, delay_ms=MS, delay_peer=TEXT)"));
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
    if (key != "fail_post" && key != "fail_wait" && key != "delay_ms" && key != "delay_peer") return bad("unknown key");
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
    } else {
      if (n > 600000) return bad("delay over 10 minutes");
      spec.delay = absl::Milliseconds(n);
    }
  }
  if (!spec.delay_peer.empty() && spec.delay == absl::ZeroDuration())
    return bad_item(peer_item, "delay_peer needs a delay_ms above 0");
  return spec;
}

std::unique_ptr<Transport> WrapWithFaults(std::unique_ptr<Transport> inner, FaultSpec spec) {
  return std::make_unique<FaultTransport>(std::move(inner), spec);
}

}  // namespace wsync::transport
