// Runs the conformance suite through the fault decorator with an empty spec: the wrapper must be transparent.
#include <cstdlib>

#include "spdlog/spdlog.h"
#include "tests/transport/conformance.h"
#include "transport/fault/fault_transport.h"

std::unique_ptr<wsync::transport::Transport> MakeTransportUnderTest() {
  wsync::transport::TransportOptions opts;
  opts.bind_host = "127.0.0.1";
  opts.io_timeout = absl::Seconds(15);
  auto t = wsync::transport::CreateTransport("tcp", opts);
  if (!t.ok()) {
    spdlog::critical("cannot create the tcp transport: {}", t.status().ToString());
    std::abort();
  }
  return wsync::transport::WrapWithFaults(std::move(*t), wsync::transport::FaultSpec{});
}
