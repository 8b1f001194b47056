#pragma once
// The coordinator's state store: one SQLite database file (--state PATH) holding the last CoordinatorState, written
// in one transaction per change, so a restarted coordinator knows its nodes, versions, engine states and history,
// and finds an update it died during (docs/operations.md, "Coordinator restarts").

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "wsync/v1/coordinator.pb.h"

struct sqlite3;

namespace wsync::daemon {

class StateStore {
 public:
  // Opens (creating if needed) the database at `path`. The parent directory must exist. Errors name the path.
  static absl::StatusOr<std::unique_ptr<StateStore>> Open(const std::string& path);
  ~StateStore();

  // NotFound when nothing was saved yet; DataLoss when the stored state cannot be parsed.
  absl::StatusOr<v1::CoordinatorState> Load();
  absl::Status Save(const v1::CoordinatorState& state);
  const std::string& path() const { return path_; }

 private:
  StateStore() = default;
  sqlite3* db_ = nullptr;
  std::string path_;
};

}  // namespace wsync::daemon
