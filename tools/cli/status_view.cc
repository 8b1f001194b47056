#include "tools/cli/status_view.h"

#include "absl/strings/str_format.h"

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

}  // namespace wsync::tools
