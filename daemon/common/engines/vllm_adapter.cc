// The vLLM EngineAdapter: each step is one or a few requests to vLLM's HTTP API (engine-apis.md §2).
#include "daemon/common/engines/vllm_adapter.h"

#include <algorithm>
#include <chrono>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "base/status.h"
#include "daemon/common/engines/http_exchange.h"
#include "nlohmann/json.hpp"
#include "spdlog/spdlog.h"

namespace wsync::daemon {
namespace {

using nlohmann::json;

// vLLM's own trainer-side client waits 300 s for these: the engine loads, post-processes and repacks in them.
constexpr absl::Duration kPostProcessMinTimeout = absl::Seconds(300);
// /reset_prefix_cache answers {"success":false} while blocks are still held (requests being preempted).
constexpr int kResetAttempts = 10;
constexpr absl::Duration kResetRetryDelay = absl::Milliseconds(200);
constexpr size_t kMaxBodyInError = 2048;
constexpr int kAttachProtocol = 1;  // docs/engines.md, "The attach protocol", version 1

std::string Seconds(absl::Duration d) { return absl::StrCat(absl::ToDoubleSeconds(d), " s"); }

std::string Truncated(absl::string_view s) {
  if (s.size() <= kMaxBodyInError) return std::string(s);
  return absl::StrCat(s.substr(0, kMaxBodyInError), "… (", s.size(), " bytes in all)");
}

// vLLM's error message when the body has one of its known shapes, else the raw body; both cut at 2 KiB.
std::string ErrorText(const std::string& body) {
  if (body.empty()) return "(empty body)";
  json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_object()) {
    auto err = j.find("error");
    if (err != j.end()) {
      // The global handler: {"error":{"message","type","param","code"}}.
      if (err->is_object()) {
        auto msg = err->find("message");
        if (msg != err->end() && msg->is_string()) return Truncated(msg->get<std::string>());
      }
      // /pause handles its own errors: {"error":"<msg>"}.
      if (err->is_string()) return Truncated(err->get<std::string>());
    }
    // FastAPI's own answers (unknown route, wrong method): {"detail":"Not Found"}.
    auto detail = j.find("detail");
    if (detail != j.end() && detail->is_string()) return Truncated(detail->get<std::string>());
  }
  return Truncated(body);
}

const json* Member(const json& j, const char* key) {
  if (!j.is_object()) return nullptr;
  auto it = j.find(key);
  return it == j.end() ? nullptr : &*it;
}

struct ParsedUrl {
  std::string host;
  int port = 0;
  std::string mode;  // "" = not given
  std::string id;    // "" = not given
};

// The wsync backend's attach modes (client/vllm/wsync_vllm/backend.py): staged and direct hold the model's weights,
// adapter the engine's LoRA adapter alone (docs/engines.md, "LoRA adapters").
bool IsAttachMode(absl::string_view m) { return m == "staged" || m == "direct" || m == "adapter"; }

absl::Status BadAddress(const std::string& url, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("invalid vLLM engine address \"vllm+", url, "\": ", why,
                                                 " (expected vllm+http://HOST:PORT[?mode=staged|direct|adapter&id=ID])"));
}

bool IsIdChar(char c) { return absl::ascii_isalnum(c) || c == '.' || c == '-' || c == '_' || c == ':'; }

absl::StatusOr<ParsedUrl> ParseUrl(const std::string& url) {
  absl::string_view rest = url;
  if (absl::StartsWith(rest, "https://")) {
    return BadAddress(url, "https is not supported; vLLM's control API is reached over plain http");
  }
  if (!absl::ConsumePrefix(&rest, "http://")) return BadAddress(url, "the scheme must be http://");
  if (rest.find('#') != absl::string_view::npos) return BadAddress(url, "a fragment (#) is not allowed");
  absl::string_view query;
  bool has_query = false;
  if (size_t q = rest.find('?'); q != absl::string_view::npos) {
    query = rest.substr(q + 1);
    rest = rest.substr(0, q);
    has_query = true;
  }
  if (size_t slash = rest.find('/'); slash != absl::string_view::npos) {
    if (rest.substr(slash) != "/") return BadAddress(url, "a path is not allowed (vLLM serves its API at /)");
    rest = rest.substr(0, slash);
  }
  if (rest.find('@') != absl::string_view::npos) return BadAddress(url, "user information is not allowed");

  ParsedUrl out;
  absl::string_view port;
  if (absl::ConsumePrefix(&rest, "[")) {
    size_t close = rest.find(']');
    if (close == absl::string_view::npos) return BadAddress(url, "unterminated [IPv6] host");
    out.host = std::string(rest.substr(0, close));
    rest = rest.substr(close + 1);
    if (!absl::ConsumePrefix(&rest, ":")) return BadAddress(url, "missing :PORT");
    port = rest;
    if (!std::all_of(out.host.begin(), out.host.end(),
                     [](char c) { return absl::ascii_isxdigit(c) || c == ':' || c == '.'; })) {
      return BadAddress(url, "bad IPv6 host");
    }
  } else {
    size_t colon = rest.rfind(':');
    if (colon == absl::string_view::npos) return BadAddress(url, "missing :PORT");
    out.host = std::string(rest.substr(0, colon));
    port = rest.substr(colon + 1);
    if (!std::all_of(out.host.begin(), out.host.end(),
                     [](char c) { return absl::ascii_isalnum(c) || c == '.' || c == '-' || c == '_'; })) {
      return BadAddress(url, "bad host (IPv6 literals go in brackets)");
    }
  }
  if (out.host.empty()) return BadAddress(url, "missing HOST");
  if (port.empty() || port.size() > 5 || !std::all_of(port.begin(), port.end(), absl::ascii_isdigit)) {
    return BadAddress(url, "PORT must be a number from 1 to 65535");
  }
  out.port = std::stoi(std::string(port));
  if (out.port < 1 || out.port > 65535) return BadAddress(url, "PORT must be a number from 1 to 65535");

  if (has_query) {
    if (query.empty()) return BadAddress(url, "empty query after ?");
    std::set<std::string> seen;
    for (absl::string_view part : absl::StrSplit(query, '&')) {
      std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(part, absl::MaxSplits('=', 1));
      std::string key(kv.first), value(kv.second);
      if (key != "mode" && key != "id") {
        return BadAddress(url, absl::StrCat("unknown query key \"", key, "\" (known: mode, id)"));
      }
      if (!seen.insert(key).second) return BadAddress(url, absl::StrCat("query key \"", key, "\" given twice"));
      if (value.empty()) return BadAddress(url, absl::StrCat("query key \"", key, "\" needs a value"));
      if (key == "mode") {
        if (!IsAttachMode(value)) {
          return BadAddress(url, absl::StrCat("mode \"", value, "\" is not staged, direct or adapter"));
        }
        out.mode = value;
      } else {
        if (!std::all_of(value.begin(), value.end(), IsIdChar)) {
          return BadAddress(url, absl::StrCat("id \"", value, "\" may hold only letters, digits and . - _ :"));
        }
        out.id = value;
      }
    }
  }
  return out;
}

class VllmAdapter final : public EngineAdapter {
 public:
  VllmAdapter(ParsedUrl url, std::string address, absl::Duration call_timeout)
      : host_(std::move(url.host)),
        port_(url.port),
        url_mode_(std::move(url.mode)),
        id_(url.id.empty() ? absl::StrCat("vllm-", host_, "-", port_) : std::move(url.id)),
        address_(std::move(address)),
        call_timeout_(call_timeout),
        post_process_timeout_(std::max(call_timeout, kPostProcessMinTimeout)) {}

  const std::string& kind() const override { return kind_; }
  const std::string& address() const override { return address_; }

  absl::StatusOr<EngineDescription> Describe() override {
    EngineDescription d;
    d.engine_id = id_;
    d.kind = kind_;
    {
      WSYNC_ASSIGN_OR_RETURN(json a, Call("Describe", "GET", "/get_world_size", nullptr, call_timeout_));
      const json* n = Member(a, "world_size");
      if (n == nullptr || !n->is_number_integer() || n->get<int64_t>() < 1) {
        return Unexpected("Describe", "GET", "/get_world_size", a, "no positive integer \"world_size\"");
      }
      d.num_ranks = n->get<int>();
    }
    {
      WSYNC_ASSIGN_OR_RETURN(json a, Call("Describe", "GET", "/weight_info", nullptr, call_timeout_));
      const json* v = Member(a, "weight_version");
      if (v == nullptr || !v->is_string()) {
        return Unexpected("Describe", "GET", "/weight_info", a, "no string \"weight_version\"");
      }
      d.weight_version = v->get<std::string>();
    }
    {
      WSYNC_ASSIGN_OR_RETURN(json a, Call("Describe", "GET", "/is_paused", nullptr, call_timeout_));
      const json* p = Member(a, "is_paused");
      if (p == nullptr || !p->is_boolean()) {
        return Unexpected("Describe", "GET", "/is_paused", a, "no boolean \"is_paused\"");
      }
      d.paused = p->get<bool>();
    }
    return d;
  }

  absl::Status RequestAttach(const AttachInfo& info) override {
    const std::string mode = !info.mode.empty() ? info.mode : !url_mode_.empty() ? url_mode_ : "staged";
    if (!IsAttachMode(mode)) {
      return absl::InvalidArgumentError(
          absl::StrCat(Who(), ": RequestAttach: mode \"", mode, "\" is not staged, direct or adapter"));
    }
    if (info.socket_path.empty() || info.token.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(Who(), ": RequestAttach: the socket path and token are required"));
    }
    const std::string engine_id = info.engine_id.empty() ? id_ : info.engine_id;
    spdlog::info("{}: asking every rank to attach to {} (mode {}, engine id {})", Who(), info.socket_path, mode,
                 engine_id);
    json body = {{"init_info",
                  {{"socket", info.socket_path},
                   {"engine_id", engine_id},
                   {"token", info.token},
                   {"mode", mode},
                   {"protocol", kAttachProtocol}}}};
    WSYNC_ASSIGN_OR_RETURN(json a, Call("RequestAttach", "POST", "/init_weight_transfer_engine", &body, call_timeout_));
    (void)a;  // {"message":"Weight transfer initialized"}; the status says it all
    spdlog::info("{}: vLLM accepted the attach request", Who());
    return absl::OkStatus();
  }

  absl::Status Pause(const std::string& mode) override {
    const std::string m = mode.empty() ? "retract" : mode;
    std::string path;
    if (m == "abort") {
      path = "/pause?mode=abort&clear_cache=false";
    } else if (m == "retract") {
      // vLLM's keep + clear_cache resets the prefix cache with reset_running_requests=True, which preempts running
      // requests back to the waiting queue (engine-apis.md §2.3) — SGLang's retract.
      path = "/pause?mode=keep&clear_cache=true";
    } else if (m == "in_place") {
      path = "/pause?mode=keep&clear_cache=false";
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(Who(), ": Pause: unknown mode \"", mode, "\" (abort | retract | in_place)"));
    }
    spdlog::info("{}: pausing ({})", Who(), m);
    WSYNC_ASSIGN_OR_RETURN(json a, Call("Pause", "POST", path, nullptr, call_timeout_));
    const json* status = Member(a, "status");
    if (status == nullptr || *status != "paused") {
      return Unexpected("Pause", "POST", path, a, "not {\"status\":\"paused\"}");
    }
    spdlog::info("{}: paused ({})", Who(), m);
    return absl::OkStatus();
  }

  absl::Status PostProcess(const std::string& version) override {
    if (version.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(Who(), ": PostProcess: empty version"));
    }
    spdlog::info("{}: post-processing update {}", Who(), version);
    WSYNC_ASSIGN_OR_RETURN(json started, Call("PostProcess", "POST", "/start_weight_update", nullptr, call_timeout_));
    (void)started;
    json update = {{"update_info", {{"version", version}}}};
    absl::StatusOr<json> updated =
        Call("PostProcess", "POST", "/update_weights", &update, post_process_timeout_, absl::StatusCode::kAborted);
    if (!updated.ok()) {
      // vLLM ends the update session on any failure inside update_weights; finishing would run the finalize step on
      // a half-loaded model. The engine stays paused for the coordinator to decide.
      return Annotate(updated.status(), "update not finished, the engine stays paused");
    }
    json finish = {{"weight_version", version}};
    WSYNC_ASSIGN_OR_RETURN(json finished,
                           Call("PostProcess", "POST", "/finish_weight_update", &finish, post_process_timeout_));
    (void)finished;
    spdlog::info("{}: post-processed update {} (weight version now {})", Who(), version, version);
    return absl::OkStatus();
  }

  absl::Status SetWeightVersion(const std::string& version) override {
    if (version.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(Who(), ": SetWeightVersion: empty version"));
    }
    json body = {{"new_version", version}};
    WSYNC_ASSIGN_OR_RETURN(json a, Call("SetWeightVersion", "POST", "/update_weight_version", &body, call_timeout_));
    if (const json* ok = Member(a, "success"); ok != nullptr && *ok == false) {
      return absl::FailedPreconditionError(absl::StrCat(
          Who(), ": SetWeightVersion: POST /update_weight_version: ", "vLLM answered ", Truncated(a.dump())));
    }
    WSYNC_ASSIGN_OR_RETURN(json info, Call("SetWeightVersion", "GET", "/weight_info", nullptr, call_timeout_));
    const json* v = Member(info, "weight_version");
    if (v == nullptr || !v->is_string()) {
      return Unexpected("SetWeightVersion", "GET", "/weight_info", info, "no string \"weight_version\"");
    }
    if (v->get<std::string>() != version) {
      return absl::FailedPreconditionError(absl::StrCat(Who(), ": SetWeightVersion: GET /weight_info reads \"",
                                                        v->get<std::string>(), "\" after setting \"", version, "\""));
    }
    spdlog::info("{}: weight version set to {}", Who(), version);
    return absl::OkStatus();
  }

  absl::Status Continue() override {
    static const std::string kReset = "/reset_prefix_cache?reset_running_requests=true";
    spdlog::info("{}: resetting the prefix cache and resuming", Who());
    bool reset = false;
    for (int attempt = 1; attempt <= kResetAttempts && !reset; ++attempt) {
      WSYNC_ASSIGN_OR_RETURN(json a, Call("Continue", "POST", kReset, nullptr, call_timeout_));
      const json* ok = Member(a, "success");
      if (ok == nullptr || !ok->is_boolean()) {
        return Unexpected("Continue", "POST", kReset, a, "no boolean \"success\"");
      }
      reset = ok->get<bool>();
      if (!reset && attempt < kResetAttempts) {
        spdlog::debug("{}: the prefix cache is still in use (attempt {} of {}), retrying", Who(), attempt,
                      kResetAttempts);
        std::this_thread::sleep_for(absl::ToChronoMicroseconds(kResetRetryDelay));
      }
    }
    if (!reset) {
      return absl::UnavailableError(absl::StrCat(
          Who(), ": Continue: POST ", kReset, ": vLLM answered {\"success\":false} ", kResetAttempts, " times, ",
          Seconds(kResetRetryDelay), " apart (KV blocks still held); /resume not called, the engine stays paused"));
    }
    WSYNC_ASSIGN_OR_RETURN(json a, Call("Continue", "POST", "/resume", nullptr, call_timeout_));
    const json* status = Member(a, "status");
    if (status == nullptr || *status != "resumed") {
      return Unexpected("Continue", "POST", "/resume", a, "not {\"status\":\"resumed\"}");
    }
    spdlog::info("{}: resumed", Who());
    return absl::OkStatus();
  }

 private:
  std::string Who() const { return absl::StrCat("vLLM engine ", id_, " (", address_, ")"); }

  std::string Where(absl::string_view method, absl::string_view verb, absl::string_view path) const {
    return absl::StrCat(Who(), ": ", method, ": ", verb, " ", path);
  }

  absl::Status Unexpected(absl::string_view method, absl::string_view verb, absl::string_view path, const json& answer,
                          absl::string_view what) const {
    return absl::InternalError(absl::StrCat(Where(method, verb, path), ": vLLM answered HTTP 200 but ", what, ": ",
                                            Truncated(answer.is_null() ? "(empty body)" : answer.dump())));
  }

  // One HTTP exchange on a fresh connection. Returns the JSON body of a 2xx answer (null when empty), or an error
  // naming the engine, `method` and the request; `server_error` is the code for a 5xx answer.
  absl::StatusOr<json> Call(absl::string_view method, absl::string_view verb, const std::string& path, const json* body,
                            absl::Duration timeout, absl::StatusCode server_error = absl::StatusCode::kInternal) {
    const std::string where = Where(method, verb, path);
    std::optional<std::string> payload;
    if (verb != "GET") payload = body != nullptr ? body->dump() : std::string();
    WSYNC_ASSIGN_OR_RETURN(HttpAnswer answer, HttpExchange(host_, port_, path, payload, timeout, where));
    const HttpAnswer* res = &answer;

    const int status = res->status;
    if (status < 200 || status >= 300) {
      const std::string text = absl::StrCat(where, ": HTTP ", status, ": ", ErrorText(res->body));
      if (status == 404) {
        return absl::FailedPreconditionError(absl::StrCat(
            text,
            " (vLLM mounts this route only with VLLM_SERVER_DEV_MODE=1; the weight-transfer routes also need "
            "--weight-transfer-config)"));
      }
      if (status >= 400 && status < 500) return absl::InvalidArgumentError(text);
      if (status >= 500 && status < 600) return absl::Status(server_error, text);
      return absl::InternalError(text);
    }
    if (res->body.empty()) return json(nullptr);
    json parsed = json::parse(res->body, nullptr, /*allow_exceptions=*/false);
    if (parsed.is_discarded()) {
      return absl::InternalError(absl::StrCat(where, ": vLLM answered HTTP ", status,
                                              " with a body that is not JSON: ", Truncated(res->body)));
    }
    return parsed;
  }

  const std::string kind_ = "vllm";
  const std::string host_;
  const int port_;
  const std::string url_mode_;
  const std::string id_;
  const std::string address_;
  const absl::Duration call_timeout_;
  const absl::Duration post_process_timeout_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<EngineAdapter>> MakeVllmAdapter(const std::string& url, absl::Duration call_timeout) {
  WSYNC_ASSIGN_OR_RETURN(ParsedUrl parsed, ParseUrl(url));
  if (call_timeout <= absl::ZeroDuration() || call_timeout == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("vLLM engine vllm+", url, ": the call timeout must be positive and ",
                                                   "finite, not ", absl::FormatDuration(call_timeout)));
  }
  return std::unique_ptr<EngineAdapter>(new VllmAdapter(std::move(parsed), "vllm+" + url, call_timeout));
}

}  // namespace wsync::daemon
