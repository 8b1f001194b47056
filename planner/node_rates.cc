#include "planner/node_rates.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"

namespace wsync::planner {

extern const char* const kBuiltinNodeRatesJson;
extern const char* const kBuiltinNodeRatesOrigin;

absl::StatusOr<NodeRates> ParseNodeRates(absl::string_view text, absl::string_view origin) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("node rates ", origin, ": ", why));
  };
  nlohmann::json j = nlohmann::json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return bad("not a JSON object");
  NodeRates r;
  r.origin = std::string(origin);
  for (auto [key, field] : {std::pair{"machine", &r.machine}, {"date", &r.date}, {"command", &r.command}}) {
    if (!j.contains(key) || !j[key].is_string() || j[key].get<std::string>().empty())
      return bad(absl::StrCat("\"", key, "\" (a non-empty string) is required"));
    *field = j[key].get<std::string>();
  }
  // A curve [[ranks, GB/s], ...]: non-empty, ranks >= 1 and increasing, rates > 0.
  auto points = [&](const std::string& key, const nlohmann::json& a,
                    std::vector<std::pair<int, double>>* out) -> absl::Status {
    if (!a.is_array() || a.empty())
      return bad(absl::StrCat("\"", key, "\" (a non-empty array of [ranks, GB/s]) is required"));
    for (const auto& p : a) {
      if (!p.is_array() || p.size() != 2 || !p[0].is_number_integer() || !p[1].is_number())
        return bad(absl::StrCat(key, " entry ", p.dump(), " is not [ranks, GB/s]"));
      const int ranks = p[0].get<int>();
      const double gbps = p[1].get<double>();
      if (ranks < 1 || !(gbps > 0)) return bad(absl::StrCat(key, " entry ", p.dump(), ": ranks >= 1, GB/s > 0"));
      if (!out->empty() && ranks <= out->back().first) return bad(absl::StrCat(key, " ranks must increase"));
      out->emplace_back(ranks, gbps);
    }
    return absl::OkStatus();
  };
  auto curve = [&](const char* key, std::vector<std::pair<int, double>>* out) { return points(key, j[key], out); };
  if (!j.contains("curves") && !j.contains("node_load_gbps"))
    return bad("\"curves\" or (older files) \"node_load_gbps\" (a non-empty array of [ranks, GB/s]) is required");
  if (j.contains("node_load_gbps"))
    if (absl::Status st = curve("node_load_gbps", &r.node_load_gbps); !st.ok()) return st;
  if (j.contains("curves")) {
    if (!j["curves"].is_object() || j["curves"].empty()) return bad("\"curves\" must be a non-empty object");
    for (const auto& [name, c] : j["curves"].items()) {
      const std::vector<std::string> parts = absl::StrSplit(name, '/');
      const bool known = parts.size() == 3 &&
                         (parts[0] == "bf16" || parts[0] == "fp8-passthrough" || parts[0] == "fp8-quantize") &&
                         ParseMemoryKind(parts[1]).ok() && (parts[2] == "ring" || parts[2] == "placement");
      if (!known) return bad(absl::StrCat("curve \"", name, "\": not WEIGHTS/TENSORS/PATH (planner/node_rates.h)"));
      if (!c.is_object() || !c.contains("gbps")) return bad(absl::StrCat("curve \"", name, "\" needs \"gbps\""));
      RateCurve rc;
      if (absl::Status st = points(absl::StrCat("curves.", name), c["gbps"], &rc.gbps); !st.ok()) return st;
      if (c.contains("tp")) {
        if (!c["tp"].is_number_integer() || c["tp"].get<int>() < 1)
          return bad(absl::StrCat("curve \"", name, "\": \"tp\" must be an integer >= 1"));
        rc.tp = c["tp"].get<int>();
      }
      if (c.contains("source")) {
        if (!c["source"].is_string()) return bad(absl::StrCat("curve \"", name, "\": \"source\" must be a string"));
        rc.source = c["source"].get<std::string>();
      }
      r.curves[name] = std::move(rc);
    }
  }
  for (auto [key, out] : {std::pair{"fp8_passthrough_load_gbps", &r.fp8_passthrough_load_gbps},
                          {"fp8_quantize_load_gbps", &r.fp8_quantize_load_gbps},
                          {"send_gbps", &r.send_gbps},
                          {"cuda_load_gbps", &r.cuda_load_gbps}})
    if (j.contains(key))
      if (absl::Status st = curve(key, out); !st.ok()) return st;
  if (j.contains("d2h_gbps")) {
    if (!j["d2h_gbps"].is_number() || !(j["d2h_gbps"].get<double>() > 0)) return bad("\"d2h_gbps\" must be > 0");
    r.d2h_gbps = j["d2h_gbps"].get<double>();
  }
  return r;
}

absl::StatusOr<NodeRates> LoadNodeRates(const std::string& path) {
  std::ifstream f(path);
  if (!f) return absl::NotFoundError(absl::StrCat("node rates ", path, ": cannot be read"));
  std::stringstream ss;
  ss << f.rdbuf();
  return ParseNodeRates(ss.str(), path);
}

absl::StatusOr<NodeRates> BuiltinNodeRates() {
  if (*kBuiltinNodeRatesJson == '\0')
    return absl::NotFoundError(absl::StrCat("no node rates were compiled in (", kBuiltinNodeRatesOrigin,
                                            " was absent at build time): run bench/node on the machine to plan for "
                                            "and keep its result there, or pass --node-rates FILE"));
  return ParseNodeRates(kBuiltinNodeRatesJson, kBuiltinNodeRatesOrigin);
}

std::string CurveName(absl::string_view weights, TrainerTensors tensors, absl::string_view path) {
  return absl::StrCat(weights, "/", MemoryKindName(tensors), "/", path);
}

absl::StatusOr<NodeCurveChoice> ChooseNodeCurve(const NodeRates& rates, TrainerTensors tensors, PushedWeights weights) {
  const TrainerTensors other = tensors == TrainerTensors::kCuda ? TrainerTensors::kHost : TrainerTensors::kCuda;
  std::vector<std::string> order;
  for (TrainerTensors t : {tensors, other}) {
    if (weights == PushedWeights::kFp8PassThrough)
      for (const char* path : {"placement", "ring"}) order.push_back(CurveName("fp8-passthrough", t, path));
    for (const char* path : {"placement", "ring"}) order.push_back(CurveName("bf16", t, path));
  }
  NodeCurveChoice c;
  for (const std::string& name : order) {
    auto it = rates.curves.find(name);
    if (it == rates.curves.end()) continue;
    c.name = name;
    c.curve = it->second;
    if (name != order.front()) c.wanted = order.front();
    return c;
  }
  if (!rates.node_load_gbps.empty()) {
    c.name = "node_load_gbps";
    c.curve.gbps = rates.node_load_gbps;
    c.wanted = order.front();
    return c;
  }
  return absl::NotFoundError(
      absl::StrCat("node rates ", rates.origin, ": no curve for ", order.front(), " nor any stand-in for it"));
}

void ApplyNodeRates(const NodeRates& rates, const NodeCurveChoice& choice, CostParams* params) {
  params->node_load_gbps = choice.curve.gbps;
  if (rates.d2h_gbps > 0) params->d2h_gbps = rates.d2h_gbps;
  std::string curve = choice.name;
  if (choice.curve.tp > 0) absl::StrAppend(&curve, " at engine TP ", choice.curve.tp);
  if (!choice.curve.source.empty()) absl::StrAppend(&curve, ", measured in ", choice.curve.source);
  if (!choice.wanted.empty()) absl::StrAppend(&curve, "; stands in for ", choice.wanted, ", not measured");
  params->rates_origin = absl::StrCat(rates.origin, " (", rates.machine, ", ", rates.date, "): ", curve);
}

absl::Status ApplyNodeRates(const NodeRates& rates, TrainerTensors tensors, PushedWeights weights, CostParams* params) {
  absl::StatusOr<NodeCurveChoice> c = ChooseNodeCurve(rates, tensors, weights);
  if (!c.ok()) return c.status();
  ApplyNodeRates(rates, *c, params);
  return absl::OkStatus();
}

}  // namespace wsync::planner
