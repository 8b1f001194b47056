#include "base/fault_knob.h"

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace wsync {

FaultKnob::FaultKnob(const char* env_var, std::string id, std::string who)
    : id_(std::move(id)), who_(std::move(who)) {
  if (const char* p = std::getenv(env_var); p != nullptr) path_ = p;
  if (!path_.empty())
    spdlog::warn("!!! {} is set ({}): calls fail or hang on demand; for tests only !!!", env_var, path_);
}

absl::Status FaultKnob::At(absl::string_view call, const std::function<bool()>& cancelled) {
  if (path_.empty()) return absl::OkStatus();
  std::string action;
  {
    std::ifstream f(path_);
    if (!f) return absl::OkStatus();
    std::stringstream ss;
    ss << f.rdbuf();
    const std::string content = ss.str();
    MutexLock l(&mu_);
    if (content.empty() || content == fired_) return absl::OkStatus();
    std::istringstream lines(content);
    std::string line;
    while (action.empty() && std::getline(lines, line)) {
      std::istringstream words(line);
      std::string id, name, act;
      if (!(words >> id >> name >> act)) continue;
      if ((id == "*" || id == id_) && name == call) action = act;
    }
    if (action.empty()) return absl::OkStatus();
    fired_ = content;
  }
  spdlog::info("{} reached {} ({})", who_, std::string(call), action);
  if (action == "hang") {
    const absl::Time until = absl::Now() + kHangBound;
    while (!cancelled() && absl::Now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return absl::CancelledError(absl::StrCat("injected hang at ", call, ": the caller gave up"));
  }
  return absl::InternalError(absl::StrCat("injected fault at ", call));
}

}  // namespace wsync
