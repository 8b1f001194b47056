#pragma once
// Calling any gRPC method by name with a raw body, and listing a service's methods from the generated descriptors:
// what the security and message-limit tests use to reach every RPC without a typed stub per method.

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/codegen/client_unary_call.h>
#include <grpcpp/impl/codegen/rpc_method.h>

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"

namespace wsync::testing {

// Calls /`method` (e.g. "wsync.v1.Coordinator/BeginUpdate") with `body` as the serialized request.
inline grpc::Status CallRaw(const std::shared_ptr<grpc::Channel>& ch, const std::string& method,
                            const std::string& body, std::chrono::seconds timeout) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  grpc::Slice s(body);
  grpc::ByteBuffer req(&s, 1), resp;
  const std::string path = "/" + method;
  return grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      ch.get(), grpc::internal::RpcMethod(path.c_str(), grpc::internal::RpcMethod::NORMAL_RPC), &ctx, req, &resp);
}

// Every method of `service` (full name, e.g. "wsync.v1.NodeDaemon") as "service/Method".
inline std::vector<std::string> Methods(const std::string& service) {
  const auto* d = google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(service);
  if (d == nullptr) throw std::runtime_error("no generated service named " + service);
  std::vector<std::string> out;
  for (int i = 0; i < d->method_count(); ++i) out.push_back(absl::StrCat(service, "/", d->method(i)->name()));
  return out;
}

}  // namespace wsync::testing
