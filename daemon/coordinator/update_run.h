#pragma once
// UpdateRun: what belongs to one update (one version) while it runs, apart from the coordinator's membership, store
// and published model: its record as it grows, its BeginUpdate reply (answers a retried begin), the Cancellation an
// operator's abort raises, the calls to peers it has in flight (what the abort cancels), the abort's reason and
// author, its commit point, the nodes lost during its commit, the plan epoch, the sources' epochs and the engines'
// live copies it began under, and its engine calls as they ended (the timeline).
//
// One object per version: BeginUpdate makes a fresh one (the previous version's object is dropped with whatever of
// it was left; a late call of that version leaving finds no count of its own here and changes nothing). The
// coordinator holds it under its lock (Coordinator::run_, ABSL_GUARDED_BY(mu_)): the run has no lock of its own, and
// every member is read and written with the coordinator's mu_ held — the compiler checks it through the guarded
// member.
//
// UpdateDriver: the phase rows (phase_table.h) run as data. The coordinator binds one step per phase (a Phase → step
// map: the step makes the phase's calls, writes what it learned into the run's context, and returns a Status) and the
// driver walks the mode's PhaseTable in its order over the rows an RPC owns (BeginUpdate: the first row up to start;
// CommitUpdate: finish up to continue), running each bound row once. A row without a step is one this update does
// not run (classic runs no verify; relay_drain only with relay trees; a staged update without deltas no apply_delta)
// and is skipped. After each row the driver asks whether the run must stop (an operator's abort before the commit
// point): the row then counts as failed with the step's Status.
//
// What a failure means is decided in exactly one place: the driver looks up PolicyFor(mode, row.phase) for the row
// that failed and hands {phase, policy, why} to the one failure handler the coordinator gives it (which resumes the
// old version, asks the sources whether they wrote, keeps the engines paused or lets them serve on: it switches on the
// policy, never on the phase). Steps whose outcome is per engine (classic continue, the staged rows from verify on)
// get their row's policy from the driver as their argument and apply it per engine; they never look it up. Moving a
// row in a table, or changing its policy (OverridePolicyForTesting), therefore changes what the run does with no other
// edit, and the fault matrix (tests/daemon/coordinator_faults_test.cc) checks the engines against the rows.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "daemon/coordinator/fanout.h"
#include "daemon/coordinator/phase_table.h"
#include "daemon/coordinator/timeline_svg.h"
#include "wsync/v1/coordinator.pb.h"

namespace wsync::daemon {

class UpdateRun {
 public:
  UpdateRun() = default;
  explicit UpdateRun(int64_t version) : version_(version) {}

  int64_t version() const { return version_; }

  // Calls in flight to peers (by address). Enter counts a call about to be made; it refuses (false) once an abort
  // was asked: the call is not made. Leave ends a call Enter counted.
  bool Enter(const std::string& addr);
  void Leave(const std::string& addr);
  // The addresses with a call in flight (an abort cancels them through Peers::CancelCalls).
  std::vector<std::string> InFlight() const;

  // An operator's abort of the run while a phase runs: recorded once (false when already asked); the phase running
  // stops starting calls, and `cancel` is raised by the caller outside the lock.
  bool AskAbort(const std::string& reason, const std::string& by);
  // The run ended (recorded): an abort asked of it no longer applies.
  void Ended();

  v1::UpdateRecord record;           // the record as it grows (saved as CoordinatorState.open_record)
  v1::BeginUpdateReply begin_reply;  // the open version's BeginUpdate reply (answers a retried BeginUpdate)
  // Raised with abort_asked: the phase running stops starting calls and cancels those in flight. A fresh one per
  // begin and per commit.
  std::shared_ptr<Cancellation> cancel = std::make_shared<Cancellation>();
  bool abort_asked = false;
  std::string abort_reason;
  std::string abort_by;  // who asked for the abort (AbortUpdateRequest.aborted_by; "the operator" when not said)
  // The commit passed its commit point (every engine held its weights and label; the continue phase began): it ends
  // committed whatever a Continue answers.
  bool commit_point = false;
  // During the commit: nodes that lost their lease (addresses) and the first such failure.
  std::set<std::string> commit_lost;
  std::string commit_lost_why;
  int64_t plan_epoch = -1;                       // plan the run was started under
  std::map<std::string, int64_t> source_epochs;  // source address → its plan epoch (sent with FinishUpdate)
  std::map<std::string, int> live_sets;          // staging engines' live copy when the run began
  std::vector<EngineCallEnd> engine_call_ends;   // its engine calls as they ended (the timeline)

 private:
  int64_t version_ = -1;
  std::map<std::string, int> in_flight_;  // peer address → calls in flight
};

// Walks a mode's phase table (see the top of this file). Not thread-safe: one driver per walk, on the thread running
// the update's RPC; steps may fan out to workers of their own.
class UpdateDriver {
 public:
  // A phase's work. `policy` is the row's (PolicyFor), for steps whose failures are per engine; a non-OK result fails
  // the row, and the driver applies `policy` through the failure handler.
  using Step = std::function<absl::Status(OnFailure policy)>;
  struct Failure {
    Phase phase;
    OnFailure policy;  // PolicyFor(mode, phase), looked up by the driver when the row failed
    absl::Status why;  // the step's Status; OK when the row ended because the run must stop (an abort)
  };
  // `stop`: whether the run must end after a row that succeeded (an operator's abort before the commit point).
  // `on_failure`: the one place a failed row's policy is applied; its result is the walk's.
  UpdateDriver(UpdateMode mode, std::function<bool()> stop, std::function<absl::Status(const Failure&)> on_failure);

  // Binds `phase`'s step; a phase the mode's table has no row for is refused (false, logged): a bug.
  bool Bind(Phase phase, Step step);
  // Runs the bound rows from `first` to `last` (inclusive, in the table's order); stops at the first row that fails
  // (or after which `stop` answers true) and returns the failure handler's answer. OK when every row passed.
  // Internal when `first` or `last` is not a row of the mode (a bug).
  absl::Status Walk(Phase first, Phase last);
  // Fails the run at row `phase` (the handler, with the row's policy): for a stop found after the walk, while the
  // run is finalized (the last row owns it).
  absl::Status FailAt(Phase phase, absl::Status why);

  UpdateMode mode() const { return mode_; }
  // The rows run so far, in the order they ran (each once).
  const std::vector<Phase>& ran() const { return ran_; }

 private:
  UpdateMode mode_;
  std::function<bool()> stop_;
  std::function<absl::Status(const Failure&)> on_failure_;
  std::map<Phase, Step> steps_;
  std::vector<Phase> ran_;
};

}  // namespace wsync::daemon
