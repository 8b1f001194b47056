// Log formats: JSON lines that parse, with the open update's version; text lines tagged with it.
#include <catch2/catch.hpp>

#include <string>

#include "base/logging.h"
#include "nlohmann/json.hpp"

namespace wsync {
namespace {

std::string Format(LogFormat f, const std::string& text) {
  auto fmt = MakeLogFormatter(f, "comp");
  spdlog::details::log_msg msg(spdlog::source_loc{}, "comp", spdlog::level::warn, text);
  spdlog::memory_buf_t buf;
  fmt->format(msg, buf);
  return std::string(buf.data(), buf.size());
}

TEST_CASE("logging: JSON lines parse and carry the update version while one is open", "[logging]") {
  SetLogUpdateVersion(-1);
  const std::string tricky = "quote \" backslash \\ newline \n tab \t ctrl \x01 end";
  std::string line = Format(LogFormat::kJson, tricky);
  REQUIRE(!line.empty());
  CHECK(line.back() == '\n');
  CHECK(line.find('\n') == line.size() - 1);  // one line, whatever the message holds
  auto j = nlohmann::json::parse(line);
  CHECK(j["msg"] == tricky);
  CHECK(j["level"] == "warning");
  CHECK(j["component"] == "comp");
  CHECK_FALSE(j.contains("update"));
  SetLogUpdateVersion(42);
  j = nlohmann::json::parse(Format(LogFormat::kJson, "x"));
  CHECK(j["update"] == 42);
  SetLogUpdateVersion(-1);
}

TEST_CASE("logging: text lines are tagged with the open update", "[logging]") {
  SetLogUpdateVersion(7);
  CHECK(Format(LogFormat::kText, "hello").find("[update 7] hello") != std::string::npos);
  SetLogUpdateVersion(-1);
  CHECK(Format(LogFormat::kText, "hello").find("[update") == std::string::npos);
}

}  // namespace
}  // namespace wsync
