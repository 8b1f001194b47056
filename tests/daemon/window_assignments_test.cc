// Write-window assignments kept by target daemons between updates (docs/operations.md, "Write windows"): the real
// coordinator opening the windows of real in-process TargetNodes (other peers faked). The first update of a plan
// sends every target its assignments, later updates of the plan only name them; a re-plan sends the changed ones;
// a target that lost them (restarted) is sent them within the same update; an older target (no digest in its
// answers) always gets them. The digest and the pure decisions on both sides are checked on their own.

#include "daemon/common/window_assignments.h"

#include <stdlib.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/coordinator/coordinator.h"
#include "daemon/node/target_node.h"
#include "tests/daemon/idle_peers.h"
#include "tests/daemon/fake_layouts.h"
#include "transport/transport.h"

namespace wsync::daemon {
namespace {

using testing::FillLayout;
using testing::TinyConfigJson;

v1::SetWriteWindowRequest FullRequest(const std::vector<std::tuple<std::string, int, uint64_t>>& assigned) {
  v1::SetWriteWindowRequest r;
  r.set_open(true);
  r.set_version(3);
  r.set_assignments_given(true);
  for (const auto& [source, rank, offset] : assigned) {
    auto* a = r.add_assignments();
    a->set_source_node(source);
    a->set_engine_id("e0");
    a->set_rank(rank);
    auto* w = a->add_writes();
    w->set_param("model.embed_tokens.weight");
    w->set_offset(offset);
    w->set_length(64);
  }
  r.set_assignments_digest(WindowAssignmentsDigest(r.assignments()));
  return r;
}

TEST_CASE("window assignments: the digest changes with every field, and each side's decision") {
  const auto base = FullRequest({{"s0", 0, 0}, {"s1", 1, 64}});
  const std::string d = base.assignments_digest();
  CHECK(d.size() == 32);
  CHECK(WindowAssignmentsDigest(FullRequest({{"s0", 0, 0}, {"s1", 1, 64}}).assignments()) == d);
  // Each field of an assignment, the order of the list and its length.
  CHECK(FullRequest({{"s2", 0, 0}, {"s1", 1, 64}}).assignments_digest() != d);
  CHECK(FullRequest({{"s0", 1, 0}, {"s1", 1, 64}}).assignments_digest() != d);
  CHECK(FullRequest({{"s0", 0, 64}, {"s1", 1, 64}}).assignments_digest() != d);
  CHECK(FullRequest({{"s1", 1, 64}, {"s0", 0, 0}}).assignments_digest() != d);
  CHECK(FullRequest({{"s0", 0, 0}}).assignments_digest() != d);
  auto longer = base;
  longer.mutable_assignments(1)->mutable_writes(0)->set_length(65);
  CHECK(WindowAssignmentsDigest(longer.assignments()) != d);
  auto other_param = base;
  other_param.mutable_assignments(0)->mutable_writes(0)->set_param("lm_head.weight");
  CHECK(WindowAssignmentsDigest(other_param.assignments()) != d);
  auto other_engine = base;
  other_engine.mutable_assignments(0)->set_engine_id("e1");
  CHECK(WindowAssignmentsDigest(other_engine.assignments()) != d);
  // Field boundaries: ("ab", "c") and ("a", "bc") are different lists.
  auto a1 = base, a2 = base;
  a1.mutable_assignments(0)->set_source_node("ab");
  a1.mutable_assignments(0)->set_engine_id("c");
  a2.mutable_assignments(0)->set_source_node("a");
  a2.mutable_assignments(0)->set_engine_id("bc");
  CHECK(WindowAssignmentsDigest(a1.assignments()) != WindowAssignmentsDigest(a2.assignments()));

  // The target.
  const v1::SetWriteWindowRequest named = NamingHeldAssignments(base);
  CHECK(named.assignments_size() == 0);
  CHECK(named.assignments_held());
  CHECK(named.assignments_digest() == d);
  CHECK(named.version() == base.version());
  CHECK(DecideWindowAssignments(base, "") == WindowAssignmentsAction::kTake);
  CHECK(DecideWindowAssignments(base, "something else") == WindowAssignmentsAction::kTake);
  CHECK(DecideWindowAssignments(named, d) == WindowAssignmentsAction::kKeep);
  CHECK(DecideWindowAssignments(named, "") == WindowAssignmentsAction::kMissing);
  CHECK(DecideWindowAssignments(named, FullRequest({{"s0", 0, 0}}).assignments_digest()) ==
        WindowAssignmentsAction::kMissing);
  auto names_nothing = named;
  names_nothing.clear_assignments_digest();
  CHECK(DecideWindowAssignments(names_nothing, "") == WindowAssignmentsAction::kMissing);
  v1::SetWriteWindowRequest older;  // an older coordinator's open, and any close
  older.set_open(true);
  CHECK(DecideWindowAssignments(older, d) == WindowAssignmentsAction::kNone);
  v1::SetWriteWindowRequest close;
  CHECK(DecideWindowAssignments(close, d) == WindowAssignmentsAction::kNone);

  // The coordinator.
  CHECK(MayNameHeldAssignments(base, d));
  CHECK_FALSE(MayNameHeldAssignments(base, ""));  // never acknowledged (an older target, a new process)
  CHECK_FALSE(MayNameHeldAssignments(base, FullRequest({{"s0", 0, 0}}).assignments_digest()));
  auto no_digest = base;
  no_digest.clear_assignments_digest();
  CHECK_FALSE(MayNameHeldAssignments(no_digest, ""));
  v1::SetWriteWindowReply kept;
  kept.set_assignments_digest(d);
  CHECK_FALSE(AssignmentsNeeded(named, kept));
  v1::SetWriteWindowReply missing;
  missing.set_assignments_missing(true);
  CHECK(AssignmentsNeeded(named, missing));
  v1::SetWriteWindowReply other;  // answered as if it opened, but with other assignments: sent them anyway
  other.set_assignments_digest("0123");
  CHECK(AssignmentsNeeded(named, other));
  CHECK(AssignmentsNeeded(named, v1::SetWriteWindowReply()));
  CHECK_FALSE(AssignmentsNeeded(base, v1::SetWriteWindowReply()));  // it carried them
}

// A real TargetNode (tcp transport, its own engine socket) behind one daemon address.
struct Target {
  explicit Target(const std::string& id) {
    char tmpl[] = "/tmp/wsync-window-test.XXXXXX";
    dir = mkdtemp(tmpl);
    auto tr = transport::CreateTransport("tcp", {});
    REQUIRE(tr.ok());
    transport = *std::move(tr);
    TargetOptions o;
    o.node_id = id;
    o.engine_socket = dir + "/engines.sock";
    node = std::make_unique<TargetNode>(o, transport.get());
    REQUIRE(node->Start().ok());
  }
  ~Target() {
    node.reset();
    std::system(("rm -rf " + dir).c_str());
  }
  std::string dir;
  std::unique_ptr<transport::Transport> transport;
  std::unique_ptr<TargetNode> node;
};

// SetWriteWindow reaches the real target nodes; every other peer answers at once.
class TargetPeers : public testing::IdlePeers {
 public:
  struct Open {
    std::string addr;
    int64_t version;
    bool named;       // the request named held assignments
    int assignments;  // WindowAssignments it carried
    size_t bytes;     // its size on the wire
    v1::SetWriteWindowReply reply;
  };
  TargetPeers() : IdlePeers(TinyConfigJson()) {}
  // Sources that were started say they wrote nothing and are quiescent (the engines may resume).
  absl::StatusOr<v1::AbortSourceUpdateReply> AbortSourceUpdate(const std::string&,
                                                               const v1::AbortSourceUpdateRequest&) override {
    v1::AbortSourceUpdateReply r;
    r.set_quiescent(true);
    return r;
  }
  absl::StatusOr<v1::SetWriteWindowReply> SetWriteWindow(const std::string& addr,
                                                         const v1::SetWriteWindowRequest& req) override {
    std::lock_guard<std::mutex> l(mu);
    auto it = targets.find(addr);
    if (it == targets.end()) return absl::UnavailableError("no target at " + addr);
    v1::SetWriteWindowReply r = it->second->node->SetWriteWindow(req);
    // An older target: the same decisions on a request that carries the assignments, no digest in its answers.
    if (older.count(addr)) r.clear_assignments_digest();
    if (req.open())
      opens.push_back({addr, req.version(), req.assignments_held(), req.assignments_size(), req.ByteSizeLong(), r});
    if (req.open() && !req.assignments_held()) last_full[addr] = req;
    return r;
  }
  // The opens of update `v` at `addr`, in order.
  std::vector<Open> OpensOf(int64_t v, const std::string& addr) {
    std::lock_guard<std::mutex> l(mu);
    std::vector<Open> out;
    for (const auto& o : opens)
      if (o.version == v && o.addr == addr) out.push_back(o);
    return out;
  }

  std::mutex mu;
  std::map<std::string, std::unique_ptr<Target>> targets;  // by daemon address
  std::set<std::string> older;
  std::vector<Open> opens;
  std::map<std::string, v1::SetWriteWindowRequest> last_full;  // the last request with assignments, per address
};

struct Fixture {
  Fixture() {
    auto p = std::make_unique<TargetPeers>();
    peers = p.get();
    for (const char* t : {"t0", "t1"}) peers->targets[std::string(t) + ":1"] = std::make_unique<Target>(t);
    c = std::make_unique<Coordinator>(CoordinatorOptions(), std::move(p));
    for (const char* s : {"s0", "s1"}) REQUIRE(c->RegisterNode(testing::SourceRegistration(s)).ok());
    REQUIRE(c->RegisterNode(testing::TargetRegistration("t0", "e0", 2)).ok());
    REQUIRE(c->RegisterNode(testing::TargetRegistration("t1", "e1", 2)).ok());
  }
  void Update(int64_t v) {
    v1::BeginUpdateRequest b;
    b.set_version(v);
    auto begun = c->BeginUpdate(b);
    INFO(begun.status().ToString());
    REQUIRE(begun.ok());
    v1::CommitUpdateRequest cr;
    cr.set_version(v);
    auto done = c->CommitUpdate(cr);
    INFO(done.status().ToString());
    REQUIRE(done.ok());
  }
  // The update's only open at `addr`: it carried the assignments (`full`) or named them, and the target opened.
  void RequireOneOpen(int64_t v, const std::string& addr, bool full) {
    const auto opens = peers->OpensOf(v, addr);
    INFO("update " << v << " at " << addr);
    REQUIRE(opens.size() == 1);
    CHECK(opens[0].named == !full);
    CHECK_FALSE(opens[0].reply.assignments_missing());
    if (full) {
      CHECK(opens[0].assignments > 0);
    } else {
      CHECK(opens[0].assignments == 0);
      CHECK(opens[0].bytes < 100);
    }
  }
  // What the target holds is what it was last sent in full (the test's own digest of that request's content).
  void RequireHoldsLastSent(int64_t v, const std::string& addr) {
    const auto opens = peers->OpensOf(v, addr);
    REQUIRE_FALSE(opens.empty());
    std::lock_guard<std::mutex> l(peers->mu);
    const v1::SetWriteWindowRequest& sent = peers->last_full.at(addr);
    CHECK(opens.back().reply.assignments_digest() == WindowAssignmentsDigest(sent.assignments()));
  }

  TargetPeers* peers;
  std::unique_ptr<Coordinator> c;
};

TEST_CASE("window assignments: sent once per plan, then named; a re-plan sends the changed ones") {
  Fixture f;
  f.Update(1);
  for (const char* a : {"t0:1", "t1:1"}) {
    f.RequireOneOpen(1, a, true);
    f.RequireHoldsLastSent(1, a);
  }
  const auto first = f.peers->OpensOf(1, "t0:1")[0];
  for (int64_t v : {2, 3}) {
    f.Update(v);
    for (const char* a : {"t0:1", "t1:1"}) {
      f.RequireOneOpen(v, a, false);
      f.RequireHoldsLastSent(v, a);
    }
  }
  CHECK(first.bytes > 20 * f.peers->OpensOf(2, "t0:1")[0].bytes);

  // A re-plan: a target is sent the assignments again where what it holds changed, else they are named; either way
  // it holds what the test last forwarded to it, and nothing of a source that left.
  const auto replanned = [&](int64_t v, const std::string& gone) {
    f.Update(v);
    int sent = 0;
    for (const char* a : {"t0:1", "t1:1"}) {
      const auto opens = f.peers->OpensOf(v, a);
      REQUIRE(opens.size() == 1);
      CHECK_FALSE(opens[0].reply.assignments_missing());
      sent += !opens[0].named;
      f.RequireHoldsLastSent(v, a);
      std::lock_guard<std::mutex> l(f.peers->mu);
      for (const auto& x : f.peers->last_full.at(a).assignments()) CHECK(x.source_node() != gone);
    }
    return sent;
  };
  REQUIRE(f.c->RegisterNode(testing::SourceRegistration("s2")).ok());  // planned again; its assignments may stay as they were
  replanned(4, "");
  v1::RemoveNodeRequest rm;
  rm.set_node_id("s1");
  REQUIRE(f.c->RemoveNode(rm).ok());  // s1's engine ranks go to another source
  CHECK(replanned(5, "s1") >= 1);
  f.Update(6);
  for (const char* a : {"t0:1", "t1:1"}) f.RequireOneOpen(6, a, false);
}

TEST_CASE("window assignments: a target that lost them (restarted) is sent them within the same update", "[faults]") {
  Fixture f;
  f.Update(1);
  f.Update(2);
  f.RequireOneOpen(2, "t0:1", false);
  // t0's daemon restarts (a new process, nothing held); the coordinator has not seen it register again.
  {
    std::lock_guard<std::mutex> l(f.peers->mu);
    f.peers->targets["t0:1"].reset();
    f.peers->targets["t0:1"] = std::make_unique<Target>("t0");
  }
  f.Update(3);
  const auto opens = f.peers->OpensOf(3, "t0:1");
  REQUIRE(opens.size() == 2);
  CHECK(opens[0].named);
  CHECK(opens[0].reply.assignments_missing());
  CHECK(opens[0].reply.assignments_digest().empty());
  CHECK_FALSE(opens[1].named);
  CHECK(opens[1].assignments > 0);
  CHECK_FALSE(opens[1].reply.assignments_missing());
  f.RequireHoldsLastSent(3, "t0:1");
  f.RequireOneOpen(3, "t1:1", false);  // the other target keeps its own
  f.Update(4);
  f.RequireOneOpen(4, "t0:1", false);

  // The daemon registers again: the coordinator sends them at once (no round trip asking first).
  {
    std::lock_guard<std::mutex> l(f.peers->mu);
    f.peers->targets["t1:1"].reset();
    f.peers->targets["t1:1"] = std::make_unique<Target>("t1");
  }
  REQUIRE(f.c->RegisterNode(testing::TargetRegistration("t1", "e1", 2)).ok());
  f.Update(5);
  f.RequireOneOpen(5, "t1:1", true);
  f.RequireHoldsLastSent(5, "t1:1");
}

TEST_CASE("window assignments: an older target (no digest in its answers) is always sent them") {
  Fixture f;
  f.peers->older.insert("t1:1");
  for (int64_t v : {1, 2, 3}) {
    f.Update(v);
    f.RequireOneOpen(v, "t1:1", true);
  }
  f.RequireOneOpen(3, "t0:1", false);
}

}  // namespace
}  // namespace wsync::daemon
