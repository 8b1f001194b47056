#pragma once
// The states of an update and of an engine as the coordinator tracks them, with the legal transitions in one place.
// Strings exist only at the edges: the API (ClusterStatus.state, EngineDetail.state) and the state stores, whose
// stored form ("idle", "failed: pause", …) is unchanged.
//
//   idle | failed  --BeginUpdate-->  beginning  --sources started-->  updating  --CommitUpdate-->  committing
//   beginning | committing  --Fail-->  failed      committing --Finish-->  idle (committed) | failed
//   beginning | updating | committing  --abort-->  aborting  --sources told-->  failed
//   beginning --the state store refused to record it-->  the state it left (nothing was asked of an engine)
//   failed --> aborting: an update ended while beginning or committing (Fail records it at once) whose sources are
//   still being told to stop (FailAndStopSources).

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace wsync::daemon {

enum class UpdateState { kIdle, kBeginning, kUpdating, kCommitting, kAborting, kFailed };

// The API and stored form ("idle", "beginning", …).
absl::string_view UpdateStateName(UpdateState s);
// The inverse; InvalidArgument naming `name` when it is none of them.
absl::StatusOr<UpdateState> ParseUpdateState(absl::string_view name);
// Whether an update is under way (beginning, updating, committing or aborting).
bool UpdateInProgress(UpdateState s);
// Whether the coordinator may move an update from `from` to `to` (the diagram above). Pure.
bool LegalUpdateTransition(UpdateState from, UpdateState to);

// An engine as the coordinator last saw it.
enum class EngineState { kRegistered, kPaused, kServing, kFailed };
struct EngineView {
  EngineState state = EngineState::kRegistered;
  std::string failed_phase;  // kFailed: the phase whose call failed ("pause", "continue", …)

  bool operator==(const EngineView& o) const { return state == o.state && failed_phase == o.failed_phase; }
};
// "registered" | "paused" | "serving" | "failed: <phase>" (the stored and API form).
std::string EngineStateName(const EngineView& e);
// The inverse; a stored value that is none of them (written by a newer coordinator) is InvalidArgument.
absl::StatusOr<EngineView> ParseEngineState(absl::string_view name);

}  // namespace wsync::daemon
