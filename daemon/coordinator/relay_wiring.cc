#include "daemon/coordinator/relay_wiring.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <mutex>
#include <numeric>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "daemon/common/serve.h"
#include "proto/status_convert.h"
#include "proto/tls.h"
#include "spdlog/spdlog.h"
#include "wsync/v1/daemon.grpc.pb.h"

namespace wsync::daemon {
namespace {

struct EngineRanks {
  std::string node, address;
  std::map<int, const PlannedAssignment*> ranks;  // one assignment per rank (which source's does not matter)
};

// Why `b` cannot take `a`'s bytes verbatim ("" when it can).
std::string LayoutsDiffer(const EngineRanks& a, const EngineRanks& b) {
  if (a.ranks.size() != b.ranks.size()) return absl::StrCat(b.ranks.size(), " ranks planned, not ", a.ranks.size());
  for (const auto& [rank, pa] : a.ranks) {
    auto it = b.ranks.find(rank);
    if (it == b.ranks.end()) return absl::StrCat("rank ", rank, " not planned");
    const v1::RankLayout* la = pa->layout.get();
    const v1::RankLayout* lb = it->second->layout.get();
    if (la == nullptr || lb == nullptr) return absl::StrCat("rank ", rank, " has no layout");
    if (la->params_size() != lb->params_size()) return absl::StrCat("rank ", rank, ": parameter counts differ");
    for (int i = 0; i < la->params_size(); ++i) {
      const auto &x = la->params(i), &y = lb->params(i);
      if (x.name() != y.name() || x.segment() != y.segment() || x.offset() != y.offset() || x.bytes() != y.bytes())
        return absl::StrCat("rank ", rank, ": parameter ", y.name(), " is not where ", x.name(), " is");
    }
    for (const auto& seg : lb->segments())
      if (!seg.kind().empty() && seg.kind() != "host")
        return absl::StrCat("rank ", rank, " segment ", seg.id(), " is ", seg.kind(), " memory");
  }
  return "";
}

uint64_t ParamBytes(const v1::RankLayout* l) {
  uint64_t b = 0;
  if (l != nullptr)
    for (const auto& p : l->params()) b += p.bytes();
  return b;
}

// Runs `call` for every member at once; the first error (in time) names the member, and cancels the calls still
// running (a drain that failed makes the others' waits pointless: the update fails either way).
absl::Status ForMembers(
    const RelayWiring& wiring, const char* what,
    const std::function<absl::Status(const RelayMember&, v1::NodeDaemon::Stub*, grpc::ClientContext*)>& call) {
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  for (size_t i = 0; i < wiring.members.size(); ++i) contexts.push_back(std::make_unique<grpc::ClientContext>());
  std::mutex mu;
  absl::Status first;
  std::vector<std::thread> threads;
  for (size_t i = 0; i < wiring.members.size(); ++i)
    threads.emplace_back([&, i] {
      const RelayMember& m = wiring.members[i];
      auto channel = tls::Dial(m.address, kMaxControlMessageBytes);
      absl::Status st =
          channel.ok() ? call(m, v1::NodeDaemon::NewStub(*channel).get(), contexts[i].get()) : channel.status();
      if (st.ok()) return;
      std::lock_guard<std::mutex> l(mu);
      if (!first.ok()) return;  // cancelled by the first failure, or failed after it
      first = Annotate(
          st, absl::StrCat(what, " of relay engine ", m.engine_id, " on node ", m.node_id, " (", m.address, ")"));
      for (size_t k = 0; k < contexts.size(); ++k)
        if (k != i) contexts[k]->TryCancel();
    });
  for (auto& t : threads) t.join();
  return first;
}

}  // namespace

planner::RelayLinks GroupRelayLinks(const std::vector<std::string>& members, const std::vector<PlannedAssignment>& plan,
                                    const planner::NicSpec& nic, const planner::RelayOptions& options) {
  planner::RelayLinks l;
  l.instances = static_cast<int>(members.size());
  if (members.empty()) return l;
  const std::set<std::string> in_group(members.begin(), members.end());
  std::set<std::string> sources;
  std::map<int, uint64_t> root_rank_bytes;
  std::map<std::string, std::set<int>> root_ranks_per_node;
  for (const PlannedAssignment& p : plan) {
    const std::string& engine = p.assignment->engine_id();
    if (!in_group.count(engine)) continue;
    sources.insert(p.source);
    if (engine != members.front()) continue;
    root_rank_bytes[p.assignment->rank()] = ParamBytes(p.layout.get());
    root_ranks_per_node[p.assignment->target_node()].insert(p.assignment->rank());
  }
  const int per_node = std::max(1, nic.per_node);
  for (const auto& [rank, b] : root_rank_bytes) l.copy_bytes += b;
  l.source_nics = std::max<int>(1, static_cast<int>(sources.size()) * per_node);
  l.source_nic_bps = l.target_nic_bps = nic.bytes_per_second();
  l.instance_nics = 0;
  l.ranks_per_nic = 1;
  for (const auto& [node, ranks] : root_ranks_per_node) {
    const int r = static_cast<int>(ranks.size());
    l.instance_nics += std::min(r, per_node);
    l.ranks_per_nic = std::max(l.ranks_per_nic, (r + per_node - 1) / per_node);
  }
  l.instance_nics = std::max(1, l.instance_nics);
  l.chunk_bytes = options.chunk_bytes;
  l.hop_s = planner::CostParams().relay_hop_ms / 1e3;
  return l;
}

RelayWiring WireRelays(const planner::RelayOptions& options, const std::map<std::string, GroupPlan>& groups,
                       std::vector<PlannedAssignment>* plan, const planner::NicSpec& nic) {
  RelayWiring out;
  if (options.mode == planner::RelayMode::kOff) return out;
  std::map<std::string, EngineRanks> engines;
  for (const PlannedAssignment& p : *plan) {
    EngineRanks& e = engines[p.assignment->engine_id()];
    e.node = p.assignment->target_node();
    e.address = p.assignment->target_daemon();
    e.ranks.emplace(p.assignment->rank(), &p);
  }
  std::set<std::string> roots;
  std::map<std::string, std::string> parent_of;  // child engine → its relay's engine
  for (const auto& [key, g] : groups) {
    std::vector<std::string> members;
    for (const auto& id : g.engine_ids)
      if (engines.count(id)) members.push_back(id);
    if (members.size() < 2) continue;
    std::string differ;
    for (size_t k = 1; k < members.size() && differ.empty(); ++k)
      if (std::string d = LayoutsDiffer(engines[members[0]], engines[members[k]]); !d.empty())
        differ = absl::StrCat("engine ", members[k], ": ", d);
    if (!differ.empty()) {
      out.why.push_back(absl::StrCat("group ", key, " not relayed: ", differ));
      continue;
    }
    int degree = std::max(1, options.degree);
    if (options.mode == planner::RelayMode::kAuto) {
      const planner::RelayShapeChoice c = planner::ChooseRelayShape(GroupRelayLinks(members, *plan, nic, options));
      if (!c.relayed()) {
        out.why.push_back(absl::StrCat("group ", key, " not relayed: ", c.why));
        continue;
      }
      spdlog::info("relay: group {}: {}", key, c.why);
      degree = c.chosen.degree;
    }
    std::vector<int> index(members.size());
    std::iota(index.begin(), index.end(), 0);
    for (const planner::RelayNode& n : planner::RelayTreeShape(index, degree)) {
      const std::string& id = members[n.instance];
      const EngineRanks& e = engines[id];
      RelayMember m;
      m.engine_id = id;
      m.node_id = e.node;
      m.address = e.address;
      m.request.set_engine_id(id);
      m.request.set_relay_node(e.node);
      for (int c : n.children) {
        const EngineRanks& ce = engines[members[c]];
        v1::RelayChild* rc = m.request.add_children();
        rc->set_target_daemon(ce.address);
        rc->set_target_node(ce.node);
        rc->set_engine_id(members[c]);
        for (const auto& [rank, p] : ce.ranks) *rc->add_layouts() = *p->layout;
      }
      if (n.parent < 0) {
        roots.insert(id);
      } else {
        m.parent = members[n.parent];
        parent_of[id] = m.parent;
      }
      out.members.push_back(std::move(m));
    }
  }
  for (const auto& w : out.why) spdlog::warn("relay: {}", w);
  if (!out.relayed()) return out;
  std::vector<PlannedAssignment> next;
  for (const PlannedAssignment& p : *plan) {
    const std::string& engine = p.assignment->engine_id();
    if (parent_of.count(engine)) continue;  // written by its relay, not by the sources
    if (!roots.count(engine)) {
      next.push_back(p);
      continue;
    }
    auto a = std::make_shared<v1::TargetAssignment>(*p.assignment);
    a->set_relay_root(true);
    PlannedAssignment q = p;
    q.digest = AssignmentDigest(*a);
    q.assignment = std::move(a);
    next.push_back(std::move(q));
  }
  // One assignment per child rank, "written" by its relay's node: its window and grant name the relay alone.
  for (const auto& [child, parent] : parent_of)
    for (const auto& [rank, p] : engines[child].ranks) {
      auto a = std::make_shared<v1::TargetAssignment>(*p->assignment);
      a->clear_writes();
      a->set_relay_root(false);
      PlannedAssignment q;
      q.source = engines[parent].node;
      q.layout = p->layout;
      q.bytes = ParamBytes(p->layout.get());
      q.epoch = p->epoch;
      q.digest = AssignmentDigest(*a);
      q.assignment = std::move(a);
      next.push_back(std::move(q));
    }
  spdlog::info("relay ({}): {} engines in trees, {} roots written by the sources", planner::FormatRelayMode(options),
               out.members.size(), roots.size());
  *plan = std::move(next);
  return out;
}

RelayReroute RerouteRelays(const RelayWiring& wiring, const std::set<std::string>& dead) {
  RelayReroute out;
  std::map<std::string, const RelayMember*> by_id;
  std::map<std::string, v1::RelayChild> spec;  // engine → its child spec, from its parent's request
  for (const RelayMember& m : wiring.members) {
    by_id[m.engine_id] = &m;
    for (const auto& c : m.request.children()) spec[c.engine_id()] = c;
  }
  std::map<std::string, std::string> parent;  // live member → its nearest live ancestor ("": a root)
  for (const RelayMember& m : wiring.members) {
    if (dead.count(m.engine_id)) continue;
    std::string p = m.parent;
    while (!p.empty() && dead.count(p)) p = by_id.count(p) ? by_id[p]->parent : std::string();
    if (p.empty() && !m.parent.empty()) {
      std::string root = m.parent;
      while (by_id.count(root) && !by_id[root]->parent.empty()) root = by_id[root]->parent;
      const RelayMember& r = *by_id[root];
      out.impossible = absl::StrCat("relay engine ", r.engine_id, " on node ", r.node_id, " (", r.address,
                                    ") died; it is its tree's root, so engine ", m.engine_id,
                                    " has no live relay above it and the sources write only the roots");
      return out;
    }
    parent[m.engine_id] = p;
    if (p != m.parent) out.adopted[m.engine_id] = p;
  }
  for (const RelayMember& m : wiring.members) {
    if (dead.count(m.engine_id)) continue;
    RelayMember n = m;
    n.parent = parent[m.engine_id];
    n.request.clear_children();
    for (const auto& c : m.request.children())  // its own live children first, in their order
      if (!dead.count(c.engine_id())) *n.request.add_children() = c;
    for (const RelayMember& k : wiring.members)  // then those it adopts, in the members' order
      if (auto a = out.adopted.find(k.engine_id); a != out.adopted.end() && a->second == m.engine_id)
        *n.request.add_children() = spec[k.engine_id];
    if (n.request.children_size() != m.request.children_size() ||
        n.request.SerializeAsString() != m.request.SerializeAsString())
      out.changed.push_back(m.engine_id);
    out.wiring.members.push_back(std::move(n));
  }
  return out;
}

std::set<std::string> DeadRelays(const RelayWiring& wiring, double timeout_s) {
  std::mutex mu;
  std::set<std::string> dead;
  std::vector<std::thread> threads;
  for (const RelayMember& m : wiring.members)
    threads.emplace_back([&, m] {
      auto channel = tls::Dial(m.address, kMaxControlMessageBytes);
      absl::Status st = channel.status();
      if (st.ok()) {
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
        v1::NodeStatus reply;
        st = FromGrpcStatus(v1::NodeDaemon::NewStub(*channel)->GetNodeStatus(&ctx, v1::NodeStatusRequest(), &reply));
      }
      if (st.ok()) return;
      spdlog::warn("relay engine {} on node {} ({}) does not answer: {}", m.engine_id, m.node_id, m.address,
                   st.ToString());
      std::lock_guard<std::mutex> l(mu);
      dead.insert(m.engine_id);
    });
  for (auto& t : threads) t.join();
  return dead;
}

absl::Status AdoptRelays(const RelayReroute& reroute, int64_t version) {
  RelayWiring told;
  for (const RelayMember& m : reroute.wiring.members)
    if (std::find(reroute.changed.begin(), reroute.changed.end(), m.engine_id) != reroute.changed.end())
      told.members.push_back(m);
  return ForMembers(told, "SetRelay (new children)",
                    [&](const RelayMember& m, v1::NodeDaemon::Stub* stub, grpc::ClientContext* ctx) {
                      v1::SetRelayRequest req = m.request;
                      req.set_version(version);
                      req.set_adopt(true);
                      ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
                      v1::SetRelayReply out;
                      return FromGrpcStatus(stub->SetRelay(ctx, req, &out));
                    });
}

absl::Status StartRelays(const RelayWiring& wiring, int64_t version) {
  return ForMembers(wiring, "SetRelay",
                    [&](const RelayMember& m, v1::NodeDaemon::Stub* stub, grpc::ClientContext* ctx) {
                      v1::SetRelayRequest req = m.request;
                      req.set_version(version);
                      ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
                      v1::SetRelayReply out;
                      return FromGrpcStatus(stub->SetRelay(ctx, req, &out));
                    });
}

absl::Status DrainRelays(const RelayWiring& wiring, int64_t version, double timeout_s) {
  return ForMembers(
      wiring, "relay_drain", [&](const RelayMember& m, v1::NodeDaemon::Stub* stub, grpc::ClientContext* ctx) {
        v1::RelayDrainRequest req;
        req.set_version(version);
        req.set_engine_id(m.engine_id);
        req.set_timeout_seconds(timeout_s);
        ctx->set_deadline(std::chrono::system_clock::now() +
                          std::chrono::milliseconds(static_cast<int64_t>((timeout_s + 10) * 1000)));
        v1::RelayDrainReply out;
        absl::Status st = FromGrpcStatus(stub->RelayDrain(ctx, req, &out));
        if (st.ok())
          spdlog::info("update {}: relay engine {} on {}: {} bytes landed and checked, {} forwarded, {} notices sent",
                       version, m.engine_id, m.node_id, out.bytes_landed(), out.bytes_forwarded(), out.notices_sent());
        return st;
      });
}

}  // namespace wsync::daemon
