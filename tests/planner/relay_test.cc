// Relay plans (planner/relay.h): groups, tree shapes, what the sources write, what relays forward, and the cost
// model's choice of degree. Expectations are computed from the inputs (layout bytes, NIC rates), not read back from
// the planner's own figures.

#include "planner/relay.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <set>

#include "synthetic.h"

namespace wsync::planner {
namespace {

using testing::MakeInput;
using testing::SyntheticShape;

uint64_t CopyBytes(const PlanInput& in) {
  uint64_t b = 0;
  for (const auto& l : in.layouts)
    for (const auto& p : l.params) b += p.bytes;
  return b;
}

uint64_t Egress(const Plan& p) {
  uint64_t b = 0;
  for (const auto& s : p.sources) b += s.bytes_out;
  return b;
}

// One NIC per node: the trainer's 8 ranks share their node's one link, and every engine rank has a node (and so a
// NIC) of its own. Writing N copies binds the direct plan to the trainer's link at the default rates, which is what
// relaying is for.
SyntheticShape TrainerLinkBound(int instances) {
  SyntheticShape s;  // the trainer: 1 node of 8 GPUs
  s.instances = instances;
  s.engine_tp = 8;
  s.nics = 1;
  s.engine_nodes = instances * 8;
  return s;
}

PlanInput TrainerLinkBoundInput(int instances) { return MakeInput(TrainerLinkBound(instances)); }

RelayPlan MustRelay(const PlanInput& in, RelayOptions ro, PlanOptions opt = {},
                    const std::vector<EngineLayoutKey>& keys = {}) {
  auto rp = BuildRelayPlan(in, opt, ro, keys);
  INFO(rp.status().message());
  REQUIRE(rp.ok());
  const absl::Status v = VerifyRelayPlan(in, *rp);
  INFO(v.message());
  CHECK(v.ok());
  return *std::move(rp);
}

RelayOptions Degree(int d) {
  RelayOptions o;
  o.mode = RelayMode::kDegree;
  o.degree = d;
  return o;
}

RelayOptions Auto() {
  RelayOptions o;
  o.mode = RelayMode::kAuto;
  return o;
}

bool SamePlan(const Plan& a, const Plan& b) {
  if (a.strategy != b.strategy || a.sources.size() != b.sources.size() || a.target_bytes != b.target_bytes ||
      a.source_nics.size() != b.source_nics.size() || a.target_nics.size() != b.target_nics.size())
    return false;
  for (size_t k = 0; k < a.sources.size(); ++k) {
    const SourcePlan &x = a.sources[k], &y = b.sources[k];
    if (!(x.tasks == y.tasks) || !(x.assignments == y.assignments) || x.push_filter != y.push_filter ||
        x.bytes_out != y.bytes_out || x.load_bytes != y.load_bytes || x.push_bytes != y.push_bytes ||
        x.sessions != y.sessions)
      return false;
  }
  for (size_t k = 0; k < a.source_nics.size(); ++k)
    if (a.source_nics[k].bytes != b.source_nics[k].bytes || a.source_nics[k].sessions != b.source_nics[k].sessions)
      return false;
  for (size_t k = 0; k < a.target_nics.size(); ++k)
    if (a.target_nics[k].bytes != b.target_nics[k].bytes || a.target_nics[k].sessions != b.target_nics[k].sessions)
      return false;
  return true;
}

TEST_CASE("relay: --relay parses auto, off and a degree", "[planner][relay]") {
  CHECK(ParseRelayMode("off")->mode == RelayMode::kOff);
  CHECK(ParseRelayMode("AUTO")->mode == RelayMode::kAuto);
  auto d = ParseRelayMode("3");
  REQUIRE(d.ok());
  CHECK(d->mode == RelayMode::kDegree);
  CHECK(d->degree == 3);
  CHECK(FormatRelayMode(*d) == "3");
  for (const char* bad : {"0", "-2", "two", "", "1.5"}) {
    INFO(bad);
    CHECK(!ParseRelayMode(bad).ok());
  }
}

TEST_CASE("relay: tree shapes are complete d-ary trees in the members' order", "[planner][relay]") {
  const std::vector<int> members = {4, 2, 7, 0, 1, 3, 5, 6};
  for (int d : {1, 2, 3, 7, 9}) {
    INFO("degree " << d);
    const std::vector<RelayNode> nodes = RelayTreeShape(members, d);
    REQUIRE(nodes.size() == members.size());
    CHECK(nodes[0].instance == 4);
    CHECK(nodes[0].parent == -1);
    int depth = 0;
    for (size_t k = 1; k < nodes.size(); ++k) {
      CHECK(nodes[k].parent == members[(k - 1) / d]);
      depth = std::max(depth, nodes[k].depth);
    }
    for (const RelayNode& n : nodes) CHECK(static_cast<int>(n.children.size()) <= d);
    // depth of a complete d-ary tree of 8: the smallest h with 1 + d + ... + d^h >= 8
    int h = 0;
    for (long cap = 1, level = 1; cap < 8; ++h) level *= d, cap += level;
    CHECK(depth == h);
  }
}

TEST_CASE("relay: instances group by layout key, mixed layouts never share a tree", "[planner][relay]") {
  EngineLayoutKey a, b, c;
  a.kind = b.kind = c.kind = "sglang";
  a.tp = b.tp = c.tp = 8;
  b.quantization = "fp8_block 128x128";
  c.dtype = "fp8_e4m3";
  auto g = GroupByLayout({0, 1, 2, 3, 4, 5}, {a, b, a, c, b, a});
  REQUIRE(g.ok());
  REQUIRE(g->size() == 3);
  CHECK((*g)[0].instances == std::vector<int>{0, 2, 5});
  CHECK((*g)[1].instances == std::vector<int>{1, 4});
  CHECK((*g)[2].instances == std::vector<int>{3});
  CHECK(!GroupByLayout({0, 1}, {a}).ok());
  CHECK(!GroupByLayout({0, 0}, {a, a}).ok());

  // In a plan: one copy per group leaves the trainer, each group relays inside itself.
  const PlanInput in = TrainerLinkBoundInput(6);
  const RelayPlan rp = MustRelay(in, Degree(2), {}, {a, b, a, c, b, a});
  REQUIRE(rp.relayed);
  REQUIRE(rp.trees.size() == 3);
  CHECK(rp.roots_input.instances == std::vector<int>{0, 1, 3});
  CHECK(Egress(rp.plan) == 3 * CopyBytes(in));
  for (const RelayTree& t : rp.trees) {
    std::set<int> members(t.group.instances.begin(), t.group.instances.end());
    for (const RelayNode& n : t.nodes) {
      CHECK(members.count(n.instance) == 1);
      if (n.parent >= 0) CHECK(members.count(n.parent) == 1);
    }
  }
  CHECK(rp.trees[2].nodes.size() == 1);  // c alone: written by the sources, forwards nothing
  CHECK(rp.trees[2].depth == 0);
}

TEST_CASE("relay: one instance is never relayed", "[planner][relay]") {
  const PlanInput in = TrainerLinkBoundInput(1);
  const Plan direct = *BuildPlan(in, {});
  for (const RelayOptions& o : {Auto(), Degree(2)}) {
    const RelayPlan rp = MustRelay(in, o);
    CHECK(!rp.relayed);
    CHECK(rp.trees.empty());
    CHECK(SamePlan(rp.plan, direct));
  }
}

TEST_CASE("relay: off is today's plan, exactly", "[planner][relay]") {
  for (const SyntheticShape& shape : testing::CoverageShapes()) {
    const PlanInput in = MakeInput(shape);
    for (Strategy s : {Strategy::kSeed, Strategy::kBalanced}) {
      PlanOptions opt;
      opt.strategy = s;
      const RelayPlan rp = MustRelay(in, RelayOptions{}, opt);
      CHECK(!rp.relayed);
      CHECK(SamePlan(rp.plan, *BuildPlan(in, opt)));
      const Prediction p = PredictPlan(in, rp.plan, opt.cost);
      const RelayPrediction r = PredictRelay(in, rp, opt.cost);
      CHECK(r.total_s == p.total_s);
      CHECK(r.hops.empty());
    }
  }
}

TEST_CASE("relay: at 8 instances the trainer sends one copy and the update takes about one instance's time",
          "[planner][relay]") {
  const PlanOptions opt;  // the default rates
  const PlanInput in8 = TrainerLinkBoundInput(8);
  PlanInput in1 = in8;
  in1.instances = {0};  // the same cluster, one instance
  const double single = PredictPlan(in1, *BuildPlan(in1, opt), opt.cost).total_s;
  const Plan direct = *BuildPlan(in8, opt);
  const double direct_s = PredictPlan(in8, direct, opt.cost).total_s;
  // The premise: writing 8 copies over the trainer's one link binds the direct plan.
  REQUIRE(Egress(direct) == 8 * CopyBytes(in8));
  REQUIRE(direct_s > 2 * single);

  const RelayPlan rp = MustRelay(in8, Auto(), opt);
  REQUIRE(rp.relayed);
  CHECK(rp.trainer_egress_bytes == CopyBytes(in8));
  CHECK(Egress(rp.plan) == CopyBytes(in8));
  const RelayPrediction pr = PredictRelay(in8, rp, opt.cost);
  INFO("single " << single << " s, relay " << pr.total_s << " s, direct " << direct_s << " s");
  CHECK(pr.total_s <= 1.15 * single);
  CHECK(pr.total_s < direct_s);
  CHECK(pr.trainer_egress_bytes == CopyBytes(in8));
  // Every instance is reached: the root by the sources, the others by exactly one relay.
  REQUIRE(rp.trees.size() == 1);
  CHECK(rp.trees[0].nodes.size() == 8);
  CHECK(pr.hops.size() == 8);
}

TEST_CASE("relay: chunk pipelining, each level adds one chunk's time, not one copy", "[planner][relay]") {
  const PlanOptions opt;
  const PlanInput in = TrainerLinkBoundInput(8);
  const RelayPlan rp = MustRelay(in, Degree(1), opt);  // a chain: 7 levels
  REQUIRE(rp.trees[0].depth == 7);
  const RelayPrediction pr = PredictRelay(in, rp, opt.cost);
  // One engine rank per NIC, one child each: a chunk crosses a relay's NIC alone.
  const double bw = in.cluster.nic.bytes_per_second();
  const double chunk = static_cast<double>(rp.options.chunk_bytes) / bw + opt.cost.relay_hop_ms / 1e3;
  CHECK(pr.latency_s == Approx(7 * chunk));
  CHECK(pr.transfer_s == Approx(std::max(pr.source_s, pr.tree_s) + 7 * chunk));
  // Store-and-forward would add a whole copy per level.
  uint64_t rank_bytes = 0;
  for (const auto& p : in.layouts[0].params) rank_bytes += p.bytes;
  CHECK(pr.latency_s < 0.1 * 7 * rank_bytes / bw);
  // Per-hop figures: the first chunk reaches level k after k hops.
  for (const RelayHop& h : pr.hops) CHECK(h.first_s == Approx(h.level * chunk));
  // Halving the chunk halves the bytes part of every hop.
  RelayOptions small = Degree(1);
  small.chunk_bytes = rp.options.chunk_bytes / 2;
  const RelayPrediction ps = PredictRelay(in, MustRelay(in, small, opt), opt.cost);
  CHECK(ps.latency_s == Approx(7 * (static_cast<double>(small.chunk_bytes) / bw + opt.cost.relay_hop_ms / 1e3)));
}

TEST_CASE("relay: a relay's egress bounds the degree", "[planner][relay]") {
  const PlanInput in = TrainerLinkBoundInput(16);
  const double bw = in.cluster.nic.bytes_per_second();
  uint64_t rank_bytes = 0;  // every rank's layout is the same size here
  for (const auto& p : in.layouts[0].params) rank_bytes += p.bytes;
  const double copy_s = rank_bytes / bw;  // one copy through one engine rank's NIC
  std::vector<int> bounds;
  for (double load : {16.0, 1.0, 0.25}) {
    INFO("replica load " << load << " GB/s per source");
    PlanOptions opt;
    opt.cost.replica_load_gbps = load;
    opt.cost.session_ms = 0;  // bytes only, so the bound can be written down
    const RelayPlan chain = MustRelay(in, Degree(1), opt);
    const int dmax = MaxRelayDegree(in, chain, opt.cost, 0);
    bounds.push_back(dmax);
    // A relay NIC sends d copies of its rank while it takes one in; it keeps up while that takes no longer than
    // the sources take to write the root (or one copy in, whichever is slower).
    const double source_s = PredictTransfer(chain.roots_input, chain.plan, opt.cost).transfer_s;
    const int want = std::clamp(static_cast<int>(std::max(source_s, copy_s) / copy_s + 1e-9), 1, 15);
    INFO("sources " << source_s << " s, one copy " << copy_s << " s, bound " << dmax);
    CHECK(dmax == want);
    const RelayPlan a = MustRelay(in, Auto(), opt);  // direct at the slowest load (16 copies fit its time)
    if (a.relayed) CHECK(a.trees[0].degree <= dmax);
    // Beyond the bound, the relays' NICs are the bottleneck.
    if (dmax < 15) {
      const RelayPrediction over = PredictRelay(in, MustRelay(in, Degree(dmax + 1), opt), opt.cost);
      CHECK(over.tree_s > over.source_s);
      CHECK(over.tree_s == Approx((dmax + 1) * copy_s));
    }
  }
  // Slower sources leave a relay more time to fan out.
  CHECK(bounds[0] < bounds[2]);
  CHECK(bounds[0] <= bounds[1]);
}

TEST_CASE("relay: auto stays direct when the direct plan is not slower", "[planner][relay]") {
  // Eight NICs per node: the trainer's links carry 4 copies easily and the replica load binds at the default
  // rates, so relaying saves nothing and adds a few chunks' latency. (With sessions it would save the sources
  // three of them each, 3 ms, more than the latency it adds: session cost off to see the bytes alone.)
  SyntheticShape s;
  s.instances = 4;
  s.engine_nodes = 4;
  const PlanInput in = MakeInput(s);
  PlanOptions opt;
  opt.cost.session_ms = 0;
  const Plan direct = *BuildPlan(in, opt);
  const double direct_s = PredictPlan(in, direct, opt.cost).total_s;
  for (int d = 1; d <= 3; ++d) {
    const RelayPrediction forced = PredictRelay(in, MustRelay(in, Degree(d), opt), opt.cost);
    INFO("degree " << d << ": direct " << direct_s << " s, relay " << forced.total_s << " s");
    REQUIRE(forced.total_s >= direct_s);
  }
  const RelayPlan rp = MustRelay(in, Auto(), opt);
  INFO(rp.why);
  CHECK(!rp.relayed);
  CHECK(SamePlan(rp.plan, direct));
}

TEST_CASE("relay: regions are the root's writes in chunks, the same for every edge", "[planner][relay]") {
  for (Strategy st : {Strategy::kSeed, Strategy::kBalanced}) {
    SyntheticShape s = TrainerLinkBound(3);
    s.pp = 2;
    s.train_nodes = 2;
    const PlanInput in = MakeInput(s);
    PlanOptions opt;
    opt.strategy = st;
    RelayOptions ro = Degree(2);
    ro.chunk_bytes = 3 << 20;  // not a divisor of the parameters' sizes
    const RelayPlan rp = MustRelay(in, ro, opt);
    REQUIRE(rp.relayed);
    const RelayTree& t = rp.trees[0];
    REQUIRE(t.regions.size() == in.layouts.size());
    for (size_t r = 0; r < t.regions.size(); ++r) {
      uint64_t want = 0;
      for (const auto& p : in.layouts[r].params) want += p.bytes;
      CHECK(t.regions[r].bytes == want);
      for (const RelayChunk& c : t.regions[r].chunks) CHECK(c.length <= ro.chunk_bytes);
    }
    // The checker notices a lost chunk and a chunk that crosses two sources' writes.
    RelayPlan broken = rp;
    broken.trees[0].regions[1].chunks.erase(broken.trees[0].regions[1].chunks.begin() + 3);
    CHECK(!VerifyRelayPlan(in, broken).ok());
    broken = rp;
    auto& ch = broken.trees[0].regions[0].chunks;
    for (RelayChunk& c : ch) c.source = (c.source + 1) % static_cast<int>(rp.plan.sources.size());
    CHECK(!VerifyRelayPlan(in, broken).ok());
    broken = rp;
    broken.trees[0].nodes[2].parent = broken.trees[0].nodes[2].instance;  // its own relay
    CHECK(!VerifyRelayPlan(in, broken).ok());
    broken = rp;
    broken.trees[0].nodes.pop_back();
    CHECK(!VerifyRelayPlan(in, broken).ok());
  }
}

}  // namespace
}  // namespace wsync::planner
