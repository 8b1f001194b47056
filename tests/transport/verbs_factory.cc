// The conformance suite's transport for the verbs backend, created through the same factory the daemon uses.

#include <cstdio>
#include <cstdlib>

#include "spdlog/spdlog.h"
#include "tests/transport/conformance.h"
#include "tests/transport/verbs_test_util.h"

std::unique_ptr<wsync::transport::Transport> MakeTransportUnderTest() {
  wsync::transport::TransportOptions opts;
  opts.io_timeout = absl::Seconds(10);
  auto t = wsync::transport::CreateTransport("verbs", opts);
  if (!t.ok()) {
    spdlog::critical("cannot create the verbs transport: {}", t.status().ToString());
    std::abort();
  }
  wsync::transport::verbs::testing::SkipUnlessViable(**t);
  return std::move(*t);
}
