#pragma once
// Shared by the daemon binaries: start a gRPC server, publish its port, wait for SIGTERM/SIGINT.

#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"

namespace wsync::daemon {

// The largest gRPC message a wsync server accepts or sends (and peers' channels allow).
inline constexpr int kMaxControlMessageBytes = 64 << 20;

struct Served {
  std::unique_ptr<grpc::Server> server;
  int port = 0;
};

// Listens on `listen` (host:port, port 0 = any free port) and, if `port_file` is set, writes the bound port there
// atomically once serving.
absl::StatusOr<Served> Serve(const std::string& listen, const std::vector<grpc::Service*>& services,
                             const std::string& port_file);

// Serves `services` on the Unix socket `path` (gRPC address "unix:<path>") with file mode `mode`; local clients only.
absl::StatusOr<std::unique_ptr<grpc::Server>> ServeUnix(const std::string& path,
                                                        const std::vector<grpc::Service*>& services, int mode);

// mkdir -p with `mode` for the directories it creates.
absl::Status MakeDirs(const std::string& dir, int mode);

// Where a daemon's local socket `name` lives by default: /run/wsync/<name> when /run/wsync can be created and
// written, else $XDG_RUNTIME_DIR/wsync/<name>, else /tmp/wsync-<uid>/<name>.
std::string DefaultSocketPath(const std::string& name);

// Blocks SIGTERM and SIGINT in the calling thread; call first in main, before any thread starts, so that every
// thread inherits the mask and WaitForTermination receives them synchronously.
void BlockTerminationSignals();

// Blocks until SIGTERM or SIGINT.
void WaitForTermination();

// Waits up to `timeout_ms` for SIGTERM or SIGINT (blocked by BlockTerminationSignals); true when one arrived. Used
// instead of a sleep in retry loops, so that a daemon stops at once when told to, at any point of its start.
bool TerminationRequested(int timeout_ms);

// True for an address nobody else can dial: empty, 0.0.0.0 or :: (wildcards are fine to bind, not to register).
bool IsWildcardHost(const std::string& host);

}  // namespace wsync::daemon
