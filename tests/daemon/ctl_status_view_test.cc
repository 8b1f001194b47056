// `wsyncctl status`'s target-node view: NodeStatus.cuda_segments and gpu_direct as the table and the JSON show them.
// The statuses are built here as a GPU target reports them (tests/cuda/cuda_segment_test checks the daemon's side).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <sstream>
#include <string>
#include <thread>

#include "base/fd_passing.h"
#include "tools/cli/cli_support.h"
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

// wsyncctl's JSON, status headline, engines table and connection errors (tools/cli/cli_support.h, status_view.h).
namespace wsync::tools {
namespace {

TEST_CASE("ProtoToJson: 64-bit integers are numbers, every field present, maps are objects") {
  v1::ClusterStatus s;
  s.set_membership_epoch(7);
  s.set_open_version(12);
  s.set_failed_version(-1);
  (*s.mutable_source_plan_epochs())["train0"] = 3;
  auto* n = s.add_nodes();
  n->set_node_id("infer0");
  n->add_engine_details()->set_engine_id("e0");
  auto* t = s.add_plan();
  t->set_bytes(uint64_t{5} << 40);
  const nlohmann::json j = ProtoToJson(s);
  CHECK(j["membership_epoch"].is_number_integer());
  CHECK(j["membership_epoch"] == 7);
  CHECK(j["open_version"] == 12);
  CHECK(j["failed_version"] == -1);
  CHECK(j["plan_epoch"] == 0);        // default-valued, still present
  CHECK(j["current_version"] == "");  // a string field stays a string
  CHECK(j["engines_hold_partial_writes"] == false);
  CHECK(j["source_plan_epochs"]["train0"] == 3);
  CHECK(j["plan"][0]["bytes"].get<uint64_t>() == (uint64_t{5} << 40));
  CHECK(j["nodes"][0]["engine_details"][0]["engine_id"] == "e0");
  CHECK(j["nodes"][0]["engine_details"][0]["ranks"] == 0);
  v1::UpdateRecord r;
  r.set_version(9);
  r.set_started_unix_ms(1733000000000);
  const nlohmann::json rj = ProtoToJson(r);
  CHECK(rj["version"].is_number_integer());
  CHECK(rj["started_unix_ms"] == 1733000000000);
  CHECK(rj["aborted_by"] == "");
}

TEST_CASE("status headline: the update in progress, the failure with its reason and the partial-write flag") {
  v1::ClusterStatus s;
  s.set_state("updating");
  s.set_current_version("4");
  s.set_open_version(5);
  s.set_failed_version(-1);
  std::string h = FormatClusterHeadline(s);
  INFO(h);
  CHECK(h.find("version: 4") != std::string::npos);
  CHECK(h.find("in progress: update 5 (updating)") != std::string::npos);
  CHECK(h.find("failed") == std::string::npos);

  s.set_state("failed");
  s.set_open_version(-1);
  s.set_failed_version(5);
  s.set_failure("ABORTED: update 5 failed; engines stay paused at version 4 until a successful update: lease lost");
  s.set_engines_hold_partial_writes(true);
  h = FormatClusterHeadline(s);
  INFO(h);
  CHECK(h.find("in progress") == std::string::npos);
  CHECK(h.find("failed: update 5: ABORTED: update 5 failed") != std::string::npos);
  CHECK(h.find("lease lost") != std::string::npos);
  CHECK(h.find("may hold partial writes") != std::string::npos);

  s.set_engines_hold_partial_writes(false);
  h = FormatClusterHeadline(s);
  CHECK(h.find("no byte of the failed update reached the engines") != std::string::npos);
  CHECK(h.find("not resumed") == std::string::npos);

  // Past the commit point: committed, with engines left paused at the new version.
  s.set_state("idle");
  s.set_failed_version(-1);
  s.set_current_version("6");
  s.add_not_resumed("e1");
  s.add_not_resumed("e3");
  h = FormatClusterHeadline(s);
  INFO(h);
  CHECK(h.find("committed, 2 engines not resumed at version 6 (e1, e3): `wsyncctl resume` continues them") !=
        std::string::npos);
}

TEST_CASE("engines table: the version each engine serves") {
  v1::ClusterStatus s;
  auto* n = s.add_nodes();
  n->set_node_id("infer0");
  auto* e = n->add_engine_details();
  e->set_engine_id("engine0");
  e->set_state("serving");
  e->set_weight_version("17");
  auto* f = n->add_engine_details();
  f->set_engine_id("engine1");
  f->set_state("registered");
  const std::string t = FormatEngines(s);
  INFO(t);
  CHECK(t.find("VERSION") != std::string::npos);
  std::istringstream lines(t);
  std::string header, l0, l1;
  std::getline(lines, header);
  std::getline(lines, l0);
  std::getline(lines, l1);
  CHECK(l0.find("engine0") == 0);
  CHECK(l0.find(" 17 ") != std::string::npos);
  CHECK(l1.find(" - ") != std::string::npos);  // no version yet
}

TEST_CASE("connection errors: a hint instead of gRPC's text, configuration (2) told from outage (3)") {
  const absl::Status closed = absl::UnavailableError("failed to connect to all addresses; last error: Socket closed");
  CallError e = DescribeCallError(closed, "127.0.0.1:7600", false, "--endpoints", EndpointProbe::kRefused);
  CHECK(e.exit_code == 3);
  CHECK(e.message.find("--endpoints or WSYNC_COORDINATOR") != std::string::npos);
  CHECK(e.message.find("127.0.0.1:7600") != std::string::npos);

  e = DescribeCallError(closed, "127.0.0.1:7600", false, "--endpoints", EndpointProbe::kTlsRequired);
  CHECK(e.exit_code == 2);
  CHECK(e.message.find("a client certificate is required") != std::string::npos);
  CHECK(e.message.find("Socket closed") == std::string::npos);

  e = DescribeCallError(closed, "127.0.0.1:7600", true, "--endpoints", EndpointProbe::kTlsRequired);
  CHECK(e.exit_code == 2);
  CHECK(e.message.find("did not accept this client's certificate") != std::string::npos);

  const absl::Status foreign = absl::UnavailableError(
      "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:7600: Ssl handshake failed: "
      "SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED");
  e = DescribeCallError(foreign, "127.0.0.1:7600", true, "--endpoints", EndpointProbe::kNotProbed);
  CHECK(e.exit_code == 2);
  CHECK(e.message.find("not signed by the CA this client trusts") != std::string::npos);
  CHECK(e.message.find('\n') == std::string::npos);

  // A metrics or status-page port: HTTP/1.1, neither TLS nor gRPC, whatever this client's TLS.
  for (bool tls : {false, true}) {
    e = DescribeCallError(closed, "127.0.0.1:9600", tls, "--endpoints", EndpointProbe::kHttp1);
    CHECK(e.exit_code == 2);
    CHECK(e.message.find("answers HTTP/1.1, not gRPC") != std::string::npos);
    CHECK(e.message.find("TLS") == std::string::npos);
  }

  e = DescribeCallError(closed, "127.0.0.1:7600", true, "--endpoints", EndpointProbe::kPlaintext);
  CHECK(e.exit_code == 2);
  CHECK(e.message.find("serves without TLS") != std::string::npos);

  // The server's own errors pass through unchanged.
  e = DescribeCallError(absl::FailedPreconditionError("no update is open"), "x:1", false, "--endpoints",
                        EndpointProbe::kNotProbed);
  CHECK(e.exit_code == 1);
  CHECK(e.message == "FAILED_PRECONDITION: no update is open");
  CHECK(!IsConnectionFailure(absl::FailedPreconditionError("no update is open")));
  CHECK(IsConnectionFailure(closed));
}

TEST_CASE("ProbeEndpoint: nothing listening, and a server that closes a plaintext connection") {
  // A port nobody listens on.
  ScopedFd probe(socket(AF_INET, SOCK_STREAM, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(bind(probe.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  socklen_t len = sizeof(a);
  REQUIRE(getsockname(probe.get(), reinterpret_cast<sockaddr*>(&a), &len) == 0);
  const std::string dead = "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
  probe.reset();
  CHECK(ProbeEndpoint(dead, 1000) == EndpointProbe::kRefused);

  // A listener that reads the preface and closes, as a TLS server does with plaintext.
  ScopedFd l(socket(AF_INET, SOCK_STREAM, 0));
  a.sin_port = 0;
  REQUIRE(bind(l.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  REQUIRE(listen(l.get(), 1) == 0);
  len = sizeof(a);
  REQUIRE(getsockname(l.get(), reinterpret_cast<sockaddr*>(&a), &len) == 0);
  std::thread server([&] {
    ScopedFd c(accept(l.get(), nullptr, nullptr));
    char buf[64];
    (void)!read(c.get(), buf, sizeof(buf));
  });
  CHECK(ProbeEndpoint("127.0.0.1:" + std::to_string(ntohs(a.sin_port)), 2000) == EndpointProbe::kTlsRequired);
  server.join();

  // An HTTP/1.1 server (a --metrics-listen port): it answers the preface's request line with a status line.
  std::thread http([&] {
    ScopedFd c(accept(l.get(), nullptr, nullptr));
    char buf[64];
    (void)!read(c.get(), buf, sizeof(buf));
    const char kReply[] = "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
    (void)!write(c.get(), kReply, sizeof(kReply) - 1);
  });
  CHECK(ProbeEndpoint("127.0.0.1:" + std::to_string(ntohs(a.sin_port)), 2000) == EndpointProbe::kHttp1);
  http.join();
}

TEST_CASE("empty clusters and resume: a next step instead of a bare header or an empty list") {
  v1::ResumeEnginesReply none;
  const std::string idle = FormatResumed(none);
  INFO(idle);
  CHECK(idle.find("nothing to resume") == 0);
  CHECK(idle.find("wsyncd --role target") != std::string::npos);
  CHECK(idle.find("-:") == std::string::npos);
  v1::ResumeEnginesReply two;
  two.add_engines("engine0");
  two.add_engines("engine1");
  CHECK(FormatResumed(two) == "resumed 2 engines at version - (no update has committed yet): engine0, engine1");
  two.set_version("7");
  CHECK(FormatResumed(two) == "resumed 2 engines at version 7: engine0, engine1");
  CHECK(std::string(kNoNodesHint).find("wsyncd --role source") != std::string::npos);
  CHECK(std::string(kNoEnginesHint).find("--engine") != std::string::npos);
}

}  // namespace
}  // namespace wsync::tools
