#include "daemon/coordinator/coordinator.h"

#include <xxhash.h>

#include <algorithm>
#include <cassert>
#include <set>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "base/cli.h"
#include "base/logging.h"
#include "base/status.h"
#include "daemon/common/config_digest.h"
#include "daemon/common/quantization.h"
#include "daemon/common/window_assignments.h"
#include "daemon/coordinator/fanout.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/util/message_differencer.h"
#include "planner/model_input.h"
#include "planner/plan.h"
#include "replica/model_config.h"
#include "spdlog/spdlog.h"

namespace wsync::daemon {
namespace {

// How a failed update's error says where the engines are (Fail): left paused, or resumed at their old version.
constexpr char kPausedNote[] = " until a successful update: ";
constexpr char kResumedNote[] = " (no byte of the update had reached them): ";
// The longest a durability point waits for the state store (an etcd leader election takes seconds).
constexpr absl::Duration kStoreWait = absl::Seconds(30);
// How long a failure at the sources' start waits for them to say whether they wrote anything before it is recorded
// (then the engines resume at once, or stay paused; a source that does not answer in time counts as written).
constexpr absl::Duration kCleanAnswerWithin = absl::Seconds(3);
// How long the engines an update paused have to answer their resume after a failure before the first write.
constexpr absl::Duration kResumeWithin = absl::Seconds(5);

// Runs fn(item) for every item as one phase on the bounded fan-out (fanout.h). OK when every call succeeded;
// otherwise the first error's code with every failure's message.
template <typename T, typename Fn>
absl::Status ForAll(const std::vector<T>& items, Fn fn, const FanoutOptions& opts = FanoutOptions()) {
  return CombineStatuses(RunFanout(
      items.size(), [&](size_t i) { return fn(items[i]); }, opts));
}

void AddPhase(v1::UpdateRecord* rec, const std::string& phase, absl::Time since) {
  auto* p = rec->add_phases();
  p->set_phase(phase);
  p->set_seconds(absl::ToDoubleSeconds(absl::Now() - since));
  p->set_start_seconds(absl::ToDoubleSeconds(since - absl::FromUnixMillis(rec->started_unix_ms())));
}

// How a restarted coordinator reports one engine of the update `v` it found interrupted (UseStateStore), from what
// the engine answered (`word`: EngineInfo, or why it did not answer) rather than from the store, which holds the
// engine as it was before the calls then in flight. `stored_label`: its label in the store; `committed`: the update
// passed its commit point.
struct RestoredEngine {
  EngineView view;
  std::string label;         // the engine's own (the stored one when it did not answer or reports none)
  std::string stale;         // not on v after a committed update: why ("" none)
  bool not_resumed = false;  // on v after a committed update, not serving
};
RestoredEngine RestoredEngineOf(const absl::StatusOr<v1::EngineInfo>& word, const std::string& stored_label,
                                const std::string& v, bool committed) {
  RestoredEngine r;
  r.label = word.ok() && !word->weight_version().empty() ? word->weight_version() : stored_label;
  const bool on_v = r.label == v;
  if (!word.ok()) {
    // Not known: never reported serving. On v past the commit point it is resumed by ResumeEngines like any engine
    // not resumed; otherwise held (stale and failed) until an update succeeds on it.
    r.view = EngineView{EngineState::kFailed, "engine_info"};
    r.not_resumed = committed && on_v;
    if (committed && !on_v) r.stale = absl::StrCat("not answering when the coordinator restarted during update ", v);
    return r;
  }
  if (!word->paused()) {
    // It serves what its label says: an update writes live weights only while its engines are paused (classic), or
    // switches them only while paused (staged), and labels them before it continues them.
    r.view = EngineView{EngineState::kServing, ""};
    if (committed && !on_v) r.stale = absl::StrCat("serving version ", r.label, ", not switched to ", v);
    return r;
  }
  r.view = EngineView{EngineState::kPaused, ""};
  r.not_resumed = committed && on_v;
  if (committed && !on_v) {
    // Paused under its old label past a staged update's switch or before it: whether it switched is not known.
    r.view = EngineView{EngineState::kFailed, "restart"};
    r.stale = absl::StrCat("paused under version ", r.label, " when the coordinator restarted during update ", v,
                           " (it may have switched): held until an update succeeds on it");
  }
  return r;
}

// A source's ConfigureSourceRequest whose targets reference the plan's shared rank tables instead of copies (a
// source's tables are megabytes at Kimi-K2 scale, and up to 64 workers build theirs at once). The tables name copy 0
// of an engine's segments; the copy an update writes travels with StartUpdate (segment_sets). The references are
// released before the request is destroyed: the plan owns those tables. Serializing one table from several workers at
// once is safe (const access; protobuf's cached sizes are atomic).
class SourceRequest {
 public:
  explicit SourceRequest(const v1::ConfigureSourceRequest& base) : req_(base) {}
  ~SourceRequest() {
    for (v1::TargetAssignment* t : shared_) t->unsafe_arena_release_layout();
  }
  SourceRequest(const SourceRequest&) = delete;
  SourceRequest& operator=(const SourceRequest&) = delete;

  // Adds `a` (no layout) with `layout` (may be null).
  void Add(const v1::TargetAssignment& a, const std::shared_ptr<const v1::RankLayout>& layout) {
    v1::TargetAssignment* t = req_.add_targets();
    *t = a;
    if (!layout) return;
    t->unsafe_arena_set_allocated_layout(const_cast<v1::RankLayout*>(layout.get()));
    shared_.push_back(t);
    held_.push_back(layout);  // alive as long as the request, whatever happens to the plan meanwhile
  }
  void set_plan_epoch(int64_t epoch) { req_.set_plan_epoch(epoch); }
  const v1::ConfigureSourceRequest& req() const { return req_; }

 private:
  v1::ConfigureSourceRequest req_;
  std::vector<v1::TargetAssignment*> shared_;  // targets whose layout is the plan's
  std::vector<std::shared_ptr<const v1::RankLayout>> held_;
};

// Whether one engine rank's staging hashes `have` (the answer to `wrote`'s ranges, in order) match what the sources
// wrote, and whether their writes cover all `bytes` of the rank's parameters. Pure.
absl::Status CompareStaged(int rank, uint64_t bytes, const std::vector<v1::WriteChecksum>& wrote,
                           const v1::ChecksumReply& have) {
  uint64_t covered = 0;
  for (const auto& w : wrote) covered += w.length();
  if (covered != bytes)
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", rank, ": the sources wrote ", covered, " of its ", bytes, " bytes"));
  if (have.params_size() != static_cast<int>(wrote.size()))
    return absl::InternalError(
        absl::StrCat("rank ", rank, ": ", have.params_size(), " hashes for ", wrote.size(), " ranges"));
  for (size_t i = 0; i < wrote.size(); ++i)
    if (have.params(static_cast<int>(i)).xxh128() != wrote[i].xxh128())
      return absl::DataLossError(absl::StrCat("rank ", rank, ": ", wrote[i].param(), " [", wrote[i].offset(), ", +",
                                              wrote[i].length(), ") staged ", have.params(static_cast<int>(i)).xxh128(),
                                              ", the source wrote ", wrote[i].xxh128()));
  return absl::OkStatus();
}

}  // namespace

Coordinator::Coordinator(CoordinatorOptions opts, std::unique_ptr<Peers> peers)
    : opts_(std::move(opts)), peers_(std::move(peers)) {
  metrics_.Declare("wsync_updates_total", "counter", "Updates ended, by result (ok, failed, aborted).");
  metrics_.Declare("wsync_update_seconds", "histogram", "Wall time of an update from BeginUpdate to its end.");
  metrics_.Declare("wsync_update_phase_seconds", "histogram",
                   "Wall time of each update phase (pause, configure, push, post_process, set_version, continue, "
                   "abort).");
  metrics_.Declare("wsync_update_bytes_total", "counter", "Bytes written into engine memory by ended updates.");
  metrics_.Declare("wsync_update_dense_bytes_total", "counter",
                   "Bytes dense writes of ended updates would have been (docs/delta.md).");
  metrics_.Declare("wsync_update_sent_bytes_total", "counter",
                   "Bytes ended updates actually wrote: dense ranges plus delta records.");
  metrics_.Declare("wsync_update_delta_ranks", "gauge", "Engine ranks that took deltas in the last ended update.");
  metrics_.Declare("wsync_update_dense_fallback_ranks", "gauge",
                   "Engine ranks that fell back to dense writes in the last ended update (the history says why).");
  metrics_.Declare("wsync_current_version", "gauge", "Last committed weight version (-1: none).");
  metrics_.Declare("wsync_update_in_progress", "gauge",
                   "1 while an update is beginning, open, committing or aborting.");
  metrics_.Declare("wsync_engines_hold_partial_writes", "gauge",
                   "1 when a failed or aborted update may have written into the paused engines.");
  metrics_.Declare("wsync_membership_epoch", "gauge", "Membership epoch (changes when a node registers).");
  metrics_.Declare("wsync_nodes", "gauge", "Registered nodes, by role.");
  metrics_.Declare("wsync_engines", "gauge", "Registered engines, by the coordinator's view of their state.");
  metrics_.Declare("wsync_engine_ready", "gauge",
                   "Per engine: 1 when it serves the current version, unpaused (a router keeps the others out).");
  metrics_.Declare("wsync_engine_stale", "gauge", "Per engine: 1 when left out of a staged update's switch.");
  metrics_.Declare("wsync_engine_weight_version", "gauge", "Per engine: the version label it serves (-1: none).");
  // From the published model only (cluster_model.h), never under mu_: a scrape answers while an update, a re-plan or
  // the store holds the coordinator, and reports the same states as Status and WatchEngines.
  metrics_.OnCollect([this](Metrics& m) {
    const std::shared_ptr<const ClusterModel> model = model_.Get();
    const v1::ClusterStatus& sum = model->summary;
    const std::string& current = sum.current_version();
    int64_t cv = -1;
    if (!current.empty() && !absl::SimpleAtoi(current, &cv)) cv = -1;
    m.Set("wsync_current_version", {}, static_cast<double>(cv));
    const absl::StatusOr<UpdateState> state = ParseUpdateState(sum.state());
    m.Set("wsync_update_in_progress", {}, state.ok() && daemon::UpdateInProgress(*state) ? 1 : 0);
    m.Set("wsync_engines_hold_partial_writes", {}, sum.engines_hold_partial_writes() ? 1 : 0);
    m.Set("wsync_membership_epoch", {}, static_cast<double>(sum.membership_epoch()));
    m.ClearFamily("wsync_nodes");
    m.ClearFamily("wsync_engines");
    m.ClearFamily("wsync_engine_ready");
    m.ClearFamily("wsync_engine_stale");
    m.ClearFamily("wsync_engine_weight_version");
    std::map<std::string, int> roles, states;
    static const ClusterModel::Engine kUnknown;
    if (model->layout != nullptr)
      for (const auto& n : model->layout->nodes()) {
        ++roles[n.role()];
        for (const auto& d : n.engine_details()) {
          auto it = model->engines.find(d.address());
          const ClusterModel::Engine& e = it == model->engines.end() ? kUnknown : it->second;
          const std::string st = e.state.empty()                       ? "registered"
                                 : absl::StartsWith(e.state, "failed") ? "failed"
                                                                       : e.state;
          ++states[st];
          // Ready as EngineStatesOf says it (routers read either).
          const bool ready = !e.stale && !e.drained && e.state == "serving" && e.weight_version == current;
          m.Set("wsync_engine_ready", {{"engine", d.engine_id()}}, ready ? 1 : 0);
          m.Set("wsync_engine_stale", {{"engine", d.engine_id()}}, e.stale ? 1 : 0);
          int64_t vn = -1;
          if (!e.weight_version.empty() && !absl::SimpleAtoi(e.weight_version, &vn)) vn = -1;
          m.Set("wsync_engine_weight_version", {{"engine", d.engine_id()}}, static_cast<double>(vn));
        }
      }
    for (const char* r : {"source", "target"}) m.Set("wsync_nodes", {{"role", r}}, roles[r]);
    for (const auto& [st, n] : states) m.Set("wsync_engines", {{"state", st}}, n);
  });
  MutexLock l(&mu_);
  Publish();  // readers answer from the first call on
}

absl::StatusOr<v1::RegisterNodeReply> Coordinator::RegisterNode(const v1::RegisterNodeRequest& req) {
  if (req.node_id().empty()) return absl::InvalidArgumentError("node_id is empty");
  // Bounds before anything is stored: names end up in every status, log line and plan.
  if (req.node_id().size() > 253 || req.address().size() > 300 || req.transport().size() > 64)
    return absl::InvalidArgumentError(absl::StrCat("node_id (", req.node_id().size(), " bytes), address (",
                                                   req.address().size(), ") or transport (", req.transport().size(),
                                                   ") is too long (limits 253, 300, 64)"));
  if (req.engines_size() > 1024 || req.trainer_ranks() > 1024 || req.trainer_ranks() < 0)
    return absl::InvalidArgumentError("too many engines (> 1024) or trainer ranks out of [0, 1024]");
  for (const auto& e : req.engines())
    if (e.engine_id().empty() || e.engine_id().size() > 253 || e.control_address().size() > 300 ||
        e.ranks_size() > 65536)
      return absl::InvalidArgumentError(absl::StrCat("engine '", e.engine_id().substr(0, 64),
                                                     "': empty or too long id/address, or more than 65536 ranks"));
  if (req.role() != "source" && req.role() != "target")
    return absl::InvalidArgumentError(absl::StrCat("role must be source or target, not '", req.role(), "'"));
  if (req.address().empty()) return absl::InvalidArgumentError("address is empty");
  if (req.pp_stage() < 0 || req.pp_stage() >= 1024)
    return absl::InvalidArgumentError(absl::StrCat("pp_stage ", req.pp_stage(), " is out of [0, 1024)"));
  MutexLock l(&mu_);
  if (UpdateInProgress())
    return absl::UnavailableError(absl::StrCat("update ", open_version_, " is in progress (", StateName(),
                                               "); register again when it has ended"));
  for (const auto& e : req.engines())
    for (const auto& [id, n] : nodes_)
      for (const auto& other : n.engines())
        if (id != req.node_id() && other.engine_id() == e.engine_id())
          return absl::AlreadyExistsError(absl::StrCat("engine ", e.engine_id(), " is already served by node ", id));
  // A (re)registering daemon is a new process, maybe at the address of the old one: dial it afresh.
  peers_->Forget(req.address());
  for (const auto& e : req.engines()) peers_->Forget(e.control_address());
  window_acks_.erase(req.address());  // a new process holds no write-window assignments
  // A new source process holds no configuration; sources writing to a new target process must connect again.
  configured_.erase(req.node_id());
  for (const auto& p : plan_)
    if (p.assignment->target_node() == req.node_id()) configured_.erase(p.source);
  if (auto old = nodes_.find(req.node_id()); old != nodes_.end())
    for (const auto& e : old->second.engines()) engine_digests_.erase(e.engine_id());
  for (const auto& e : req.engines()) engine_digests_.erase(e.engine_id());
  nodes_[req.node_id()] = req;
  StampLease(req.node_id(), req.address(), absl::Now());
  for (const auto& e : req.engines()) engine_state_[e.control_address()] = EngineView();
  ++membership_epoch_;
  Persist();
  spdlog::info("node {} registered as {} at {} ({} engines); membership epoch {}", req.node_id(), req.role(),
               req.address(), req.engines_size(), membership_epoch_);
  v1::RegisterNodeReply out;
  out.set_membership_epoch(membership_epoch_);
  return out;
}

absl::StatusOr<PlanSources> Coordinator::SourcesForPlan() const {
  std::set<std::string> excluded = drained_nodes_;
  excluded.insert(lapsed_nodes_.begin(), lapsed_nodes_.end());
  return PlanSourceNodes(nodes_, excluded, PlanningOptions());
}

ReplanOptions Coordinator::PlanningOptions() const {
  ReplanOptions o;
  o.strategy = opts_.strategy;
  o.trainer_parallelism = opts_.trainer_parallelism;
  o.min_source_bytes = opts_.min_source_bytes;
  o.nic = opts_.nic;
  o.snap_bytes = opts_.snap_bytes;
  return o;
}

ReplanInput Coordinator::PlanningInput() const {
  ReplanInput in;
  in.nodes = &nodes_;
  in.drained_engines = &drained_engines_;
  in.drained_nodes = &plan_excluded_;
  in.membership_epoch = membership_epoch_;
  in.model_config_json = model_config_json_;
  in.options = PlanningOptions();
  in.previous = &groups_;
  in.engine_digests = &engine_digests_;
  return in;
}

void Coordinator::RefreshEngineDigests() {
  for (const auto& [id, n] : nodes_)
    for (const auto& e : n.engines())
      if (!engine_digests_.count(e.engine_id())) engine_digests_[e.engine_id()] = EngineInputDigest(id, n.address(), e);
}

absl::Status Coordinator::Replan(bool dry_run) {
  WSYNC_ASSIGN_OR_RETURN(Replanned r, PlanMembership(PrepareReplan()));
  if (dry_run) return absl::OkStatus();
  ApplyPlanLogged(std::move(r));
  return absl::OkStatus();
}

ReplanInput Coordinator::PrepareReplan() {
  RefreshEngineDigests();
  plan_excluded_ = drained_nodes_;
  plan_excluded_.insert(lapsed_nodes_.begin(), lapsed_nodes_.end());
  return PlanningInput();
}

void Coordinator::ApplyPlanLogged(Replanned r) {
  spdlog::info(
      "plan ({}): {} source nodes ({} stages x {} ranks per node), {} engine groups ({} re-planned: {}), "
      "{} (source, engine rank) assignments, quantization {}",
      opts_.strategy, r.sources, r.pp, r.ranks_per_node, r.groups.size(), r.replanned.size(),
      absl::StrJoin(r.replanned, ", "), r.plan.size(), QuantizationName(r.quantization));
  ApplyPlan(std::move(r));
}

void Coordinator::ApplyPlan(Replanned r) {
  ++plan_generation_;
  model_quantization_ = std::move(r.quantization);
  // --relay auto decides with the nodes' NICs (--nic, checked at start-up; its default if unparsable here).
  relay_wiring_ = std::make_shared<const RelayWiring>(
      WireRelays(planner::ParseRelayMode(opts_.relay).value_or(planner::RelayOptions{}), r.groups, &r.plan,
                 planner::ParseNicSpec(opts_.nic).value_or(planner::NicSpec{1, 400.0})));
  plan_ = std::move(r.plan);
  push_filters_ = std::move(r.push_filters);
  groups_ = std::move(r.groups);
  NoteChange();  // the plan is in Status
}

std::string Coordinator::EngineLabel(const std::string& addr) const {
  MutexLock l(&mu_);
  for (const auto& [id, n] : nodes_)
    for (const auto& e : n.engines())
      if (e.control_address() == addr)
        return absl::StrCat("engine ", e.engine_id(), " (", e.ranks_size(), " ranks, node ", id, ", ", addr, ")");
  return addr;
}

std::string Coordinator::NodeLabel(const std::string& addr) const {
  MutexLock l(&mu_);
  for (const auto& [id, n] : nodes_)
    if (n.address() == addr) return absl::StrCat(id, " (", addr, ")");
  return addr;
}

std::vector<std::string> Coordinator::EngineAddresses() const {
  std::vector<std::string> out;
  for (const auto& [id, n] : nodes_)
    for (const auto& e : n.engines())
      if (!EngineDrained(id, e.engine_id())) out.push_back(e.control_address());
  return out;
}

absl::Status Coordinator::Track(const std::string& addr, std::optional<EngineState> on_success,
                                const std::string& phase, absl::Status st) {
  MutexLock l(&mu_);
  if (open_version_ >= 0) run_.engine_call_ends.push_back({addr, phase, absl::Now(), st.ok()});  // the timeline
  if (!st.ok()) {
    engine_state_[addr] = EngineView{EngineState::kFailed, phase};
  } else if (on_success) {
    engine_state_[addr] = EngineView{*on_success, ""};
  }
  NoteChange();
  return st;
}

void Coordinator::NoteChange() {
  Publish();
  MutexLock l(&change_mu_);
  ++change_generation_;
  change_cv_.SignalAll();
}

uint64_t Coordinator::ChangeGeneration() {
  MutexLock l(&change_mu_);
  return change_generation_;
}

uint64_t Coordinator::WaitForChange(uint64_t seen, absl::Duration max_wait) {
  MutexLock l(&change_mu_);
  const absl::Time deadline = absl::Now() + max_wait;
  while (change_generation_ == seen)
    if (change_cv_.WaitWithDeadline(&change_mu_, deadline)) break;  // true: the deadline passed
  return change_generation_;
}

void Coordinator::SetState(UpdateState to) {
  if (!LegalUpdateTransition(state_, to)) {
    // A bug in this file: the bookkeeping follows what happened, and the log says where it went wrong.
    spdlog::critical("update {}: illegal state transition {} -> {}", open_version_, StateName(),
                     std::string(UpdateStateName(to)));
    assert(false);
  }
  state_ = to;
}

void Coordinator::SaveEngineStates() {
  MutexLock l(&mu_);
  Persist();
}

FanoutOptions Coordinator::UpdatePhase(UpdateMode mode, Phase phase, std::vector<std::string> addrs,
                                       double deadline_s) const {
  // Width, deadline and whether an abort cuts the calls short: the row's (phase_table.h).
  const PhaseRow row = RowFor(mode, phase);
  FanoutOptions o;
  o.max_parallel = row.fanout == kFanoutDefault ? opts_.fanout_parallel : std::max<size_t>(row.fanout, 1);
  if (row.fanout == kAllAtOnce) o.max_parallel = std::max<size_t>(addrs.size(), 1);
  o.deadline = row.deadline_s > 0   ? absl::Seconds(row.deadline_s)
               : deadline_s > 0     ? absl::Seconds(deadline_s)
                                    : absl::InfiniteDuration();
  o.phase = std::string(PhaseName(phase));
  if (row.abortable) {
    MutexLock l(&mu_);
    o.cancellation = run_.cancel;
  }
  o.cancel_running = [this, addrs = std::move(addrs)](size_t i) { peers_->CancelCalls(addrs[i]); };
  return o;
}

const Coordinator::Outcome* Coordinator::FindOutcome(int64_t v) const {
  auto it = outcomes_.find(v);
  return it == outcomes_.end() ? nullptr : &it->second;
}

template <typename Call>
auto Coordinator::Remote(const std::string& addr, Call call) -> decltype(call()) {
  {
    MutexLock l(&mu_);
    if (!run_.Enter(addr))
      return absl::CancelledError(
          absl::StrCat("not called: update ", open_version_, " is being aborted by the operator"));
  }
  struct Done {
    Coordinator* c;
    const std::string& addr;
    ~Done() {
      MutexLock l(&c->mu_);
      c->run_.Leave(addr);
    }
  } done{this, addr};
  return call();
}

bool Coordinator::AbortAsked() const {
  MutexLock l(&mu_);
  return run_.abort_asked;
}

bool Coordinator::AbortSources(int64_t v, const std::string& why, uint64_t* bytes, absl::Duration within) {
  std::vector<std::string> sources;
  {
    MutexLock l(&mu_);
    for (const auto& [id, n] : nodes_)
      if (n.role() == "source" && InRun(id)) sources.push_back(n.address());
  }
  v1::AbortSourceUpdateRequest req;
  req.set_version(v);
  req.set_reason(why);
  std::mutex agg_mu;
  bool clean = true;
  FanoutOptions o;
  o.max_parallel = opts_.fanout_parallel;
  o.deadline = within;
  o.phase = "abort sources";
  o.cancel_running = [this, &sources](size_t i) { peers_->CancelCalls(sources[i]); };
  const absl::Status all = ForAll(
      sources,
      [&](const std::string& a) {
        auto r = peers_->AbortSourceUpdate(a, req);
        std::lock_guard<std::mutex> l(agg_mu);
        if (!r.ok()) {
          clean = false;  // unknown: that source may have written
          spdlog::warn("telling source {} to abort update {}: {}", a, v, r.status().ToString());
          return absl::OkStatus();
        }
        *bytes += r->bytes_written();
        if (r->bytes_written() > 0 || !r->quiescent()) clean = false;
        return absl::OkStatus();
      },
      o);                        // best effort: a source that missed it abandons the update at the next StartUpdate
  if (!all.ok()) clean = false;  // a source not asked in time: unknown
  return clean;
}

void Coordinator::Finish(int64_t v, const Outcome& o, v1::UpdateRecord rec) {
  // A commit past its commit point ended committed even when some engine was not resumed (rec.success, o.status
  // Unavailable): the update is over and the fleet is on v.
  const bool committed = o.status.ok() || rec.success();
  SetState(committed ? UpdateState::kIdle : UpdateState::kFailed);
  run_.Ended();
  open_version_ = -1;
  SetLogUpdateVersion(-1);
  // BeginUpdate admits only versions newer than every one begun, so this never moves backwards; the check keeps it so.
  if (committed && v > current_version_) current_version_ = v;
  if (committed) since_dense_ = rec.delta_mode() == "off" || rec.delta_mode() == "anchor" ? 0 : since_dense_ + 1;
  outcomes_[v] = o;
  while (outcomes_.size() > std::max<size_t>(opts_.history_limit, 1)) outcomes_.erase(outcomes_.begin());
  const char* result = rec.aborted()                ? "aborted"
                       : !committed                 ? "failed"
                       : rec.not_resumed_size() > 0 ? "not_resumed"
                                                    : "ok";
  metrics_.Add("wsync_updates_total", {{"result", result}}, 1);
  metrics_.Observe("wsync_update_seconds", {}, rec.total_seconds());
  for (const auto& p : rec.phases())
    metrics_.Observe("wsync_update_phase_seconds", {{"phase", p.phase()}}, p.seconds());
  metrics_.Add("wsync_update_bytes_total", {}, static_cast<double>(rec.bytes()));
  metrics_.Add("wsync_update_dense_bytes_total", {}, static_cast<double>(rec.dense_bytes()));
  metrics_.Add("wsync_update_sent_bytes_total", {}, static_cast<double>(rec.sent_bytes()));
  metrics_.Set("wsync_update_delta_ranks", {}, static_cast<double>(rec.delta_ranks_size()));
  metrics_.Set("wsync_update_dense_fallback_ranks", {}, static_cast<double>(rec.fallbacks_size()));
  std::map<std::string, std::string> engine_ids;  // control address -> engine id, for the timeline
  for (const auto& [id, n] : nodes_)
    for (const auto& e : n.engines()) engine_ids[e.control_address()] = e.engine_id();
  AddEnginePhases(&rec, run_.engine_call_ends, engine_ids);
  run_.engine_call_ends.clear();
  history_dirty_.insert(rec.version());
  model_history_dirty_.insert(rec.version());
  history_.push_back(std::move(rec));
  while (history_.size() > opts_.history_limit) history_.pop_front();
  Persist();
  ended_cv_.SignalAll();
}

absl::Status Coordinator::Fail(v1::UpdateRecord rec, const absl::Status& why_in, bool may_have_written, bool stopping,
                               bool resumed) {
  const int64_t v = rec.version();
  MutexLock l(&mu_);
  absl::Status why = why_in;
  const bool asked = run_.abort_asked && !rec.aborted();
  if (asked) {
    rec.set_aborted(true);
    rec.set_aborted_by(run_.abort_by);
    why = absl::AbortedError(absl::StrCat(
        "aborted by ", run_.abort_by, run_.abort_reason.empty() ? std::string() : absl::StrCat(": ", run_.abort_reason),
        " while ", StateName(), why_in.ok() ? std::string() : absl::StrCat(" (", why_in.ToString(), ")")));
  }
  // The caller decided from the phase table (phase_table.h) whether live weights may be partly written: a staged
  // update writes staging memory only, until its switch.
  const bool live_written = may_have_written;
  if (live_written) engines_dirty_ = true;
  const char* engines_now = resumed                                  ? "were resumed"
                            : live_written || rec.mode() != "staged" ? "stay paused"
                                                                     : "serve on";
  // Aborted: this update is over whatever is retried; a new update (a newer version) is the way forward.
  absl::Status err = absl::AbortedError(
      absl::StrCat("update ", v, " failed; engines ", engines_now,
                   current_version_ >= 0 ? absl::StrCat(" at version ", current_version_) : std::string(),
                   resumed ? kResumedNote : kPausedNote, why.ToString()));
  rec.set_success(false);
  rec.set_error(err.ToString());
  rec.set_total_seconds(absl::ToDoubleSeconds(absl::Now() - absl::FromUnixMillis(rec.started_unix_ms())));
  Finish(v, Outcome{err, v1::CommitUpdateReply()}, std::move(rec));
  if (asked) {
    // The answer of the AbortUpdate calls waiting for this update to end, and of their repeats.
    v1::AbortUpdateReply out;
    if (!history_.empty()) *out.mutable_record() = history_.back();
    out.set_bytes_written(out.record().bytes());
    out.set_engines_resumable(!engines_dirty_);
    aborted_[v] = out;
    while (aborted_.size() > std::max<size_t>(opts_.history_limit, 1)) aborted_.erase(aborted_.begin());
  }
  if (stopping) {
    SetState(
        UpdateState::kAborting);  // ended and recorded; FailAndStopSources leaves it once sources and targets were told
    open_version_ = v;
    NoteChange();
  }
  spdlog::error("{}", err.ToString());
  return err;
}

absl::Status Coordinator::EndRunAt(const UpdateDriver::Failure& f, const v1::UpdateRecord& rec,
                                   const RunContext& ctx) {
  if (ctx.sources_live) return FailAndStopSources(rec, f.why, f.phase, f.policy, ctx.engines, ctx.window_skip);
  if (ctx.windows_open) SetWindows(false, rec.version(), ctx.window_skip).IgnoreError();
  return FailAt(rec, f.why, f.policy, ctx.engines);
}

void Coordinator::CloseWindows(int64_t v, RunContext* ctx) {
  SetWindows(false, v, ctx->window_skip).IgnoreError();
  ctx->windows_open = false;
}

bool Coordinator::StopAsked() const {
  MutexLock l(&mu_);
  // Past the commit point the update commits; past a staged update's verify an abort acts per engine (its calls are
  // refused: that engine is left out), never on the run.
  return run_.abort_asked && !run_.commit_point && !switch_started_;
}

absl::Status Coordinator::FailAt(v1::UpdateRecord rec, const absl::Status& why, OnFailure policy,
                                 const std::vector<std::string>& engines) {
  switch (policy) {
    case OnFailure::kResumeOld: {
      bool dirty;
      {
        MutexLock l(&mu_);
        dirty = engines_dirty_;
      }
      // Engines an earlier failed update left holding partial writes stay paused: they serve nothing true.
      if (dirty) return Fail(std::move(rec), why, false);
      ResumeOld(rec.version(), engines);
      return Fail(std::move(rec), why, false, false, /*resumed=*/true);
    }
    case OnFailure::kServeOn:
    case OnFailure::kLeaveOutStale:
      return Fail(std::move(rec), why, false);
    case OnFailure::kResumeIfClean:  // only where sources were started (FailAndStopSources); here: the safe answer
    case OnFailure::kKeepPaused:
    case OnFailure::kHoldPaused:
    case OnFailure::kCommittedNotResumed:
    case OnFailure::kRouteAround:  // what is left when a relay could not be routed around (phase_table.h)
      break;
  }
  return Fail(std::move(rec), why, true);
}

bool Coordinator::ResumeOld(int64_t v, const std::vector<std::string>& all) {
  // Only the engines the update paused (their Pause answered): one whose Pause failed was not paused by it or does not
  // answer (its record says failed: pause; `wsyncctl resume` may continue it), and a call to it would hold the
  // failure's answer for the call's deadline.
  std::vector<std::string> engines;
  {
    MutexLock l(&mu_);
    for (const auto& a : all)
      if (auto it = engine_state_.find(a); it != engine_state_.end() && it->second.state == EngineState::kPaused)
        engines.push_back(a);
  }
  FanoutOptions o;
  o.max_parallel = opts_.fanout_parallel;
  o.deadline = kResumeWithin;  // an engine that stopped answering since its pause: cut short, recorded failed
  o.phase = "resume";
  o.cancel_running = [this, &engines](size_t i) { peers_->CancelCalls(engines[i]); };
  std::mutex failed_mu;
  std::vector<std::string> failed;
  // Called directly, not through Remote: an operator's abort must not keep the engines paused.
  RunFanout(
      engines.size(),
      [&](size_t i) {
        const std::string& a = engines[i];
        absl::Status r =
            Track(a, EngineState::kServing, "resume", Annotate(peers_->Continue(a), "resume " + EngineLabel(a)));
        if (!r.ok()) {
          std::lock_guard<std::mutex> l(failed_mu);
          failed.push_back(a);
        }
        return r;
      },
      o);
  std::sort(failed.begin(), failed.end());
  {
    MutexLock l(&mu_);
    // Engines a committed update left paused at the current version were continued too.
    MarkResumed(engines, failed, absl::UnavailableError("their resume failed"));
  }
  SaveEngineStates();
  if (failed.empty())
    spdlog::warn("update {}: nothing of it reached the engines: {} engines resumed at their version", v,
                 engines.size());
  else
    spdlog::error("update {}: nothing of it reached the engines; {} of {} engines could not be resumed ({})", v,
                  failed.size(), engines.size(), absl::StrJoin(failed, ", "));
  return failed.empty();
}

absl::Status Coordinator::FailAndStopSources(v1::UpdateRecord rec, const absl::Status& why, Phase phase,
                                             OnFailure policy, const std::vector<std::string>& engines,
                                             const std::set<std::string>& skip) {
  const int64_t v = rec.version();
  const bool live = policy == OnFailure::kResumeIfClean || policy == OnFailure::kKeepPaused ||
                    policy == OnFailure::kHoldPaused || policy == OnFailure::kRouteAround;
  bool dirty_before, asked;
  {
    MutexLock l(&mu_);
    dirty_before = engines_dirty_;
    asked = run_.abort_asked;
  }
  const std::string reason = asked ? absl::StrCat("aborted by the operator at ", PhaseName(phase))
                                   : absl::StrCat("update failed at ", PhaseName(phase), ": ", why.message());
  uint64_t bytes = 0;
  absl::Status err;
  if (policy == OnFailure::kResumeIfClean && !dirty_before) {
    // Whether the engines resume depends on what the sources answer: asked first, for a short time, so that the
    // recorded outcome (and an operator's abort, waiting for it) is true from the start.
    const bool clean = AbortSources(v, reason, &bytes, kCleanAnswerWithin);
    if (clean) ResumeOld(v, engines);
    err = Fail(std::move(rec), why, /*may_have_written=*/!clean, /*stopping=*/true, /*resumed=*/clean);
    if (!clean) AbortSources(v, reason, &bytes);  // the ones that did not answer in time are told, unbounded
  } else {
    err = Fail(std::move(rec), why, /*may_have_written=*/live, /*stopping=*/true);
    AbortSources(v, reason, &bytes);
  }
  SetWindows(false, v, skip).IgnoreError();
  MutexLock l(&mu_);
  SetState(UpdateState::kFailed);
  open_version_ = -1;
  Persist();
  ended_cv_.SignalAll();
  if (bytes > 0) spdlog::warn("update {}: {} bytes of it had reached the engines when it was aborted", v, bytes);
  return err;
}

absl::StatusOr<v1::BeginUpdateReply> Coordinator::BeginUpdate(const v1::BeginUpdateRequest& req) {
  // The outcome is in the store before the caller hears it (the store writer, store_writer.h).
  auto out = RunBeginUpdate(req);
  Durable().IgnoreError();
  return out;
}

absl::StatusOr<v1::BeginUpdateReply> Coordinator::RunBeginUpdate(const v1::BeginUpdateRequest& req) {
  const absl::Time start = absl::Now();
  const int64_t v = req.version();
  if (v < 0) return absl::InvalidArgumentError(absl::StrCat("version ", v, " is negative"));
  if (!req.mode().empty() && req.mode() != "classic" && req.mode() != "staged")
    return absl::InvalidArgumentError(absl::StrCat("mode '", req.mode(), "' is not classic or staged"));
  const bool staged = req.mode() == "staged";
  const UpdateMode mode = staged ? UpdateMode::kStaged : UpdateMode::kClassic;
  std::string delta = req.delta().empty() ? "auto" : req.delta();
  if (delta != "auto" && delta != "off" && delta != "always")
    return absl::InvalidArgumentError(absl::StrCat("delta mode '", req.delta(), "' is not auto, off or always"));
  const std::string pause_mode = req.pause_mode().empty() ? "retract" : req.pause_mode();
  if (pause_mode != "retract" && pause_mode != "in_place" && pause_mode != "abort")
    return absl::InvalidArgumentError(
        absl::StrCat("pause mode '", req.pause_mode(), "' is not retract, in_place or abort; nothing was paused"));
  v1::UpdateRecord rec;
  rec.set_version(v);
  rec.set_pause_mode(pause_mode);
  rec.set_delta_mode(delta);
  rec.set_started_unix_ms(absl::ToUnixMillis(start));
  rec.set_mode(staged ? "staged" : "classic");
  std::vector<std::string> engines;
  std::vector<std::string> staging_engines;  // engines offering staging memory: their live copy is asked below
  std::map<std::string, int> live_sets;
  bool need_plan, need_configure;
  absl::Status saved;
  uint64_t begin_ticket = 0;
  UpdateState prev_state;
  int64_t prev_last_begun;
  UpdateRun prev_run;
  {
    MutexLock l(&mu_);
    // A retried BeginUpdate(v) while the first one is still running waits for it and shares its result.
    while (state_ == UpdateState::kBeginning && open_version_ == v) ended_cv_.Wait(&mu_);
    if (open_version_ == v && (state_ == UpdateState::kUpdating || state_ == UpdateState::kCommitting))
      return run_.begin_reply;
    if (const Outcome* o = FindOutcome(v)) {
      if (!o->status.ok()) return o->status;
      return absl::FailedPreconditionError(absl::StrCat("update ", v, " has already been committed"));
    }
    if (UpdateInProgress())
      return absl::FailedPreconditionError(
          absl::StrCat("cannot begin update ", v, ": update ", open_version_, " is still open (", StateName(), ")"));
    if (v <= last_begun_)
      return absl::FailedPreconditionError(
          absl::StrCat("version ", v, " is not newer than the last update begun (", last_begun_, "; current version ",
                       current_version_ >= 0 ? std::to_string(current_version_) : std::string("none"), ")"));
    // A node whose lease lapsed (registered, then silent) is left out of this update: not planned, paused, started
    // or written; it comes back with its next heartbeat (a membership change: the next update re-plans).
    if (std::set<std::string> lapsed = LapsedNodes(absl::Now()); lapsed != lapsed_nodes_) {
      for (const auto& id : lapsed)
        if (!lapsed_nodes_.count(id))
          spdlog::warn("update {}: node {} lost its lease (no heartbeat for {:.1f} s): left out of the update", v, id,
                       absl::ToDoubleSeconds(absl::Now() - LastHeartbeat(id)));
      lapsed_nodes_ = std::move(lapsed);
      ++membership_epoch_;
    }
    engines = EngineAddresses();
    if (engines.empty())
      return absl::FailedPreconditionError(drained_engines_.empty() && drained_nodes_.empty()
                                               ? "no engine has registered"
                                               : "no engine to update: every registered engine is drained");
    if (delta == "auto" && opts_.delta_anchor_every > 0 && since_dense_ + 1 >= opts_.delta_anchor_every) {
      delta = "off";
      rec.set_delta_mode("anchor");
    }
    // A relay forwards into the ranges its children's assignments name, which are copy 0's: a staged update would
    // have it write the live copy of a serving engine. Refused before anything is paused or written.
    if (staged && opts_.relay != "off")
      return absl::InvalidArgumentError(absl::StrCat(
          "mode staged cannot run with relay trees (wsync-coordinator --relay ", opts_.relay,
          "): relays forward classic dense updates only (docs/planner.md, \"The relay data path\")"));
    WSYNC_ASSIGN_OR_RETURN(staging_engines, StagingEngines(engines, staged));
    // A second copy holds an older version than the sources' delta base; an engine staging in place (vLLM) holds
    // what was last written into it, which is what the target's per-rank base records say.
    if (staged && !staging_engines.empty() && delta != "off") {
      if (delta == "always")
        return absl::InvalidArgumentError(
            "delta=always cannot run with mode staged: a staging copy holds an older version than the sources' delta "
            "base (docs/delta.md, \"Fallback to dense\")");
      delta = "off";
      rec.set_delta_mode(delta);
    }
    if (opts_.relay != "off" && delta != "off") rec.set_delta_mode(delta = "off");  // relays forward dense bytes only
    prev_state = state_;
    prev_last_begun = last_begun_;
    prev_run = std::move(run_);
    SetState(UpdateState::kBeginning);
    run_ = UpdateRun(v);  // one run per version: a fresh record, cancellation and count of calls in flight
    SetLogUpdateVersion(v);
    open_version_ = v;
    last_begun_ = v;
    run_.record = rec;
    saved = SaveState();
    begin_ticket = save_ticket_;
  }
  // The begin must be durable before any engine is paused; waited for without the lock (Status, heartbeats and an
  // abort answer meanwhile; nothing else can begin: the state is beginning).
  if (saved.ok()) saved = Durable(begin_ticket);
  {
    MutexLock l(&mu_);
    if (!saved.ok()) {
      // Nothing was asked of an engine yet: fail now rather than run an update a successor would not know of.
      SetState(prev_state);
      open_version_ = -1;
      last_begun_ = prev_last_begun;
      run_ = std::move(prev_run);
      run_.Ended();
      SetLogUpdateVersion(-1);
      Persist();
      ended_cv_.SignalAll();
      return absl::UnavailableError(absl::StrCat("update ", v, " not begun: the state store could not record it (",
                                                 saved.message(), "); nothing was paused"));
    }
    need_plan = plan_epoch_ != membership_epoch_;
    // A source without a recorded configuration (a configure failed, or its heartbeat reported that it does not
    // hold the planned one) is configured again even when the plan is unchanged.
    need_configure = need_plan;
    for (const auto& [id, n] : nodes_) need_configure |= n.role() == "source" && InRun(id) && !configured_.count(id);
    // Which copy an update writes changes at every switch; it travels with StartUpdate, not in the configuration.
  }
  v1::BeginUpdateReply out;
  out.set_version(v);

  // The rows of the begin half (pause … start), walked in the mode's table order by the driver (update_run.h); each
  // step below is one row's calls, writing what it learned into these locals (the run's context).
  RunContext ctx;
  ctx.engines = engines;
  UpdateDriver driver(
      mode, [this] { return StopAsked(); },
      [&](const UpdateDriver::Failure& f) { return EndRunAt(f, rec, ctx); });
  // A source to configure: its request without its assignments (model, push filters, quantization), its
  // assignments and their rank tables as the plan holds them (shared). The whole request is built only by the worker
  // sending it, with the tables it shares with the plan referenced, not copied: a source's tables are megabytes at
  // Kimi-K2 scale, and at 1024 engine ranks every source's request at once did not fit in memory; 64 workers' copies of
  // theirs were the coordinator's peak.
  struct Configure {
    std::string node_id, address;
    v1::ConfigureSourceRequest base;                                    // no targets
    std::vector<std::shared_ptr<const v1::TargetAssignment>> assigned;  // in plan order; no layouts
    std::vector<std::shared_ptr<const v1::RankLayout>> layouts;         // per assignment
    std::string key;                                                    // SourceConfigKey
  };
  std::map<std::string, int64_t> source_epochs;  // address → the plan epoch it holds after this phase
  int64_t plan_epoch = -1;
  std::string engine_model_json;
  // Staged: engines serve on; they pause only for the switch (CommitStaged). The staged table has no pause row.
  if (!staged)
    driver.Bind(Phase::kPause, [&](OnFailure) {
      const absl::Time t = absl::Now();
      std::vector<char> asked(engines.size(), 0);  // each worker sets its own
      std::vector<absl::Status> paused = RunFanout(
          engines.size(),
          [&](size_t i) {
            const std::string& a = engines[i];
            asked[i] = 1;
            return Track(a, EngineState::kPaused, "pause",
                         Annotate(Remote(a, [&] { return peers_->Pause(a, pause_mode); }), "pause " + EngineLabel(a)));
          },
          UpdatePhase(mode, Phase::kPause, engines));
      // An engine the phase never asked (an abort or the phase's deadline came first) is recorded as its pause having
      // failed, with why, as one whose pause was cancelled is: the record then says which engines the update left
      // unpaused, whichever way it ended.
      for (size_t i = 0; i < engines.size(); ++i)
        if (!asked[i]) Track(engines[i], EngineState::kPaused, "pause", paused[i]).IgnoreError();
      SaveEngineStates();
      AddPhase(&rec, "pause", t);
      out.set_pause_seconds(rec.phases(0).seconds());
      return CombineStatuses(paused);
    });
  // (Staged: nothing was paused; the abort is met after this row, which serves on as well.)
  driver.Bind(Phase::kEngineInfo, [&](OnFailure) {
    absl::Status st;
    if (need_plan) {
      // The engines are the authority on the model they serve. Asked without the lock: no remote call under mu_.
      const std::string& a = engines.front();
      auto info = Remote(a, [&] { return peers_->EngineInfo(a); });
      if (!info.ok())
        st = Annotate(info.status(), "engine info from " + EngineLabel(a));
      else
        engine_model_json = info->model_config_json();
    }
    if (st.ok()) st = LiveSets(staging_engines, &live_sets);
    return st;
  });
  driver.Bind(Phase::kConfigure, [&](OnFailure) {
    absl::Status st;
    std::vector<Configure> configure;
    if (need_plan) {
      // Planned without the lock (seconds at 1024 engine ranks): Status, heartbeats and an abort answer meanwhile.
      // The input points into members that nothing changes while an update is beginning (registrations, removals and
      // drains are refused while an update is in progress; heartbeats and Status only read them); the plan in force
      // is replaced under the lock.
      ReplanInput input;
      {
        MutexLock l(&mu_);
        model_config_json_ = engine_model_json;
        input = PrepareReplan();
      }
      absl::StatusOr<Replanned> planned = PlanMembership(input);
      MutexLock l(&mu_);
      if (planned.ok())
        ApplyPlanLogged(*std::move(planned));
      else
        st = planned.status();
    }
    {
      MutexLock l(&mu_);
      plan_epoch = need_plan ? membership_epoch_ : plan_epoch_;
      if (st.ok() && need_configure) {
        RefreshEngineDigests();
        std::map<std::string, std::vector<const Planned*>> planned_of;  // source → its assignments, in plan order
        for (const Planned& p : plan_) planned_of[p.source].push_back(&p);
        // Every source's request without its assignments (an empty plan): those are added by the worker.
        std::map<std::string, v1::ConfigureSourceRequest> by_source =
            SourceConfigurations(nodes_, model_config_json_, {}, push_filters_, model_quantization_,
                                 [](const Planned& p) { return *p.assignment; });
        // Only sources whose configuration changed, or that do not hold it (their heartbeats said so), are
        // configured again (a join or leave re-plans one group; the sources serving only other groups keep their
        // replica, connections and plan epoch).
        for (auto& [id, r] : by_source) {
          if (!InRun(id)) continue;  // its lease lapsed: left out of this update
          Configure cf{id, nodes_[id].address(), std::move(r), {}, {}, ""};
          const std::vector<const Planned*>& mine = planned_of[id];
          for (const Planned* p : mine) {
            cf.assigned.push_back(p->assignment);
            cf.layouts.push_back(p->layout);
          }
          cf.key = SourceConfigKey(cf.base, mine);
          auto c = configured_.find(id);
          if (c != configured_.end() && c->second.key == cf.key) continue;
          configure.push_back(std::move(cf));
        }
      }
    }
    if (!st.ok() || !need_configure) return st;
    const absl::Time t = absl::Now();
    std::vector<std::string> configure_addrs;
    std::vector<size_t> items;
    for (const Configure& c : configure) {
      configure_addrs.push_back(c.address);
      items.push_back(items.size());
    }
    std::vector<std::string> digests(configure.size());  // by item; each worker writes its own
    st = ForAll(
        items,
        [&](size_t i) {
          const Configure& c = configure[i];
          SourceRequest full(c.base);
          for (size_t k = 0; k < c.assigned.size(); ++k) full.Add(*c.assigned[k], c.layouts[k]);
          digests[i] = ConfigureSourceDigest(full.req());  // before the epoch is set, which it leaves out anyway
          full.set_plan_epoch(plan_epoch);
          auto r = Remote(c.address, [&] { return peers_->ConfigureSource(c.address, full.req()); });
          return Annotate(r.status(), "configure source " + NodeLabel(c.address));
        },
        UpdatePhase(mode, Phase::kConfigure, std::move(configure_addrs)));
    AddPhase(&rec, "configure", t);
    out.set_configure_seconds(rec.phases(rec.phases_size() - 1).seconds());
    size_t configured_sources = 0;
    {
      MutexLock l(&mu_);
      for (size_t i = 0; i < configure.size(); ++i) {
        const Configure& c = configure[i];
        if (!st.ok()) {
          configured_.erase(c.node_id);  // unknown what it holds now: configured again next time
          continue;
        }
        SourceConfig& sc = configured_[c.node_id];
        sc.key = c.key;
        sc.epoch = plan_epoch;
        sc.digest = digests[i];
        sc.targets.clear();
        for (const auto& tg : c.assigned) sc.targets.emplace_back(tg->engine_id(), tg->rank());
      }
      if (st.ok()) plan_epoch_ = plan_epoch;
      configured_sources = configured_.size();
      NoteChange();
    }
    // The failure is applied by the driver, without mu_ (Fail takes it: called with it held, the coordinator
    // deadlocked on every failed configure).
    if (st.ok())
      spdlog::info("update {}: plan {} configured on {} of {} source nodes (the others' configuration is unchanged)",
                   v, plan_epoch, configure.size(), configured_sources);
    return st;
  });
  std::vector<std::string> source_addrs;
  // Per source, the engine ranks its plan writes: it is told only their held versions (every rank's, to every
  // source, was 1024 x 256 entries per update at 1024 ranks). Absent: the source's plan is unknown here, all are sent.
  std::map<std::string, std::set<std::pair<std::string, int>>> source_ranks;
  // Per engine offering staging memory, the copy of its segments this update writes (LayoutCopy; absent: copy 0).
  std::map<std::string, int> segment_sets;
  std::vector<v1::RankVersion> held;  // what each engine rank holds: sources send deltas where it is their base
  driver.Bind(Phase::kOpenWindows, [&](OnFailure) {
    {
      MutexLock l(&mu_);
      for (const auto& [id, n] : nodes_)
        for (const auto& e : n.engines())
          if (const int c = LayoutCopy(e.engine_id(), staged, live_sets); c > 0) segment_sets[e.engine_id()] = c;
      for (const auto& [id, n] : nodes_) {
        if (n.role() != "source" || !InRun(id)) continue;
        source_addrs.push_back(n.address());
        auto c = configured_.find(id);
        source_epochs[n.address()] = c == configured_.end() ? plan_epoch : c->second.epoch;
        if (c != configured_.end()) {
          auto& ranks = source_ranks[n.address()];
          for (const auto& t : c->second.targets) ranks.insert(t);
        }
      }
    }
    // Targets accept writes from now on, until the sources have finished (or the update ends otherwise: the failure
    // handler closes them).
    ctx.windows_open = true;
    absl::Status st = SetWindows(true, v, {}, &held);
    std::shared_ptr<const RelayWiring> relays;
    WSYNC_UNDER(mu_, relays = relay_wiring_);
    if (st.ok() && !AbortAsked() && relays && relays->relayed()) st = StartRelays(*relays, v);  // relay_wiring.h
    return st;
  });
  driver.Bind(Phase::kStart, [&](OnFailure) {
    // A source that started may already take pushes from its ranks: from here a failure (or an abort) tells every
    // source to abort, and each says what it wrote (the failure handler, FailAndStopSources).
    ctx.sources_live = true;
    return ForAll(
        source_addrs,
        [&](const std::string& a) {
          v1::StartUpdateRequest sreq;
          sreq.set_version(v);
          sreq.set_plan_epoch(source_epochs.at(a));
          sreq.set_delta(delta);
          auto mine = source_ranks.find(a);
          for (const auto& h : held)
            if (mine == source_ranks.end() || mine->second.count({h.engine_id(), h.rank()})) *sreq.add_held() = h;
          for (const auto& [engine, set] : segment_sets) (*sreq.mutable_segment_sets())[engine] = set;
          return Annotate(Remote(a, [&] { return peers_->StartUpdate(a, sreq); }), "start source " + NodeLabel(a));
        },
        UpdatePhase(mode, Phase::kStart, source_addrs));
  });
  if (absl::Status walked = driver.Walk(PhaseTable(mode).front().phase, Phase::kStart); !walked.ok()) return walked;
  out.set_plan_epoch(plan_epoch);
  {
    MutexLock l(&mu_);
    // Checked under the lock AbortUpdate decides under: an abort asked before this point ends the update below.
    if (!run_.abort_asked) {
      SetState(UpdateState::kUpdating);
      run_.plan_epoch = plan_epoch;
      run_.source_epochs = source_epochs;
      run_.live_sets = live_sets;
      run_.begin_reply = out;
      run_.record = rec;
      run_.record.set_started_unix_ms(absl::ToUnixMillis(start));
      // The push phase starts now; its start is kept in total_seconds until commit.
      run_.record.set_total_seconds(absl::ToDoubleSeconds(absl::Now() - start));
      Persist();
      ended_cv_.SignalAll();
      if (staged)
        spdlog::info("update {} open (plan {}, staged): engines serve on while it is staged", v, plan_epoch);
      else
        spdlog::info("update {} open (plan {}): engines paused in {:.3f}s", v, plan_epoch, out.pause_seconds());
      return out;
    }
  }
  // The abort came after the start row passed: that row's failure.
  return driver.FailAt(Phase::kStart, absl::OkStatus());
}

absl::StatusOr<v1::CommitUpdateReply> Coordinator::CommitUpdate(const v1::CommitUpdateRequest& req) {
  // The outcome is in the store before the caller hears it (the store writer, store_writer.h).
  auto out = RunCommitUpdate(req);
  Durable().IgnoreError();
  return out;
}

absl::StatusOr<v1::CommitUpdateReply> Coordinator::RunCommitUpdate(const v1::CommitUpdateRequest& req) {
  const int64_t v = req.version();
  v1::UpdateRecord rec;
  std::vector<std::string> sources, engines;
  int engine_ranks = 0;
  std::map<std::string, int64_t> source_epochs;
  std::map<std::string, std::string> source_ids;  // address -> node id (the timeline)
  {
    ReleasableMutexLock l(&mu_);
    // A second CommitUpdate(v) while v commits (a client retry, a second driver) starts nothing: it waits for the
    // running commit and returns its recorded result. The wait is bounded by that commit's own peer deadlines.
    // Likewise while v is being ended (an abort, a lost node, a source's failure report): its recorded failure is
    // the answer.
    while ((state_ == UpdateState::kCommitting || state_ == UpdateState::kAborting) && open_version_ == v)
      ended_cv_.Wait(&mu_);
    if (const Outcome* o = FindOutcome(v)) {
      // Committed with engines not resumed, and still the fleet's version: the retry continues them.
      const bool resume =
          o->reply.record().success() && !not_resumed_.empty() && v == current_version_ && !UpdateInProgress();
      if (!resume) {
        if (!o->status.ok()) return o->status;
        spdlog::info("CommitUpdate({}) repeated after it committed: answering with the recorded result", v);
        return o->reply;
      }
    }
    if (FindOutcome(v) != nullptr) {
      l.Release();
      return ResumeCommitted(v);
    }
    if (state_ != UpdateState::kUpdating || open_version_ != v) {
      std::string open = open_version_ >= 0 ? absl::StrCat("update ", open_version_, " is ", StateName())
                                            : absl::StrCat("no update is open (state ", StateName(), ")");
      return absl::FailedPreconditionError(
          absl::StrCat("cannot commit update ", v, ": ", open, "; current version ",
                       current_version_ >= 0 ? std::to_string(current_version_) : std::string("none"),
                       v <= current_version_ ? " (the asked version is not newer than it)" : ""));
    }
    SetState(UpdateState::kCommitting);
    run_.cancel = std::make_shared<Cancellation>();
    run_.commit_lost.clear();
    run_.commit_lost_why.clear();
    Persist();
    rec = run_.record;
    source_epochs = run_.source_epochs;
    for (const auto& [id, n] : nodes_) {
      if (n.role() == "source" && InRun(id)) sources.push_back(n.address());
      if (n.role() == "source") source_ids[n.address()] = id;
      for (const auto& e : n.engines()) {
        if (EngineDrained(id, e.engine_id())) continue;
        engines.push_back(e.control_address());
        engine_ranks += e.ranks_size();
      }
    }
  }
  const absl::Time start = absl::FromUnixMillis(rec.started_unix_ms());
  const absl::Time push_start = start + absl::Seconds(rec.total_seconds());
  rec.set_engines(static_cast<int>(engines.size()));
  rec.set_engine_ranks(engine_ranks);

  std::mutex agg_mu;
  uint64_t bytes = 0, params = 0;
  std::vector<std::pair<std::string, v1::FinishUpdateReply>> finished;  // (source address, reply)
  std::map<std::string, absl::Time> finished_at;
  const double commit_timeout_s = req.timeout_seconds() > 0 ? req.timeout_seconds() : kDefaultCommitTimeoutSeconds;
  const bool staged = rec.mode() == "staged";
  const UpdateMode mode = staged ? UpdateMode::kStaged : UpdateMode::kClassic;
  std::shared_ptr<const RelayWiring> relays;
  WSYNC_UNDER(mu_, relays = relay_wiring_);
  const bool relayed = !staged && relays && relays->relayed();  // staged updates are refused with relays (BeginUpdate)
  // The rows of the commit half (finish … continue), walked in the mode's table order by the driver (update_run.h).
  // The sources still take pushes and the targets' windows are open until the finish row ends.
  RunContext ctx;
  ctx.engines = engines;
  ctx.sources_live = true;
  ctx.windows_open = true;
  UpdateDriver driver(
      mode, [this] { return StopAsked(); },
      [&](const UpdateDriver::Failure& f) { return EndRunAt(f, rec, ctx); });
  driver.Bind(Phase::kFinish, [&](OnFailure) {
    absl::Status st = ForAll(
        sources,
        [&](const std::string& a) {
          v1::FinishUpdateRequest freq;
          freq.set_version(v);
          auto ep = source_epochs.find(a);
          freq.set_plan_epoch(ep == source_epochs.end() ? -1 : ep->second);
          freq.set_timeout_seconds(commit_timeout_s);
          auto r = Remote(a, [&] { return peers_->FinishUpdate(a, freq); });
          if (!r.ok()) return Annotate(r.status(), "finish update at source " + NodeLabel(a));
          std::lock_guard<std::mutex> l(agg_mu);
          bytes += r->bytes_written();
          params += r->params_written();
          finished.emplace_back(a, *r);
          finished_at[a] = absl::Now();
          return absl::OkStatus();
        },
        UpdatePhase(mode, Phase::kFinish, sources, commit_timeout_s + PeerDeadlines::kFinishSlack));
    {
      auto* p = rec.add_phases();
      p->set_phase("push");
      p->set_seconds(absl::ToDoubleSeconds(absl::Now() - push_start));
      p->set_start_seconds(absl::ToDoubleSeconds(push_start - start));
    }
    AddSourcePushes(&rec, finished, finished_at, source_ids, push_start);
    rec.set_bytes(bytes);
    rec.set_params(params);
    // Every source has finished (or failed and drained): no write of this update is legitimate any more. A failed
    // commit does not wait on targets that are unreachable (lost their lease, or missed their last heartbeat): their
    // window closes when they come back (the next update's windows), and nothing writes meanwhile.
    if (!st.ok()) {
      MutexLock l(&mu_);
      ctx.window_skip = run_.commit_lost;
      const absl::Time now = absl::Now();
      for (const auto& [id, n] : nodes_)
        if (now - LastHeartbeat(id) > absl::Seconds(1.5 * opts_.heartbeat_seconds)) ctx.window_skip.insert(n.address());
      if (!run_.commit_lost_why.empty() && !absl::StrContains(st.message(), run_.commit_lost_why))
        st = absl::Status(st.code(), absl::StrCat(run_.commit_lost_why, "; ", st.message()));
    }
    for (const auto& a : ctx.window_skip) spdlog::warn("update {}: write window of {} not closed (unreachable)", v, a);
    // The operator's abort cancelled the sources' FinishUpdate: their writes may still run; the failure handler stops
    // them. Otherwise every source is done; the windows close once the relays drained (when there are relay trees).
    ctx.sources_live = AbortAsked();
    if (st.ok() && !ctx.sources_live && !relayed) CloseWindows(v, &ctx);
    return st;
  });
  // A relay whose target daemon died (docs/planner.md, "A relay that dies"): its engine is dropped from the update
  // (kept paused at its old label, stale and failed at relay_drain: it may hold a mix), the write windows of the
  // children it leaves name their new parent's node as their ranks' writer (grants of anyone else revoked), and each
  // new parent is told its children (SetRelay adopt). Decided by RerouteRelays.
  const auto route_around = [&](const RelayWiring& live, const std::set<std::string>& dead,
                                const RelayReroute& rr) -> absl::Status {
    std::map<std::string, std::string> node_of;  // engine → its target daemon's node id
    std::set<std::string> adopters;              // target daemons whose write windows change
    for (const RelayMember& m : live.members) {
      node_of[m.engine_id] = m.node_id;
      if (rr.adopted.count(m.engine_id)) adopters.insert(m.address);
    }
    std::set<std::string> dropped;  // engine control addresses
    std::map<std::string, v1::SetWriteWindowRequest> windows;
    {
      MutexLock l(&mu_);
      for (const RelayMember& m : live.members) {
        if (!dead.count(m.engine_id)) continue;
        ctx.window_skip.insert(m.address);  // its window is not closed: nothing answers there
        run_.commit_lost.insert(m.address);  // nor is it asked to apply deltas, nor its lease checked
        const std::string why = absl::StrCat(m.engine_id, ": its target daemon on node ", m.node_id, " (", m.address,
                                             ") died during update ", v, " while relaying; kept paused at its old label");
        rec.add_dropped(why);
        spdlog::error("update {}: relay engine {} dropped: {}", v, m.engine_id, why);
        for (const auto& [id, n] : nodes_)
          for (const auto& e : n.engines())
            if (e.engine_id() == m.engine_id) {
              dropped.insert(e.control_address());
              engine_stale_[e.control_address()] = why;
              engine_state_[e.control_address()] = EngineView{EngineState::kFailed, "relay_drain"};
            }
      }
      for (const auto& addr : adopters) {
        WindowSources objects;
        for (const auto& p : plan_) {
          if (p.assignment->target_daemon() != addr) continue;
          auto a = rr.adopted.find(p.assignment->engine_id());
          objects.emplace_back(a == rr.adopted.end() ? p.source : node_of[a->second], p.assignment);
        }
        v1::SetWriteWindowRequest& w = windows[addr];
        w.set_open(true);
        w.set_version(v);
        w.set_assignments_given(true);
        AddWindowAssignments(objects, &w);
        w.set_assignments_digest(WindowAssignmentsDigest(w.assignments()));
      }
      NoteChange();
    }
    SaveEngineStates();
    engines.erase(std::remove_if(engines.begin(), engines.end(), [&](const std::string& a) { return dropped.count(a); }),
                  engines.end());
    for (const auto& [child, parent] : rr.adopted)
      spdlog::warn("update {}: relay engine {} re-parented to {}", v, child, parent.empty() ? "the sources" : parent);
    for (const auto& entry : windows) {
      const std::string& addr = entry.first;  // not a structured binding: the lambda below captures it
      const auto& w = entry.second;
      auto r = Remote(addr, [&] { return peers_->SetWriteWindow(addr, w); });
      if (!r.ok()) return Annotate(r.status(), "re-opening the write window of target " + NodeLabel(addr));
      MutexLock l(&mu_);
      window_acks_[addr] = r->assignments_digest();
    }
    return AdoptRelays(rr, v);
  };
  if (relayed)
    driver.Bind(Phase::kRelayDrain, [&](OnFailure policy) {
      const absl::Time t = absl::Now();
      RelayWiring live = *relays;
      absl::Status st = DrainRelays(live, v, commit_timeout_s);  // every relay checked and forwarded all
      // The row's policy routes around relays whose daemons died: each round drops the dead, re-parents their
      // children and drains the rest again. Any other failure, or a dead root, is the row's failure (kept paused).
      while (!st.ok() && policy == OnFailure::kRouteAround && !AbortAsked()) {
        const std::set<std::string> dead = DeadRelays(live, kRelayProbeSeconds);
        if (dead.empty()) break;
        RelayReroute rr = RerouteRelays(live, dead);
        if (!rr.impossible.empty()) {
          st = absl::Status(st.code(), absl::StrCat(rr.impossible, "; ", st.message()));
          break;
        }
        st = route_around(live, dead, rr);
        if (!st.ok()) break;
        live = std::move(rr.wiring);
        st = DrainRelays(live, v, commit_timeout_s);
      }
      AddPhase(&rec, "relay_drain", t);
      if (st.ok()) CloseWindows(v, &ctx);
      return st;
    });
  // Staged with deltas (every engine stages in place): the records land in the staging memory before it is verified,
  // and the targets record the version it holds. Staged without: nothing is recorded, the next update is dense (a
  // second copy holds an older version than the one written).
  if (!staged || rec.delta_mode() == "auto" || rec.delta_mode() == "always")
    driver.Bind(Phase::kApplyDelta, [&](OnFailure) {
      const absl::Time t = absl::Now();
      absl::Status st = ApplyDeltas(v, finished, &rec);
      AddPhase(&rec, "apply_delta", t);
      return st;
    });
  const std::string version = std::to_string(v);
  driver.Bind(Phase::kPostProcess, [&](OnFailure) {
    const absl::Time t = absl::Now();
    absl::Status st = ForAll(
        engines,
        [&](const std::string& a) {
          return Track(
              a, std::nullopt, "post_process",
              Annotate(Remote(a, [&] { return peers_->PostProcess(a, version); }), "post_process " + EngineLabel(a)));
        },
        UpdatePhase(mode, Phase::kPostProcess, engines));
    SaveEngineStates();
    AddPhase(&rec, "post_process", t);
    return st;
  });
  driver.Bind(Phase::kSetVersion, [&](OnFailure) {
    const absl::Time t = absl::Now();
    absl::Status st = ForAll(
        engines,
        [&](const std::string& a) {
          absl::Status r = Track(a, std::nullopt, "set_version",
                                 Annotate(Remote(a, [&] { return peers_->SetWeightVersion(a, version); }),
                                          "set_version " + EngineLabel(a)));
          if (r.ok()) {
            MutexLock l(&mu_);
            engine_version_[a] = version;
            NoteChange();  // the label is in Status as soon as the engine holds it
          }
          return r;
        },
        UpdatePhase(mode, Phase::kSetVersion, engines));
    SaveEngineStates();
    AddPhase(&rec, "set_version", t);
    if (!st.ok()) return st;
    // The commit point (docs/operations.md, "Past the commit point"): every engine holds v's weights and label, so
    // the fleet's version is v from here, whatever a Continue answers. Decided under the lock AbortUpdate decides
    // under, and saved before the first Continue so that a successor coordinator knows it too.
    {
      MutexLock l(&mu_);
      // The abort came before the continue phase: no engine was continued at v (this row fails).
      if (run_.abort_asked) return absl::CancelledError("no engine was continued");
      run_.commit_point = true;
      rec.set_committed_unix_ms(absl::ToUnixMillis(absl::Now()));
      run_.record = rec;
      current_version_ = v;
      engines_dirty_ = false;  // no engine holds a mix: all hold v
      Persist();
    }
    // Durable before the first Continue, so that a successor knows the fleet is on v (waited for without the lock).
    Durable().IgnoreError();
    return absl::OkStatus();
  });
  std::vector<std::string> not_resumed;  // addresses
  absl::Status continued;                // the continue row's, when its row commits engines not resumed
  driver.Bind(Phase::kContinue, [&](OnFailure policy) {
    const absl::Time t = absl::Now();
    absl::Status st = ContinueEngines(engines, UpdatePhase(mode, Phase::kContinue, engines), &not_resumed);
    AddPhase(&rec, "continue", t);
    if (policy != OnFailure::kCommittedNotResumed) return st;  // another meaning: the failure handler applies it
    continued = st;  // per engine: those whose Continue failed stay paused at v, named not resumed
    return absl::OkStatus();
  });
  // Staged: the rows from verify to continue are bound by CommitStaged, which walks them after these.
  if (staged) {
    if (absl::Status walked = driver.Walk(Phase::kFinish, Phase::kApplyDelta); !walked.ok()) return walked;
    return CommitStaged(driver, rec, engines, start);
  }
  if (absl::Status walked = driver.Walk(Phase::kFinish, Phase::kContinue); !walked.ok()) return walked;
  rec.set_success(true);
  rec.set_total_seconds(absl::ToDoubleSeconds(absl::Now() - start));
  MutexLock l(&mu_);
  for (const auto& a : engines) {  // every engine holds v now: nothing of an earlier staged update is pending
    engine_stale_.erase(a);
    engine_staged_.erase(a);
  }
  not_resumed_.clear();
  for (const auto& a : not_resumed) {
    const std::string id = EngineIdLocked(a);
    not_resumed_.insert(id);
    rec.add_not_resumed(id);
  }
  v1::CommitUpdateReply out;
  *out.mutable_record() = rec;
  const absl::Status result = continued.ok() ? absl::OkStatus() : NotResumedError(v, engines.size(), continued);
  Finish(v, Outcome{result, out}, rec);
  if (!result.ok()) {
    spdlog::error("{}", result.ToString());
    return result;
  }
  spdlog::info("update {} committed: {:.1f} MiB to {} engine ranks in {:.3f}s", v, bytes / 1048576.0, engine_ranks,
               rec.total_seconds());
  return out;
}

absl::Status Coordinator::ContinueEngines(const std::vector<std::string>& engines, const FanoutOptions& phase,
                                          std::vector<std::string>* failed) {
  std::mutex failed_mu;
  absl::Status st = ForAll(
      engines,
      [&](const std::string& a) {
        absl::Status r = Track(a, EngineState::kServing, "continue",
                               Annotate(Remote(a, [&] { return peers_->Continue(a); }), "continue " + EngineLabel(a)));
        if (!r.ok()) {
          std::lock_guard<std::mutex> l(failed_mu);
          failed->push_back(a);
        }
        return r;
      },
      phase);
  std::sort(failed->begin(), failed->end());
  SaveEngineStates();
  return st;
}

absl::Status Coordinator::NotResumedError(int64_t v, size_t engines, const absl::Status& why) const {
  // Unavailable: the update is committed; retrying the commit (or wsyncctl resume) continues the rest.
  return absl::UnavailableError(absl::StrCat(
      "update ", v, " committed: the fleet is on version ", v, "; ", not_resumed_.size(), " of ", engines,
      " engines not resumed (", absl::StrJoin(not_resumed_, ", "), "): ", why.message(),
      "; they stay paused at version ", v, " until CommitUpdate(", v, ") is retried or `wsyncctl resume` runs"));
}

absl::StatusOr<v1::CommitUpdateReply> Coordinator::ResumeCommitted(int64_t v) {
  std::vector<std::string> addrs;
  size_t engines = 0;
  {
    MutexLock l(&mu_);
    for (const auto& [id, n] : nodes_)
      for (const auto& e : n.engines()) {
        if (EngineDrained(id, e.engine_id())) continue;
        ++engines;
        if (not_resumed_.count(e.engine_id())) addrs.push_back(e.control_address());
      }
  }
  std::vector<std::string> failed;
  FanoutOptions phase;
  phase.max_parallel = opts_.fanout_parallel;
  phase.deadline = absl::Seconds(PeerDeadlines::kContinue);
  phase.phase = "continue";
  absl::Status st = ContinueEngines(addrs, phase, &failed);
  MutexLock l(&mu_);
  MarkResumed(addrs, failed, st);
  const Outcome* o = FindOutcome(v);
  if (o == nullptr) return absl::InternalError(absl::StrCat("update ", v, " has no recorded outcome"));
  if (!o->status.ok()) return o->status;
  spdlog::info("update {}: the engines not resumed at its commit were continued", v);
  return o->reply;
}

void Coordinator::MarkResumed(const std::vector<std::string>& addrs, const std::vector<std::string>& failed,
                              const absl::Status& why) {
  if (not_resumed_.empty() || current_version_ < 0) return;
  const std::set<std::string> still(failed.begin(), failed.end());
  for (const auto& a : addrs)
    if (!still.count(a)) not_resumed_.erase(EngineIdLocked(a));
  // The committed update's record says which engines are still not resumed; its answer to a retry too.
  const int64_t v = current_version_;
  auto update = [&](v1::UpdateRecord* r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    r->clear_not_resumed();
    for (const auto& id : not_resumed_) r->add_not_resumed(id);
  };
  for (auto& r : history_)
    if (r.version() == v) {
      update(&r);
      history_dirty_.insert(v);
      model_history_dirty_.insert(v);
    }
  if (auto it = outcomes_.find(v); it != outcomes_.end()) {
    update(it->second.reply.mutable_record());
    it->second.status = not_resumed_.empty()
                            ? absl::OkStatus()
                            : NotResumedError(v, static_cast<size_t>(it->second.reply.record().engines()), why);
  }
  Persist();
}

std::string Coordinator::EngineIdLocked(const std::string& addr) const {
  for (const auto& [id, n] : nodes_)
    for (const auto& e : n.engines())
      if (e.control_address() == addr) return e.engine_id();
  return addr;
}

absl::StatusOr<v1::AbortUpdateReply> Coordinator::AbortUpdate(const v1::AbortUpdateRequest& req) {
  // The outcome is in the store before the caller hears it (the store writer, store_writer.h).
  auto out = RunAbortUpdate(req);
  Durable().IgnoreError();
  return out;
}

absl::StatusOr<v1::AbortUpdateReply> Coordinator::RunAbortUpdate(const v1::AbortUpdateRequest& req) {
  const int64_t v = req.version();
  bool in_phase = false;                 // v is beginning or committing (else updating)
  std::shared_ptr<Cancellation> cancel;  // the running phase's, raised without the lock
  {
    MutexLock l(&mu_);
    // Being ended by another call (an abort, a lost node, a source's failure report): its recorded end is the answer.
    while (ending_open_ == v) ended_cv_.Wait(&mu_);
    if (auto it = aborted_.find(v); it != aborted_.end()) return it->second;
    if (const Outcome* o = FindOutcome(v))
      return absl::FailedPreconditionError(absl::StrCat("cannot abort update ", v, ": it has ended already (",
                                                        o->status.ok() ? "committed" : "failed", ")"));
    if (open_version_ != v || state_ == UpdateState::kIdle || state_ == UpdateState::kFailed)
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot abort update ", v, ": ",
          open_version_ >= 0 ? absl::StrCat("the open update is ", open_version_) : std::string("no update is open")));
    if (state_ == UpdateState::kAborting)
      return absl::FailedPreconditionError(
          absl::StrCat("update ", v, " is being aborted by another call; ask again for its result"));
    in_phase =
        state_ != UpdateState::kUpdating;  // updating: EndOpenUpdate below, without the lock (it calls the sources)
    if (!in_phase) run_.abort_by = req.aborted_by().empty() ? "the operator" : req.aborted_by();
    // Beginning or committing: the thread running that phase ends the update at its next step.
    if (in_phase && run_.AskAbort(req.reason(), req.aborted_by().empty() ? "the operator" : req.aborted_by())) {
      cancel = run_.cancel;
      spdlog::warn("update {}: abort asked by {} while {}{}", v, run_.abort_by, StateName(),
                   req.reason().empty() ? std::string() : absl::StrCat(" (", req.reason(), ")"));
    }
  }
  if (cancel)
    cancel->Cancel(
        absl::StrCat("update ", v, " aborted by ", req.aborted_by().empty() ? "the operator" : req.aborted_by()));
  if (!in_phase) return EndOpenUpdate(v, req.reason(), true);
  // Cancel the phase's calls in flight until the update has ended. Repeated: a call the run counts in flight may not
  // have reached the peer yet when it is first cancelled (the peer cannot cancel what it does not hold yet).
  for (;;) {
    std::vector<std::string> addrs;
    {
      MutexLock l(&mu_);
      if (open_version_ != v || aborted_.count(v)) break;
      addrs = run_.InFlight();
    }
    for (const auto& a : addrs) peers_->CancelCalls(a);
    MutexLock l(&mu_);
    const absl::Time deadline = absl::Now() + absl::Milliseconds(50);
    while (open_version_ == v && !aborted_.count(v))
      if (ended_cv_.WaitWithDeadline(&mu_, deadline)) break;
    if (open_version_ != v || aborted_.count(v)) break;
  }
  MutexLock l(&mu_);
  if (auto it = aborted_.find(v); it != aborted_.end()) return it->second;
  const Outcome* o = FindOutcome(v);
  if (o != nullptr && !o->status.ok() && o->reply.record().success())
    return absl::FailedPreconditionError(absl::StrCat("cannot abort update ", v,
                                                      ": it passed its commit point before the abort took effect (",
                                                      o->status.message(), ")"));
  if (o != nullptr && o->status.ok())
    return absl::FailedPreconditionError(
        absl::StrCat("cannot abort update ", v,
                     ": it committed before the abort took effect (every engine had been continued at "
                     "version ",
                     v, ")"));
  if (o != nullptr) return o->status;
  return absl::InternalError(absl::StrCat("update ", v, " ended without a recorded outcome"));
}

absl::StatusOr<v1::AbortUpdateReply> Coordinator::EndOpenUpdate(int64_t v, const std::string& why_in, bool by_operator,
                                                                const std::string& lost_address,
                                                                absl::StatusCode failed_code) {
  v1::UpdateRecord rec;
  std::vector<std::string> sources, engines;
  bool dirty_before;
  {
    MutexLock l(&mu_);
    if (open_version_ != v || state_ != UpdateState::kUpdating)
      return absl::FailedPreconditionError(
          absl::StrCat("update ", v, " is not open (", StateName(), "); nothing to end"));
    SetState(UpdateState::kAborting);
    ending_open_ = v;
    Persist();
    rec = run_.record;
    if (by_operator) rec.set_aborted_by(run_.abort_by.empty() ? "the operator" : run_.abort_by);
    for (const auto& [id, n] : nodes_)
      if (n.role() == "source" && InRun(id)) sources.push_back(n.address());
    engines = EngineAddresses();
    dirty_before = engines_dirty_;
  }
  const absl::Time t = absl::Now();
  v1::AbortSourceUpdateRequest sreq;
  sreq.set_version(v);
  sreq.set_reason(why_in);
  std::mutex agg_mu;
  uint64_t bytes = 0;
  bool clean = true;
  absl::Status st = ForAll(sources, [&](const std::string& a) {
    if (a == lost_address) {
      // Not asked: a stopped or unreachable node would hold the failure for the whole call deadline. It abandons
      // the update at its next StartUpdate; whatever it wrote counts as possibly written.
      std::lock_guard<std::mutex> l(agg_mu);
      clean = false;
      return absl::OkStatus();
    }
    auto r = peers_->AbortSourceUpdate(a, sreq);
    std::lock_guard<std::mutex> l(agg_mu);
    if (!r.ok()) {
      clean = false;  // unknown: that source may have written
      return Annotate(r.status(), "abort at source " + NodeLabel(a));
    }
    bytes += r->bytes_written();
    if (r->bytes_written() > 0 || !r->quiescent()) clean = false;
    return absl::OkStatus();
  });
  SetWindows(false, v, {lost_address}).IgnoreError();
  AddPhase(&rec, "abort", t);
  rec.set_bytes(bytes);
  rec.set_aborted(by_operator);
  const std::string why =
      by_operator
          ? absl::StrCat("aborted by ", rec.aborted_by(), why_in.empty() ? std::string() : absl::StrCat(": ", why_in),
                         st.ok() ? std::string() : absl::StrCat(" (", st.ToString(), ")"))
          : absl::StrCat(why_in, st.ok() ? std::string() : absl::StrCat(" (", st.ToString(), ")"));
  // The phase table's row for the open update (kPush): classic resumes the engines when no source wrote a byte.
  const OnFailure policy = PolicyFor(rec.mode() == "staged" ? UpdateMode::kStaged : UpdateMode::kClassic, Phase::kPush);
  const bool resume = policy == OnFailure::kResumeIfClean && clean && !dirty_before;
  const bool written = policy == OnFailure::kResumeIfClean || policy == OnFailure::kKeepPaused ? !clean : false;
  if (resume) ResumeOld(v, engines);
  absl::Status err = Fail(rec, by_operator ? absl::AbortedError(why) : absl::Status(failed_code, why), written,
                          /*stopping=*/false, /*resumed=*/resume);
  if (!lost_address.empty()) {
    // The failure is recorded; now, off the critical path, try to close the lost node's window too (a stopped
    // target that is continued later must not keep it open). Bounded by the call's deadline.
    v1::SetWriteWindowRequest close;
    close.set_open(false);
    close.set_version(v);
    bool is_target = false;
    {
      MutexLock l(&mu_);
      for (const auto& [id, n] : nodes_) is_target |= n.address() == lost_address && n.role() == "target";
    }
    if (is_target) {
      auto r = peers_->SetWriteWindow(lost_address, close);
      if (!r.ok()) spdlog::warn("closing the write window of lost target {}: {}", lost_address, r.status().ToString());
    }
  }
  v1::AbortUpdateReply out;
  {
    MutexLock l(&mu_);
    if (!history_.empty() && history_.back().version() == v) *out.mutable_record() = history_.back();
    out.set_bytes_written(bytes);
    out.set_engines_resumable(!engines_dirty_);
    aborted_[v] = out;
    while (aborted_.size() > std::max<size_t>(opts_.history_limit, 1)) aborted_.erase(aborted_.begin());
    ending_open_ = -1;
    ended_cv_.SignalAll();  // an AbortUpdate that came meanwhile answers with `out`
  }
  spdlog::warn("update {} {}: {} bytes had reached the engines; engines {}", v, by_operator ? "aborted" : "failed",
               bytes,
               out.engines_resumable() ? "may be resumed at the old version" : "stay paused until an update succeeds");
  return out;
}

v1::ReportUpdateFailureReply Coordinator::ReportUpdateFailure(const v1::ReportUpdateFailureRequest& req) {
  const int64_t v = req.version();
  v1::ReportUpdateFailureReply out;
  std::string node_label;
  {
    MutexLock l(&mu_);
    auto n = nodes_.find(req.node_id());
    if (n == nodes_.end() || n->second.role() != "source" || !InRun(req.node_id())) {
      out.set_detail(absl::StrCat("node ", req.node_id(), " is not a source of the open update"));
      return out;
    }
    if (FindOutcome(v) != nullptr || open_version_ != v) {
      out.set_detail(absl::StrCat("update ", v, " is not the open update (", StateName(), ")"));
      return out;
    }
    if (state_ != UpdateState::kUpdating) {
      // Beginning: StartUpdate has not answered yet or the run is ending; committing: FinishUpdate answers it.
      out.set_detail(absl::StrCat("update ", v, " is ", StateName(), "; that phase's calls answer the failure"));
      return out;
    }
    node_label = absl::StrCat("source node ", req.node_id(), " at ", n->second.address());
  }
  spdlog::warn("update {}: {} failed it: {}", v, node_label, req.error());
  auto r = EndOpenUpdate(v, absl::StrCat(node_label, " failed update ", v, ": ", req.error()), false, "",
                         absl::StatusCode::kAborted);
  Durable().IgnoreError();
  out.set_ended(r.ok());
  if (!r.ok()) out.set_detail(std::string(r.status().message()));
  return out;
}

Coordinator::~Coordinator() {
  {
    std::lock_guard<std::mutex> l(watch_mu_);
    watch_stop_ = true;
  }
  watch_cv_.notify_all();
  if (watch_thread_.joinable()) watch_thread_.join();
}

void Coordinator::StartLeaseWatch() {
  if (watch_thread_.joinable() || opts_.lease_check_seconds <= 0) return;
  {
    MutexLock l(&mu_);
    leases_enforced_ = true;  // from now on a node whose lease lapsed is left out of the next update
  }
  watch_thread_ = std::thread([this] {
    std::unique_lock<std::mutex> l(watch_mu_);
    while (!watch_cv_.wait_for(l, absl::ToChronoMilliseconds(absl::Seconds(opts_.lease_check_seconds)),
                               [this] { return watch_stop_; })) {
      l.unlock();
      CheckLeases();
      l.lock();
    }
  });
}

bool Coordinator::CheckLeases() {
  int64_t v;
  std::string why, lost_address;
  std::vector<std::string> sources;
  bool committing = false, lost_source = false;
  {
    MutexLock l(&mu_);
    if (state_ != UpdateState::kUpdating && state_ != UpdateState::kCommitting) return false;
    committing = state_ == UpdateState::kCommitting;
    const absl::Duration limit = absl::Seconds(3 * opts_.heartbeat_seconds);
    const absl::Time now = absl::Now();
    // Relays below a tree's root: one that died is routed around at relay_drain (phase_table.h, kRouteAround), so
    // its lease is not the update's.
    std::set<std::string> routed_around;
    if (relay_wiring_)
      for (const RelayMember& m : relay_wiring_->members)
        if (!m.parent.empty()) routed_around.insert(m.node_id);
    for (const auto& [id, n] : nodes_) {
      if (TargetOutOfUpdates(n) || !InRun(id)) continue;  // drained or left out: the update does not need it
      if (routed_around.count(id)) continue;
      const absl::Duration ago = now - LastHeartbeat(id);
      if (ago <= limit || (committing && run_.commit_lost.count(n.address()))) continue;
      why = absl::StrCat(n.role(), " node ", id, " (", n.address(),
                         ") lost its lease during the update: no heartbeat for ",
                         absl::FormatDuration(absl::Trunc(ago, absl::Milliseconds(100))), " (limit ",
                         absl::FormatDuration(limit), "); it stopped or is unreachable");
      std::vector<std::string> ranks;
      for (const auto& e : n.engines())
        for (const auto& r : e.ranks()) ranks.push_back(absl::StrCat("engine ", e.engine_id(), " rank ", r.rank()));
      if (!ranks.empty())
        absl::StrAppend(&why, "; engine ranks that may hold partial writes: ", absl::StrJoin(ranks, ", "));
      lost_address = n.address();
      lost_source = n.role() == "source";
      break;
    }
    if (why.empty()) return false;
    v = open_version_;
    if (committing) {
      // The commit owns the update: it fails it once its sources return. Tell them now, so that writes blocked on
      // the lost node are cancelled and their drains return at once instead of running into tcp timeouts.
      run_.commit_lost.insert(lost_address);
      if (run_.commit_lost_why.empty()) run_.commit_lost_why = why;
      for (const auto& [id, n] : nodes_)
        if (n.role() == "source" && n.address() != lost_address) sources.push_back(n.address());
    }
  }
  spdlog::error("update {}: {}", v, why);
  if (committing) {
    v1::AbortSourceUpdateRequest req;
    req.set_version(v);
    req.set_reason(why);
    ForAll(sources, [&](const std::string& a) {
      auto r = peers_->AbortSourceUpdate(a, req);
      if (!r.ok()) spdlog::warn("telling source {} to cancel the writes of update {}: {}", a, v, r.status().ToString());
      return absl::OkStatus();
    }).IgnoreError();
    // A lost source cannot answer its FinishUpdate: stop waiting for it now rather than at the call's deadline
    // (the commit's timeout). Its writes, if it still runs, end with its own abort when it finds the update gone.
    if (lost_source) peers_->CancelCalls(lost_address);
    return true;
  }
  return EndOpenUpdate(v, why, false, lost_address).ok();
}

absl::Status Coordinator::SetWindows(bool open, int64_t version, const std::set<std::string>& skip,
                                     std::vector<v1::RankVersion>* held) {
  // Per target: the request, with the plan's assignments on it (its write grants are narrowed to them).
  std::map<std::string, v1::SetWriteWindowRequest> built;
  std::shared_ptr<std::map<std::string, v1::SetWriteWindowRequest>> cached;
  std::map<std::string, std::string> acked;  // target address → the assignments digest it last said it holds
  {
    MutexLock l(&mu_);
    // `from`/`previous` (may be null): what each request is built from, and the requests of the last build, a
    // target's taken over when built from the same assignment objects.
    using From = std::map<std::string, WindowSources>;
    const auto build =
        [&](std::map<std::string, v1::SetWriteWindowRequest>* out, From* from,
            std::map<std::string, v1::SetWriteWindowRequest>* previous) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          for (const auto& [id, n] : nodes_) {
            if (n.role() != "target" || skip.count(n.address()) || TargetOutOfUpdates(n)) continue;
            WindowSources objects;
            if (open)
              for (const auto& p : plan_)
                if (p.assignment->target_node() == id || p.assignment->target_daemon() == n.address())
                  objects.emplace_back(p.source, p.assignment);
            if (previous != nullptr && from != nullptr) {
              auto was = open_windows_from_.find(n.address());
              auto req = previous->find(n.address());
              if (was != open_windows_from_.end() && req != previous->end() && was->second == objects) {
                (*out)[n.address()] = std::move(req->second);
                (*from)[n.address()] = std::move(objects);
                continue;
              }
            }
            v1::SetWriteWindowRequest& r = (*out)[n.address()];
            r.set_open(open);
            r.set_version(version);
            r.set_assignments_given(open);
            if (!open) continue;
            AddWindowAssignments(objects, &r);
            r.set_assignments_digest(WindowAssignmentsDigest(r.assignments()));
            if (from != nullptr) (*from)[n.address()] = std::move(objects);
          }
        };
    if (open && skip.empty()) {
      // Built once per plan and membership, not per update: at 1024 engine ranks the assignments hold 1.6 million
      // write ranges, copied per update they were most of a BeginUpdate's CPU. Only one update begins at a time
      // (state beginning), so the version is set in place.
      const std::string key =
          absl::StrCat(membership_epoch_, "/", plan_generation_, "/", absl::StrJoin(drained_engines_, ","), "/",
                       absl::StrJoin(drained_nodes_, ","));
      if (!open_windows_ || open_windows_key_ != key) {
        auto next = std::make_shared<std::map<std::string, v1::SetWriteWindowRequest>>();
        From from;
        build(next.get(), &from, open_windows_.get());  // no other SetWindows reads open_windows_ meanwhile
        open_windows_ = std::move(next);
        open_windows_from_ = std::move(from);
        open_windows_key_ = key;
      }
      for (auto& [a, r] : *open_windows_) r.set_version(version);
      cached = open_windows_;
    } else {
      build(&built, nullptr, nullptr);
    }
    if (open) acked = window_acks_;
  }
  const std::map<std::string, v1::SetWriteWindowRequest>& reqs = cached ? *cached : built;
  std::vector<std::string> targets;
  for (const auto& [a, r] : reqs) targets.push_back(a);
  std::mutex held_mu;
  // Opening is a step of the beginning update (an abort cancels it); closing is how any update ends, never cancelled.
  FanoutOptions phase;
  if (open) phase = UpdatePhase(UpdateMode::kClassic, Phase::kOpenWindows, targets);
  phase.max_parallel = opts_.fanout_parallel;
  // A kept request whose assignments were dropped (its target holds them) is made whole again when it must be sent
  // whole (the target restarted, or holds others).
  const auto whole = [&](const std::string& a) {
    v1::SetWriteWindowRequest w = reqs.at(a);
    MutexLock l(&mu_);
    auto from = open_windows_from_.find(a);
    if (from != open_windows_from_.end()) AddWindowAssignments(from->second, &w);
    return w;
  };
  absl::Status st = ForAll(
      targets,
      [&](const std::string& a) {
        const v1::SetWriteWindowRequest& req = reqs.at(a);
        const bool dropped = cached && req.assignments_given() && req.assignments_size() == 0;
        absl::StatusOr<v1::SetWriteWindowReply> r =
            open ? OpenWindow(a, req, acked.count(a) ? acked.at(a) : std::string(),
                              dropped ? std::function<v1::SetWriteWindowRequest()>([&] { return whole(a); }) : nullptr)
                 : peers_->SetWriteWindow(a, req);
        if (r.ok() && held != nullptr) {
          std::lock_guard<std::mutex> l(held_mu);
          held->insert(held->end(), r->held().begin(), r->held().end());
        }
        return Annotate(r.status(),
                        absl::StrCat(open ? "opening" : "closing", " the write window of target ", NodeLabel(a)));
      },
      phase);
  if (!st.ok() && !open) spdlog::warn("{}", st.ToString());
  if (cached) {
    // A target that holds its assignments is sent only their digest until the plan or its daemon changes: its
    // request keeps no write ranges of its own (at 1024 engine ranks, every target's were 210 MB kept per plan).
    MutexLock l(&mu_);
    if (cached == open_windows_)
      for (auto& [a, r] : *open_windows_) {
        auto ack = window_acks_.find(a);
        if (ack != window_acks_.end() && !r.assignments_digest().empty() && ack->second == r.assignments_digest())
          google::protobuf::RepeatedPtrField<v1::WindowAssignment>().Swap(r.mutable_assignments());
      }
  }
  return st;
}

void Coordinator::AddWindowAssignments(const WindowSources& from, v1::SetWriteWindowRequest* r) const {
  for (const auto& [source, assignment] : from) {
    auto* a = r->add_assignments();
    a->set_source_node(source);
    a->set_engine_id(assignment->engine_id());
    a->set_rank(assignment->rank());
    *a->mutable_writes() = assignment->writes();
  }
}

absl::StatusOr<v1::SetWriteWindowReply> Coordinator::OpenWindow(
    const std::string& addr, const v1::SetWriteWindowRequest& full, const std::string& acked,
    const std::function<v1::SetWriteWindowRequest()>& whole) {
  // The plan's assignments go to a target once; afterwards the request only names them (at 1024 engine ranks they
  // are 1.6 million write ranges, ~100 MB a round, that were most of a steady update's cost).
  const bool named = MayNameHeldAssignments(full, acked);
  const v1::SetWriteWindowRequest naming = named ? NamingHeldAssignments(full) : v1::SetWriteWindowRequest();
  const v1::SetWriteWindowRequest made = !named && whole ? whole() : v1::SetWriteWindowRequest();
  const v1::SetWriteWindowRequest& first = named ? naming : whole ? made : full;
  absl::StatusOr<v1::SetWriteWindowReply> r = Remote(addr, [&] { return peers_->SetWriteWindow(addr, first); });
  // A target that lost them (it restarted) or holds others opened nothing: it is given them within this phase.
  if (r.ok() && AssignmentsNeeded(first, *r)) {
    spdlog::info("target {} does not hold the plan's write-window assignments ({}; it holds {}): sending them",
                 NodeLabel(addr), full.assignments_digest(),
                 r->assignments_digest().empty() ? "none" : r->assignments_digest());
    const v1::SetWriteWindowRequest again = whole ? whole() : v1::SetWriteWindowRequest();
    r = Remote(addr, [&] { return peers_->SetWriteWindow(addr, whole ? again : full); });
  }
  if (r.ok() && r->assignments_missing())
    r = absl::FailedPreconditionError("the target did not take the plan's write-window assignments sent to it");
  MutexLock l(&mu_);
  if (r.ok())
    window_acks_[addr] = r->assignments_digest();
  else
    window_acks_.erase(addr);  // not known what it holds: the next opening sends them
  return r;
}

absl::Status Coordinator::ApplyDeltas(int64_t v,
                                      const std::vector<std::pair<std::string, v1::FinishUpdateReply>>& finished,
                                      v1::UpdateRecord* rec) {
  std::map<std::string, v1::ApplyDeltaRequest> reqs;  // target daemon address → what was staged there
  {
    MutexLock l(&mu_);
    for (const auto& [id, n] : nodes_)
      // A relay routed around (its daemon died, route_around in CommitUpdate) holds nothing of the update.
      if (n.role() == "target" && !TargetOutOfUpdates(n) && !run_.commit_lost.count(n.address()))
        reqs[n.address()].set_version(v);
    std::map<std::string, std::string> source_id;
    for (const auto& [id, n] : nodes_) source_id[n.address()] = id;
    uint64_t dense = 0, sent = 0;
    std::map<std::string, std::string> fallback;  // "engine/rank" → why ("" took deltas)
    for (const auto& [addr, r] : finished) {
      dense += r.dense_bytes();
      for (const auto& d : r.ranks()) {
        sent += d.sent_bytes();
        const std::string rank = absl::StrCat(d.engine_id(), "/", d.rank());
        // A rank written by several sources took deltas only if every one sent them.
        if (!d.fallback().empty() || !fallback.count(rank)) fallback[rank] = d.fallback();
        if (d.records() == 0) continue;
        auto* s = reqs[d.target_daemon()].add_staged();
        s->set_source_node(source_id[addr]);
        s->set_engine_id(d.engine_id());
        s->set_rank(d.rank());
        s->set_bytes(d.staged_bytes());
        s->set_records(d.records());
        s->set_segment_set(d.segment_set());  // the copy of the segments the source wrote
      }
    }
    rec->set_dense_bytes(dense);
    rec->set_sent_bytes(sent);
    for (const auto& [rank, why] : fallback) {
      if (why.empty()) {
        rec->add_delta_ranks(rank);
        continue;
      }
      auto* f = rec->add_fallbacks();
      f->set_rank(rank);
      f->set_reason(why);
    }
  }
  std::vector<std::string> targets;
  for (auto& [a, r] : reqs) {
    r.set_version(v);
    targets.push_back(a);
  }
  return ForAll(
      targets,
      [&](const std::string& a) {
        auto r = Remote(a, [&] { return peers_->ApplyDelta(a, reqs.at(a)); });
        return Annotate(r.status(), "apply_delta at target " + NodeLabel(a));
      },
      UpdatePhase(UpdateMode::kClassic, Phase::kApplyDelta, targets));
}

absl::Status Coordinator::SaveState() {
  NoteChange();  // every save is a change readers see: the model is published first
  if (!writer_) return absl::OkStatus();
  v1::CoordinatorState s;
  // The nodes (their parameter tables are most of the state) change only with the membership epoch. They are lent
  // to `s`, not copied (a copy of every registration per membership change was hundreds of MB at 1024 engine
  // ranks), and taken back before `s` is destroyed; mu_ is held throughout, so nodes_ does not change meanwhile.
  struct Lent {
    google::protobuf::RepeatedPtrField<v1::RegisterNodeRequest>* nodes;
    ~Lent() { nodes->UnsafeArenaExtractSubrange(0, nodes->size(), nullptr); }
  } lent{s.mutable_nodes()};
  const bool nodes_changed = persisted_nodes_epoch_ != membership_epoch_;
  if (nodes_changed)
    for (const auto& [id, n] : nodes_)
      s.mutable_nodes()->UnsafeArenaAddAllocated(const_cast<v1::RegisterNodeRequest*>(&n));
  s.set_membership_epoch(membership_epoch_);
  s.set_current_version(current_version_);
  s.set_last_begun(last_begun_);
  s.set_state(StateName());
  s.set_open_version(open_version_);
  s.set_engines_hold_partial_writes(engines_dirty_);
  for (const auto& [a, st] : engine_state_) (*s.mutable_engine_state())[a] = EngineStateName(st);
  // Only the records added or changed since the last save (written once, not re-serialized at every save).
  for (const auto& r : history_)
    if (history_dirty_.count(r.version())) *s.add_history() = r;
  history_dirty_.clear();
  s.set_history_incremental(true);
  s.set_history_floor(history_.empty() ? 0 : history_.front().version());
  *s.mutable_open_record() = run_.record;
  for (const auto& e : drained_engines_) s.add_drained_engines(e);
  for (const auto& n : drained_nodes_) s.add_drained_nodes(n);
  for (const auto& [a, v] : engine_version_) (*s.mutable_engine_version())[a] = v;
  for (const auto& [a, why] : engine_stale_) (*s.mutable_engine_stale())[a] = why;
  s.set_switch_started(switch_started_);
  if (!nodes_changed) {
    save_ticket_ = writer_->Submit(std::move(s));
    return absl::OkStatus();
  }
  // The nodes are lent: written now, under mu_ (a membership change, between updates only).
  absl::Status st = writer_->SaveNow(&s, true, &save_ticket_);
  persisted_nodes_epoch_ = membership_epoch_;  // the store keeps the nodes it was given, saved or not
  if (!st.ok()) spdlog::error("{} (the coordinator goes on from memory)", st.ToString());
  return st;
}

absl::Status Coordinator::Durable(uint64_t t) {
  StoreWriter* w;
  {
    MutexLock l(&mu_);
    w = writer_.get();  // set once, before serving (UseStateStore); the writer itself is thread-safe
  }
  return w == nullptr ? absl::OkStatus() : w->Wait(t, kStoreWait);
}

absl::Status Coordinator::Durable() {
  uint64_t t;
  {
    MutexLock l(&mu_);
    if (!writer_) return absl::OkStatus();
    t = save_ticket_;
  }
  const absl::Status st = Durable(t);
  if (!st.ok()) spdlog::error("{} (the coordinator goes on from memory)", st.ToString());
  return st;
}

absl::Status Coordinator::UseStateStore(std::unique_ptr<StateStore> store) {
  auto loaded = store->Load();
  std::vector<std::string> ask;  // the engines of an update the previous coordinator died during
  {
    MutexLock l(&mu_);
    writer_ = std::make_unique<StoreWriter>(std::move(store));
    persisted_nodes_epoch_ = -1;
    if (absl::IsNotFound(loaded.status())) {
      spdlog::info("state store {} is new", writer_->store()->path());
      Persist();
      return absl::OkStatus();
    }
    if (!loaded.ok()) return loaded.status();
    const v1::CoordinatorState& s = *loaded;
    // Restored nodes get a fresh lease: they have three heartbeats to renew it with this coordinator.
    engine_digests_.clear();
    for (const auto& n : s.nodes()) {
      nodes_[n.node_id()] = n;
      StampLease(n.node_id(), n.address(), absl::Now());
    }
    // A fresh epoch: the plan is not stored, so the first update re-plans and re-configures every source.
    membership_epoch_ = s.membership_epoch() + 1;
    current_version_ = s.current_version();
    last_begun_ = s.last_begun();
    engines_dirty_ = s.engines_hold_partial_writes();
    for (const auto& [a, st] : s.engine_state()) {
      auto view = ParseEngineState(st);
      if (!view.ok())
        return Annotate(view.status(), absl::StrCat("restoring engine ", a, " from ", writer_->store()->path()));
      engine_state_[a] = *view;
    }
    drained_engines_ = {s.drained_engines().begin(), s.drained_engines().end()};
    drained_nodes_ = {s.drained_nodes().begin(), s.drained_nodes().end()};
    for (const auto& [a, v] : s.engine_version()) engine_version_[a] = v;
    for (const auto& [a, why] : s.engine_stale()) engine_stale_[a] = why;
    for (const auto& r : s.history()) {
      history_.push_back(r);
      history_dirty_.insert(r.version());
      model_history_dirty_.insert(r.version());  // rewritten once as objects if a schema 1 store held it
      Outcome o;
      if (r.success()) {
        *o.reply.mutable_record() = r;
      } else {
        o.status = absl::AbortedError(r.error().empty() ? absl::StrCat("update ", r.version(), " failed") : r.error());
      }
      outcomes_[r.version()] = o;
    }
    auto stored_state = ParseUpdateState(s.state());
    if (!stored_state.ok())
      return Annotate(stored_state.status(), absl::StrCat("restoring from ", writer_->store()->path()));
    // Restoring is not a transition: the state is what was stored, an update in progress ended below.
    state_ = *stored_state == UpdateState::kFailed ? UpdateState::kFailed : UpdateState::kIdle;
    if (!history_.empty() && history_.back().success() && history_.back().version() == current_version_)
      not_resumed_ = {history_.back().not_resumed().begin(), history_.back().not_resumed().end()};
    if (daemon::UpdateInProgress(*stored_state) && s.open_version() >= 0) {
      ask = EngineAddresses();
    } else {
      Persist();
      spdlog::info("restored from {}: {} nodes, version {}, {} updates in the history{}", writer_->store()->path(),
                   nodes_.size(), current_version_, history_.size(),
                   engines_dirty_ ? "; engines may hold partial writes and stay paused until an update succeeds" : "");
      return absl::OkStatus();
    }
  }
  // Died during an update: which of its calls in flight landed is not in the store, the engines know. Asked without
  // mu_ (no lock across a peer call), then the update is ended from their answers.
  const EngineWords words = AskEngines(ask);
  std::vector<std::string> sources;
  int64_t abort_version = -1;
  {
    MutexLock l(&mu_);
    abort_version = EndInterruptedLocked(*loaded, words);
    if (abort_version >= 0)
      for (const auto& [id, n] : nodes_)
        if (n.role() == "source") sources.push_back(n.address());
    Persist();
    spdlog::info("restored from {}: {} nodes, version {}, {} updates in the history{}", writer_->store()->path(),
                 nodes_.size(), current_version_, history_.size(),
                 engines_dirty_ ? "; engines may hold partial writes and stay paused until an update succeeds" : "");
  }
  if (abort_version >= 0) {
    v1::AbortSourceUpdateRequest req;
    req.set_version(abort_version);
    req.set_reason("the coordinator restarted during the update");
    ForAll(sources, [&](const std::string& a) {
      auto r = peers_->AbortSourceUpdate(a, req);
      if (!r.ok()) spdlog::warn("telling source {} to abort update {}: {}", a, abort_version, r.status().ToString());
      return absl::OkStatus();
    }).IgnoreError();  // best effort: a source that missed it abandons the update at the next StartUpdate
    SetWindows(false, abort_version).IgnoreError();
  }
  return absl::OkStatus();
}

Coordinator::EngineWords Coordinator::AskEngines(const std::vector<std::string>& addrs) {
  std::vector<absl::StatusOr<v1::EngineInfo>> got(addrs.size(), absl::UnknownError("not asked"));
  FanoutOptions o;
  o.max_parallel = opts_.fanout_parallel;
  o.deadline = absl::Seconds(DeadlineFor(UpdateMode::kClassic, Phase::kEngineInfo));
  o.phase = "engine_info";
  o.cancel_running = [this, &addrs](size_t i) { peers_->CancelCalls(addrs[i]); };
  const std::vector<absl::Status> st = RunFanout(
      addrs.size(),
      [&](size_t i) {
        got[i] = peers_->EngineInfo(addrs[i]);
        return got[i].status();
      },
      o);
  EngineWords out;
  for (size_t i = 0; i < addrs.size(); ++i)
    out.emplace(addrs[i], st[i].ok() ? got[i] : absl::StatusOr<v1::EngineInfo>(st[i]));
  return out;
}

int64_t Coordinator::EndInterruptedLocked(const v1::CoordinatorState& s, const EngineWords& words) {
  const int64_t v = s.open_version();
  const std::string version = std::to_string(v);
  v1::UpdateRecord rec = s.open_record();
  rec.set_version(v);
  const bool staged = rec.mode() == "staged";
  // Past the commit point: the classic one was saved (every engine held v's weights and label), or a staged update's
  // engine holds v's label (it switched and was post-processed; CommitStaged commits on such an engine), whether the
  // staged commit point was saved (before its first Continue) or the engine says so.
  bool labelled = false;
  for (const auto& [a, w] : words) labelled = labelled || (w.ok() && w->weight_version() == version);
  const bool committed = rec.committed_unix_ms() > 0 || (staged && s.switch_started() && labelled);
  if (committed) not_resumed_.clear();
  for (const auto& [a, w] : words) {
    const RestoredEngine r = RestoredEngineOf(w, engine_version_[a], version, committed);
    const std::string id = EngineIdLocked(a);
    spdlog::info(
        "update {}: engine {} {}", v, id,
        w.ok()
            ? absl::StrCat("says it holds version '", w->weight_version(), "', ", w->paused() ? "paused" : "not paused")
            : absl::StrCat("did not answer (", w.status().ToString(), "): reported ", EngineStateName(r.view)));
    engine_state_[a] = r.view;
    if (r.label.empty())
      engine_version_.erase(a);
    else
      engine_version_[a] = r.label;
    if (!r.stale.empty()) {
      engine_stale_[a] = r.stale;
    } else if (committed && r.label == version) {
      engine_stale_.erase(a);  // on the fleet's version
    }
    engine_staged_.erase(a);
    if (!committed) continue;
    if (r.not_resumed) {
      not_resumed_.insert(id);
      rec.add_not_resumed(id);
    }
    if (staged && r.label == version) rec.add_switched(id);
    if (!r.stale.empty()) rec.add_stale(absl::StrCat(id, ": ", r.stale));
  }
  if (rec.started_unix_ms() > 0)
    rec.set_total_seconds(absl::ToDoubleSeconds(absl::Now() - absl::FromUnixMillis(rec.started_unix_ms())));
  open_version_ = v;  // Finish closes it
  if (committed) {
    // Every engine on v holds its weights and label; those not seen serving stay paused at v until resumed.
    rec.set_success(true);
    v1::CommitUpdateReply reply;
    *reply.mutable_record() = rec;
    state_ = UpdateState::kCommitting;
    const absl::Status result =
        not_resumed_.empty() ? absl::OkStatus()
                             : NotResumedError(v, static_cast<size_t>(rec.engines()),
                                               absl::UnavailableError("the coordinator restarted during its commit"));
    Finish(v, Outcome{result, reply}, rec);
    spdlog::warn(
        "update {} had passed its commit point when the previous coordinator stopped: recorded as committed, {} "
        "engines not resumed",
        v, not_resumed_.size());
    return -1;
  }
  // Failed. Its bytes may be in the engines it paused; they stay paused. A staged update that had not begun to
  // switch wrote only staging memory: it is abandoned and every engine serves on at the version it served (the next
  // staged update writes every byte of the staging copies again).
  const bool untouched = staged && !s.switch_started();
  rec.set_success(false);
  rec.set_error(absl::StrCat("ABORTED: update ", v,
                             " failed: the coordinator restarted during it (or its leader failed over; state ",
                             s.state(),
                             untouched ? "); abandoned before its switch: engines serve on at their version"
                                       : "); the engines it paused stay paused until a successful update"));
  if (!untouched) engines_dirty_ = true;
  state_ = UpdateState::kAborting;  // ended by the restart
  Finish(v, Outcome{absl::AbortedError(rec.error()), v1::CommitUpdateReply()}, rec);
  spdlog::warn("update {} was open ({}) when the previous coordinator stopped: recorded as failed", v, s.state());
  return v;
}

absl::StatusOr<v1::RemoveNodeReply> Coordinator::RemoveNode(const v1::RemoveNodeRequest& req) {
  MutexLock l(&mu_);
  auto it = nodes_.find(req.node_id());
  if (it == nodes_.end()) return absl::NotFoundError(absl::StrCat("no node ", req.node_id(), " is registered"));
  if (UpdateInProgress())
    return absl::FailedPreconditionError(absl::StrCat("cannot remove node ", req.node_id(), ": update ", open_version_,
                                                      " is ", StateName(), "; remove it between updates"));
  v1::RemoveNodeReply out;
  for (const auto& e : it->second.engines()) {
    out.add_engines(e.engine_id());
    engine_state_.erase(e.control_address());
    engine_version_.erase(e.control_address());
    drained_engines_.erase(e.engine_id());
    not_resumed_.erase(e.engine_id());  // nothing left to resume
    engine_digests_.erase(e.engine_id());
  }
  nodes_.erase(it);
  {
    MutexLock ll(&lease_mu_);
    leases_.erase(req.node_id());
  }
  lapsed_nodes_.erase(req.node_id());
  configured_.erase(req.node_id());
  drained_nodes_.erase(req.node_id());
  ++membership_epoch_;
  out.set_membership_epoch(membership_epoch_);
  Persist();
  spdlog::warn("node {} removed by the operator ({} engines); membership epoch {}", req.node_id(), out.engines_size(),
               membership_epoch_);
  return out;
}

absl::StatusOr<v1::DrainReply> Coordinator::Drain(const v1::DrainRequest& req, bool drain) {
  const char* verb = drain ? "drain" : "undrain";
  if (req.engine_id().empty() == req.node_id().empty())
    return absl::InvalidArgumentError(absl::StrCat("give exactly one of an engine id and a node id to ", verb));
  const std::string what =
      req.engine_id().empty() ? absl::StrCat("node ", req.node_id()) : absl::StrCat("engine ", req.engine_id());
  MutexLock l(&mu_);
  if (UpdateInProgress())
    return absl::FailedPreconditionError(absl::StrCat("cannot ", verb, " ", what, ": update ", open_version_, " is ",
                                                      StateName(), "; ", verb, " between updates"));
  v1::DrainReply out;
  bool changed = false;
  if (!req.engine_id().empty()) {
    std::string node_id;
    for (const auto& [id, n] : nodes_)
      for (const auto& e : n.engines())
        if (e.engine_id() == req.engine_id()) node_id = id;
    if (node_id.empty()) return absl::NotFoundError(absl::StrCat("no engine ", req.engine_id(), " is registered"));
    if (!drain && drained_nodes_.count(node_id))
      return absl::FailedPreconditionError(
          absl::StrCat("engine ", req.engine_id(), " is drained with its node ", node_id, ": undrain the node"));
    changed = drain ? drained_engines_.insert(req.engine_id()).second : drained_engines_.erase(req.engine_id()) > 0;
    if (changed) out.add_engines(req.engine_id());
  } else {
    auto it = nodes_.find(req.node_id());
    if (it == nodes_.end()) return absl::NotFoundError(absl::StrCat("no node ", req.node_id(), " is registered"));
    if (drain && it->second.role() == "source" && !drained_nodes_.count(req.node_id())) {
      // Only if the other source nodes can still push every tensor: try the plan without it.
      drained_nodes_.insert(req.node_id());
      absl::Status can = SourcesForPlan().status();
      if (can.ok() && !model_config_json_.empty() && !plan_.empty()) can = Replan(/*dry_run=*/true);
      if (!can.ok()) {
        drained_nodes_.erase(req.node_id());
        return absl::FailedPreconditionError(absl::StrCat("cannot drain source node ", req.node_id(),
                                                          ": the plan cannot cover without it: ", can.message()));
      }
      changed = true;
    } else {
      changed = drain ? drained_nodes_.insert(req.node_id()).second : drained_nodes_.erase(req.node_id()) > 0;
    }
    if (it->second.role() == "target") {
      for (const auto& e : it->second.engines()) {
        // Undraining a node also undrains engines drained one by one on it.
        if (!drain) changed |= drained_engines_.erase(e.engine_id()) > 0;
        if (changed) out.add_engines(e.engine_id());
      }
    }
  }
  if (changed) {
    ++membership_epoch_;  // the next update re-plans: the affected group only
    Persist();
    spdlog::warn("{} {} by the operator; membership epoch {}", what, drain ? "drained" : "undrained",
                 membership_epoch_);
  }
  out.set_membership_epoch(membership_epoch_);
  return out;
}

void Coordinator::StampLease(const std::string& id, const std::string& address, absl::Time at) {
  MutexLock l(&lease_mu_);
  leases_[id] = Lease{address, at};
}

absl::Time Coordinator::LastHeartbeat(const std::string& id) const {
  MutexLock l(&lease_mu_);
  auto it = leases_.find(id);
  return it == leases_.end() ? absl::InfinitePast() : it->second.last;
}

std::set<std::string> Coordinator::LapsedNodes(absl::Time now) const {
  std::set<std::string> out;
  if (!leases_enforced_) return out;
  const absl::Duration limit = absl::Seconds(3 * opts_.heartbeat_seconds);
  for (const auto& [id, n] : nodes_)
    if (!drained_nodes_.count(id) && now - LastHeartbeat(id) > limit) out.insert(id);
  return out;
}

v1::HeartbeatReply Coordinator::Heartbeat(const v1::HeartbeatRequest& req) {
  // Stamped on arrival, before mu_ (which a slow store write may hold): the lease is renewed whatever that costs.
  const absl::Time arrived = absl::Now();
  {
    MutexLock ll(&lease_mu_);
    auto lease = leases_.find(req.node_id());
    if (lease != leases_.end() && lease->second.address == req.address()) lease->second.last = arrived;
  }
  MutexLock l(&mu_);
  v1::HeartbeatReply out;
  out.set_interval_seconds(opts_.heartbeat_seconds);
  out.set_membership_epoch(membership_epoch_);
  auto it = nodes_.find(req.node_id());
  out.set_known(it != nodes_.end() && it->second.address() == req.address());
  if (!out.known()) return out;
  // A source that does not hold the configuration planned for it (it lost or never applied a ConfigureSource) is
  // configured again at the next update. Not while one begins: its configure may be in flight, the report older.
  auto c = configured_.find(req.node_id());
  if (req.plan_epoch() != 0 && it->second.role() == "source" && state_ != UpdateState::kBeginning &&
      c != configured_.end() && (req.plan_epoch() != c->second.epoch || req.config_digest() != c->second.digest)) {
    spdlog::warn(
        "source {} holds plan {} (configuration {}), not plan {} ({}) as planned: it is configured again at "
        "the next update",
        req.node_id(), req.plan_epoch(), req.config_digest().empty() ? "none" : req.config_digest(), c->second.epoch,
        c->second.digest);
    configured_.erase(c);
    NoteChange();
  }
  return out;
}

absl::StatusOr<v1::ResumeEnginesReply> Coordinator::ResumeEngines(const v1::ResumeEnginesRequest&) {
  std::vector<std::string> engines;
  v1::ResumeEnginesReply out;
  {
    MutexLock l(&mu_);
    if (UpdateInProgress())
      return absl::FailedPreconditionError(
          absl::StrCat("cannot resume engines: update ", open_version_, " is ", StateName()));
    if (engines_dirty_)
      return absl::FailedPreconditionError(
          "cannot resume engines: a failed or aborted update may have written into them, so they may hold mixed "
          "weights; they resume with the next successful update");
    for (const auto& [id, n] : nodes_)
      for (const auto& e : n.engines()) {
        if (EngineDrained(id, e.engine_id())) continue;  // never resumed by wsync while drained
        // Held paused past a staged switch (stale and failed): it holds weights its label does not say.
        auto es = engine_state_.find(e.control_address());
        if (engine_stale_.count(e.control_address()) && es != engine_state_.end() &&
            es->second.state == EngineState::kFailed) {
          out.add_held(e.engine_id());
          continue;
        }
        engines.push_back(e.control_address());
        out.add_engines(e.engine_id());
      }
    out.set_version(current_version_ >= 0 ? std::to_string(current_version_) : std::string());
  }
  FanoutOptions phase;
  phase.max_parallel = opts_.fanout_parallel;
  phase.deadline = absl::Seconds(PeerDeadlines::kContinue);
  phase.phase = "resume";
  std::vector<std::string> failed;
  absl::Status st = ContinueEngines(engines, phase, &failed);
  {
    // Past a commit point: the engines not resumed then are now (the committed update's record says so).
    MutexLock l(&mu_);
    MarkResumed(engines, failed, st);
  }
  if (!st.ok()) return st;
  spdlog::info("engines resumed at version {} by the operator", out.version());
  return out;
}

v1::ClusterStatus Coordinator::Status() const {
  return StatusOf(*model_.Get(), /*with_plan=*/true, HeartbeatAgoFn(), opts_.heartbeat_seconds);
}

v1::EngineStates Coordinator::EngineStates() const {
  return EngineStatesOf(StatusOf(*model_.Get(), /*with_plan=*/false, HeartbeatAgoFn(), opts_.heartbeat_seconds));
}

HeartbeatAgo Coordinator::HeartbeatAgoFn() const {
  return [this, now = absl::Now()](const std::string& id) {
    const absl::Time hb = LastHeartbeat(id);
    // A heartbeat stamped after `now` (it arrived while the status was being built) is 0 s ago, not negative: a
    // negative age read as "never heard from" and a heartbeating node was reported unreachable (seen once in
    // daemon_etcd_raft_stop_test's 500 probes).
    return hb == absl::InfinitePast() ? -1.0 : std::max(0.0, absl::ToDoubleSeconds(now - hb));
  };
}

std::shared_ptr<const v1::ClusterStatus> Coordinator::LayoutOf() const {
  auto s = std::make_shared<v1::ClusterStatus>();
  for (const auto& [id, n] : nodes_) {
    auto* ni = s->add_nodes();
    ni->set_node_id(id);
    ni->set_role(n.role());
    ni->set_address(n.address());
    ni->set_transport(n.transport());
    for (const auto& e : n.engines()) {
      ni->add_engines(e.engine_id());
      auto* d = ni->add_engine_details();
      d->set_engine_id(e.engine_id());
      d->set_kind(e.kind());
      d->set_address(e.control_address());
      d->set_ranks(e.ranks_size());
      d->set_staging(e.ranks_size() > 0 && (e.ranks(0).staging_segment_shift() > 0 || e.ranks(0).stages_in_place()));
    }
  }
  for (const auto& p : plan_) {
    auto* t = s->add_plan();
    t->set_source_node(p.source);
    t->set_engine_id(p.assignment->engine_id());
    t->set_rank(p.assignment->rank());
    t->set_bytes(p.bytes);
    t->set_plan_epoch(p.epoch);
  }
  for (const auto& [key, g] : groups_) {
    auto* gp = s->add_groups();
    gp->set_key(key);
    gp->set_plan_epoch(g.epoch);
    for (const auto& e : g.engine_ids) gp->add_engines(e);
  }
  return s;
}

std::map<std::string, ClusterModel::Engine> Coordinator::EnginesOf() const {
  std::map<std::string, ClusterModel::Engine> out;
  for (const auto& [id, n] : nodes_)
    for (const auto& e : n.engines()) {
      const std::string& a = e.control_address();
      ClusterModel::Engine& m = out[a];
      auto it = engine_state_.find(a);
      m.state = EngineStateName(it == engine_state_.end() ? EngineView() : it->second);
      if (auto ver = engine_version_.find(a); ver != engine_version_.end()) m.weight_version = ver->second;
      if (auto sv = engine_staged_.find(a); sv != engine_staged_.end()) m.staged_version = sv->second;
      m.stale = engine_stale_.count(a) > 0;
      if (m.stale && m.state == "serving") m.state = "stale";  // serving, an older version than current
      if (EngineDrained(id, e.engine_id())) {
        m.drained = true;
        m.state = "drained";
      }
    }
  return out;
}

v1::ClusterStatus Coordinator::SummaryOf() const {
  v1::ClusterStatus s;
  s.set_membership_epoch(membership_epoch_);
  s.set_plan_epoch(plan_epoch_);
  s.set_current_version(current_version_ >= 0 ? std::to_string(current_version_) : std::string());
  s.set_state(StateName());
  s.set_engines_hold_partial_writes(engines_dirty_);
  s.set_open_version(state_ == UpdateState::kIdle || state_ == UpdateState::kFailed ? -1 : open_version_);
  const bool failed = state_ == UpdateState::kFailed && !history_.empty() && !history_.back().success();
  s.set_failed_version(failed ? history_.back().version() : -1);
  if (failed) s.set_failure(history_.back().error());
  for (const auto& id : not_resumed_) s.add_not_resumed(id);
  for (const auto& [id, c] : configured_) (*s.mutable_source_plan_epochs())[id] = c.epoch;
  for (const auto& n : drained_nodes_) s.add_drained_nodes(n);
  return s;
}

void Coordinator::Publish() {
  auto m = std::make_shared<ClusterModel>();
  m->generation = ++model_generation_;
  const std::pair<int64_t, int64_t> key(membership_epoch_, plan_generation_);
  if (layout_ == nullptr || layout_key_ != key) {
    layout_ = LayoutOf();
    layout_key_ = key;
  }
  m->layout = layout_;
  m->engines = EnginesOf();
  m->summary = SummaryOf();
  if (history_model_ == nullptr || !model_history_dirty_.empty()) {
    // Records added or rewritten are copied once; the others are shared with the previous model.
    for (int64_t v : model_history_dirty_)
      for (auto r = history_.rbegin(); r != history_.rend(); ++r)
        if (r->version() == v) {
          history_shared_[v] = std::make_shared<const v1::UpdateRecord>(*r);
          break;
        }
    model_history_dirty_.clear();
    if (history_.empty()) {
      history_shared_.clear();
    } else {
      history_shared_.erase(history_shared_.begin(), history_shared_.lower_bound(history_.front().version()));
    }
    auto records = std::make_shared<ClusterModel::Records>();
    records->reserve(history_shared_.size());
    for (const auto& [v, r] : history_shared_) records->push_back(r);
    history_model_ = std::move(records);
  }
  m->history = history_model_;
  model_.Set(std::move(m));
}

absl::Status Coordinator::CheckModelForTest() const {
  MutexLock l(&mu_);
  ClusterModel fresh;
  fresh.layout = LayoutOf();
  fresh.engines = EnginesOf();
  fresh.summary = SummaryOf();
  auto records = std::make_shared<ClusterModel::Records>();
  for (const auto& r : history_) records->push_back(std::make_shared<const v1::UpdateRecord>(r));
  fresh.history = std::move(records);
  const std::shared_ptr<const ClusterModel> published = model_.Get();
  const HeartbeatAgo no_lease = [](const std::string&) { return -1.0; };
  const v1::ClusterStatus want = StatusOf(fresh, true, no_lease, opts_.heartbeat_seconds);
  const v1::ClusterStatus have = StatusOf(*published, true, no_lease, opts_.heartbeat_seconds);
  google::protobuf::util::MessageDifferencer diff;
  std::string differences;
  diff.ReportDifferencesToString(&differences);
  if (!diff.Compare(have, want))
    return absl::InternalError(
        absl::StrCat("the published status is not the coordinator's state (published → state): ", differences));
  if (!google::protobuf::util::MessageDifferencer::Equals(HistoryOf(fresh, 0), HistoryOf(*published, 0)))
    return absl::InternalError(absl::StrCat("the published history (", published->history->size(),
                                            " records) is not the coordinator's (", history_.size(), ")"));
  return absl::OkStatus();
}

void Coordinator::HoldLockForTest(const std::function<void()>& fn) {
  MutexLock l(&mu_);
  fn();
}

absl::StatusOr<std::vector<std::string>> Coordinator::StagingEngines(const std::vector<std::string>& engines,
                                                                     bool staged) const {
  std::vector<std::string> out;
  for (const auto& [id, n] : nodes_)
    for (const auto& e : n.engines()) {
      if (std::find(engines.begin(), engines.end(), e.control_address()) == engines.end()) continue;
      if (e.ranks_size() > 0 && e.ranks(0).staging_segment_shift() > 0) {
        out.push_back(e.control_address());
      } else if (staged && !(e.ranks_size() > 0 && e.ranks(0).stages_in_place())) {
        // An engine staging in place (vLLM) is written as it is: no live copy to pick, nothing to re-configure.
        return absl::FailedPreconditionError(
            absl::StrCat("engine ", e.engine_id(), " (", e.kind(), ", node ", id,
                         ") offers no staging memory; use mode classic or start it with --staging"));
      }
    }
  return out;
}

absl::Status Coordinator::LiveSets(const std::vector<std::string>& engines, std::map<std::string, int>* out) {
  std::mutex m;
  return ForAll(
      engines,
      [&](const std::string& a) {
        auto info = Remote(a, [&] { return peers_->EngineInfo(a); });
        if (!info.ok()) return Annotate(info.status(), "engine info from " + EngineLabel(a));
        std::lock_guard<std::mutex> l(m);
        (*out)[a] = info->live_set() == 1 ? 1 : 0;
        return absl::OkStatus();
      },
      UpdatePhase(UpdateMode::kStaged, Phase::kEngineInfo, engines));
}

int Coordinator::LayoutCopy(const std::string& engine_id, bool staged,
                            const std::map<std::string, int>& live_sets) const {
  for (const auto& [id, n] : nodes_)
    for (const auto& e : n.engines()) {
      if (e.engine_id() != engine_id) continue;
      auto it = live_sets.find(e.control_address());
      if (it == live_sets.end()) return -1;  // no staging memory: one copy
      return staged ? 1 - it->second : it->second;
    }
  return -1;
}

std::string Coordinator::SourceConfigKey(const v1::ConfigureSourceRequest& base,
                                         const std::vector<const Planned*>& assigned) const {
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream sos(&bytes);
    google::protobuf::io::CodedOutputStream cos(&sos);
    cos.SetSerializationDeterministic(true);
    base.SerializeToCodedStream(&cos);
  }
  // Each assignment by its digest (computed when the plan was built), its engine's registration by its digest.
  for (size_t k = 0; k < assigned.size(); ++k) {
    const Planned& p = *assigned[k];
    const std::string& engine = p.assignment->engine_id();
    auto d = engine_digests_.find(engine);
    absl::StrAppend(&bytes, "\n", p.digest.empty() ? AssignmentDigest(*p.assignment) : p.digest, " ", engine, " ",
                    d == engine_digests_.end() ? "?" : d->second);
  }
  const XXH128_hash_t h = XXH3_128bits(bytes.data(), bytes.size());
  return absl::StrFormat("%016x%016x", h.high64, h.low64);
}

std::map<std::string, std::vector<std::string>> Coordinator::StageVerify(int64_t v,
                                                                         const std::vector<std::string>& engines,
                                                                         std::map<std::string, std::string>* left_out) {
  struct Reg {
    std::string id;
    std::vector<uint64_t> rank_bytes;  // per rank: its parameters' bytes
  };
  std::vector<std::string> sources;
  std::map<std::string, Reg> regs;  // control address → registration
  {
    MutexLock l(&mu_);
    for (const auto& [id, n] : nodes_) {
      if (n.role() == "source") sources.push_back(n.address());
      for (const auto& e : n.engines()) {
        Reg& r = regs[e.control_address()];
        r.id = e.engine_id();
        for (const auto& rank : e.ranks()) {
          uint64_t b = 0;
          for (const auto& p : rank.params()) b += p.bytes();
          r.rank_bytes.push_back(b);
        }
      }
    }
  }
  std::map<std::pair<std::string, int>, std::vector<v1::WriteChecksum>> wrote;  // (engine id, rank) → ranges
  std::mutex m;
  // The verify row's deadline bounds each of its two fan-outs: the sources' records, then every engine rank at once
  // (ranks asked one by one took ranks × the deadline).
  absl::Status st = ForAll(
      sources,
      [&](const std::string& a) {
        auto r = Remote(a, [&] { return peers_->WriteChecksums(a, v); });
        if (!r.ok()) return Annotate(r.status(), "write checksums of source " + NodeLabel(a));
        if (r->version() != v || !r->finished())
          return absl::FailedPreconditionError(
              absl::StrCat("source ", NodeLabel(a), " has no finished record of update ", v, " (it answered for ",
                           r->version(), r->finished() ? ")" : ", unfinished)"));
        std::lock_guard<std::mutex> l(m);
        for (const auto& w : r->writes()) wrote[{w.engine_id(), w.rank()}].push_back(w);
        return absl::OkStatus();
      },
      UpdatePhase(UpdateMode::kStaged, Phase::kVerify, sources));
  std::map<std::string, std::vector<std::string>> verified;
  if (!st.ok()) {
    for (const auto& a : engines) (*left_out)[a] = absl::StrCat("not verified: ", st.ToString());
    return verified;
  }
  struct RankItem {
    std::string engine;  // control address
    int rank;
  };
  std::vector<RankItem> items;
  std::vector<std::string> item_addrs;
  std::map<std::string, std::vector<std::string>> digests;  // control address → per rank
  for (const auto& a : engines) {
    const Reg& reg = regs.at(a);  // every engine of the update is registered (filled above)
    digests[a].resize(reg.rank_bytes.size());
    for (int rank = 0; rank < static_cast<int>(reg.rank_bytes.size()); ++rank) {
      items.push_back({a, rank});
      item_addrs.push_back(a);
    }
  }
  const std::vector<absl::Status> per_rank = RunFanout(
      items.size(),
      [&](size_t i) {
        const std::string& a = items[i].engine;
        const int rank = items[i].rank;
        const Reg& reg = regs.at(a);
        static const std::vector<v1::WriteChecksum> kNone;
        auto w = wrote.find({reg.id, rank});
        const std::vector<v1::WriteChecksum>& ws = w == wrote.end() ? kNone : w->second;
        v1::RankRequest req;
        req.set_rank(rank);
        req.set_staging(true);
        for (const auto& c : ws) {
          auto* r = req.add_ranges();
          r->set_param(c.param());
          r->set_offset(c.offset());
          r->set_length(c.length());
        }
        auto have = Remote(a, [&] { return peers_->EngineChecksums(a, req); });
        absl::Status rs = have.ok() ? CompareStaged(rank, reg.rank_bytes[rank], ws, *have) : have.status();
        if (rs.ok()) {
          std::lock_guard<std::mutex> l(m);
          digests[a][rank] = have->staging_digest();
        }
        return rs;
      },
      UpdatePhase(UpdateMode::kStaged, Phase::kVerify, item_addrs));
  std::map<std::string, absl::Status> first_error;  // control address → its first failed rank's
  for (size_t i = 0; i < items.size(); ++i)
    if (!per_rank[i].ok()) first_error.emplace(items[i].engine, per_rank[i]);
  for (const auto& a : engines) {
    auto e = first_error.find(a);
    if (e == first_error.end()) {
      verified[a] = std::move(digests[a]);
    } else {
      (*left_out)[a] = absl::StrCat("staging not verified: ", e->second.ToString());
      spdlog::warn("update {}: {} left out: {}", v, EngineLabel(a), (*left_out)[a]);
    }
  }
  return verified;  // every engine's outcome is in `verified` or `left_out`
}

absl::StatusOr<v1::CommitUpdateReply> Coordinator::CommitStaged(UpdateDriver& driver, v1::UpdateRecord& rec,
                                                                const std::vector<std::string>& engines,
                                                                absl::Time start) {
  const int64_t v = rec.version();
  const std::string version = std::to_string(v);
  std::map<std::string, std::string> left_out;               // before their switch: continued at the old version
  std::map<std::string, std::vector<std::string>> verified;  // control address → its ranks' staging digests
  std::map<std::string, std::string> ids;                    // control address → engine id
  SwitchResult sw;
  std::vector<std::string> prepared, paused, switched, processed, labelled;
  // An engine failing its call at a row is handled as that row's policy says, handed to the step by the driver: left
  // out (its old version continued, stale), held paused past its switch, or on v and not resumed.
  auto failed_at = [&](OnFailure policy, const std::string& a, const std::string& why) {
    switch (policy) {
      case OnFailure::kHoldPaused:
        sw.held[a] = why;
        break;
      case OnFailure::kCommittedNotResumed:
        sw.not_resumed[a] = why;
        break;
      default:
        left_out[a] = why;
        break;
    }
  };
  // Calls `call` on every engine of `in` at once; those it answers OK go to `passed`, the others to failed_at. Each
  // with the phase's row (its deadline; an abort cuts it short only before the switch), a call still running at the
  // deadline failing as the row says.
  auto each = [&](Phase phase, OnFailure policy, const std::vector<std::string>& in, std::vector<std::string>* passed,
                  auto call) {
    const std::vector<absl::Status> st = RunFanout(
        in.size(), [&](size_t i) { return call(in[i]); }, UpdatePhase(UpdateMode::kStaged, phase, in));
    for (size_t i = 0; i < in.size(); ++i)
      if (st[i].ok())
        passed->push_back(in[i]);
      else
        failed_at(policy, in[i], st[i].ToString());
  };
  auto switch_request = [&](const std::string& a) {
    v1::SwitchRequest req;
    req.set_version(version);
    for (const auto& d : verified.at(a)) req.add_staging_digests(d);
    return req;
  };
  // Paused engines left out so far serve their old version again (called directly: an abort must not keep them
  // paused). Run after the switch, and once more at the end for engines a later phase left out.
  std::set<std::string> continued_old;
  auto resume_left_out = [&] {
    std::vector<std::string> resume;
    for (const auto& a : paused)
      if (left_out.count(a) && continued_old.insert(a).second) resume.push_back(a);
    ForAll(resume, [&](const std::string& a) {
      return Track(a, EngineState::kServing, "continue", Annotate(peers_->Continue(a), "continue " + EngineLabel(a)));
    }).IgnoreError();
  };
  // The rows from verify to continue. An abort before the verify ended fails the run at the verify row (engines
  // serve on); from then on (switch_started_) it acts per engine: its calls are refused and the engine is left out.
  driver.Bind(Phase::kVerify, [&](OnFailure policy) {
    const absl::Time t = absl::Now();
    std::map<std::string, std::string> not_verified;
    verified = StageVerify(v, engines, &not_verified);
    for (const auto& [a, why] : not_verified) failed_at(policy, a, why);
    AddPhase(&rec, "verify", t);
    if (AbortAsked()) return absl::CancelledError("no engine was switched");
    MutexLock l(&mu_);
    for (const auto& [id, n] : nodes_)
      for (const auto& e : n.engines()) ids[e.control_address()] = e.engine_id();
    for (const auto& [a, d] : verified) engine_staged_[a] = version;
    switch_started_ = !verified.empty();
    Persist();
    return absl::OkStatus();
  });
  // The re-hash of the staging memory runs here, while the engines serve, not in the paused window: every source's
  // write window closed before the verify, so no peer can write it any more; the prepare catches a change made on the
  // engine's host since the verify (the engine left out, never paused) and arms the switch below.
  driver.Bind(Phase::kPrepareSwitch, [&](OnFailure policy) {
    if (verified.empty()) return absl::OkStatus();
    std::vector<std::string> all;
    for (const auto& [a, d] : verified) all.push_back(a);
    const absl::Time t = absl::Now();
    each(Phase::kPrepareSwitch, policy, all, &prepared, [&](const std::string& a) {
      absl::Status st = Annotate(Remote(a, [&] { return peers_->PrepareSwitch(a, switch_request(a)); }),
                                 "switch " + EngineLabel(a) + " (prepare)");
      if (st.code() == absl::StatusCode::kUnimplemented) {
        // An engine from before PrepareSwitch: its Switch re-hashes inside the paused window, as it always did.
        spdlog::info("update {}: {} has no PrepareSwitch; its switch re-hashes while paused", v, EngineLabel(a));
        return absl::OkStatus();
      }
      return st;
    });
    AddPhase(&rec, "prepare", t);
    // Recorded paused before they are, so that no store write lies inside the paused window: a coordinator that stops
    // from here on restarts with the switch begun (switch_started), engines held paused until an update succeeds.
    MutexLock l(&mu_);
    for (const auto& a : prepared) engine_state_[a] = EngineView{EngineState::kPaused, ""};
    Persist();
    return absl::OkStatus();
  });
  driver.Bind(Phase::kSwitchPause, [&](OnFailure policy) {
    if (verified.empty()) return absl::OkStatus();
    const absl::Time t = absl::Now();
    // The update's pause mode (BeginUpdate), as a classic update pauses with it: in_place keeps running requests and
    // their KV (a record of an older coordinator has none: retract).
    const std::string pause_mode = rec.pause_mode().empty() ? "retract" : rec.pause_mode();
    each(Phase::kSwitchPause, policy, prepared, &paused, [&](const std::string& a) {
      return Track(a, EngineState::kPaused, "pause",
                   Annotate(Remote(a, [&] { return peers_->Pause(a, pause_mode); }), "pause " + EngineLabel(a)));
    });
    AddPhase(&rec, "pause", t);
    return absl::OkStatus();
  });
  // The barrier: no engine switches before every engine was verified and paused.
  driver.Bind(Phase::kSwitch, [&](OnFailure policy) {
    if (verified.empty()) return absl::OkStatus();
    const absl::Time t = absl::Now();
    each(Phase::kSwitch, policy, paused, &switched, [&](const std::string& a) {
      return Annotate(Remote(a, [&] { return peers_->Switch(a, switch_request(a)); }), "switch " + EngineLabel(a));
    });
    AddPhase(&rec, "switch", t);
    resume_left_out();
    if (switched.empty()) SaveEngineStates();  // else saved after the switched engines continue, outside their pause
    return absl::OkStatus();
  });
  // Past its switch an engine serves v's weights: each row from here runs on the engines that passed the one before,
  // and an engine failing one is handled as its row says (never labelled or continued as what it is not).
  driver.Bind(Phase::kPostProcess, [&](OnFailure policy) {
    if (switched.empty()) return absl::OkStatus();
    const absl::Time t = absl::Now();
    each(Phase::kPostProcess, policy, switched, &processed, [&](const std::string& a) {
      return Track(
          a, std::nullopt, "post_process",
          Annotate(Remote(a, [&] { return peers_->PostProcess(a, version); }), "post_process " + EngineLabel(a)));
    });
    AddPhase(&rec, "post_process", t);
    return absl::OkStatus();
  });
  driver.Bind(Phase::kSetVersion, [&](OnFailure policy) {
    if (switched.empty()) return absl::OkStatus();
    const absl::Time t = absl::Now();
    each(Phase::kSetVersion, policy, processed, &labelled, [&](const std::string& a) {
      absl::Status r = Track(
          a, std::nullopt, "set_version",
          Annotate(Remote(a, [&] { return peers_->SetWeightVersion(a, version); }), "set_version " + EngineLabel(a)));
      if (r.ok()) {
        MutexLock l(&mu_);
        engine_version_[a] = version;
        NoteChange();  // the label is in Status as soon as the engine holds it
      }
      return r;
    });
    AddPhase(&rec, "set_version", t);
    // The staged commit point: an engine holds v's weights and label, so the update commits whatever a Continue
    // answers. Saved with the labels before the first Continue, as the classic one, so that a successor knows it too
    // (waited for without the lock).
    if (!labelled.empty()) {
      {
        MutexLock l(&mu_);
        rec.set_committed_unix_ms(absl::ToUnixMillis(absl::Now()));
        run_.record = rec;
        Persist();
      }
      Durable().IgnoreError();
    }
    return absl::OkStatus();
  });
  driver.Bind(Phase::kContinue, [&](OnFailure policy) {
    if (switched.empty()) return absl::OkStatus();
    const absl::Time t = absl::Now();
    each(Phase::kContinue, policy, labelled, &sw.serving, [&](const std::string& a) {
      return Track(a, EngineState::kServing, "continue", Annotate(peers_->Continue(a), "continue " + EngineLabel(a)));
    });
    resume_left_out();
    SaveEngineStates();
    AddPhase(&rec, "continue", t);
    std::sort(sw.serving.begin(), sw.serving.end());
    return absl::OkStatus();
  });
  if (absl::Status walked = driver.Walk(Phase::kVerify, Phase::kContinue); !walked.ok()) return walked;
  std::vector<std::string> stale, held;
  const bool on_v = !sw.serving.empty() || !sw.not_resumed.empty();  // engines holding v's weights and label
  {
    MutexLock l(&mu_);
    switch_started_ = false;
    for (const auto& [a, why] : left_out) {
      engine_stale_[a] = why;
      engine_staged_.erase(a);
      stale.push_back(absl::StrCat(ids[a], ": ", why));
    }
    // Held past their switch: v's weights without the phase's effect, labelled as before, paused. Stale (not what
    // the fleet serves) until an update succeeds on them; ResumeEngines leaves them paused.
    for (const auto& [a, why] : sw.held) {
      engine_stale_[a] = absl::StrCat("held paused after its switch to ", v, ": ", why);
      engine_staged_.erase(a);
      held.push_back(absl::StrCat(ids[a], ": held paused after its switch: ", why));
    }
    std::vector<std::string> on_version = sw.serving;
    for (const auto& [a, why] : sw.not_resumed) on_version.push_back(a);
    for (const auto& a : on_version) {
      engine_stale_.erase(a);
      engine_staged_.erase(a);
      rec.add_switched(ids[a]);
    }
    for (const auto& x : stale) rec.add_stale(x);
    for (const auto& x : held) rec.add_stale(x);
    if (on_v) {
      not_resumed_.clear();
      for (const auto& [a, why] : sw.not_resumed) {
        not_resumed_.insert(ids[a]);
        rec.add_not_resumed(ids[a]);
      }
    }
  }
  if (!on_v) {
    std::vector<std::string> all = stale;
    all.insert(all.end(), held.begin(), held.end());
    // Engines held past their switch hold v's weights, paused: they stay paused until an update succeeds.
    return Fail(
        rec, absl::FailedPreconditionError(absl::StrCat("no engine switched to ", v, ": ", absl::StrJoin(all, "; "))),
        /*may_have_written=*/!held.empty());
  }
  rec.set_success(true);
  rec.set_total_seconds(absl::ToDoubleSeconds(absl::Now() - start));
  v1::CommitUpdateReply out;
  *out.mutable_record() = rec;
  MutexLock l(&mu_);
  absl::Status result = absl::OkStatus();
  if (!not_resumed_.empty())
    result = NotResumedError(v, engines.size(), absl::UnavailableError(sw.not_resumed.begin()->second));
  if (!held.empty())
    result = absl::UnavailableError(absl::StrCat(
        result.ok() ? absl::StrCat("update ", v, " committed: the fleet is on version ", v) : result.message(), "; ",
        held.size(), " engines held paused after their switch (", absl::StrJoin(held, "; "),
        "): they serve nothing until an update succeeds on them"));
  Finish(v, Outcome{result, out}, rec);
  spdlog::info("update {} committed (staged): {} engines switched, {} left out (stale), {} held paused in {:.3f}s", v,
               rec.switched_size(), stale.size(), held.size(), rec.total_seconds());
  if (!result.ok()) return result;
  return out;
}

v1::EngineStates EngineStatesOf(const v1::ClusterStatus& status) {
  v1::EngineStates out;
  out.set_current_version(status.current_version());
  for (const auto& n : status.nodes())
    for (const auto& e : n.engine_details()) {
      auto* s = out.add_engines();
      s->set_engine_id(e.engine_id());
      s->set_node_id(n.node_id());
      s->set_address(e.address());
      s->set_weight_version(e.weight_version());
      s->set_staged_version(e.staged_version());
      s->set_stale(e.stale());
      s->set_state(e.state());
      s->set_paused(e.state() == "paused" || absl::StartsWith(e.state(), "failed"));
      s->set_ready(!e.stale() && !e.drained() && e.state() == "serving" &&
                   e.weight_version() == status.current_version());
    }
  return out;
}

v1::HistoryReply Coordinator::History(const v1::HistoryRequest& req) const {
  return HistoryOf(*model_.Get(), req.limit());
}

}  // namespace wsync::daemon
