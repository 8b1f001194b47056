// The source's pure configuration step (daemon/node/source_plan.h): what it decides for a request and what it
// refuses, with no sockets, threads or replica memory; at the size of a Kimi-K2 cluster of 8 engines x 32 ranks.
// Then the step that applies a plan (SourceNode::Configure over a null transport): its targets are connected
// several at once, and no connect starts after the caller's deadline.
#include "daemon/node/source_plan.h"

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "daemon/node/source_node.h"
#include "replica/layout_plan.h"
#include "tests/daemon/null_source.h"
#include "tools/testdata/planned_layout.h"
#include "transport/mooncake/mooncake_transport.h"
#include "transport/registry.h"

namespace wsync::daemon {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  REQUIRE(f.good());
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// Engine rank `rank` of a TP=`tp` engine as the planner lays it out, in one segment of `kind` whose descriptor is
// `descriptor`.
v1::TargetAssignment Target(const replica::ModelConfig& cfg, const replica::QuantSpec& q, const std::string& engine,
                            int tp, int rank, const std::string& kind = "host", const std::string& descriptor = "d",
                            int ep = 1) {
  auto l = testdata::PlannedRankLayout(cfg, replica::RankParallelism::ForTp(tp, rank, ep), q);
  INFO(l.status().ToString());
  REQUIRE(l.ok());
  v1::TargetAssignment a;
  a.set_engine_id(engine);
  a.set_rank(rank);
  a.set_target_daemon("127.0.0.1:1");
  a.set_engine_kind("sglang");
  *a.mutable_layout() = *std::move(l);
  auto* seg = a.mutable_layout()->add_segments();
  seg->set_id(0);
  seg->set_kind(kind);
  seg->set_bytes(a.layout().region_bytes());
  seg->set_region_descriptor(descriptor);
  return a;
}

struct Tiny {
  Tiny() {
    json = ReadFile(WSYNC_TINY_MODEL);
    auto c = replica::ModelConfig::FromJson(json);
    REQUIRE(c.ok());
    cfg = *c;
  }
  v1::ConfigureSourceRequest Request(int engines, int tp) const {
    v1::ConfigureSourceRequest req;
    req.set_model_config_json(json);
    req.set_plan_epoch(3);
    for (int e = 0; e < engines; ++e)
      for (int r = 0; r < tp; ++r) *req.add_targets() = Target(cfg, {}, "e" + std::to_string(e), tp, r);
    return req;
  }
  std::string json;
  replica::ModelConfig cfg;
};

SourcePlanOptions Options(int ranks = 1) {
  SourcePlanOptions o;
  o.trainer_ranks = ranks;
  o.node_transport = transport::CapabilitiesOf("tcp");
  return o;
}

std::string Mooncake(const std::string& session, uint64_t bytes) {
  auto d = transport::mooncake::MakeRegionDescriptor(session, 0x7f0000000000ull, bytes);
  REQUIRE(d.ok());
  return *d;
}

// The request refused, with a message naming `what`.
void Refused(const v1::ConfigureSourceRequest& req, const std::string& what, const SourcePlanOptions& o = Options()) {
  auto plan = PlanSourceConfiguration(req, o);
  INFO(plan.status().ToString());
  REQUIRE_FALSE(plan.ok());
  CHECK_THAT(std::string(plan.status().message()), Catch::Contains(what));
}

}  // namespace

TEST_CASE("a Kimi-K2 cluster of 8 engines x 32 ranks: 32 layouts, every rank wired, nothing refused") {
  const std::string json = ReadFile(std::string(WSYNC_MODELS_DIR) + "/moonshotai__Kimi-K2-Instruct/config.json");
  auto cfg = replica::ModelConfig::FromJson(json);
  REQUIRE(cfg.ok());
  replica::QuantSpec q;
  q.mode = replica::QuantSpec::Mode::kFp8Block;
  q.block_n = q.block_k = 64;  // whole blocks at TP 32 (as the engines of a seed-shaped cluster)
  constexpr int kEngines = 8, kTp = 32;
  v1::ConfigureSourceRequest req;
  req.set_model_config_json(json);
  req.set_quantization("fp8_block");
  req.add_weight_block_size(64);
  req.add_weight_block_size(64);
  std::vector<v1::TargetAssignment> ranks;
  for (int r = 0; r < kTp; ++r) ranks.push_back(Target(*cfg, q, "", kTp, r, "host", "d", kTp));
  for (int e = 0; e < kEngines; ++e)
    for (int r = 0; r < kTp; ++r) {
      v1::TargetAssignment a = ranks[r];
      a.set_engine_id("e" + std::to_string(e));
      // Engine 7 is GPU memory: its ranks take deltas too (the target daemon scatters them on the device).
      if (e == 7) a.mutable_layout()->mutable_segments(0)->set_kind("cuda");
      *req.add_targets() = std::move(a);
    }
  auto plan = PlanSourceConfiguration(req, Options(8));
  INFO(plan.status().ToString());
  REQUIRE(plan.ok());
  REQUIRE(plan->layouts.size() == kTp);  // identical ranks of the 8 engines share one layout
  REQUIRE(plan->targets.size() == kEngines * kTp);
  CHECK(plan->transports.empty());
  for (int e = 0; e < kEngines; ++e)
    for (int r = 0; r < kTp; ++r) {
      const PlannedTarget& t = plan->targets[e * kTp + r];
      CHECK(t.index == e * kTp + r);
      CHECK(t.layout == r);
      CHECK(t.transport.empty());
      CHECK(t.caps.needs_target_daemon);
      const replica::ParamTable& table = plan->tables[r];
      REQUIRE(t.ranges.size() == table.params().size());
      // Every byte of every param, at the engine's offsets, through segment 0 (one check per rank: 2.5 M otherwise).
      uint64_t bytes = 0;
      std::vector<std::string> wrong;
      for (size_t p = 0; p < table.params().size(); ++p) {
        const v1::ParamDesc& theirs = req.targets(t.index).layout().params(t.layout_index[p]);
        if (t.ranges[p] != std::vector<std::pair<uint64_t, uint64_t>>{{0, table.params()[p].bytes}} ||
            t.segment[p] != 0 || t.dst_offset[p] != theirs.offset() || theirs.name() != table.params()[p].name ||
            t.host_param[p] != 1)
          wrong.push_back(table.params()[p].name);
        bytes += table.params()[p].bytes;
      }
      CHECK(wrong.empty());
      CHECK(bytes <= table.total_bytes());
      CHECK(t.delta_write_bytes == bytes);
    }
  for (const auto& req_l : plan->required) CHECK(std::count(req_l.begin(), req_l.end(), 0) == 0);
  CHECK(plan->rank_push.empty());  // no push filters: the source splits its need itself
  // Pure: the same input gives the same plan.
  auto again = PlanSourceConfiguration(req, Options(8));
  REQUIRE(again.ok());
  CHECK(again->required == plan->required);
  REQUIRE(again->targets.size() == plan->targets.size());
  for (size_t i = 0; i < plan->targets.size(); ++i) {
    CHECK(again->targets[i].ranges == plan->targets[i].ranges);
    CHECK(again->targets[i].dst_offset == plan->targets[i].dst_offset);
  }
}

TEST_CASE("the plan's write ranges decide what an update must complete") {
  Tiny tiny;
  v1::ConfigureSourceRequest req = tiny.Request(1, 2);
  const std::string p0 = req.targets(0).layout().params(0).name();
  auto* w = req.mutable_targets(0)->add_writes();
  w->set_param(p0);
  w->set_offset(2);
  w->set_length(4);
  auto* w1 = req.mutable_targets(1)->add_writes();
  w1->set_param(p0);
  w1->set_offset(0);
  w1->set_length(2);
  auto plan = PlanSourceConfiguration(req, Options());
  INFO(plan.status().ToString());
  REQUIRE(plan.ok());
  REQUIRE(plan->layouts.size() == 2);
  for (int l = 0; l < 2; ++l) {
    const PlannedTarget& t = plan->targets[l];
    const int p = plan->tables[t.layout].IndexOf(p0);
    REQUIRE(p >= 0);
    for (size_t i = 0; i < t.ranges.size(); ++i) {
      CHECK(t.ranges[i].empty() == (static_cast<int>(i) != p));
      CHECK(plan->required[t.layout][i] == (static_cast<int>(i) == p ? 1 : 0));
    }
    CHECK(t.delta_write_bytes == (l == 0 ? 4u : 2u));
  }
}

TEST_CASE("segments a registered backend owns are written by it, connected to the peer their descriptors name") {
  Tiny tiny;
  v1::ConfigureSourceRequest req = tiny.Request(1, 2);
  for (int r = 0; r < 2; ++r) {
    auto* seg = req.mutable_targets(r)->mutable_layout()->mutable_segments(0);
    seg->set_kind("mooncake");
    seg->set_region_descriptor(Mooncake("127.0.0.1:1545" + std::to_string(r), seg->bytes()));
  }
  auto plan = PlanSourceConfiguration(req, Options());
  INFO(plan.status().ToString());
  REQUIRE(plan.ok());
  CHECK(plan->transports == std::set<std::string>{"mooncake"});
  for (int r = 0; r < 2; ++r) {
    const PlannedTarget& t = plan->targets[r];
    CHECK(t.transport == "mooncake");
    CHECK(t.peer == "127.0.0.1:1545" + std::to_string(r));
    CHECK_FALSE(t.caps.needs_target_daemon);
    CHECK(t.caps.one_sided_only);
    // Nothing beside that memory decodes deltas.
    for (char h : t.host_param) CHECK(h == 0);
    CHECK(t.delta_write_bytes == 0);
  }
  // The registry says which backend owns which kind; the daemon's own transport writes everything else.
  REQUIRE(transport::TransportForSegmentKind(SegmentKind::kMooncake) != nullptr);
  CHECK(transport::TransportForSegmentKind(SegmentKind::kMooncake)->name == "mooncake");
  CHECK(transport::TransportForSegmentKind(SegmentKind::kHost) == nullptr);
  CHECK(transport::TransportForSegmentKind(SegmentKind::kCuda) == nullptr);
}

TEST_CASE("refusals name what is wrong") {
  Tiny tiny;
  SECTION("segments of one rank in two peers of a direct backend") {
    v1::ConfigureSourceRequest req = tiny.Request(1, 1);
    auto* l = req.mutable_targets(0)->mutable_layout();
    l->mutable_segments(0)->set_kind("mooncake");
    l->mutable_segments(0)->set_region_descriptor(Mooncake("127.0.0.1:1", 64));
    auto* s1 = l->add_segments();
    s1->set_id(1);
    s1->set_kind("mooncake");
    s1->set_bytes(64);
    s1->set_region_descriptor(Mooncake("127.0.0.1:2", 64));
    Refused(req, "segments in two mooncake peers (127.0.0.1:1, 127.0.0.1:2)");
  }
  SECTION("a rank mixing backends") {
    v1::ConfigureSourceRequest req = tiny.Request(1, 1);
    auto* l = req.mutable_targets(0)->mutable_layout();
    auto* s1 = l->add_segments();
    s1->set_id(1);
    s1->set_kind("mooncake");
    s1->set_bytes(64);
    s1->set_region_descriptor(Mooncake("127.0.0.1:1", 64));
    Refused(req, "engine e0 rank 0: mixes host and mooncake segments");
  }
  SECTION("a descriptor the owning backend cannot parse") {
    v1::ConfigureSourceRequest req = tiny.Request(1, 1);
    req.mutable_targets(0)->mutable_layout()->mutable_segments(0)->set_kind("mooncake");
    Refused(req, "segment 0 of engine e0 rank 0");
  }
  SECTION("a segment kind no one knows (the wire's name, parsed once here)") {
    v1::ConfigureSourceRequest req = tiny.Request(1, 1);
    req.mutable_targets(0)->mutable_layout()->mutable_segments(0)->set_kind("gpu");
    Refused(req, "segment 0 of engine e0 rank 0: unknown segment kind \"gpu\" (known: host, cuda, mooncake)");
  }
  SECTION("a segment without a descriptor") {
    v1::ConfigureSourceRequest req = tiny.Request(1, 1);
    req.mutable_targets(0)->mutable_layout()->mutable_segments(0)->clear_region_descriptor();
    Refused(req, "segment 0 has no region descriptor");
  }
  SECTION("a target twice") {
    v1::ConfigureSourceRequest req = tiny.Request(1, 1);
    *req.add_targets() = req.targets(0);
    Refused(req, "engine e0 rank 0 is a target twice in the plan");
  }
  SECTION("unknown engine kind, quantization, scale format") {
    v1::ConfigureSourceRequest req = tiny.Request(1, 1);
    req.mutable_targets(0)->set_engine_kind("trt");
    Refused(req, "unknown engine kind 'trt'");
    req = tiny.Request(1, 1);
    req.set_quantization("int4");
    Refused(req, "unknown method 'int4'");
    req = tiny.Request(1, 1);
    req.set_scale_format("e5m2");
    Refused(req, "scale_format are only meaningful with method fp8_block");
    req = tiny.Request(1, 1);
    req.set_quantization("fp8_block");
    req.add_weight_block_size(128);
    req.add_weight_block_size(128);
    req.set_scale_format("e5m2");
    Refused(req, "unknown scale_format 'e5m2'");
    req = tiny.Request(1, 1);
    req.set_quantization("fp8_block");
    Refused(req, "block_size");  // no silent 128x128 default
  }
  SECTION("a layout that does not match the model") {
    v1::ConfigureSourceRequest req = tiny.Request(1, 1);
    auto* p = req.mutable_targets(0)->mutable_layout()->mutable_params(0);
    p->set_bytes(p->bytes() + 2);
    Refused(req, "parameter " + p->name() + ": replica has");
    req = tiny.Request(1, 1);
    req.mutable_targets(0)->mutable_layout()->mutable_segments(0)->set_bytes(8);
    Refused(req, "lies outside segment 0");
  }
  SECTION("a write range outside its parameter or naming none") {
    v1::ConfigureSourceRequest req = tiny.Request(1, 1);
    auto* w = req.mutable_targets(0)->add_writes();
    w->set_param(req.targets(0).layout().params(0).name());
    w->set_offset(req.targets(0).layout().params(0).bytes());
    w->set_length(1);
    Refused(req, "is empty or outside its");
    w->set_param("model.nothing");
    w->set_offset(0);
    Refused(req, "names no parameter of the layout");
  }
  SECTION("push filters") {
    v1::ConfigureSourceRequest req = tiny.Request(1, 1);
    auto* f = req.add_push_filters();
    f->set_local_rank(2);
    Refused(req, "push filter for local rank 2: out of range [0, 2)", Options(2));
    f->set_local_rank(0);
    f->add_tensor_names("model.nothing.weight");
    Refused(req, "names model.nothing.weight, which is not a tensor of the model", Options(2));
    f->clear_tensor_names();
    f->add_tensor_names("model.norm.weight");
    auto* f1 = req.add_push_filters();
    f1->set_local_rank(1);
    f1->add_tensor_names("model.norm.weight");
    Refused(req, "tensor model.norm.weight is assigned to two local ranks", Options(2));
    f1->clear_tensor_names();
    auto* sl = f1->add_slices();
    sl->set_name("model.norm.weight");
    sl->add_shape(64);
    sl->add_offsets(0);
    sl->add_extents(32);
    Refused(req, "tensor model.norm.weight is both pushed whole and sliced", Options(2));
    f1->clear_slices();
    auto plan = PlanSourceConfiguration(req, Options(2));
    INFO(plan.status().ToString());
    REQUIRE(plan.ok());
    CHECK(plan->rank_push.at(0) == std::vector<std::string>{"model.norm.weight"});
    CHECK(plan->rank_push.at(1).empty());
  }
  SECTION("push filters naming tensors without targets") {
    v1::ConfigureSourceRequest req;
    req.set_model_config_json(tiny.json);
    Refused(req, "the plan names no targets but the push filters are missing or name tensors");
    auto* f = req.add_push_filters();
    f->set_local_rank(0);
    auto plan = PlanSourceConfiguration(req, Options());
    REQUIRE(plan.ok());  // a node without work: an empty filter per rank
    CHECK(plan->targets.empty());
    CHECK(plan->layouts.empty());
  }
}

TEST_CASE("applying a plan connects its targets several at once, none after the caller's deadline") {
  // Engine ranks of one layout, each target daemon answering its ConnectTarget after 200 ms.
  v1::ConfigureSourceRequest req = testing::TinyPlan(WSYNC_TINY_MODEL, 1);
  const v1::TargetAssignment one = req.targets(0);
  req.clear_targets();
  for (int e = 0; e < 40; ++e) {
    v1::TargetAssignment a = one;
    a.set_engine_id("e" + std::to_string(e));
    *req.add_targets() = a;
  }
  std::atomic<int> in_flight{0}, most{0}, calls{0};
  auto connect = [&](const std::string&, const v1::ConnectTargetRequest&) -> absl::StatusOr<std::string> {
    const int now = ++in_flight;
    int seen = most.load();
    while (now > seen && !most.compare_exchange_weak(seen, now)) {
    }
    ++calls;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    --in_flight;
    return std::string("null");
  };
  testing::NullTransport transport;
  SourceOptions o;
  o.node_id = "src";
  SourceNode node(o, &transport, connect);

  SECTION("twelve targets: about one connect's time, not twelve") {
    while (req.targets_size() > 12) req.mutable_targets()->RemoveLast();
    const absl::Time start = absl::Now();
    auto r = node.Configure(req);
    INFO(r.status().ToString());
    REQUIRE(r.ok());
    CHECK(calls == 12);
    CHECK(most > 1);
    CHECK(absl::Now() - start < absl::Milliseconds(12 * 200 / 2));
  }
  SECTION("forty targets and a deadline the first ones' connects outlast: the rest are not started") {
    auto r = node.Configure(req, absl::Now() + absl::Milliseconds(100));
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == absl::StatusCode::kDeadlineExceeded);
    CHECK_THAT(std::string(r.status().message()), Catch::Contains("the caller's deadline passed first"));
    CHECK(calls < 40);
    CHECK(node.AppliedConfig().first == -1);  // unconfigured: a failure after the plan was decided
  }
}

}  // namespace wsync::daemon
