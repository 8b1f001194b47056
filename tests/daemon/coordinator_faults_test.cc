// The coordinator's control plane under faults injected at every outbound call (docs/operations.md, "Faults"): a
// scripted Peers makes each call of each phase fail at once, time out, hang until cancelled or a short stand-in
// deadline, or answer late. For every combination the coordinator must keep answering Status (probed from another
// thread throughout, and from inside every peer call: a lock held across a call would block it), end the update with
// an error naming the call and the peer, leave the engines where its records say (checked against what the fake
// engines were really told), and run the next update once the fault is gone. Then: an operator's abort in every
// phase (the hung call cancelled, the abort back promptly), and self-healing by heartbeat digest.

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "base/status.h"
#include "daemon/common/config_digest.h"
#include "daemon/coordinator/coordinator.h"
#include "daemon/coordinator/state_store.h"
#include "daemon/coordinator/update_run.h"
#include "tests/daemon/fake_layouts.h"
#include "tests/daemon/gated_store.h"

namespace wsync::daemon {
namespace {

using namespace std::chrono_literals;
using testing::FillLayout;
using testing::TinyConfigJson;

// Every outbound call of the coordinator; the write window's opening and closing are told apart.
enum class Rpc {
  kPause,
  kEngineInfo,
  kConfigureSource,
  kOpenWindow,
  kStartUpdate,
  kFinishUpdate,
  kCloseWindow,
  kApplyDelta,
  kPostProcess,
  kSetWeightVersion,
  kContinue,
  kAbortSourceUpdate,
  // Staged updates only: the verify's two sides and the switch.
  kWriteChecksums,
  kEngineChecksums,
  kSwitch,
};
enum class Fault { kNone, kUnavailable, kInternal, kTimeout, kHang, kLate };

const char* Name(Rpc r) {
  switch (r) {
    case Rpc::kPause:
      return "Pause";
    case Rpc::kEngineInfo:
      return "EngineInfo";
    case Rpc::kConfigureSource:
      return "ConfigureSource";
    case Rpc::kOpenWindow:
      return "SetWriteWindow(open)";
    case Rpc::kStartUpdate:
      return "StartUpdate";
    case Rpc::kFinishUpdate:
      return "FinishUpdate";
    case Rpc::kCloseWindow:
      return "SetWriteWindow(close)";
    case Rpc::kApplyDelta:
      return "ApplyDelta";
    case Rpc::kPostProcess:
      return "PostProcess";
    case Rpc::kSetWeightVersion:
      return "SetWeightVersion";
    case Rpc::kContinue:
      return "Continue";
    case Rpc::kAbortSourceUpdate:
      return "AbortSourceUpdate";
    case Rpc::kWriteChecksums:
      return "GetWriteChecksums";
    case Rpc::kEngineChecksums:
      return "GetChecksums(staging)";
    case Rpc::kSwitch:
      return "Switch";
  }
  return "?";
}
const char* Name(Fault f) {
  switch (f) {
    case Fault::kNone:
      return "none";
    case Fault::kUnavailable:
      return "UNAVAILABLE";
    case Fault::kInternal:
      return "INTERNAL";
    case Fault::kTimeout:
      return "timeout";
    case Fault::kHang:
      return "hang";
    case Fault::kLate:
      return "late";
  }
  return "?";
}

// Stand-ins for the real deadlines (PeerDeadlines), so that a test takes milliseconds: a timed-out call fails after
// kTimeoutAfter, a hung one at `hang_deadline` unless the coordinator cancels it first, a late one succeeds after
// kLateBy.
constexpr auto kTimeoutAfter = 100ms;
constexpr auto kLateBy = 150ms;
// How long Status() (and an operator's abort) may take at most, from anywhere, at any time. Generous, so that a
// loaded machine does not fail it (1 s did, once): what it catches is an answer that waits for a hung peer call, and
// those hang 10 s (the abort cases) or until Probe, running inside the call, gives up waiting for Status().
constexpr auto kAnswerWithin = 5s;

// A scripted cluster of source daemons, target daemons and engines. What each peer was really told (its "truth") is
// kept apart from the coordinator's records, so the tests can compare the two.
class ScriptedPeers : public Peers {
 public:
  struct EngineTruth {
    bool paused = false;
    std::string version;  // the label last set
    // The version of the live weights it holds (classic: what the sources wrote; "partial N" while a push of N was
    // under way and not every source finished; staged engines: `live`).
    std::string weights;
    std::string staged;   // the version its staging memory holds (what the sources of a started update wrote)
    std::string live;     // the version its Switch made live ("" = none switched)
    bool prepared_while_paused = false;  // its last Switch prepare came while it was paused (the re-hash in the window)
  };
  struct SourceTruth {
    int64_t epoch = -1;           // plan epoch held (-1: none)
    std::string digest;           // ConfigureSourceDigest of the request applied
    bool drop_configure = false;  // answer ConfigureSource OK without applying it (a configure lost on the way)
  };

  Coordinator* coordinator = nullptr;  // probed from inside every call
  std::chrono::milliseconds hang_deadline{400};

  // Injects `fault` into every call `rpc` to `addr` from now on (replacing what was armed; Also: in addition).
  void Arm(Rpc rpc, Fault fault, const std::string& addr) {
    std::lock_guard<std::mutex> l(mu_);
    armed_.clear();
    armed_[{rpc, addr}] = fault;
  }
  void AlsoArm(Rpc rpc, Fault fault, const std::string& addr) {
    std::lock_guard<std::mutex> l(mu_);
    armed_[{rpc, addr}] = fault;
  }
  void Disarm() {
    std::lock_guard<std::mutex> l(mu_);
    armed_.clear();
  }

  absl::Status Pause(const std::string& addr, const std::string&) override {
    WSYNC_RETURN_IF_ERROR(Inject(Rpc::kPause, addr));
    std::lock_guard<std::mutex> l(mu_);
    engines_[addr].paused = true;
    cv_.notify_all();
    return absl::OkStatus();
  }
  // What the engine says of itself, as a real one: its model, its label, whether it is paused.
  absl::StatusOr<v1::EngineInfo> EngineInfo(const std::string& addr) override {
    WSYNC_RETURN_IF_ERROR(Inject(Rpc::kEngineInfo, addr));
    v1::EngineInfo i;
    i.set_model_config_json(config_json_);
    std::lock_guard<std::mutex> l(mu_);
    const EngineTruth& e = engines_[addr];
    i.set_weight_version(e.version);
    i.set_paused(e.paused);
    return i;
  }
  absl::StatusOr<v1::ConfigureSourceReply> ConfigureSource(const std::string& addr,
                                                           const v1::ConfigureSourceRequest& req) override {
    WSYNC_RETURN_IF_ERROR(Inject(Rpc::kConfigureSource, addr));
    std::lock_guard<std::mutex> l(mu_);
    SourceTruth& s = sources_[addr];
    if (!s.drop_configure) {
      s.epoch = req.plan_epoch();
      s.digest = ConfigureSourceDigest(req);
    }
    return v1::ConfigureSourceReply();
  }
  absl::StatusOr<v1::SetWriteWindowReply> SetWriteWindow(const std::string& addr,
                                                         const v1::SetWriteWindowRequest& req) override {
    WSYNC_RETURN_IF_ERROR(Inject(req.open() ? Rpc::kOpenWindow : Rpc::kCloseWindow, addr));
    return v1::SetWriteWindowReply();
  }
  absl::StatusOr<v1::ApplyDeltaReply> ApplyDelta(const std::string& addr, const v1::ApplyDeltaRequest&) override {
    WSYNC_RETURN_IF_ERROR(Inject(Rpc::kApplyDelta, addr));
    return v1::ApplyDeltaReply();
  }
  absl::Status StartUpdate(const std::string& addr, const v1::StartUpdateRequest& req) override {
    WSYNC_RETURN_IF_ERROR(Inject(Rpc::kStartUpdate, addr));
    WSYNC_RETURN_IF_ERROR(CheckPlan(addr, req.version(), req.plan_epoch()));
    std::lock_guard<std::mutex> l(mu_);
    // A started source writes every staged engine's staging memory (the fake's sources write everything).
    for (const auto& [id, layout] : staged_layouts_) engines_[id + ":2"].staged = std::to_string(req.version());
    return absl::OkStatus();
  }
  absl::StatusOr<v1::FinishUpdateReply> FinishUpdate(const std::string& addr,
                                                     const v1::FinishUpdateRequest& req) override {
    {
      // The trainer pushed through this source before it was asked to finish: its share reached the live weights of
      // every engine without staging memory (the fake's sources write everything).
      std::lock_guard<std::mutex> l(mu_);
      wrote_[addr] = req.version();
      for (auto& [a, e] : engines_)
        if (!staged_layouts_.count(a.substr(0, a.find(':')))) e.weights = absl::StrCat("partial ", req.version());
    }
    WSYNC_RETURN_IF_ERROR(Inject(Rpc::kFinishUpdate, addr));
    WSYNC_RETURN_IF_ERROR(CheckPlan(addr, req.version(), req.plan_epoch()));
    v1::FinishUpdateReply r;
    r.set_bytes_written(100);
    return r;
  }
  absl::StatusOr<v1::AbortSourceUpdateReply> AbortSourceUpdate(const std::string& addr,
                                                               const v1::AbortSourceUpdateRequest& req) override {
    if (absl::Status st = Inject(Rpc::kAbortSourceUpdate, addr); !st.ok()) {
      std::lock_guard<std::mutex> l(mu_);
      abort_unanswered_ = true;
      return st;
    }
    v1::AbortSourceUpdateReply r;
    r.set_was_open(true);
    r.set_quiescent(true);
    std::lock_guard<std::mutex> l(mu_);
    if (auto w = wrote_.find(addr); w != wrote_.end() && w->second == req.version()) r.set_bytes_written(100);
    return r;
  }
  absl::Status PostProcess(const std::string& addr, const std::string&) override {
    return Inject(Rpc::kPostProcess, addr);
  }
  absl::Status SetWeightVersion(const std::string& addr, const std::string& version) override {
    WSYNC_RETURN_IF_ERROR(Inject(Rpc::kSetWeightVersion, addr));
    std::lock_guard<std::mutex> l(mu_);
    EngineTruth& e = engines_[addr];
    e.version = version;
    // Asked only once every source finished: the push is whole.
    if (e.weights == absl::StrCat("partial ", version)) e.weights = version;
    return absl::OkStatus();
  }
  absl::Status Continue(const std::string& addr) override {
    WSYNC_RETURN_IF_ERROR(Inject(Rpc::kContinue, addr));
    std::lock_guard<std::mutex> l(mu_);
    engines_[addr].paused = false;
    cv_.notify_all();
    return absl::OkStatus();
  }
  // Staged updates. Source s0 reports writes covering every parameter of every staged engine (what a real source
  // records when it posts them); each engine's staging memory hashes to what was written unless `corrupt` names it.
  void StagedEngine(const std::string& engine_id, const v1::RankLayout& layout) {
    std::lock_guard<std::mutex> l(mu_);
    staged_layouts_[engine_id] = layout;
  }
  void Corrupt(const std::string& addr) {
    std::lock_guard<std::mutex> l(mu_);
    corrupt_ = addr;
  }
  // The staging memory of `addr` changes after its verify (before the switch's prepare): it no longer hashes to the
  // digest the verify returned.
  void ChangeAfterVerify(const std::string& addr) {
    std::lock_guard<std::mutex> l(mu_);
    changed_after_verify_ = addr;
  }
  absl::StatusOr<v1::WriteChecksumsReply> WriteChecksums(const std::string& addr, int64_t version) override {
    WSYNC_RETURN_IF_ERROR(Inject(Rpc::kWriteChecksums, addr));
    std::lock_guard<std::mutex> l(mu_);
    v1::WriteChecksumsReply r;
    r.set_version(version);
    r.set_finished(true);
    if (addr != "s0:1") return r;
    for (const auto& [id, layout] : staged_layouts_)
      for (const auto& p : layout.params()) {
        auto* w = r.add_writes();
        w->set_engine_id(id);
        w->set_rank(layout.rank());
        w->set_param(p.name());
        w->set_length(p.bytes());
        w->set_xxh128(StagedHash(version, p.name()));
      }
    return r;
  }
  absl::StatusOr<v1::ChecksumReply> EngineChecksums(const std::string& addr, const v1::RankRequest& req) override {
    WSYNC_RETURN_IF_ERROR(Inject(Rpc::kEngineChecksums, addr));
    std::lock_guard<std::mutex> l(mu_);
    const std::string& staged = engines_[addr].staged;
    v1::ChecksumReply r;
    r.set_rank(req.rank());
    r.set_staging_digest(absl::StrCat("digest of ", addr, " at ", staged));
    for (const auto& q : req.ranges()) {
      auto* c = r.add_params();
      c->set_name(q.param());
      c->set_xxh128(corrupt_ == addr ? "flipped" : StagedHash(std::stoll(staged), q.param()));
    }
    return r;
  }
  absl::Status Switch(const std::string& addr, const v1::SwitchRequest& req) override {
    return CheckStaged(addr, req, /*prepare=*/false);
  }
  absl::Status PrepareSwitch(const std::string& addr, const v1::SwitchRequest& req) override {
    return CheckStaged(addr, req, /*prepare=*/true);
  }
  // Faults at Switch hit its prepare too (a named "switch engine e1" either way).
  absl::Status CheckStaged(const std::string& addr, const v1::SwitchRequest& req, bool prepare) {
    WSYNC_RETURN_IF_ERROR(Inject(Rpc::kSwitch, addr));
    std::lock_guard<std::mutex> l(mu_);
    EngineTruth& e = engines_[addr];
    const std::string have =
        absl::StrCat("digest of ", addr, " at ", e.staged, changed_after_verify_ == addr ? " (changed)" : "");
    for (const auto& d : req.staging_digests())
      if (d != have)
        return absl::FailedPreconditionError(absl::StrCat("staging of ", addr, " is not what was verified"));
    if (prepare) {
      e.prepared_while_paused = e.paused;
      return absl::OkStatus();  // checked and armed; nothing live changes
    }
    e.live = req.version();
    e.weights = req.version();
    return absl::OkStatus();
  }

  // Cancels the calls to `addr` in flight now (not later ones), as gRPC's TryCancel does.
  void CancelCalls(const std::string& addr) override {
    std::lock_guard<std::mutex> l(mu_);
    ++cancel_gen_[addr];
    ++cancels_[addr];
    cv_.notify_all();
  }

  // Ends every hang now and from now on (a failed test does not wait for the hang deadlines).
  void ReleaseAll() {
    std::lock_guard<std::mutex> l(mu_);
    released_ = true;
    cv_.notify_all();
  }
  // Blocks until a call hangs (at most 5 s); false if none did.
  bool AwaitHanging() {
    std::unique_lock<std::mutex> l(mu_);
    return cv_.wait_for(l, 5s, [&] { return hanging_ > 0; });
  }
  // Blocks until engine `addr` is paused (`paused`) or not (at most 5 s); false if it did not get there.
  bool AwaitPaused(const std::string& addr, bool paused) {
    std::unique_lock<std::mutex> l(mu_);
    return cv_.wait_for(l, 5s, [&] { return engines_[addr].paused == paused; });
  }
  int Calls(Rpc rpc, const std::string& addr) {
    std::lock_guard<std::mutex> l(mu_);
    return calls_[{rpc, addr}];
  }
  int Cancels(const std::string& addr) {
    std::lock_guard<std::mutex> l(mu_);
    return cancels_[addr];
  }
  EngineTruth Engine(const std::string& addr) {
    std::lock_guard<std::mutex> l(mu_);
    return engines_[addr];
  }
  SourceTruth& Source(const std::string& addr) { return sources_[addr]; }  // between updates only
  SourceTruth SourceNow(const std::string& addr) {  // at any time
    std::lock_guard<std::mutex> l(mu_);
    return sources_[addr];
  }
  // Whether any source pushed version `v` (reached its FinishUpdate), or could not tell (its abort failed).
  bool AnyWrote(int64_t v) {
    std::lock_guard<std::mutex> l(mu_);
    if (abort_unanswered_) return true;
    for (const auto& [a, w] : wrote_)
      if (w == v) return true;
    return false;
  }
  // Calls inside which Status() did not answer within kAnswerWithin (the coordinator held its lock across them).
  std::vector<std::string> Blocked() {
    std::lock_guard<std::mutex> l(mu_);
    return blocked_;
  }

 private:
  absl::Status CheckPlan(const std::string& addr, int64_t v, int64_t epoch) {
    std::lock_guard<std::mutex> l(mu_);
    const SourceTruth& s = sources_[addr];
    // What a real source answers (SourceNode::StartUpdate): it holds another plan than the update's.
    if (s.epoch != epoch)
      return absl::FailedPreconditionError(
          absl::StrCat("update ", v, " is for plan ", epoch, " but this source is configured for plan ", s.epoch));
    return absl::OkStatus();
  }

  // Status() from another thread while this call is in flight. Detached: if the coordinator holds its lock across
  // this call, Status() returns only after it, which is recorded rather than waited for.
  void Probe(Rpc rpc, const std::string& addr) {
    auto done = std::make_shared<std::promise<void>>();
    std::future<void> answered = done->get_future();
    std::thread([c = coordinator, done] {
      c->Status();
      done->set_value();
    }).detach();
    if (answered.wait_for(kAnswerWithin) != std::future_status::ready) {
      std::lock_guard<std::mutex> l(mu_);
      blocked_.push_back(absl::StrCat(Name(rpc), " ", addr));
    }
  }

  absl::Status Inject(Rpc rpc, const std::string& addr) {
    Probe(rpc, addr);
    Fault fault = Fault::kNone;
    uint64_t gen = 0;
    {
      std::lock_guard<std::mutex> l(mu_);
      ++calls_[{rpc, addr}];
      if (auto it = armed_.find({rpc, addr}); it != armed_.end()) fault = it->second;
      gen = cancel_gen_[addr];
    }
    const std::string what = absl::StrCat(Name(rpc), " at ", addr, " (injected ", Name(fault), ")");
    switch (fault) {
      case Fault::kNone:
        return absl::OkStatus();
      case Fault::kUnavailable:
        return absl::UnavailableError(absl::StrCat(what, ": connection refused"));
      case Fault::kInternal:
        return absl::InternalError(absl::StrCat(what, ": peer failed"));
      case Fault::kTimeout:
        std::this_thread::sleep_for(kTimeoutAfter);
        return absl::DeadlineExceededError(absl::StrCat(what, ": deadline exceeded"));
      case Fault::kHang: {
        std::unique_lock<std::mutex> l(mu_);
        ++hanging_;
        cv_.notify_all();
        const bool cancelled = cv_.wait_for(l, hang_deadline, [&] { return cancel_gen_[addr] != gen || released_; });
        --hanging_;
        if (cancelled) return absl::CancelledError(absl::StrCat(what, ": cancelled by the coordinator"));
        return absl::DeadlineExceededError(absl::StrCat(what, ": deadline exceeded"));
      }
      case Fault::kLate:
        std::this_thread::sleep_for(kLateBy);
        return absl::OkStatus();
    }
    return absl::OkStatus();
  }

  static std::string StagedHash(int64_t version, const std::string& param) {
    return absl::StrCat("v", version, " ", param);
  }

  const std::string config_json_ = TinyConfigJson();
  std::map<std::string, v1::RankLayout> staged_layouts_;  // engine id → its one rank's layout
  std::string corrupt_;
  std::string changed_after_verify_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::pair<Rpc, std::string>, Fault> armed_;
  int hanging_ = 0;
  bool released_ = false;
  std::map<std::string, uint64_t> cancel_gen_;
  std::map<std::string, int> cancels_;
  std::map<std::pair<Rpc, std::string>, int> calls_;
  std::map<std::string, EngineTruth> engines_;
  std::map<std::string, SourceTruth> sources_;
  std::map<std::string, int64_t> wrote_;  // source address → the last version it pushed (FinishUpdate reached)
  bool abort_unanswered_ = false;         // a source could not say what it wrote (its AbortSourceUpdate failed)
  std::vector<std::string> blocked_;
};

// Joins `t` however the test leaves its scope, releasing the fake's hangs first.
struct Joiner {
  std::thread& t;
  ScriptedPeers* peers;
  ~Joiner() {
    if (!t.joinable()) return;
    peers->ReleaseAll();
    t.join();
  }
};

// The peers of a successor coordinator (a restart on the same store): the same processes, so every call goes to the
// scripted peers the first coordinator called (`to`, which keeps the truth of what each was told).
class SamePeers : public Peers {
 public:
  explicit SamePeers(ScriptedPeers* to) : to_(to) {}
  void Forget(const std::string& a) override { to_->Forget(a); }
  void CancelCalls(const std::string& a) override { to_->CancelCalls(a); }
  absl::StatusOr<v1::ConfigureSourceReply> ConfigureSource(const std::string& a,
                                                           const v1::ConfigureSourceRequest& r) override {
    return to_->ConfigureSource(a, r);
  }
  absl::Status StartUpdate(const std::string& a, const v1::StartUpdateRequest& r) override {
    return to_->StartUpdate(a, r);
  }
  absl::StatusOr<v1::FinishUpdateReply> FinishUpdate(const std::string& a, const v1::FinishUpdateRequest& r) override {
    return to_->FinishUpdate(a, r);
  }
  absl::StatusOr<v1::AbortSourceUpdateReply> AbortSourceUpdate(const std::string& a,
                                                               const v1::AbortSourceUpdateRequest& r) override {
    return to_->AbortSourceUpdate(a, r);
  }
  absl::StatusOr<v1::EngineInfo> EngineInfo(const std::string& a) override { return to_->EngineInfo(a); }
  absl::StatusOr<v1::SetWriteWindowReply> SetWriteWindow(const std::string& a,
                                                         const v1::SetWriteWindowRequest& r) override {
    return to_->SetWriteWindow(a, r);
  }
  absl::StatusOr<v1::ApplyDeltaReply> ApplyDelta(const std::string& a, const v1::ApplyDeltaRequest& r) override {
    return to_->ApplyDelta(a, r);
  }
  absl::Status Pause(const std::string& a, const std::string& mode) override { return to_->Pause(a, mode); }
  absl::Status PostProcess(const std::string& a, const std::string& v) override { return to_->PostProcess(a, v); }
  absl::Status SetWeightVersion(const std::string& a, const std::string& v) override {
    return to_->SetWeightVersion(a, v);
  }
  absl::Status Continue(const std::string& a) override { return to_->Continue(a); }
  absl::StatusOr<v1::WriteChecksumsReply> WriteChecksums(const std::string& a, int64_t v) override {
    return to_->WriteChecksums(a, v);
  }
  absl::StatusOr<v1::ChecksumReply> EngineChecksums(const std::string& a, const v1::RankRequest& r) override {
    return to_->EngineChecksums(a, r);
  }
  absl::Status Switch(const std::string& a, const v1::SwitchRequest& r) override { return to_->Switch(a, r); }
  absl::Status PrepareSwitch(const std::string& a, const v1::SwitchRequest& r) override {
    return to_->PrepareSwitch(a, r);
  }

 private:
  ScriptedPeers* to_;
};

// Calls Status() every 5 ms from its own thread while it lives; the longest answer.
class StatusProbe {
 public:
  explicit StatusProbe(Coordinator* c)
      : thread_([this, c] {
          while (!stop_) {
            const absl::Time t0 = absl::Now();
            c->Status();
            const absl::Duration took = absl::Now() - t0;
            std::lock_guard<std::mutex> l(mu_);
            longest_ = std::max(longest_, took);
            std::this_thread::sleep_for(5ms);
          }
        }) {}
  ~StatusProbe() { Stop(); }
  absl::Duration Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    std::lock_guard<std::mutex> l(mu_);
    return longest_;
  }

 private:
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  absl::Duration longest_ = absl::ZeroDuration();
  std::thread thread_;
};

v1::RegisterNodeRequest Source(const std::string& id) { return testing::SourceRegistration(id); }

v1::RegisterNodeRequest Target(const std::string& id, const std::string& engine) {
  return testing::TargetRegistration(id, engine, 1);
}

// How an engine offers staging memory: none, a second copy (the reference engine's --staging) or its own segments
// made live by its reload (vLLM's staged attach).
enum class Staging { kNone, kSecondCopy, kInPlace };

v1::RegisterNodeRequest StagedTarget(const std::string& id, const std::string& engine, Staging staging) {
  v1::RegisterNodeRequest r = Target(id, engine);
  v1::RankLayout* l = r.mutable_engines(0)->mutable_ranks(0);
  if (staging == Staging::kSecondCopy) l->set_staging_segment_shift(1);
  if (staging == Staging::kInPlace) {
    r.mutable_engines(0)->set_kind("vllm");
    l->set_stages_in_place(true);
  }
  return r;
}

// Two source nodes s0, s1 (each given work: no minimum per source) and engines e0, e1 on target nodes t0, t1, with
// the staging memory given (e0's, e1's).
struct Cluster {
  ScriptedPeers* peers;
  std::unique_ptr<Coordinator> c;

  // fanout_parallel: the coordinator's workers per phase (0: its default).
  // heartbeat_seconds > 0: leases of that interval, and a lease watch running (StartLeaseWatch).
  explicit Cluster(Staging e0 = Staging::kNone, Staging e1 = Staging::kNone, size_t fanout_parallel = 0,
                   double heartbeat_seconds = 0) {
    CoordinatorOptions o;
    o.min_source_bytes = 0;
    if (fanout_parallel > 0) o.fanout_parallel = fanout_parallel;
    if (heartbeat_seconds > 0) {
      o.heartbeat_seconds = heartbeat_seconds;
      o.lease_check_seconds = heartbeat_seconds / 4;
    }
    auto p = std::make_unique<ScriptedPeers>();
    peers = p.get();
    c = std::make_unique<Coordinator>(o, std::move(p));
    peers->coordinator = c.get();
    for (const char* s : {"s0", "s1"}) REQUIRE(c->RegisterNode(Source(s)).ok());
    for (const auto& [t, e, staging] : {std::tuple("t0", "e0", e0), std::tuple("t1", "e1", e1)}) {
      const v1::RegisterNodeRequest r = StagedTarget(t, e, staging);
      REQUIRE(c->RegisterNode(r).ok());
      if (staging != Staging::kNone) peers->StagedEngine(e, r.engines(0).ranks(0));
    }
    if (heartbeat_seconds > 0) c->StartLeaseWatch();
  }
  absl::Status Begin(int64_t v, const std::string& mode = "", const std::string& delta = "") {
    v1::BeginUpdateRequest r;
    r.set_version(v);
    r.set_mode(mode);
    r.set_delta(delta);
    return c->BeginUpdate(r).status();
  }
  absl::Status Commit(int64_t v) {
    v1::CommitUpdateRequest r;
    r.set_version(v);
    return c->CommitUpdate(r).status();
  }
  absl::StatusOr<v1::AbortUpdateReply> Abort(int64_t v, const std::string& reason = "") {
    v1::AbortUpdateRequest r;
    r.set_version(v);
    r.set_reason(reason);
    return c->AbortUpdate(r);
  }
  absl::Status Update(int64_t v, const std::string& mode = "") {
    absl::Status st = Begin(v, mode);
    return st.ok() ? Commit(v) : st;
  }
  v1::UpdateRecord LastRecord() {
    const v1::HistoryReply h = c->History(v1::HistoryRequest());
    REQUIRE(h.records_size() > 0);
    return h.records(h.records_size() - 1);
  }
  // A heartbeat from source `id` reporting what it really holds.
  void Heartbeat(const std::string& id) {
    v1::HeartbeatRequest hb;
    hb.set_node_id(id);
    hb.set_address(id + ":1");
    const ScriptedPeers::SourceTruth& s = peers->Source(id + ":1");
    hb.set_plan_epoch(s.epoch);
    hb.set_config_digest(s.digest);
    REQUIRE(c->Heartbeat(hb).known());
  }
  // Every engine serves version `v`, by the coordinator's records and by what the engines were told.
  void CheckAllServing(const std::string& v) {
    const v1::ClusterStatus st = c->Status();
    CHECK(st.state() == "idle");
    CHECK(st.current_version() == v);
    CHECK_FALSE(st.engines_hold_partial_writes());
    CHECK(st.not_resumed_size() == 0);
    for (const auto& n : st.nodes())
      for (const auto& d : n.engine_details()) {
        INFO(d.engine_id());
        CHECK(d.state() == "serving");
        CHECK(d.weight_version() == v);
        const ScriptedPeers::EngineTruth t = peers->Engine(d.address());
        CHECK_FALSE(t.paused);
        CHECK(t.version == v);
      }
  }
};

// The invariants of the phase tables (daemon/coordinator/phase_table.h, docs/operations.md "Failure semantics"),
// checked against what the engines were really told, after update `v` ended (`before`: the current version before
// it; `dirty_before`: whether engines held partial writes before it). Returns what was violated, empty when nothing:
//   (a) no unpaused engine serves weights other than its label says;
//   (b) the status reports every engine's label as it is, and an engine reported serving is unpaused (reported
//       paused: paused); a router's "ready" is true only of such an engine on the current version;
//   (c) the current version never goes backwards;
//   (f) an update none of whose sources wrote a byte leaves no engine paused (a failure before the first write
//       resumes every engine at its version), unless an earlier failure had left them holding partial writes.
std::vector<std::string> Violations(Cluster& k, int64_t v, int64_t before, bool dirty_before) {
  std::vector<std::string> out;
  const v1::ClusterStatus st = k.c->Status();
  const int64_t current = st.current_version().empty() ? -1 : std::stoll(st.current_version());
  if (current < before) out.push_back(absl::StrCat("(c) current version ", current, " < ", before));
  const v1::UpdateRecord last = k.LastRecord();
  const bool nothing_written = !last.success() && !k.peers->AnyWrote(v) && last.mode() != "staged";
  const v1::EngineStates ready = EngineStatesOf(st);
  std::map<std::string, bool> ready_of;
  for (const auto& e : ready.engines()) ready_of[e.engine_id()] = e.ready();
  for (const auto& n : st.nodes())
    for (const auto& d : n.engine_details()) {
      const ScriptedPeers::EngineTruth t = k.peers->Engine(d.address());
      const std::string who = absl::StrCat(d.engine_id(), " (", d.state(), ", label ", t.version, ", weights ",
                                           t.weights, t.paused ? ", paused" : ", unpaused", ")");
      if (!t.paused && t.weights != t.version) out.push_back("(a) serves weights its label does not say: " + who);
      if (d.weight_version() != t.version) out.push_back("(b) label reported as " + d.weight_version() + ": " + who);
      if (d.state() == "serving" && t.paused) out.push_back("(b) reported serving but paused: " + who);
      if (d.state() == "paused" && !t.paused) out.push_back("(b) reported paused but serving: " + who);
      if (ready_of[d.engine_id()] && (t.paused || t.version != st.current_version() || t.weights != t.version))
        out.push_back("(b) ready for routers but not serving the current version: " + who);
      if (nothing_written && !dirty_before && t.paused)
        out.push_back("(f) left paused although nothing of the update was written: " + who);
    }
  return out;
}

// The peer a fault is injected at, and how the coordinator's error names that call there.
struct Victim {
  std::string addr;
  std::string named;
};
Victim VictimOf(Rpc rpc) {
  switch (rpc) {
    case Rpc::kPause:
      return {"e1:2", "pause engine e1"};
    case Rpc::kEngineInfo:
      return {"e0:2", "engine info from engine e0"};  // the first engine is asked
    case Rpc::kConfigureSource:
      return {"s1:1", "configure source s1 (s1:1)"};
    case Rpc::kOpenWindow:
      return {"t1:1", "opening the write window of target t1 (t1:1)"};
    case Rpc::kStartUpdate:
      return {"s1:1", "start source s1 (s1:1)"};
    case Rpc::kFinishUpdate:
      return {"s1:1", "finish update at source s1 (s1:1)"};
    case Rpc::kCloseWindow:
      return {"t1:1", "closing the write window of target t1 (t1:1)"};
    case Rpc::kApplyDelta:
      return {"t1:1", "apply_delta at target t1 (t1:1)"};
    case Rpc::kPostProcess:
      return {"e1:2", "post_process engine e1"};
    case Rpc::kSetWeightVersion:
      return {"e1:2", "set_version engine e1"};
    case Rpc::kContinue:
      return {"e1:2", "continue engine e1"};
    case Rpc::kAbortSourceUpdate:
      return {"s1:1", "abort at source s1 (s1:1)"};
    case Rpc::kWriteChecksums:
      return {"s1:1", "write checksums of source s1 (s1:1)"};
    case Rpc::kEngineChecksums:
      return {"e1:2", "staging not verified"};
    case Rpc::kSwitch:
      return {"e1:2", "switch engine e1"};
  }
  return {};
}

// Whether a failure of `rpc` comes before any byte of the update reached the engines: the classic phase table
// resumes every engine at its version (kResumeOld; at the start, kResumeIfClean with sources that wrote nothing).
bool BeforeFirstWrite(Rpc rpc) {
  switch (rpc) {
    case Rpc::kPause:
    case Rpc::kEngineInfo:
    case Rpc::kConfigureSource:
    case Rpc::kOpenWindow:
    case Rpc::kStartUpdate:
      return true;
    default:
      return false;
  }
}

TEST_CASE(
    "faults: every call of every phase fails, times out, hangs or answers late; the coordinator keeps "
    "answering, ends the update naming the call, records where the engines are, and runs the next update") {
  const Rpc rpc = GENERATE(Rpc::kPause, Rpc::kEngineInfo, Rpc::kConfigureSource, Rpc::kOpenWindow, Rpc::kStartUpdate,
                           Rpc::kFinishUpdate, Rpc::kCloseWindow, Rpc::kApplyDelta, Rpc::kPostProcess,
                           Rpc::kSetWeightVersion, Rpc::kContinue, Rpc::kAbortSourceUpdate);
  const Fault fault = GENERATE(Fault::kUnavailable, Fault::kInternal, Fault::kTimeout, Fault::kHang, Fault::kLate);
  INFO(Name(rpc) << " " << Name(fault));
  Cluster k;
  REQUIRE(k.Update(1).ok());
  k.CheckAllServing("1");
  // A join: update 2 re-plans, so it asks the engine info and configures the sources again.
  REQUIRE(k.c->RegisterNode(Target("t2", "e2")).ok());
  const Victim victim = VictimOf(rpc);
  k.peers->Arm(rpc, fault, victim.addr);

  StatusProbe probe(k.c.get());
  absl::Status ended = k.Begin(2);
  if (ended.ok()) {
    if (rpc == Rpc::kAbortSourceUpdate) {
      // Only an abort calls it: the operator aborts update 2.
      auto a = k.Abort(2, "step rejected");
      ended = a.status();
      if (a.ok() && !a->record().error().empty()) ended = absl::AbortedError(a->record().error());
    } else {
      ended = k.Commit(2);
    }
  }
  const absl::Duration longest = probe.Stop();
  CHECK(longest < absl::FromChrono(kAnswerWithin));
  CHECK(k.peers->Blocked().empty());
  CHECK(k.peers->Calls(rpc, victim.addr) > 0);  // the fault was met

  const v1::ClusterStatus st = k.c->Status();
  const v1::UpdateRecord last = k.LastRecord();
  CHECK(last.version() == 2);
  // A late answer, and a window that could not be closed after the sources finished (logged; the next update's
  // windows replace it), do not fail the update.
  const bool tolerated = fault == Fault::kLate || rpc == Rpc::kCloseWindow;
  if (rpc == Rpc::kAbortSourceUpdate) {
    INFO(ended.ToString());
    CHECK(last.aborted());
    CHECK(absl::StrContains(last.error(), "aborted by the operator: step rejected"));
    CHECK(st.state() == "failed");
    CHECK(st.current_version() == "1");
    if (!tolerated) CHECK(absl::StrContains(last.error(), victim.named));
    // A source that could not tell what it wrote counts as written.
    CHECK(st.engines_hold_partial_writes() == !tolerated);
    // Nothing was pushed: every source that answered said so; one that could not answer counts as written.
    if (tolerated) CHECK(absl::StrContains(last.error(), "engines were resumed at version 1"));
  } else if (tolerated) {
    INFO(ended.ToString());
    CHECK(ended.ok());
    CHECK(last.success());
    k.CheckAllServing("2");
  } else if (rpc == Rpc::kContinue) {
    // Past the commit point (every engine held version 2 and its label): the update committed, the engine whose
    // Continue failed is named, paused at version 2, and nothing is flagged as partly written.
    INFO(ended.ToString());
    CHECK(ended.code() == absl::StatusCode::kUnavailable);
    CHECK(absl::StrContains(ended.message(),
                            "update 2 committed: the fleet is on version 2; 1 of 3 engines not resumed (e1)"));
    CHECK(absl::StrContains(ended.message(), victim.named));
    CHECK(last.success());
    CHECK(last.committed_unix_ms() >= last.started_unix_ms());
    REQUIRE(last.not_resumed_size() == 1);
    CHECK(last.not_resumed(0) == "e1");
    CHECK(st.state() == "idle");
    CHECK(st.current_version() == "2");
    CHECK_FALSE(st.engines_hold_partial_writes());
    REQUIRE(st.not_resumed_size() == 1);
    CHECK(st.not_resumed(0) == "e1");
    for (const auto& n : st.nodes())
      for (const auto& d : n.engine_details()) {
        INFO(d.engine_id() << " " << d.state() << " at " << d.weight_version());
        const ScriptedPeers::EngineTruth t = k.peers->Engine(d.address());
        CHECK(t.version == "2");
        CHECK(d.weight_version() == "2");
        CHECK(t.paused == (d.engine_id() == "e1"));
        CHECK(d.state() == (d.engine_id() == "e1" ? "failed: continue" : "serving"));
      }
  } else {
    // (b) the update ended with an error naming the call and the peer.
    INFO(ended.ToString());
    CHECK(ended.code() == absl::StatusCode::kAborted);
    CHECK(absl::StrContains(ended.message(), victim.named));
    CHECK_FALSE(last.success());
    CHECK(absl::StrContains(last.error(), victim.named));
    // (c) one known version: the current one stays 1; every engine is serving v2 only if it was continued at 2
    // (the error then names it), else paused or failed with the phase; the records match what the engines were told.
    CHECK(st.state() == "failed");
    CHECK(st.current_version() == "1");
    CHECK(st.engines_hold_partial_writes() == !BeforeFirstWrite(rpc));
    // Before the first write every engine serves version 1 again (the error says so); after it, none was continued.
    CHECK(absl::StrContains(ended.message(),
                            BeforeFirstWrite(rpc) ? "engines were resumed at version 1" : "engines stay paused"));
    for (const auto& n : st.nodes())
      for (const auto& d : n.engine_details()) {
        INFO(d.engine_id() << " " << d.state() << " at " << d.weight_version());
        const ScriptedPeers::EngineTruth t = k.peers->Engine(d.address());
        CHECK(d.weight_version() == t.version);
        if (BeforeFirstWrite(rpc)) {
          CHECK(t.version == (d.engine_id() == "e2" ? "" : "1"));  // e2 joined for update 2: never labelled
          // The engine whose pause failed was not paused by the update: left as its record says (not called again).
          CHECK(d.state() == (rpc == Rpc::kPause && d.engine_id() == "e1" ? "failed: pause" : "serving"));
          CHECK_FALSE(t.paused);
        } else {
          CHECK((d.state() == "paused" || absl::StartsWith(d.state(), "failed: ")));
          CHECK(t.paused);
        }
      }
  }
  const std::vector<std::string> broken = Violations(k, 2, 1, false);
  INFO(absl::StrJoin(broken, "\n"));
  CHECK(broken.empty());
  // (d) the fault gone, the next update runs and every engine serves it.
  k.peers->Disarm();
  const absl::Status next = k.Update(3);
  INFO(next.ToString());
  REQUIRE(next.ok());
  k.CheckAllServing("3");
  CHECK(k.peers->Blocked().empty());
}

// An operator's abort while the call of `rpc` hangs (no stand-in deadline within the test: only a cancellation
// ends it) returns promptly (kAnswerWithin), cancels the call, records the update as aborted; the next update runs.
void AbortWhileHanging(Rpc rpc) {
  INFO(Name(rpc));
  Cluster k;
  REQUIRE(k.Update(1).ok());
  REQUIRE(k.c->RegisterNode(Target("t2", "e2")).ok());  // update 2 configures the sources
  const Victim victim = VictimOf(rpc);
  k.peers->hang_deadline = 10s;  // far beyond the kAnswerWithin the abort has
  k.peers->Arm(rpc, Fault::kHang, victim.addr);
  const bool in_commit =
      rpc == Rpc::kFinishUpdate || rpc == Rpc::kApplyDelta || rpc == Rpc::kPostProcess || rpc == Rpc::kSetWeightVersion;
  if (in_commit) REQUIRE(k.Begin(2).ok());
  absl::Status driven = absl::UnknownError("not run");
  std::thread driver([&] { driven = in_commit ? k.Commit(2) : k.Begin(2); });  // checked after the join
  Joiner joiner{driver, k.peers};
  REQUIRE(k.peers->AwaitHanging());
  CHECK(k.c->Status().state() == (in_commit ? "committing" : "beginning"));

  StatusProbe probe(k.c.get());
  const absl::Time t0 = absl::Now();
  auto a = k.Abort(2, "bad step");
  const absl::Duration took = absl::Now() - t0;
  if (!a.ok()) k.peers->ReleaseAll();
  driver.join();
  CHECK(probe.Stop() < absl::FromChrono(kAnswerWithin));
  CHECK(took < absl::FromChrono(kAnswerWithin));
  INFO(a.status().ToString());
  REQUIRE(a.ok());
  CHECK(k.peers->Cancels(victim.addr) > 0);
  CHECK(a->record().aborted());
  CHECK(absl::StrContains(a->record().error(), "aborted by the operator: bad step"));
  CHECK(driven.code() == absl::StatusCode::kAborted);
  CHECK(absl::StrContains(driven.message(), "aborted by the operator: bad step"));
  // A repeat gets the same answer.
  auto again = k.Abort(2, "bad step");
  REQUIRE(again.ok());
  CHECK(again->SerializeAsString() == a->SerializeAsString());

  const v1::ClusterStatus st = k.c->Status();
  CHECK(st.state() == "failed");
  CHECK(st.current_version() == "1");
  const v1::UpdateRecord last = k.LastRecord();
  CHECK(last.version() == 2);
  CHECK(last.aborted());
  // Aborted before any byte was written (the fake's sources push only once asked to finish): every engine serves
  // version 1 again, and the abort's answer says they may be resumed; after the first write they stay paused.
  const bool before_write = BeforeFirstWrite(rpc);
  CHECK(a->engines_resumable() == before_write);
  CHECK(st.engines_hold_partial_writes() == !before_write);
  for (const auto& n : st.nodes())
    for (const auto& d : n.engine_details()) {
      INFO(d.engine_id() << " " << d.state());
      const ScriptedPeers::EngineTruth t = k.peers->Engine(d.address());
      CHECK(d.weight_version() == t.version);
      CHECK(t.paused == !before_write);
      // Before the first write: resumed, or (its pause hung or was never sent once the abort came) left unpaused as
      // its record says.
      if (before_write) CHECK((d.state() == "serving" || (rpc == Rpc::kPause && d.state() == "failed: pause")));
      CHECK(d.state() != (before_write ? "paused" : "serving"));
    }
  const std::vector<std::string> broken = Violations(k, 2, 1, false);
  INFO(absl::StrJoin(broken, "\n"));
  CHECK(broken.empty());
  // Sources that were started or were finishing are told to abort (their writes stop).
  if (rpc == Rpc::kStartUpdate || rpc == Rpc::kFinishUpdate) CHECK(k.peers->Calls(Rpc::kAbortSourceUpdate, "s0:1") > 0);

  k.peers->Disarm();
  const absl::Status next = k.Update(3);
  INFO(next.ToString());
  REQUIRE(next.ok());
  k.CheckAllServing("3");
  CHECK(k.peers->Blocked().empty());
}

TEST_CASE("faults: abort ends an update in every phase, at once, the hung call cancelled") {
  SECTION("while Pause hangs") { AbortWhileHanging(Rpc::kPause); }
  SECTION("while EngineInfo hangs") { AbortWhileHanging(Rpc::kEngineInfo); }
  SECTION("while ConfigureSource hangs") { AbortWhileHanging(Rpc::kConfigureSource); }
  SECTION("while the write window opens") { AbortWhileHanging(Rpc::kOpenWindow); }
  SECTION("while StartUpdate hangs") { AbortWhileHanging(Rpc::kStartUpdate); }
  SECTION("while FinishUpdate hangs") { AbortWhileHanging(Rpc::kFinishUpdate); }
  SECTION("while ApplyDelta hangs") { AbortWhileHanging(Rpc::kApplyDelta); }
  SECTION("while PostProcess hangs") { AbortWhileHanging(Rpc::kPostProcess); }
  SECTION("while SetWeightVersion hangs") { AbortWhileHanging(Rpc::kSetWeightVersion); }
}

// An abort while engines still wait for a worker of the pause phase (one worker, the first engine's pause hung): the
// engine never asked is recorded as its pause failed, like the one whose pause was cancelled, never as registered or
// serving; the next update pauses and updates both.
TEST_CASE("faults: an abort while engines queue for their pause records each engine never asked as failed: pause") {
  Cluster k(Staging::kNone, Staging::kNone, 1);
  REQUIRE(k.Update(1).ok());
  k.peers->hang_deadline = 10s;
  k.peers->Arm(Rpc::kPause, Fault::kHang, "e0:2");
  const int e1_pauses = k.peers->Calls(Rpc::kPause, "e1:2");
  absl::Status driven = absl::UnknownError("not run");
  std::thread driver([&] { driven = k.Begin(2); });
  Joiner joiner{driver, k.peers};
  REQUIRE(k.peers->AwaitHanging());
  auto a = k.Abort(2, "bad step");
  INFO(a.status().ToString());
  REQUIRE(a.ok());
  driver.join();
  CHECK(driven.code() == absl::StatusCode::kAborted);
  CHECK(k.peers->Calls(Rpc::kPause, "e1:2") == e1_pauses);  // queued behind e0, never asked
  CHECK_FALSE(k.peers->Engine("e1:2").paused);
  // The update's record says which engines it never paused (their pause is recorded as failed, cancelled), and so
  // does Status: neither was paused by the update, so neither is asked to resume.
  const v1::UpdateRecord last = k.LastRecord();
  int cancelled_pauses = 0;
  for (const auto& e : last.engine_phases())
    if (e.phase() == "pause" && !e.ok()) ++cancelled_pauses;
  CHECK(cancelled_pauses == 2);
  int engines = 0;
  const v1::ClusterStatus st = k.c->Status();
  for (const auto& n : st.nodes())
    for (const auto& d : n.engine_details()) {
      INFO(d.engine_id() << " " << d.state());
      CHECK(d.state() == "failed: pause");
      CHECK_FALSE(k.peers->Engine(d.address()).paused);
      ++engines;
    }
  CHECK(engines == 2);
  k.peers->Disarm();
  REQUIRE(k.Update(3).ok());
  k.CheckAllServing("3");
}

// Past the commit point (docs/operations.md): every engine holds the version and its label, so an engine whose
// Continue fails (refused, or its process gone: connection refused) leaves the update committed, that engine paused at
// the new version and named; a retried CommitUpdate or ResumeEngines (wsyncctl resume) continues it.
TEST_CASE("past the commit point: a failed Continue commits with the engine not resumed; a retry or resume ends it") {
  Cluster k;
  REQUIRE(k.Update(1).ok());
  const Fault fault = GENERATE(Fault::kUnavailable, Fault::kInternal);
  INFO(Name(fault));
  k.peers->Arm(Rpc::kContinue, fault, "e1:2");
  REQUIRE(k.Begin(2).ok());
  const absl::Status ended = k.Commit(2);
  INFO(ended.ToString());
  CHECK(ended.code() == absl::StatusCode::kUnavailable);
  CHECK(absl::StrContains(ended.message(), "1 of 2 engines not resumed (e1)"));
  CHECK(absl::StrContains(ended.message(), "retried or `wsyncctl resume` runs"));
  CHECK(k.c->Status().current_version() == "2");
  CHECK(k.peers->Engine("e1:2").paused);
  // No newer version begins behind the operator's back, but nothing blocks one either: resuming is not required.
  CHECK(k.c->Status().state() == "idle");

  SECTION("a retried CommitUpdate continues the engines not resumed") {
    // Still failing: the same answer, the engine asked again.
    const int e0_before = k.peers->Calls(Rpc::kContinue, "e0:2");
    const int e1_before = k.peers->Calls(Rpc::kContinue, "e1:2");
    const absl::Status again = k.Commit(2);
    CHECK(again.code() == absl::StatusCode::kUnavailable);
    CHECK(absl::StrContains(again.message(), "1 of 2 engines not resumed (e1)"));
    CHECK(k.peers->Calls(Rpc::kContinue, "e1:2") == e1_before + 1);
    CHECK(k.peers->Calls(Rpc::kContinue, "e0:2") == e0_before);  // only those not resumed
    k.peers->Disarm();
    v1::CommitUpdateRequest r;
    r.set_version(2);
    auto done = k.c->CommitUpdate(r);
    INFO(done.status().ToString());
    REQUIRE(done.ok());
    CHECK(done->record().success());
    CHECK(done->record().not_resumed_size() == 0);
    k.CheckAllServing("2");
    CHECK(k.LastRecord().not_resumed_size() == 0);
    CHECK(k.Commit(2).ok());  // the recorded answer from now on
  }
  SECTION("ResumeEngines (wsyncctl resume) continues them") {
    k.peers->Disarm();
    auto r = k.c->ResumeEngines(v1::ResumeEnginesRequest());
    INFO(r.status().ToString());
    REQUIRE(r.ok());
    CHECK(r->version() == "2");
    k.CheckAllServing("2");
    CHECK(k.LastRecord().not_resumed_size() == 0);
    CHECK(k.Commit(2).ok());
  }
  SECTION("the next update continues them too") {
    k.peers->Disarm();
    REQUIRE(k.Update(3).ok());
    k.CheckAllServing("3");
  }
}

TEST_CASE("past the commit point: an abort while Continue hangs cancels it; the update stays committed") {
  Cluster k;
  REQUIRE(k.Update(1).ok());
  k.peers->hang_deadline = 10s;  // only a cancellation ends it within the test
  k.peers->Arm(Rpc::kContinue, Fault::kHang, "e1:2");
  REQUIRE(k.Begin(2).ok());
  absl::Status driven = absl::UnknownError("not run");
  std::thread driver([&] { driven = k.Commit(2); });
  Joiner joiner{driver, k.peers};
  REQUIRE(k.peers->AwaitHanging());
  StatusProbe probe(k.c.get());
  const absl::Time t0 = absl::Now();
  auto a = k.Abort(2, "bad step");
  const absl::Duration took = absl::Now() - t0;
  driver.join();
  CHECK(probe.Stop() < absl::FromChrono(kAnswerWithin));
  CHECK(took < absl::FromChrono(kAnswerWithin));
  INFO(a.status().ToString());
  CHECK(a.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(a.status().message(), "passed its commit point"));
  CHECK(k.peers->Cancels("e1:2") > 0);
  INFO(driven.ToString());
  CHECK(driven.code() == absl::StatusCode::kUnavailable);
  CHECK(absl::StrContains(driven.message(), "1 of 2 engines not resumed (e1)"));
  const v1::ClusterStatus st = k.c->Status();
  CHECK(st.current_version() == "2");
  CHECK_FALSE(st.engines_hold_partial_writes());
  const v1::UpdateRecord last = k.LastRecord();
  CHECK(last.success());
  CHECK_FALSE(last.aborted());
  k.peers->Disarm();
  REQUIRE(k.c->ResumeEngines(v1::ResumeEnginesRequest()).ok());
  k.CheckAllServing("2");
}

TEST_CASE("past the commit point: a coordinator that restarts during the continue phase records it committed") {
  char tmpl[] = "/tmp/wsync_commit_point_XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  const std::string dir = tmpl;
  const std::string db = dir + "/state.db";
  CoordinatorOptions o;
  o.min_source_bytes = 0;
  auto first_peers = std::make_unique<ScriptedPeers>();
  ScriptedPeers* peers = first_peers.get();
  peers->hang_deadline = 10s;
  auto first = std::make_unique<Coordinator>(o, std::move(first_peers));
  peers->coordinator = first.get();
  {
    auto store = SqliteStateStore::Open(db);
    REQUIRE(store.ok());
    REQUIRE(first->UseStateStore(*std::move(store)).ok());
  }
  for (const char* s : {"s0", "s1"}) REQUIRE(first->RegisterNode(Source(s)).ok());
  REQUIRE(first->RegisterNode(Target("t0", "e0")).ok());
  REQUIRE(first->RegisterNode(Target("t1", "e1")).ok());
  v1::BeginUpdateRequest b;
  b.set_version(2);
  REQUIRE(first->BeginUpdate(b).ok());
  peers->Arm(Rpc::kContinue, Fault::kHang, "e1:2");
  std::thread driver([&] {
    v1::CommitUpdateRequest c;
    c.set_version(2);
    first->CommitUpdate(c).IgnoreError();
  });
  Joiner joiner{driver, peers};
  REQUIRE(peers->AwaitHanging());
  REQUIRE(peers->AwaitPaused("e0:2", false));  // e0's Continue returned
  // The successor loads what the first one saved at its commit point (the first is still hung in the Continue) and
  // asks the same engines what they hold.
  Coordinator second(o, std::make_unique<SamePeers>(peers));
  {
    auto store = SqliteStateStore::Open(db);
    REQUIRE(store.ok());
    REQUIRE(second.UseStateStore(*std::move(store)).ok());
  }
  const v1::ClusterStatus st = second.Status();
  CHECK(st.current_version() == "2");
  CHECK(st.state() == "idle");
  CHECK_FALSE(st.engines_hold_partial_writes());
  // Which Continue returned is not in the store; the engines say: e0 serves version 2, e1 is paused at it.
  CHECK(std::vector<std::string>(st.not_resumed().begin(), st.not_resumed().end()) == std::vector<std::string>{"e1"});
  for (const auto& n : st.nodes())
    for (const auto& d : n.engine_details()) {
      INFO(d.engine_id() << " " << d.state());
      CHECK(d.weight_version() == "2");
      CHECK(d.state() == (d.engine_id() == "e0" ? "serving" : "paused"));
    }
  peers->Disarm();
  const v1::HistoryReply h = second.History(v1::HistoryRequest());
  REQUIRE(h.records_size() > 0);
  const v1::UpdateRecord& last = h.records(h.records_size() - 1);
  CHECK(last.version() == 2);
  CHECK(last.success());
  CHECK(last.committed_unix_ms() > 0);
  auto resumed = second.ResumeEngines(v1::ResumeEnginesRequest());
  INFO(resumed.status().ToString());
  REQUIRE(resumed.ok());
  CHECK(resumed->version() == "2");
  CHECK(second.Status().not_resumed_size() == 0);
  CHECK_FALSE(peers->Engine("e1:2").paused);
  peers->ReleaseAll();
  driver.join();
  first.reset();
  std::filesystem::remove_all(dir);
}

// A coordinator restarted on the store of one that died during an update, with the same engines: the first one is
// left hung in a call of `rpc` to `hung` (what the successor's store holds is from before that phase's calls).
struct Restart {
  std::string dir;
  std::string db;
  CoordinatorOptions o;
  ScriptedPeers* peers = nullptr;
  std::unique_ptr<Coordinator> first;
  std::unique_ptr<Coordinator> second;
  std::thread driver;

  explicit Restart(Staging staging) {
    char tmpl[] = "/tmp/wsync_restart_XXXXXX";
    REQUIRE(mkdtemp(tmpl) != nullptr);
    dir = tmpl;
    db = dir + "/state.db";
    o.min_source_bytes = 0;
    auto p = std::make_unique<ScriptedPeers>();
    peers = p.get();
    peers->hang_deadline = 10s;
    first = std::make_unique<Coordinator>(o, std::move(p));
    peers->coordinator = first.get();
    auto store = SqliteStateStore::Open(db);
    REQUIRE(store.ok());
    REQUIRE(first->UseStateStore(*std::move(store)).ok());
    for (const char* s : {"s0", "s1"}) REQUIRE(first->RegisterNode(Source(s)).ok());
    for (const auto& [t, e] : {std::pair("t0", "e0"), std::pair("t1", "e1")}) {
      const v1::RegisterNodeRequest r = StagedTarget(t, e, staging);
      REQUIRE(first->RegisterNode(r).ok());
      if (staging != Staging::kNone) peers->StagedEngine(e, r.engines(0).ranks(0));
    }
  }
  ~Restart() {
    peers->ReleaseAll();
    if (driver.joinable()) driver.join();
    second.reset();
    first.reset();
    std::filesystem::remove_all(dir);
  }
  absl::Status Update(int64_t v, const std::string& mode) {
    v1::BeginUpdateRequest b;
    b.set_version(v);
    b.set_mode(mode);
    WSYNC_RETURN_IF_ERROR(first->BeginUpdate(b).status());
    v1::CommitUpdateRequest c;
    c.set_version(v);
    return first->CommitUpdate(c).status();
  }
  // Runs update `v` on the first coordinator with `rpc` hanging at engine e1, until it hangs there.
  void HangIn(int64_t v, const std::string& mode, Rpc rpc) {
    peers->Arm(rpc, Fault::kHang, "e1:2");
    driver = std::thread([this, v, mode] { Update(v, mode).IgnoreError(); });
    REQUIRE(peers->AwaitHanging());
  }
  void RestartOnStore() {
    second = std::make_unique<Coordinator>(o, std::make_unique<SamePeers>(peers));
    auto store = SqliteStateStore::Open(db);
    REQUIRE(store.ok());
    REQUIRE(second->UseStateStore(*std::move(store)).ok());
  }
  v1::UpdateRecord LastRecord() {
    const v1::HistoryReply h = second->History(v1::HistoryRequest());
    REQUIRE(h.records_size() > 0);
    return h.records(h.records_size() - 1);
  }
  // What the successor reports of every engine against what the engine was really told: a label as it is; serving
  // only unpaused, holding its label's weights; paused only paused. Empty when true.
  std::vector<std::string> Untrue() {
    std::vector<std::string> out;
    const v1::ClusterStatus st = second->Status();
    for (const auto& n : st.nodes())
      for (const auto& d : n.engine_details()) {
        const ScriptedPeers::EngineTruth t = peers->Engine(d.address());
        const std::string who =
            absl::StrCat(d.engine_id(), " (", d.state(), ", label ", d.weight_version(), "; really: label ", t.version,
                         ", weights ", t.weights, t.paused ? ", paused)" : ", unpaused)");
        if (d.weight_version() != t.version) out.push_back("label not the engine's: " + who);
        if ((d.state() == "serving" || d.state() == "stale") && (t.paused || t.weights != t.version))
          out.push_back("reported serving: " + who);
        if (d.state() == "paused" && !t.paused) out.push_back("reported paused: " + who);
      }
    return out;
  }
};

// Bug found by the real-process fault matrix: the store holds the engines as they were before the pause fan-out, so
// the successor reported serving an engine the update had paused.
TEST_CASE("restart: during a classic pause fan-out, the successor reports each engine as the engine says it is") {
  Restart r(Staging::kNone);
  REQUIRE(r.Update(1, "").ok());
  r.HangIn(2, "", Rpc::kPause);
  REQUIRE(r.peers->AwaitPaused("e0:2", true));  // e0 paused, e1 inside its Pause
  r.RestartOnStore();
  const std::vector<std::string> untrue = r.Untrue();
  INFO(absl::StrJoin(untrue, "\n"));
  CHECK(untrue.empty());
  const v1::ClusterStatus st = r.second->Status();
  CHECK(st.current_version() == "1");
  CHECK(st.state() == "failed");
  const v1::UpdateRecord last = r.LastRecord();
  CHECK(last.version() == 2);
  CHECK_FALSE(last.success());
  CHECK(absl::StrContains(last.error(), "restarted during it"));
  // Never reported ready: e0 is paused.
  const v1::EngineStates ready = EngineStatesOf(st);
  for (const auto& e : ready.engines()) CHECK(e.ready() == (e.engine_id() == "e1"));
}

// Bug found by the real-process fault matrix: the staged commit point was not saved, so the successor recorded the
// update failed and labelled an engine that switched, was labelled and continued with the old version.
TEST_CASE("restart: during a staged update's continue fan-out, the successor records it committed") {
  Restart r(Staging::kSecondCopy);
  REQUIRE(r.Update(1, "staged").ok());
  r.HangIn(2, "staged", Rpc::kContinue);
  REQUIRE(r.peers->AwaitPaused("e0:2", false));  // e0 switched, labelled 2 and continued; e1 inside its Continue
  SECTION("the engines answer") {
    r.RestartOnStore();
    const std::vector<std::string> untrue = r.Untrue();
    INFO(absl::StrJoin(untrue, "\n"));
    CHECK(untrue.empty());
    const v1::ClusterStatus st = r.second->Status();
    CHECK(st.current_version() == "2");
    CHECK(std::vector<std::string>(st.not_resumed().begin(), st.not_resumed().end()) == std::vector<std::string>{"e1"});
  }
  SECTION("no engine answers: the saved commit point and labels, every engine reported not serving") {
    r.peers->AlsoArm(Rpc::kEngineInfo, Fault::kUnavailable, "e0:2");
    r.peers->AlsoArm(Rpc::kEngineInfo, Fault::kUnavailable, "e1:2");
    r.RestartOnStore();
    const v1::ClusterStatus st = r.second->Status();
    CHECK(st.current_version() == "2");
    CHECK(st.not_resumed_size() == 2);
    for (const auto& n : st.nodes())
      for (const auto& d : n.engine_details()) {
        INFO(d.engine_id());
        CHECK(d.state() == "failed: engine_info");
        CHECK(d.weight_version() == "2");
      }
  }
  const v1::UpdateRecord last = r.LastRecord();
  CHECK(last.version() == 2);
  CHECK(last.success());
  CHECK(last.committed_unix_ms() > 0);
  CHECK(r.second->Status().state() == "idle");
  // The next update (on the successor) brings every engine to it.
  r.peers->Disarm();
  v1::BeginUpdateRequest b;
  b.set_version(3);
  b.set_mode("staged");
  REQUIRE(r.second->BeginUpdate(b).ok());
  v1::CommitUpdateRequest c;
  c.set_version(3);
  const auto committed = r.second->CommitUpdate(c);
  INFO(committed.status().ToString());
  CHECK(committed.ok());
  CHECK(r.Untrue().empty());
}

TEST_CASE("faults: an abort returns at once even when the source it must stop does not answer (stopped process)") {
  Cluster k;
  REQUIRE(k.Update(1).ok());
  REQUIRE(k.Begin(2).ok());
  // s1 answers nothing any more, its AbortSourceUpdate included (a SIGSTOPped daemon), for 10 s.
  k.peers->hang_deadline = 10s;
  k.peers->Arm(Rpc::kFinishUpdate, Fault::kHang, "s1:1");
  k.peers->AlsoArm(Rpc::kAbortSourceUpdate, Fault::kHang, "s1:1");
  absl::Status driven = absl::UnknownError("not run");
  std::thread driver([&] { driven = k.Commit(2); });
  Joiner joiner{driver, k.peers};
  REQUIRE(k.peers->AwaitHanging());
  const absl::Time t0 = absl::Now();
  auto a = k.Abort(2, "stopped source");
  const absl::Duration took = absl::Now() - t0;
  // Recorded at once; nothing new begins while the sources are still being told.
  CHECK(took < absl::FromChrono(kAnswerWithin));
  INFO(a.status().ToString());
  REQUIRE(a.ok());
  CHECK(a->record().aborted());
  CHECK_FALSE(a->engines_resumable());
  CHECK(k.Begin(3).code() == absl::StatusCode::kFailedPrecondition);
  k.peers->ReleaseAll();  // the stopped daemon runs again (rather than the test waiting out its 10 s)
  driver.join();
  CHECK(driven.code() == absl::StatusCode::kAborted);
  CHECK(k.peers->Calls(Rpc::kAbortSourceUpdate, "s0:1") == 1);
  CHECK(k.c->Status().state() == "failed");
  k.peers->Disarm();
  REQUIRE(k.Update(4).ok());
  k.CheckAllServing("4");
}

TEST_CASE("faults: an abort that comes after every engine was continued finds the update committed") {
  Cluster k;
  REQUIRE(k.Update(1).ok());
  REQUIRE(k.Begin(2).ok());
  REQUIRE(k.Commit(2).ok());
  auto a = k.Abort(2);
  CHECK(a.status().code() == absl::StatusCode::kFailedPrecondition);
  k.CheckAllServing("2");
}

TEST_CASE("faults: a source that lost its configuration is configured again at the next update (heartbeat digest)") {
  Cluster k;
  REQUIRE(k.Update(1).ok());
  const int s0 = k.peers->Calls(Rpc::kConfigureSource, "s0:1");
  const int s1 = k.peers->Calls(Rpc::kConfigureSource, "s1:1");
  REQUIRE(s1 == 1);

  SECTION("heartbeats reporting the planned configuration change nothing") {
    k.Heartbeat("s0");
    k.Heartbeat("s1");
    v1::HeartbeatRequest older;  // a daemon that reports nothing (plan_epoch 0)
    older.set_node_id("s1");
    older.set_address("s1:1");
    REQUIRE(k.c->Heartbeat(older).known());
    REQUIRE(k.Update(2).ok());
    CHECK(k.peers->Calls(Rpc::kConfigureSource, "s0:1") == s0);
    CHECK(k.peers->Calls(Rpc::kConfigureSource, "s1:1") == s1);
  }
  SECTION("a source that restarted in place without its configuration") {
    k.peers->Source("s1:1") = ScriptedPeers::SourceTruth();  // holds nothing, like a new process
    k.Heartbeat("s1");
    const absl::Status st = k.Update(2);
    INFO(st.ToString());
    REQUIRE(st.ok());
    CHECK(k.peers->Calls(Rpc::kConfigureSource, "s1:1") == s1 + 1);
    CHECK(k.peers->Calls(Rpc::kConfigureSource, "s0:1") == s0);  // the other source keeps its configuration
    k.CheckAllServing("2");
  }
  SECTION("a configure that was answered but never applied") {
    REQUIRE(k.c->RegisterNode(Target("t2", "e2")).ok());  // update 2 configures both sources
    k.peers->Source("s1:1").drop_configure = true;
    const absl::Status failed = k.Update(2);
    INFO(failed.ToString());
    CHECK(absl::StrContains(failed.message(), "but this source is configured for plan"));
    k.peers->Source("s1:1").drop_configure = false;
    const int before = k.peers->Calls(Rpc::kConfigureSource, "s1:1");
    // Not once, but in every later update, until its heartbeat tells the coordinator what it holds.
    k.Heartbeat("s0");
    k.Heartbeat("s1");
    const absl::Status st = k.Update(3);
    INFO(st.ToString());
    REQUIRE(st.ok());
    CHECK(k.peers->Calls(Rpc::kConfigureSource, "s1:1") == before + 1);
    k.CheckAllServing("3");
  }
}

// Staged updates under faults at stage, verify and switch (docs/operations.md, "Staged updates"): e0 stages in place
// (vLLM), e1 in a second copy (reference engine). A source failing during the stage abandons the update with every
// engine serving the old version, never paused; a verify that cannot hear the sources switches none; an engine whose
// staging is not verified, whose pause fails (dead between verify and switch) or that refuses Switch is left out,
// stale, serving its old version unpaused, while the other switches. The next staged update brings every engine up.
TEST_CASE("faults, staged: stage, verify and switch fail, time out, hang or answer late; engines left out are stale") {
  const Rpc rpc = GENERATE(Rpc::kStartUpdate, Rpc::kFinishUpdate, Rpc::kWriteChecksums, Rpc::kEngineChecksums,
                           Rpc::kPause, Rpc::kSwitch, Rpc::kPostProcess, Rpc::kSetWeightVersion, Rpc::kContinue);
  const Fault fault = GENERATE(Fault::kUnavailable, Fault::kInternal, Fault::kTimeout, Fault::kHang, Fault::kLate);
  INFO(Name(rpc) << " " << Name(fault));
  Cluster k(Staging::kInPlace, Staging::kSecondCopy);
  REQUIRE(k.Update(1, "staged").ok());
  k.CheckAllServing("1");
  const Victim victim = VictimOf(rpc);
  k.peers->Arm(rpc, fault, victim.addr);

  StatusProbe probe(k.c.get());
  const absl::Status ended = k.Update(2, "staged");
  CHECK(probe.Stop() < absl::FromChrono(kAnswerWithin));
  CHECK(k.peers->Blocked().empty());
  CHECK(k.peers->Calls(rpc, victim.addr) > 0);
  INFO(ended.ToString());

  const v1::ClusterStatus st = k.c->Status();
  const v1::UpdateRecord last = k.LastRecord();
  CHECK(last.version() == 2);
  CHECK(last.mode() == "staged");
  const std::vector<std::string> broken = Violations(k, 2, 1, false);
  INFO(absl::StrJoin(broken, "\n"));
  CHECK(broken.empty());
  // Past its switch (post-process, set version, continue) an engine that fails stays paused: it holds version 2.
  const bool past_switch = fault != Fault::kLate && (rpc == Rpc::kPostProcess || rpc == Rpc::kSetWeightVersion ||
                                                     rpc == Rpc::kContinue);
  // Otherwise no engine stays paused; and none ever holds partial live weights.
  CHECK_FALSE(st.engines_hold_partial_writes());
  CHECK_FALSE(k.peers->Engine("e0:2").paused);
  CHECK(k.peers->Engine("e1:2").paused == past_switch);
  std::map<std::string, v1::EngineSummary> detail;
  for (const auto& n : st.nodes())
    for (const auto& d : n.engine_details()) detail[d.engine_id()] = d;
  REQUIRE(detail.size() == 2);

  if (fault == Fault::kLate) {
    CHECK(ended.ok());
    CHECK(last.switched_size() == 2);
    k.CheckAllServing("2");
  } else if (past_switch) {
    // e0 serves 2. e1 switched (its live weights are 2's) and then failed: committed, e1 named, paused, never
    // reported ready; its label is 2 only where set_version had passed (a failed Continue: not resumed).
    INFO(ended.ToString());
    CHECK(ended.code() == absl::StatusCode::kUnavailable);
    CHECK(absl::StrContains(ended.message(), "update 2 committed: the fleet is on version 2"));
    CHECK(absl::StrContains(ended.message(), victim.named));
    CHECK(last.success());
    CHECK(st.current_version() == "2");
    CHECK(detail["e0"].state() == "serving");
    CHECK(detail["e0"].weight_version() == "2");
    const ScriptedPeers::EngineTruth t1 = k.peers->Engine("e1:2");
    CHECK(t1.live == "2");
    const v1::EngineStates routers = EngineStatesOf(st);
    for (const auto& e : routers.engines()) CHECK(e.ready() == (e.engine_id() == "e0"));
    if (rpc == Rpc::kContinue) {
      CHECK(t1.version == "2");
      CHECK(detail["e1"].weight_version() == "2");
      CHECK(detail["e1"].state() == "failed: continue");
      REQUIRE(last.not_resumed_size() == 1);
      CHECK(last.not_resumed(0) == "e1");
      CHECK(last.switched_size() == 2);
    } else {
      CHECK(t1.version == "1");
      CHECK(detail["e1"].weight_version() == "1");
      CHECK(detail["e1"].state() == (rpc == Rpc::kPostProcess ? "failed: post_process" : "failed: set_version"));
      CHECK(detail["e1"].stale());
      CHECK(detail["e1"].staged_version().empty());
      REQUIRE(last.switched_size() == 1);
      CHECK(last.switched(0) == "e0");
      REQUIRE(last.stale_size() == 1);
      CHECK(absl::StartsWith(last.stale(0), "e1: held paused after its switch: "));
      // The operator's resume leaves it paused: it would serve 2's weights labelled 1.
      auto r = k.c->ResumeEngines(v1::ResumeEnginesRequest());
      REQUIRE(r.ok());
      REQUIRE(r->held_size() == 1);
      CHECK(r->held(0) == "e1");
      CHECK(k.peers->Engine("e1:2").paused);
    }
  } else if (rpc == Rpc::kStartUpdate || rpc == Rpc::kFinishUpdate) {
    // A source failed during the stage: abandoned, nothing paused, nothing switched.
    CHECK_FALSE(ended.ok());
    CHECK(absl::StrContains(ended.message(), victim.named));
    CHECK(st.current_version() == "1");
    CHECK(last.switched_size() == 0);
    for (const char* e : {"e0", "e1"}) {
      INFO(e);
      CHECK(detail[e].weight_version() == "1");
      const ScriptedPeers::EngineTruth t = k.peers->Engine(absl::StrCat(e, ":2"));
      CHECK(t.version == "1");
      CHECK(t.live == "1");
    }
    CHECK(k.peers->Calls(Rpc::kSwitch, "e0:2") == 2);  // update 1's only (its prepare and its switch)
  } else if (rpc == Rpc::kWriteChecksums) {
    // Nothing can be verified without every source's record: no engine switches, both stay on 1.
    CHECK_FALSE(ended.ok());
    CHECK(absl::StrContains(ended.message(), "no engine switched to 2"));
    CHECK(absl::StrContains(ended.message(), victim.named));
    CHECK(st.current_version() == "1");
    for (const char* e : {"e0", "e1"}) {
      INFO(e);
      CHECK(detail[e].stale());
      CHECK(detail[e].weight_version() == "1");
      CHECK(k.peers->Engine(absl::StrCat(e, ":2")).live == "1");
    }
  } else {
    // e1 was left out (not verified, its pause failed, or it refused Switch); e0 switched.
    CHECK(ended.ok());
    CHECK(st.current_version() == "2");
    REQUIRE(last.switched_size() == 1);
    CHECK(last.switched(0) == "e0");
    REQUIRE(last.stale_size() == 1);
    CHECK(absl::StartsWith(last.stale(0), "e1: "));
    CHECK(absl::StrContains(last.stale(0), victim.named));
    CHECK(detail["e0"].state() == "serving");
    CHECK(detail["e0"].weight_version() == "2");
    CHECK(k.peers->Engine("e0:2").live == "2");
    CHECK(detail["e1"].stale());
    CHECK(detail["e1"].weight_version() == "1");
    const ScriptedPeers::EngineTruth t1 = k.peers->Engine("e1:2");
    CHECK(t1.version == "1");
    CHECK(t1.live == "1");
  }
  k.peers->Disarm();
  const absl::Status next = k.Update(3, "staged");
  INFO(next.ToString());
  REQUIRE(next.ok());
  k.CheckAllServing("3");
  const v1::ClusterStatus after = k.c->Status();
  for (const auto& n : after.nodes())
    for (const auto& d : n.engine_details()) CHECK_FALSE(d.stale());
}

TEST_CASE("faults, staged: staged bytes that differ from what the sources wrote leave that engine out") {
  Cluster k(Staging::kInPlace, Staging::kInPlace);
  REQUIRE(k.Update(1, "staged").ok());
  k.peers->Corrupt("e1:2");
  REQUIRE(k.Update(2, "staged").ok());
  const v1::UpdateRecord last = k.LastRecord();
  REQUIRE(last.stale_size() == 1);
  CHECK(absl::StrContains(last.stale(0), "staged flipped, the source wrote v2"));
  CHECK(k.peers->Engine("e1:2").live == "1");
  CHECK(k.peers->Engine("e0:2").live == "2");
  k.peers->Corrupt("");
  REQUIRE(k.Update(3, "staged").ok());
  k.CheckAllServing("3");
}

// The switch's re-hash runs before the pause (Switch with prepare, while the engines serve): a staging memory changed
// after its verify is refused there, that engine is left out without ever being paused, and the other switches.
TEST_CASE("faults, staged: staging memory changed after the verify is refused at the prepare; never paused") {
  Cluster k(Staging::kInPlace, Staging::kSecondCopy);
  REQUIRE(k.Update(1, "staged").ok());
  CHECK_FALSE(k.peers->Engine("e0:2").prepared_while_paused);
  CHECK_FALSE(k.peers->Engine("e1:2").prepared_while_paused);
  const int e1_pauses = k.peers->Calls(Rpc::kPause, "e1:2");
  k.peers->ChangeAfterVerify("e1:2");
  REQUIRE(k.Update(2, "staged").ok());
  const v1::UpdateRecord last = k.LastRecord();
  REQUIRE(last.switched_size() == 1);
  CHECK(last.switched(0) == "e0");
  REQUIRE(last.stale_size() == 1);
  CHECK(absl::StrContains(last.stale(0), "is not what was verified"));
  CHECK(absl::StrContains(last.stale(0), "(prepare)"));
  CHECK(k.peers->Calls(Rpc::kPause, "e1:2") == e1_pauses);
  CHECK_FALSE(k.peers->Engine("e1:2").paused);
  CHECK(k.peers->Engine("e1:2").live == "1");
  CHECK(k.peers->Engine("e0:2").live == "2");
  k.peers->ChangeAfterVerify("");
  REQUIRE(k.Update(3, "staged").ok());
  k.CheckAllServing("3");
}

TEST_CASE("staged: deltas stay possible where every engine stages in place; a second copy turns them off") {
  SECTION("every engine stages in place (vLLM): its staging memory holds the version last written") {
    Cluster k(Staging::kInPlace, Staging::kInPlace);
    REQUIRE(k.Update(1, "staged").ok());
    CHECK(k.LastRecord().delta_mode() == "auto");
    // The targets apply the records into the staging memory (and record the version it holds) before the verify.
    CHECK(k.peers->Calls(Rpc::kApplyDelta, "t1:1") == 1);
    REQUIRE(k.Begin(2, "staged", "always").ok());
    REQUIRE(k.Commit(2).ok());
    CHECK(k.LastRecord().delta_mode() == "always");
    k.CheckAllServing("2");
    // A target failing to apply them: nothing verified or switched, every engine serves on at 2, unpaused.
    k.peers->Arm(Rpc::kApplyDelta, Fault::kUnavailable, "t1:1");
    const absl::Status failed = k.Update(3, "staged");
    CHECK(absl::StrContains(failed.message(), "apply_delta at target t1 (t1:1)"));
    CHECK(k.peers->Calls(Rpc::kSwitch, "e0:2") == 4);  // updates 1 and 2, a prepare and a switch each
    for (const char* e : {"e0:2", "e1:2"}) {
      CHECK_FALSE(k.peers->Engine(e).paused);
      CHECK(k.peers->Engine(e).live == "2");
    }
    CHECK_FALSE(k.c->Status().engines_hold_partial_writes());
    k.peers->Disarm();
    REQUIRE(k.Update(4, "staged").ok());
    k.CheckAllServing("4");
  }
  SECTION("an engine with a second copy: that copy holds an older version") {
    Cluster k(Staging::kInPlace, Staging::kSecondCopy);
    REQUIRE(k.Update(1, "staged").ok());
    CHECK(k.LastRecord().delta_mode() == "off");
    CHECK(k.peers->Calls(Rpc::kApplyDelta, "t1:1") == 0);  // no version recorded: the next update is dense
    const absl::Status always = k.Begin(2, "staged", "always");
    CHECK(always.code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StrContains(always.message(), "delta=always cannot run with mode staged"));
    REQUIRE(k.Update(2).ok());  // classic still takes deltas
    CHECK(k.LastRecord().delta_mode() == "auto");
  }
  SECTION("an engine without staging memory is refused, named, before anything is paused") {
    Cluster k(Staging::kInPlace, Staging::kNone);
    const absl::Status st = k.Begin(1, "staged");
    CHECK(st.code() == absl::StatusCode::kFailedPrecondition);
    CHECK(absl::StrContains(st.message(), "engine e1 (reference, node t1) offers no staging memory"));
    CHECK(k.peers->Calls(Rpc::kPause, "e0:2") == 0);
  }
}


}  // namespace
}  // namespace wsync::daemon

namespace wsync::daemon {
namespace {

// The healthy nodes renew their leases every 20 ms while it lives, as their daemons do; the longest a heartbeat took
// to be answered, and whether every one was known.
class Heartbeats {
 public:
  Heartbeats(Cluster& k, std::vector<std::string> ids)
      : thread_([this, &k, ids = std::move(ids)] {
          while (!stop_) {
            for (const auto& id : ids) {
              v1::HeartbeatRequest hb;
              hb.set_node_id(id);
              hb.set_address(id + ":1");
              if (id[0] == 's') {
                const ScriptedPeers::SourceTruth s = k.peers->SourceNow(id + ":1");
                hb.set_plan_epoch(s.epoch);
                hb.set_config_digest(s.digest);
              }
              const absl::Time t0 = absl::Now();
              const bool known = k.c->Heartbeat(hb).known();
              std::lock_guard<std::mutex> l(mu_);
              longest_ = std::max(longest_, absl::Now() - t0);
              all_known_ &= known;
            }
            std::this_thread::sleep_for(20ms);
          }
        }) {}
  ~Heartbeats() {
    stop_ = true;
    thread_.join();
  }
  absl::Duration longest() {
    std::lock_guard<std::mutex> l(mu_);
    return longest_;
  }
  bool all_known() {
    std::lock_guard<std::mutex> l(mu_);
    return all_known_;
  }

 private:
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  absl::Duration longest_ = absl::ZeroDuration();
  bool all_known_ = true;
  std::thread thread_;
};

// Restores a phase table row however the test leaves its scope.
struct BrokenRow {
  UpdateMode mode;
  Phase phase;
  OnFailure was;
  BrokenRow(UpdateMode m, Phase p, OnFailure f) : mode(m), phase(p), was(OverridePolicyForTesting(m, p, f)) {}
  ~BrokenRow() { OverridePolicyForTesting(mode, phase, was); }
};

bool AnyStartsWith(const std::vector<std::string>& v, const std::string& prefix) {
  for (const auto& x : v)
    if (absl::StartsWith(x, prefix)) return true;
  return false;
}

// The invariants above can fail: one row of a phase table broken on purpose (what a new mode with a wrong failure
// path would do) is caught by them, naming the invariant and the engine.
TEST_CASE("phase tables: a row broken on purpose is caught by the invariants") {
  SECTION("classic finish resumes the engines (instead of keeping them paused) over partial writes") {
    Cluster k;
    REQUIRE(k.Update(1).ok());
    BrokenRow broken(UpdateMode::kClassic, Phase::kFinish, OnFailure::kResumeOld);
    k.peers->Arm(Rpc::kFinishUpdate, Fault::kUnavailable, "s1:1");
    REQUIRE(k.Begin(2).ok());
    CHECK_FALSE(k.Commit(2).ok());
    const std::vector<std::string> v = Violations(k, 2, 1, false);
    INFO(absl::StrJoin(v, "\n"));
    CHECK(AnyStartsWith(v, "(a) serves weights its label does not say: e0"));
  }
  SECTION("staged post-process leaves a switched engine out (continued at its old label) instead of holding it") {
    Cluster k(Staging::kInPlace, Staging::kSecondCopy);
    REQUIRE(k.Update(1, "staged").ok());
    BrokenRow broken(UpdateMode::kStaged, Phase::kPostProcess, OnFailure::kLeaveOutStale);
    k.peers->Arm(Rpc::kPostProcess, Fault::kUnavailable, "e1:2");
    k.Update(2, "staged").IgnoreError();
    const std::vector<std::string> v = Violations(k, 2, 1, false);
    INFO(absl::StrJoin(v, "\n"));
    CHECK(AnyStartsWith(v, "(a) serves weights its label does not say: e1"));
  }
  SECTION("classic start keeps the engines paused although no source wrote a byte") {
    Cluster k;
    REQUIRE(k.Update(1).ok());
    BrokenRow broken(UpdateMode::kClassic, Phase::kStart, OnFailure::kKeepPaused);
    k.peers->Arm(Rpc::kStartUpdate, Fault::kUnavailable, "s1:1");
    CHECK_FALSE(k.Begin(2).ok());
    const std::vector<std::string> v = Violations(k, 2, 1, false);
    INFO(absl::StrJoin(v, "\n"));
    CHECK(AnyStartsWith(v, "(f) left paused although nothing of the update was written: e0"));
  }
  SECTION("classic pause keeps the engines paused although nothing was written") {
    Cluster k;
    REQUIRE(k.Update(1).ok());
    BrokenRow broken(UpdateMode::kClassic, Phase::kPause, OnFailure::kKeepPaused);
    k.peers->Arm(Rpc::kPause, Fault::kUnavailable, "e1:2");
    CHECK_FALSE(k.Begin(2).ok());
    const std::vector<std::string> v = Violations(k, 2, 1, false);
    INFO(absl::StrJoin(v, "\n"));
    CHECK(AnyStartsWith(v, "(f) left paused although nothing of the update was written: e0"));
  }
}

// The staged fleet barrier is a row's width (phase_table.h: the switch's pause and switch call every engine at once):
// with one worker per phase, e1 is paused for the switch while e0's pause still hangs. In waves of --fanout-parallel
// (the row at kFanoutDefault) e1 would wait behind e0's hang and this fails.
TEST_CASE("faults, staged: the switch's pause calls every engine at once, whatever --fanout-parallel says") {
  Cluster k(Staging::kSecondCopy, Staging::kSecondCopy, 1);
  REQUIRE(k.Update(1, "staged").ok());
  CHECK(RowFor(UpdateMode::kStaged, Phase::kSwitchPause).fanout == kAllAtOnce);
  CHECK(RowFor(UpdateMode::kStaged, Phase::kSwitch).fanout == kAllAtOnce);
  k.peers->hang_deadline = 10s;  // only the release at the end stops it within the test
  k.peers->Arm(Rpc::kPause, Fault::kHang, "e0:2");
  absl::Status driven = absl::UnknownError("not run");
  std::thread driver([&] { driven = k.Update(2, "staged"); });
  Joiner joiner{driver, k.peers};
  REQUIRE(k.peers->AwaitHanging());
  CHECK(k.peers->AwaitPaused("e1:2", true));
  k.peers->ReleaseAll();
  driver.join();
  INFO(driven.ToString());
  // e0's pause was cancelled: it is left out, its live weights and label still update 1's; e1 switched to 2.
  CHECK(k.peers->Engine("e0:2").version == "1");
  CHECK(k.peers->Engine("e1:2").live == "2");
}

// The update driver (update_run.h) with fake steps: it walks the mode's table, not the order steps were bound in.
TEST_CASE("update driver: rows run in the table's order, once each, over the rows the RPC owns") {
  for (UpdateMode mode : {UpdateMode::kClassic, UpdateMode::kStaged}) {
    const std::vector<PhaseRow>& table = PhaseTable(mode);
    std::vector<Phase> ran;
    UpdateDriver d(
        mode, [] { return false; }, [](const UpdateDriver::Failure& f) { return f.why; });
    for (auto r = table.rbegin(); r != table.rend(); ++r)  // bound backwards
      if (r->phase != Phase::kPush)                        // a row with no step: skipped
        CHECK(d.Bind(r->phase, [&ran, p = r->phase](OnFailure) {
          ran.push_back(p);
          return absl::OkStatus();
        }));
    CHECK(d.Walk(table.front().phase, Phase::kStart).ok());
    CHECK(d.Walk(Phase::kFinish, table.back().phase).ok());
    std::vector<Phase> want;
    for (const PhaseRow& r : table)
      if (r.phase != Phase::kPush) want.push_back(r.phase);
    CHECK(ran == want);
    CHECK(d.ran() == want);
  }
  UpdateDriver classic(
      UpdateMode::kClassic, [] { return false; }, [](const UpdateDriver::Failure& f) { return f.why; });
  CHECK_FALSE(classic.Bind(Phase::kVerify, [](OnFailure) { return absl::OkStatus(); }));  // no such classic row
  CHECK(classic.Walk(Phase::kVerify, Phase::kContinue).code() == absl::StatusCode::kInternal);
  CHECK(classic.Walk(Phase::kContinue, Phase::kPause).code() == absl::StatusCode::kInternal);
}

// Every row of every table, made to fail: the walk stops there, the handler gets that row's phase and policy (read
// from the row when it failed: a row broken on purpose is what the handler applies), and the step got it too.
TEST_CASE("update driver: a row that fails applies that row's policy, wherever it sits") {
  for (UpdateMode mode : {UpdateMode::kClassic, UpdateMode::kStaged})
    for (const PhaseRow& failing : PhaseTable(mode))
      for (bool broken : {false, true}) {
        INFO(PhaseName(failing.phase) << (mode == UpdateMode::kStaged ? " (staged)" : " (classic)")
                                      << (broken ? ", row broken" : ""));
        const OnFailure want = broken ? (failing.on_failure == OnFailure::kKeepPaused ? OnFailure::kResumeOld
                                                                                      : OnFailure::kKeepPaused)
                                      : failing.on_failure;
        std::unique_ptr<BrokenRow> row;
        if (broken) row = std::make_unique<BrokenRow>(mode, failing.phase, want);
        std::vector<Phase> ran;
        std::optional<OnFailure> step_got;
        std::vector<UpdateDriver::Failure> handled;
        UpdateDriver d(
            mode, [] { return false; },
            [&](const UpdateDriver::Failure& f) {
              handled.push_back(f);
              return absl::AbortedError("handled");
            });
        for (const PhaseRow& r : PhaseTable(mode))
          d.Bind(r.phase, [&, p = r.phase](OnFailure policy) {
            ran.push_back(p);
            if (p != failing.phase) return absl::OkStatus();
            step_got = policy;
            return absl::UnavailableError("injected");
          });
        const absl::Status st = d.Walk(PhaseTable(mode).front().phase, PhaseTable(mode).back().phase);
        CHECK(st.message() == "handled");
        REQUIRE(handled.size() == 1);
        CHECK(handled[0].phase == failing.phase);
        CHECK(handled[0].policy == want);
        CHECK(handled[0].why.message() == "injected");
        CHECK(step_got == want);
        REQUIRE_FALSE(ran.empty());
        CHECK(ran.back() == failing.phase);  // no row after it ran
      }
}

TEST_CASE("update driver: a stop asked during a row ends the run at that row, with the row's policy") {
  bool stop = false;
  std::vector<UpdateDriver::Failure> handled;
  UpdateDriver d(
      UpdateMode::kClassic, [&] { return stop; },
      [&](const UpdateDriver::Failure& f) {
        handled.push_back(f);
        return absl::AbortedError("handled");
      });
  int after = 0;
  d.Bind(Phase::kPause, [](OnFailure) { return absl::OkStatus(); });
  d.Bind(Phase::kConfigure, [&](OnFailure) {
    stop = true;  // the operator's abort arrives while the configure calls run; they answer OK
    return absl::OkStatus();
  });
  d.Bind(Phase::kStart, [&](OnFailure) {
    ++after;
    return absl::OkStatus();
  });
  CHECK_FALSE(d.Walk(Phase::kPause, Phase::kStart).ok());
  REQUIRE(handled.size() == 1);
  CHECK(handled[0].phase == Phase::kConfigure);
  CHECK(handled[0].policy == OnFailure::kResumeOld);
  CHECK(handled[0].why.ok());
  CHECK(after == 0);
}

// The real coordinator runs its updates through the driver: the phases its records time appear in the order of the
// mode's table ("push" is timed by the finish row; "pause" of a staged update is the switch's pause row).
TEST_CASE("update driver: the coordinator's records time the phases in the table's order") {
  auto in_table_order = [](UpdateMode mode, const v1::UpdateRecord& rec) {
    const std::vector<PhaseRow>& table = PhaseTable(mode);
    size_t at = 0;
    std::vector<std::string> names;
    for (const auto& p : rec.phases()) {
      names.push_back(p.phase());
      while (at < table.size() && table[at].name != p.phase()) ++at;
      if (at == table.size()) return absl::StrJoin(names, ", ") + " <- out of the table's order";
      ++at;
    }
    return std::string();
  };
  Cluster k(Staging::kInPlace, Staging::kSecondCopy);
  REQUIRE(k.Update(1).ok());
  v1::UpdateRecord rec = k.LastRecord();
  CHECK(in_table_order(UpdateMode::kClassic, rec) == "");
  CHECK(rec.phases_size() >= 6);  // pause, configure, push, apply_delta, post_process, set_version, continue
  REQUIRE(k.Update(2, "staged").ok());
  rec = k.LastRecord();
  CHECK(in_table_order(UpdateMode::kStaged, rec) == "");
  CHECK(rec.phases_size() >= 7);  // push, verify, prepare, pause, switch, post_process, set_version, continue
  // The check can fail: a record in another order is caught.
  std::swap(*rec.mutable_phases(0), *rec.mutable_phases(rec.phases_size() - 1));
  CHECK(in_table_order(UpdateMode::kStaged, rec) != "");
}

// docs/operations.md's failure table is the one generated from the phase tables (one fact, one place).
TEST_CASE("phase tables: docs/operations.md shows them as they are") {
  std::ifstream in(WSYNC_SOURCE_DIR "/docs/operations.md");
  REQUIRE(in.good());
  const std::string doc((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  INFO("regenerate with: wsyncctl phases (or copy PhaseTableMarkdown())\n" << PhaseTableMarkdown());
  CHECK(absl::StrContains(doc, PhaseTableMarkdown()));
}

// The phases both modes run share their fan-outs (pause at begin, configure, start, open windows, finish, apply
// delta: one code path for both), which take the row's name and deadline from the classic table: the two tables must
// agree on them, or a staged update would run under a deadline its table does not show. Every row that names a
// deadline names one the commit's budget counts (PeerDeadlines), and every phase a mode runs has a row.
TEST_CASE("phase tables: rows both modes run agree on name and deadline; DeadlineFor answers from the row") {
  const auto& classic = PhaseTable(UpdateMode::kClassic);
  const auto& staged = PhaseTable(UpdateMode::kStaged);
  int shared = 0;
  for (const PhaseRow& c : classic)
    for (const PhaseRow& st : staged)
      if (c.phase == st.phase) {
        ++shared;
        INFO(c.name);
        CHECK(std::string(c.name) == st.name);
        CHECK(c.deadline_s == st.deadline_s);
      }
  CHECK(shared >= 8);
  for (UpdateMode mode : {UpdateMode::kClassic, UpdateMode::kStaged})
    for (const PhaseRow& r : PhaseTable(mode)) {
      CHECK(DeadlineFor(mode, r.phase) == r.deadline_s);
      CHECK(PhaseName(r.phase) == r.name);
    }
  CHECK(DeadlineFor(UpdateMode::kStaged, Phase::kVerify) == PeerDeadlines::kVerify);
  CHECK(DeadlineFor(UpdateMode::kClassic, Phase::kVerify) == 0);  // classic runs no verify: no deadline, logged
}

// A node whose lease lapsed (registered, never heard from again: a dead member, or an attacker with a valid source
// certificate) is left out of the next update instead of failing it with the fleet paused; it is never called.
TEST_CASE("leases: a node whose lease lapsed is not planned, paused or called; the update succeeds without it") {
  Cluster k(Staging::kNone, Staging::kNone, 0, /*heartbeat_seconds=*/1);
  Heartbeats beats(k, {"s0", "s1", "t0", "t1"});
  REQUIRE(k.Update(1).ok());
  // A source at an address nobody serves: every call to it fails, as a dial to it would.
  for (Rpc r : {Rpc::kConfigureSource, Rpc::kStartUpdate, Rpc::kFinishUpdate, Rpc::kAbortSourceUpdate})
    k.peers->AlsoArm(r, Fault::kUnavailable, "s9:1");
  REQUIRE(k.c->RegisterNode(Source("s9")).ok());
  // Wait for the coordinator to see its lease lapse (3 intervals: 3 s), bounded.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  bool lapsed = false;
  while (!lapsed && absl::Now() < deadline) {
    const v1::ClusterStatus st = k.c->Status();
    for (const auto& n : st.nodes())
      if (n.node_id() == "s9") lapsed = !n.reachable();
    if (!lapsed) std::this_thread::sleep_for(20ms);
  }
  REQUIRE(lapsed);
  const absl::Status st = k.Update(2);
  INFO(st.ToString());
  REQUIRE(st.ok());
  k.CheckAllServing("2");
  for (Rpc r : {Rpc::kConfigureSource, Rpc::kStartUpdate, Rpc::kFinishUpdate}) CHECK(k.peers->Calls(r, "s9:1") == 0);
  const v1::ClusterStatus st2 = k.c->Status();
  for (const auto& p : st2.plan()) CHECK(p.source_node() != "s9");
}

}  // namespace
}  // namespace wsync::daemon

namespace wsync::daemon {
namespace {

std::unique_ptr<testing::GatedStore> NewGatedStore(const std::string& name) {
  const std::string dir =
      absl::StrCat(std::filesystem::temp_directory_path().string(), "/wsync-faults-store-", getpid());
  std::filesystem::create_directories(dir);
  const std::string path = absl::StrCat(dir, "/", name, ".db");
  std::filesystem::remove(path);
  auto inner = SqliteStateStore::Open(path);
  REQUIRE(inner.ok());
  return std::make_unique<testing::GatedStore>(*std::move(inner));
}

// A stalled state store (an etcd leader election, a disk that stops) delays only what must be durable (the begin,
// here): Status and heartbeats answer at once throughout, no lease lapses although the stall outlasts the lease, and
// the update completes once the store is back.
TEST_CASE("store: a stalled store holds only the durability points; Status and heartbeats answer, no lease lapses") {
  Cluster k(Staging::kNone, Staging::kNone, 0, /*heartbeat_seconds=*/0.5);
  auto owned = NewGatedStore("stall");
  testing::GatedStore* gate = owned.get();
  REQUIRE(k.c->UseStateStore(std::move(owned)).ok());
  Heartbeats beats(k, {"s0", "s1", "t0", "t1"});
  REQUIRE(k.Update(1).ok());
  const int before = static_cast<int>(gate->saves().size());
  gate->Hold();
  absl::Status updated = absl::UnknownError("not run");
  std::thread driver([&] { updated = k.Update(2); });
  struct Join {
    std::thread& t;
    testing::GatedStore* g;
    ~Join() {
      g->Release();
      if (t.joinable()) t.join();
    }
  } join{driver, gate};
  REQUIRE(gate->AwaitEntered(before + 1));  // the begin's save is in the store, stalled
  // Twice the lease (3 heartbeats of 0.5 s): Status answers promptly every time. The bound is loose (a loaded
  // machine, sanitizer builds): what it catches is an answer that waits for the stalled store (3 s here);
  // bench_control measures the p99 (docs/operations.md, "Control plane at scale").
  const absl::Time until = absl::Now() + absl::Seconds(3);
  absl::Duration worst = absl::ZeroDuration();
  while (absl::Now() < until) {
    const absl::Time t0 = absl::Now();
    const v1::ClusterStatus st = k.c->Status();
    worst = std::max(worst, absl::Now() - t0);
    CHECK(st.state() == "beginning");
    std::this_thread::sleep_for(10ms);
  }
  CHECK(worst < absl::Milliseconds(500));
  CHECK(beats.longest() < absl::Milliseconds(500));
  CHECK(beats.all_known());
  gate->Release();
  driver.join();
  INFO(updated.ToString());
  REQUIRE(updated.ok());
  k.CheckAllServing("2");
}

// Each history record is handed to the store once, when it is added or changed: a save's cost does not grow with the
// history's length (the whole history was serialized at every save, about ten per update).
TEST_CASE("store: an update hands the store its own history record only, whatever the history's length") {
  Cluster k;
  auto owned = NewGatedStore("history");
  testing::GatedStore* gate = owned.get();
  REQUIRE(k.c->UseStateStore(std::move(owned)).ok());
  for (int v = 1; v <= 30; ++v) REQUIRE(k.Update(v).ok());
  int most = 0, total = 0;
  for (const auto& save : gate->saves()) {
    most = std::max(most, save.history);
    total += save.history;
  }
  CHECK(most <= 1);
  CHECK(total == 30);
  CHECK(k.c->History(v1::HistoryRequest()).records_size() == 30);
}

}  // namespace
}  // namespace wsync::daemon
