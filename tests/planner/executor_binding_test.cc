// The cost model predicts wsync's updates with the executor TraitsOf(kWsyncExecutor) describes (planner/cost_params.h);
// this test measures the source daemon's data path (an in-process SourceNode, two trainer ranks pushing through their
// rings into a transport whose posts and completions the test holds) and fails when the daemon does not do what the
// model assumes, in either direction:
//   parallel_rank_loads     while rank 0's bucket is held inside the transport's Post (its locks taken), rank 1's
//                           bucket is loaded into the replica (its bytes appear in the replica's memory);
//   handover_overlaps_load  while that bucket of rank 0 is still in the node, rank 0 writes and commits its next
//                           bucket into its ring without waiting;
//   writes_overlap_loads    with no write ever completing (every Wait held), each bucket's CommitBucket still
//                           returns and the next bucket is loaded: writes are posted, never waited for on the way.

#include <sys/mman.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "client/ring/ring.h"
#include "daemon/node/source_node.h"
#include "planner/cost.h"
#include "replica/model_config.h"
#include "tests/daemon/null_source.h"

namespace wsync {
namespace {

using planner::ExecutorTraits;
using planner::TraitsOf;

// Shared by every endpoint of the transport: while hold_post is set a Post blocks (after counting itself) until it
// is cleared; while hold_wait is set no batch completes. Both give up after kSafety so a broken daemon cannot hang
// the test.
struct Gate {
  static constexpr auto kSafety = std::chrono::seconds(20);
  std::mutex mu;
  std::condition_variable cv;
  bool hold_post = false, hold_wait = false;
  int posts_entered = 0;

  void Set(bool* flag, bool v) {
    std::lock_guard<std::mutex> l(mu);
    *flag = v;
    cv.notify_all();
  }
  bool WaitPostsEntered(int n, std::chrono::milliseconds within) {
    std::unique_lock<std::mutex> l(mu);
    return cv.wait_for(l, within, [&] { return posts_entered >= n; });
  }
};

class GatedEndpoint : public transport::Endpoint {
 public:
  explicit GatedEndpoint(Gate* g) : g_(g) {}
  std::string LocalInfo() const override { return "gated"; }
  absl::Status Connect(const std::string&, absl::Duration) override { return absl::OkStatus(); }
  absl::StatusOr<transport::BatchId> Post(absl::Span<const transport::WriteRequest> writes) override {
    for (const auto& w : writes)
      if (auto st = transport::ValidateWrite(w); !st.ok()) return st;
    std::unique_lock<std::mutex> l(g_->mu);
    ++g_->posts_entered;
    g_->cv.notify_all();
    g_->cv.wait_for(l, Gate::kSafety, [&] { return !g_->hold_post; });
    return ++next_;
  }
  absl::Status Wait(transport::BatchId, absl::Duration timeout) override {
    std::unique_lock<std::mutex> l(g_->mu);
    if (!g_->cv.wait_for(l, std::min(absl::ToChronoNanoseconds(timeout), std::chrono::nanoseconds(Gate::kSafety)),
                         [&] { return !g_->hold_wait; }))
      return absl::DeadlineExceededError("gated peer: writes held");
    return absl::OkStatus();
  }
  std::string PeerName() const override { return "gated peer"; }

 private:
  Gate* g_;
  transport::BatchId next_ = 0;
};

class GatedTransport : public daemon::testing::NullTransport {
 public:
  explicit GatedTransport(Gate* g) : g_(g) {}
  absl::StatusOr<std::unique_ptr<transport::Endpoint>> CreateEndpoint() override {
    return std::make_unique<GatedEndpoint>(g_);
  }

 private:
  Gate* g_;
};

// Writes `names` into the ring as one bucket, every byte `fill`, and commits it there; the bucket's seq.
uint64_t WriteBucket(RingProducer& ring, const std::vector<std::string>& names,
                     const std::map<std::string, replica::TensorSpec>& specs, uint8_t fill, absl::Duration timeout) {
  for (const auto& n : names) {
    const auto& s = specs.at(n);
    auto dst = ring.BeginTensor(n, s.dtype, s.shape, s.bytes(), timeout);
    REQUIRE(dst.ok());
    std::memset(*dst, fill, s.bytes());
    REQUIRE(ring.FinishTensor().ok());
  }
  auto seq = ring.CommitBucket();
  REQUIRE(seq.ok());
  return *seq;
}

// True once a run of `run` bytes equal to `fill` is in one of the mappings.
bool Holds(const std::vector<std::pair<uint8_t*, uint64_t>>& maps, uint8_t fill, size_t run) {
  const std::vector<uint8_t> needle(run, fill);
  for (const auto& [a, n] : maps)
    if (memmem(a, n, needle.data(), run) != nullptr) return true;
  return false;
}

// Runs the probes against a fresh node; what the daemon measurably does.
ExecutorTraits MeasureDaemon() {
  const std::string model = std::string(WSYNC_MODELS_DIR) + "/tiny-qwen3/config.json";
  Gate gate;
  GatedTransport tr(&gate);
  daemon::SourceOptions o;
  o.node_id = "binding";
  o.trainer_ranks = 2;
  o.ring_bytes = 8 << 20;
  o.write_checksums = false;
  o.placement = false;
  o.push_timeout = absl::Seconds(30);
  daemon::SourceNode node(
      o, &tr, [](const std::string&, const v1::ConnectTargetRequest&) { return absl::StatusOr<std::string>("gated"); });
  const v1::ConfigureSourceRequest plan = daemon::testing::TinyPlan(model, 1);
  REQUIRE(node.Configure(plan).ok());
  auto cfg = replica::ModelConfig::FromJson(plan.model_config_json());
  REQUIRE(cfg.ok());
  auto tensors = replica::CheckpointTensors(*cfg);
  REQUIRE(tensors.ok());
  std::map<std::string, replica::TensorSpec> specs;
  for (const auto& t : *tensors) specs[t.name] = t;

  std::vector<std::string> sessions;
  std::vector<ScopedFd> fds;
  std::vector<std::unique_ptr<RingProducer>> rings;
  for (int r = 0; r < 2; ++r) {
    daemon::SessionRequest sr;
    sr.local_rank = r;
    auto s = node.OpenSession(sr);
    REQUIRE(s.ok());
    sessions.push_back(s->id);
    fds.push_back(std::move(s->ring_fd));
    auto p = RingProducer::Attach(fds.back().get());
    REQUIRE(p.ok());
    rings.push_back(std::make_unique<RingProducer>(*std::move(p)));
  }
  // The replica's memory, to see a bucket's bytes arrive (the daemon's own timestamps are not the witness).
  auto handles = node.ReplicaFds(sessions[0]);
  REQUIRE(handles.ok());
  std::vector<std::pair<uint8_t*, uint64_t>> maps;
  for (size_t i = 0; i < handles->fds.size(); ++i) {
    void* a = mmap(nullptr, handles->bytes[i], PROT_READ, MAP_SHARED, handles->fds[i].get(), 0);
    REQUIRE(a != MAP_FAILED);
    maps.push_back({static_cast<uint8_t*>(a), handles->bytes[i]});
  }

  v1::StartUpdateRequest su;
  su.set_version(1);
  su.set_plan_epoch(1);
  REQUIRE(node.StartUpdate(su).ok());
  std::vector<std::vector<std::string>> names(2);
  for (int r = 0; r < 2; ++r) {
    v1::BeginPushRequest bp;
    bp.set_session_id(sessions[r]);
    bp.set_version(1);
    auto rep = node.BeginPush(bp);
    REQUIRE(rep.ok());
    names[r].assign(rep->tensor_names().begin(), rep->tensor_names().end());
    REQUIRE(names[r].size() >= 2);
  }
  auto commit = [&](int r, uint64_t seq) {
    return std::async(std::launch::async, [&node, &sessions, r, seq] {
      v1::CommitBucketRequest cb;
      cb.set_session_id(sessions[r]);
      cb.set_bucket_seq(seq);
      return node.CommitBucket(cb).status();
    });
  };
  auto ready_within = [](std::future<absl::Status>& f, std::chrono::milliseconds d) {
    return f.wait_for(d) == std::future_status::ready;
  };

  ExecutorTraits measured;
  gate.Set(&gate.hold_wait, true);  // no write completes until the end
  gate.Set(&gate.hold_post, true);
  // Rank 0's first bucket: every tensor of its share but the last (it completes parameters: it posts writes).
  std::vector<std::string> a1(names[0].begin(), names[0].end() - 1), a2(names[0].end() - 1, names[0].end());
  std::future<absl::Status> c_a1 = commit(0, WriteBucket(*rings[0], a1, specs, 0x11, absl::Seconds(5)));
  INFO("rank 0's first bucket must reach the transport's Post (it completes parameters of the tiny model)");
  REQUIRE(gate.WaitPostsEntered(1, std::chrono::seconds(10)));

  // Hand-over beside the node's work: the next bucket goes into the ring while the first is still in the node.
  {
    auto dst = rings[0]->BeginTensor(a2[0], specs.at(a2[0]).dtype, specs.at(a2[0]).shape, specs.at(a2[0]).bytes(),
                                     absl::Seconds(2));
    measured.handover_overlaps_load = dst.ok();
    if (dst.ok()) {
      std::memset(*dst, 0x22, specs.at(a2[0]).bytes());
      REQUIRE(rings[0]->FinishTensor().ok());
    }
  }
  uint64_t a2_seq = 0;
  if (measured.handover_overlaps_load) {
    auto seq = rings[0]->CommitBucket();
    REQUIRE(seq.ok());
    a2_seq = *seq;
  }

  // Rank 1's bucket is loaded while rank 0's is held in Post.
  std::future<absl::Status> c_b = commit(1, WriteBucket(*rings[1], names[1], specs, 0x5A, absl::Seconds(5)));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!(measured.parallel_rank_loads = Holds(maps, 0x5A, 64)) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  gate.Set(&gate.hold_post, false);

  // Writes never complete (hold_wait): buckets are still answered, and the next one is loaded.
  std::future<absl::Status> c_a2;
  if (measured.handover_overlaps_load) c_a2 = commit(0, a2_seq);
  measured.writes_overlap_loads = ready_within(c_a1, std::chrono::seconds(5)) &&
                                  ready_within(c_b, std::chrono::seconds(5)) &&
                                  (!c_a2.valid() || ready_within(c_a2, std::chrono::seconds(5))) &&
                                  Holds(maps, 0x22, std::min<uint64_t>(64, specs.at(a2[0]).bytes()));
  gate.Set(&gate.hold_wait, false);
  CHECK(c_a1.get().ok());
  CHECK(c_b.get().ok());
  if (c_a2.valid()) CHECK(c_a2.get().ok());
  for (int r = 0; r < 2; ++r) {
    v1::EndPushRequest ep;
    ep.set_session_id(sessions[r]);
    ep.set_version(1);
    CHECK(node.EndPush(ep).ok());
  }
  v1::FinishUpdateRequest fu;
  fu.set_version(1);
  fu.set_plan_epoch(1);
  fu.set_timeout_seconds(30);
  if (measured.handover_overlaps_load) CHECK(node.FinishUpdate(fu).ok());  // every parameter arrived and was written
  for (auto& [a, n] : maps) munmap(a, n);
  return measured;
}

TEST_CASE("executor binding: the source daemon runs the executor the cost model assumes for wsync") {
  const ExecutorTraits measured = MeasureDaemon();
  const ExecutorTraits assumed = TraitsOf(planner::kWsyncExecutor);
  INFO("measured: parallel rank loads " << measured.parallel_rank_loads << ", hand-over beside loads "
                                        << measured.handover_overlaps_load << ", writes beside loads "
                                        << measured.writes_overlap_loads);
  INFO("assumed:  parallel rank loads " << assumed.parallel_rank_loads << ", hand-over beside loads "
                                        << assumed.handover_overlaps_load << ", writes beside loads "
                                        << assumed.writes_overlap_loads);
  CHECK(measured == assumed);
  // The seed's executor is not what runs: predicting wsync with it would misstate the daemon.
  CHECK_FALSE(measured == TraitsOf(planner::Executor::kSerial));
}

TEST_CASE("executor binding: the pipelined formulas follow the traits they declare") {
  // One source: 1 GB pushed, 2 GB loaded, 1 GB written of which 0.5 GB blocking, over its own NIC.
  planner::CostParams cp;
  cp.d2h_gbps = 0.5;  // hand-over the slowest stage
  cp.replica_load_gbps = 4;
  cp.session_ms = 0;
  const double bw = 10e9;
  cp.executor = planner::kWsyncExecutor;
  const auto piped = planner::PredictSource(cp, bw, 1, 1'000'000'000, 1'000'000'000, 2'000'000'000, 500'000'000, 1, 1);
  // Stages overlap: the slowest (the 2 s hand-over) is the time, nothing is added to it.
  CHECK(piped.total_s == Approx(2.0));
  cp.executor = planner::Executor::kSerial;
  const auto serial = planner::PredictSource(cp, bw, 1, 1'000'000'000, 1'000'000'000, 2'000'000'000, 500'000'000, 1, 1);
  // Load then the blocking writes, one after the other; the hand-over is inside the load rate.
  CHECK(serial.total_s == Approx(0.5 + 0.05));
}

}  // namespace
}  // namespace wsync
