#include "daemon/coordinator/phase_table.h"

#include <atomic>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/coordinator/coordinator.h"
#include "spdlog/spdlog.h"

namespace wsync::daemon {
namespace {

using D = PeerDeadlines;

std::vector<PhaseRow>& Table(UpdateMode mode) {
  // Classic: engines pause first; nothing reaches live weights before the sources start.
  static std::vector<PhaseRow> classic = {
      {Phase::kPause, "pause", "every engine", D::kPause, OnFailure::kResumeOld},
      {Phase::kEngineInfo, "engine_info", "the first engine (re-plan only)", D::kEngineInfo, OnFailure::kResumeOld},
      {Phase::kConfigure, "configure", "sources whose plan changed", D::kConfigure, OnFailure::kResumeOld},
      {Phase::kOpenWindows, "open_windows", "every target daemon", D::kStart, OnFailure::kResumeOld},
      {Phase::kStart, "start", "every source", D::kStart, OnFailure::kResumeIfClean},
      {Phase::kPush, "push", "the trainer (lease loss, operator's abort)", 0, OnFailure::kResumeIfClean},
      {Phase::kFinish, "finish", "every source", 0, OnFailure::kKeepPaused},
      // A relay that died is routed around; one that failed a check, or a dead root, keeps every engine paused:
      // engines below it may hold a mix of versions (docs/planner.md, "A relay that dies").
      {Phase::kRelayDrain, "relay_drain", "every target daemon of a relay tree", 0, OnFailure::kRouteAround},
      {Phase::kApplyDelta, "apply_delta", "target daemons with delta records", D::kApplyDelta, OnFailure::kKeepPaused},
      {Phase::kPostProcess, "post_process", "every engine", D::kPostProcess, OnFailure::kKeepPaused},
      {Phase::kSetVersion, "set_version", "every engine", D::kSetVersion, OnFailure::kKeepPaused},
      {Phase::kContinue, "continue", "every engine", D::kContinue, OnFailure::kCommittedNotResumed},
  };
  // Staged: engines serve while the update is staged; the switch is per engine the point of no return.
  static std::vector<PhaseRow> staged = {
      {Phase::kEngineInfo, "engine_info", "the first engine (re-plan only)", D::kEngineInfo, OnFailure::kServeOn},
      {Phase::kConfigure, "configure", "sources whose plan changed", D::kConfigure, OnFailure::kServeOn},
      {Phase::kOpenWindows, "open_windows", "every target daemon", D::kStart, OnFailure::kServeOn},
      {Phase::kStart, "start", "every source", D::kStart, OnFailure::kServeOn},
      {Phase::kPush, "push", "the trainer (lease loss, operator's abort)", 0, OnFailure::kServeOn},
      {Phase::kFinish, "finish", "every source", 0, OnFailure::kServeOn},
      {Phase::kApplyDelta, "apply_delta", "target daemons with delta records", D::kApplyDelta, OnFailure::kServeOn},
      {Phase::kVerify, "verify", "every source, then every engine rank", D::kVerify, OnFailure::kLeaveOutStale},
      {Phase::kPrepareSwitch, "prepare", "every verified engine", D::kSwitch, OnFailure::kLeaveOutStale},
      // The fleet barrier: every engine pauses and switches at once, not in waves of --fanout-parallel.
      {Phase::kSwitchPause, "pause", "every prepared engine", D::kPause, OnFailure::kLeaveOutStale, kAllAtOnce},
      {Phase::kSwitch, "switch", "every paused engine", D::kSwitch, OnFailure::kLeaveOutStale, kAllAtOnce, false},
      // Past the switch an abort acts per engine (each ends as its row says), never on the run.
      {Phase::kPostProcess, "post_process", "every switched engine", D::kPostProcess, OnFailure::kHoldPaused,
       kFanoutDefault, false},
      {Phase::kSetVersion, "set_version", "every post-processed engine", D::kSetVersion, OnFailure::kHoldPaused,
       kFanoutDefault, false},
      {Phase::kContinue, "continue", "every engine on the new version", D::kContinue, OnFailure::kCommittedNotResumed,
       kFanoutDefault, false},
  };
  return mode == UpdateMode::kStaged ? staged : classic;
}

std::mutex& OverrideMu() {
  static std::mutex mu;
  return mu;
}

}  // namespace

const std::vector<PhaseRow>& PhaseTable(UpdateMode mode) { return Table(mode); }

OnFailure PolicyFor(UpdateMode mode, Phase phase) {
  std::lock_guard<std::mutex> l(OverrideMu());
  for (const PhaseRow& r : Table(mode))
    if (r.phase == phase) return r.on_failure;
  spdlog::critical("no {} phase {} in the phase table: keeping engines paused",
                   mode == UpdateMode::kStaged ? "staged" : "classic", std::string(PhaseName(phase)));
  return OnFailure::kKeepPaused;
}

double DeadlineFor(UpdateMode mode, Phase phase) {
  for (const PhaseRow& r : Table(mode))
    if (r.phase == phase) return r.deadline_s;
  spdlog::critical("no {} phase {} in the phase table: no deadline", mode == UpdateMode::kStaged ? "staged" : "classic",
                   std::string(PhaseName(phase)));
  return 0;
}

PhaseRow RowFor(UpdateMode mode, Phase phase) {
  std::lock_guard<std::mutex> l(OverrideMu());
  for (const PhaseRow& r : Table(mode))
    if (r.phase == phase) return r;
  spdlog::critical("no {} phase {} in the phase table: a row of defaults",
                   mode == UpdateMode::kStaged ? "staged" : "classic", std::string(PhaseName(phase)));
  return PhaseRow{phase, "?", "?", 0, OnFailure::kKeepPaused};
}

OnFailure OverridePolicyForTesting(UpdateMode mode, Phase phase, OnFailure f) {
  std::lock_guard<std::mutex> l(OverrideMu());
  for (PhaseRow& r : Table(mode))
    if (r.phase == phase) {
      const OnFailure old = r.on_failure;
      r.on_failure = f;
      return old;
    }
  return OnFailure::kKeepPaused;
}

void CapDeadlinesForTesting(double max_s) {
  std::lock_guard<std::mutex> l(OverrideMu());
  for (UpdateMode mode : {UpdateMode::kClassic, UpdateMode::kStaged})
    for (PhaseRow& r : Table(mode))
      if (r.deadline_s > max_s) r.deadline_s = max_s;
}

absl::string_view PhaseName(Phase phase) {
  switch (phase) {
    case Phase::kPause:
      return "pause";
    case Phase::kEngineInfo:
      return "engine_info";
    case Phase::kConfigure:
      return "configure";
    case Phase::kOpenWindows:
      return "open_windows";
    case Phase::kStart:
      return "start";
    case Phase::kPush:
      return "push";
    case Phase::kFinish:
      return "finish";
    case Phase::kApplyDelta:
      return "apply_delta";
    case Phase::kVerify:
      return "verify";
    case Phase::kPrepareSwitch:
      return "prepare";
    case Phase::kSwitchPause:
      return "pause";
    case Phase::kSwitch:
      return "switch";
    case Phase::kPostProcess:
      return "post_process";
    case Phase::kSetVersion:
      return "set_version";
    case Phase::kContinue:
      return "continue";
    case Phase::kRelayDrain:
      return "relay_drain";
  }
  return "?";
}

absl::string_view OnFailureName(OnFailure f) {
  switch (f) {
    case OnFailure::kResumeOld:
      return "resume old";
    case OnFailure::kResumeIfClean:
      return "resume old if nothing was written, else keep paused";
    case OnFailure::kKeepPaused:
      return "keep paused";
    case OnFailure::kServeOn:
      return "serve on";
    case OnFailure::kLeaveOutStale:
      return "leave the engine out (stale)";
    case OnFailure::kHoldPaused:
      return "hold the engine paused (failed)";
    case OnFailure::kCommittedNotResumed:
      return "committed; engine not resumed";
    case OnFailure::kRouteAround:
      return "route around a dead relay, else keep paused";
  }
  return "?";
}

absl::string_view OnFailureMeaning(OnFailure f) {
  switch (f) {
    case OnFailure::kResumeOld:
      return "nothing reached live weights: every engine the update paused is continued at its version";
    case OnFailure::kResumeIfClean:
      return "sources are told to abort; when none wrote a byte, engines resume at their version, else they stay "
             "paused until an update succeeds";
    case OnFailure::kKeepPaused:
      return "live weights may be partly written: engines stay paused at their old label until an update succeeds";
    case OnFailure::kServeOn:
      return "only staging memory was written: engines serve their version, never paused";
    case OnFailure::kLeaveOutStale:
      return "that engine is continued at its old version and marked stale; the others go on";
    case OnFailure::kHoldPaused:
      return "that engine holds the new weights without this phase: kept paused, reported failed and stale, never "
             "labelled; the update commits on the engines that completed";
    case OnFailure::kCommittedNotResumed:
      return "the fleet is on the new version; that engine stays paused at it, reported not resumed";
    case OnFailure::kRouteAround:
      return "a relay whose daemon died is dropped (its engine kept paused at its old label, stale) and its children "
             "re-parented to the nearest live relay above, the update goes on; a failed check or a dead root: as "
             "keep paused";
  }
  return "?";
}

std::string PhaseTableMarkdown() {
  std::string out;
  for (UpdateMode mode : {UpdateMode::kClassic, UpdateMode::kStaged}) {
    absl::StrAppend(&out, mode == UpdateMode::kStaged ? "Staged" : "Classic (and delta)", " updates:\n\n",
                    "| phase | peers | at once | abort | deadline | on failure | the engines then |\n",
                    "|---|---|---|---|---|---|---|\n");
    for (const PhaseRow& r : PhaseTable(mode))
      absl::StrAppend(&out, "| ", r.name, " | ", r.peers, " | ",
                      r.fanout == kAllAtOnce      ? std::string("all")
                      : r.fanout == kFanoutDefault ? std::string("--fanout-parallel")
                                                   : absl::StrCat(r.fanout),
                      " | ", r.abortable ? "cancels its calls" : "calls run to the end", " | ",
                      r.deadline_s > 0 ? absl::StrFormat("%g s", r.deadline_s) : std::string("the commit's timeout"),
                      " | ", OnFailureName(r.on_failure), " | ", OnFailureMeaning(r.on_failure), " |\n");
    out += "\n";
  }
  return out;
}

}  // namespace wsync::daemon
