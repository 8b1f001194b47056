#include "tools/plan_command.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include "CLI/CLI.hpp"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/status.h"
#include "nlohmann/json.hpp"
#include "planner/cost.h"
#include "planner/seed_table.h"

namespace wsync::tools {
namespace {

using planner::ClusterSpec;
using planner::HfTensorInfo;
using planner::LayoutInfo;
using planner::ParamInfo;
using planner::PlanInput;

constexpr int kExitOk = 0;
constexpr int kExitError = 1;
constexpr int kExitUsage = 2;

// ---------------------------------------------------------------------------------------------------------------
// Model shape: the few config.json facts that decide tensor sizes. (The replica module's ModelConfig/ParamTable
// are the authoritative layout; this estimate matches them in bytes, which is all the planner needs.)

struct ModelShape {
  std::string architecture;
  int64_t hidden = 0, layers = 0, heads = 0, kv_heads = 0, head_dim = 0, intermediate = 0, vocab = 0;
  bool tie = false, qkv_bias = false, qk_norm = false, glm4_dense_norms = false;
  int64_t experts = 0, shared_experts = 0, moe_intermediate = 0, first_dense = 0, moe_freq = 1;
  bool expert_bias = false;  // e_score_correction_bias
  int64_t q_lora = 0, kv_lora = 0, qk_nope = 0, qk_rope = 0, v_head = 0;
  bool mla() const { return kv_lora > 0; }
  bool moe_layer(int64_t l) const { return experts > 0 && l >= first_dense && (l % std::max<int64_t>(1, moe_freq)) == 0; }
};

int64_t GetInt(const nlohmann::json& j, const char* key, int64_t def) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null() || !it->is_number()) return def;
  return it->get<int64_t>();
}

absl::StatusOr<ModelShape> LoadShape(const std::string& path) {
  std::ifstream f(path);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot open model config '", path, "'"));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not JSON: ", e.what()));
  }
  ModelShape m;
  if (j.contains("architectures") && j["architectures"].is_array() && !j["architectures"].empty()) {
    m.architecture = j["architectures"][0].get<std::string>();
  }
  const std::string& a = m.architecture;
  m.hidden = GetInt(j, "hidden_size", 0);
  m.layers = GetInt(j, "num_hidden_layers", 0);
  m.heads = GetInt(j, "num_attention_heads", 0);
  m.kv_heads = GetInt(j, "num_key_value_heads", m.heads);
  m.head_dim = GetInt(j, "head_dim", m.heads ? m.hidden / m.heads : 0);
  m.intermediate = GetInt(j, "intermediate_size", 0);
  m.vocab = GetInt(j, "vocab_size", 0);
  m.tie = j.value("tie_word_embeddings", false);
  if (m.hidden <= 0 || m.layers <= 0 || m.heads <= 0 || m.vocab <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": needs hidden_size, num_hidden_layers, num_attention_heads and vocab_size"));
  }
  m.experts = GetInt(j, "n_routed_experts", GetInt(j, "num_experts", 0));
  m.shared_experts = GetInt(j, "n_shared_experts", 0);
  m.moe_intermediate = GetInt(j, "moe_intermediate_size", 0);
  m.first_dense = GetInt(j, "first_k_dense_replace", 0);
  m.moe_freq = GetInt(j, "moe_layer_freq", GetInt(j, "decoder_sparse_step", 1));
  m.q_lora = GetInt(j, "q_lora_rank", 0);
  m.kv_lora = GetInt(j, "kv_lora_rank", 0);
  m.qk_nope = GetInt(j, "qk_nope_head_dim", 0);
  m.qk_rope = GetInt(j, "qk_rope_head_dim", 0);
  m.v_head = GetInt(j, "v_head_dim", 0);
  if (a == "Qwen2ForCausalLM") m.qkv_bias = true;
  if (a == "Qwen3ForCausalLM" || a == "Qwen3MoeForCausalLM") m.qk_norm = true;
  if (a == "Glm4ForCausalLM") m.glm4_dense_norms = true, m.qkv_bias = j.value("attention_bias", true);
  if (a == "Glm4MoeForCausalLM") {
    m.qkv_bias = j.value("attention_bias", true);
    m.qk_norm = j.value("use_qk_norm", false);
  }
  // SGLang registers gate.e_score_correction_bias for DeepSeek only with noaux_tc routing; GLM4-MoE always has it.
  m.expert_bias = a.find("Glm4Moe") != std::string::npos || a.find("GlmMoe") != std::string::npos ||
                  (a.find("Deepseek") != std::string::npos && j.value("topk_method", std::string()) == "noaux_tc");
  if (m.experts > 0 && m.moe_intermediate <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": MoE model without moe_intermediate_size"));
  }
  return m;
}

// ---------------------------------------------------------------------------------------------------------------
// Layout builder.

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

class LayoutBuilder {
 public:
  LayoutBuilder(const ModelShape& m, const ClusterSpec& c, const WeightFormat& f, PlanInput* out)
      : m_(m), c_(c), f_(f), out_(out) {
    out_->layouts.assign(c.engine.tp, {});
  }

  absl::Status Build() {
    const auto& e = c_.engine;
    at_ = e.tp / e.dp_attention;
    mt_ = e.tp / e.ep;
    if (m_.experts > 0 && m_.experts % e.ep != 0) {
      return absl::InvalidArgumentError(absl::StrCat("engine ep=", e.ep, " does not divide ", m_.experts, " experts"));
    }
    if (m_.heads % at_ != 0 && at_ % m_.heads != 0) {
      return absl::InvalidArgumentError(absl::StrCat("attention tp=", at_, " does not fit ", m_.heads, " heads"));
    }
    const int last = c_.trainer.pp - 1;
    const int64_t vpad = CeilDiv(m_.vocab, 64) * 64;
    Linear("model.embed_tokens.weight", {"model.embed_tokens.weight"}, vpad, m_.hidden, e.tp, 1, 0, false);
    for (int64_t l = 0; l < m_.layers; ++l) Layer(l);
    Replicated("model.norm.weight", {"model.norm.weight"}, m_.hidden, last);
    if (!m_.tie) Linear("lm_head.weight", {"lm_head.weight"}, vpad, m_.hidden, e.tp, 1, last, false);
    return absl::OkStatus();
  }

 private:
  int StageOf(int64_t layer) const {
    const int pp = c_.trainer.pp;
    for (int p = 0; p < pp; ++p) {
      if (layer < (p + 1) * m_.layers / pp) return p;
    }
    return pp - 1;
  }

  int Hf(const std::string& name, int64_t numel, int elem, int stage, bool expert, bool quantized_scale = false) {
    HfTensorInfo h;
    h.name = name;
    h.bytes = static_cast<uint64_t>(numel) * elem;
    h.stage = stage;
    h.expert = expert;
    // The trainer gathers bf16 weights and quantizes afterwards, so scales are not gathered.
    h.train_bytes = quantized_scale ? 0 : static_cast<uint64_t>(numel) * 2;
    out_->hf_tensors.push_back(std::move(h));
    return static_cast<int>(out_->hf_tensors.size()) - 1;
  }

  int WeightElem(bool quantizable) const { return (quantizable && f_.fp8_block > 0) ? 1 : 2; }
  int64_t ScaleNumel(int64_t n, int64_t k) const { return CeilDiv(n, f_.fp8_block) * CeilDiv(k, f_.fp8_block); }

  void AddParam(int rank, const std::string& name, uint64_t bytes, int stage, std::vector<int> inputs) {
    out_->layouts[rank].params.push_back({name, bytes, stage, std::move(inputs)});
  }

  // A norm / bias / router tensor every rank holds whole.
  void Replicated(const std::string& engine, const std::vector<std::string>& hf, int64_t numel, int stage,
                  int elem = 2) {
    std::vector<int> in;
    for (const auto& n : hf) in.push_back(Hf(n, numel / static_cast<int64_t>(hf.size()), elem, stage, false));
    for (int r = 0; r < c_.engine.tp; ++r) AddParam(r, engine, static_cast<uint64_t>(numel) * elem, stage, in);
  }

  // A linear weight of [n, k] (HF tensors `hf` stacked along n), split `split_n` ways along n and `split_k` ways
  // along k over `group` consecutive ranks. FP8 adds a `weight_scale_inv` of whole blocks beside it.
  void Linear(const std::string& engine, const std::vector<std::string>& hf, int64_t n, int64_t k, int split_n,
              int split_k, int stage, bool quantizable, int64_t local_n_override = 0) {
    const bool q = quantizable && f_.fp8_block > 0;
    std::vector<int> in;
    for (const auto& name : hf) {
      const int64_t hn = n / static_cast<int64_t>(hf.size());
      in.push_back(Hf(name, hn * k, WeightElem(quantizable), stage, false));
      if (q) in.push_back(Hf(ScaleName(name), ScaleNumel(hn, k), 4, stage, false, true));
    }
    const int64_t ln = local_n_override ? local_n_override : CeilDiv(n, split_n);
    const int64_t lk = CeilDiv(k, split_k);
    for (int r = 0; r < c_.engine.tp; ++r) {
      AddParam(r, engine, static_cast<uint64_t>(ln * lk) * WeightElem(quantizable), stage, in);
      if (q) AddParam(r, ScaleName(engine), static_cast<uint64_t>(ScaleNumel(ln, lk)) * 4, stage, in);
    }
  }

  static std::string ScaleName(const std::string& weight) {
    const std::string suffix = ".weight";
    if (weight.size() > suffix.size() && weight.compare(weight.size() - suffix.size(), suffix.size(), suffix) == 0) {
      return weight.substr(0, weight.size() - suffix.size()) + ".weight_scale_inv";
    }
    return weight + "_scale_inv";
  }

  void Layer(int64_t l) {
    const int s = StageOf(l);
    const std::string p = absl::StrCat("model.layers.", l, ".");
    const int at = at_;
    Replicated(p + "input_layernorm.weight", {p + "input_layernorm.weight"}, m_.hidden, s);
    Replicated(p + "post_attention_layernorm.weight", {p + "post_attention_layernorm.weight"}, m_.hidden, s);
    if (m_.glm4_dense_norms) {
      Replicated(p + "post_self_attn_layernorm.weight", {p + "post_self_attn_layernorm.weight"}, m_.hidden, s);
      Replicated(p + "post_mlp_layernorm.weight", {p + "post_mlp_layernorm.weight"}, m_.hidden, s);
    }
    const std::string a = p + "self_attn.";
    if (m_.mla()) {
      const int64_t qk = m_.qk_nope + m_.qk_rope;
      const int64_t local_heads = std::max<int64_t>(1, m_.heads / at);
      if (m_.q_lora > 0) {
        Linear(a + "fused_qkv_a_proj_with_mqa.weight", {a + "q_a_proj.weight", a + "kv_a_proj_with_mqa.weight"},
               m_.q_lora + m_.kv_lora + m_.qk_rope, m_.hidden, 1, 1, s, true);
        Replicated(a + "q_a_layernorm.weight", {a + "q_a_layernorm.weight"}, m_.q_lora, s);
        Linear(a + "q_b_proj.weight", {a + "q_b_proj.weight"}, m_.heads * qk, m_.q_lora, 1, 1, s, true,
               local_heads * qk);
      } else {
        Linear(a + "q_proj.weight", {a + "q_proj.weight"}, m_.heads * qk, m_.hidden, 1, 1, s, true, local_heads * qk);
        Linear(a + "kv_a_proj_with_mqa.weight", {a + "kv_a_proj_with_mqa.weight"}, m_.kv_lora + m_.qk_rope, m_.hidden,
               1, 1, s, true);
      }
      Replicated(a + "kv_a_layernorm.weight", {a + "kv_a_layernorm.weight"}, m_.kv_lora, s);
      Linear(a + "kv_b_proj.weight", {a + "kv_b_proj.weight"}, m_.heads * (m_.qk_nope + m_.v_head), m_.kv_lora, 1, 1,
             s, true, local_heads * (m_.qk_nope + m_.v_head));
      Linear(a + "o_proj.weight", {a + "o_proj.weight"}, m_.hidden, m_.heads * m_.v_head, 1, at, s, true);
    } else {
      const int64_t hd = m_.head_dim;
      const int64_t local_q = std::max<int64_t>(1, m_.heads / at) * hd;
      const int64_t local_kv = std::max<int64_t>(1, m_.kv_heads / at) * hd;  // KV heads replicated when tp > kv
      Linear(a + "qkv_proj.weight", {a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"},
             (m_.heads + 2 * m_.kv_heads) * hd, m_.hidden, 1, 1, s, true, local_q + 2 * local_kv);
      if (m_.qkv_bias) {
        std::vector<int> in = {Hf(a + "q_proj.bias", m_.heads * hd, 2, s, false),
                               Hf(a + "k_proj.bias", m_.kv_heads * hd, 2, s, false),
                               Hf(a + "v_proj.bias", m_.kv_heads * hd, 2, s, false)};
        for (int r = 0; r < c_.engine.tp; ++r) AddParam(r, a + "qkv_proj.bias", (local_q + 2 * local_kv) * 2, s, in);
      }
      if (m_.qk_norm) {
        Replicated(a + "q_norm.weight", {a + "q_norm.weight"}, hd, s);
        Replicated(a + "k_norm.weight", {a + "k_norm.weight"}, hd, s);
      }
      Linear(a + "o_proj.weight", {a + "o_proj.weight"}, m_.hidden, m_.heads * hd, 1, at, s, true);
    }
    const std::string mlp = p + "mlp.";
    const int tp = c_.engine.tp;
    if (!m_.moe_layer(l)) {
      Linear(mlp + "gate_up_proj.weight", {mlp + "gate_proj.weight", mlp + "up_proj.weight"}, 2 * m_.intermediate,
             m_.hidden, tp, 1, s, true);
      Linear(mlp + "down_proj.weight", {mlp + "down_proj.weight"}, m_.hidden, m_.intermediate, 1, tp, s, true);
      return;
    }
    Replicated(mlp + "gate.weight", {mlp + "gate.weight"}, m_.experts * m_.hidden, s);
    if (m_.expert_bias) {
      Replicated(mlp + "gate.e_score_correction_bias", {mlp + "gate.e_score_correction_bias"}, m_.experts, s, 4);
    }
    if (m_.shared_experts > 0) {
      const int64_t is = m_.moe_intermediate * m_.shared_experts;
      const std::string se = mlp + "shared_experts.";
      Linear(se + "gate_up_proj.weight", {se + "gate_proj.weight", se + "up_proj.weight"}, 2 * is, m_.hidden, tp, 1,
             s, true);
      Linear(se + "down_proj.weight", {se + "down_proj.weight"}, m_.hidden, is, 1, tp, s, true);
    }
    Experts(l, s);
  }

  // Routed experts: HF experts.{e}.{gate,up,down}_proj -> experts.w13_weight [E/ep, 2I/moe_tp, H] and
  // experts.w2_weight [E/ep, H, I/moe_tp] on EP rank tp_rank / moe_tp.
  void Experts(int64_t l, int s) {
    const std::string ex = absl::StrCat("model.layers.", l, ".mlp.experts.");
    const int64_t im = m_.moe_intermediate, h = m_.hidden;
    const bool q = f_.fp8_block > 0;
    const int elem = WeightElem(true);
    struct PerExpert {
      std::vector<int> w13, w2, w13s, w2s;
    };
    std::vector<PerExpert> per(m_.experts);
    for (int64_t e = 0; e < m_.experts; ++e) {
      const std::string n = absl::StrCat(ex, e, ".");
      for (const char* proj : {"gate_proj", "up_proj"}) {
        per[e].w13.push_back(Hf(absl::StrCat(n, proj, ".weight"), im * h, elem, s, true));
        if (q) per[e].w13s.push_back(Hf(absl::StrCat(n, proj, ".weight_scale_inv"), ScaleNumel(im, h), 4, s, true, true));
      }
      per[e].w2.push_back(Hf(n + "down_proj.weight", h * im, elem, s, true));
      if (q) per[e].w2s.push_back(Hf(n + "down_proj.weight_scale_inv", ScaleNumel(h, im), 4, s, true, true));
    }
    const int64_t el = m_.experts / c_.engine.ep;
    const int64_t lim = CeilDiv(im, mt_);
    for (int r = 0; r < c_.engine.tp; ++r) {
      const int64_t ep_rank = r / mt_;
      std::vector<int> w13, w2, w13s, w2s;
      for (int64_t e = ep_rank * el; e < (ep_rank + 1) * el; ++e) {
        w13.insert(w13.end(), per[e].w13.begin(), per[e].w13.end());
        w2.insert(w2.end(), per[e].w2.begin(), per[e].w2.end());
        w13s.insert(w13s.end(), per[e].w13s.begin(), per[e].w13s.end());
        w2s.insert(w2s.end(), per[e].w2s.begin(), per[e].w2s.end());
      }
      AddParam(r, ex + "w13_weight", static_cast<uint64_t>(el * 2 * lim * h) * elem, s, w13);
      AddParam(r, ex + "w2_weight", static_cast<uint64_t>(el * h * lim) * elem, s, w2);
      if (q) {
        AddParam(r, ex + "w13_weight_scale_inv", static_cast<uint64_t>(el * ScaleNumel(2 * lim, h)) * 4, s, w13s);
        AddParam(r, ex + "w2_weight_scale_inv", static_cast<uint64_t>(el * ScaleNumel(h, lim)) * 4, s, w2s);
      }
    }
  }

  const ModelShape& m_;
  const ClusterSpec& c_;
  const WeightFormat& f_;
  PlanInput* out_;
  int at_ = 1, mt_ = 1;
};

// ---------------------------------------------------------------------------------------------------------------
// Output.

std::string Bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) b /= 1024, ++u;
  return absl::StrFormat(u == 0 ? "%.0f %s" : "%.2f %s", b, units[u]);
}

std::string Secs(double s) { return s < 1 ? absl::StrFormat("%.0f ms", s * 1e3) : absl::StrFormat("%.2f s", s); }

struct Report {
  std::string model;
  planner::PlanStats stats;
  planner::Prediction p2p;
  planner::BroadcastPrediction bcast;
  uint64_t max_push = 0;
  double build_ms = 0;
};

nlohmann::json SourcesJson(const PlanInput& in, const planner::Plan& plan, bool tasks) {
  nlohmann::json arr = nlohmann::json::array();
  for (const auto& s : plan.sources) {
    if (!s.active()) continue;
    nlohmann::json j = {{"trainer_rank", s.trainer_rank}, {"stage", s.stage}, {"node", s.node}, {"nic", s.nic},
                        {"bytes_out", s.bytes_out}, {"load_bytes", s.load_bytes}, {"push_bytes", s.push_bytes},
                        {"sessions", s.sessions}, {"push_tensors", s.push_filter.size()}};
    if (tasks) {
      nlohmann::json tj = nlohmann::json::array();
      for (const auto& t : s.tasks) {
        nlohmann::json sl = nlohmann::json::array();
        for (const auto& x : t.slices) {
          sl.push_back({{"param", in.layouts[t.target.rank].params[x.param].name}, {"offset", x.offset},
                        {"length", x.length}});
        }
        tj.push_back({{"instance", t.target.instance}, {"rank", t.target.rank}, {"bytes", t.bytes}, {"params", sl}});
      }
      j["tasks"] = tj;
      nlohmann::json pf = nlohmann::json::array();
      for (int h : s.push_filter) pf.push_back(in.hf_tensors[h].name);
      j["push_filter"] = pf;
    }
    arr.push_back(j);
  }
  return arr;
}

void PrintTable(const PlanInput& in, const planner::Plan& plan, const Report& r, const WeightFormat& f,
                const planner::CostParams& cp, bool tasks) {
  const auto& c = in.cluster;
  const auto& st = r.stats;
  std::printf("model             %s, %s\n", r.model.c_str(),
              f.fp8_block ? absl::StrCat("fp8 [", f.fp8_block, ",", f.fp8_block, "] blocks").c_str() : "bf16");
  std::printf("trainer           %s -> %d ranks, %d sources per PP stage\n",
              planner::FormatTrainerSpec(c.trainer).c_str(), c.trainer.world(), c.trainer.sources_per_stage());
  std::printf("engine            %s -> %d targets\n", planner::FormatEngineSpec(c.engine).c_str(),
              c.engine.instances * c.engine.tp);
  std::printf("nic               %d x %.0f Gb/s per node\n", c.nic.per_node, c.nic.gbps);
  std::printf("strategy          %s (built in %.1f ms)\n", std::string(planner::StrategyName(plan.strategy)).c_str(),
              r.build_ms);
  std::printf("sources used      %d / %d\n", st.sources_used, st.sources_total);
  std::printf("bytes per source  max %s  min %s  mean %s  (max / ideal %.3f)\n", Bytes(st.max_source_bytes).c_str(),
              Bytes(st.min_source_bytes).c_str(), Bytes(st.mean_source_bytes).c_str(), st.imbalance);
  std::printf("bytes per target  max %s  min %s  mean %s\n", Bytes(st.max_target_bytes).c_str(),
              Bytes(st.min_target_bytes).c_str(), Bytes(st.mean_target_bytes).c_str());
  std::printf("sessions/source   max %d  min %d  mean %.1f\n", st.max_sessions, st.min_sessions, st.mean_sessions);
  std::printf("replica loads     max %d layouts, %s per source; push filter max %s\n", st.max_layouts_per_source,
              Bytes(st.max_load_bytes).c_str(), Bytes(r.max_push).c_str());
  std::printf("NIC bytes         source max %s, target max %s\n", Bytes(st.max_source_nic_bytes).c_str(),
              Bytes(st.max_target_nic_bytes).c_str());
  std::printf("network bound     %s  (any plan: %s)\n", Secs(r.p2p.bound_s).c_str(), Secs(r.p2p.ideal_bound_s).c_str());
  std::printf("predicted         %s  (gather %s + transfer %s + fixed/post %s; %s executor)\n",
              Secs(r.p2p.total_s).c_str(), Secs(r.p2p.gather_s).c_str(), Secs(r.p2p.transfer_s).c_str(),
              Secs((cp.fixed_ms + cp.post_process_ms) / 1e3).c_str(),
              cp.executor == planner::Executor::kSerial ? "serial" : "pipelined");
  std::printf("NCCL broadcast    %s  (gather %s + transfer %s; %s per engine rank)\n", Secs(r.bcast.total_s).c_str(),
              Secs(r.bcast.gather_s).c_str(), Secs(r.bcast.transfer_s).c_str(),
              Bytes(r.bcast.bytes_per_receiver).c_str());
  std::printf("speed-up          %.2fx\n", r.bcast.total_s / r.p2p.total_s);
  if (tasks) {
    for (const auto& s : plan.sources) {
      if (!s.active()) continue;
      std::printf("source %d (stage %d, node %d, nic %d): %s out, load %s, push %zu tensors\n", s.trainer_rank, s.stage,
                  s.node, s.nic, Bytes(s.bytes_out).c_str(), Bytes(s.load_bytes).c_str(), s.push_filter.size());
      for (const auto& t : s.tasks) {
        std::printf("  -> (%d,%d) %zu params %s\n", t.target.instance, t.target.rank, t.slices.size(),
                    Bytes(t.bytes).c_str());
      }
    }
  }
}

nlohmann::json ReportJson(const Report& r) {
  const auto& st = r.stats;
  return {{"model", r.model},
          {"build_ms", r.build_ms},
          {"sources_used", st.sources_used},
          {"sources_total", st.sources_total},
          {"source_bytes", {{"max", st.max_source_bytes}, {"min", st.min_source_bytes}, {"mean", st.mean_source_bytes}}},
          {"target_bytes", {{"max", st.max_target_bytes}, {"min", st.min_target_bytes}, {"mean", st.mean_target_bytes}}},
          {"sessions", {{"max", st.max_sessions}, {"min", st.min_sessions}, {"mean", st.mean_sessions}}},
          {"imbalance", st.imbalance},
          {"max_layouts_per_source", st.max_layouts_per_source},
          {"max_load_bytes", st.max_load_bytes},
          {"max_push_bytes", r.max_push},
          {"max_source_nic_bytes", st.max_source_nic_bytes},
          {"max_target_nic_bytes", st.max_target_nic_bytes},
          {"bound_s", r.p2p.bound_s},
          {"ideal_bound_s", r.p2p.ideal_bound_s},
          {"predicted_s", r.p2p.total_s},
          {"gather_s", r.p2p.gather_s},
          {"transfer_s", r.p2p.transfer_s},
          {"broadcast_s", r.bcast.total_s},
          {"broadcast_transfer_s", r.bcast.transfer_s},
          {"speedup", r.bcast.total_s / r.p2p.total_s}};
}

Report Evaluate(const std::string& model, const PlanInput& in, const planner::Plan& plan,
                const planner::CostParams& cp, double build_ms) {
  Report r;
  r.model = model;
  r.build_ms = build_ms;
  r.stats = planner::ComputeStats(in, plan);
  r.p2p = planner::PredictPlan(in, plan, cp);
  r.bcast = planner::PredictBroadcast(in, cp);
  for (const auto& s : plan.sources) r.max_push = std::max(r.max_push, s.push_bytes);
  return r;
}

std::string FindModel(const std::vector<std::string>& dirs, const std::string& name) {
  for (const auto& d : dirs) {
    const std::string p = absl::StrCat(d, "/", name, "/config.json");
    if (std::ifstream(p).good()) return p;
  }
  return "";
}

int RunSeedTable(const std::vector<std::string>& dirs, const planner::CostParams& base, bool json) {
  nlohmann::json rows = nlohmann::json::array();
  if (!json) {
    std::printf("%-24s %5s %9s | %9s %9s | %9s %9s %9s %9s | %9s | %7s %7s\n", "model", "nodes", "HF bytes",
                "bcast", "bcast", "seed", "balanced", "bal+pipe", "P2P", "bound", "speedup", "speedup");
    std::printf("%-24s %5s %9s | %9s %9s | %9s %9s %9s %9s | %9s | %7s %7s\n", "", "", "", "pred", "measured",
                "pred", "pred", "pred", "measured", "", "pred", "meas");
  }
  int rc = kExitOk;
  for (const planner::SeedRow& row : planner::SeedRows()) {
    const std::string path = FindModel(dirs, row.model_dir);
    if (path.empty()) {
      std::fprintf(stderr, "seed table: no %s/config.json under any --models-dir; row skipped\n", row.model_dir.c_str());
      rc = kExitError;
      continue;
    }
    ClusterSpec c{row.trainer, row.engine, planner::SeedNic()};
    WeightFormat f{row.fp8_block};
    auto in = PlanInputFromModel(path, c, f);
    if (!in.ok()) {
      std::fprintf(stderr, "seed table: %s: %s\n", row.model.c_str(), std::string(in.status().message()).c_str());
      rc = kExitError;
      continue;
    }
    planner::CostParams cp = base;
    cp.post_process_ms = row.post_process_ms;
    planner::PlanOptions so, bo;
    so.strategy = planner::Strategy::kSeed;
    auto seed = planner::BuildPlan(*in, so);
    auto bal = planner::BuildPlan(*in, bo);
    if (!seed.ok() || !bal.ok()) {
      std::fprintf(stderr, "seed table: %s: planning failed\n", row.model.c_str());
      rc = kExitError;
      continue;
    }
    const auto ps = planner::PredictPlan(*in, *seed, cp);
    const auto pb = planner::PredictPlan(*in, *bal, cp);
    planner::CostParams pipe = cp;
    pipe.executor = planner::Executor::kPipelined;
    const auto pp = planner::PredictPlan(*in, *bal, pipe);
    const auto bc = planner::PredictBroadcast(*in, cp);
    const double meas_ratio = row.nccl_ms / row.rdma_ms;
    if (json) {
      rows.push_back({{"model", row.model}, {"nodes", row.trainer.nodes}, {"hf_bytes", bc.bytes_per_receiver},
                      {"trainer", planner::FormatTrainerSpec(row.trainer)},
                      {"engine", planner::FormatEngineSpec(row.engine)},
                      {"broadcast_pred_ms", bc.total_s * 1e3}, {"broadcast_meas_ms", row.nccl_ms},
                      {"seed_pred_ms", ps.total_s * 1e3}, {"balanced_pred_ms", pb.total_s * 1e3},
                      {"balanced_pipelined_pred_ms", pp.total_s * 1e3}, {"p2p_meas_ms", row.rdma_ms},
                      {"gather_ms", ps.gather_s * 1e3}, {"bound_ms", pb.bound_s * 1e3},
                      {"speedup_pred", bc.total_s / ps.total_s}, {"speedup_meas", meas_ratio}});
    } else {
      std::printf("%-24s %5d %9s | %9.0f %9.0f | %9.0f %9.0f %9.0f %9.0f | %9.0f | %6.2fx %6.2fx\n",
                  row.model.c_str(), row.trainer.nodes, Bytes(bc.bytes_per_receiver).c_str(), bc.total_s * 1e3,
                  row.nccl_ms, ps.total_s * 1e3, pb.total_s * 1e3, pp.total_s * 1e3, row.rdma_ms, pb.bound_s * 1e3,
                  bc.total_s / ps.total_s, meas_ratio);
    }
  }
  if (json) {
    std::printf("%s\n", nlohmann::json({{"seed_table", rows}}).dump(2).c_str());
  } else {
    std::printf("times in ms; pred = this cost model (serial executor unless 'pipe'); speed-up pred = bcast / seed\n");
  }
  return rc;
}

}  // namespace

absl::StatusOr<WeightFormat> ParseWeightFormat(const std::string& text) {
  WeightFormat f;
  if (text == "bf16" || text == "none") return f;
  if (text == "fp8") {
    f.fp8_block = 128;
    return f;
  }
  if (text.rfind("fp8:", 0) == 0 && absl::SimpleAtoi(text.substr(4), &f.fp8_block) && f.fp8_block > 0) return f;
  return absl::InvalidArgumentError(absl::StrCat("--weights: expected bf16, fp8 or fp8:BLOCK, got '", text, "'"));
}

absl::StatusOr<PlanInput> PlanInputFromModel(const std::string& config_path, const ClusterSpec& cluster,
                                             const WeightFormat& format) {
  WSYNC_RETURN_IF_ERROR(cluster.Validate());
  WSYNC_ASSIGN_OR_RETURN(ModelShape shape, LoadShape(config_path));
  PlanInput in;
  in.cluster = cluster;
  LayoutBuilder b(shape, cluster, format, &in);
  WSYNC_RETURN_IF_ERROR_CTX(b.Build(), config_path);
  return in;
}

int RunPlanCommand(int argc, char** argv) {
  CLI::App app{"Build a weight-transfer plan and predict its cost against NCCL broadcast.", "plan"};
  app.footer(
      "Exit codes: 0 ok, 1 model or planning error, 2 bad flags.\n"
      "Example: plan --model config.json --train tp=8,pp=8,cp=4,ep=32,nodes=32 --infer instances=8,tp=32,ep=32 "
      "--nic 8x400Gbps --weights fp8:64");
  std::string model, train = "tp=1", infer = "instances=1,tp=1", nic = "8x400Gbps", strategy = "balanced";
  std::string out = "table", weights = "bf16", executor = "serial";
  std::vector<std::string> models_dirs;
  bool seed_table = false, tasks = false, no_gather = false;
  planner::CostParams cp;
  app.add_option("--model", model, "HF config.json of the model");
  app.add_option("--train", train, "trainer: tp=,pp=,cp=,ep=,etp=,nodes=,gpus= (gpus per node, default 8)");
  app.add_option("--infer", infer, "engines: instances=,tp=,ep=,dp=,nodes=");
  app.add_option("--nic", nic, "NICs per node x rate, e.g. 8x400Gbps")->capture_default_str();
  app.add_option("--strategy", strategy, "seed|balanced")->capture_default_str();
  app.add_option("-w,--write-out", out, "table|json")->capture_default_str();
  app.add_option("--weights", weights, "transfer format: bf16, fp8 (128 blocks) or fp8:BLOCK")->capture_default_str();
  app.add_option("--executor", executor, "serial (the seed's) or pipelined")->capture_default_str();
  app.add_option("--replica-load-gbps", cp.replica_load_gbps, "CPU replica load rate per source")->capture_default_str();
  app.add_option("--d2h-gbps", cp.d2h_gbps, "GPU->host hand-over rate per source")->capture_default_str();
  app.add_option("--nvlink-gbps", cp.nvlink_gbps, "intra-node all-gather rate per GPU")->capture_default_str();
  app.add_option("--bcast-rx-gbps", cp.bcast_rx_gbps, "what one broadcast receiver absorbs")->capture_default_str();
  app.add_option("--fixed-ms", cp.fixed_ms, "fixed per-update overhead")->capture_default_str();
  app.add_option("--post-process-ms", cp.post_process_ms, "engine post-processing")->capture_default_str();
  app.add_flag("--no-gather", no_gather, "leave the trainer all-gather out of the prediction");
  app.add_flag("--tasks", tasks, "print every source's tasks (and push filter in json)");
  app.add_flag("--seed-table", seed_table, "reproduce the seed write-up's 8-row table in simulation");
  app.add_option("--models-dir", models_dirs, "directories holding <org>__<name>/config.json (repeatable)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? kExitOk : kExitUsage;
  }
  auto usage = [](const absl::Status& s) {
    std::fprintf(stderr, "error: %s\n", std::string(s.message()).c_str());
    return kExitUsage;
  };
  if (out != "table" && out != "json") return usage(absl::InvalidArgumentError("-w must be table or json"));
  if (executor == "serial") {
    cp.executor = planner::Executor::kSerial;
  } else if (executor == "pipelined") {
    cp.executor = planner::Executor::kPipelined;
  } else {
    return usage(absl::InvalidArgumentError("--executor must be serial or pipelined"));
  }
  for (double v : {cp.replica_load_gbps, cp.d2h_gbps, cp.nvlink_gbps, cp.bcast_rx_gbps}) {
    if (!(v > 0)) return usage(absl::InvalidArgumentError("rates must be positive"));
  }
  cp.include_gather = !no_gather;
  if (seed_table) {
    if (models_dirs.empty()) return usage(absl::InvalidArgumentError("--seed-table needs --models-dir"));
    return RunSeedTable(models_dirs, cp, out == "json");
  }
  if (model.empty()) return usage(absl::InvalidArgumentError("--model is required"));
  auto t = planner::ParseTrainerSpec(train);
  if (!t.ok()) return usage(t.status());
  auto e = planner::ParseEngineSpec(infer);
  if (!e.ok()) return usage(e.status());
  auto n = planner::ParseNicSpec(nic);
  if (!n.ok()) return usage(n.status());
  auto st = planner::ParseStrategy(strategy);
  if (!st.ok()) return usage(st.status());
  auto wf = ParseWeightFormat(weights);
  if (!wf.ok()) return usage(wf.status());
  ClusterSpec c{*t, *e, *n};
  if (absl::Status v = c.Validate(); !v.ok()) return usage(v);

  auto in = PlanInputFromModel(model, c, *wf);
  if (!in.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(in.status().message()).c_str());
    return kExitError;
  }
  planner::PlanOptions opt;
  opt.strategy = *st;
  const auto t0 = std::chrono::steady_clock::now();
  auto plan = planner::BuildPlan(*in, opt);
  const double build_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (!plan.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(plan.status().message()).c_str());
    return kExitError;
  }
  const std::string name = model.substr(model.find_last_of('/') == std::string::npos ? 0 : model.find_last_of('/') + 1);
  Report r = Evaluate(model, *in, *plan, cp, build_ms);
  if (out == "json") {
    nlohmann::json j = ReportJson(r);
    j["strategy"] = std::string(planner::StrategyName(plan->strategy));
    j["trainer"] = planner::FormatTrainerSpec(c.trainer);
    j["engine"] = planner::FormatEngineSpec(c.engine);
    j["sources"] = SourcesJson(*in, *plan, tasks);
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    PrintTable(*in, *plan, r, *wf, cp, tasks);
  }
  return kExitOk;
}

}  // namespace wsync::tools
