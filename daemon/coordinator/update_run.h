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
// member. The phase rows (phase_table.h) are still run by the coordinator's update functions, which read and write the
// run (docs/operations.md, "Coordinator internals").

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "daemon/coordinator/fanout.h"
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

}  // namespace wsync::daemon
