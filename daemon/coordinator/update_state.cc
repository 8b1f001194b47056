#include "daemon/coordinator/update_state.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace wsync::daemon {

absl::string_view UpdateStateName(UpdateState s) {
  switch (s) {
    case UpdateState::kIdle:
      return "idle";
    case UpdateState::kBeginning:
      return "beginning";
    case UpdateState::kUpdating:
      return "updating";
    case UpdateState::kCommitting:
      return "committing";
    case UpdateState::kAborting:
      return "aborting";
    case UpdateState::kFailed:
      return "failed";
  }
  return "unknown";
}

absl::StatusOr<UpdateState> ParseUpdateState(absl::string_view name) {
  for (UpdateState s : {UpdateState::kIdle, UpdateState::kBeginning, UpdateState::kUpdating, UpdateState::kCommitting,
                        UpdateState::kAborting, UpdateState::kFailed})
    if (UpdateStateName(s) == name) return s;
  return absl::InvalidArgumentError(absl::StrCat("unknown update state '", name, "'"));
}

bool UpdateInProgress(UpdateState s) {
  return s == UpdateState::kBeginning || s == UpdateState::kUpdating || s == UpdateState::kCommitting ||
         s == UpdateState::kAborting;
}

bool LegalUpdateTransition(UpdateState from, UpdateState to) {
  using S = UpdateState;
  switch (from) {
    case S::kIdle:
      return to == S::kBeginning;
    case S::kFailed:
      return to == S::kBeginning || to == S::kAborting;
    case S::kBeginning:
      // idle or failed: the store refused to record the begin, the state goes back to what it was.
      return to == S::kUpdating || to == S::kFailed || to == S::kAborting || to == S::kIdle;
    case S::kUpdating:
      return to == S::kCommitting || to == S::kAborting;
    case S::kCommitting:
      return to == S::kIdle || to == S::kFailed || to == S::kAborting;
    case S::kAborting:
      return to == S::kFailed;
  }
  return false;
}

std::string EngineStateName(const EngineView& e) {
  switch (e.state) {
    case EngineState::kRegistered:
      return "registered";
    case EngineState::kPaused:
      return "paused";
    case EngineState::kServing:
      return "serving";
    case EngineState::kFailed:
      return absl::StrCat("failed: ", e.failed_phase);
  }
  return "unknown";
}

absl::StatusOr<EngineView> ParseEngineState(absl::string_view name) {
  EngineView e;
  if (name == "registered") return e;
  if (name == "paused") {
    e.state = EngineState::kPaused;
    return e;
  }
  if (name == "serving") {
    e.state = EngineState::kServing;
    return e;
  }
  if (absl::ConsumePrefix(&name, "failed: ")) {
    e.state = EngineState::kFailed;
    e.failed_phase = std::string(name);
    return e;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown engine state '", name, "'"));
}

}  // namespace wsync::daemon
