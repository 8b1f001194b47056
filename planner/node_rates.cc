#include "planner/node_rates.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
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
  auto curve = [&](const char* key, std::vector<std::pair<int, double>>* out) -> absl::Status {
    if (!j[key].is_array() || j[key].empty())
      return bad(absl::StrCat("\"", key, "\" (a non-empty array of [ranks, GB/s]) is required"));
    for (const auto& p : j[key]) {
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
  if (!j.contains("node_load_gbps")) return bad("\"node_load_gbps\" (a non-empty array of [ranks, GB/s]) is required");
  if (absl::Status st = curve("node_load_gbps", &r.node_load_gbps); !st.ok()) return st;
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

void ApplyNodeRates(const NodeRates& rates, CostParams* params) {
  params->node_load_gbps = rates.node_load_gbps;
  if (rates.d2h_gbps > 0) params->d2h_gbps = rates.d2h_gbps;
  params->rates_origin = absl::StrCat(rates.origin, " (", rates.machine, ", ", rates.date, ")");
}

}  // namespace wsync::planner
