#pragma once
// Shared by the fabric transport tests.

#include <cstdlib>
#include <memory>
#include <string>

#include "spdlog/spdlog.h"
#include "transport/transport.h"

namespace wsync::transport::fabric::testing {

// The provider the tests run on: WSYNC_FABRIC_TEST_PROVIDER, else tcp;ofi_rxm.
inline std::string TestProvider() {
  const char* p = std::getenv("WSYNC_FABRIC_TEST_PROVIDER");
  return p != nullptr && *p != '\0' ? p : "tcp;ofi_rxm";
}

// A fabric transport on the test provider; aborts on an options error (the environment is the test's own).
inline std::unique_ptr<Transport> MakeFabric(const std::string& provider = TestProvider()) {
  TransportOptions opts;
  opts.io_timeout = absl::Seconds(15);
  opts.fabric_provider = provider;
  auto t = CreateTransport("fabric", opts);
  if (!t.ok()) {
    spdlog::critical("cannot create the fabric transport: {}", t.status().ToString());
    std::abort();
  }
  return std::move(*t);
}

}  // namespace wsync::transport::fabric::testing
