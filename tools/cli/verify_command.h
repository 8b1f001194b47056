#pragma once
// `wsyncctl verify` against the checksums the writers recorded: every source daemon reports, per engine rank and
// parameter byte range, the XXH3-128 of the bytes it wrote in an update (NodeDaemon.GetWriteChecksums), and so does
// every target daemon that relayed into other engines (relay trees: what it forwarded, checked against its own
// engine first); every engine hashes the same ranges of its own memory (EngineControl.GetChecksums with ranges).
// Works for any weights (nothing is regenerated), unlike the reference engine's synthetic Verify.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/coordinator_client.h"

namespace wsync::tools {

enum class ParamVerdict { kMatch, kMismatch, kMissing };
const char* VerdictName(ParamVerdict v);

struct ParamResult {
  std::string engine_id;
  int rank = 0;
  std::string param;
  ParamVerdict verdict = ParamVerdict::kMatch;
  uint64_t bytes = 0;  // the parameter's size in the engine's layout (0: unknown)
  std::string detail;  // why it is not a match: the first differing range, or what is missing
};

struct VerifyReport {
  int64_t version = -1;
  std::vector<std::string> sources;  // node ids whose checksums were used
  std::vector<std::string> relays;   // target node ids whose relays' records were used (relay trees)
  std::vector<std::string> notes;    // e.g. "source X: update V did not finish there"
  std::vector<ParamResult> params;   // every (engine, rank, parameter), in engine/rank/layout order
  int64_t matched = 0, mismatched = 0, missing = 0;
  uint64_t bytes_compared = 0;
  bool ok() const { return mismatched == 0 && missing == 0 && !params.empty(); }
};

struct VerifyOptions {
  int64_t version = -1;  // -1: the coordinator's current version
  std::string engine;    // "": every engine; else an engine id or control address
  absl::Duration dial_timeout = absl::Seconds(5);
  absl::Duration call_timeout = absl::Seconds(600);  // hashing a large engine takes a while
};

// Errors: the coordinator, a source or an engine could not be asked (Unavailable/DeadlineExceeded when unreachable),
// no version to verify, an engine filter matching nothing (InvalidArgument).
absl::StatusOr<VerifyReport> VerifyAgainstSources(client::CoordinatorClient& coordinator, const VerifyOptions& opts);

}  // namespace wsync::tools
