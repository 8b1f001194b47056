#pragma once
// A source daemon's surroundings for in-process tests of SourceNode: a transport that accepts every write without
// sending it (what the writes carry is covered by the cluster tests), and a plan with one reference-engine target at
// TP=1 laid out as the tiny model's SGLang table.

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <condition_variable>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "daemon/common/convert.h"
#include "replica/model_config.h"
#include "replica/param_table.h"
#include "transport/transport.h"
#include "wsync/v1/daemon.pb.h"

namespace wsync::daemon::testing {

class NullLocalRegion : public transport::LocalRegion {
 public:
  NullLocalRegion(void* a, uint64_t n) : a_(a), n_(n) {}
  void* addr() const override { return a_; }
  uint64_t length() const override { return n_; }
  std::string Descriptor() const override { return std::to_string(n_); }

 private:
  void* a_;
  uint64_t n_;
};

class NullRemoteRegion : public transport::RemoteRegion {
 public:
  explicit NullRemoteRegion(uint64_t n) : n_(n) {}
  uint64_t length() const override { return n_; }

 private:
  uint64_t n_;
};

// An engine rank's memory for tests that check what was written: a host buffer a copying endpoint fills.
class EngineMemory : public transport::RemoteRegion {
 public:
  explicit EngineMemory(uint64_t n) : bytes(n, 0) {}
  uint64_t length() const override { return bytes.size(); }
  mutable std::vector<uint8_t> bytes;
};

// Posts are validated and completed at once (or, `hang`, never: Wait runs into its timeout unless cancelled);
// Cancel fails every later call with its reason.
class NullEndpoint : public transport::Endpoint {
 public:
  explicit NullEndpoint(bool hang = false) : hang_(hang) {}
  std::string LocalInfo() const override { return "null"; }
  absl::Status Connect(const std::string&, absl::Duration) override { return absl::OkStatus(); }
  absl::StatusOr<transport::BatchId> Post(absl::Span<const transport::WriteRequest> writes) override {
    for (const auto& w : writes)
      if (auto st = transport::ValidateWrite(w); !st.ok()) return st;
    std::lock_guard<std::mutex> l(mu_);
    if (!cancelled_.ok()) return cancelled_;
    return ++next_;
  }
  absl::Status Wait(transport::BatchId, absl::Duration timeout) override {
    std::unique_lock<std::mutex> l(mu_);
    if (!hang_) return cancelled_;
    if (!cv_.wait_for(l, absl::ToChronoNanoseconds(timeout), [&] { return !cancelled_.ok(); }))
      return absl::DeadlineExceededError("null peer: batch hangs");
    return cancelled_;
  }
  void Cancel(const absl::Status& why) override {
    std::lock_guard<std::mutex> l(mu_);
    if (cancelled_.ok()) cancelled_ = why;
    cv_.notify_all();
  }
  std::string PeerName() const override { return "null peer"; }

 private:
  const bool hang_;
  std::mutex mu_;
  std::condition_variable cv_;
  absl::Status cancelled_;
  transport::BatchId next_ = 0;
};

class NullTransport : public transport::Transport {
 public:
  std::atomic<bool> hang{false};  // endpoints created from now on never complete their batches
  std::string name() const override { return "null"; }
  bool viable() const override { return true; }
  std::string reason() const override { return ""; }
  absl::StatusOr<std::unique_ptr<transport::LocalRegion>> RegisterMemory(void* addr, uint64_t len) override {
    return std::make_unique<NullLocalRegion>(addr, len);
  }
  absl::StatusOr<std::unique_ptr<transport::RemoteRegion>> ImportRegion(const std::string& d) override {
    return std::make_unique<NullRemoteRegion>(std::stoull(d));
  }
  absl::StatusOr<std::unique_ptr<transport::Endpoint>> CreateEndpoint() override {
    return std::make_unique<NullEndpoint>(hang.load());
  }
};

// The plan: one reference engine "e0" at TP=1 (a null target daemon), the tiny model's SGLang layout.
inline v1::ConfigureSourceRequest TinyPlan(const std::string& model_json_path, int64_t plan_epoch) {
  std::ifstream f(model_json_path);
  REQUIRE(f.good());
  std::stringstream json;
  json << f.rdbuf();
  auto cfg = replica::ModelConfig::FromJson(json.str());
  REQUIRE(cfg.ok());
  v1::ConfigureSourceRequest req;
  req.set_model_config_json(json.str());
  req.set_plan_epoch(plan_epoch);
  auto* t = req.add_targets();
  t->set_engine_id("e0");
  t->set_rank(0);
  t->set_target_daemon("nowhere:1");
  t->set_engine_kind("reference");
  auto* l = t->mutable_layout();
  const replica::RankParallelism rp;
  *l->mutable_parallelism() = ToProto(rp);
  auto table = replica::BuildParamTable(*cfg, rp, replica::QuantSpec());
  REQUIRE(table.ok());
  for (const auto& p : table->params()) {
    auto* d = l->add_params();
    d->set_name(p.name);
    d->set_dtype(std::string(DTypeName(p.dtype)));
    for (int64_t s : p.shape) d->add_shape(s);
    d->set_bytes(p.bytes);
    d->set_offset(p.offset);
    d->set_segment(0);
  }
  auto* seg = l->add_segments();
  seg->set_id(0);
  seg->set_kind("host");
  seg->set_bytes(std::max<uint64_t>(table->total_bytes(), 1));
  seg->set_region_descriptor(std::to_string(seg->bytes()));
  l->set_region_bytes(seg->bytes());
  return req;
}

}  // namespace wsync::daemon::testing
