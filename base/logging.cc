#include "base/logging.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>

#include "spdlog/pattern_formatter.h"
#include "spdlog/sinks/stdout_color_sinks.h"

namespace wsync {
namespace {

std::atomic<int64_t> g_update{-1};
std::atomic<int> g_format{-1};  // -1: not set by a flag

// %U: "[update N] " while an update is open, else nothing.
class UpdateFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg&, const std::tm&, spdlog::memory_buf_t& dest) override {
    const int64_t v = g_update.load(std::memory_order_relaxed);
    if (v < 0) return;
    char buf[40];
    const int n = std::snprintf(buf, sizeof buf, "[update %lld] ", static_cast<long long>(v));
    dest.append(buf, buf + n);
  }
  std::unique_ptr<custom_flag_formatter> clone() const override { return std::make_unique<UpdateFlag>(); }
};

// One JSON object per line.
class JsonFormatter final : public spdlog::formatter {
 public:
  explicit JsonFormatter(std::string component) : component_(std::move(component)) {}
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    const auto t = std::chrono::system_clock::to_time_t(msg.time);
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(msg.time.time_since_epoch()).count() % 1000;
    std::tm tm{};
    gmtime_r(&t, &tm);
    char ts[64];
    std::snprintf(ts, sizeof ts, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
                  tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<int>(ms));
    const auto level = spdlog::level::to_string_view(msg.level);
    std::string line = std::string("{\"ts\":\"") + ts + "\",\"level\":\"" + std::string(level.data(), level.size()) +
                       "\",\"component\":\"" + JsonEscape(component_) + "\",\"thread\":" + std::to_string(msg.thread_id);
    const int64_t v = g_update.load(std::memory_order_relaxed);
    if (v >= 0) line += ",\"update\":" + std::to_string(v);
    line += ",\"msg\":\"" + JsonEscape(std::string(msg.payload.data(), msg.payload.size())) + "\"}\n";
    dest.append(line.data(), line.data() + line.size());
  }
  std::unique_ptr<spdlog::formatter> clone() const override { return std::make_unique<JsonFormatter>(component_); }

 private:
  std::string component_;
};

}  // namespace

std::unique_ptr<spdlog::formatter> MakeLogFormatter(LogFormat format, const std::string& component) {
  if (format == LogFormat::kJson) return std::make_unique<JsonFormatter>(component);
  auto f = std::make_unique<spdlog::pattern_formatter>();
  f->add_flag<UpdateFlag>('U').set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%L%$ [%n %t] %U%v");
  return f;
}

void SetLogFormat(LogFormat f) { g_format = static_cast<int>(f); }

void SetLogUpdateVersion(int64_t version) { g_update = version; }

std::string JsonEscape(const std::string& s) {
  std::string out;
  out.reserve(s.size() + 8);
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out;
}

void InitLogging(const std::string& component, const std::string& level) {
  std::string lvl = level;
  if (lvl.empty()) {
    const char* env = std::getenv("WSYNC_LOG_LEVEL");
    lvl = env ? env : "info";
  }
  LogFormat format = LogFormat::kText;
  if (g_format >= 0) {
    format = static_cast<LogFormat>(g_format.load());
  } else if (const char* env = std::getenv("WSYNC_LOG_FORMAT"); env != nullptr && std::strcmp(env, "json") == 0) {
    format = LogFormat::kJson;
  }
  auto logger = spdlog::stderr_color_mt(component);
  spdlog::set_default_logger(logger);
  spdlog::set_formatter(MakeLogFormatter(format, component));
  spdlog::set_level(spdlog::level::from_str(lvl));
}

}  // namespace wsync
