#pragma once
// Helpers shared by the end-to-end tests: talk to a reference engine, and push generated weights.

#include <grpcpp/grpcpp.h>

#include <catch2/catch.hpp>
#include <map>
#include <memory>
#include <string>

#include "client/trainer_client.h"
#include "replica/model_config.h"
#include "tools/testdata/weight_gen.h"
#include "wsync/v1/engine.grpc.pb.h"

namespace wsync::testing {

inline std::unique_ptr<v1::EngineControl::Stub> EngineStub(const std::string& addr) {
  return v1::EngineControl::NewStub(grpc::CreateChannel(addr, grpc::InsecureChannelCredentials()));
}

// The engine's own bit-exact check against step `step`; mismatches are attached to the test output.
inline v1::VerifyReply Verify(const std::string& engine, int64_t step) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  v1::VerifyRequest req;
  req.set_step(step);
  v1::VerifyReply rep;
  REQUIRE(EngineStub(engine)->Verify(&ctx, req, &rep).ok());
  for (const auto& m : rep.mismatches()) UNSCOPED_INFO(m);
  return rep;
}

// The weight layout an engine reports for one rank (GetWeightLayout).
inline v1::RankLayout Layout(const std::string& engine, int rank) {
  grpc::ClientContext ctx;
  v1::RankRequest req;
  req.set_rank(rank);
  v1::RankLayout layout;
  REQUIRE(EngineStub(engine)->GetWeightLayout(&ctx, req, &layout).ok());
  return layout;
}

inline v1::EngineInfo Info(const std::string& engine) {
  grpc::ClientContext ctx;
  v1::EngineInfo info;
  REQUIRE(EngineStub(engine)->GetInfo(&ctx, v1::GetEngineInfoRequest(), &info).ok());
  return info;
}

// "rank/name" → XXH3-128 for every rank of an engine.
inline std::map<std::string, std::string> Checksums(const std::string& engine, int tp) {
  std::map<std::string, std::string> out;
  for (int r = 0; r < tp; ++r) {
    grpc::ClientContext ctx;
    v1::RankRequest req;
    req.set_rank(r);
    v1::ChecksumReply rep;
    REQUIRE(EngineStub(engine)->GetChecksums(&ctx, req, &rep).ok());
    for (const auto& p : rep.params()) out[std::to_string(r) + "/" + p.name()] = p.xxh128();
  }
  return out;
}

// The model's checkpoint tensors by name.
inline std::map<std::string, replica::TensorSpec> Specs(const std::string& model) {
  auto cfg = replica::ModelConfig::FromFile(model);
  REQUIRE(cfg.ok());
  auto specs = replica::CheckpointTensors(*cfg);
  REQUIRE(specs.ok());
  std::map<std::string, replica::TensorSpec> out;
  for (auto& s : *specs) out[s.name] = s;
  return out;
}

// Pushes tensor `s` generated for `step` (the same generator the reference engine derives its expectation from).
// A trainer rank's client of the source daemon behind `socket` (a Cluster's trainer_sockets[i]).
inline absl::StatusOr<std::unique_ptr<client::TrainerClient>> ConnectTrainer(const std::string& socket,
                                                                           absl::Duration timeout = absl::Seconds(20)) {
  client::TrainerOptions to;
  to.daemon = socket;
  to.timeout = timeout;
  return client::TrainerClient::Connect(to);
}

inline absl::Status PushGenerated(client::TrainerClient& c, const replica::TensorSpec& s, int64_t step) {
  const uint64_t elems = s.bytes() / DTypeSize(s.dtype);
  return c.PushWith(s.name, s.dtype, s.shape, s.bytes(),
                    [&](uint8_t* dst) { tools::GenerateTensor(s.name, step, s.dtype, elems, dst); });
}

// One whole push of generated step `step`: BeginPush, every tensor the daemon asks for (from `specs`), EndPush.
inline absl::Status PushStep(client::TrainerClient& c, const std::map<std::string, replica::TensorSpec>& specs,
                             int64_t step) {
  auto names = c.BeginPush(step);
  if (!names.ok()) return names.status();
  for (const auto& n : *names) {
    auto it = specs.find(n);
    if (it == specs.end()) return absl::NotFoundError("the daemon asked for " + n + ", which the model lacks");
    absl::Status st = PushGenerated(c, it->second, step);
    if (!st.ok()) return st;
  }
  return c.EndPush(step);
}

}  // namespace wsync::testing
