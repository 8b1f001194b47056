#pragma once
// The coordinator's state store: where the last CoordinatorState lives, written once per change, so a restarted (or
// newly elected) coordinator knows its nodes, versions, engine states and history, and finds an update that was open
// when the previous one stopped (docs/operations.md, "Coordinator restarts" and "High availability (etcd)").
//
// Two implementations, chosen by --state (OpenStateStore):
//   sqlite:PATH or PATH               one SQLite database file, one coordinator per file (this file)
//   etcd://H:P[,H:P...]/PREFIX        etcd v3, shared by several coordinators of which one leads (etcd_store.h)

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "wsync/v1/coordinator.pb.h"

struct sqlite3;

namespace wsync::daemon {

// Contract: Load and Save block (disk or network I/O) and may be called from any thread, one call at a time (the
// coordinator calls them under its own lock).
class StateStore {
 public:
  virtual ~StateStore() = default;
  // NotFound when nothing was saved yet; DataLoss when the stored state cannot be parsed.
  virtual absl::StatusOr<v1::CoordinatorState> Load() = 0;
  // FailedPrecondition when this process may no longer write (a store shared by several coordinators refuses the
  // writes of one that is not the leader any more).
  virtual absl::Status Save(const v1::CoordinatorState& state) = 0;
  // Where the state lives, for logs and errors (a file path, or etcd://endpoints/prefix).
  virtual const std::string& path() const = 0;
};

class SqliteStateStore final : public StateStore {
 public:
  // Opens (creating if needed) the database at `path`. The parent directory must exist. Errors name the path.
  static absl::StatusOr<std::unique_ptr<SqliteStateStore>> Open(const std::string& path);
  ~SqliteStateStore() override;

  absl::StatusOr<v1::CoordinatorState> Load() override;
  absl::Status Save(const v1::CoordinatorState& state) override;
  const std::string& path() const override { return path_; }

 private:
  SqliteStateStore() = default;
  sqlite3* db_ = nullptr;
  std::string path_;
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
