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
  if (!j.contains("node_load_gbps") || !j["node_load_gbps"].is_array() || j["node_load_gbps"].empty())
    return bad("\"node_load_gbps\" (a non-empty array of [ranks, GB/s]) is required");
  for (const auto& p : j["node_load_gbps"]) {
    if (!p.is_array() || p.size() != 2 || !p[0].is_number_integer() || !p[1].is_number())
      return bad(absl::StrCat("node_load_gbps entry ", p.dump(), " is not [ranks, GB/s]"));
    const int ranks = p[0].get<int>();
    const double gbps = p[1].get<double>();
    if (ranks < 1 || !(gbps > 0)) return bad(absl::StrCat("node_load_gbps entry ", p.dump(), ": ranks >= 1, GB/s > 0"));
    if (!r.node_load_gbps.empty() && ranks <= r.node_load_gbps.back().first)
      return bad("node_load_gbps ranks must increase");
    r.node_load_gbps.emplace_back(ranks, gbps);
  }
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
