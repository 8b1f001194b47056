#pragma once
// One place that configures spdlog for every binary: level from --log-level / WSYNC_LOG_LEVEL, format from
// --log-format / WSYNC_LOG_FORMAT (text or json), a component tag, and the weight-update version a line belongs to.
//
// Text:  2026-12-04T04:20:01.123 I [coordinator 4242] [update 7] update 7 open ...
// JSON:  {"ts":"2026-12-04T04:20:01.123Z","level":"info","component":"coordinator","thread":4242,"update":7,
//         "msg":"update 7 open ..."}      (one object per line; "update" only while an update is open)

#include <cstdint>
#include <memory>
#include <string>

#include "spdlog/formatter.h"
#include "spdlog/spdlog.h"

namespace wsync {

enum class LogFormat { kText, kJson };

// Sets the format InitLogging uses (the --log-format flag); unset: $WSYNC_LOG_FORMAT, else text.
void SetLogFormat(LogFormat f);

// Sets the default logger's pattern and level. `level` is an spdlog level name ("info", "debug", ...);
// empty means WSYNC_LOG_LEVEL from the environment, else "info". `component` appears in every line.
void InitLogging(const std::string& component, const std::string& level = "");

// The update this process is working on (-1: none); every log line carries it while set. The coordinator sets it
// from BeginUpdate to the update's end, a source daemon from StartUpdate to FinishUpdate/abort.
void SetLogUpdateVersion(int64_t version);

// The formatter InitLogging installs for `format` (exposed for tests).
std::unique_ptr<spdlog::formatter> MakeLogFormatter(LogFormat format, const std::string& component);

// `s` as the body of a JSON string (quotes, backslashes and control characters escaped).
std::string JsonEscape(const std::string& s);

}  // namespace wsync
