#include "daemon/coordinator/state_store.h"

#include <sqlite3.h>

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/cli.h"

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

// Big enough that a layout is one row; SQLite has no per-transaction limit that needs parts.
constexpr size_t kSqlitePartBytes = size_t{1} << 30;

SqliteStateStore::SqliteStateStore(const std::string& path) : path_(path), objects_(path, kSqlitePartBytes) {}

absl::StatusOr<std::unique_ptr<SqliteStateStore>> SqliteStateStore::Open(const std::string& path) {
  std::unique_ptr<SqliteStateStore> st(new SqliteStateStore(path));
  if (sqlite3_open_v2(path.c_str(), &st->db_, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX,
                      nullptr) != SQLITE_OK)
    return absl::FailedPreconditionError(
        absl::StrCat("cannot open the state store ", path, ": ", st->db_ ? sqlite3_errmsg(st->db_) : "out of memory"));
  sqlite3_busy_timeout(st->db_, 5000);
  // WAL: a crash mid-write leaves the previous state intact; FULL sync: a saved state survives a power loss.
  // coordinator_state is schema 1 (one row holding the whole state); it is read once and emptied by the next save.
  for (const char* sql : {"PRAGMA journal_mode=WAL", "PRAGMA synchronous=FULL",
                          "CREATE TABLE IF NOT EXISTS coordinator_state (id INTEGER PRIMARY KEY CHECK (id = 1), "
                          "format INTEGER NOT NULL, state BLOB NOT NULL, saved_unix_ms INTEGER NOT NULL)",
                          "CREATE TABLE IF NOT EXISTS state_objects (key TEXT PRIMARY KEY, value BLOB NOT NULL)"}) {
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

absl::StatusOr<StateObjects> SqliteStateStore::ReadAll() {
  StateObjects out;
  // One read transaction: both tables as of one moment.
  if (sqlite3_exec(db_, "BEGIN", nullptr, nullptr, nullptr) != SQLITE_OK) return Error(db_, path_, "begin read");
  struct End {
    sqlite3* db;
    ~End() { sqlite3_exec(db, "COMMIT", nullptr, nullptr, nullptr); }
  } end{db_};
  {
    Stmt q;
    if (sqlite3_prepare_v2(db_, "SELECT key, value FROM state_objects", -1, &q.s, nullptr) != SQLITE_OK)
      return Error(db_, path_, "prepare load");
    int rc;
    while ((rc = sqlite3_step(q.s)) == SQLITE_ROW) {
      const char* k = reinterpret_cast<const char*>(sqlite3_column_text(q.s, 0));
      const void* v = sqlite3_column_blob(q.s, 1);
      const int n = sqlite3_column_bytes(q.s, 1);
      out[k ? k : ""] = std::string(static_cast<const char*>(v), v ? n : 0);
    }
    if (rc != SQLITE_DONE) return Error(db_, path_, "load");
  }
  Stmt q;
  if (sqlite3_prepare_v2(db_, "SELECT format, state FROM coordinator_state WHERE id = 1", -1, &q.s, nullptr) !=
      SQLITE_OK)
    return Error(db_, path_, "prepare load");
  const int rc = sqlite3_step(q.s);
  if (rc == SQLITE_ROW) {
    if (sqlite3_column_int(q.s, 0) != 1)
      return absl::DataLossError(absl::StrCat("state store ", path_, ": unknown format ", sqlite3_column_int(q.s, 0)));
    const void* blob = sqlite3_column_blob(q.s, 1);
    out[kLegacyStateKey] = std::string(static_cast<const char*>(blob), blob ? sqlite3_column_bytes(q.s, 1) : 0);
  } else if (rc != SQLITE_DONE) {
    return Error(db_, path_, "load");
  }
  return out;
}

absl::StatusOr<v1::CoordinatorState> SqliteStateStore::Load() {
  std::lock_guard<std::mutex> l(mu_);
  auto all = ReadAll();
  if (!all.ok()) return all.status();
  objects_.SetStored(*all);
  if (all->count(kRootKey) || !all->count(kLegacyStateKey)) return JoinState(*all, path_);
  return ParseLegacyState(all->at(kLegacyStateKey), path_);
}

absl::Status SqliteStateStore::SaveChanges(const v1::CoordinatorState& state, bool nodes_changed) {
  std::lock_guard<std::mutex> l(mu_);
  if (absl::Status st = objects_.UseNodes(state, nodes_changed); !st.ok()) return st;
  if (!objects_.stored_known()) {
    auto all = ReadAll();
    if (!all.ok()) return all.status();
    objects_.SetStored(*all);
  }
  auto diff = objects_.Prepare(state, cli::VersionString("wsync-coordinator"));
  if (!diff.ok()) return diff.status();
  if (diff->empty()) return absl::OkStatus();
  // One transaction: a crash leaves the previous state or this one, never a mix.
  if (sqlite3_exec(db_, "BEGIN IMMEDIATE", nullptr, nullptr, nullptr) != SQLITE_OK)
    return Error(db_, path_, "begin save");
  auto rollback = [this](absl::Status st) {
    sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
    return st;
  };
  {
    Stmt del, legacy, put;
    if (sqlite3_prepare_v2(db_, "DELETE FROM state_objects WHERE key = ?1", -1, &del.s, nullptr) != SQLITE_OK ||
        sqlite3_prepare_v2(db_, "DELETE FROM coordinator_state", -1, &legacy.s, nullptr) != SQLITE_OK ||
        sqlite3_prepare_v2(db_, "INSERT OR REPLACE INTO state_objects (key, value) VALUES (?1, ?2)", -1, &put.s,
                           nullptr) != SQLITE_OK)
      return rollback(Error(db_, path_, "prepare save"));
    for (const auto& k : diff->deletes) {
      Stmt& q = k == kLegacyStateKey ? legacy : del;
      sqlite3_reset(q.s);
      if (&q == &del) sqlite3_bind_text(q.s, 1, k.data(), static_cast<int>(k.size()), SQLITE_TRANSIENT);
      if (sqlite3_step(q.s) != SQLITE_DONE) return rollback(Error(db_, path_, "save (delete)"));
    }
    for (const auto& [k, v] : diff->puts) {
      sqlite3_reset(put.s);
      sqlite3_bind_text(put.s, 1, k.data(), static_cast<int>(k.size()), SQLITE_TRANSIENT);
      sqlite3_bind_blob(put.s, 2, v.data(), static_cast<int>(v.size()), SQLITE_STATIC);
      if (sqlite3_step(put.s) != SQLITE_DONE) return rollback(Error(db_, path_, "save"));
    }
  }
  if (sqlite3_exec(db_, "COMMIT", nullptr, nullptr, nullptr) != SQLITE_OK) {
    objects_.ForgetStored();
    return rollback(Error(db_, path_, "commit save"));
  }
  objects_.Written(*diff);
  ++stats_.saves;
  ++stats_.requests;
  stats_.bytes_written += diff->bytes;
  stats_.last_save_bytes = diff->bytes;
  stats_.max_request_bytes = std::max<uint64_t>(stats_.max_request_bytes, diff->bytes);
  stats_.max_request_ops =
      std::max<int>(stats_.max_request_ops, static_cast<int>(diff->puts.size() + diff->deletes.size()));
  return absl::OkStatus();
}

StateStoreStats SqliteStateStore::stats() const {
  std::lock_guard<std::mutex> l(mu_);
  return stats_;
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
