#pragma once
// What every wsync binary's command line shares: exit codes, --version, a validated --log-level, defaults shown in
// --help, and one way to turn a parse error into an exit status.
//
// Exit codes (documented in docs/operations.md, "Exit codes"; the same for wsyncctl, wsyncd, wsync-coordinator and
// the tools):
//   0  success (also --help and --version)
//   1  failure: the operation or a server it called reported an error (wsyncctl), or the daemon stopped on an error
//   2  bad usage or input: unknown flag or command, invalid value, missing file
//   3  unavailable: an endpoint could not be reached in time
#include <string>

#include "CLI/CLI.hpp"

namespace wsync::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitUnavailable = 3;

// "PROGRAM 0.1.0 (commit abc1234)".
std::string VersionString(const std::string& program);
// The version of CMakeLists.txt and the commit built ("" when unknown), apart.
std::string Version();
std::string GitCommit();

// Adds --version (prints VersionString and exits 0) and --log-level (validated: trace, debug, info, warn, error,
// critical, off; empty = WSYNC_LOG_LEVEL or info), and makes every option added afterwards show its default in
// --help. Call right after constructing the app, before adding other options.
void AddCommonFlags(CLI::App& app, const std::string& program, std::string* log_level);

// Parses argv; returns -1 when the program should go on, else the exit status to return (0 for --help/--version,
// kExitUsage for any parse error, with CLI11's message and the hint to use --help on stderr).
int Parse(CLI::App& app, int argc, char** argv);

}  // namespace wsync::cli
