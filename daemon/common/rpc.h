#pragma once
// What the gRPC service faces of the node daemon and the coordinator share: the reply conversion, deadlines and the
// role check (statuses convert in one place, proto/status_convert.h).

#include <chrono>
#include <cstdint>
#include <utility>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "proto/status_convert.h"
#include "proto/tls.h"
#include "daemon/common/serve.h"

namespace wsync::daemon {

// Copies a StatusOr's value into the reply or converts its error.
template <typename T>
grpc::Status Reply(absl::StatusOr<T> r, T* out) {
  if (!r.ok()) return ToGrpcStatus(r.status());
  *out = *std::move(r);
  return grpc::Status::OK;
}

inline std::chrono::system_clock::time_point Deadline(double seconds) {
  return std::chrono::system_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

}  // namespace wsync::daemon

// Role check first (before any validation or state access): PERMISSION_DENIED for a caller whose certificate's role
// is not allowed (docs/security.md, "Roles"). No check on an insecure (loopback development) server.
// Then the request's size against the RPC's limit (serve.h, CheckRequestSize): RESOURCE_EXHAUSTED before anything
// is looked at or stored.
#define WSYNC_AUTHORIZE(rpc, ...)                            \
  do {                                                       \
    grpc::Status a_ = tls::Authorize(ctx, rpc, __VA_ARGS__); \
    if (!a_.ok()) return a_;                                 \
    a_ = CheckRequestSize(rpc, *req);                        \
    if (!a_.ok()) return a_;                                 \
  } while (0)

// The trainer ranks' RPCs (Unix socket, authorized by their session id): the size check only.
#define WSYNC_LIMIT(rpc)                           \
  do {                                             \
    grpc::Status l_ = CheckRequestSize(rpc, *req); \
    if (!l_.ok()) return l_;                       \
  } while (0)
