#include "client/coordinator_client.h"

#include <grpcpp/grpcpp.h>

#include "proto/status_convert.h"

namespace wsync::client {
namespace {

void SetDeadline(grpc::ClientContext* ctx, absl::Duration d) {
  ctx->set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(d));
}

}  // namespace

CoordinatorClient::CoordinatorClient(const std::string& endpoint, absl::Duration dial_timeout)
    : stub_(v1::Coordinator::NewStub(grpc::CreateChannel(endpoint, grpc::InsecureChannelCredentials()))),
      dial_timeout_(dial_timeout) {}

absl::StatusOr<v1::BeginUpdateReply> CoordinatorClient::BeginUpdate(int64_t version, const std::string& pause_mode) {
  v1::BeginUpdateRequest req;
  req.set_version(version);
  req.set_pause_mode(pause_mode);
  v1::BeginUpdateReply rep;
  grpc::ClientContext ctx;
  SetDeadline(&ctx, BeginUpdateDeadline(dial_timeout_));
  grpc::Status s = stub_->BeginUpdate(&ctx, req, &rep);
  if (!s.ok()) return FromGrpcStatus(s);
  return rep;
}

absl::StatusOr<v1::UpdateRecord> CoordinatorClient::CommitUpdate(int64_t version, double timeout_seconds) {
  v1::CommitUpdateRequest req;
  req.set_version(version);
  req.set_timeout_seconds(timeout_seconds);
  v1::CommitUpdateReply rep;
  grpc::ClientContext ctx;
  SetDeadline(&ctx, CommitUpdateDeadline(timeout_seconds, dial_timeout_));
  grpc::Status s = stub_->CommitUpdate(&ctx, req, &rep);
  if (!s.ok()) return FromGrpcStatus(s);
  return rep.record();
}

absl::StatusOr<v1::ClusterStatus> CoordinatorClient::Status() {
  v1::ClusterStatus rep;
  grpc::ClientContext ctx;
  SetDeadline(&ctx, dial_timeout_);
  grpc::Status s = stub_->GetClusterStatus(&ctx, v1::ClusterStatusRequest(), &rep);
  if (!s.ok()) return FromGrpcStatus(s);
  return rep;
}

absl::StatusOr<v1::HistoryReply> CoordinatorClient::History(int limit) {
  v1::HistoryRequest req;
  req.set_limit(limit);
  v1::HistoryReply rep;
  grpc::ClientContext ctx;
  SetDeadline(&ctx, dial_timeout_);
  grpc::Status s = stub_->GetHistory(&ctx, req, &rep);
  if (!s.ok()) return FromGrpcStatus(s);
  return rep;
}

absl::StatusOr<v1::AbortUpdateReply> CoordinatorClient::AbortUpdate(int64_t version, const std::string& reason) {
  v1::AbortUpdateRequest req;
  req.set_version(version);
  req.set_reason(reason);
  v1::AbortUpdateReply rep;
  grpc::ClientContext ctx;
  // The coordinator waits for every source's AbortSourceUpdate (a bucket being written, then the drain).
  SetDeadline(&ctx, dial_timeout_ + absl::Seconds(60 + kDeadlineMarginSeconds));
  grpc::Status s = stub_->AbortUpdate(&ctx, req, &rep);
  if (!s.ok()) return FromGrpcStatus(s);
  return rep;
}

absl::StatusOr<v1::RemoveNodeReply> CoordinatorClient::RemoveNode(const std::string& node_id) {
  v1::RemoveNodeRequest req;
  req.set_node_id(node_id);
  v1::RemoveNodeReply rep;
  grpc::ClientContext ctx;
  SetDeadline(&ctx, dial_timeout_);
  grpc::Status s = stub_->RemoveNode(&ctx, req, &rep);
  if (!s.ok()) return FromGrpcStatus(s);
  return rep;
}

absl::StatusOr<v1::ResumeEnginesReply> CoordinatorClient::ResumeEngines() {
  v1::ResumeEnginesReply rep;
  grpc::ClientContext ctx;
  SetDeadline(&ctx, dial_timeout_ + absl::Seconds(30 + kDeadlineMarginSeconds));
  grpc::Status s = stub_->ResumeEngines(&ctx, v1::ResumeEnginesRequest(), &rep);
  if (!s.ok()) return FromGrpcStatus(s);
  return rep;
}

}  // namespace wsync::client
