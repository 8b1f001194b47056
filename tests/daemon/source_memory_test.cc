// A source daemon's memory per update, in process: a real SourceNode (the tiny model's replica, write checksums on
// their hash pool, a trainer rank pushing every update through the real shared-memory ring, a null transport) runs
// hundreds of updates; what it retains across updates (checksum records, sessions, lost/ended ranks, staged tensors,
// metric series) must stay the same size after warm-up, and so must the heap (glibc's mallinfo2): a leak of a few
// hundred bytes per update fails it.

#include <malloc.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "client/ring/ring.h"
#include "daemon/node/source_node.h"
#include "replica/model_config.h"
#include "tests/daemon/null_source.h"

namespace wsync::daemon {
namespace {

constexpr int64_t kPlan = 5;

struct Node {
  testing::NullTransport transport;
  std::unique_ptr<SourceNode> node;
  std::string session;
  ScopedFd ring_fd;
  std::map<std::string, replica::TensorSpec> specs;
  std::vector<uint8_t> fill;

  Node() {
    SourceOptions o;
    o.node_id = "src";
    o.trainer_ranks = 1;
    o.ring_bytes = 8 << 20;
    o.push_timeout = absl::Seconds(5);
    o.write_checksum_threads = 2;
    node = std::make_unique<SourceNode>(
        o, &transport, [](const std::string&, const v1::ConnectTargetRequest&) -> absl::StatusOr<std::string> {
          return std::string("null");
        });
    auto c = node->Configure(testing::TinyPlan(WSYNC_TINY_MODEL, kPlan));
    INFO(c.status().ToString());
    REQUIRE(c.ok());
    SessionRequest os;
    auto s = node->OpenSession(os);
    REQUIRE(s.ok());
    session = s->id;
    ring_fd = std::move(s->ring_fd);
    auto cfg = replica::ModelConfig::FromFile(WSYNC_TINY_MODEL);
    REQUIRE(cfg.ok());
    auto all = replica::CheckpointTensors(*cfg);
    REQUIRE(all.ok());
    for (auto& t : *all) specs[t.name] = t;
  }

  // One whole update v: StartUpdate, every tensor in one bucket (bytes depend on v), EndPush, FinishUpdate.
  void Update(int64_t v) {
    v1::StartUpdateRequest su;
    su.set_version(v);
    su.set_plan_epoch(kPlan);
    REQUIRE(node->StartUpdate(su).ok());
    v1::BeginPushRequest bp;
    bp.set_session_id(session);
    bp.set_version(v);
    auto names = node->BeginPush(bp);
    REQUIRE(names.ok());
    auto prod = RingProducer::Attach(ring_fd.get());
    REQUIRE(prod.ok());
    for (const auto& n : names->tensor_names()) {
      const replica::TensorSpec& s = specs.at(n);
      auto dst = prod->BeginTensor(s.name, s.dtype, s.shape, s.bytes(), absl::Seconds(5));
      REQUIRE(dst.ok());
      std::memset(*dst, static_cast<int>(v & 0x3f), s.bytes());  // small values: valid in every float dtype
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
    v1::FinishUpdateRequest fu;
    fu.set_version(v);
    fu.set_plan_epoch(kPlan);
    fu.set_timeout_seconds(10);
    auto f = node->FinishUpdate(fu);
    INFO(f.status().ToString());
    REQUIRE(f.ok());
  }
};

size_t HeapInUse() {
  const struct mallinfo2 m = mallinfo2();
  return m.uordblks + m.hblkhd;
}

size_t MetricSeries(SourceNode& n) {
  size_t lines = 0;
  for (absl::string_view l : absl::StrSplit(n.metrics().Render(), '\n'))
    lines += !l.empty() && !absl::StartsWith(l, "#");
  return lines;
}

TEST_CASE("source memory: what a source keeps across updates, and its heap, stay flat over hundreds of updates",
          "[faults]") {
  Node n;
  constexpr int kWarmup = 30, kUpdates = 300;
  int64_t v = 1;
  for (; v <= kWarmup; ++v) n.Update(v);
  const SourceNode::Retained r0 = n.node->RetainedSizes();
  const size_t series0 = MetricSeries(*n.node);
  malloc_trim(0);
  const size_t heap0 = HeapInUse();
  for (; v <= kWarmup + kUpdates; ++v) n.Update(v);
  const SourceNode::Retained r1 = n.node->RetainedSizes();
  const size_t series1 = MetricSeries(*n.node);
  malloc_trim(0);
  const size_t heap1 = HeapInUse();
  const double per_update = (static_cast<double>(heap1) - static_cast<double>(heap0)) / kUpdates;
  std::printf(
      "source memory: heap %zu -> %zu bytes over %d updates (%.1f bytes/update); checksum versions %zu, "
      "entries %zu; metric series %zu -> %zu\n",
      heap0, heap1, kUpdates, per_update, r1.checksum_versions, r1.checksum_entries, series0, series1);
  CHECK(r1.checksum_versions == SourceNode::kChecksumVersionsKept);
  CHECK(r1.checksum_entries == r0.checksum_entries);
  CHECK(r1.sessions == 1);
  CHECK(r1.lost_ranks == 0);
  CHECK(r1.staged_tensors == r0.staged_tensors);
  CHECK(series1 == series0);
  CHECK(per_update < 256);  // a record kept per update, however small, shows here
  // The newest versions' checksums are still there, the older ones named as gone.
  CHECK(n.node->WriteChecksums(v - 1).ok());
  CHECK(absl::IsNotFound(n.node->WriteChecksums(1).status()));
}

TEST_CASE("source metrics: counters are exported at zero before the first update; write rate in bytes per second") {
  Node n;
  const std::string before = n.node->metrics().Render();
  INFO(before);
  for (const char* series :
       {"wsync_source_updates_total{result=\"ok\"} 0\n", "wsync_source_updates_total{result=\"aborted\"} 0\n",
        "wsync_source_buckets_total{result=\"rejected\"} 0\n", "wsync_source_placements_total{result=\"ok\"} 0\n",
        "wsync_source_sliced_tensors_total{path=\"staged\"} 0\n", "wsync_source_bytes_written_total 0\n",
        "wsync_source_bucket_write_seconds_count 0\n"})
    CHECK(absl::StrContains(before, series));
  CHECK_FALSE(absl::StrContains(before, "\nwsync_source_update_write_bytes_per_second "));  // no update yet
  n.Update(1);
  const double bytes = n.node->metrics().Value("wsync_source_bytes_written_total", {});
  const double rate = n.node->metrics().Value("wsync_source_update_write_bytes_per_second", {});
  CHECK(n.node->metrics().Value("wsync_source_updates_total", {{"result", "ok"}}) == 1);
  CHECK(bytes > 0);
  // Base units: at least the update's bytes per hour, which a GB/s figure of this tiny model would never reach.
  CHECK(rate >= bytes / 3600);
}

}  // namespace
}  // namespace wsync::daemon
