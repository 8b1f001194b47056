#pragma once
// A CoordinatorState as the state stores keep it: one key per object, each written only when it changes
// (docs/operations.md, "High availability (etcd)"). Keys, relative to the store's prefix:
//
//   root                      StoredRoot: schema version, generation, versions, update state, drained lists
//   node/<node id>            StoredNode: the registration with every rank's parameter table left out, and per rank
//                             the hash of its table
//   layout/<hash>/<part>      StoredLayout bytes, in parts of at most part_bytes; <hash> is the XXH3-128 of the
//                             whole StoredLayout (32 hex digits), <part> 4 decimal digits. Engines of one kind and
//                             parallelism report identical tables: each distinct table is stored once.
//   engine/<control address>  StoredEngine: the coordinator's view of the engine and its version label
//   history/<version>[-<k>]   UpdateRecord, <version> 20 decimal digits (key order is history order)
//   open                      UpdateRecord of the update open or last opened
//   saving                    present only while a save that needs several etcd transactions is under way
//   (etcd_store.h) state                     schema 1: the whole state as one value; read once, then replaced by the
//   objects above
//
// The plan is not stored (a restored coordinator re-plans at its first update), so there is no plan object.
//
// This file decides (what to write, how to reassemble); the stores act (SQLite transaction, etcd transactions).

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "wsync/v1/coordinator.pb.h"

namespace wsync::daemon {

// 1: the whole state in one value ("state"); 2: one key per object.
inline constexpr int kStateSchemaVersion = 2;
inline constexpr char kLegacyStateKey[] = "state";
inline constexpr char kSavingKey[] = "saving";
inline constexpr char kRootKey[] = "root";

// Relative key → value.
using StateObjects = std::map<std::string, std::string>;

// Whether `key` (relative) is one the stores manage: the object kinds above, the legacy state and the saving marker.
// Anything else under the prefix (the leader key) is never read as state nor deleted.
bool IsStateKey(const std::string& key);

// The node and layout objects of `nodes` (pure). Node keys map to StoredNode bytes, layout parts to their bytes.
StateObjects SplitNodes(const google::protobuf::RepeatedPtrField<v1::RegisterNodeRequest>& nodes, size_t part_bytes);
// One node's objects of SplitNodes, added to `out` (a layout already there is not made again); returns the keys of
// its objects (its layouts' parts, then the node's own).
std::vector<std::string> SplitNode(const v1::RegisterNodeRequest& node, size_t part_bytes, StateObjects* out);
// The root (with `generation` and `writer`), engine, history and open-update objects of `state` (pure).
StateObjects SplitRest(const v1::CoordinatorState& state, int64_t generation, const std::string& writer);

// Reassembles a state from the objects a store holds (`where` names the store in errors). NotFound when there is no
// root; FailedPrecondition, naming both versions, when a newer schema wrote it; DataLoss when an object is missing
// or unreadable, or a node's layout differs from the one stored under its hash. `generation`: the root's.
absl::StatusOr<v1::CoordinatorState> JoinState(const StateObjects& objects, const std::string& where,
                                               int64_t* generation = nullptr);
// A schema 1 value.
absl::StatusOr<v1::CoordinatorState> ParseLegacyState(const std::string& bytes, const std::string& where);

// The changes that make a store hold a new state: puts in write order (layout parts first, the root last) and
// deletes. `bytes`: keys and values put.
struct ObjectDiff {
  std::vector<std::pair<std::string, std::string>> puts;
  std::vector<std::string> deletes;
  uint64_t bytes = 0;
  int64_t generation = 0;  // the root's after this diff
  bool empty() const { return puts.empty() && deletes.empty(); }
};

// What one store holds and wants, between saves. Not thread-safe: the store serializes its calls.
class StateObjectSet {
 public:
  StateObjectSet(std::string where, size_t part_bytes) : where_(std::move(where)), part_bytes_(part_bytes) {}

  // What the store holds now, from a full read of its state keys (IsStateKey).
  void SetStored(const StateObjects& stored);
  // After a write whose outcome is unknown: the next Prepare needs a full read first (SetStored).
  void ForgetStored() { stored_known_ = false; }
  bool stored_known() const { return stored_known_; }
  bool stored_has(const std::string& key) const { return stored_.count(key) > 0; }

  // The nodes the next Prepare writes: those of `state` when `nodes_changed`, else the ones given last
  // (FailedPrecondition if none ever were). Call first in every save, before anything can fail: the caller counts on
  // the nodes being taken whatever the save's outcome.
  absl::Status UseNodes(const v1::CoordinatorState& state, bool nodes_changed);
  // The changes that make the store hold `state` with the nodes of UseNodes; empty when it already does.
  // FailedPrecondition when a layout part the store holds under a hash differs from the table that hashes to it
  // (naming the node, engine and rank). Requires stored_known().
  absl::StatusOr<ObjectDiff> Prepare(const v1::CoordinatorState& state, const std::string& writer);
  // `diff` is now in the store.
  void Written(const ObjectDiff& diff);
  // The node and layout objects of the nodes given last (SplitNodes of them), and how many of those nodes the last
  // UseNodes with changed nodes split (the others kept their objects: their registrations were the same).
  const StateObjects& node_objects() const { return node_objects_; }
  size_t nodes_split() const { return nodes_split_; }

 private:
  const std::string where_;
  const size_t part_bytes_;
  bool stored_known_ = false;
  std::map<std::string, uint64_t> stored_;  // key → XXH3-64 of its value
  int64_t generation_ = 0;                  // the stored root's
  bool have_nodes_ = false;
  StateObjects node_objects_;  // the node and layout objects of the last nodes given
  struct NodeSplit {
    std::string hash;               // XXH3-128 of the registration's serialization
    std::vector<std::string> keys;  // of its objects in node_objects_ (SplitNode)
  };
  std::map<std::string, NodeSplit> split_;  // node id → what its objects were made from
  size_t nodes_split_ = 0;
};

}  // namespace wsync::daemon
