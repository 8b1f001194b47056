#include "base/cli.h"

#include "base/logging.h"

#ifndef WSYNC_VERSION
#define WSYNC_VERSION "unknown"
#endif
#ifndef WSYNC_GIT_COMMIT
#define WSYNC_GIT_COMMIT ""
#endif

namespace wsync::cli {

std::string Version() { return WSYNC_VERSION; }
std::string GitCommit() { return WSYNC_GIT_COMMIT; }

std::string VersionString(const std::string& program) {
  std::string s = program + " " + WSYNC_VERSION;
  const std::string commit = WSYNC_GIT_COMMIT;
  if (!commit.empty()) s += " (commit " + commit + ")";
  return s;
}

void AddCommonFlags(CLI::App& app, const std::string& program, std::string* log_level) {
  app.name(program);
  app.option_defaults()->always_capture_default();
  app.set_version_flag("--version", VersionString(program), "print the version and exit");
  app.add_option("--log-level", *log_level, "trace|debug|info|warn|error|critical|off; empty: $WSYNC_LOG_LEVEL or info")
      ->check(CLI::IsMember({"", "trace", "debug", "info", "warn", "error", "critical", "off"}));
  app.add_option_function<std::string>(
         "--log-format", [](const std::string& f) { SetLogFormat(f == "json" ? LogFormat::kJson : LogFormat::kText); },
         "text|json (one JSON object per line, with the update version while one is open); default: "
         "$WSYNC_LOG_FORMAT or text")
      ->check(CLI::IsMember({"text", "json"}));
  app.footer("exit codes: 0 ok, 1 failure, 2 bad usage, 3 endpoint unavailable\n");
}

int Parse(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // prints help/version (rc 0) or the error and the --help hint
    return rc == 0 ? kExitOk : kExitUsage;
  }
  return -1;
}

}  // namespace wsync::cli
