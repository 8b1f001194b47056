// The etcd state store and leader election against a real etcd (started by tests/daemon/etcd_harness.py, which
// passes its address in WSYNC_ETCD_ENDPOINT): save/load, create-if-absent election, fencing of a deposed leader,
// fail-over by lease expiry and by resignation. Also the --state parser.

#include "daemon/coordinator/etcd_store.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "httplib.h"
#include "nlohmann/json.hpp"

namespace wsync::daemon {
namespace {

std::string Endpoint() {
  const char* e = std::getenv("WSYNC_ETCD_ENDPOINT");
  // Not a skip: the CTest command always starts etcd; running the binary alone needs one.
  if (e == nullptr || *e == '\0') FAIL("WSYNC_ETCD_ENDPOINT is unset: run through tests/daemon/etcd_harness.py");
  return e;
}

// A prefix of its own per test case, so cases never see each other's keys.
std::string Prefix(const std::string& name) {
  static std::atomic<int> n{0};
  return absl::StrCat("wsync-test/", name, "-", absl::ToUnixMicros(absl::Now()), "-", n++);
}

EtcdOptions Opts(const std::string& prefix, const std::string& self, double ttl = 3) {
  EtcdOptions o;
  o.endpoints = {Endpoint()};
  o.prefix = prefix;
  o.advertise = self;
  o.lease_ttl_seconds = ttl;
  o.campaign_interval = absl::Milliseconds(100);
  return o;
}

std::unique_ptr<EtcdStateStore> OpenOrFail(EtcdOptions o) {
  auto s = EtcdStateStore::Open(std::move(o));
  REQUIRE(s.ok());
  return *std::move(s);
}

v1::CoordinatorState State(int64_t version, const std::string& node) {
  v1::CoordinatorState s;
  s.set_current_version(version);
  s.set_last_begun(version);
  s.set_state("idle");
  s.add_nodes()->set_node_id(node);
  return s;
}

// A raw put through the gateway, as an operator's etcdctl would (not through the store under test).
void RawPut(const std::string& key, const std::string& value) {
  const std::string ep = Endpoint();
  httplib::Client cli(ep.substr(0, ep.rfind(':')), std::stoi(ep.substr(ep.rfind(':') + 1)));
  nlohmann::json body = {{"key", absl::Base64Escape(key)}, {"value", absl::Base64Escape(value)}};
  auto r = cli.Post("/v3/kv/put", body.dump(), "application/json");
  REQUIRE(r);
  REQUIRE(r->status == 200);
}

TEST_CASE("--state: sqlite paths and etcd URLs parse; bad ones are refused with the reason", "[etcd]") {
  auto p = ParseStateSpec("/var/lib/wsync/state.db");
  REQUIRE(p.ok());
  CHECK(p->kind == StateSpec::Kind::kSqlite);
  CHECK(p->path == "/var/lib/wsync/state.db");
  p = ParseStateSpec("sqlite:state.db");
  REQUIRE(p.ok());
  CHECK(p->path == "state.db");
  p = ParseStateSpec("etcd://10.0.0.1:2379, 10.0.0.2:2379/wsync/prod/");
  REQUIRE(p.ok());
  CHECK(p->kind == StateSpec::Kind::kEtcd);
  CHECK(p->endpoints == std::vector<std::string>{"10.0.0.1:2379", "10.0.0.2:2379"});
  CHECK(p->prefix == "wsync/prod");
  for (const char* bad : {"", "sqlite:", "etcd://h:2379", "etcd://h:2379/", "etcd:///p", "etcd://h/p",
                          "etcd://h:99999/p", "etcd://h:x/p"}) {
    INFO(bad);
    auto r = ParseStateSpec(bad);
    CHECK(absl::IsInvalidArgument(r.status()));
  }
}

TEST_CASE("etcd store: an unreachable etcd is Unavailable naming the endpoint", "[etcd]") {
  EtcdOptions o = Opts("x", "a:1");
  o.endpoints = {"127.0.0.1:1"};
  o.request_timeout = absl::Milliseconds(500);
  auto s = EtcdStateStore::Open(o);
  REQUIRE(absl::IsUnavailable(s.status()));
  CHECK(absl::StrContains(s.status().message(), "127.0.0.1:1"));
}

TEST_CASE("etcd store: one leader per prefix; only it writes; the others read its state and name it", "[etcd]") {
  const std::string prefix = Prefix("elect");
  auto a = OpenOrFail(Opts(prefix, "10.0.0.1:7600"));
  auto b = OpenOrFail(Opts(prefix, "10.0.0.2:7600"));
  CHECK(absl::IsNotFound(a->Load().status()));
  CHECK(absl::IsFailedPrecondition(a->Save(State(1, "n"))));  // nobody leads yet

  auto won = a->TryAcquire();
  REQUIRE(won.ok());
  CHECK(*won);
  won = b->TryAcquire();
  REQUIRE(won.ok());
  CHECK_FALSE(*won);
  CHECK(a->leader());
  CHECK_FALSE(b->leader());
  CHECK(b->LeaderAddress(true) == "10.0.0.1:7600");

  REQUIRE(a->Save(State(7, "train0")).ok());
  auto got = b->Load();
  REQUIRE(got.ok());
  CHECK(got->current_version() == 7);
  CHECK(got->nodes(0).node_id() == "train0");
  CHECK(absl::IsFailedPrecondition(b->Save(State(8, "evil"))));  // a standby may not write
  got = a->Load();
  REQUIRE(got.ok());
  CHECK(got->current_version() == 7);
}

TEST_CASE("etcd store: a deposed leader's write is refused (fencing) and it learns it lost", "[etcd]") {
  const std::string prefix = Prefix("fence");
  auto a = OpenOrFail(Opts(prefix, "old:1", /*ttl=*/1));
  auto b = OpenOrFail(Opts(prefix, "new:1", 1));
  REQUIRE(*a->TryAcquire());
  REQUIRE(a->Save(State(1, "n")).ok());
  // `a` stalls (no keepalive: a long GC pause, a frozen VM); its lease expires and `b` takes over.
  const absl::Time t0 = absl::Now();
  bool b_leads = false;
  while (!b_leads && absl::Now() - t0 < absl::Seconds(10)) {
    auto w = b->TryAcquire();
    INFO(w.status().ToString());
    REQUIRE(w.ok());
    b_leads = *w;
    if (!b_leads) absl::SleepFor(absl::Milliseconds(100));
  }
  REQUIRE(b_leads);
  CHECK(absl::Now() - t0 < absl::Seconds(4));  // TTL 1 s plus etcd's expiry granularity
  REQUIRE(b->Save(State(2, "n")).ok());

  // `a` wakes up, still believing it leads, and writes: refused; it notices and reports the loss once.
  std::atomic<int> lost{0};
  a->StartElection(nullptr, [&](const absl::Status&) { ++lost; });
  absl::Status st = a->Save(State(99, "stale"));
  CHECK(absl::IsFailedPrecondition(st));
  CHECK(absl::StrContains(st.message(), "another coordinator leads"));
  CHECK_FALSE(a->leader());
  CHECK(lost.load() == 1);
  auto got = b->Load();
  REQUIRE(got.ok());
  CHECK(got->current_version() == 2);  // the new leader's state, untouched
  CHECK(absl::IsFailedPrecondition(a->Save(State(100, "stale"))));
  CHECK(lost.load() == 1);
}

TEST_CASE("etcd store: election threads fail over on lease expiry and on resignation", "[etcd]") {
  const std::string prefix = Prefix("failover");
  auto a = OpenOrFail(Opts(prefix, "a:1", 1));
  auto b = OpenOrFail(Opts(prefix, "b:1", 1));
  std::atomic<int> a_elected{0}, b_elected{0}, a_lost{0};
  a->StartElection([&] { ++a_elected; }, [&](const absl::Status&) { ++a_lost; });
  const absl::Time t0 = absl::Now();
  while (a_elected.load() == 0 && absl::Now() - t0 < absl::Seconds(5)) absl::SleepFor(absl::Milliseconds(20));
  REQUIRE(a_elected.load() == 1);
  b->StartElection([&] { ++b_elected; }, nullptr);
  absl::SleepFor(absl::Seconds(2.5));  // several TTLs: a's keepalives hold it
  CHECK(b_elected.load() == 0);
  CHECK(a->leader());
  CHECK(b->LeaderAddress(true) == "a:1");

  // Resignation: b leads within a few campaign intervals, not a TTL.
  const absl::Time t1 = absl::Now();
  a->Resign();
  while (b_elected.load() == 0 && absl::Now() - t1 < absl::Seconds(5)) absl::SleepFor(absl::Milliseconds(10));
  const double handover = absl::ToDoubleSeconds(absl::Now() - t1);
  REQUIRE(b_elected.load() == 1);
  CHECK(handover < 1.0);
  CHECK(a_lost.load() == 0);  // resigning is not a loss
  CHECK(absl::IsFailedPrecondition(a->Save(State(5, "x"))));
  CHECK(b->Save(State(5, "x")).ok());

  // Expiry: c waits while b leads; b's process "dies" (the store is dropped without resigning).
  auto c = OpenOrFail(Opts(prefix, "c:1", 1));
  std::atomic<int> c_elected{0};
  c->StartElection([&] { ++c_elected; }, nullptr);
  absl::SleepFor(absl::Milliseconds(500));
  CHECK(c_elected.load() == 0);
  const absl::Time t2 = absl::Now();
  b.reset();
  while (c_elected.load() == 0 && absl::Now() - t2 < absl::Seconds(10)) absl::SleepFor(absl::Milliseconds(20));
  const double expiry = absl::ToDoubleSeconds(absl::Now() - t2);
  REQUIRE(c_elected.load() == 1);
  CHECK(expiry < 4.0);
  auto got = c->Load();
  REQUIRE(got.ok());
  CHECK(got->current_version() == 5);
  WARN("hand-over by resignation " << handover << " s, by lease expiry (TTL 1 s) " << expiry << " s");
}

TEST_CASE("etcd store: etcd's own refusal reaches the caller with its reason (a state over the request limit)",
          "[etcd]") {
  auto a = OpenOrFail(Opts(Prefix("large"), "a:1"));
  REQUIRE(*a->TryAcquire());
  v1::CoordinatorState big = State(1, "n");
  big.add_history()->set_error(std::string(2 << 20, 'x'));  // over etcd's default 1.5 MiB per request
  absl::Status st = a->Save(big);
  CHECK_FALSE(st.ok());
  INFO(st.ToString());
  CHECK(absl::IsResourceExhausted(st));
  CHECK(absl::StrContains(st.message(), "larger than max"));
  CHECK(a->leader());  // a refused write is not a lost leadership
  CHECK(a->Save(State(2, "n")).ok());
}

TEST_CASE("etcd store: a corrupt state is DataLoss, not an empty cluster", "[etcd]") {
  const std::string prefix = Prefix("corrupt");
  RawPut(prefix + "/state", std::string("\xff\xff\xff\xff", 4) + " not a proto");
  auto a = OpenOrFail(Opts(prefix, "a:1"));
  CHECK(absl::IsDataLoss(a->Load().status()));
}

}  // namespace
}  // namespace wsync::daemon
