#pragma once
// One place that configures spdlog for every binary: level from --log-level / WSYNC_LOG_LEVEL, a component tag.

#include <string>

#include "spdlog/spdlog.h"

namespace wsync {

// Sets the default logger's pattern and level. `level` is an spdlog level name ("info", "debug", ...);
// empty means WSYNC_LOG_LEVEL from the environment, else "info". `component` appears in every line.
void InitLogging(const std::string& component, const std::string& level = "");

}  // namespace wsync
