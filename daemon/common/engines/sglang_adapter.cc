// The SGLang EngineAdapter: SGLang's HTTP control API plus its Mooncake bootstrap (engine-apis.md §1.2–1.4, 1.8).
#include "daemon/common/engines/sglang_adapter.h"

#include <fstream>
#include <map>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/checked_size.h"
#include "base/dtype.h"
#include "base/status.h"
#include "daemon/common/engines/http_exchange.h"
#include "daemon/common/quantization.h"
#include "nlohmann/json.hpp"
#include "replica/model_config.h"
#include "replica/param_table.h"
#include "spdlog/spdlog.h"
#include "transport/mooncake/mooncake_transport.h"

namespace wsync::daemon {
namespace {

using nlohmann::json;

// end_weight_update runs the model's post-load fixups and the quantization post-processing on every rank.
constexpr absl::Duration kPostProcessMinTimeout = absl::Seconds(300);
constexpr int kDefaultBootstrapPort = 6789;
constexpr size_t kMaxText = 2048;

std::string Cut(absl::string_view s) {
  return s.size() <= kMaxText ? std::string(s) : absl::StrCat(s.substr(0, kMaxText), "… (", s.size(), " bytes)");
}

// SGLang's message from any of its answer shapes, else the raw body.
std::string SglangMessage(const std::string& body) {
  if (body.empty()) return "(empty body)";
  json j = json::parse(body, nullptr, false);
  if (j.is_object()) {
    if (auto e = j.find("error"); e != j.end()) {
      if (e->is_object() && e->contains("message") && (*e)["message"].is_string())
        return Cut((*e)["message"].get<std::string>());
      if (e->is_string()) return Cut(e->get<std::string>());
    }
    if (auto m = j.find("message"); m != j.end() && m->is_string()) return Cut(m->get<std::string>());
    if (auto d = j.find("detail"); d != j.end()) return Cut(d->is_string() ? d->get<std::string>() : d->dump());
  }
  return Cut(body);
}

using HostPort = transport::mooncake::SessionAddress;  // "HOST:PORT" or "[v6]:PORT", the same syntax

absl::StatusOr<HostPort> ParseHostPort(absl::string_view hp) {
  return transport::mooncake::ParseSessionId(std::string(hp));
}

struct SglangUrl {
  HostPort server, bootstrap;
  std::string config_path, id;
};

absl::StatusOr<SglangUrl> ParseSglangUrl(const std::string& url) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "invalid SGLang engine address \"sglang+", url, "\": ", why,
        " (expected sglang+http://HOST:PORT?config=PATH[&bootstrap=HOST:PORT][&id=ID])"));
  };
  absl::string_view rest = url;
  if (!absl::ConsumePrefix(&rest, "http://")) return bad("the scheme must be http://");
  absl::string_view query;
  if (const size_t q = rest.find('?'); q != absl::string_view::npos) {
    query = rest.substr(q + 1);
    rest = rest.substr(0, q);
  }
  absl::ConsumeSuffix(&rest, "/");
  SglangUrl out;
  auto server = ParseHostPort(rest);
  if (!server.ok()) return bad(server.status().message());
  out.server = *server;
  out.bootstrap = {out.server.host, kDefaultBootstrapPort};
  for (absl::string_view kv : absl::StrSplit(query, '&', absl::SkipEmpty())) {
    const size_t eq = kv.find('=');
    if (eq == absl::string_view::npos) return bad(absl::StrCat("query item '", kv, "' is not KEY=VALUE"));
    const absl::string_view k = kv.substr(0, eq), v = kv.substr(eq + 1);
    if (k == "config") {
      out.config_path = std::string(v);
    } else if (k == "bootstrap") {
      auto b = ParseHostPort(v);
      if (!b.ok()) return bad(absl::StrCat("bootstrap: ", b.status().message()));
      out.bootstrap = *b;
    } else if (k == "id") {
      if (v.empty()) return bad("empty id");
      out.id = std::string(v);
    } else {
      return bad(absl::StrCat("unknown query key '", k, "'"));
    }
  }
  if (out.config_path.empty()) return bad("config=PATH (the model's config.json) is required");
  if (out.id.empty()) out.id = absl::StrCat("sglang-", out.server.host, "-", out.server.port);
  return out;
}

class SglangAdapter final : public EngineAdapter {
 public:
  SglangAdapter(SglangUrl u, std::string address, absl::Duration timeout)
      : u_(std::move(u)), address_(std::move(address)), timeout_(timeout),
        post_timeout_(std::max(timeout, kPostProcessMinTimeout)) {}

  const std::string& kind() const override { return kind_; }
  const std::string& address() const override { return address_; }
  bool remote_memory() const override { return true; }

  absl::StatusOr<EngineDescription> Describe() override {
    WSYNC_ASSIGN_OR_RETURN(json info, Call("describe", u_.server, "GET", "/server_info", nullptr, timeout_));
    auto get_int = [&](const char* key, int dflt) -> absl::StatusOr<int> {
      auto it = info.find(key);
      if (it == info.end() || it->is_null()) return dflt;
      if (!it->is_number_integer())
        return absl::InternalError(absl::StrCat(Who(), ": /server_info field ", key, " is not an integer: ",
                                                Cut(it->dump())));
      return it->get<int>();
    };
    WSYNC_ASSIGN_OR_RETURN(tp_, get_int("tp_size", -1));
    WSYNC_ASSIGN_OR_RETURN(int pp, get_int("pp_size", 1));
    WSYNC_ASSIGN_OR_RETURN(int dp, get_int("dp_size", 1));
    WSYNC_ASSIGN_OR_RETURN(ep_, get_int("ep_size", 1));
    if (tp_ < 1) return absl::InternalError(absl::StrCat(Who(), ": /server_info has no tp_size"));
    // SGLang's bootstrap keys ranks by tp_rank only (engine-apis.md §1.4): other stages or replicas collide.
    if (pp != 1 || dp != 1)
      return absl::UnimplementedError(absl::StrCat(
          Who(), ": pp_size ", pp, ", dp_size ", dp, ": SGLang publishes its transfer-engine memory keyed by TP rank "
          "only, so only pp_size = dp_size = 1 engines can be written (run one engine per DP replica)"));
    if (info.value("enable_dp_attention", false))
      return absl::UnimplementedError(absl::StrCat(Who(), ": DP attention is not supported for SGLang engines yet"));
    // Every speculative algorithm but NGRAM and UNO runs a draft ModelRunner of its own (SGLang's
    // BaseSpecWorker.weight_update_runners); SGLang reports NEXTN resolved to EAGLE.
    if (auto it = info.find("speculative_algorithm"); it != info.end() && !it->is_null()) {
      if (!it->is_string())
        return absl::InternalError(absl::StrCat(Who(), ": /server_info field speculative_algorithm is not a string: ",
                                                Cut(it->dump())));
      const std::string algo = it->get<std::string>();
      const std::string up = absl::AsciiStrToUpper(algo);
      if (!up.empty() && up != "NONE" && up != "NGRAM" && up != "UNO") draft_algorithm_ = algo;
    }
    WSYNC_ASSIGN_OR_RETURN(json model, Call("describe", u_.server, "GET", "/model_info", nullptr, timeout_));
    EngineDescription d;
    d.engine_id = u_.id;
    d.kind = kind_;
    d.num_ranks = tp_;
    d.weight_version = model.value("weight_version", "");
    return d;
  }

  absl::Status RequestAttach(const AttachInfo&) override {
    return absl::FailedPreconditionError(absl::StrCat(
        Who(), ": SGLang ranks do not attach to a target daemon; their memory is published by SGLang's bootstrap"));
  }

  absl::StatusOr<RemoteMemory> RemoteLayouts() override {
    std::ifstream f(u_.config_path);
    if (!f) return absl::FailedPreconditionError(absl::StrCat(Who(), ": cannot read config ", u_.config_path));
    std::stringstream text;
    text << f.rdbuf();
    RemoteMemory out;
    out.model_config_json = text.str();
    auto cfg = replica::ModelConfig::FromJson(out.model_config_json);
    if (!cfg.ok()) return Annotate(cfg.status(), absl::StrCat(Who(), ": config ", u_.config_path));
    // SGLang holds the weights as the config it serves declares them (quantization_config): reported per rank.
    auto quant = QuantizationFromModelConfig(out.model_config_json);
    if (!quant.ok()) return Annotate(quant.status(), absl::StrCat(Who(), ": config ", u_.config_path));
    std::vector<std::string> draft_entries;
    for (int r = 0; r < tp_; ++r) {
      WSYNC_ASSIGN_OR_RETURN(json answer, BootstrapEntry(r));
      if (!draft_algorithm_.empty()) {
        WSYNC_ASSIGN_OR_RETURN(std::string what, DescribeEntry(*cfg, *quant, r, answer));
        draft_entries.push_back(std::move(what));
        continue;
      }
      WSYNC_ASSIGN_OR_RETURN(v1::RankLayout layout, RankFromBootstrap(*cfg, *quant, r, answer));
      out.ranks.push_back(std::move(layout));
    }
    if (!draft_algorithm_.empty())
      return absl::UnimplementedError(absl::StrCat(
          Who(), ": runs a speculative draft model (speculative_algorithm ", draft_algorithm_,
          "), which wsync cannot update on SGLang 0.5.23: each model runner, the target's and the draft's, publishes "
          "its transfer-engine memory on the bootstrap under its tp_rank alone, and the draft runner registers after "
          "the target, so its table replaces the target's. ", absl::StrJoin(draft_entries, "; "),
          ". The target's memory cannot be located, and an engine whose draft would keep serving the old version is "
          "not updated: serve it without speculative decoding to update it with wsync (docs/engines.md, "
          "\"Speculative drafts\")"));
    return out;
  }

  absl::Status Pause(const std::string& mode) override {
    if (mode != "abort" && mode != "retract" && mode != "in_place")
      return absl::InvalidArgumentError(
          absl::StrCat(Who(), ": pause mode '", mode, "' is not one of abort, retract, in_place"));
    json body = {{"mode", mode}};
    WSYNC_RETURN_IF_ERROR(Call("pause", u_.server, "POST", "/pause_generation", &body, timeout_).status());
    json begin = {{"selector", "target"}};
    auto r = Call("pause", u_.server, "POST", "/begin_weight_update", &begin, timeout_);
    // A session left open by a failed update is reused: its writes are replaced by this update's.
    if (!r.ok() && absl::StrContains(r.status().message(), "already open")) {
      spdlog::warn("{}: a weight-update session was still open (an earlier update failed); continuing in it", Who());
      return absl::OkStatus();
    }
    return Success("pause", "/begin_weight_update", r);
  }

  absl::Status PostProcess(const std::string& version) override {
    json body = json::object();
    return Success("post_process",  "/end_weight_update",
                   Call("post_process", u_.server, "POST", "/end_weight_update", &body, post_timeout_));
  }

  absl::Status SetWeightVersion(const std::string& version) override {
    json body = {{"new_version", version}, {"abort_all_requests", false}};
    WSYNC_RETURN_IF_ERROR(Success("set_weight_version", "/update_weight_version",
                                  Call("set_weight_version", u_.server, "POST", "/update_weight_version", &body,
                                       timeout_)));
    WSYNC_ASSIGN_OR_RETURN(json model, Call("set_weight_version", u_.server, "GET", "/model_info", nullptr, timeout_));
    const std::string now = model.value("weight_version", "");
    if (now != version)
      return absl::InternalError(absl::StrCat(Who(), ": set_weight_version: /model_info reports weight_version '", now,
                                              "' after setting '", version, "'"));
    return absl::OkStatus();
  }

  absl::Status Continue() override {
    // While paused the waiting queue is ignored by the idle check; with timeout 0 SGLang answers at once.
    WSYNC_RETURN_IF_ERROR(Call("continue", u_.server, "GET", "/flush_cache", nullptr, timeout_).status());
    json body = {{"torch_empty_cache", true}};
    return Call("continue", u_.server, "POST", "/continue_generation", &body, timeout_).status();
  }

 private:
  std::string Who() const { return absl::StrCat("SGLang engine ", u_.id, " (", address_, ")"); }

  // {"success": false, "message"} is SGLang's refusal even with HTTP 200.
  absl::Status Success(const char* method, const char* path, const absl::StatusOr<json>& r) const {
    if (!r.ok()) return r.status();
    if (r->is_object() && r->contains("success") && !r->value("success", false))
      return absl::FailedPreconditionError(
          absl::StrCat(Who(), ": ", method, ": POST ", path, ": SGLang refused: ", r->value("message", "")));
    return absl::OkStatus();
  }

  // GET <bootstrap>/get_transfer_engine_info?rank=R: SGLang's answer for the rank, its 404 named.
  absl::StatusOr<json> BootstrapEntry(int rank) const {
    const std::string path = absl::StrCat("/get_transfer_engine_info?rank=", rank);
    auto answer = Call("layout", u_.bootstrap, "GET", path, nullptr, timeout_);
    if (absl::IsFailedPrecondition(answer.status()) && absl::StrContains(answer.status().message(), "HTTP 404"))
      return absl::NotFoundError(absl::StrCat(
          Who(), ": SGLang's bootstrap at ", u_.bootstrap.host, ":", u_.bootstrap.port,
          " has no transfer-engine memory for TP rank ", rank, " (is the engine started with "
          "--remote-instance-weight-loader-start-seed-via-transfer-engine, and is this its bootstrap port?): ",
          answer.status().message()));
    return answer;
  }

  // The published [session_id, {name: [data_ptr, numel, element_size]}] of a rank.
  absl::StatusOr<std::pair<std::string, const json*>> EntryOf(int rank, const json& answer) const {
    const json* info = answer.is_object() && answer.contains("remote_instance_transfer_engine_info")
                           ? &answer["remote_instance_transfer_engine_info"]
                           : nullptr;
    if (info == nullptr || !info->is_array() || info->size() != 2 || !(*info)[0].is_string() ||
        !(*info)[1].is_object())
      return absl::InternalError(absl::StrCat(Who(), ": TP rank ", rank, ": the bootstrap's answer is not "
                                              "[session_id, {name: [data_ptr, numel, element_size]}]: ",
                                              Cut(answer.dump())));
    return std::make_pair((*info)[0].get<std::string>(), &(*info)[1]);
  }

  replica::RankParallelism ParallelismOf(int rank, replica::WeightSet weights) const {
    replica::RankParallelism rp = replica::RankParallelism::ForTp(tp_, rank, ep_);
    rp.dialect = replica::EngineDialect::kSglang;
    rp.weights = weights;
    return rp;
  }

  // Whose table a draft-running engine's bootstrap holds for a rank, told apart by the parameter names wsync's
  // tables of SGLang's target and NextN draft layouts have (the draft's also lists its own embed_tokens and lm_head,
  // which the speculative worker then replaces with the target's tensors).
  absl::StatusOr<std::string> DescribeEntry(const replica::ModelConfig& cfg, const v1::WeightQuantization& quant,
                                            int rank, const json& answer) const {
    WSYNC_ASSIGN_OR_RETURN(auto entry, EntryOf(rank, answer));
    const auto& [session, published] = entry;
    auto count = [&](const replica::ParamTable& t) {
      size_t n = 0;
      for (const auto& p : t.params()) n += published->contains(p.name);
      return n;
    };
    auto target = replica::BuildParamTable(cfg, ParallelismOf(rank, replica::WeightSet::kTarget), QuantSpecOf(quant));
    if (!target.ok()) return Annotate(target.status(), absl::StrCat(Who(), ": TP rank ", rank));
    const size_t of_target = count(*target);
    std::string whose = "neither the target's nor a NextN draft's";
    // A config without a next-n layer has no NextN table (the draft is then another family's: EAGLE heads).
    if (auto draft = replica::BuildParamTable(cfg, ParallelismOf(rank, replica::WeightSet::kDraft),
                                              QuantSpecOf(quant));
        draft.ok() && count(*draft) == draft->params().size())
      whose = absl::StrCat("the draft runner's: all ", draft->params().size(), " parameters of the NextN draft");
    else if (of_target == target->params().size())
      whose = "the target's: the draft runner's memory is published nowhere";
    std::vector<std::string> foreign;  // a few published names the target does not have
    for (auto it = published->begin(); it != published->end() && foreign.size() < 3; ++it)
      if (target->Find(it.key()) == nullptr) foreign.push_back(it.key());
    return absl::StrCat("TP rank ", rank, "'s entry (Mooncake session ", session, ", ", published->size(),
                        " parameters, ", of_target, " of the target's ", target->params().size(),
                        foreign.empty() ? "" : absl::StrCat("; not the target's: ", absl::StrJoin(foreign, ", "),
                                                                   foreign.size() == 3 ? ", …" : ""),
                        ") is ", whose);
  }

  // One rank's layout from SGLang's bootstrap answer, checked against wsync's table of SGLang's layout.
  absl::StatusOr<v1::RankLayout> RankFromBootstrap(const replica::ModelConfig& cfg, const v1::WeightQuantization& quant,
                                                   int rank, const json& answer) {
    const std::string where = absl::StrCat(Who(), ": TP rank ", rank);
    WSYNC_ASSIGN_OR_RETURN(auto entry, EntryOf(rank, answer));
    const std::string session = entry.first;
    const json& published = *entry.second;
    const replica::RankParallelism rp = ParallelismOf(rank, replica::WeightSet::kTarget);
    auto table = replica::BuildParamTable(cfg, rp, QuantSpecOf(quant));
    if (!table.ok()) return Annotate(table.status(), where);
    v1::RankLayout out;
    out.set_rank(rank);
    *out.mutable_quantization() = quant;
    auto* par = out.mutable_parallelism();
    par->set_tp_size(rp.tp_size);
    par->set_tp_rank(rp.tp_rank);
    par->set_pp_size(rp.pp_size);
    par->set_pp_rank(rp.pp_rank);
    par->set_ep_size(rp.ep_size);
    par->set_ep_rank(rp.ep_rank);
    par->set_moe_tp_size(rp.moe_tp_size);
    par->set_moe_tp_rank(rp.moe_tp_rank);
    par->set_attn_tp_size(rp.attn_tp_size);
    par->set_attn_tp_rank(rp.attn_tp_rank);
    par->set_attn_dp_size(rp.attn_dp_size);
    par->set_attn_dp_rank(rp.attn_dp_rank);
    uint64_t total = 0;
    int seg = 0;
    for (const auto& p : table->params()) {
      auto it = published.find(p.name);
      if (it == published.end())
        return absl::FailedPreconditionError(absl::StrCat(
            where, ": SGLang publishes no parameter ", p.name, " that wsync's layout of this model has"));
      const json& e = *it;
      if (!e.is_array() || e.size() != 3 || !e[0].is_number_unsigned() || !e[1].is_number_unsigned() ||
          !e[2].is_number_unsigned())
        return absl::InternalError(absl::StrCat(where, ": parameter ", p.name, ": [data_ptr, numel, element_size] ",
                                                "expected, got ", Cut(e.dump())));
      const uint64_t ptr = e[0].get<uint64_t>(), numel = e[1].get<uint64_t>(), esize = e[2].get<uint64_t>();
      if (esize != DTypeSize(p.dtype) || CheckedMul(numel, esize) != std::optional<uint64_t>(p.bytes))
        return absl::FailedPreconditionError(absl::StrCat(
            where, ": parameter ", p.name, ": SGLang has ", numel, " elements of ", esize, " bytes (",
            CheckedMul(numel, esize) ? absl::StrCat(*CheckedMul(numel, esize)) : std::string("over 2^64"),
            " bytes), wsync's layout has ", p.bytes, " bytes of ", DTypeName(p.dtype)));
      WSYNC_ASSIGN_OR_RETURN(std::string desc, transport::mooncake::MakeRegionDescriptor(session, ptr, p.bytes));
      auto* s = out.add_segments();
      s->set_id(seg);
      s->set_kind("mooncake");
      s->set_bytes(p.bytes);
      s->set_region_descriptor(desc);
      auto* d = out.add_params();
      d->set_name(p.name);
      d->set_dtype(std::string(DTypeName(p.dtype)));
      for (int64_t x : p.shape) d->add_shape(x);
      d->set_bytes(p.bytes);
      d->set_offset(0);
      d->set_segment(seg++);
      total += p.bytes;
    }
    for (auto it = published.begin(); it != published.end(); ++it)
      if (table->Find(it.key()) == nullptr)
        return absl::FailedPreconditionError(absl::StrCat(
            where, ": SGLang publishes parameter ", it.key(), " that wsync's layout of this model lacks"));
    out.set_region_bytes(total);
    spdlog::info("{}: {} parameters, {:.1f} MiB in Mooncake session {}", where, out.params_size(),
                 total / 1048576.0, session);
    return out;
  }

  // One HTTP exchange; the JSON body of a 2xx answer (null when empty or not JSON, e.g. /flush_cache's text).
  absl::StatusOr<json> Call(const char* method, const HostPort& to, const char* verb, const std::string& path,
                            const json* body, absl::Duration timeout) const {
    const std::string where = absl::StrCat(Who(), ": ", method, ": ", verb, " ", to.host, ":", to.port, path);
    std::optional<std::string> payload;
    if (std::string(verb) != "GET") payload = body ? body->dump() : std::string("{}");
    WSYNC_ASSIGN_OR_RETURN(HttpAnswer answer, HttpExchange(to.host, to.port, path, payload, timeout, where));
    const HttpAnswer* res = &answer;
    if (res->status == 404)
      return absl::FailedPreconditionError(absl::StrCat(where, ": HTTP 404: ", SglangMessage(res->body)));
    if (res->status >= 500)
      return absl::InternalError(absl::StrCat(where, ": HTTP ", res->status, ": ", SglangMessage(res->body)));
    if (res->status < 200 || res->status >= 300)
      return absl::FailedPreconditionError(absl::StrCat(where, ": HTTP ", res->status, ": ", SglangMessage(res->body)));
    json parsed = json::parse(res->body, nullptr, false);
    return parsed.is_discarded() ? json(nullptr) : parsed;
  }

  const std::string kind_ = "sglang";
  const SglangUrl u_;
  const std::string address_;
  const absl::Duration timeout_, post_timeout_;
  int tp_ = 0, ep_ = 1;
  std::string draft_algorithm_;  // /server_info's speculative_algorithm when it runs a draft model, else empty
};

}  // namespace

absl::StatusOr<std::unique_ptr<EngineAdapter>> MakeSglangAdapter(const std::string& url, absl::Duration call_timeout) {
  WSYNC_ASSIGN_OR_RETURN(SglangUrl u, ParseSglangUrl(url));
  if (call_timeout <= absl::ZeroDuration() || call_timeout == absl::InfiniteDuration())
    return absl::InvalidArgumentError(absl::StrCat("SGLang engine sglang+", url, ": the call timeout must be positive "
                                                   "and finite"));
  return std::unique_ptr<EngineAdapter>(new SglangAdapter(std::move(u), "sglang+" + url, call_timeout));
}

}  // namespace wsync::daemon
