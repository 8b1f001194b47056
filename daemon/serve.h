#pragma once
// Shared by the daemon binaries: start a gRPC server, publish its port, wait for SIGTERM/SIGINT.

#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"

namespace wsync::daemon {

struct Served {
  std::unique_ptr<grpc::Server> server;
  int port = 0;
};

// Listens on `listen` (host:port, port 0 = any free port) and, if `port_file` is set, writes the bound port there
// atomically once serving.
absl::StatusOr<Served> Serve(const std::string& listen, const std::vector<grpc::Service*>& services,
                             const std::string& port_file);

// Blocks SIGTERM and SIGINT in the calling thread; call first in main, before any thread starts, so that every
// thread inherits the mask and WaitForTermination receives them synchronously.
void BlockTerminationSignals();

// Blocks until SIGTERM or SIGINT.
void WaitForTermination();

}  // namespace wsync::daemon
