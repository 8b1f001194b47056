#include "daemon/coordinator/state_store.h"

#include <sqlite3.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

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

absl::StatusOr<std::unique_ptr<SqliteStateStore>> SqliteStateStore::Open(const std::string& path) {
  std::unique_ptr<SqliteStateStore> st(new SqliteStateStore());
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

SqliteStateStore::~SqliteStateStore() {
  if (db_ != nullptr) sqlite3_close(db_);
}

absl::StatusOr<v1::CoordinatorState> SqliteStateStore::Load() {
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

absl::Status SqliteStateStore::Save(const v1::CoordinatorState& state) {
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

absl::StatusOr<StateSpec> ParseStateSpec(const std::string& value) {
  StateSpec out;
  if (value.empty()) return absl::InvalidArgumentError("--state is empty");
  constexpr absl::string_view kEtcd = "etcd://";
  if (!absl::StartsWith(value, kEtcd)) {
    out.kind = StateSpec::Kind::kSqlite;
    out.path = absl::StartsWith(value, "sqlite:") ? value.substr(7) : value;
    if (out.path.empty()) return absl::InvalidArgumentError("--state sqlite: needs a file path");
    return out;
  }
  out.kind = StateSpec::Kind::kEtcd;
  const std::string rest = value.substr(kEtcd.size());
  const size_t slash = rest.find('/');
  if (slash == std::string::npos || slash + 1 >= rest.size())
    return absl::InvalidArgumentError(absl::StrCat("--state ", value,
                                                   ": want etcd://HOST:PORT[,HOST:PORT...]/PREFIX (the key prefix "
                                                   "every coordinator of this cluster shares)"));
  out.prefix = rest.substr(slash + 1);
  while (!out.prefix.empty() && out.prefix.back() == '/') out.prefix.pop_back();
  if (out.prefix.empty()) return absl::InvalidArgumentError(absl::StrCat("--state ", value, ": the prefix is empty"));
  for (absl::string_view ep : absl::StrSplit(rest.substr(0, slash), ',', absl::SkipWhitespace())) {
    ep = absl::StripAsciiWhitespace(ep);
    const size_t colon = ep.rfind(':');
    int port = 0;
    if (colon == absl::string_view::npos || colon == 0 || !absl::SimpleAtoi(ep.substr(colon + 1), &port) || port <= 0 ||
        port > 65535)
      return absl::InvalidArgumentError(absl::StrCat("--state ", value, ": etcd endpoint '", ep, "' is not HOST:PORT"));
    out.endpoints.emplace_back(ep);
  }
  if (out.endpoints.empty())
    return absl::InvalidArgumentError(absl::StrCat("--state ", value, ": no etcd endpoint (HOST:PORT) given"));
  return out;
}

}  // namespace wsync::daemon
