
// The vLLM adapter against a recording fake of vLLM's HTTP API (engine-apis.md §2): what it sends, in which order,
// and how vLLM's failures come back. The fake checks every request by vLLM's own rules and lists what the real
// server would have rejected, so a malformed request fails the test even where the adapter shrugs it off.

#include "daemon/common/engines/vllm_adapter.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "tests/daemon/loopback_port.h"

namespace wsync::daemon {
namespace {

using nlohmann::json;
using Params = std::map<std::string, std::string>;

struct Recorded {
  std::string method;
  std::string path;
  Params params;
  json body;  // null when empty; the raw text when it is not JSON
};

// FastAPI parses query booleans with pydantic's lax rules.
std::optional<bool> QueryBool(const std::string& s) {
  if (s == "true" || s == "1" || s == "yes" || s == "on" || s == "True") return true;
  if (s == "false" || s == "0" || s == "no" || s == "off" || s == "False") return false;
  return std::nullopt;
}

// vLLM's global error handler: {"error":{"message","type","param","code"}}.
json VllmError(int code, const std::string& message) {
  return {{"error",
           {{"message", message},
            {"type", code == 400 ? "BadRequestError" : "InternalServerError"},
            {"param", nullptr},
            {"code", code}}}};
}

class FakeVllm {
 public:
  // Behaviour knobs; set them while no adapter call is in flight.
  int world_size = 4;
  bool dev_mode = true;           // false: the RL routes are not mounted (404), as without VLLM_SERVER_DEV_MODE=1
  int reset_false_answers = 0;    // /reset_prefix_cache answers {"success":false} this many times first
  std::string update_error;       // /update_weights raises this (HTTP 500, the session ends)
  std::string pause_error;        // /pause fails: HTTP 500 {"error":"Failed to pause generation: ..."}
  std::string resume_raw_answer;  // /resume answers HTTP 502 with this body, as a proxy in front of vLLM might
  bool keep_version = false;      // /update_weight_version says success but the version does not change
  absl::Duration pause_delay = absl::ZeroDuration();  // /pause answers after this long (or when the fake stops)

  FakeVllm() {
    Route("GET", "/get_world_size", [this](const Recorded& r, httplib::Response& res) {
      if (r.params.count("include_dp") && !QueryBool(r.params.at("include_dp"))) {
        return Reject(res, 400, VllmError(400, "include_dp: not a boolean"));
      }
      Answer(res, {{"world_size", world_size}});
    });
    Route("GET", "/weight_info", [this](const Recorded&, httplib::Response& res) {
      Answer(res, {{"weight_version", version_}});
    });
    Route("GET", "/is_paused", [this](const Recorded&, httplib::Response& res) {
      Answer(res, {{"is_paused", paused_}});
    });
    Route("POST", "/pause", [this](const Recorded& r, httplib::Response& res) {
      // Query parameters only; vLLM never reads a body here.
      const std::string mode = r.params.count("mode") ? r.params.at("mode") : "abort";
      if (mode != "abort" && mode != "wait" && mode != "keep") {
        return Reject(res, 400, {{"error", "Invalid mode '" + mode + "'. Must be one of: abort, wait, keep"}});
      }
      if (r.params.count("clear_cache") && !QueryBool(r.params.at("clear_cache"))) {
        return Reject(res, 400, VllmError(400, "clear_cache: Input should be a valid boolean"));
      }
      if (!pause_error.empty()) {
        return Answer(res, {{"error", "Failed to pause generation: " + pause_error}}, 500);
      }
      if (pause_delay > absl::ZeroDuration()) {
        std::unique_lock<std::mutex> l(sleep_mu_);
        sleep_cv_.wait_for(l, absl::ToChronoMicroseconds(pause_delay), [this] { return stopping_; });
      }
      paused_ = true;
      Answer(res, {{"status", "paused"}});
    });
    Route("POST", "/resume", [this](const Recorded&, httplib::Response& res) {
      if (!resume_raw_answer.empty()) {
        res.status = 502;
        res.set_content(resume_raw_answer, "text/html");
        return;
      }
      paused_ = false;
      Answer(res, {{"status", "resumed"}});
    });
    Route("POST", "/init_weight_transfer_engine", [this](const Recorded& r, httplib::Response& res) {
      if (!r.body.is_object() || !r.body.contains("init_info") || !r.body["init_info"].is_object()) {
        return Reject(res, 400, VllmError(400, "Missing 'init_info' in request body"));
      }
      Answer(res, {{"message", "Weight transfer initialized"}});
    });
    Route("POST", "/start_weight_update", [this](const Recorded&, httplib::Response& res) {
      if (update_active_) {
        return Reject(res, 500,
                      VllmError(500,
                                "start_weight_update called while a weight update is already "
                                "active. Call finish_weight_update first."));
      }
      update_active_ = true;
      Answer(res, {{"message", "Weight update started"}});
    });
    Route("POST", "/update_weights", [this](const Recorded& r, httplib::Response& res) {
      if (!r.body.is_object() || !r.body.contains("update_info") ||
          !(r.body["update_info"].is_object() || r.body["update_info"].is_array())) {
        return Reject(res, 400, VllmError(400, "Missing 'update_info' in request body"));
      }
      if (!update_active_) {
        return Reject(res, 500, VllmError(500, "start_weight_update must be called before update_weights."));
      }
      if (!update_error.empty()) {
        update_active_ = false;  // any exception ends vLLM's session
        return Answer(res, VllmError(500, update_error), 500);
      }
      Answer(res, {{"message", "Weights updated"}});
    });
    Route("POST", "/finish_weight_update", [this](const Recorded& r, httplib::Response& res) {
      if (!r.body.is_null() && !r.body.is_object()) return Reject(res, 400, VllmError(400, "body: not an object"));
      if (r.body.is_object() && r.body.contains("weight_version") && !r.body["weight_version"].is_string()) {
        return Reject(res, 400, VllmError(400, "weight_version: Input should be a valid string"));
      }
      update_active_ = false;
      if (r.body.is_object() && r.body.contains("weight_version")) version_ = r.body["weight_version"];
      Answer(res, {{"message", "Weight update finished"}});
    });
    Route("POST", "/update_weight_version", [this](const Recorded& r, httplib::Response& res) {
      if (!r.body.is_object() || !r.body.contains("new_version") || !r.body["new_version"].is_string()) {
        return Reject(res, 400, VllmError(400, "new_version: Field required"));
      }
      if (!keep_version) version_ = r.body["new_version"];
      Answer(res, {{"success", true}, {"new_version", r.body["new_version"]}});
    });
    Route("POST", "/reset_prefix_cache", [this](const Recorded& r, httplib::Response& res) {
      for (const char* key : {"reset_running_requests", "reset_external"}) {
        if (r.params.count(key) && !QueryBool(r.params.at(key))) {
          return Reject(res, 400, VllmError(400, std::string(key) + ": Input should be a valid boolean"));
        }
      }
      if (reset_false_answers > 0) {
        --reset_false_answers;
        return Answer(res, {{"success", false}});
      }
      Answer(res, {{"success", true}});
    });
    for (const char* verb : {"GET", "POST"}) {
      Route(verb, ".*", [this](const Recorded&, httplib::Response& res) {
        Reject(res, 404, {{"detail", "Not Found"}});
      });
    }
    port_ = server_.bind_to_any_port("127.0.0.1");
    REQUIRE(port_ > 0);
    thread_ = std::thread([this] { server_.listen_after_bind(); });
  }

  ~FakeVllm() {
    {
      std::lock_guard<std::mutex> l(sleep_mu_);
      stopping_ = true;
    }
    sleep_cv_.notify_all();
    server_.stop();
    thread_.join();
  }

  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  int port() const { return port_; }

  std::vector<Recorded> requests() {
    std::lock_guard<std::mutex> l(mu_);
    return requests_;
  }
  // "POST /pause" per request, in arrival order.
  std::vector<std::string> calls() {
    std::vector<std::string> out;
    for (const Recorded& r : requests()) out.push_back(r.method + " " + r.path);
    return out;
  }
  // What the real vLLM would have refused.
  std::vector<std::string> violations() {
    std::lock_guard<std::mutex> l(mu_);
    return violations_;
  }
  void Clear() {
    std::lock_guard<std::mutex> l(mu_);
    requests_.clear();
  }
  std::string version() {
    std::lock_guard<std::mutex> l(mu_);
    return version_;
  }
  bool paused() {
    std::lock_guard<std::mutex> l(mu_);
    return paused_;
  }
  bool update_active() {
    std::lock_guard<std::mutex> l(mu_);
    return update_active_;
  }
  void set_update_active(bool on) {
    std::lock_guard<std::mutex> l(mu_);
    update_active_ = on;
  }

 private:
  using Handler = std::function<void(const Recorded&, httplib::Response&)>;

  void Route(const std::string& verb, const std::string& path, Handler fn) {
    auto wrapped = [this, fn](const httplib::Request& req, httplib::Response& res) {
      Recorded r{req.method, req.path, {}, nullptr};
      for (const auto& [k, v] : req.params) r.params[k] = v;
      if (!req.body.empty()) {
        r.body = json::parse(req.body, nullptr, /*allow_exceptions=*/false);
        if (r.body.is_discarded()) r.body = req.body;
      }
      std::unique_lock<std::mutex> l(mu_);
      requests_.push_back(r);
      if (!dev_mode) return Reject(res, 404, {{"detail", "Not Found"}});
      if (!req.body.empty() && r.body.is_string()) {
        return Reject(res, 400, VllmError(400, "JSON decode error"));
      }
      fn(r, res);  // under mu_: the adapter sends one request at a time, and a sleeping /pause holds nothing else up
    };
    if (verb == "GET") {
      server_.Get(path, wrapped);
    } else {
      server_.Post(path, wrapped);
    }
  }

  void Answer(httplib::Response& res, const json& body, int status = 200) {
    res.status = status;
    res.set_content(body.dump(), "application/json");
  }
  void Reject(httplib::Response& res, int status, const json& body) {
    {
      std::lock_guard<std::mutex> l(violations_mu_);
      violations_.push_back(std::to_string(status) + " " + body.dump());
    }
    Answer(res, body, status);
  }

  httplib::Server server_;
  std::thread thread_;
  int port_ = -1;

  std::mutex mu_;
  std::vector<Recorded> requests_;
  std::string version_ = "default";
  bool paused_ = false;
  bool update_active_ = false;

  std::mutex violations_mu_;
  std::vector<std::string> violations_;

  std::mutex sleep_mu_;
  std::condition_variable sleep_cv_;
  bool stopping_ = false;
};

std::unique_ptr<EngineAdapter> MustMake(const std::string& url, absl::Duration timeout = absl::Seconds(10)) {
  auto a = MakeVllmAdapter(url, timeout);
  INFO(a.status().ToString());
  REQUIRE(a.ok());
  return std::move(a).value();
}

// Every error names the engine (id and address), the adapter method and the request.
void CheckNames(const absl::Status& s, const std::string& id, const std::string& address, const std::string& method,
                const std::string& request) {
  INFO(s.ToString());
  CHECK(absl::StrContains(s.message(), id));
  CHECK(absl::StrContains(s.message(), address));
  CHECK(absl::StrContains(s.message(), method + ": "));
  CHECK(absl::StrContains(s.message(), request));
}

TEST_CASE("vllm adapter: the full lifecycle sends what vLLM expects, in order", "[vllm]") {
  FakeVllm fake;
  const std::string url = fake.url() + "?mode=direct";
  auto a = MustMake(url);
  CHECK(a->kind() == "vllm");
  CHECK(a->address() == "vllm+" + url);

  auto d = a->Describe();
  INFO(d.status().ToString());
  REQUIRE(d.ok());
  CHECK(d->engine_id == "vllm-127.0.0.1-" + std::to_string(fake.port()));
  CHECK(d->kind == "vllm");
  CHECK(d->num_ranks == 4);
  CHECK(d->weight_version == "default");
  CHECK_FALSE(d->paused);
  CHECK(fake.calls() == std::vector<std::string>{"GET /get_world_size", "GET /weight_info", "GET /is_paused"});

  SECTION("attach: init_info carries the attach protocol's fields; the URL's mode unless the caller names one") {
    fake.Clear();
    REQUIRE(a->RequestAttach({"/run/wsync/target-7001.sock", "vllm-0", "00ff", ""}).ok());
    REQUIRE(a->RequestAttach({"/run/wsync/target-7001.sock", "", "00ff", "staged"}).ok());
    auto r = fake.requests();
    REQUIRE(r.size() == 2);
    CHECK(r[0].method == "POST");
    CHECK(r[0].path == "/init_weight_transfer_engine");
    CHECK(r[0].body == json{{"init_info",
                             {{"socket", "/run/wsync/target-7001.sock"},
                              {"engine_id", "vllm-0"},
                              {"token", "00ff"},
                              {"mode", "direct"},
                              {"protocol", 1}}}});
    CHECK(r[1].body["init_info"]["mode"] == "staged");
    CHECK(r[1].body["init_info"]["engine_id"] == d->engine_id);

    fake.Clear();
    auto bad = a->RequestAttach({"/run/wsync/t.sock", "vllm-0", "00ff", "zero-copy"});
    CHECK(bad.code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StrContains(bad.message(), "zero-copy"));
    CHECK(fake.requests().empty());

    auto plain = MustMake(fake.url());
    REQUIRE(plain->RequestAttach({"/s.sock", "e", "aa", ""}).ok());
    CHECK(fake.requests().back().body["init_info"]["mode"] == "staged");
  }

  SECTION("pause: each coordinator mode maps to vLLM's query parameters, never a body") {
    struct Case {
      std::string mode;
      Params params;
    };
    const std::vector<Case> cases = {
        {"", {{"mode", "keep"}, {"clear_cache", "true"}}},
        {"retract", {{"mode", "keep"}, {"clear_cache", "true"}}},
        {"in_place", {{"mode", "keep"}, {"clear_cache", "false"}}},
        {"abort", {{"mode", "abort"}, {"clear_cache", "false"}}},
    };
    for (const Case& c : cases) {
      fake.Clear();
      INFO("mode \"" << c.mode << "\"");
      auto s = a->Pause(c.mode);
      INFO(s.ToString());
      REQUIRE(s.ok());
      auto r = fake.requests();
      REQUIRE(r.size() == 1);
      CHECK(r[0].method == "POST");
      CHECK(r[0].path == "/pause");
      CHECK(r[0].params == c.params);
      CHECK(r[0].body.is_null());
      CHECK(fake.paused());
    }
    fake.Clear();
    auto bad = a->Pause("drain");
    CHECK(bad.code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StrContains(bad.message(), "drain"));
    CHECK(fake.requests().empty());
  }

  SECTION("post-process, version, continue") {
    REQUIRE(a->Pause("retract").ok());
    fake.Clear();
    auto pp = a->PostProcess("7");
    INFO(pp.ToString());
    REQUIRE(pp.ok());
    CHECK(fake.calls() ==
          std::vector<std::string>{"POST /start_weight_update", "POST /update_weights", "POST /finish_weight_update"});
    auto r = fake.requests();
    REQUIRE(r.size() == 3);
    CHECK(r[0].body.is_null());
    CHECK(r[1].body == json{{"update_info", {{"version", "7"}}}});
    CHECK(r[2].body == json{{"weight_version", "7"}});
    CHECK(fake.version() == "7");
    CHECK_FALSE(fake.update_active());

    fake.Clear();
    auto sv = a->SetWeightVersion("8");
    INFO(sv.ToString());
    REQUIRE(sv.ok());
    CHECK(fake.calls() == std::vector<std::string>{"POST /update_weight_version", "GET /weight_info"});
    CHECK(fake.requests()[0].body == json{{"new_version", "8"}});
    CHECK(fake.version() == "8");

    auto paused = a->Describe();
    REQUIRE(paused.ok());
    CHECK(paused->paused);
    CHECK(paused->weight_version == "8");

    fake.Clear();
    fake.reset_false_answers = 2;
    auto c = a->Continue();
    INFO(c.ToString());
    REQUIRE(c.ok());
    CHECK(fake.calls() == std::vector<std::string>{"POST /reset_prefix_cache", "POST /reset_prefix_cache",
                                                   "POST /reset_prefix_cache", "POST /resume"});
    for (const Recorded& q : fake.requests()) {
      if (q.path == "/reset_prefix_cache") CHECK(q.params == Params{{"reset_running_requests", "true"}});
    }
    CHECK_FALSE(fake.paused());
  }

  CHECK(fake.violations().empty());
}

TEST_CASE("vllm adapter: a failing update_weights comes back verbatim and finish is not called", "[vllm]") {
  FakeVllm fake;
  auto a = MustMake(fake.url() + "?id=vllm-a");
  REQUIRE(a->Pause("in_place").ok());
  fake.Clear();
  fake.update_error = "wsync backend: no commit for version 7 within 30 s (rank 1)";
  auto s = a->PostProcess("7");
  CHECK(s.code() == absl::StatusCode::kAborted);
  CheckNames(s, "vllm-a", "vllm+" + fake.url() + "?id=vllm-a", "PostProcess", "POST /update_weights");
  CHECK(absl::StrContains(s.message(), "HTTP 500: wsync backend: no commit for version 7 within 30 s (rank 1)"));
  CHECK(fake.calls() == std::vector<std::string>{"POST /start_weight_update", "POST /update_weights"});
  CHECK(fake.version() == "default");
  CHECK(fake.paused());

  // vLLM ended the session itself, so the next attempt starts cleanly.
  fake.update_error.clear();
  fake.Clear();
  auto again = a->PostProcess("7");
  INFO(again.ToString());
  CHECK(again.ok());
  CHECK(fake.version() == "7");
  CHECK(fake.violations().empty());
}

TEST_CASE("vllm adapter: vLLM's error bodies are surfaced", "[vllm]") {
  FakeVllm fake;
  auto a = MustMake(fake.url());
  const std::string id = "vllm-127.0.0.1-" + std::to_string(fake.port());
  const std::string address = "vllm+" + fake.url();

  SECTION("500 object shape: start_weight_update while a session is active") {
    fake.set_update_active(true);
    auto s = a->PostProcess("9");
    CHECK(s.code() == absl::StatusCode::kInternal);
    CheckNames(s, id, address, "PostProcess", "POST /start_weight_update");
    CHECK(absl::StrContains(s.message(),
                            "HTTP 500: start_weight_update called while a weight update is already "
                            "active. Call finish_weight_update first."));
    CHECK(fake.calls() == std::vector<std::string>{"POST /start_weight_update"});
    CHECK(fake.violations().size() == 1);  // the fake refused it, as vLLM does
  }
  SECTION("/pause's flat shape") {
    fake.pause_error = "EngineCore died";
    auto s = a->Pause("abort");
    CHECK(s.code() == absl::StatusCode::kInternal);
    CheckNames(s, id, address, "Pause", "POST /pause?mode=abort&clear_cache=false");
    CHECK(absl::StrContains(s.message(), "HTTP 500: Failed to pause generation: EngineCore died"));
    CHECK_FALSE(absl::StrContains(s.message(), "{\"error\""));  // the message, not the JSON around it
  }
  SECTION("an unknown shape comes back raw, cut at about 2 KiB") {
    fake.resume_raw_answer = "<html>bad gateway " + std::string(5000, 'x') + "</html>";
    auto s = a->Continue();
    CHECK(s.code() == absl::StatusCode::kInternal);
    CheckNames(s, id, address, "Continue", "POST /resume");
    CHECK(absl::StrContains(s.message(), "HTTP 502: <html>bad gateway xxxx"));
    CHECK(absl::StrContains(s.message(), "(5025 bytes in all)"));
    CHECK(s.message().size() < 2600);
  }
  SECTION("routes not mounted (no VLLM_SERVER_DEV_MODE=1) → FailedPrecondition") {
    fake.dev_mode = false;
    auto d = a->Describe();
    CHECK(d.status().code() == absl::StatusCode::kFailedPrecondition);
    CheckNames(d.status(), id, address, "Describe", "GET /get_world_size");
    CHECK(absl::StrContains(d.status().message(), "HTTP 404: Not Found"));
    CHECK(absl::StrContains(d.status().message(), "VLLM_SERVER_DEV_MODE=1"));
  }
  SECTION("a version that does not stick → FailedPrecondition saying what vLLM reads") {
    fake.keep_version = true;
    auto s = a->SetWeightVersion("12");
    CHECK(s.code() == absl::StatusCode::kFailedPrecondition);
    CheckNames(s, id, address, "SetWeightVersion", "GET /weight_info");
    CHECK(absl::StrContains(s.message(), "reads \"default\" after setting \"12\""));
    CHECK(fake.violations().empty());
  }
  SECTION("a prefix cache that never frees: bounded retries, then Unavailable and no resume") {
    REQUIRE(a->Pause("retract").ok());
    fake.Clear();
    fake.reset_false_answers = 1000;
    const absl::Time start = absl::Now();
    auto s = a->Continue();
    CHECK(absl::Now() - start < absl::Seconds(10));
    CHECK(s.code() == absl::StatusCode::kUnavailable);
    CheckNames(s, id, address, "Continue", "POST /reset_prefix_cache?reset_running_requests=true");
    auto calls = fake.calls();
    CHECK(calls.size() == 10);
    CHECK(std::find(calls.begin(), calls.end(), "POST /resume") == calls.end());
    CHECK(fake.paused());
    CHECK(fake.violations().empty());
  }
}

TEST_CASE("vllm adapter: an engine that never answers → DeadlineExceeded naming it", "[vllm]") {
  FakeVllm fake;
  fake.pause_delay = absl::Seconds(30);
  auto a = MustMake(fake.url() + "?id=stuck-engine", absl::Seconds(1));
  const absl::Time start = absl::Now();
  auto s = a->Pause("in_place");
  const absl::Duration took = absl::Now() - start;
  CHECK(s.code() == absl::StatusCode::kDeadlineExceeded);
  CheckNames(s, "stuck-engine", "vllm+" + fake.url() + "?id=stuck-engine", "Pause",
             "POST /pause?mode=keep&clear_cache=false");
  CHECK(absl::StrContains(s.message(), "no answer within 1 s"));
  CHECK(took >= absl::Milliseconds(900));
  CHECK(took < absl::Seconds(5));
}

TEST_CASE("vllm adapter: connection refused → Unavailable naming the engine", "[vllm]") {
  const std::string url = "http://127.0.0.1:" + std::to_string(testing::FreeLoopbackPort()) + "?id=gone";
  auto a = MustMake(url, absl::Seconds(2));
  auto d = a->Describe();
  CHECK(d.status().code() == absl::StatusCode::kUnavailable);
  CheckNames(d.status(), "gone", "vllm+" + url, "Describe", "GET /get_world_size");
  auto p = a->Pause("abort");
  CHECK(p.code() == absl::StatusCode::kUnavailable);
  CheckNames(p, "gone", "vllm+" + url, "Pause", "POST /pause");
}

TEST_CASE("vllm adapter: addresses", "[vllm]") {
  for (const std::string url : {"127.0.0.1:8000",
                                "grpc://127.0.0.1:8000",
                                "https://127.0.0.1:8000",
                                "http://127.0.0.1",
                                "http://:8000",
                                "http://127.0.0.1:0",
                                "http://127.0.0.1:70000",
                                "http://127.0.0.1:80a0",
                                "http://127.0.0.1:+80",
                                "http://127.0.0.1:8000/v1",
                                "http://127.0.0.1:8000?",
                                "http://127.0.0.1:8000?mode=fast",
                                "http://127.0.0.1:8000?bogus=1",
                                "http://127.0.0.1:8000?mode=staged&mode=direct",
                                "http://127.0.0.1:8000?id=",
                                "http://127.0.0.1:8000?id=a b",
                                "http://[::1:8000",
                                "http://::1:8000",
                                "http://user@127.0.0.1:8000",
                                "http://127.0.0.1:8000#x",
                                ""}) {
    INFO("url \"" << url << "\"");
    auto a = MakeVllmAdapter(url, absl::Seconds(5));
    INFO(a.status().ToString());
    CHECK(a.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StrContains(a.status().message(), "\"vllm+" + url + "\""));
  }
  CHECK(absl::StrContains(MakeVllmAdapter("http://h:1?bogus=1", absl::Seconds(5)).status().message(),
                          "unknown query key \"bogus\""));
  CHECK(
      absl::StrContains(MakeVllmAdapter("http://h:1?mode=fast", absl::Seconds(5)).status().message(), "mode \"fast\""));
  CHECK(MakeVllmAdapter("http://h:1", absl::ZeroDuration()).status().code() == absl::StatusCode::kInvalidArgument);

  for (const std::string url : {"http://127.0.0.1:8000", "http://127.0.0.1:8000/", "http://[::1]:8000?mode=direct",
                                "http://vllm-0.cluster.local:65535?id=vllm-0&mode=staged",
                                "http://127.0.0.1:8000?mode=adapter&id=policy-0"}) {
    INFO("url \"" << url << "\"");
    auto a = MakeVllmAdapter(url, absl::Seconds(5));
    INFO(a.status().ToString());
    REQUIRE(a.ok());
    CHECK((*a)->kind() == "vllm");
    CHECK((*a)->address() == "vllm+" + url);
  }
}

}  // namespace
}  // namespace wsync::daemon
