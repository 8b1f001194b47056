#include "daemon/coordinator/etcd_store.h"

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
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
      state_key_(opts_.prefix + "/state") {}

absl::StatusOr<std::unique_ptr<EtcdStateStore>> EtcdStateStore::Open(EtcdOptions opts) {
  if (opts.endpoints.empty()) return absl::InvalidArgumentError("etcd state store: no endpoint");
  if (opts.prefix.empty()) return absl::InvalidArgumentError("etcd state store: empty key prefix");
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

absl::StatusOr<v1::CoordinatorState> EtcdStateStore::Load() {
  json req = {{"key", B64(state_key_)}};
  auto body = Post("/v3/kv/range", req.dump());
  if (!body.ok()) return body.status();
  auto j = Parse(*body, "range");
  if (!j.ok()) return j.status();
  if (!j->contains("kvs") || (*j)["kvs"].empty())
    return absl::NotFoundError(absl::StrCat("state store ", where_, " holds no state yet"));
  const json& kv = (*j)["kvs"][0];
  std::string bytes;
  if (!kv.contains("value") || !absl::Base64Unescape(kv["value"].get<std::string>(), &bytes)) bytes.clear();
  v1::CoordinatorState out;
  if (!out.ParseFromString(bytes))
    return absl::DataLossError(
        absl::StrCat("state store ", where_, ": the saved state (", bytes.size(), " bytes) is corrupt"));
  return out;
}

absl::Status EtcdStateStore::Save(const v1::CoordinatorState& state) {
  int64_t rev;
  {
    std::lock_guard<std::mutex> l(mu_);
    rev = leader_revision_;
  }
  if (!leader_.load() || rev == 0)
    return absl::FailedPreconditionError(
        absl::StrCat("state store ", where_, ": this coordinator is not the leader; it may not write the state"));
  json cmp = {
      {"key", B64(leader_key_)}, {"target", "CREATE"}, {"result", "EQUAL"}, {"create_revision", std::to_string(rev)}};
  json put = {{"request_put", {{"key", B64(state_key_)}, {"value", B64(state.SerializeAsString())}}}};
  json req = {{"compare", json::array({cmp})}, {"success", json::array({put})}, {"failure", json::array()}};
  auto body = Post("/v3/kv/txn", req.dump());
  if (!body.ok())
    return absl::Status(body.status().code(),
                        absl::StrCat("state store ", where_, ": saving the state: ", body.status().message()));
  auto j = Parse(*body, "txn");
  if (!j.ok()) return j.status();
  if (j->value("succeeded", false)) return absl::OkStatus();
  absl::Status fenced = absl::FailedPreconditionError(absl::StrCat(
      "state store ", where_, ": write refused: ", leader_key_, " is no longer the key this coordinator created (",
      "revision ", rev, "); another coordinator leads now"));
  Lost(fenced);
  return fenced;
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
    if (wait(ttl / 3)) return;
    absl::Status st = KeepAlive();
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
