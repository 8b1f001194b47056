#include <cstdlib>

#include "spdlog/spdlog.h"
#include "tests/transport/conformance.h"

std::unique_ptr<wsync::transport::Transport> MakeTransportUnderTest() {
  wsync::transport::TransportOptions opts;
  opts.bind_host = "127.0.0.1";
  opts.io_timeout = absl::Seconds(15);  // generous: CI machines are shared and sanitizers are slow
  opts.send_progress_timeout = absl::Seconds(1);  // conformance.h: below the stopped-peer case's 2.5 s
  auto t = wsync::transport::CreateTransport("tcp", opts);
  if (!t.ok()) {
    spdlog::critical("cannot create the tcp transport: {}", t.status().ToString());
    std::abort();
  }
  return std::move(*t);
}
