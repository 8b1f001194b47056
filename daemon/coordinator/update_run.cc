#include "daemon/coordinator/update_run.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace wsync::daemon {

bool UpdateRun::Enter(const std::string& addr) {
  if (abort_asked) return false;
  ++in_flight_[addr];
  return true;
}

void UpdateRun::Leave(const std::string& addr) {
  auto it = in_flight_.find(addr);
  if (it == in_flight_.end()) return;  // a call of an earlier run, counted there
  if (--it->second == 0) in_flight_.erase(it);
}

std::vector<std::string> UpdateRun::InFlight() const {
  std::vector<std::string> out;
  out.reserve(in_flight_.size());
  for (const auto& [a, n] : in_flight_) out.push_back(a);
  return out;
}

bool UpdateRun::AskAbort(const std::string& reason, const std::string& by) {
  if (abort_asked) return false;
  abort_asked = true;
  abort_reason = reason;
  abort_by = by;
  return true;
}

void UpdateRun::Ended() {
  commit_point = false;
  abort_asked = false;
  abort_reason.clear();
  abort_by.clear();
}

namespace {

const char* ModeName(UpdateMode mode) { return mode == UpdateMode::kStaged ? "staged" : "classic"; }

// The row of `phase` in `table`; -1 when none.
int RowOf(const std::vector<PhaseRow>& table, Phase phase) {
  for (size_t i = 0; i < table.size(); ++i)
    if (table[i].phase == phase) return static_cast<int>(i);
  return -1;
}

}  // namespace

UpdateDriver::UpdateDriver(UpdateMode mode, std::function<bool()> stop,
                           std::function<absl::Status(const Failure&)> on_failure)
    : mode_(mode), stop_(std::move(stop)), on_failure_(std::move(on_failure)) {}

bool UpdateDriver::Bind(Phase phase, Step step) {
  if (RowOf(PhaseTable(mode_), phase) < 0) {
    spdlog::critical("no {} phase {} in the phase table: its step is not run", ModeName(mode_),
                     std::string(PhaseName(phase)));
    return false;
  }
  steps_[phase] = std::move(step);
  return true;
}

absl::Status UpdateDriver::Walk(Phase first, Phase last) {
  const std::vector<PhaseRow>& table = PhaseTable(mode_);
  const int from = RowOf(table, first), to = RowOf(table, last);
  if (from < 0 || to < 0 || from > to)
    return absl::InternalError(absl::StrCat("no ", ModeName(mode_), " rows from ", PhaseName(first), " to ",
                                            PhaseName(last), " in the phase table"));
  for (int i = from; i <= to; ++i) {
    const Phase phase = table[i].phase;
    auto step = steps_.find(phase);
    if (step == steps_.end()) continue;  // a row this update does not run
    ran_.push_back(phase);
    absl::Status st = step->second(PolicyFor(mode_, phase));
    if (!st.ok() || stop_()) return FailAt(phase, std::move(st));
  }
  return absl::OkStatus();
}

absl::Status UpdateDriver::FailAt(Phase phase, absl::Status why) {
  return on_failure_(Failure{phase, PolicyFor(mode_, phase), std::move(why)});
}

}  // namespace wsync::daemon
