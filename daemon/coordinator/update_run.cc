#include "daemon/coordinator/update_run.h"

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

}  // namespace wsync::daemon
