#pragma once
// The coordinator: membership (source and target daemons with their engines), the transfer plan, and the update
// lifecycle on every engine (pause → configure when membership changed → push → post-process → set version →
// continue), with per-phase timings kept in a bounded history.
//
// Peers are reached through the injected `Peers` interface so the logic can be tested without servers.
//
// Update lifecycle (exactly once per version):
//   idle|failed --BeginUpdate(v)--> beginning --(engines paused, sources started)--> updating
//   updating --CommitUpdate(v)--> committing --> idle (v is the current version) | failed
// A version is used by one attempt only: BeginUpdate(v) needs v newer than every version begun before, failed ones
// included (retry a failed update under a new version). Every outcome is recorded per version, so retries are
// answered from the record instead of being run again:
//   BeginUpdate(v)  while v is beginning: waits for that call and returns its result; while v is open: its reply.
//   CommitUpdate(v) while v is committing: waits for that commit and returns its result (no second commit);
//                   after v committed: the recorded reply; after v failed: the recorded Aborted("update v failed: …");
//                   any other version, or v not yet open: FailedPrecondition naming the open and the asked version.
//   AbortUpdate(v)  while v is open (updating): updating --> aborting --> failed; every source stops taking v's
//                   pushes and drains its writes; the record says aborted and how many bytes reached the engines.
//                   While v is beginning or committing: the calls in flight are cancelled (Peers::CancelCalls), no
//                   further phase starts, and the thread running the phase ends v as aborted with the operator's
//                   reason at once (the abort returns the recorded answer); then, state aborting until done, it tells
//                   started or finishing sources to abort and closes the write windows. What the engines are left
//                   with is the phase table's row (phase_table.h): resumed at their old version before the first
//                   write (and after it when every source answers that it wrote nothing), else paused at their old
//                   version. After the commit point (below) an abort cannot undo the update:
//                   it cancels the Continue calls left, the update ends committed with those engines not resumed,
//                   and the abort answers FailedPrecondition. Repeats get the recorded answer.
//   Commit point    the continue phase begins: every engine holds v's weights and label. Recorded
//                   (committed_unix_ms) and saved before the first Continue; v is the current version from then on.
//                   Engines whose Continue fails are "not resumed" (paused at v, named in the record and Status);
//                   CommitUpdate answers Unavailable "update v committed: … N of M engines not resumed"; a retried
//                   CommitUpdate(v), ResumeEngines or the next update continues them.
//   ResumeEngines   continues every engine at the current version, only when no byte of a failed or aborted update
//                   may have reached them (engines_hold_partial_writes false); a successful update clears the flag.
// The current version, the history and the engines' version labels therefore only move forward.
//
// Staged mode (BeginUpdateRequest.mode "staged", docs/operations.md "Staged updates"): BeginUpdate pauses nothing and
// points the plan at each engine's staging copy; CommitUpdate, once the sources finished, runs StageVerify (every
// rank's staging copy against the sources' write checksums), then the switch rows: pause every verified engine, Switch
// each (the engine re-checks the verified digest), post-process, set the version, continue. Engines that fail to
// verify, pause or switch are left out, continued at their old version and marked stale; the update succeeds when at
// least one engine switched. Before its switch a staged update never writes live weights: its failure leaves the
// engines serving. Past an engine's switch, a failed post-process or set-version holds that engine paused (failed,
// stale, its label unchanged) and a failed Continue leaves it not resumed at v; the others commit. Its commit point is
// the first engine labelled v: saved (committed_unix_ms, with the labels) before the first Continue, as above.
//
// Restart: a coordinator that finds an update open in its store ends it (UseStateStore), committed past the commit
// point, else failed, and reports every engine of it as the engine answers EngineInfo (label, paused), not as the
// store last saw it: the store cannot say which of the calls then in flight landed.
//
// Failure semantics are data: BeginUpdate and CommitUpdate bind one step per phase and an UpdateDriver
// (update_run.h) walks the mode's phase table (phase_table.h) over them; a failed row's PolicyFor(mode, phase) is
// applied in one place (EndRunAt). A node whose lease lapsed before an update began is left out of it
// (lapsed_nodes_: not planned, paused or called).
//
// Fan-out: each phase calls its peers on at most CoordinatorOptions::fanout_parallel workers (fanout.h), with a
// deadline for the whole phase (the phase's PeerDeadlines entry) and the update's Cancellation (an operator's abort).
// Saves: handed to the store writer (store_writer.h), its one owner, once per phase (the engine states a phase
// changed, once all its calls returned) and at each state change; never written under mu_ except a membership
// change's. Those that must be durable before the next step are waited for without mu_: the begin (before any engine
// is paused), the commit point (before the first Continue) and each call's outcome. States are typed
// (update_state.h); strings only at the API and in the store, whose form is unchanged.
//
// No lock is held across a call to a peer (tests/daemon/coordinator_faults_test.cc calls Status() from inside every
// peer call), a store write or a re-plan: a peer that fails, times out or hangs, or a store that stalls, delays only
// the update it belongs to, never Status, History, heartbeats (stamped on arrival under lease_mu_) or an abort. The
// lock contracts are compiler-checked (ABSL_GUARDED_BY; daemon_thread_safety_test).
//
// Readers: Status, EngineStates (WatchEngines), History and the status page answer from a ClusterModel
// (cluster_model.h), an immutable snapshot the coordinator builds under mu_ at every change of what they report
// (Publish, called where the change counter moves) and swaps in under the model's own mutex; they never take mu_.
// The layout (nodes, plan, groups) and the history records are shared between successive models and rebuilt only
// when they change. tests/daemon/coordinator_model_test.cc holds mu_ while they answer and checks, inside every peer
// call, that the published model is the state.
//
// The update in progress is an UpdateRun (update_run.h), one per version, made by BeginUpdate: its record, its
// BeginUpdate reply, its Cancellation, its calls in flight, the operator's abort, its commit point, the nodes lost
// during its commit and its engine calls' ends. The coordinator keeps membership, plan, store and model; the run is
// held under mu_ (run_), and its phase rows are walked by an UpdateDriver.
//
// Self-healing: sources report in every heartbeat the plan epoch and the digest (daemon/common/config_digest.h) of
// the configuration they hold; one that does not hold what the coordinator planned for it is configured again at
// the next BeginUpdate.

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "base/mutex.h"
#include "daemon/common/metrics.h"
#include "daemon/coordinator/cluster_model.h"
#include "daemon/coordinator/fanout.h"
#include "daemon/coordinator/phase_table.h"
#include "daemon/coordinator/replan.h"
#include "daemon/coordinator/relay_wiring.h"
#include "daemon/coordinator/state_store.h"
#include "daemon/coordinator/store_writer.h"
#include "daemon/coordinator/timeline_svg.h"
#include "daemon/coordinator/update_run.h"
#include "daemon/coordinator/update_state.h"
#include "wsync/v1/coordinator.pb.h"
#include "wsync/v1/daemon.pb.h"
#include "wsync/v1/engine.pb.h"

namespace wsync::daemon {

// Calls to the other processes; every call has a deadline.
class Peers {
 public:
  virtual ~Peers() = default;
  // A daemon or engine at `addr` (re)started: drop any connection state kept for it, so the next call dials afresh
  // instead of failing inside a reconnect backoff left by the previous process.
  virtual void Forget(const std::string& addr) { (void)addr; }
  // Fails the calls in flight to `addr` at once (CANCELLED), without waiting for their deadlines: the coordinator
  // stops waiting for a node that lost its lease (e.g. a source's FinishUpdate during the commit).
  virtual void CancelCalls(const std::string& addr) { (void)addr; }
  virtual absl::StatusOr<v1::ConfigureSourceReply> ConfigureSource(const std::string& addr,
                                                                   const v1::ConfigureSourceRequest& req) = 0;
  virtual absl::Status StartUpdate(const std::string& addr, const v1::StartUpdateRequest& req) = 0;
  virtual absl::StatusOr<v1::FinishUpdateReply> FinishUpdate(const std::string& addr,
                                                             const v1::FinishUpdateRequest& req) = 0;
  virtual absl::StatusOr<v1::AbortSourceUpdateReply> AbortSourceUpdate(const std::string& addr,
                                                                       const v1::AbortSourceUpdateRequest& req) = 0;
  virtual absl::StatusOr<v1::EngineInfo> EngineInfo(const std::string& addr) = 0;
  // Target daemons: accept writes into their engines' memory only while the window is open.
  virtual absl::StatusOr<v1::SetWriteWindowReply> SetWriteWindow(const std::string& addr,
                                                                 const v1::SetWriteWindowRequest& req) {
    (void)addr;
    (void)req;
    return v1::SetWriteWindowReply();
  }
  // Target daemons, after every source finished: decode the staged delta records of the update into engine memory
  // and record the ranks written as holding it (docs/delta.md).
  virtual absl::StatusOr<v1::ApplyDeltaReply> ApplyDelta(const std::string& addr, const v1::ApplyDeltaRequest& req) {
    (void)addr;
    (void)req;
    return v1::ApplyDeltaReply();
  }
  virtual absl::Status Pause(const std::string& addr, const std::string& mode) = 0;
  // `version`: the update whose writes have all completed (a target daemon's facade sends it to the engine's ranks).
  virtual absl::Status PostProcess(const std::string& addr, const std::string& version) = 0;
  virtual absl::Status SetWeightVersion(const std::string& addr, const std::string& version) = 0;
  virtual absl::Status Continue(const std::string& addr) = 0;
  // Staged updates (docs/operations.md, "Staged updates"). The defaults answer Unimplemented, as a peer that offers
  // no staging does.
  // What source `addr` wrote in update `version` (NodeDaemon.GetWriteChecksums).
  virtual absl::StatusOr<v1::WriteChecksumsReply> WriteChecksums(const std::string& addr, int64_t version) {
    (void)addr;
    (void)version;
    return absl::UnimplementedError("write checksums");
  }
  // Hashes of one engine rank's memory (EngineControl.GetChecksums; req.staging: of its staging copy).
  virtual absl::StatusOr<v1::ChecksumReply> EngineChecksums(const std::string& addr, const v1::RankRequest& req) {
    (void)addr;
    (void)req;
    return absl::UnimplementedError("engine checksums");
  }
  virtual absl::Status Switch(const std::string& addr, const v1::SwitchRequest& req) {
    (void)addr;
    (void)req;
    return absl::UnimplementedError("switch");
  }
  // EngineControl.PrepareSwitch: Switch's check, before the pause, arming the switch.
  virtual absl::Status PrepareSwitch(const std::string& addr, const v1::SwitchRequest& req) {
    (void)addr;
    (void)req;
    return absl::UnimplementedError("prepare switch");
  }
};

// gRPC implementation of Peers.
// Engine calls' deadlines (seconds), configurable downwards from PeerDeadlines (clients' deadlines assume those
// maxima): a stopped engine fails the update within these.
struct EngineDeadlines {
  double pause = 120;
  double post_process = 300;
};
std::unique_ptr<Peers> MakeGrpcPeers(EngineDeadlines deadlines = EngineDeadlines());

struct CoordinatorOptions {
  std::string strategy = "balanced";  // transfer-plan strategy: seed | balanced | local (planner/plan.h)
  // local: the trainer's parallelism inside each PP stage ("tp=2,cp=1,ep=2,etp=1"; pp and nodes come from the
  // registered sources), i.e. which rank holds which shard. Empty = tp=ep=1 (every rank holds whole tensors).
  std::string trainer_parallelism;
  // balanced: a source is only given work if it gets at least this many bytes per engine copy (0 = every source);
  // nullopt (default): as many sources as the planner's cost model predicts fastest (planner::PlanOptions).
  std::optional<uint64_t> min_source_bytes;
  // balanced, automatic source count: every node's NICs ("1x400Gbps"), the link rate the cost model plans with.
  std::string nic = "1x400Gbps";
  // balanced: a cut within this many bytes of a parameter boundary moves to the boundary (0: cut anywhere, aligned).
  uint64_t snap_bytes = 4ull << 20;
  // Relay trees (issue 41): off (every engine written by the sources), auto or a degree N (relay_wiring.h).
  std::string relay = "off";
  size_t history_limit = 1000;   // also bounds the per-version outcomes kept to answer retries
  double heartbeat_seconds = 2;  // daemons' lease renewal interval; a node is unreachable after 3 missed
  // While an update is open (trainer pushing), a node that misses 3 lease renewals fails it at once, naming the node
  // (StartLeaseWatch runs the check); otherwise a dead daemon would hold the update open until its client gave up.
  double lease_check_seconds = 0.5;
  // Delta updates (docs/delta.md): with `auto`, every Nth update since the last dense one is sent dense (an anchor:
  // every engine rank is rewritten in full now and then, whatever it held); 0: never.
  int delta_anchor_every = 0;
  // Calls to peers running at once in one phase (daemon/coordinator/fanout.h): the threads and sockets an update
  // uses, whatever the fleet's size.
  size_t fanout_parallel = 64;
};

// The gRPC deadlines GrpcPeers puts on each call (seconds). One fact, one place: CommitWorstCase below and the
// clients' deadlines derive from them.
struct PeerDeadlines {
  static constexpr double kPause = 120;
  static constexpr double kEngineInfo = 30;
  static constexpr double kConfigure = 600;
  static constexpr double kStart = 30;
  static constexpr double kFinishSlack = 30;  // FinishUpdate: the commit's timeout_seconds plus this
  static constexpr double kPostProcess = 300;
  static constexpr double kSetVersion = 30;
  static constexpr double kContinue = 30;
  static constexpr double kApplyDelta = 60;  // decoding what the sources staged (a fraction of the dense bytes)
  static constexpr double kAbort = 60;    // a source's AbortSourceUpdate: the bucket being written + the drain (30 s)
  static constexpr double kVerify = 120;  // staged: a source's write checksums, an engine rank's staging hashes
  static constexpr double kSwitch = 60;   // staged: an engine's PrepareSwitch or Switch (re-hashes its staging copy)
};

// Default CommitUpdateRequest.timeout_seconds (how long sources wait for their trainer ranks).
inline constexpr double kDefaultCommitTimeoutSeconds = 120;

// The longest a CommitUpdate can run on the server: the sources' FinishUpdate (its wait for the ranks, then the
// drain of outstanding writes, both bounded by `commit_timeout_s`, under the peer deadline timeout + slack), then
// post-process, set-version and continue, each phase bounded by its peer deadline; a staged update adds its verify
// (the sources' checksums, then the engines' staging hashes) and the pause and switch of its barrier.
inline double CommitWorstCaseSeconds(double commit_timeout_s) {
  if (commit_timeout_s <= 0) commit_timeout_s = kDefaultCommitTimeoutSeconds;
  return commit_timeout_s + PeerDeadlines::kFinishSlack + PeerDeadlines::kApplyDelta + PeerDeadlines::kPostProcess +
         PeerDeadlines::kSetVersion + PeerDeadlines::kContinue + 2 * PeerDeadlines::kVerify + PeerDeadlines::kPause +
         2 * PeerDeadlines::kSwitch;
}
// The longest a BeginUpdate can run on the server (pause, engine info, configure, start).
inline double BeginWorstCaseSeconds() {
  return PeerDeadlines::kPause + PeerDeadlines::kEngineInfo + PeerDeadlines::kConfigure + PeerDeadlines::kStart;
}

// Readiness for routers: each engine's version served, staged version and ready / stale / paused, derived from a
// status (one fact: the status is the coordinator's view; this only reads it). Pure.
v1::EngineStates EngineStatesOf(const v1::ClusterStatus& status);

class Coordinator {
 public:
  Coordinator(CoordinatorOptions opts, std::unique_ptr<Peers> peers);
  ~Coordinator();

  // Starts the lease watch: every lease_check_seconds, CheckLeases(). The binary starts it; unit tests call
  // CheckLeases() themselves. Stopped by the destructor.
  void StartLeaseWatch();
  // Fails the open update (state updating) when a registered node has not renewed its lease for 3 intervals: its
  // sources are told to abort, windows close, the record names the node, engines stay paused. Returns whether it
  // failed an update.
  bool CheckLeases();

  absl::StatusOr<v1::RegisterNodeReply> RegisterNode(const v1::RegisterNodeRequest& req);
  v1::ClusterStatus Status() const;
  absl::StatusOr<v1::BeginUpdateReply> BeginUpdate(const v1::BeginUpdateRequest& req);
  absl::StatusOr<v1::CommitUpdateReply> CommitUpdate(const v1::CommitUpdateRequest& req);
  v1::HistoryReply History(const v1::HistoryRequest& req) const;
  absl::StatusOr<v1::AbortUpdateReply> AbortUpdate(const v1::AbortUpdateRequest& req);
  absl::StatusOr<v1::ResumeEnginesReply> ResumeEngines(const v1::ResumeEnginesRequest& req);
  v1::HeartbeatReply Heartbeat(const v1::HeartbeatRequest& req);
  // A source that failed the open update on its own says so (SourceNode's failure report): while the update is
  // open (updating) and the node is one of its sources, the update ends now as CheckLeases ends it (the push row's
  // policy, the sources told to abort, windows closed), failed with the source's error. Beginning or committing, the
  // running phase's own calls to that source answer the failure; an update that ended, or another version, is left
  // as it is (reply.ended false with the reason).
  v1::ReportUpdateFailureReply ReportUpdateFailure(const v1::ReportUpdateFailureRequest& req);
  // Status, EngineStates and History answer from the published model (cluster_model.h), never taking mu_: an update,
  // a peer call or a store write in progress never delays them.
  // The engines' states for routers (EngineStatesOf of a status without the plan).
  v1::EngineStates EngineStates() const;
  // A counter that moves whenever the state Status reports may have changed; WaitForChange blocks until it moves
  // past `seen` or `max_wait` passed (whichever first) and returns it. Never waits on mu_.
  uint64_t ChangeGeneration();
  uint64_t WaitForChange(uint64_t seen, absl::Duration max_wait);
  absl::StatusOr<v1::RemoveNodeReply> RemoveNode(const v1::RemoveNodeRequest& req);
  // Drains (`drain`) or undrains an engine or a node between updates (docs/operations.md, "Draining"): a drained
  // engine is left out of the plans (re-planned as a leave), never paused, written or resumed until undrained (a
  // join). A source node is drained only if the other source nodes still hold every trainer stage; its ranks then
  // push nothing. Repeating a drain or undrain changes nothing and succeeds.
  absl::StatusOr<v1::DrainReply> Drain(const v1::DrainRequest& req, bool drain);
  // Makes the coordinator persistent: restores what `store` holds (nodes, versions, engine states, history) and
  // saves every change from now on. An update that was open when the previous coordinator died is ended: committed
  // when it had passed its commit point (the classic one saved, or a staged one some engine of which holds its
  // label), else recorded as failed ("the coordinator restarted during it") and its sources told to abort it. Which
  // of the calls in flight then landed is not in the store: every engine of the update is asked (EngineInfo, without
  // mu_) and reported as it answers (its label; paused or serving); one that does not answer is reported failed
  // ("failed: engine_info"), never serving. Engines the update may have written into stay paused until an update
  // succeeds. Call before serving.
  absl::Status UseStateStore(std::unique_ptr<StateStore> store);
  // Updates by result, phase durations, bytes; membership and engine states (docs/operations.md, "Metrics").
  Metrics& metrics() { return metrics_; }
  // Tests only. CheckModelForTest: under mu_, whether the published model is what the state is now (a change not
  // published shows as a difference; lease fields left out). HoldLockForTest: runs `fn` holding mu_ (Status,
  // History, EngineStates and WatchEngines must answer meanwhile).
  absl::Status CheckModelForTest() const ABSL_LOCKS_EXCLUDED(mu_);
  void HoldLockForTest(const std::function<void()>& fn) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // The bodies of BeginUpdate, CommitUpdate and AbortUpdate; the public calls add the wait for the outcome's save.
  absl::StatusOr<v1::BeginUpdateReply> RunBeginUpdate(const v1::BeginUpdateRequest& req);
  absl::StatusOr<v1::CommitUpdateReply> RunCommitUpdate(const v1::CommitUpdateRequest& req);
  absl::StatusOr<v1::AbortUpdateReply> RunAbortUpdate(const v1::AbortUpdateRequest& req);
  using Planned = PlannedAssignment;  // daemon/coordinator/replan.h, as GroupPlan and PlanSources
  // A target's write-window assignments: the plan's, each with its source node (open_windows_from_).
  using WindowSources = std::vector<std::pair<std::string, std::shared_ptr<const v1::TargetAssignment>>>;
  // A source node's last acknowledged configuration and the plan epoch it holds. Digests, not the request: at 1024
  // engine ranks the sources' requests (every assigned rank's table) were gigabytes kept only to be compared.
  struct SourceConfig {
    std::string key;  // SourceConfigKey of what it was sent: equal keys, equal requests
    int64_t epoch = -1;
    std::string digest;  // ConfigureSourceDigest of the request: what its heartbeats must report
    std::vector<std::pair<std::string, int>> targets;  // (engine id, rank) it writes
  };
  // Runs `call`, a call of the beginning or committing update to the peer at `addr`, counted in the run's calls in
  // flight while it runs (what an operator's abort cancels); once an abort was asked, returns Cancelled without
  // calling. Takes mu_ briefly before and after, never across the call.
  template <typename Call>
  auto Remote(const std::string& addr, Call call) -> decltype(call());
  // The source nodes that take part in plans (not drained), in (stage, node id) order (PlanSourceNodes).
  absl::StatusOr<PlanSources> SourcesForPlan() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);  // requires mu_
  // Drained, or on a node whose lease had lapsed when the update began (not planned, paused or written).
  bool EngineDrained(const std::string& node_id, const std::string& engine_id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return drained_engines_.count(engine_id) > 0 || drained_nodes_.count(node_id) > 0 ||
           lapsed_nodes_.count(node_id) > 0;
  }
  // A target node none of whose engines takes part in updates: not told to open windows, its lease not checked.
  bool TargetOutOfUpdates(const v1::RegisterNodeRequest& n) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (n.role() != "target" || n.engines_size() == 0) return false;
    for (const auto& e : n.engines())
      if (!EngineDrained(n.node_id(), e.engine_id())) return false;
    return true;
  }
  // The terminal result of one version: its reply when it committed, else the error it failed with.
  struct Outcome {
    absl::Status status;
    v1::CommitUpdateReply reply;
  };
  // Plans the membership and model_config_json_ (PlanMembership, daemon/coordinator/replan.h: pure) and applies the
  // result (ApplyPlan). Reuses the plan of every engine group whose inputs did not change. `dry_run`: checks that a
  // plan can be built, changes nothing.
  absl::Status Replan(bool dry_run = false) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);  // requires mu_
  // What PlanMembership plans from: the membership, drains, model and options, and the groups in force. The input
  // points into members: use it while mu_ is held. Requires mu_.
  ReplanInput PlanningInput() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  ReplanOptions PlanningOptions() const;  // the planning fields of opts_
  // Keeps `r` as the plan in force (plan_, groups_, push_filters_, model_quantization_). Requires mu_.
  void ApplyPlan(Replanned r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Replan's halves: the input (engine digests refreshed, drained and lapsed nodes left out), and the plan applied
  // with its log line. Require mu_; PlanMembership runs between them, with or without it.
  ReplanInput PrepareReplan() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ApplyPlanLogged(Replanned r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Control addresses of the engines that take part in updates (not drained). Requires mu_.
  std::vector<std::string> EngineAddresses() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // "engine ID (N ranks, node NODE, ADDR)": how errors name an engine. Takes mu_ (call without it).
  std::string EngineLabel(const std::string& addr) const ABSL_LOCKS_EXCLUDED(mu_);
  // "NODE_ID (ADDR)": how errors name a daemon. Takes mu_ (call without it).
  std::string NodeLabel(const std::string& addr) const ABSL_LOCKS_EXCLUDED(mu_);
  bool UpdateInProgress() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return daemon::UpdateInProgress(state_); }
  // Moves the update to `to`, checking the transition (update_state.h). Requires mu_.
  void SetState(UpdateState to) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string StateName() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return std::string(UpdateStateName(state_)); }
  // Records `v`'s outcome and history entry, leaves the update (state idle on success, failed otherwise) and wakes
  // the calls waiting for it. Requires mu_.
  void Finish(int64_t v, const Outcome& o, v1::UpdateRecord rec) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the open update `rec.version()` as failed with Aborted("update v failed: why"); returns that status.
  // `may_have_written`: whether a byte of it may have reached an engine (then engines stay paused until an update
  // succeeds).
  // When an operator asked to abort the update (AbortUpdate while beginning or committing), it is recorded as
  // aborted with their reason, `why` appended. `stopping`: the caller still tells the sources and targets (the
  // update stays in progress, state aborting, until StopSources).
  // `resumed`: the engines were continued at their old version (phase_table.h, kResumeOld): the record says so.
  absl::Status Fail(v1::UpdateRecord rec, const absl::Status& why, bool may_have_written, bool stopping = false,
                    bool resumed = false) ABSL_LOCKS_EXCLUDED(mu_);
  // What a run of the update driver (update_run.h) knows that its failure handler needs: written by the steps.
  struct RunContext {
    std::vector<std::string> engines;   // the update's engines (control addresses)
    bool windows_open = false;          // the targets' write windows of this update are open
    bool sources_live = false;          // sources may take pushes or still write: a failure tells them to abort
    std::set<std::string> window_skip;  // targets not waited on when the windows close (unreachable)
  };
  // The driver's failure handler, the one place a failed row's policy is applied (`f.policy`, looked up by the
  // driver): with sources live, FailAndStopSources; otherwise the windows close (when open) and FailAt.
  absl::Status EndRunAt(const UpdateDriver::Failure& f, const v1::UpdateRecord& rec, const RunContext& ctx)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Closes update `v`'s write windows (skipping ctx->window_skip) and records it in `ctx`. Without mu_.
  void CloseWindows(int64_t v, RunContext* ctx) ABSL_LOCKS_EXCLUDED(mu_);
  // Whether the run must end after the row that just passed: an operator's abort before the commit point. Takes mu_.
  bool StopAsked() const ABSL_LOCKS_EXCLUDED(mu_);
  // A failure of a row of the update before its sources started (or after they finished), applied as `policy` (the
  // row's, PolicyFor) says: kResumeOld continues every engine in `engines` at its version first (unless an earlier
  // update left them holding partial writes), kServeOn and kLeaveOutStale record it with the engines serving, the
  // others with the engines paused.
  absl::Status FailAt(v1::UpdateRecord rec, const absl::Status& why, OnFailure policy,
                      const std::vector<std::string>& engines) ABSL_LOCKS_EXCLUDED(mu_);
  // Continues the engines of `engines` that the update paused (recorded paused) at the version they hold, after a
  // failure before the first write (no abort cancels these calls: it is what the abort leaves behind; a call still
  // running after kResumeWithin is), returns whether every one answered. Saves their states.
  bool ResumeOld(int64_t v, const std::vector<std::string>& engines) ABSL_LOCKS_EXCLUDED(mu_);
  // An update whose sources were started ends (an operator's abort, or a failure of `phase`): recorded at once (the
  // AbortUpdate waiting for it returns), then the sources are told to abort and the windows close (`skip`:
  // unreachable targets) while nothing new may begin — a stopped source would otherwise hold the abort for its
  // call's deadline. When `policy` (the row's) is kResumeIfClean, the sources are asked first (for
  // kCleanAnswerWithin): when every one answers that it wrote nothing, the engines in `engines` are resumed at their
  // version before the failure is recorded (saying so).
  absl::Status FailAndStopSources(v1::UpdateRecord rec, const absl::Status& why, Phase phase, OnFailure policy,
                                  const std::vector<std::string>& engines, const std::set<std::string>& skip = {})
      ABSL_LOCKS_EXCLUDED(mu_);
  // Restoring an update the previous coordinator died during (UseStateStore): what each engine at `addrs` says of
  // itself (EngineInfo: its label, whether it is paused), asked as one phase (the engine_info row's deadline) without
  // mu_; an engine that did not answer has its error.
  using EngineWords = std::map<std::string, absl::StatusOr<v1::EngineInfo>>;
  EngineWords AskEngines(const std::vector<std::string>& addrs) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the update stored open in `s` from the engines' `words` (UseStateStore): committed or failed, each engine
  // reported as it answered (RestoredEngineOf). Returns the version whose sources must be told to abort (-1: none).
  int64_t EndInterruptedLocked(const v1::CoordinatorState& s, const EngineWords& words)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Node ids whose lease lapsed (no heartbeat for 3 intervals), not drained. Requires mu_.
  std::set<std::string> LapsedNodes(absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether node `id` takes part in updates now (its lease had not lapsed when the update began). Requires mu_.
  bool InRun(const std::string& id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return lapsed_nodes_.count(id) == 0; }
  // Whether an operator asked to abort the beginning or committing update. Takes mu_.
  bool AbortAsked() const ABSL_LOCKS_EXCLUDED(mu_);
  // Tells every source to abort update `v` (best effort, not cancelled by an abort: it is the abort); returns
  // whether no byte of it may have been written (every source answered 0 bytes, quiescent) and adds the bytes.
  // `within`: the phase's deadline (calls still running then are cancelled, and count as not clean).
  bool AbortSources(int64_t v, const std::string& why, uint64_t* bytes,
                    absl::Duration within = absl::Seconds(PeerDeadlines::kAbort)) ABSL_LOCKS_EXCLUDED(mu_);
  // The recorded answer for a version that has ended, or nullptr. Requires mu_.
  const Outcome* FindOutcome(int64_t v) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the open update `v` (state updating) through the sources' AbortSourceUpdate: `by_operator` records it as
  // aborted with `why`, otherwise as failed because of `why`. The shared body of AbortUpdate and CheckLeases.
  // `lost_address`: a node not to be asked (its lease lapsed).
  // `failed_code`: the status code of a failure not by the operator (a lost node: Unavailable; a source's own
  // failure: Aborted, what its FinishUpdate would have answered).
  absl::StatusOr<v1::AbortUpdateReply> EndOpenUpdate(int64_t v, const std::string& why, bool by_operator,
                                                     const std::string& lost_address = "",
                                                     absl::StatusCode failed_code = absl::StatusCode::kUnavailable)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Opens or closes the write window on every target daemon; a target that cannot be told is an error when opening
  // (its engines would refuse the writes) and logged when closing.
  // `skip_address`: a target not to be told (its lease lapsed; its window closes when it restarts).
  // Targets in `skip` (unreachable ones) are not asked: a call to them would hold the caller for its whole deadline.
  // Opening counts as a call of the beginning update (InFlight): an abort cancels it.
  // `held` (open only): the versions the targets' engine ranks held until now (docs/delta.md).
  absl::Status SetWindows(bool open, int64_t version, const std::set<std::string>& skip = {},
                          std::vector<v1::RankVersion>* held = nullptr) ABSL_LOCKS_EXCLUDED(mu_);
  // Opens the write window of the target at `addr` with the open request `full`: without its assignments where the
  // target's last answer said it holds them (`acked`, their digest), and then with them if it answers that it does
  // not (restarted); records what the target now holds (window_acks_). A call of the beginning update (Remote).
  // `whole` (may be null) makes the request with its assignments where `full` was kept without them (SetWindows
  // drops them once the target holds them).
  absl::StatusOr<v1::SetWriteWindowReply> OpenWindow(const std::string& addr, const v1::SetWriteWindowRequest& full,
                                                     const std::string& acked,
                                                     const std::function<v1::SetWriteWindowRequest()>& whole = nullptr);
  // Adds the write-window assignments of `from` (a target's, WindowSources) to `r`.
  void AddWindowAssignments(const WindowSources& from, v1::SetWriteWindowRequest* r) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Delta updates, after every source finished `v` (`finished`: each source's node id and reply): every target
  // daemon in the update applies the records staged for it (ApplyDelta), and `rec` gets the delta figures.
  absl::Status ApplyDeltas(int64_t v, const std::vector<std::pair<std::string, v1::FinishUpdateReply>>& finished,
                           v1::UpdateRecord* rec);
  // Hands the state to the store writer, if any; returns at once (OK) unless the membership changed, which is written
  // now (its error returned; most callers go on). Requires mu_.
  absl::Status SaveState() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits, without mu_, until the state handed to the writer last (or ticket `t`) is in the store, at most
  // kStoreWait: the durability points (begin, commit point, outcome). The store's error, or DeadlineExceeded.
  absl::Status Durable(uint64_t t) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Durable() ABSL_LOCKS_EXCLUDED(mu_);
  // SaveState where the caller goes on whatever the store says (the failure is logged).
  void Persist() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    SaveState().IgnoreError();  // publishes the change (NoteChange)
  }
  // Staged updates (docs/operations.md, "Staged updates").
  // The engines among `engines` that offer staging memory (their layout's staging_segment_shift); with `staged`,
  // FailedPrecondition naming the first that does not. Requires mu_.
  absl::StatusOr<std::vector<std::string>> StagingEngines(const std::vector<std::string>& engines, bool staged) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Asks each engine in `engines` which copy of its segments is live (EngineInfo.live_set).
  absl::Status LiveSets(const std::vector<std::string>& engines, std::map<std::string, int>* out);
  // The copy of engine `engine_id`'s segments an update writes (LayoutForCopy's `set`): the live copy (classic) or
  // the other one (staged) for engines offering staging memory; -1 for the others (their layout as registered).
  // Requires mu_.
  int LayoutCopy(const std::string& engine_id, bool staged, const std::map<std::string, int>& live_sets) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What tells two configurations of a source apart without their rank tables or write ranges: `base` (its request
  // without targets), and per assignment its digest (PlannedAssignment::digest), its engine's registration digest
  // (not the copy an update writes: StartUpdate names it, so a switch costs no re-configure). Requires mu_ and
  // RefreshEngineDigests.
  std::string SourceConfigKey(const v1::ConfigureSourceRequest& base, const std::vector<const Planned*>& assigned) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Digests every registered engine not in engine_digests_ (EngineInputDigest, replan.h). Requires mu_.
  void RefreshEngineDigests() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The commit of a staged update once its sources finished: binds the staged rows from verify to continue on
  // `driver` (StageVerify, then the fleet barrier: pause every verified engine, switch each, then post-process, set
  // the version and continue those that switched, each row on the engines that passed the one before), walks them,
  // then records the outcome. An engine failing a call is handled as its row's policy says (the driver hands it to
  // the step): before its switch it is left out (continued at its old version, stale); past it, it is held paused
  // (post-process, set version) or on v not resumed (continue). `rec`: the record the driver's failure handler reads.
  absl::StatusOr<v1::CommitUpdateReply> CommitStaged(UpdateDriver& driver, v1::UpdateRecord& rec,
                                                     const std::vector<std::string>& engines, absl::Time start);
  // Checks every rank of every engine in `engines`: its staging copy against the checksums the sources recorded for
  // update `v`. Returns per verified engine its ranks' staging digests (for Switch); `left_out` gets the others, why.
  std::map<std::string, std::vector<std::string>> StageVerify(int64_t v, const std::vector<std::string>& engines,
                                                              std::map<std::string, std::string>* left_out);
  // The per-engine outcomes of a staged update's switch rows.
  struct SwitchResult {
    std::vector<std::string> serving;                // on v, continued
    std::map<std::string, std::string> not_resumed;  // on v (weights and label), Continue failed: paused (→ why)
    std::map<std::string, std::string> held;         // switched, a later phase failed: held paused (address → why)
  };
  // The fan-out of one phase of the beginning or committing update (fanout.h), as `mode`'s phase table declares it:
  // its name, its deadline for the whole phase (`deadline_s` only where the row leaves it to the caller: the
  // commit's timeout), cancelled by an operator's abort (run_.cancel) up to the switch (an engine past its switch
  // is never cut short by an abort), a running call cut short through Peers::CancelCalls on `addrs[i]` (the peer of
  // item i) at the deadline.
  FanoutOptions UpdatePhase(UpdateMode mode, Phase phase, std::vector<std::string> addrs, double deadline_s = 0) const;
  // Saves what a phase changed (engine states) in one store write, once every call of the phase returned. Takes mu_.
  void SaveEngineStates() ABSL_LOCKS_EXCLUDED(mu_);
  // Records the coordinator's view of engine `addr` after a call of `phase` (on_success nullopt = unchanged); returns
  // st. Not saved: the phase saves once when all its calls returned (SaveEngineStates).
  absl::Status Track(const std::string& addr, std::optional<EngineState> on_success, const std::string& phase,
                     absl::Status st);
  // Past the commit point (docs/operations.md): continues each engine in `engines` (control addresses) at the version
  // it holds, as one phase; `failed` gets those whose Continue failed, sorted. Saves their states. Without mu_.
  absl::Status ContinueEngines(const std::vector<std::string>& engines, const FanoutOptions& phase,
                               std::vector<std::string>* failed);
  // "update v committed: the fleet is on version v; N of M engines not resumed (…)": the answer of a commit that
  // passed its commit point with not_resumed_ left paused. Requires mu_.
  absl::Status NotResumedError(int64_t v, size_t engines, const absl::Status& why) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A retried CommitUpdate(v) of the current version committed with engines not resumed: continues them.
  absl::StatusOr<v1::CommitUpdateReply> ResumeCommitted(int64_t v);
  // After Continue was asked of `addrs` (`failed`: those that failed, with `why`): drops the others from
  // not_resumed_ and rewrites the current version's record and recorded answer. Requires mu_.
  void MarkResumed(const std::vector<std::string>& addrs, const std::vector<std::string>& failed,
                   const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The readers' model (cluster_model.h). Publish builds one from the state, reusing the layout and the history
  // records of the last one where their inputs did not change, and swaps it in; NoteChange calls it. The parts, built
  // from scratch: LayoutOf (nodes, engines' fixed details, plan, groups), EnginesOf (each engine's state), SummaryOf
  // (the update, epochs, small lists). Require mu_.
  void Publish() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::shared_ptr<const v1::ClusterStatus> LayoutOf() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::map<std::string, ClusterModel::Engine> EnginesOf() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::ClusterStatus SummaryOf() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Seconds since a node's last lease renewal, as of the call (lease_mu_ per lookup, never mu_).
  HeartbeatAgo HeartbeatAgoFn() const;
  // The id of the engine at control address `addr` (addr when unknown). Requires mu_.
  std::string EngineIdLocked(const std::string& addr) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  CoordinatorOptions opts_;
  std::unique_ptr<Peers> peers_;
  mutable Mutex mu_;
  std::map<std::string, v1::RegisterNodeRequest> nodes_ ABSL_GUARDED_BY(mu_);
  int64_t membership_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t plan_epoch_ ABSL_GUARDED_BY(mu_) = -1;  // membership epoch the current plan was built for
  std::vector<Planned> plan_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const RelayWiring> relay_wiring_ ABSL_GUARDED_BY(mu_);  // the plan's relay trees (relay_wiring.h)
  std::map<std::string, GroupPlan> groups_ ABSL_GUARDED_BY(mu_);  // by group key ("<dialect> tp=N ep=N dp=N")
  std::map<std::string, SourceConfig> configured_
      ABSL_GUARDED_BY(mu_);                           // source node id → what it was last configured with
  int64_t plan_generation_ ABSL_GUARDED_BY(mu_) = 0;  // plans applied (ApplyPlan)
  // The open-window requests of the plan in force by target daemon address (SetWindows), and what they were built
  // for (membership epoch, plan generation, drained engines and nodes): rebuilt only when one of those changed.
  std::shared_ptr<std::map<std::string, v1::SetWriteWindowRequest>> open_windows_ ABSL_GUARDED_BY(mu_);
  std::string open_windows_key_ ABSL_GUARDED_BY(mu_);
  // Per target of open_windows_, the plan's assignments its request was built from, with their source node (held:
  // the same objects, never an address reused). A rebuild keeps the request of a target whose assignments are the
  // same objects (a kept plan: a membership change elsewhere) instead of copying and digesting its write ranges
  // again; a request kept without its assignments (the target holds them) is made whole from them when needed.
  std::map<std::string, WindowSources> open_windows_from_ ABSL_GUARDED_BY(mu_);
  // Target daemon address → the digest of the write-window assignments it last answered holding (OpenWindow);
  // erased when the daemon registers again.
  std::map<std::string, std::string> window_acks_ ABSL_GUARDED_BY(mu_);
  // Engine id → EngineInputDigest of its registration in nodes_, computed once per registration (a re-plan with
  // nothing changed then reads no parameter table); dropped whenever the node's registration changes.
  std::map<std::string, std::string> engine_digests_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> drained_engines_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> drained_nodes_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> engine_version_
      ABSL_GUARDED_BY(mu_);  // control address → the version label last set on it
  // Per source node: what each of its local trainer ranks pushes (every local rank listed, lists may be empty).
  std::map<std::string, std::vector<v1::RankPushFilter>> push_filters_ ABSL_GUARDED_BY(mu_);
  std::string model_config_json_ ABSL_GUARDED_BY(mu_);
  v1::WeightQuantization model_quantization_
      ABSL_GUARDED_BY(mu_);  // what the engines report holding; the sources quantize to it
  // Leases: stamped on arrival under their own lock (lease_mu_, taken after mu_ when both are needed, never before),
  // so that a heartbeat is counted even while mu_ is held (a slow store write): a stalled store must not expire
  // healthy nodes.
  mutable Mutex lease_mu_ ABSL_ACQUIRED_AFTER(mu_);
  struct Lease {
    std::string address;  // the registered address: a heartbeat from another process of the id does not renew it
    absl::Time last;
  };
  std::map<std::string, Lease> leases_ ABSL_GUARDED_BY(lease_mu_);  // node id → its lease
  // Records a lease renewal for node `id` at `address` (registration or heartbeat). Takes lease_mu_.
  void StampLease(const std::string& id, const std::string& address, absl::Time at) ABSL_LOCKS_EXCLUDED(lease_mu_);
  // When node `id` last renewed its lease (InfinitePast when never). Takes lease_mu_.
  absl::Time LastHeartbeat(const std::string& id) const ABSL_LOCKS_EXCLUDED(lease_mu_);
  // Nodes whose lease had lapsed when the open (or last) update began: left out of its plan and calls; a lease watch
  // must run (StartLeaseWatch) for leases to mean anything, so without it none lapse.
  std::set<std::string> lapsed_nodes_ ABSL_GUARDED_BY(mu_);
  bool leases_enforced_ ABSL_GUARDED_BY(mu_) = false;
  // The drained nodes and the lapsed ones: what the planner leaves out (PlanningInput). Requires mu_.
  std::set<std::string> plan_excluded_ ABSL_GUARDED_BY(mu_);
  // Bumped on every change of the state Status reports (Persist, Track); WatchEngines waits on it.
  Mutex change_mu_ ABSL_ACQUIRED_AFTER(mu_);
  CondVar change_cv_;
  uint64_t change_generation_ ABSL_GUARDED_BY(change_mu_) = 0;
  // Publishes the model (Publish), then moves the counter. Requires mu_.
  void NoteChange() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) ABSL_LOCKS_EXCLUDED(change_mu_);
  // What readers see (cluster_model.h): replaced whole under its own mutex, read without mu_.
  ModelCell model_;
  uint64_t model_generation_ ABSL_GUARDED_BY(mu_) = 0;
  // The parts Publish reuses: the layout and what it was built for (membership epoch, plan generation); per version
  // the history record as last published; the versions added or rewritten since (Finish, MarkResumed, restore).
  std::shared_ptr<const v1::ClusterStatus> layout_ ABSL_GUARDED_BY(mu_);
  std::pair<int64_t, int64_t> layout_key_ ABSL_GUARDED_BY(mu_) = {-1, -1};
  std::map<int64_t, std::shared_ptr<const v1::UpdateRecord>> history_shared_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const ClusterModel::Records> history_model_ ABSL_GUARDED_BY(mu_);
  std::set<int64_t> model_history_dirty_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, EngineView> engine_state_ ABSL_GUARDED_BY(mu_);  // control address → its state (update_state.h)

  UpdateState state_ ABSL_GUARDED_BY(mu_) = UpdateState::kIdle;
  bool engines_dirty_ ABSL_GUARDED_BY(mu_) = false;  // a failed/aborted update may have written into the engines
  std::map<int64_t, v1::AbortUpdateReply> aborted_
      ABSL_GUARDED_BY(mu_);  // answers to repeated AbortUpdate, bounded like outcomes_
  // The update of the open version (update_run.h): its record, cancellation, calls in flight, abort, commit point.
  // A fresh one per BeginUpdate; read and written under mu_ only.
  UpdateRun run_ ABSL_GUARDED_BY(mu_);
  CondVar ended_cv_;                                // a begin or a commit ended (state_ left beginning or committing)
  int64_t open_version_ ABSL_GUARDED_BY(mu_) = -1;  // the version beginning, open or committing; -1 when none
  // The version EndOpenUpdate is ending (-1: none); an AbortUpdate of it waits for that end's reply.
  int64_t ending_open_ ABSL_GUARDED_BY(mu_) = -1;
  int64_t last_begun_ ABSL_GUARDED_BY(mu_) = -1;    // highest version ever begun; BeginUpdate needs a newer one
  int64_t since_dense_ ABSL_GUARDED_BY(mu_) = 0;    // updates committed since the last dense one (delta_anchor_every)
  int64_t current_version_ ABSL_GUARDED_BY(mu_) = -1;  // last committed version; -1 when none
  // Staged updates: engines left out of a switch (control address → why) until an update succeeds on them; the
  // version each engine holds verified in its staging copy, not yet switched; whether the open update's switch began.
  std::map<std::string, std::string> engine_stale_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> engine_staged_ ABSL_GUARDED_BY(mu_);
  bool switch_started_ ABSL_GUARDED_BY(mu_) = false;
  // Engines (ids) holding the current version paused because their Continue failed past its commit point.
  std::set<std::string> not_resumed_ ABSL_GUARDED_BY(mu_);
  std::mutex watch_mu_;
  std::condition_variable watch_cv_;
  bool watch_stop_ = false;
  std::thread watch_thread_;
  std::map<int64_t, Outcome> outcomes_
      ABSL_GUARDED_BY(mu_);  // per ended version, the oldest dropped beyond history_limit
  std::deque<v1::UpdateRecord> history_ ABSL_GUARDED_BY(mu_);
  Metrics metrics_;
  // The store's one owner (store_writer.h): saves are queued, never written under mu_, except a membership change's.
  std::unique_ptr<StoreWriter> writer_ ABSL_GUARDED_BY(mu_);
  int64_t persisted_nodes_epoch_ ABSL_GUARDED_BY(mu_) =
      -1;  // membership epoch whose nodes the store was last given (nodes_ change with it)
  std::set<int64_t> history_dirty_
      ABSL_GUARDED_BY(mu_);  // versions whose history record was added or changed since the last save
  uint64_t save_ticket_ ABSL_GUARDED_BY(mu_) = 0;  // the ticket of the last state handed to writer_
};

}  // namespace wsync::daemon
