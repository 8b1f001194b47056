#pragma once
// What `wsyncctl status` shows of each target node beyond the coordinator's view: how writes reach every attached
// CUDA segment and whether all of them are written by GPUDirect RDMA (NodeStatus.cuda_segments / gpu_direct, asked
// of the node itself). Formatting only; the RPCs are the caller's.

#include <string>
#include <vector>

#include "nlohmann/json.hpp"
#include "wsync/v1/coordinator.pb.h"
#include "wsync/v1/daemon.pb.h"

namespace wsync::tools {

struct TargetPath {
  std::string node_id;
  bool reachable = false;  // false: the node's GetNodeStatus failed; `status` is empty
  std::string error;       // why, when unreachable
  v1::NodeStatus status;
};

// Table: one line per target node (GPUDirect yes/no, first segment), one more line per further segment.
std::string FormatTargetPaths(const std::vector<TargetPath>& targets);
// [{"node_id", "reachable", "gpu_direct", "cuda_segments": [...]} (+ "error" when unreachable)].
nlohmann::json TargetPathsJson(const std::vector<TargetPath>& targets);

// `wsyncctl status`'s first lines: state, the version served, the update in progress (its version; the state is its
// phase), and after a failure the failed version, why, and whether the engines may hold partial writes.
std::string FormatClusterHeadline(const v1::ClusterStatus& s);

// The engines table of `wsyncctl engines` and `status`: id, kind, ranks, address, node, state and the version each
// serves (EngineSummary.weight_version).
std::string FormatEngines(const v1::ClusterStatus& s);

// What an empty cluster's tables add under their headers: what registers nodes and engines, so a new user sees the
// next step rather than a bare header.
inline constexpr char kNoNodesHint[] =
    "(no node registered: start `wsyncd --role source` on each trainer node and `wsyncd --role target --engine ADDR` "
    "on each inference node, with --coordinator this address; deploy/README.md)";
inline constexpr char kNoEnginesHint[] =
    "(no engine registered: engines are registered by their target daemon, `wsyncd --role target --engine ADDR "
    "--coordinator this address`)";

// `wsyncctl resume`'s line: which engines were resumed at which version, or that there was none to resume.
std::string FormatResumed(const v1::ResumeEnginesReply& r);

}  // namespace wsync::tools
