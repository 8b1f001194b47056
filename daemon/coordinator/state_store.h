#pragma once
// The coordinator's state store: where the last CoordinatorState lives, written once per change, so a restarted (or
// newly elected) coordinator knows its nodes, versions, engine states and history, and finds an update that was open
// when the previous one stopped (docs/operations.md, "Coordinator restarts" and "High availability (etcd)").
//
// Two implementations, chosen by --state (OpenStateStore):
//   sqlite:PATH or PATH               one SQLite database file, one coordinator per file (this file)
//   etcd://H:P[,H:P...]/PREFIX        etcd v3, shared by several coordinators of which one leads (etcd_store.h)

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/coordinator/state_objects.h"
#include "wsync/v1/coordinator.pb.h"

struct sqlite3;

namespace wsync::daemon {

// What a store has written since it was opened (bench/control and the tests read it).
struct StateStoreStats {
  uint64_t saves = 0;              // saves that wrote something (a save that changes nothing writes nothing)
  uint64_t requests = 0;           // write requests: etcd transactions, SQLite transactions
  uint64_t bytes_written = 0;      // keys and values put, over all saves
  uint64_t last_save_bytes = 0;    // of the last save that wrote something
  uint64_t max_request_bytes = 0;  // largest write request (etcd: the JSON body its gateway received)
  int max_request_ops = 0;         // most operations in one write request
};

// Both stores keep a state as one key per object (state_objects.h) and write only the objects that changed since
// the last save, atomically: a Load sees one whole saved state, never parts of two.
//
// Contract: Load and Save block (disk or network I/O) and may be called from any thread, one call at a time (the
// coordinator calls them under its own lock).
class StateStore {
 public:
  virtual ~StateStore() = default;
  // NotFound when nothing was saved yet; DataLoss when the stored state cannot be parsed or a node's layout differs
  // from the one stored under its hash; FailedPrecondition naming both versions when a newer schema wrote it. A store
  // still in the single-value form of schema 1 is read as such; the next save rewrites it as objects.
  virtual absl::StatusOr<v1::CoordinatorState> Load() = 0;
  // FailedPrecondition when this process may no longer write (a store shared by several coordinators refuses the
  // writes of one that is not the leader any more), or when a layout it would store differs from the one the store
  // holds under the same hash. `nodes_changed` false: `state` carries no nodes, and they are those of the previous
  // SaveChanges (the caller knows: its nodes change only with its membership epoch); the nodes' tables, most of a
  // state's bytes, are then neither copied nor compared.
  virtual absl::Status SaveChanges(const v1::CoordinatorState& state, bool nodes_changed) = 0;
  absl::Status Save(const v1::CoordinatorState& state) { return SaveChanges(state, true); }
  // Where the state lives, for logs and errors (a file path, or etcd://endpoints/prefix).
  virtual const std::string& path() const = 0;
  virtual StateStoreStats stats() const = 0;
};

class SqliteStateStore final : public StateStore {
 public:
  // Opens (creating if needed) the database at `path`. The parent directory must exist. Errors name the path.
  static absl::StatusOr<std::unique_ptr<SqliteStateStore>> Open(const std::string& path);
  ~SqliteStateStore() override;

  absl::StatusOr<v1::CoordinatorState> Load() override;
  absl::Status SaveChanges(const v1::CoordinatorState& state, bool nodes_changed) override;
  const std::string& path() const override { return path_; }
  StateStoreStats stats() const override;

 private:
  explicit SqliteStateStore(const std::string& path);
  // Every state key with its value: the objects table, and the schema 1 row as kLegacyStateKey.
  absl::StatusOr<StateObjects> ReadAll();

  sqlite3* db_ = nullptr;
  std::string path_;
  mutable std::mutex mu_;  // the members below; Load and Save also run one at a time under it
  StateObjectSet objects_;
  StateStoreStats stats_;
};

// A parsed --state value.
struct StateSpec {
  enum class Kind { kSqlite, kEtcd } kind = Kind::kSqlite;
  std::string path;                    // sqlite
  std::vector<std::string> endpoints;  // etcd: host:port each
  std::string prefix;                  // etcd: key prefix, no trailing '/'
};
// InvalidArgument naming what is wrong: an empty value, an etcd URL without endpoints or prefix, a bad host:port.
absl::StatusOr<StateSpec> ParseStateSpec(const std::string& value);

}  // namespace wsync::daemon
