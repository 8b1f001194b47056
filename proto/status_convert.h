#pragma once
// The one place absl::Status and grpc::Status are converted into each other.

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"

namespace wsync {

grpc::Status ToGrpcStatus(const absl::Status& s);
absl::Status FromGrpcStatus(const grpc::Status& s);

}  // namespace wsync
