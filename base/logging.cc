#include "base/logging.h"

#include <cstdlib>

#include "spdlog/sinks/stdout_color_sinks.h"

namespace wsync {

void InitLogging(const std::string& component, const std::string& level) {
  std::string lvl = level;
  if (lvl.empty()) {
    const char* env = std::getenv("WSYNC_LOG_LEVEL");
    lvl = env ? env : "info";
  }
  auto logger = spdlog::stderr_color_mt(component);
  spdlog::set_default_logger(logger);
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%L%$ [%n %t] %v");
  spdlog::set_level(spdlog::level::from_str(lvl));
}

}  // namespace wsync
