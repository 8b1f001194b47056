// `wsyncctl status`'s target-node view: NodeStatus.cuda_segments and gpu_direct as the table and the JSON show them.
// The statuses are built here as a GPU target reports them (tests/cuda/cuda_segment_test checks the daemon's side).
#include <catch2/catch.hpp>
#include <string>

#include "tools/cli/status_view.h"

namespace wsync::tools {
namespace {

std::vector<TargetPath> Sample() {
  TargetPath gpu;
  gpu.node_id = "gpu-node";
  gpu.reachable = true;
  gpu.status.add_cuda_segments("engine e0 rank 0 segment 0: gpudirect");
  gpu.status.add_cuda_segments("engine e0 rank 1 segment 0: staging (no GPUDirect: nvidia_peermem not loaded)");
  gpu.status.set_gpu_direct(false);
  TargetPath direct;
  direct.node_id = "direct-node";
  direct.reachable = true;
  direct.status.add_cuda_segments("engine e1 rank 0 segment 0: gpudirect");
  direct.status.set_gpu_direct(true);
  TargetPath host;
  host.node_id = "host-node";
  host.reachable = true;
  TargetPath gone;
  gone.node_id = "gone-node";
  gone.error = "failed to connect";
  return {gpu, direct, host, gone};
}

TEST_CASE("status table: GPUDirect and every CUDA segment per target node") {
  const std::string t = FormatTargetPaths(Sample());
  INFO(t);
  CHECK(t.find("TARGET NODE") == 0);
  CHECK(t.find("GPUDIRECT") != std::string::npos);
  // First segment on the node's line, the second on its own line under it.
  const size_t gpu = t.find("gpu-node");
  REQUIRE(gpu != std::string::npos);
  const std::string gpu_line = t.substr(gpu, t.find('\n', gpu) - gpu);
  CHECK(gpu_line.find(" no ") != std::string::npos);
  CHECK(gpu_line.find("engine e0 rank 0 segment 0: gpudirect") != std::string::npos);
  const size_t next = t.find('\n', gpu) + 1;
  const std::string second = t.substr(next, t.find('\n', next) - next);
  CHECK(second.find("engine e0 rank 1 segment 0: staging (no GPUDirect: nvidia_peermem not loaded)") !=
        std::string::npos);
  CHECK(second.substr(0, 28) == std::string(28, ' '));  // no node id repeated: it starts blank
  const size_t direct = t.find("direct-node");
  CHECK(t.substr(direct, t.find('\n', direct) - direct).find(" yes ") != std::string::npos);
  const size_t host = t.find("host-node");
  CHECK(t.substr(host, t.find('\n', host) - host).find("none (host memory)") != std::string::npos);
  const size_t gone = t.find("gone-node");
  CHECK(t.substr(gone, t.find('\n', gone) - gone).find("unreachable: failed to connect") != std::string::npos);
}

TEST_CASE("status JSON: gpu_direct and cuda_segments per target node") {
  const nlohmann::json j = TargetPathsJson(Sample());
  REQUIRE(j.is_array());
  REQUIRE(j.size() == 4);
  CHECK(j[0]["node_id"] == "gpu-node");
  CHECK(j[0]["reachable"] == true);
  CHECK(j[0]["gpu_direct"] == false);
  CHECK(j[0]["cuda_segments"] == nlohmann::json::array({"engine e0 rank 0 segment 0: gpudirect",
                                                        "engine e0 rank 1 segment 0: staging (no GPUDirect: "
                                                        "nvidia_peermem not loaded)"}));
  CHECK(j[1]["gpu_direct"] == true);
  CHECK(j[1]["cuda_segments"].size() == 1);
  CHECK(j[2]["gpu_direct"] == false);
  CHECK(j[2]["cuda_segments"].empty());
  CHECK(j[3]["reachable"] == false);
  CHECK(j[3]["error"] == "failed to connect");
  CHECK(!j[3].contains("gpu_direct"));
}

}  // namespace
}  // namespace wsync::tools
