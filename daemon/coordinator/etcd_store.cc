#include "daemon/coordinator/etcd_store.h"

#include <algorithm>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/cli.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "spdlog/spdlog.h"

namespace wsync::daemon {
namespace {

using nlohmann::json;

std::string B64(const std::string& s) { return absl::Base64Escape(s); }

// The gateway writes int64 fields as JSON strings and leaves out zero values.
int64_t Int(const json& j, const char* field) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return 0;
  if (it->is_number_integer()) return it->get<int64_t>();
  int64_t v = 0;
  if (it->is_string() && absl::SimpleAtoi(it->get<std::string>(), &v)) return v;
  return 0;
}

absl::StatusOr<json> Parse(const std::string& body, const std::string& what) {
  json j = json::parse(body, nullptr, false);
  if (j.is_discarded() || !j.is_object())
    return absl::InternalError(absl::StrCat("etcd ", what, ": unreadable answer: ", body.substr(0, 200)));
  return j;
}

}  // namespace

EtcdStateStore::EtcdStateStore(EtcdOptions opts)
    : opts_(std::move(opts)),
      where_(absl::StrCat("etcd://", absl::StrJoin(opts_.endpoints, ","), "/", opts_.prefix)),
      leader_key_(opts_.prefix + "/leader"),
      objects_(where_, opts_.layout_part_bytes) {}

absl::StatusOr<std::unique_ptr<EtcdStateStore>> EtcdStateStore::Open(EtcdOptions opts) {
  if (opts.endpoints.empty()) return absl::InvalidArgumentError("etcd state store: no endpoint");
  if (opts.prefix.empty()) return absl::InvalidArgumentError("etcd state store: empty key prefix");
  if (opts.max_txn_ops < 3 || opts.max_txn_bytes < (64 << 10) || opts.layout_part_bytes < 1 || opts.range_page < 1)
    return absl::InvalidArgumentError("etcd state store: max_txn_ops >= 3, max_txn_bytes >= 64 KiB, parts >= 1 B");
  if (opts.lease_ttl_seconds < 1)
    return absl::InvalidArgumentError(absl::StrCat("etcd lease TTL ", opts.lease_ttl_seconds, " s is below 1 s"));
  std::unique_ptr<EtcdStateStore> s(new EtcdStateStore(std::move(opts)));
  // A count-only range: proves that some endpoint answers and speaks the v3 gateway.
  json req = {{"key", B64(s->leader_key_)}, {"count_only", true}};
  auto r = s->Post("/v3/kv/range", req.dump());
  if (!r.ok()) return r.status();
  return s;
}

EtcdStateStore::~EtcdStateStore() {
  {
    std::lock_guard<std::mutex> l(stop_mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

absl::StatusOr<std::string> EtcdStateStore::Post(const std::string& path, const std::string& body) {
  std::vector<std::string> errors;
  const size_t n = opts_.endpoints.size();
  const size_t first = endpoint_.load();
  for (size_t k = 0; k < n; ++k) {
    const size_t i = (first + k) % n;
    const std::string& ep = opts_.endpoints[i];
    const size_t colon = ep.rfind(':');
    httplib::Client cli(ep.substr(0, colon), std::stoi(ep.substr(colon + 1)));
    const auto t = absl::ToChronoMicroseconds(opts_.request_timeout);
    cli.set_connection_timeout(t);
    cli.set_read_timeout(t);
    cli.set_write_timeout(t);
    cli.set_keep_alive(false);
    // etcd's gateway ends an error answer's chunked body with HTTP trailers, which this HTTP client cannot parse:
    // the status and body are taken as they arrive, so that a failed read after them still leaves etcd's answer.
    int status = 0;
    std::string answer;
    httplib::Request req;
    req.method = "POST";
    req.path = path;
    req.body = body;
    req.set_header("Content-Type", "application/json");
    req.response_handler = [&status](const httplib::Response& r) {
      status = r.status;
      return true;
    };
    req.content_receiver = [&answer](const char* d, size_t len, uint64_t, uint64_t) {
      answer.append(d, len);
      return true;
    };
    httplib::Response res;
    httplib::Error err = httplib::Error::Success;
    const bool done = cli.send(req, res, err);
    if (!done && (status == 0 || answer.empty())) {
      errors.push_back(absl::StrCat(ep, ": ", httplib::to_string(err)));
      continue;
    }
    endpoint_.store(i);
    if (status == 200) return answer;  // a truncated answer fails to parse as JSON
    // An answer from etcd itself (bad request, lease not found, request too large): no other endpoint would differ.
    json j = json::parse(answer, nullptr, false);
    std::string msg = !j.is_discarded() && j.is_object() && j.contains("message") && j["message"].is_string()
                          ? j["message"].get<std::string>()
                          : answer.substr(0, 300);
    const int64_t code = j.is_discarded() || !j.is_object() ? 0 : Int(j, "code");
    const std::string text = absl::StrCat("etcd ", ep, " ", path, ": HTTP ", status, ": ", msg);
    if (code == 5) return absl::NotFoundError(text);
    if (code == 14 || status == 503) return absl::UnavailableError(text);
    if (code == 8 || status == 429) return absl::ResourceExhaustedError(text);  // over etcd's request size limit
    return absl::FailedPreconditionError(text);
  }
  return absl::UnavailableError(absl::StrCat("etcd ", path, ": no endpoint answered within ",
                                             absl::FormatDuration(opts_.request_timeout), " (",
                                             absl::StrJoin(errors, "; "), ")"));
}

absl::StatusOr<StateObjects> EtcdStateStore::ReadAll(int64_t revision, int64_t* root_revision) {
  const std::string base = opts_.prefix + "/";
  std::string range_end = base;
  range_end.back() = static_cast<char>(range_end.back() + 1);  // '/' + 1: every key under the prefix
  StateObjects out;
  *root_revision = 0;
  std::string from = base;
  while (true) {
    json req = {{"key", B64(from)}, {"range_end", B64(range_end)}, {"limit", std::to_string(opts_.range_page)}};
    if (revision > 0) req["revision"] = std::to_string(revision);
    auto body = Post("/v3/kv/range", req.dump());
    if (!body.ok())
      return absl::Status(body.status().code(),
                          absl::StrCat("state store ", where_, ": reading the state: ", body.status().message()));
    auto j = Parse(*body, "range");
    if (!j.ok()) return j.status();
    // The later pages read the revision of the first: one consistent view.
    if (revision == 0) revision = Int((*j)["header"], "revision");
    std::string last;
    if (j->contains("kvs"))
      for (const json& kv : (*j)["kvs"]) {
        std::string k, v;
        if (!absl::Base64Unescape(kv.value("key", std::string()), &k) ||
            (kv.contains("value") && !absl::Base64Unescape(kv["value"].get<std::string>(), &v)))
          return absl::DataLossError(absl::StrCat("state store ", where_, ": etcd answered an undecodable key"));
        last = k;
        std::string rel = k.substr(base.size());
        if (!IsStateKey(rel)) continue;
        if (rel == kRootKey) *root_revision = Int(kv, "mod_revision");
        out[std::move(rel)] = std::move(v);
      }
    if (!j->value("more", false) || last.empty()) break;
    from = last + std::string(1, '\0');
  }
  return out;
}

absl::StatusOr<v1::CoordinatorState> EtcdStateStore::Load() {
  std::lock_guard<std::mutex> l(save_mu_);
  int64_t root_revision = 0;
  auto all = ReadAll(0, &root_revision);
  if (!all.ok()) return all.status();
  objects_.SetStored(*all);  // what the next save diffs against: the latest keys, a broken save's included
  StateObjects view = *std::move(all);
  if (view.count(kSavingKey)) {
    // A save of several txns is under way or died part way: the last whole save is the one that wrote the root.
    if (root_revision == 0) {
      // No whole save of objects yet: what there is besides them is a schema 1 value being migrated, or nothing.
      StateObjects legacy;
      if (auto it = view.find(kLegacyStateKey); it != view.end()) legacy.insert(*it);
      view = std::move(legacy);
    } else {
      int64_t unused;
      auto at = ReadAll(root_revision, &unused);
      if (!at.ok())
        return absl::Status(at.status().code(),
                            absl::StrCat(at.status().message(), " (reading the last whole save, at revision ",
                                         root_revision, ", because ", opts_.prefix, "/saving shows one under way)"));
      view = *std::move(at);
    }
    spdlog::warn("state store {}: a save of several transactions did not finish; reading the last whole one{}", where_,
                 root_revision ? absl::StrCat(" (revision ", root_revision, ")") : std::string(" (none)"));
  }
  if (view.count(kRootKey) || !view.count(kLegacyStateKey)) return JoinState(view, where_);
  return ParseLegacyState(view.at(kLegacyStateKey), where_);
}

absl::Status EtcdStateStore::Txn(const std::vector<std::string>& ops, int64_t leader_revision) {
  json cmp = {{"key", B64(leader_key_)},
              {"target", "CREATE"},
              {"result", "EQUAL"},
              {"create_revision", std::to_string(leader_revision)}};
  // The ops are JSON already: joined by hand rather than parsed again.
  std::string body =
      absl::StrCat(R"({"compare":[)", cmp.dump(), R"(],"success":[)", absl::StrJoin(ops, ","), R"(],"failure":[]})");
  {
    std::lock_guard<std::mutex> l(stats_mu_);
    ++stats_.requests;
    stats_.max_request_bytes = std::max<uint64_t>(stats_.max_request_bytes, body.size());
    stats_.max_request_ops = std::max<int>(stats_.max_request_ops, static_cast<int>(ops.size()));
  }
  auto answer = Post("/v3/kv/txn", body);
  if (!answer.ok())
    return absl::Status(answer.status().code(),
                        absl::StrCat("state store ", where_, ": saving the state: ", answer.status().message()));
  auto j = Parse(*answer, "txn");
  if (!j.ok()) return j.status();
  if (j->value("succeeded", false)) return absl::OkStatus();
  absl::Status fenced = absl::FailedPreconditionError(absl::StrCat(
      "state store ", where_, ": write refused: ", leader_key_, " is no longer the key this coordinator created (",
      "revision ", leader_revision, "); another coordinator leads now"));
  Lost(fenced);
  return fenced;
}

absl::Status EtcdStateStore::SaveChanges(const v1::CoordinatorState& state, bool nodes_changed) {
  std::lock_guard<std::mutex> l(save_mu_);
  if (absl::Status st = objects_.UseNodes(state, nodes_changed); !st.ok()) return st;
  int64_t rev;
  {
    std::lock_guard<std::mutex> ml(mu_);
    rev = leader_revision_;
  }
  if (!leader_.load() || rev == 0)
    return absl::FailedPreconditionError(
        absl::StrCat("state store ", where_, ": this coordinator is not the leader; it may not write the state"));
  if (!objects_.stored_known()) {
    int64_t unused;
    auto all = ReadAll(0, &unused);
    if (!all.ok()) return all.status();
    objects_.SetStored(*all);
  }
  auto diff = objects_.Prepare(state, cli::VersionString("wsync-coordinator"));
  if (!diff.ok()) return diff.status();
  if (diff->empty()) return absl::OkStatus();
  const bool had_marker = objects_.stored_has(kSavingKey);

  // Ops in write order: layout parts, other objects, deletes, the root last (in the last txn).
  std::vector<std::string> ops;
  ops.reserve(diff->puts.size() + diff->deletes.size());
  const std::string base = opts_.prefix + "/";
  auto put = [&](const std::string& k, const std::string& v) {
    return json{{"request_put", {{"key", B64(base + k)}, {"value", B64(v)}}}}.dump();
  };
  auto del = [&](const std::string& k) { return json{{"request_delete_range", {{"key", B64(base + k)}}}}.dump(); };
  for (size_t i = 0; i + 1 < diff->puts.size(); ++i) ops.push_back(put(diff->puts[i].first, diff->puts[i].second));
  for (const auto& k : diff->deletes) ops.push_back(del(k));
  ops.push_back(put(diff->puts.back().first, diff->puts.back().second));  // the root

  // Greedy packing; two ops of every txn are kept for the saving marker's put and delete.
  std::vector<std::vector<std::string>> txns(1);
  size_t bytes = 0;
  constexpr size_t kOverhead = 512;  // compare, brackets, the marker's ops
  for (auto& op : ops) {
    if (!txns.back().empty() && (static_cast<int>(txns.back().size()) + 2 >= opts_.max_txn_ops ||
                                 bytes + op.size() + 1 + kOverhead > opts_.max_txn_bytes)) {
      txns.emplace_back();
      bytes = 0;
    }
    bytes += op.size() + 1;
    txns.back().push_back(std::move(op));
  }
  if (txns.size() > 1) {
    txns.front().insert(txns.front().begin(), put(kSavingKey, std::to_string(diff->generation)));
    txns.back().push_back(del(kSavingKey));
  } else if (had_marker) {
    txns.back().push_back(del(kSavingKey));
  }
  for (const auto& t : txns) {
    if (absl::Status st = Txn(t, rev); !st.ok()) {
      objects_.ForgetStored();  // some txns may have applied (or this one, unanswered): read before the next save
      return st;
    }
  }
  objects_.Written(*diff);
  std::lock_guard<std::mutex> sl(stats_mu_);
  ++stats_.saves;
  stats_.bytes_written += diff->bytes;
  stats_.last_save_bytes = diff->bytes;
  return absl::OkStatus();
}

StateStoreStats EtcdStateStore::stats() const {
  std::lock_guard<std::mutex> l(stats_mu_);
  return stats_;
}

absl::StatusOr<bool> EtcdStateStore::TryAcquire() {
  if (leader_.load()) return true;
  int64_t lease;
  {
    std::lock_guard<std::mutex> l(mu_);
    lease = lease_id_;
  }
  if (lease == 0) {
    const absl::Time sent = absl::Now();
    json req = {{"TTL", std::to_string(static_cast<int64_t>(opts_.lease_ttl_seconds))}};
    auto body = Post("/v3/lease/grant", req.dump());
    if (!body.ok()) return body.status();
    auto j = Parse(*body, "lease grant");
    if (!j.ok()) return j.status();
    lease = Int(*j, "ID");
    if (lease == 0) return absl::InternalError(absl::StrCat("etcd lease grant: no lease ID in ", *body));
    std::lock_guard<std::mutex> l(mu_);
    lease_id_ = lease;
    lease_sent_ = sent;
  }
  json cmp = {{"key", B64(leader_key_)}, {"target", "CREATE"}, {"result", "EQUAL"}, {"create_revision", "0"}};
  json put = {
      {"request_put", {{"key", B64(leader_key_)}, {"value", B64(opts_.advertise)}, {"lease", std::to_string(lease)}}}};
  json get = {{"request_range", {{"key", B64(leader_key_)}}}};
  json req = {{"compare", json::array({cmp})}, {"success", json::array({put})}, {"failure", json::array({get})}};
  auto body = Post("/v3/kv/txn", req.dump());
  if (absl::IsNotFound(body.status())) {  // our lease expired meanwhile: grant a new one next time
    std::lock_guard<std::mutex> l(mu_);
    lease_id_ = 0;
    return false;
  }
  if (!body.ok()) return body.status();
  auto j = Parse(*body, "txn");
  if (!j.ok()) return j.status();
  std::lock_guard<std::mutex> l(mu_);
  if (j->value("succeeded", false)) {
    // The put's revision is the transaction's: the leader key's create_revision, which fences every Save.
    leader_revision_ = Int((*j)["header"], "revision");
    leader_address_ = opts_.advertise;
    leader_.store(true);
    return true;
  }
  leader_address_.clear();
  if (j->contains("responses") && !(*j)["responses"].empty()) {
    const json& rr = (*j)["responses"][0]["response_range"];
    if (rr.contains("kvs") && !rr["kvs"].empty()) {
      std::string v;
      if (absl::Base64Unescape(rr["kvs"][0].value("value", std::string()), &v)) leader_address_ = v;
    }
  }
  return false;
}

absl::Status EtcdStateStore::KeepAlive() {
  int64_t lease;
  {
    std::lock_guard<std::mutex> l(mu_);
    lease = lease_id_;
  }
  if (lease == 0) return absl::FailedPreconditionError("no lease to keep alive");
  const absl::Time sent = absl::Now();
  json req = {{"ID", std::to_string(lease)}};
  auto body = Post("/v3/lease/keepalive", req.dump());
  if (!body.ok()) return body.status();
  // A stream of {"result": LeaseKeepAliveResponse} lines; one request, one line.
  auto j = Parse(body->substr(0, body->find('\n')), "lease keepalive");
  if (!j.ok()) return j.status();
  const json& r = j->contains("result") ? (*j)["result"] : *j;
  if (Int(r, "TTL") <= 0) {
    std::lock_guard<std::mutex> l(mu_);
    lease_id_ = 0;
    return absl::FailedPreconditionError(absl::StrCat("etcd lease ", lease, " has expired"));
  }
  std::lock_guard<std::mutex> l(mu_);
  lease_sent_ = sent;
  return absl::OkStatus();
}

std::string EtcdStateStore::LeaderAddress(bool refresh) {
  if (refresh) {
    json req = {{"key", B64(leader_key_)}};
    auto body = Post("/v3/kv/range", req.dump());
    if (body.ok()) {
      auto j = Parse(*body, "range");
      std::string v;
      if (j.ok() && j->contains("kvs") && !(*j)["kvs"].empty())
        absl::Base64Unescape((*j)["kvs"][0].value("value", std::string()), &v);
      std::lock_guard<std::mutex> l(mu_);
      leader_address_ = v;
    }
  }
  std::lock_guard<std::mutex> l(mu_);
  return leader_address_;
}

void EtcdStateStore::Lost(const absl::Status& why) {
  leader_.store(false);
  if (lost_.exchange(true)) return;
  spdlog::error("leadership lost: {}", why.ToString());
  if (on_lost_) on_lost_(why);
}

void EtcdStateStore::StartElection(std::function<void()> on_elected, std::function<void(const absl::Status&)> on_lost) {
  on_elected_ = std::move(on_elected);
  on_lost_ = std::move(on_lost);
  thread_ = std::thread([this] { ElectionLoop(); });
}

void EtcdStateStore::ElectionLoop() {
  const absl::Duration ttl = absl::Seconds(opts_.lease_ttl_seconds);
  absl::Time last_keepalive = absl::Now();
  bool logged_standby = false;
  std::string last_error;  // a campaign error is logged when it changes, not every interval
  bool renew_failed = false;
  auto wait = [this](absl::Duration d) {
    std::unique_lock<std::mutex> l(stop_mu_);
    return stop_cv_.wait_for(l, absl::ToChronoMilliseconds(d), [this] { return stop_; });
  };
  while (!lost_.load()) {
    if (!leader_.load()) {
      auto won = TryAcquire();
      if (won.ok() && *won) {
        last_keepalive = absl::Now();
        spdlog::info("elected leader at {} (lease TTL {} s, key revision {})", where_, opts_.lease_ttl_seconds,
                     leader_revision_);
        if (on_elected_) on_elected_();
        continue;
      }
      if (!won.ok()) {
        if (won.status().ToString() != last_error) spdlog::warn("campaign at {}: {}", where_, won.status().ToString());
        last_error = won.status().ToString();
      } else if (!logged_standby) {
        spdlog::info("standing by: the leader is {}", LeaderAddress(false));
        logged_standby = true;
      }
      // A standby keeps its lease alive too, so that it can take over without a grant.
      if (absl::Now() - last_keepalive >= ttl / 3) {
        if (KeepAlive().ok()) last_keepalive = absl::Now();
      }
      if (wait(opts_.campaign_interval)) return;
      continue;
    }
    // A renewal that failed (an endpoint stopped, etcd electing a raft leader) is retried every campaign_interval,
    // not a third of the TTL later: with the first try lost to a stopped member's request timeout, waiting the
    // usual interval again left too little of the TTL, and the leader stepped down although etcd would have
    // renewed (daemon_etcd_raft_stop_test failed so, 1 run in 2 on a loaded machine).
    if (wait(renew_failed ? opts_.campaign_interval : ttl / 3)) return;
    absl::Status st = KeepAlive();
    renew_failed = !st.ok();
    if (absl::IsFailedPrecondition(st)) {
      Lost(st);
      return;
    }
    absl::Time sent;
    {
      std::lock_guard<std::mutex> l(mu_);
      sent = lease_sent_;
    }
    // Step down before etcd can have expired the lease: it counts from when it got the last renewal, which was sent
    // at `sent` or later.
    if (!st.ok() && absl::Now() - sent >= ttl - absl::Milliseconds(500)) {
      Lost(absl::UnavailableError(absl::StrCat("the lease was not renewed for ",
                                               absl::FormatDuration(absl::Now() - sent), " (TTL ",
                                               opts_.lease_ttl_seconds, " s): ", st.ToString())));
      return;
    }
    if (!st.ok()) spdlog::warn("lease keepalive: {}", st.ToString());
  }
}

void EtcdStateStore::Resign() {
  {
    std::lock_guard<std::mutex> l(stop_mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  int64_t lease, rev;
  {
    std::lock_guard<std::mutex> l(mu_);
    lease = lease_id_;
    rev = leader_revision_;
  }
  const bool was_leader = leader_.exchange(false);
  lost_.store(true);  // a later Save is refused, not reported as a loss
  if (was_leader && rev != 0) {
    json cmp = {
        {"key", B64(leader_key_)}, {"target", "CREATE"}, {"result", "EQUAL"}, {"create_revision", std::to_string(rev)}};
    json del = {{"request_delete_range", {{"key", B64(leader_key_)}}}};
    json req = {{"compare", json::array({cmp})}, {"success", json::array({del})}, {"failure", json::array()}};
    if (auto r = Post("/v3/kv/txn", req.dump()); !r.ok()) spdlog::warn("resigning: {}", r.status().ToString());
  }
  if (lease != 0) {
    json req = {{"ID", std::to_string(lease)}};
    (void)Post("/v3/lease/revoke", req.dump());
  }
  if (was_leader) spdlog::info("resigned the leadership at {}", where_);
}

}  // namespace wsync::daemon
