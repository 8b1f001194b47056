#include "tools/cli/status_view.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace wsync::tools {

std::string FormatTargetPaths(const std::vector<TargetPath>& targets) {
  std::string out = absl::StrFormat("%-28s %-11s %s\n", "TARGET NODE", "GPUDIRECT", "CUDA SEGMENTS");
  for (const TargetPath& t : targets) {
    if (!t.reachable) {
      absl::StrAppendFormat(&out, "%-28s %-11s %s\n", t.node_id, "?", "unreachable: " + t.error);
      continue;
    }
    const auto& segs = t.status.cuda_segments();
    absl::StrAppendFormat(&out, "%-28s %-11s %s\n", t.node_id, t.status.gpu_direct() ? "yes" : "no",
                          segs.empty() ? std::string("none (host memory)") : segs[0]);
    for (int k = 1; k < segs.size(); ++k) absl::StrAppendFormat(&out, "%-28s %-11s %s\n", "", "", segs[k]);
  }
  return out;
}

nlohmann::json TargetPathsJson(const std::vector<TargetPath>& targets) {
  nlohmann::json arr = nlohmann::json::array();
  for (const TargetPath& t : targets) {
    nlohmann::json j = {{"node_id", t.node_id}, {"reachable", t.reachable}};
    if (t.reachable) {
      j["gpu_direct"] = t.status.gpu_direct();
      j["cuda_segments"] = nlohmann::json::array();
      for (const auto& s : t.status.cuda_segments()) j["cuda_segments"].push_back(s);
    } else {
      j["error"] = t.error;
    }
    arr.push_back(std::move(j));
  }
  return arr;
}

std::string FormatClusterHeadline(const v1::ClusterStatus& s) {
  std::string out =
      absl::StrFormat("state: %s   version: %s", s.state(), s.current_version().empty() ? "-" : s.current_version());
  if (s.open_version() >= 0) absl::StrAppendFormat(&out, "   in progress: update %d (%s)", s.open_version(), s.state());
  absl::StrAppendFormat(&out, "   membership epoch: %d   plan epoch: %d\n", s.membership_epoch(), s.plan_epoch());
  if (s.failed_version() >= 0)
    absl::StrAppendFormat(&out, "failed: update %d: %s\n", s.failed_version(),
                          s.failure().empty() ? std::string("(no reason recorded)") : s.failure());
  if (s.engines_hold_partial_writes())
    out +=
        "engines may hold partial writes of a failed or aborted update: they stay paused until an update "
        "succeeds (`wsyncctl resume` is refused)\n";
  else if (s.state() == "failed")
    out += "no byte of the failed update reached the engines: `wsyncctl resume` serves the old version again\n";
  // Past the commit point (docs/operations.md): the update committed, some engines hold it paused.
  if (s.not_resumed_size() > 0)
    absl::StrAppendFormat(&out,
                          "committed, %d engines not resumed at version %s (%s): `wsyncctl resume` continues them\n",
                          s.not_resumed_size(), s.current_version(), absl::StrJoin(s.not_resumed(), ", "));
  return out;
}

std::string FormatEngines(const v1::ClusterStatus& s) {
  std::string out = absl::StrFormat("%-16s %-10s %-6s %-22s %-28s %-10s %s\n", "ENGINE", "KIND", "RANKS", "ADDRESS",
                                    "NODE", "VERSION", "STATE");
  for (const auto& n : s.nodes())
    for (const auto& e : n.engine_details())
      absl::StrAppendFormat(&out, "%-16s %-10s %-6d %-22s %-28s %-10s %s\n", e.engine_id(),
                            e.kind().empty() ? "-" : e.kind(), e.ranks(), e.address(), n.node_id(),
                            e.weight_version().empty() ? "-" : e.weight_version(), e.state());
  return out;
}

std::string FormatResumed(const v1::ResumeEnginesReply& r) {
  if (r.engines_size() == 0) return absl::StrCat("nothing to resume: ", kNoEnginesHint);
  return absl::StrFormat("resumed %d engine%s at version %s: %s", r.engines_size(), r.engines_size() == 1 ? "" : "s",
                         r.version().empty() ? "- (no update has committed yet)" : r.version(),
                         absl::StrJoin(r.engines(), ", "));
}

}  // namespace wsync::tools
