// The conformance suite's transport for the fabric backend, created through the same factory the daemon uses, on
// the provider named by WSYNC_FABRIC_TEST_PROVIDER (default tcp;ofi_rxm, which every Debian libfabric1 has).
// libfabric is a test dependency (tools/cli/quickstart.sh installs it): a transport that is not viable here is a
// failure, never a skip.

#include <cstdlib>

#include "spdlog/spdlog.h"
#include "tests/transport/conformance.h"
#include "tests/transport/fabric_test_util.h"

std::unique_ptr<wsync::transport::Transport> MakeTransportUnderTest() {
  auto t = wsync::transport::fabric::testing::MakeFabric();
  if (!t->viable()) {
    spdlog::critical("the fabric transport is not viable here: {} (install libfabric1: tools/cli/quickstart.sh)",
                     t->reason());
    std::abort();
  }
  return t;
}
