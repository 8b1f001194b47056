// The relay tree's shape from link rates (planner/relay_shape.h) against hand-computed cases. Every case: one copy
// of 1 GB, NICs of 1 GB/s, chunks of 1 MB, 0.5 ms per hop; so one chunk across a hop out of a relay with d children
// (one rank per NIC) takes d x 1 ms + 0.5 ms.

#include <catch2/catch.hpp>
#include <random>

#include "planner/relay.h"
#include "planner/relay_shape.h"
#include "synthetic.h"

namespace wsync::planner {
namespace {

RelayLinks Links(int instances, int source_nics, int instance_nics) {
  RelayLinks l;
  l.copy_bytes = 1000000000;
  l.instances = instances;
  l.source_nics = source_nics;
  l.source_nic_bps = 1e9;
  l.instance_nics = instance_nics;
  l.target_nic_bps = 1e9;
  l.ranks_per_nic = 1;
  l.chunk_bytes = 1000000;
  l.hop_s = 0.5e-3;
  return l;
}

TEST_CASE("relay shape: the trainer's link binds, a chain wins", "[planner][relay_shape]") {
  // 8 instances, one trainer NIC, one NIC per instance: direct sends 8 copies (8 s); a chain sends one (1 s) and
  // adds 7 hops of 1.5 ms; degree 2 doubles a relay's egress (2 s) for 3 levels of 2.5 ms.
  const RelayShapeChoice c = ChooseRelayShape(Links(8, 1, 1));
  CHECK(c.direct.total_s == Approx(8.0));
  CHECK(c.direct.trainer_egress_bytes == 8000000000ull);
  REQUIRE(c.candidates.size() == 7);
  CHECK(c.candidates[0].total_s == Approx(1.0 + 7 * 1.5e-3));
  CHECK(c.candidates[1].depth == 3);
  CHECK(c.candidates[1].total_s == Approx(2.0 + 3 * 2.5e-3));
  REQUIRE(c.relayed());
  CHECK(c.chosen.degree == 1);
  CHECK(c.chosen.depth == 7);
  CHECK(c.chosen.trainer_egress_bytes == 1000000000ull);
  CHECK(c.chosen.total_s == Approx(1.0105));
}

TEST_CASE("relay shape: equal links and few instances stay direct", "[planner][relay_shape]") {
  // 2 instances, 4 (or 2) trainer NICs: direct takes one copy's time on the instance's NIC (1 s), as a tree
  // would, and a tree adds a hop.
  for (int source_nics : {2, 4}) {
    INFO(source_nics << " source NICs");
    const RelayShapeChoice c = ChooseRelayShape(Links(2, source_nics, 1));
    CHECK(c.direct.total_s == Approx(1.0));
    CHECK(c.candidates.at(0).total_s == Approx(1.0015));
    CHECK_FALSE(c.relayed());
    CHECK(c.chosen.degree == 0);
  }
  CHECK_FALSE(ChooseRelayShape(Links(1, 1, 1)).relayed());  // one instance: nothing to relay
}

TEST_CASE("relay shape: instances with twice the trainer's links, the root feeds everyone", "[planner][relay_shape]") {
  // 3 instances of 2 NICs, one trainer NIC: direct 3 s; chain 1 s + 2 hops of 1.5 ms; degree 2 (= every other
  // member a child of the root) forwards 2 copies over 2 NICs (1 s) + one hop of 2.5 ms.
  const RelayShapeChoice c = ChooseRelayShape(Links(3, 1, 2));
  CHECK(c.direct.total_s == Approx(3.0));
  CHECK(c.candidates.at(0).total_s == Approx(1.003));
  CHECK(c.candidates.at(1).total_s == Approx(1.0025));
  CHECK(c.chosen.degree == 2);
  CHECK(c.chosen.depth == 1);
}

TEST_CASE("relay shape: fast engine NICs, a shallower tree wins while a relay's egress keeps up",
          "[planner][relay_shape]") {
  // 16 instances of 4 NICs, one trainer NIC (1 s per copy): a relay keeps up with up to 4 children (4 x 0.25 s).
  // chain 1 + 15 x 1.5 ms; degree 2 depth 4: 1 + 4 x 2.5 ms; degree 3 depth 3: 1 + 3 x 3.5 ms; degree 4 depth 2:
  // 1 + 2 x 4.5 ms = 1.009 s; degree 5: 1.25 s + ...
  const RelayShapeChoice c = ChooseRelayShape(Links(16, 1, 4));
  REQUIRE(c.candidates.size() == 15);
  CHECK(c.candidates[0].total_s == Approx(1.0225));
  CHECK(c.candidates[1].total_s == Approx(1.010));
  CHECK(c.candidates[2].total_s == Approx(1.0105));
  CHECK(c.candidates[3].total_s == Approx(1.009));
  CHECK(c.candidates[4].total_s == Approx(1.25 + 2 * 5.5e-3));
  CHECK(c.chosen.degree == 4);
  CHECK(c.chosen.depth == 2);
  // Two ranks per NIC double every hop's chunk time: the chain's 15 hops now cost more than degree 4's 2.
  RelayLinks shared = Links(16, 1, 4);
  shared.ranks_per_nic = 2;
  CHECK(RelayTreeCost(shared, 1).chunk_s == Approx(2.5e-3));
  CHECK(ChooseRelayShape(shared).chosen.degree == 4);
}

TEST_CASE("relay shape: big chunks make depth cost", "[planner][relay_shape]") {
  // 4 instances, chunks of 400 MB: a chain pays 3 hops of 0.4005 s (2.2015 s), still under direct's 4 s.
  RelayLinks l = Links(4, 1, 1);
  l.chunk_bytes = 400000000;
  const RelayShapeChoice c = ChooseRelayShape(l);
  CHECK(c.chosen.degree == 1);
  CHECK(c.chosen.total_s == Approx(2.2015));
  // A chunk as large as the copy is store-and-forward: each level adds a whole copy (1.0005 s), so a chain of N
  // (1 + (N - 1) x 1.0005 s) never beats direct's N s, and wider trees pay their egress on top.
  l.chunk_bytes = 4000000000ull;  // capped at the copy
  CHECK(RelayTreeCost(l, 1).total_s == Approx(1 + 3 * 1.0005));
  CHECK(RelayTreeCost(l, 3).total_s == Approx(3 + 3.0005));
  CHECK_FALSE(ChooseRelayShape(l).relayed());
}

TEST_CASE("relay shape: depth is RelayTreeShape's, and the choice is the fastest candidate", "[planner][relay_shape]") {
  for (int members = 1; members <= 70; ++members)
    for (int degree = 1; degree <= 9; ++degree) {
      std::vector<int> ids(members);
      for (int k = 0; k < members; ++k) ids[k] = k;
      int depth = 0;
      for (const RelayNode& n : RelayTreeShape(ids, degree)) depth = std::max(depth, n.depth);
      INFO(members << " members, degree " << degree);
      CHECK(RelayTreeDepth(members, degree) == depth);
    }
  std::mt19937 rng(41);
  std::uniform_int_distribution<int> n(1, 40), nics(1, 8);
  std::uniform_real_distribution<double> rate(1e8, 5e10);
  for (int i = 0; i < 500; ++i) {
    RelayLinks l = Links(n(rng), nics(rng), nics(rng));
    l.source_nic_bps = rate(rng);
    l.target_nic_bps = rate(rng);
    l.ranks_per_nic = nics(rng);
    const RelayShapeChoice c = ChooseRelayShape(l);
    double best = c.direct.total_s;
    for (const RelayShapeCost& t : c.candidates) best = std::min(best, t.total_s);
    CHECK(c.chosen.total_s == best);
    if (c.relayed()) CHECK(c.chosen.total_s < c.direct.total_s);
  }
}

TEST_CASE("relay shape: the links of a plan input", "[planner][relay_shape]") {
  // 2 trainer nodes; 8 instances of TP 4 on 4 engine nodes (8 GPUs each: instance 0 is GPUs 0-3 of node 0).
  testing::SyntheticShape sh;
  sh.train_nodes = 2, sh.instances = 8, sh.engine_tp = 4, sh.engine_nodes = 4;
  for (int nics : {1, 8}) {
    INFO(nics << " NICs per node");
    sh.nics = nics;
    const PlanInput in = testing::MakeInput(sh);
    uint64_t copy = 0;
    for (const auto& l : in.layouts)
      for (const auto& p : l.params) copy += p.bytes;
    RelayOptions ro;
    ro.chunk_bytes = 1 << 20;
    CostParams cp;
    cp.relay_hop_ms = 2;
    const RelayLinks l = RelayLinksOf(in, ro, cp);
    CHECK(l.copy_bytes == copy);
    CHECK(l.instances == 8);
    CHECK(l.source_nics == 2 * nics);
    // One NIC per node: the instance's 4 ranks share it; 8 per node: GPU g on NIC g, one rank each.
    CHECK(l.instance_nics == (nics == 1 ? 1 : 4));
    CHECK(l.ranks_per_nic == (nics == 1 ? 4 : 1));
    CHECK(l.source_nic_bps == in.cluster.nic.bytes_per_second());
    CHECK(l.chunk_bytes == (1u << 20));
    CHECK(l.hop_s == 2e-3);
  }
}

}  // namespace
}  // namespace wsync::planner
