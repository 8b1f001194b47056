#include "daemon/coordinator/state_objects.h"

#include <xxhash.h>

#include <cstdio>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace wsync::daemon {
namespace {

constexpr absl::string_view kNode = "node/", kLayout = "layout/", kEngine = "engine/", kHistory = "history/";
constexpr char kOpen[] = "open";

std::string Hash128(const std::string& bytes) {
  const XXH128_hash_t h = XXH3_128bits(bytes.data(), bytes.size());
  return absl::StrFormat("%016x%016x", h.high64, h.low64);
}

uint64_t Hash64(const std::string& bytes) { return XXH3_64bits(bytes.data(), bytes.size()); }

std::string LayoutKey(const std::string& hash, int part) { return absl::StrFormat("layout/%s/%04d", hash, part); }

absl::Status Corrupt(const std::string& where, const std::string& what) {
  return absl::DataLossError(absl::StrCat("state store ", where, ": ", what));
}

// The version of a history key ("history/<20 digits>[-<k>]"); -1 when it is not one.
int64_t HistoryKeyVersion(const std::string& key) {
  int64_t v = -1;
  if (!absl::SimpleAtoi(absl::string_view(key).substr(kHistory.size(), 20), &v)) return -1;
  return v;
}

}  // namespace

bool IsStateKey(const std::string& key) {
  return key == kRootKey || key == kOpen || key == kLegacyStateKey || key == kSavingKey ||
         absl::StartsWith(key, kNode) || absl::StartsWith(key, kLayout) || absl::StartsWith(key, kEngine) ||
         absl::StartsWith(key, kHistory);
}

std::vector<std::string> SplitNode(const v1::RegisterNodeRequest& n, size_t part_bytes, StateObjects* out) {
  std::vector<std::string> keys;
  v1::StoredNode sn;
  v1::RegisterNodeRequest* stripped = sn.mutable_node();
  // Copy, then clear the tables: every other field (of the node, its engines and their ranks, present or added
  // later) is kept. A node is split only when it changed (StateObjectSet::UseNodes), so the copy of its tables is
  // paid once per registration.
  *stripped = n;
  for (int e = 0; e < n.engines_size(); ++e) {
    const auto& eng = n.engines(e);
    for (int r = 0; r < eng.ranks_size(); ++r) {
      if (eng.ranks(r).params_size() == 0) continue;
      // The copy's table moves to the layout object (the stripped node is left without it).
      v1::StoredLayout layout;
      layout.mutable_params()->Swap(stripped->mutable_engines(e)->mutable_ranks(r)->mutable_params());
      const std::string bytes = layout.SerializeAsString();
      const std::string hash = Hash128(bytes);
      auto* ref = sn.add_layouts();
      ref->set_engine(e);
      ref->set_rank(r);
      ref->set_hash(hash);
      ref->set_bytes(bytes.size());
      const size_t step = std::max<size_t>(part_bytes, 1);
      const int parts = static_cast<int>((bytes.size() + step - 1) / step);
      ref->set_parts(parts);
      for (int p = 0; p < parts; ++p) keys.push_back(LayoutKey(hash, p));
      if (out->count(LayoutKey(hash, 0))) continue;  // another rank or engine has the same table
      for (int p = 0; p < parts; ++p) (*out)[LayoutKey(hash, p)] = bytes.substr(p * step, step);
    }
  }
  keys.push_back(absl::StrCat(kNode, n.node_id()));
  (*out)[keys.back()] = sn.SerializeAsString();
  return keys;
}

StateObjects SplitNodes(const google::protobuf::RepeatedPtrField<v1::RegisterNodeRequest>& nodes, size_t part_bytes) {
  StateObjects out;
  for (const auto& n : nodes) SplitNode(n, part_bytes, &out);
  return out;
}

StateObjects SplitRest(const v1::CoordinatorState& s, int64_t generation, const std::string& writer) {
  StateObjects out;
  v1::StoredRoot root;
  root.set_schema_version(kStateSchemaVersion);
  root.set_writer(writer);
  root.set_generation(generation);
  root.set_membership_epoch(s.membership_epoch());
  root.set_current_version(s.current_version());
  root.set_last_begun(s.last_begun());
  root.set_state(s.state());
  root.set_open_version(s.open_version());
  root.set_engines_hold_partial_writes(s.engines_hold_partial_writes());
  *root.mutable_drained_engines() = s.drained_engines();
  *root.mutable_drained_nodes() = s.drained_nodes();
  root.set_switch_started(s.switch_started());
  out[kRootKey] = root.SerializeAsString();
  std::map<std::string, v1::StoredEngine> engines;
  for (const auto& [addr, st] : s.engine_state()) engines[addr].set_state(st);
  for (const auto& [addr, v] : s.engine_version()) engines[addr].set_version(v);
  for (const auto& [addr, why] : s.engine_stale()) engines[addr].set_stale(why);
  for (const auto& [addr, e] : engines) out[absl::StrCat(kEngine, addr)] = e.SerializeAsString();
  // Versions only grow along the history; a repeated one (never expected) keeps its place with a suffix.
  std::map<int64_t, int> seen;
  for (const auto& r : s.history()) {
    const int k = seen[r.version()]++;
    std::string key = absl::StrFormat("history/%020d", r.version());
    if (k > 0) absl::StrAppend(&key, "-", absl::StrFormat("%04d", k));
    out[key] = r.SerializeAsString();
  }
  if (s.has_open_record()) out[kOpen] = s.open_record().SerializeAsString();
  return out;
}

absl::StatusOr<v1::CoordinatorState> ParseLegacyState(const std::string& bytes, const std::string& where) {
  v1::CoordinatorState out;
  if (!out.ParseFromString(bytes))
    return Corrupt(where, absl::StrCat("the saved state (", bytes.size(), " bytes) is corrupt"));
  return out;
}

absl::StatusOr<v1::CoordinatorState> JoinState(const StateObjects& objects, const std::string& where,
                                               int64_t* generation) {
  auto root_it = objects.find(kRootKey);
  if (root_it == objects.end()) return absl::NotFoundError(absl::StrCat("state store ", where, " holds no state yet"));
  v1::StoredRoot root;
  if (!root.ParseFromString(root_it->second))
    return Corrupt(where, absl::StrCat("the root object (", root_it->second.size(), " bytes) is corrupt"));
  if (root.schema_version() > kStateSchemaVersion)
    return absl::FailedPreconditionError(
        absl::StrCat("state store ", where, " was written with state schema version ", root.schema_version(), " by ",
                     root.writer().empty() ? "an unknown coordinator" : root.writer(),
                     "; this coordinator reads schema versions up to ", kStateSchemaVersion,
                     ": run a coordinator at least as new as the one that wrote it"));
  if (root.schema_version() < 2)
    return Corrupt(where, absl::StrCat("the root object has schema version ", root.schema_version()));
  if (generation) *generation = root.generation();
  v1::CoordinatorState s;
  s.set_membership_epoch(root.membership_epoch());
  s.set_current_version(root.current_version());
  s.set_last_begun(root.last_begun());
  s.set_state(root.state());
  s.set_open_version(root.open_version());
  s.set_engines_hold_partial_writes(root.engines_hold_partial_writes());
  *s.mutable_drained_engines() = root.drained_engines();
  *s.mutable_drained_nodes() = root.drained_nodes();
  s.set_switch_started(root.switch_started());
  for (auto it = objects.lower_bound(std::string(kNode)); it != objects.end() && absl::StartsWith(it->first, kNode);
       ++it) {
    v1::StoredNode sn;
    if (!sn.ParseFromString(it->second)) return Corrupt(where, absl::StrCat("object ", it->first, " is corrupt"));
    v1::RegisterNodeRequest* n = s.add_nodes();
    *n = std::move(*sn.mutable_node());
    for (const auto& ref : sn.layouts()) {
      const std::string who = absl::StrCat("node ", n->node_id(), " engine ", ref.engine(), " rank ", ref.rank());
      if (ref.engine() < 0 || ref.engine() >= n->engines_size() || ref.rank() < 0 ||
          ref.rank() >= n->engines(ref.engine()).ranks_size())
        return Corrupt(where, absl::StrCat(who, ": the layout reference points at no rank"));
      std::string bytes;
      for (int p = 0; p < ref.parts(); ++p) {
        auto part = objects.find(LayoutKey(ref.hash(), p));
        if (part == objects.end())
          return Corrupt(where, absl::StrCat(who, ": its layout ", ref.hash(), " lacks part ", p, " of ", ref.parts()));
        bytes += part->second;
      }
      if (bytes.size() != ref.bytes() || Hash128(bytes) != ref.hash())
        return Corrupt(where,
                       absl::StrCat(who, ": the layout stored under hash ", ref.hash(),
                                    " differs from the one the node registered (", bytes.size(), " bytes hashing to ",
                                    Hash128(bytes), ", expected ", ref.bytes(), " bytes)"));
      v1::StoredLayout layout;
      if (!layout.ParseFromString(bytes))
        return Corrupt(where, absl::StrCat(who, ": layout ", ref.hash(), " is corrupt"));
      *n->mutable_engines(ref.engine())->mutable_ranks(ref.rank())->mutable_params() =
          std::move(*layout.mutable_params());
    }
  }
  for (auto it = objects.lower_bound(std::string(kEngine)); it != objects.end() && absl::StartsWith(it->first, kEngine);
       ++it) {
    v1::StoredEngine e;
    if (!e.ParseFromString(it->second)) return Corrupt(where, absl::StrCat("object ", it->first, " is corrupt"));
    const std::string addr = it->first.substr(kEngine.size());
    if (e.has_state()) (*s.mutable_engine_state())[addr] = e.state();
    if (e.has_version()) (*s.mutable_engine_version())[addr] = e.version();
    if (e.has_stale()) (*s.mutable_engine_stale())[addr] = e.stale();
  }
  for (auto it = objects.lower_bound(std::string(kHistory));
       it != objects.end() && absl::StartsWith(it->first, kHistory); ++it)
    if (!s.add_history()->ParseFromString(it->second))
      return Corrupt(where, absl::StrCat("object ", it->first, " is corrupt"));
  if (auto it = objects.find(kOpen); it != objects.end() && !s.mutable_open_record()->ParseFromString(it->second))
    return Corrupt(where, "the open update's record is corrupt");
  return s;
}

void StateObjectSet::SetStored(const StateObjects& stored) {
  stored_.clear();
  generation_ = 0;
  for (const auto& [k, v] : stored) {
    if (!IsStateKey(k)) continue;
    stored_[k] = Hash64(v);
    if (k == kRootKey) {
      v1::StoredRoot root;
      if (root.ParseFromString(v)) generation_ = root.generation();
    }
  }
  stored_known_ = true;
}

absl::Status StateObjectSet::UseNodes(const v1::CoordinatorState& state, bool nodes_changed) {
  if (nodes_changed) {
    // Only the nodes whose registration changed are split again: a membership change is one node, and splitting
    // every node copied and serialized every engine rank's table (at 1024 engine ranks, about a second of the
    // coordinator's lock per registration). A node's objects are moved from the previous set, not copied.
    StateObjects next;
    std::map<std::string, NodeSplit> split;
    nodes_split_ = 0;
    for (const auto& n : state.nodes()) {
      NodeSplit ns;
      ns.hash = Hash128(n.SerializeAsString());
      auto old = split_.find(n.node_id());
      bool kept = have_nodes_ && old != split_.end() && old->second.hash == ns.hash;
      if (kept) {
        for (const auto& k : old->second.keys) {
          if (next.count(k)) continue;  // a layout another node has too
          auto moved = node_objects_.extract(k);
          if (moved.empty()) {
            kept = false;  // not expected: split it again
            break;
          }
          next.insert(std::move(moved));
        }
      }
      if (kept) {
        ns.keys = std::move(old->second.keys);
      } else {
        ns.keys = SplitNode(n, part_bytes_, &next);
        ++nodes_split_;
      }
      split[n.node_id()] = std::move(ns);
    }
    node_objects_ = std::move(next);
    split_ = std::move(split);
    have_nodes_ = true;
  } else if (!have_nodes_) {
    return absl::FailedPreconditionError(
        absl::StrCat("state store ", where_, ": a save without nodes before any save with them"));
  }
  return absl::OkStatus();
}

absl::StatusOr<ObjectDiff> StateObjectSet::Prepare(const v1::CoordinatorState& state, const std::string& writer) {
  if (!stored_known_) return absl::InternalError("state objects: prepared without knowing what the store holds");
  if (!have_nodes_) return absl::InternalError("state objects: prepared before UseNodes");
  ObjectDiff d;
  // First with the stored generation: when nothing else changed, neither does the root, and nothing is written.
  StateObjects rest = SplitRest(state, generation_, writer);
  auto consider = [&](const std::string& key, const std::string& value) {
    auto it = stored_.find(key);
    if (it != stored_.end() && it->second == Hash64(value)) return absl::OkStatus();
    if (it != stored_.end() && absl::StartsWith(key, kLayout)) {
      // Content-addressed: a stored part that differs is not ours to overwrite.
      const std::string hash = key.substr(kLayout.size(), 32);
      std::string who = "no node";
      for (const auto& [nk, nv] : node_objects_) {
        if (!absl::StartsWith(nk, kNode)) continue;
        v1::StoredNode sn;
        if (!sn.ParseFromString(nv)) continue;
        for (const auto& ref : sn.layouts())
          if (ref.hash() == hash) {
            who = absl::StrCat("node ", sn.node().node_id(), " engine ", sn.node().engines(ref.engine()).engine_id(),
                               " rank ", ref.rank());
            break;
          }
      }
      return absl::FailedPreconditionError(absl::StrCat("state store ", where_, ": refusing the layout of ", who,
                                                        ": the store already holds a different layout "
                                                        "under its hash (",
                                                        key,
                                                        "); the store is corrupt or was written by something else"));
    }
    d.puts.emplace_back(key, value);
    d.bytes += key.size() + value.size();
    return absl::OkStatus();
  };
  for (const auto& [k, v] : node_objects_)
    if (absl::StartsWith(k, kLayout)) {
      if (auto st = consider(k, v); !st.ok()) return st;
    }
  for (const auto& [k, v] : node_objects_)
    if (!absl::StartsWith(k, kLayout)) {
      if (auto st = consider(k, v); !st.ok()) return st;
    }
  for (const auto& [k, v] : rest)
    if (k != kRootKey) {
      if (auto st = consider(k, v); !st.ok()) return st;
    }
  for (const auto& [k, h] : stored_) {
    if (k == kSavingKey || node_objects_.count(k) || rest.count(k)) continue;
    // An incremental history: records not sent are kept unless older than the floor (trimmed).
    if (state.history_incremental() && absl::StartsWith(k, kHistory) && HistoryKeyVersion(k) >= state.history_floor())
      continue;
    d.deletes.push_back(k);
  }
  const bool root_differs = stored_.count(kRootKey) == 0 || stored_[kRootKey] != Hash64(rest[kRootKey]);
  if (d.empty() && !root_differs) {
    d.generation = generation_;
    return d;
  }
  d.generation = generation_ + 1;
  v1::StoredRoot r;
  r.ParseFromString(rest[kRootKey]);
  r.set_generation(d.generation);
  std::string bytes = r.SerializeAsString();
  d.bytes += std::string(kRootKey).size() + bytes.size();
  d.puts.emplace_back(kRootKey, std::move(bytes));
  return d;
}

void StateObjectSet::Written(const ObjectDiff& diff) {
  for (const auto& k : diff.deletes) stored_.erase(k);
  for (const auto& [k, v] : diff.puts) stored_[k] = Hash64(v);
  stored_.erase(kSavingKey);
  generation_ = diff.generation;
}

}  // namespace wsync::daemon
