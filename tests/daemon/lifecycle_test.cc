// The source daemon's half of the exactly-once update lifecycle, driven in-process (no gRPC, no network): a real
// SourceNode with the tiny model's replica, a trainer rank pushing through the real shared-memory ring, and a
// transport that accepts every write without sending it (the writes' contents are covered by the cluster tests).
// FinishUpdate(v) runs once: a repeat, concurrent or late, returns the first result; older versions and other plans'
// calls are refused.

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "client/ring/ring.h"
#include "daemon/common/config_digest.h"
#include "daemon/common/convert.h"
#include "daemon/node/source_node.h"
#include "tests/daemon/null_source.h"
#include "replica/model_config.h"
#include "replica/param_table.h"
#include "transport/transport.h"

namespace wsync::daemon {
namespace {

using testing::NullTransport;

constexpr int64_t kPlan = 7;

// A plan with one reference-engine target at TP=1 whose layout is the tiny model's SGLang table.
v1::ConfigureSourceRequest Plan() { return testing::TinyPlan(WSYNC_TINY_MODEL, kPlan); }

struct Node {
  NullTransport transport;
  std::unique_ptr<SourceNode> node;
  std::string session;
  std::map<std::string, replica::TensorSpec> specs;

  explicit Node(int ranks = 1, bool hang = false) {
    transport.hang = hang;
    SourceOptions o;
    o.node_id = "src";
    o.trainer_ranks = ranks;
    o.ring_bytes = 8 << 20;
    o.push_timeout = absl::Seconds(5);
    node = std::make_unique<SourceNode>(o, &transport,
                                        [](const std::string&, const v1::ConnectTargetRequest&) -> absl::StatusOr<std::string> {
                                          return std::string("null");
                                        });
    auto c = node->Configure(Plan());
    INFO(c.status().ToString());
    REQUIRE(c.ok());
    SessionRequest os;
    os.local_rank = 0;
    auto s = node->OpenSession(os);
    REQUIRE(s.ok());
    session = s->id;
    CHECK(session.size() == 32);  // 128 random bits, hex
    for (int r = 1; r < ranks; ++r) {
      os.local_rank = r;
      auto more = node->OpenSession(os);
      REQUIRE(more.ok());
      other_sessions.push_back(more->id);
      other_fds.push_back(std::move(more->ring_fd));
    }
    auto cfg = replica::ModelConfig::FromFile(WSYNC_TINY_MODEL);
    REQUIRE(cfg.ok());
    auto all = replica::CheckpointTensors(*cfg);
    REQUIRE(all.ok());
    for (auto& t : *all) specs[t.name] = t;
    ring_fd = std::move(s->ring_fd);
  }

  absl::Status Start(int64_t v, int64_t plan = kPlan) {
    v1::StartUpdateRequest r;
    r.set_version(v);
    r.set_plan_epoch(plan);
    return node->StartUpdate(r);
  }
  absl::StatusOr<v1::FinishUpdateReply> Finish(int64_t v, double timeout_s = 5, int64_t plan = kPlan) {
    v1::FinishUpdateRequest r;
    r.set_version(v);
    r.set_timeout_seconds(timeout_s);
    r.set_plan_epoch(plan);
    return node->FinishUpdate(r);
  }
  // The trainer rank's whole push of update v: every tensor of its filter in one bucket, then EndPush.
  void Push(int64_t v) {
    v1::BeginPushRequest bp;
    bp.set_session_id(session);
    bp.set_version(v);
    auto names = node->BeginPush(bp);
    REQUIRE(names.ok());
    REQUIRE(names->tensor_names_size() > 0);
    auto prod = RingProducer::Attach(ring_fd.get());
    REQUIRE(prod.ok());
    for (const auto& n : names->tensor_names()) {
      const replica::TensorSpec& s = specs.at(n);
      auto dst = prod->BeginTensor(s.name, s.dtype, s.shape, s.bytes(), absl::Seconds(5));
      REQUIRE(dst.ok());
      std::memset(*dst, 0, s.bytes());
      REQUIRE(prod->FinishTensor().ok());
    }
    auto seq = prod->CommitBucket();
    REQUIRE(seq.ok());
    v1::CommitBucketRequest cb;
    cb.set_session_id(session);
    cb.set_bucket_seq(*seq);
    auto c = node->CommitBucket(cb);
    INFO(c.status().ToString());
    REQUIRE(c.ok());
    v1::EndPushRequest ep;
    ep.set_session_id(session);
    ep.set_version(v);
    REQUIRE(node->EndPush(ep).ok());
  }

  ScopedFd ring_fd;  // the rank's own descriptor of the ring, as the hand-over socket sends it
  std::vector<std::string> other_sessions;  // ranks 1.. (their rings are never written by these tests)
  std::vector<ScopedFd> other_fds;
};

TEST_CASE("source lifecycle: a repeated FinishUpdate(v) returns the first result; older versions are refused") {
  Node n;
  REQUIRE(n.Start(1).ok());
  n.Push(1);
  auto first = n.Finish(1);
  INFO(first.status().ToString());
  REQUIRE(first.ok());
  CHECK(first->params_written() > 0);
  auto again = n.Finish(1);
  REQUIRE(again.ok());
  CHECK(again->SerializeAsString() == first->SerializeAsString());
  CHECK(n.node->Status().last_version() == 1);

  REQUIRE(n.Start(2).ok());
  auto repeat = n.Finish(1);  // still the newest ended update: its record answers, 2 stays open
  REQUIRE(repeat.ok());
  CHECK(repeat->SerializeAsString() == first->SerializeAsString());
  CHECK(n.node->Status().state() == "updating");
  CHECK(n.Start(1).code() == absl::StatusCode::kFailedPrecondition);  // versions never move back
  CHECK(n.Start(2).ok());                                             // a repeated StartUpdate of the open one
  n.Push(2);
  REQUIRE(n.Finish(2).ok());
  auto old = n.Finish(1);  // older than the newest ended update: refused
  CHECK(old.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(std::string(old.status().message()).find("older than update 2") != std::string::npos);
  CHECK(n.node->Status().last_version() == 2);
}

TEST_CASE("source lifecycle: a failed FinishUpdate(v) is answered again with the same failure, without a new wait") {
  Node n;
  REQUIRE(n.Start(1).ok());  // the trainer rank never pushes
  auto first = n.Finish(1, 0.2);
  CHECK(first.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(std::string(first.status().message()).find("trainer ranks [0]") != std::string::npos);
  const absl::Time t0 = absl::Now();
  auto again = n.Finish(1, 30);
  CHECK(absl::Now() - t0 < absl::Seconds(5));  // answered from the record, not waited for again
  CHECK(again.status() == first.status());
  // The failed version is not reused; a newer one runs normally.
  CHECK(n.Start(1).code() == absl::StatusCode::kFailedPrecondition);
  REQUIRE(n.Start(2).ok());
  n.Push(2);
  CHECK(n.Finish(2).ok());
}

TEST_CASE("source lifecycle: concurrent FinishUpdate(v) calls finish v once and share its result") {
  Node n;
  REQUIRE(n.Start(1).ok());
  constexpr int kCallers = 6;
  std::vector<absl::StatusOr<v1::FinishUpdateReply>> results(kCallers, absl::UnknownError("not run"));
  std::vector<std::thread> ts;
  for (int i = 0; i < kCallers; ++i) ts.emplace_back([&, i] { results[i] = n.Finish(1, 10); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // all of them are waiting for the rank
  n.Push(1);
  for (auto& t : ts) t.join();
  for (const auto& r : results) {
    INFO(r.status().ToString());
    REQUIRE(r.ok());
    CHECK(r->SerializeAsString() == results[0]->SerializeAsString());
  }
  CHECK(n.node->Status().last_version() == 1);
  CHECK(n.node->Status().state() == "ready");
}

TEST_CASE("source lifecycle: StartUpdate and FinishUpdate refuse another plan's epoch") {
  Node n;
  auto st = n.Start(1, kPlan - 1);
  CHECK(st.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(std::string(st.message()).find("plan 6") != std::string::npos);
  REQUIRE(n.Start(1).ok());
  n.Push(1);
  auto stale = n.Finish(1, 5, kPlan + 1);
  CHECK(stale.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(n.node->Status().state() == "updating");  // the stale call changed nothing
  REQUIRE(n.Finish(1).ok());
}

TEST_CASE("source lifecycle: a newer StartUpdate abandons an update the coordinator gave up on") {
  Node n;
  REQUIRE(n.Start(1).ok());  // e.g. the coordinator's begin of 1 failed at another source
  REQUIRE(n.Start(2).ok());
  auto late = n.Finish(1);
  CHECK(late.status().code() == absl::StatusCode::kAborted);
  CHECK(std::string(late.status().message()).find("abandoned") != std::string::npos);
  n.Push(2);
  CHECK(n.Finish(2).ok());
}

TEST_CASE("source handlers: a rank stuck mid-bucket does not block another rank's CommitBucket") {
  Node n(2);
  REQUIRE(n.Start(1).ok());
  // Rank 1 says it committed bucket 0 but its ring holds nothing (its process hangs mid-bucket): its call waits for
  // the bucket (SourceNode::kBucketWait) without holding anything rank 0 needs.
  std::atomic<bool> stuck_returned{false};
  absl::Status stuck_status;
  std::thread stuck([&] {
    v1::CommitBucketRequest cb;
    cb.set_session_id(n.other_sessions[0]);
    cb.set_bucket_seq(0);
    stuck_status = n.node->CommitBucket(cb).status();
    stuck_returned = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // rank 1 is waiting now
  const absl::Time t0 = absl::Now();
  n.Push(1);  // rank 0's BeginPush, CommitBucket and EndPush
  const absl::Duration took = absl::Now() - t0;
  CHECK(!stuck_returned.load());  // rank 0 finished while rank 1 was still waiting
  CHECK(took < absl::Seconds(2));
  stuck.join();
  CHECK(stuck_status.code() == absl::StatusCode::kDeadlineExceeded);
}

TEST_CASE("source handlers: a cancelled CommitBucket, BeginPush or FinishUpdate returns promptly") {
  Node n(2);
  std::atomic<bool> gone{false};
  const CancelFn cancelled = [&] { return gone.load(); };
  auto cancel_after = [&](int ms) {
    gone = false;
    return std::thread([&, ms] {
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      gone = true;
    });
  };
  {
    v1::BeginPushRequest bp;  // no update is open: the call would wait for push_timeout (5 s)
    bp.set_session_id(n.session);
    bp.set_version(1);
    std::thread c = cancel_after(200);
    const absl::Time t0 = absl::Now();
    auto r = n.node->BeginPush(bp, absl::Seconds(30), cancelled);
    c.join();
    CHECK(r.status().code() == absl::StatusCode::kCancelled);
    CHECK(absl::Now() - t0 < absl::Seconds(1));
  }
  REQUIRE(n.Start(1).ok());
  {
    v1::CommitBucketRequest cb;  // nothing in the ring: the call would wait kBucketWait (5 s)
    cb.set_session_id(n.other_sessions[0]);
    cb.set_bucket_seq(0);
    std::thread c = cancel_after(200);
    const absl::Time t0 = absl::Now();
    auto r = n.node->CommitBucket(cb, cancelled);
    c.join();
    INFO(r.status().ToString());
    CHECK(r.status().code() == absl::StatusCode::kCancelled);
    CHECK(absl::Now() - t0 < absl::Seconds(1));
  }
  {
    v1::FinishUpdateRequest fr;  // no rank has pushed: the call would wait its 30 s timeout
    fr.set_version(1);
    fr.set_plan_epoch(kPlan);
    fr.set_timeout_seconds(30);
    std::thread c = cancel_after(200);
    const absl::Time t0 = absl::Now();
    auto r = n.node->FinishUpdate(fr, cancelled);
    c.join();
    INFO(r.status().ToString());
    CHECK(r.status().code() == absl::StatusCode::kCancelled);
    CHECK(absl::Now() - t0 < absl::Seconds(1));
  }
  // The freed handlers left the node usable: the next update runs.
  REQUIRE(n.Start(2).ok());
}

TEST_CASE("source liveness: the coordinator's abort during a commit cancels writes blocked on a dead peer") {
  Node n(1, /*hang=*/true);
  REQUIRE(n.Start(1).ok());
  n.Push(1);  // its batches never complete
  absl::StatusOr<v1::FinishUpdateReply> fin = absl::UnknownError("not run");
  absl::Time finished;
  std::thread f([&] {
    fin = n.Finish(1, 30);  // would drain for 30 s
    finished = absl::Now();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  CHECK(n.node->Status().state() == "finishing");
  v1::AbortSourceUpdateRequest ab;
  ab.set_version(1);
  ab.set_reason("target node tn1 lost its lease; engine ranks: engine e0 rank 0");
  const absl::Time t0 = absl::Now();
  auto a = n.node->AbortUpdate(ab);
  INFO(a.status().ToString());
  REQUIRE(a.ok());
  CHECK(!a->quiescent());
  f.join();
  CHECK(finished - t0 < absl::Seconds(2));
  INFO(fin.status().ToString());
  REQUIRE(!fin.ok());
  CHECK(absl::StrContains(fin.status().message(), "target node tn1 lost its lease"));
  CHECK(n.node->Status().last_version() == -1);  // never counted as written
  // The next update re-creates the cancelled endpoint and runs (the peer answers again).
  n.transport.hang = false;
  REQUIRE(n.Start(2).ok());
  n.Push(2);
  auto ok = n.Finish(2);
  INFO(ok.status().ToString());
  CHECK(ok.ok());
}

TEST_CASE("source liveness: an abort while a bucket is being written cancels its writes instead of waiting") {
  Node n(1, /*hang=*/true);
  REQUIRE(n.Start(1).ok());
  n.Push(1);
  v1::AbortSourceUpdateRequest ab;
  ab.set_version(1);
  ab.set_reason("operator");
  const absl::Time t0 = absl::Now();
  auto a = n.node->AbortUpdate(ab, absl::Seconds(30));  // the drain would otherwise wait 30 s
  CHECK(absl::Now() - t0 < absl::Seconds(2));
  REQUIRE(a.ok());
  CHECK(a->was_open());
}

}  // namespace
}  // namespace wsync::daemon

namespace wsync::daemon {
namespace {

TEST_CASE("source configure: a request that fails validation changes nothing; the current plan keeps working") {
  Node n;
  REQUIRE(n.Start(1).ok());
  n.Push(1);
  REQUIRE(n.Finish(1).ok());
  struct Bad {
    const char* what;
    std::function<void(v1::ConfigureSourceRequest&)> mutate;
  };
  const std::vector<Bad> bad = {
      {"a parameter with the wrong size",
       [](v1::ConfigureSourceRequest& r) { r.mutable_targets(0)->mutable_layout()->mutable_params(0)->set_bytes(3); }},
      {"a missing parameter",
       [](v1::ConfigureSourceRequest& r) { r.mutable_targets(0)->mutable_layout()->mutable_params()->RemoveLast(); }},
      {"a config that does not parse", [](v1::ConfigureSourceRequest& r) { r.set_model_config_json("{"); }},
      {"an unknown engine kind", [](v1::ConfigureSourceRequest& r) { r.mutable_targets(0)->set_engine_kind("x"); }},
      {"a segment without descriptor",
       [](v1::ConfigureSourceRequest& r) {
         r.mutable_targets(0)->mutable_layout()->mutable_segments(0)->clear_region_descriptor();
       }},
      {"no targets, no push filters", [](v1::ConfigureSourceRequest& r) { r.clear_targets(); }},
      {"no targets while a rank's push filter names tensors",
       [](v1::ConfigureSourceRequest& r) {
         r.clear_targets();
         auto* f = r.add_push_filters();
         f->set_local_rank(0);
         f->add_tensor_names("model.embed_tokens.weight");
       }},
      {"the same engine rank twice", [](v1::ConfigureSourceRequest& r) { *r.add_targets() = r.targets(0); }},
      {"an unknown quantization", [](v1::ConfigureSourceRequest& r) { r.set_quantization("int3"); }},
      {"fp8_block without a block size", [](v1::ConfigureSourceRequest& r) { r.set_quantization("fp8_block"); }},
      {"an unknown scale format", [](v1::ConfigureSourceRequest& r) { r.set_scale_format("e5m2"); }},
      {"a layout for another parallelism",
       [](v1::ConfigureSourceRequest& r) {
         r.mutable_targets(0)->mutable_layout()->mutable_parallelism()->set_tp_size(2);
       }},
      {"a write range outside its parameter",
       [](v1::ConfigureSourceRequest& r) {
         auto* w = r.mutable_targets(0)->add_writes();
         w->set_param(r.targets(0).layout().params(0).name());
         w->set_offset(r.targets(0).layout().params(0).bytes());
         w->set_length(1);
       }},
      {"a Mooncake segment whose descriptor does not parse",
       [](v1::ConfigureSourceRequest& r) {
         r.mutable_targets(0)->mutable_layout()->mutable_segments(0)->set_kind("mooncake");
       }},
  };
  int64_t v = 2;
  for (const auto& b : bad) {
    v1::ConfigureSourceRequest r = Plan();
    r.set_plan_epoch(kPlan + 1);
    b.mutate(r);
    const auto held = n.node->AppliedConfig();
    auto c = n.node->Configure(r);
    INFO(b.what << ": " << c.status().ToString());
    CHECK_FALSE(c.ok());
    CHECK((c.status().code() == absl::StatusCode::kInvalidArgument ||
           c.status().code() == absl::StatusCode::kFailedPrecondition));
    // The old plan is intact: the same epoch and configuration, and an update under it runs end to end.
    CHECK(n.node->AppliedConfig() == held);
    CHECK(held.first == kPlan);
    CHECK(n.node->Status().state() == "ready");
    REQUIRE(n.Start(v).ok());
    n.Push(v);
    CHECK(n.Finish(v).ok());
    ++v;
  }
}

}  // namespace
}  // namespace wsync::daemon

namespace wsync::daemon {
namespace {

TEST_CASE(
    "source configure: the configuration held is reported by plan epoch and digest; a node without work is "
    "configured with empty push filters") {
  Node n;
  // What heartbeats report: the digest the coordinator computes of what it sent (one function, both sides).
  CHECK(n.node->AppliedConfig() == std::make_pair(kPlan, ConfigureSourceDigest(Plan())));
  v1::ConfigureSourceRequest other = Plan();
  other.set_plan_epoch(kPlan + 5);  // the epoch is not part of the digest
  CHECK(ConfigureSourceDigest(other) == ConfigureSourceDigest(Plan()));
  other.mutable_targets(0)->set_engine_id("e9");
  CHECK(ConfigureSourceDigest(other) != ConfigureSourceDigest(Plan()));

  // No work in this plan: no targets, an empty push list for the local rank. Accepted; then a plan with work again.
  v1::ConfigureSourceRequest idle = Plan();
  idle.set_plan_epoch(kPlan + 1);
  idle.clear_targets();
  idle.add_push_filters()->set_local_rank(0);
  auto c = n.node->Configure(idle);
  INFO(c.status().ToString());
  REQUIRE(c.ok());
  CHECK(n.node->AppliedConfig() == std::make_pair(kPlan + 1, ConfigureSourceDigest(idle)));
  REQUIRE(n.node->Configure(Plan()).ok());
  REQUIRE(n.Start(1).ok());
  n.Push(1);
  CHECK(n.Finish(1).ok());
}

}  // namespace
}  // namespace wsync::daemon
