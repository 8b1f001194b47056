#include "tools/testing/engine_ref/ref_faults.h"

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace wsync::engine_ref {

RefFaults::RefFaults(std::string engine_id) : engine_id_(std::move(engine_id)) {
  if (const char* p = std::getenv("WSYNC_REF_FAULTS_FILE"); p != nullptr) path_ = p;
  if (!path_.empty())
    spdlog::warn("!!! WSYNC_REF_FAULTS_FILE is set ({}): control calls fail or hang on demand; for tests only !!!",
                 path_);
}

grpc::Status RefFaults::At(absl::string_view call, const std::function<bool()>& cancelled) {
  if (path_.empty()) return grpc::Status::OK;
  std::string action;
  {
    std::ifstream f(path_);
    if (!f) return grpc::Status::OK;
    std::stringstream ss;
    ss << f.rdbuf();
    const std::string content = ss.str();
    std::lock_guard<std::mutex> l(mu_);
    if (content.empty() || content == fired_) return grpc::Status::OK;
    std::istringstream lines(content);
    std::string line;
    while (action.empty() && std::getline(lines, line)) {
      std::istringstream words(line);
      std::string engine, name, act;
      if (!(words >> engine >> name >> act)) continue;
      if ((engine == "*" || engine == engine_id_) && name == call) action = act;
    }
    if (action.empty()) return grpc::Status::OK;
    fired_ = content;
  }
  spdlog::info("ref_fault: engine {} reached {} ({})", engine_id_, std::string(call), action);
  if (action == "hang") {
    while (!cancelled()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return grpc::Status(grpc::StatusCode::CANCELLED, absl::StrCat("injected hang at ", call, ": the caller gave up"));
  }
  return grpc::Status(grpc::StatusCode::INTERNAL, absl::StrCat("injected fault at ", call));
}

}  // namespace wsync::engine_ref
