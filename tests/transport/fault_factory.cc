// Runs the conformance suite through the fault decorator. With an empty spec the wrapper must be transparent; with
// WSYNC_FAULT_TEST_SPEC="delay_ms=N" (transport_fault_delay_test) every batch is held N ms inside the endpoint, and
// the suite's contract still holds (Post never waits, completions reach CompletionFd, Cancel drops held batches).
#include <cstdlib>

#include "spdlog/spdlog.h"
#include "tests/transport/conformance.h"
#include "transport/fault/fault_transport.h"

std::unique_ptr<wsync::transport::Transport> MakeTransportUnderTest() {
  wsync::transport::TransportOptions opts;
  opts.bind_host = "127.0.0.1";
  opts.io_timeout = absl::Seconds(15);
  opts.send_progress_timeout = absl::Seconds(1);  // conformance.h: below the stopped-peer case's 2.5 s
  auto t = wsync::transport::CreateTransport("tcp", opts);
  if (!t.ok()) {
    spdlog::critical("cannot create the tcp transport: {}", t.status().ToString());
    std::abort();
  }
  const char* text = std::getenv("WSYNC_FAULT_TEST_SPEC");
  auto spec = wsync::transport::ParseFaultSpec(text == nullptr ? "" : text);
  if (!spec.ok()) {
    spdlog::critical("WSYNC_FAULT_TEST_SPEC: {}", spec.status().ToString());
    std::abort();
  }
  return wsync::transport::WrapWithFaults(std::move(*t), *spec);
}
