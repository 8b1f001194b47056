#pragma once
// Shared by the daemon binaries: start a gRPC server, publish its port, wait for SIGTERM/SIGINT.

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "google/protobuf/message.h"

namespace wsync::daemon {

// Request size limits per RPC (docs/security.md, "Bounded requests"). Control requests carry ids, versions, addresses
// and connection blobs: kMaxControlRequestBytes. Only the two that carry engine layouts get kMaxPlanRequestBytes:
// RegisterNode (every rank's parameter table) and ConfigureSource (the plan's targets with their layouts, write
// ranges and push filters). Measured for Kimi-K2 (FP8, 64x64 blocks, two TP32/EP32 engines, 32 source nodes of 8
// ranks; daemon_message_limits_test prints them): a registration of one engine's 32 ranks 3.7 MiB, ConfigureSource
// 0.55 MiB per source (17 MiB over all 32; a single source given every rank of both engines would get about 8 MiB),
// so 64 MiB leaves a margin of 8x over the worst case and 17x over a registration.
inline constexpr uint64_t kMaxControlRequestBytes = 4 << 20;
inline constexpr uint64_t kMaxPlanRequestBytes = 64 << 20;
// gRPC's own cap on every message a wsync server receives or sends (and peers' channels allow): the largest
// per-RPC limit. gRPC refuses a larger message before parsing it; CheckRequestSize applies the per-RPC limit after.
inline constexpr int kMaxControlMessageBytes = static_cast<int>(kMaxPlanRequestBytes);

// The limit for the RPC `rpc` (its method name, e.g. "ConfigureSource").
uint64_t MaxRequestBytes(std::string_view rpc);

// RESOURCE_EXHAUSTED naming the RPC, the size and the limit when `req` is over MaxRequestBytes(rpc); OK otherwise.
// Every handler calls it before it looks at the request (daemon/services.cc).
grpc::Status CheckRequestSize(const char* rpc, const google::protobuf::Message& req);

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
