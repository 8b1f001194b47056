#pragma once
// What a failure means at each phase of an update, declared once (docs/operations.md, "Failure semantics").
//
// Every update mode is a table of phases in the order they run; each row names the phase's peers, how many of them
// are called at once, whether an operator's abort cancels the row's calls, its deadline and the policy the coordinator
// applies when a call of that phase fails, times out, hangs past its deadline, loses its peer or is cancelled by an
// operator's abort. The coordinator never decides what a failure means inline: the update
// driver (update_run.h) walks these rows and hands a failed row's PolicyFor(mode, phase) to one failure handler
// (coordinator.cc, EndRunAt), or to the row's step where the outcome is per engine (the staged switch rows, continue),
// so a new mode or phase is a new row here, and the fault matrix (tests/daemon/
// coordinator_faults_test.cc) enumerates these rows and checks what every engine was really told against them.
//
// The invariants every row keeps:
//   - no engine serves weights other than its version label says (an engine that may hold a mix is never resumed);
//   - before the first write into live weights, a failure resumes every engine the update paused, at its version;
//   - past a switch or a commit point, an engine is never relabelled or resumed as something it is not: it is
//     reported paused (not resumed, or failed at the phase), and the update's outcome names it;
//   - versions never go backwards (BeginUpdate admits only newer versions; Finish never lowers the current one).

#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace wsync::daemon {

enum class UpdateMode { kClassic, kStaged };

enum class Phase {
  kPause,          // classic: engines paused before anything is written
  kEngineInfo,     // the model the engines serve (re-plan)
  kConfigure,      // sources given the plan
  kOpenWindows,    // target daemons accept this update's writes
  kStart,          // sources told to take the trainer's pushes
  kPush,           // the update is open: the trainer pushes (lease loss, operator's abort)
  kFinish,         // sources drain their writes
  kApplyDelta,     // targets decode staged delta records
  kVerify,         // staged: staging copies against the sources' write checksums
  kPrepareSwitch,  // staged: the engine re-checks its staging copy and arms the switch
  kSwitchPause,    // staged: the fleet barrier's pause
  kSwitch,         // staged: staging becomes live
  kPostProcess,
  kSetVersion,
  kContinue,
  kRelayDrain,  // relay trees: every relay checked and forwarded what landed (after finish; appended, not re-ordered)
};

enum class OnFailure {
  // Nothing of the update reached live weights: every engine the update paused is continued at its version; the
  // fleet serves on as before the update.
  kResumeOld,
  // Sources were started: each is told to abort and answers what it wrote. None wrote a byte (and each is quiescent):
  // as kResumeOld. Otherwise as kKeepPaused.
  kResumeIfClean,
  // Live weights may be partly written: engines stay paused at their old label, reported paused; only a successful
  // update resumes them (ResumeEngines refuses).
  kKeepPaused,
  // Staged, before any engine was paused: only staging memory was written; engines serve on, unpaused.
  kServeOn,
  // Staged, per engine before its switch: that engine is left out, continued at its old version and marked stale;
  // the others go on. The update fails when no engine is left.
  kLeaveOutStale,
  // Staged, per engine past its switch: it holds the new weights without the phase's effect. It is never continued
  // nor labelled: reported failed at the phase (paused, stale) until an update succeeds on it. The update commits on
  // the engines that completed; it fails (engines paused) when none did.
  kHoldPaused,
  // Past the commit point: the engine holds v's weights and label; a failed Continue leaves it paused at v, named
  // "not resumed" in the record and Status; ResumeEngines, a retried commit or the next update continues it.
  kCommittedNotResumed,
  // Relay trees, per relay: one whose target daemon died is routed around within the update. Its engine is dropped
  // from the update (it may hold a mix: kept paused at its old label, named in the record's `dropped` and reported
  // stale, as a direct engine whose daemon dies under keep paused); its live children are re-parented to the nearest
  // live relay above it, which forwards them everything from the start, and the drain runs again. A relay that
  // failed otherwise (a check, a forward to a live child), or a dead root (its children have no live relay above
  // them; the sources write only roots), fails the update as kKeepPaused, naming the relay.
  kRouteAround,
};

// A row's fan-out width: kFanoutDefault calls at most the coordinator's --fanout-parallel peers at once; kAllAtOnce
// calls every peer at once (the staged fleet barrier: engines pause and switch together, not in waves).
constexpr size_t kFanoutDefault = 0;
constexpr size_t kAllAtOnce = static_cast<size_t>(-1);

struct PhaseRow {
  Phase phase;
  const char* name;   // the phase as records and errors name it ("pause", "post_process", …)
  const char* peers;  // who is called
  double deadline_s;  // the whole phase's deadline (PeerDeadlines); 0: the caller's (commit timeout)
  OnFailure on_failure;
  size_t fanout = kFanoutDefault;  // peers called at once (above)
  // An operator's abort (the run's cancellation) cancels the row's calls still running, and the row's policy applies
  // (to the run, or to each engine whose call it cut, as the row says); false: past the staged switch, where every
  // engine's call runs to its end and each engine ends as the row's policy says for it.
  bool abortable = true;
};

// The phases of `mode`, in the order they run.
const std::vector<PhaseRow>& PhaseTable(UpdateMode mode);
// The row's policy; a phase the mode does not run is a bug (logged, kKeepPaused: the safe answer).
OnFailure PolicyFor(UpdateMode mode, Phase phase);
// The row's deadline for the whole phase (seconds; 0: the caller's, the commit's timeout). Every fan-out of an update
// takes its deadline from here (Coordinator::UpdatePhase). A phase the mode does not run: 0, logged.
double DeadlineFor(UpdateMode mode, Phase phase);
// The row itself (its fan-out width and whether an abort cancels its calls); a phase the mode does not run: a row with the
// defaults and kKeepPaused, logged.
PhaseRow RowFor(UpdateMode mode, Phase phase);
absl::string_view PhaseName(Phase phase);
absl::string_view OnFailureName(OnFailure f);
// One sentence: what the engines see after a failure under `f`.
absl::string_view OnFailureMeaning(OnFailure f);
// docs/operations.md's table of every mode's rows (Markdown), generated from the tables above.
std::string PhaseTableMarkdown();

// Test hook: replaces one row's policy (returns the previous one). The fault matrix breaks a row on purpose with it
// to show that the suite fails (tests/daemon/coordinator_faults_test.cc); never called by the coordinator.
OnFailure OverridePolicyForTesting(UpdateMode mode, Phase phase, OnFailure f);
// Test hook: caps every row's deadline at `max_s` seconds (rows with the caller's deadline keep it), so that a hang
// fails its phase within a test's time (wsync-coordinator --test-phase-deadline; tests/daemon/
// fault_matrix_real_test.cc). Call before any update runs; never called otherwise.
void CapDeadlinesForTesting(double max_s);

}  // namespace wsync::daemon
