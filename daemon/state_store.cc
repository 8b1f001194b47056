#include "daemon/state_store.h"

#include <sqlite3.h>

#include "absl/strings/str_cat.h"

namespace wsync::daemon {
namespace {

absl::Status Error(sqlite3* db, const std::string& path, const char* what) {
  return absl::InternalError(absl::StrCat("state store ", path, ": ", what, ": ", db ? sqlite3_errmsg(db) : "no db"));
}

// A prepared statement that finalizes itself.
struct Stmt {
  sqlite3_stmt* s = nullptr;
  ~Stmt() { sqlite3_finalize(s); }
};

}  // namespace

absl::StatusOr<std::unique_ptr<StateStore>> StateStore::Open(const std::string& path) {
  std::unique_ptr<StateStore> st(new StateStore());
  st->path_ = path;
  if (sqlite3_open_v2(path.c_str(), &st->db_, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX,
                      nullptr) != SQLITE_OK)
    return absl::FailedPreconditionError(
        absl::StrCat("cannot open the state store ", path, ": ", st->db_ ? sqlite3_errmsg(st->db_) : "out of memory"));
  sqlite3_busy_timeout(st->db_, 5000);
  // WAL: a crash mid-write leaves the previous state intact; FULL sync: a saved state survives a power loss.
  for (const char* sql : {"PRAGMA journal_mode=WAL", "PRAGMA synchronous=FULL",
                          "CREATE TABLE IF NOT EXISTS coordinator_state (id INTEGER PRIMARY KEY CHECK (id = 1), "
                          "format INTEGER NOT NULL, state BLOB NOT NULL, saved_unix_ms INTEGER NOT NULL)"}) {
    char* err = nullptr;
    if (sqlite3_exec(st->db_, sql, nullptr, nullptr, &err) != SQLITE_OK) {
      std::string msg = err ? err : "unknown error";
      sqlite3_free(err);
      return absl::FailedPreconditionError(absl::StrCat("state store ", path, ": ", sql, ": ", msg));
    }
  }
  return st;
}

StateStore::~StateStore() {
  if (db_ != nullptr) sqlite3_close(db_);
}

absl::StatusOr<v1::CoordinatorState> StateStore::Load() {
  Stmt q;
  if (sqlite3_prepare_v2(db_, "SELECT format, state FROM coordinator_state WHERE id = 1", -1, &q.s, nullptr) !=
      SQLITE_OK)
    return Error(db_, path_, "prepare load");
  const int rc = sqlite3_step(q.s);
  if (rc == SQLITE_DONE) return absl::NotFoundError(absl::StrCat("state store ", path_, " holds no state yet"));
  if (rc != SQLITE_ROW) return Error(db_, path_, "load");
  if (sqlite3_column_int(q.s, 0) != 1)
    return absl::DataLossError(absl::StrCat("state store ", path_, ": unknown format ", sqlite3_column_int(q.s, 0)));
  v1::CoordinatorState out;
  const void* blob = sqlite3_column_blob(q.s, 1);
  const int n = sqlite3_column_bytes(q.s, 1);
  if (!out.ParseFromArray(blob, n))
    return absl::DataLossError(absl::StrCat("state store ", path_, ": the saved state (", n, " bytes) is corrupt"));
  return out;
}

absl::Status StateStore::Save(const v1::CoordinatorState& state) {
  const std::string bytes = state.SerializeAsString();
  Stmt q;
  if (sqlite3_prepare_v2(db_,
                         "INSERT OR REPLACE INTO coordinator_state (id, format, state, saved_unix_ms) "
                         "VALUES (1, 1, ?1, CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER))",
                         -1, &q.s, nullptr) != SQLITE_OK)
    return Error(db_, path_, "prepare save");
  sqlite3_bind_blob(q.s, 1, bytes.data(), static_cast<int>(bytes.size()), SQLITE_TRANSIENT);
  if (sqlite3_step(q.s) != SQLITE_DONE) return Error(db_, path_, "save");
  return absl::OkStatus();
}

}  // namespace wsync::daemon
