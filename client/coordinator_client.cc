#include "client/coordinator_client.h"

#include <grpcpp/grpcpp.h>

#include "proto/status_convert.h"
#include "proto/tls.h"

namespace wsync::client {
namespace {

void SetDeadline(grpc::ClientContext* ctx, absl::Duration d) {
  ctx->set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(d));
}

}  // namespace

CoordinatorClient::CoordinatorClient(const std::string& endpoint, absl::Duration dial_timeout)
    : dial_timeout_(dial_timeout) {
  // mTLS from WSYNC_TLS_* (or the binary's --tls-* flags); without TLS only a loopback endpoint is dialled.
  auto channel = tls::Dial(endpoint);
  if (channel.ok())
    stub_ = v1::Coordinator::NewStub(*std::move(channel));
  else
    dial_status_ = channel.status();
}

absl::StatusOr<v1::BeginUpdateReply> CoordinatorClient::BeginUpdate(int64_t version, const std::string& pause_mode) {
  v1::BeginUpdateRequest req;
  req.set_version(version);
  req.set_pause_mode(pause_mode);
  v1::BeginUpdateReply rep;
  if (!stub_) return dial_status_;
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
  if (!stub_) return dial_status_;
  grpc::ClientContext ctx;
  SetDeadline(&ctx, CommitUpdateDeadline(timeout_seconds, dial_timeout_));
  grpc::Status s = stub_->CommitUpdate(&ctx, req, &rep);
  if (!s.ok()) return FromGrpcStatus(s);
  return rep.record();
}

absl::StatusOr<v1::ClusterStatus> CoordinatorClient::Status() {
  v1::ClusterStatus rep;
  if (!stub_) return dial_status_;
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
  if (!stub_) return dial_status_;
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
  if (!stub_) return dial_status_;
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
  if (!stub_) return dial_status_;
  grpc::ClientContext ctx;
  SetDeadline(&ctx, dial_timeout_);
  grpc::Status s = stub_->RemoveNode(&ctx, req, &rep);
  if (!s.ok()) return FromGrpcStatus(s);
  return rep;
}

absl::StatusOr<v1::ResumeEnginesReply> CoordinatorClient::ResumeEngines() {
  v1::ResumeEnginesReply rep;
  if (!stub_) return dial_status_;
  grpc::ClientContext ctx;
  SetDeadline(&ctx, dial_timeout_ + absl::Seconds(30 + kDeadlineMarginSeconds));
  grpc::Status s = stub_->ResumeEngines(&ctx, v1::ResumeEnginesRequest(), &rep);
  if (!s.ok()) return FromGrpcStatus(s);
  return rep;
}

}  // namespace wsync::client
