// The state kept as one object per key (daemon/coordinator/state_objects.h), on SQLite: a state round-trips through
// a new store; identical parameter tables are stored once; a save writes only what changed (nothing when nothing
// did); a store written by a newer schema is refused naming both versions; a layout that differs from the one stored
// under its hash is refused, at load and at save; a schema 1 store (one row holding the whole state) is read and
// rewritten as objects.

#include "daemon/coordinator/state_store.h"

#include <sqlite3.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon/coordinator/state_objects.h"
#include "google/protobuf/util/message_differencer.h"

namespace wsync::daemon {
namespace {

std::string TempDb(const std::string& name) {
  const std::string p =
      (std::filesystem::temp_directory_path() / absl::StrCat("wsync-state-", name, "-", ::getpid(), ".db")).string();
  for (const char* suffix : {"", "-wal", "-shm"}) std::filesystem::remove(p + suffix);
  return p;
}

// A target node with `engines` engines of `ranks` ranks; every engine's rank r has the same table (as engines of one
// kind and parallelism report), rank tables differ between ranks; `tag` changes every table.
v1::RegisterNodeRequest Target(const std::string& id, int engines, int ranks, const std::string& tag = "") {
  v1::RegisterNodeRequest n;
  n.set_node_id(id);
  n.set_role("target");
  n.set_address(id + ":7701");
  n.set_transport("tcp");
  for (int e = 0; e < engines; ++e) {
    auto* eng = n.add_engines();
    eng->set_engine_id(absl::StrCat(id, "-e", e));
    eng->set_control_address(absl::StrCat(id, ":3000", e));
    eng->set_kind("reference");
    for (int r = 0; r < ranks; ++r) {
      auto* l = eng->add_ranks();
      l->set_rank(r);
      l->mutable_parallelism()->set_tp_size(ranks);
      l->mutable_parallelism()->set_tp_rank(r);
      for (int p = 0; p < 50; ++p) {
        auto* d = l->add_params();
        d->set_name(absl::StrCat(tag, "model.layers.", p, ".mlp.experts.", r, ".down_proj.weight"));
        d->set_dtype("bfloat16");
        d->add_shape(4096);
        d->add_shape(512);
        d->set_bytes(4096 * 512 * 2);
        d->set_offset(static_cast<uint64_t>(p) * 4096 * 512 * 2);
      }
      l->set_region_bytes(50ull * 4096 * 512 * 2);
      auto* seg = l->add_segments();
      seg->set_id(0);
      seg->set_kind("host");
      seg->set_bytes(l->region_bytes());
      seg->set_region_descriptor(absl::StrCat("descriptor of ", eng->engine_id(), " rank ", r));  // per process
    }
  }
  return n;
}

v1::CoordinatorState ClusterState(int history) {
  v1::CoordinatorState s;
  *s.add_nodes() = Target("infer0", 2, 4);
  *s.add_nodes() = Target("infer1", 1, 4);
  auto* src = s.add_nodes();
  src->set_node_id("train0");
  src->set_role("source");
  src->set_address("train0:7700");
  src->set_trainer_ranks(8);
  s.set_membership_epoch(3);
  s.set_current_version(history);
  s.set_last_begun(history);
  s.set_state("idle");
  s.set_open_version(-1);
  for (const auto& n : s.nodes())
    for (const auto& e : n.engines()) {
      (*s.mutable_engine_state())[e.control_address()] = "serving";
      (*s.mutable_engine_version())[e.control_address()] = std::to_string(history);
    }
  (*s.mutable_engine_state())["only-state:1"] = "registered";  // a state without a version label
  for (int v = 1; v <= history; ++v) {
    auto* r = s.add_history();
    r->set_version(v);
    r->set_success(true);
    r->set_bytes(1000 * v);
  }
  s.mutable_open_record()->set_version(history);
  s.add_drained_engines("infer1-e0");
  return s;
}

bool Same(const v1::CoordinatorState& a, const v1::CoordinatorState& b) {
  google::protobuf::util::MessageDifferencer d;
  d.TreatAsSet(v1::CoordinatorState::descriptor()->FindFieldByName("nodes"));
  std::string diff;
  d.ReportDifferencesToString(&diff);
  const bool same = d.Compare(a, b);
  if (!same) UNSCOPED_INFO(diff.substr(0, 2000));
  return same;
}

void Exec(const std::string& db, const std::string& sql, const std::string& blob = "") {
  sqlite3* h = nullptr;
  REQUIRE(sqlite3_open(db.c_str(), &h) == SQLITE_OK);
  sqlite3_stmt* s = nullptr;
  REQUIRE(sqlite3_prepare_v2(h, sql.c_str(), -1, &s, nullptr) == SQLITE_OK);
  if (!blob.empty()) sqlite3_bind_blob(s, 1, blob.data(), static_cast<int>(blob.size()), SQLITE_TRANSIENT);
  CHECK(sqlite3_step(s) == SQLITE_DONE);
  sqlite3_finalize(s);
  sqlite3_close(h);
}

int64_t Count(const std::string& db, const std::string& sql) {
  sqlite3* h = nullptr;
  REQUIRE(sqlite3_open(db.c_str(), &h) == SQLITE_OK);
  sqlite3_stmt* s = nullptr;
  REQUIRE(sqlite3_prepare_v2(h, sql.c_str(), -1, &s, nullptr) == SQLITE_OK);
  REQUIRE(sqlite3_step(s) == SQLITE_ROW);
  const int64_t n = sqlite3_column_int64(s, 0);
  sqlite3_finalize(s);
  sqlite3_close(h);
  return n;
}

std::unique_ptr<SqliteStateStore> OpenOrFail(const std::string& path) {
  auto s = SqliteStateStore::Open(path);
  REQUIRE(s.ok());
  return *std::move(s);
}

TEST_CASE("state objects: a state round-trips through a new store; identical tables are stored once") {
  const std::string db = TempDb("roundtrip");
  const v1::CoordinatorState s = ClusterState(5);
  {
    auto a = OpenOrFail(db);
    CHECK(absl::IsNotFound(a->Load().status()));
    REQUIRE(a->Save(s).ok());
  }
  auto b = OpenOrFail(db);
  auto got = b->Load();
  REQUIRE(got.ok());
  CHECK(Same(*got, s));
  // 3 engines x 4 ranks, but each rank index has one table: 4 layouts; 3 nodes, 4 engines, 5 history entries.
  CHECK(Count(db, "SELECT COUNT(*) FROM state_objects WHERE key LIKE 'layout/%'") == 4);
  CHECK(Count(db, "SELECT COUNT(*) FROM state_objects WHERE key LIKE 'node/%'") == 3);
  CHECK(Count(db, "SELECT COUNT(*) FROM state_objects WHERE key LIKE 'engine/%'") == 4);
  CHECK(Count(db, "SELECT COUNT(*) FROM state_objects WHERE key LIKE 'history/%'") == 5);
}

TEST_CASE("state objects: a save writes only what changed, and nothing when nothing did") {
  const std::string db = TempDb("diff");
  auto a = OpenOrFail(db);
  v1::CoordinatorState s = ClusterState(3);
  REQUIRE(a->Save(s).ok());
  const StateStoreStats first = a->stats();
  CHECK(first.saves == 1);

  REQUIRE(a->Save(s).ok());  // unchanged
  CHECK(a->stats().saves == 1);

  // One engine's state changes: its object and the root, nothing of the nodes; the caller says the nodes did not
  // change and passes none.
  v1::CoordinatorState t = s;
  t.clear_nodes();
  (*t.mutable_engine_state())["infer0:30000"] = "paused";
  REQUIRE(a->SaveChanges(t, /*nodes_changed=*/false).ok());
  const StateStoreStats second = a->stats();
  CHECK(second.saves == 2);
  CHECK(second.max_request_ops == first.max_request_ops);  // the first save was the big one
  CHECK(second.last_save_bytes < 400);
  CHECK(second.last_save_bytes * 50 < first.last_save_bytes);

  // An update ends: one history entry more, the oldest dropped (the history's bound), versions move.
  t.add_history()->set_version(4);
  t.mutable_history()->erase(t.mutable_history()->begin());
  t.set_current_version(4);
  REQUIRE(a->SaveChanges(t, false).ok());
  CHECK(a->stats().last_save_bytes < 400);
  CHECK(Count(db, "SELECT COUNT(*) FROM state_objects WHERE key LIKE 'history/%'") == 3);

  auto b = OpenOrFail(db);
  auto got = b->Load();
  REQUIRE(got.ok());
  v1::CoordinatorState want = t;
  *want.mutable_nodes() = s.nodes();
  CHECK(Same(*got, want));

  // Removing a node deletes its object and the tables no other node uses.
  v1::CoordinatorState u = want;
  u.mutable_nodes()->DeleteSubrange(0, 2);  // both targets: only the source remains
  REQUIRE(a->Save(u).ok());
  CHECK(Count(db, "SELECT COUNT(*) FROM state_objects WHERE key LIKE 'layout/%'") == 0);
  CHECK(Count(db, "SELECT COUNT(*) FROM state_objects WHERE key LIKE 'node/%'") == 1);
  got = OpenOrFail(db)->Load();
  REQUIRE(got.ok());
  CHECK(Same(*got, u));
}

TEST_CASE("state objects: a store written by a newer schema is refused naming both versions") {
  const std::string db = TempDb("newer");
  REQUIRE(OpenOrFail(db)->Save(ClusterState(1)).ok());
  v1::StoredRoot root;
  root.set_schema_version(kStateSchemaVersion + 1);
  root.set_writer("wsync-coordinator 9.0.0 (commit abc)");
  Exec(db, "UPDATE state_objects SET value = ?1 WHERE key = 'root'", root.SerializeAsString());
  auto got = OpenOrFail(db)->Load();
  REQUIRE(absl::IsFailedPrecondition(got.status()));
  INFO(got.status().ToString());
  CHECK(absl::StrContains(got.status().message(), absl::StrCat("schema version ", kStateSchemaVersion + 1)));
  CHECK(absl::StrContains(got.status().message(), absl::StrCat("up to ", kStateSchemaVersion)));
  CHECK(absl::StrContains(got.status().message(), "wsync-coordinator 9.0.0"));
}

TEST_CASE("state objects: a layout that differs from the one stored under its hash is refused") {
  const std::string db = TempDb("layout");
  const v1::CoordinatorState s = ClusterState(1);
  auto a = OpenOrFail(db);
  REQUIRE(a->Save(s).ok());
  // The table of rank 2 (shared by infer0-e0, infer0-e1 and infer1-e0) is altered in the store.
  const std::string key = [&] {
    auto all = SplitNodes(s.nodes(), size_t{1} << 30);
    std::string want;
    for (const auto& [k, v] : all)
      if (absl::StartsWith(k, "layout/") && absl::StrContains(v, "experts.2.down_proj")) want = k;
    return want;
  }();
  REQUIRE(!key.empty());
  v1::StoredLayout other;
  other.add_params()->set_name("model.layers.0.mlp.experts.2.down_proj.weight");
  Exec(db, absl::StrCat("UPDATE state_objects SET value = ?1 WHERE key = '", key, "'"), other.SerializeAsString());

  auto got = OpenOrFail(db)->Load();
  REQUIRE(absl::IsDataLoss(got.status()));
  INFO(got.status().ToString());
  CHECK(absl::StrContains(got.status().message(), "differs from the one the node registered"));
  CHECK(absl::StrContains(got.status().message(), "rank 2"));

  // A node registering with that table (its hash names the altered value) is refused, not linked to the wrong table.
  auto b = OpenOrFail(db);
  (void)b->Load();
  v1::CoordinatorState t = s;
  *t.add_nodes() = Target("infer2", 1, 4);
  t.mutable_nodes()->DeleteSubrange(0, 2);  // the altered table is referenced by infer2 only
  absl::Status st = b->Save(t);
  REQUIRE(absl::IsFailedPrecondition(st));
  INFO(st.ToString());
  CHECK(absl::StrContains(st.message(), "node infer2 engine infer2-e0 rank 2"));
  CHECK(absl::StrContains(st.message(), "different layout under its hash"));
}

TEST_CASE("state objects: a schema 1 store (the whole state in one row) is read, then rewritten as objects") {
  const std::string db = TempDb("legacy");
  const v1::CoordinatorState s = ClusterState(4);
  {
    auto a = OpenOrFail(db);  // creates both tables
  }
  Exec(db, "INSERT INTO coordinator_state (id, format, state, saved_unix_ms) VALUES (1, 1, ?1, 0)",
       s.SerializeAsString());
  auto a = OpenOrFail(db);
  auto got = a->Load();
  REQUIRE(got.ok());
  CHECK(Same(*got, s));
  CHECK(Count(db, "SELECT COUNT(*) FROM state_objects") == 0);
  REQUIRE(a->Save(*got).ok());
  CHECK(Count(db, "SELECT COUNT(*) FROM coordinator_state") == 0);
  CHECK(Count(db, "SELECT COUNT(*) FROM state_objects WHERE key = 'root'") == 1);
  got = OpenOrFail(db)->Load();
  REQUIRE(got.ok());
  CHECK(Same(*got, s));
}

}  // namespace
}  // namespace wsync::daemon
