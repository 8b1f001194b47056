#include "planner/cluster.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace wsync::planner {
namespace {

// Parses "k=v,k=v" into ints; every key must be in `allowed`.
absl::StatusOr<std::map<std::string, int>> ParseKeyValues(absl::string_view text, absl::string_view what,
                                                          const std::vector<std::string>& allowed) {
  std::map<std::string, int> out;
  if (absl::StripAsciiWhitespace(text).empty()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": empty"));
  }
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    item = absl::StripAsciiWhitespace(item);
    std::vector<std::string> kv = absl::StrSplit(item, absl::MaxSplits('=', 1));
    if (kv.size() != 2 || kv[0].empty()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": expected key=value, got '", item, "'"));
    }
    std::string key = absl::AsciiStrToLower(absl::StripAsciiWhitespace(kv[0]));
    bool known = false;
    for (const auto& a : allowed) known |= (a == key);
    if (!known) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": unknown key '", key, "' (allowed: ", absl::StrJoin(allowed, ", "), ")"));
    }
    int v = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(kv[1]), &v) || v <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": '", key, "' needs a positive integer, got '", kv[1], "'"));
    }
    if (out.count(key)) return absl::InvalidArgumentError(absl::StrCat(what, ": '", key, "' given twice"));
    out[key] = v;
  }
  return out;
}

int Get(const std::map<std::string, int>& m, const std::string& k, int def) {
  auto it = m.find(k);
  return it == m.end() ? def : it->second;
}

}  // namespace

absl::StatusOr<TrainerSpec> ParseTrainerSpec(absl::string_view text) {
  auto kv = ParseKeyValues(text, "--train", {"tp", "pp", "cp", "ep", "etp", "nodes", "gpus"});
  if (!kv.ok()) return kv.status();
  TrainerSpec t;
  t.tp = Get(*kv, "tp", 1);
  t.pp = Get(*kv, "pp", 1);
  t.cp = Get(*kv, "cp", 1);
  t.ep = Get(*kv, "ep", 1);
  t.etp = Get(*kv, "etp", 1);
  t.nodes = Get(*kv, "nodes", 1);
  t.gpus_per_node = Get(*kv, "gpus", 8);
  return t;
}

absl::StatusOr<EngineSpec> ParseEngineSpec(absl::string_view text) {
  auto kv = ParseKeyValues(text, "--infer", {"instances", "tp", "ep", "dp", "nodes"});
  if (!kv.ok()) return kv.status();
  EngineSpec e;
  e.instances = Get(*kv, "instances", 1);
  e.tp = Get(*kv, "tp", 1);
  e.ep = Get(*kv, "ep", 1);
  e.dp_attention = Get(*kv, "dp", 1);
  e.nodes = Get(*kv, "nodes", std::max(1, e.instances * e.tp / 8));
  return e;
}

absl::StatusOr<NicSpec> ParseNicSpec(absl::string_view text) {
  std::string s = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text));
  std::vector<std::string> parts = absl::StrSplit(s, absl::MaxSplits('x', 1));
  auto bad = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat("--nic: expected COUNTxRATE like 8x400Gbps, got '", text, "'"));
  };
  if (parts.size() != 2) return bad();
  NicSpec n;
  if (!absl::SimpleAtoi(parts[0], &n.per_node) || n.per_node <= 0) return bad();
  absl::string_view rate = parts[1];
  for (absl::string_view suffix : {"gbps", "gb/s", "gbit/s", "g"}) {
    if (absl::ConsumeSuffix(&rate, suffix)) break;
  }
  if (!absl::SimpleAtod(rate, &n.gbps) || !(n.gbps > 0) || !std::isfinite(n.gbps)) return bad();
  return n;
}

absl::Status ClusterSpec::Validate() const {
  const TrainerSpec& t = trainer;
  if (t.world() % t.pp != 0) {
    return absl::InvalidArgumentError(absl::StrCat("trainer world size ", t.world(), " (nodes*gpus) is not a multiple of pp=", t.pp));
  }
  const int s = t.sources_per_stage();
  if (s % (t.tp * t.cp) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("trainer ranks per PP stage (", s, ") are not a multiple of tp*cp=", t.tp * t.cp));
  }
  if (s % (t.ep * t.etp) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("trainer ranks per PP stage (", s, ") are not a multiple of ep*etp=", t.ep * t.etp));
  }
  const EngineSpec& e = engine;
  if (e.tp % e.ep != 0) {
    return absl::InvalidArgumentError(absl::StrCat("engine ep=", e.ep, " does not divide engine tp=", e.tp));
  }
  if (e.tp % e.dp_attention != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("engine dp-attention=", e.dp_attention, " does not divide engine tp=", e.tp));
  }
  if (e.nodes > e.instances * e.tp) {
    return absl::InvalidArgumentError(
        absl::StrCat("engine nodes=", e.nodes, " exceed the engine GPUs (", e.instances * e.tp, ")"));
  }
  if (nic.per_node <= 0 || !(nic.gbps > 0)) return absl::InvalidArgumentError("NIC count and rate must be positive");
  return absl::OkStatus();
}

std::string FormatTrainerSpec(const TrainerSpec& t) {
  return absl::StrCat("tp=", t.tp, ",pp=", t.pp, ",cp=", t.cp, ",ep=", t.ep, ",etp=", t.etp, ",nodes=", t.nodes,
                      ",gpus=", t.gpus_per_node);
}

std::string FormatEngineSpec(const EngineSpec& e) {
  return absl::StrCat("instances=", e.instances, ",tp=", e.tp, ",ep=", e.ep, ",dp=", e.dp_attention,
                      ",nodes=", e.nodes);
}

}  // namespace wsync::planner
