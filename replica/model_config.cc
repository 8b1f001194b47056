#include "replica/model_config.h"

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"

namespace wsync::replica {
namespace {

using Json = nlohmann::json;

struct ArchEntry {
  const char* name;
  Family family;
};
constexpr ArchEntry kArchitectures[] = {
    {"LlamaForCausalLM", Family::kLlama},
    {"Qwen2ForCausalLM", Family::kQwen2},
    {"Qwen3ForCausalLM", Family::kQwen3},
    {"Qwen3MoeForCausalLM", Family::kQwen3Moe},
    {"Glm4ForCausalLM", Family::kGlm4},
    {"Glm4MoeForCausalLM", Family::kGlm4Moe},
    {"DeepseekV2ForCausalLM", Family::kDeepseekV2V3},
    {"DeepseekV3ForCausalLM", Family::kDeepseekV2V3},
    {"Glm4MoeLiteForCausalLM", Family::kGlm4MoeLite},
};

// Reads config keys with context in every error; absent-or-null optional keys take the default.
class Reader {
 public:
  Reader(const Json& j, std::string arch) : j_(j), arch_(std::move(arch)) {}

  bool Has(const char* key) const { return j_.contains(key) && !j_.at(key).is_null(); }

  absl::StatusOr<int64_t> Int(const char* key) const {
    if (!Has(key)) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json (", arch_, "): missing required key '", key, "'"));
    }
    const Json& v = j_.at(key);
    if (!v.is_number_integer() && !v.is_number_unsigned()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json (", arch_, "): key '", key, "' must be an integer, got ", v.dump()));
    }
    return v.get<int64_t>();
  }
  absl::StatusOr<int64_t> Int(const char* key, int64_t def) const {
    if (!Has(key)) return def;
    return Int(key);
  }
  absl::StatusOr<int64_t> PositiveInt(const char* key) const {
    WSYNC_ASSIGN_OR_RETURN(int64_t v, Int(key));
    if (v <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json (", arch_, "): key '", key, "' must be positive, got ", v));
    }
    return v;
  }
  absl::StatusOr<bool> Bool(const char* key, bool def) const {
    if (!Has(key)) return def;
    const Json& v = j_.at(key);
    if (!v.is_boolean()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json (", arch_, "): key '", key, "' must be a boolean, got ", v.dump()));
    }
    return v.get<bool>();
  }
  std::string Str(const char* key) const {
    if (!Has(key) || !j_.at(key).is_string()) return "";
    return j_.at(key).get<std::string>();
  }

 private:
  const Json& j_;
  std::string arch_;
};

absl::Status ParseLoraAdapter(const Json& a, ModelConfig* c) {
  const std::string what = absl::StrCat("config.json (", c->architecture, "): lora_adapter");
  if (!a.is_object()) return absl::InvalidArgumentError(absl::StrCat(what, " must be an object"));
  ModelConfig::LoraAdapter out;
  if (!a.contains("r") || !a["r"].is_number_integer() || a["r"].get<int64_t>() <= 0)
    return absl::InvalidArgumentError(absl::StrCat(what, ".r (the adapter's rank) must be a positive integer"));
  out.rank = a["r"].get<int64_t>();
  if (!a.contains("target_modules") || !a["target_modules"].is_array() || a["target_modules"].empty())
    return absl::InvalidArgumentError(absl::StrCat(what, ".target_modules must be a non-empty list of module names"));
  for (const Json& m : a["target_modules"]) {
    if (!m.is_string() || m.get<std::string>().empty())
      return absl::InvalidArgumentError(absl::StrCat(what, ".target_modules must hold module names"));
    out.target_modules.push_back(m.get<std::string>());
  }
  c->lora_adapter = std::move(out);
  return absl::OkStatus();
}

// The "speculative_draft" section (ModelConfig::SeparateDraft). Only what shapes the draft's parameters is read; the
// draft config's options that change them and have not been compared with vLLM are listed in `unchecked`.
absl::Status ParseSeparateDraft(const Json& d, ModelConfig* c) {
  const std::string what = absl::StrCat("config.json (", c->architecture, "): speculative_draft");
  if (!d.is_object()) return absl::InvalidArgumentError(absl::StrCat(what, " must be an object"));
  ModelConfig::SeparateDraft out;
  if (!d.contains("method") || !d["method"].is_string() || d["method"].get<std::string>().empty())
    return absl::InvalidArgumentError(absl::StrCat(what, ".method (vLLM's speculative method) must be a string"));
  out.method = d["method"].get<std::string>();
  if (!d.contains("config") || !d["config"].is_object())
    return absl::InvalidArgumentError(absl::StrCat(what, ".config (the draft's config.json) must be an object"));
  Json dc = d["config"];
  if (!dc.contains("architectures") || !dc["architectures"].is_array() || dc["architectures"].empty() ||
      !dc["architectures"][0].is_string())
    return absl::InvalidArgumentError(absl::StrCat(what, ".config: missing 'architectures'"));
  out.architecture = dc["architectures"][0].get<std::string>();
  // vLLM's EAGLE-3 drafters of Llama-style layers (llama_eagle3.py's Eagle3LlamaForCausalLM, which these names
  // select): the layer is a Llama decoder layer.
  if (out.architecture == "LlamaForCausalLMEagle3" || out.architecture == "Eagle3LlamaForCausalLM")
    dc["architectures"] = {"LlamaForCausalLM"};
  dc.erase("speculative_draft");
  dc.erase("lora_adapter");
  absl::StatusOr<ModelConfig> parsed = ModelConfig::FromJson(dc.dump());
  if (!parsed.ok()) return Annotate(parsed.status(), absl::StrCat(what, ".config"));
  ModelConfig draft = *std::move(parsed);
  draft.architecture = out.architecture;
  draft.dtype = c->dtype;
  Reader r(dc, out.architecture);
  WSYNC_ASSIGN_OR_RETURN(out.draft_vocab_size, r.Int("draft_vocab_size", draft.vocab_size));
  if (out.draft_vocab_size <= 0)
    return absl::InvalidArgumentError(absl::StrCat(what, ".config: draft_vocab_size must be positive"));
  const Json eagle = dc.contains("eagle_config") && dc["eagle_config"].is_object() ? dc["eagle_config"] : Json::object();
  int64_t aux = 3;
  if (r.Has("num_aux_hidden_states")) {
    WSYNC_ASSIGN_OR_RETURN(aux, r.PositiveInt("num_aux_hidden_states"));
  } else if (eagle.contains("eagle_aux_hidden_state_layer_ids") && eagle["eagle_aux_hidden_state_layer_ids"].is_array() &&
             !eagle["eagle_aux_hidden_state_layer_ids"].empty()) {
    aux = static_cast<int64_t>(eagle["eagle_aux_hidden_state_layer_ids"].size());
  }
  int64_t target_hidden = 0;
  WSYNC_ASSIGN_OR_RETURN(target_hidden, r.Int("target_hidden_size", draft.hidden_size));
  out.fc_in = target_hidden * aux;
  auto flag = [&](const char* key) {
    const Json* v = eagle.contains(key) ? &eagle[key] : (dc.contains(key) ? &dc[key] : nullptr);
    return v != nullptr && v->is_boolean() && v->get<bool>();
  };
  if (flag("norm_before_fc")) out.unchecked.push_back("norm_before_fc");
  if (flag("fc_norm")) out.unchecked.push_back("fc_norm");
  if (eagle.contains("use_aux_hidden_state") && eagle["use_aux_hidden_state"] == false)
    out.unchecked.push_back("eagle_config.use_aux_hidden_state false (no fc)");
  if (draft.attention_bias) out.unchecked.push_back("attention_bias");
  if (draft.num_layers != 1) out.unchecked.push_back(absl::StrCat("num_hidden_layers ", draft.num_layers));
  if (dc.contains("quantization_config") && !dc["quantization_config"].is_null())
    out.unchecked.push_back("a quantization_config (a quantized draft)");
  for (const char* key : {"own_embed_tokens", "own_lm_head"}) {
    if (!d.contains(key) || !d[key].is_boolean())
      return absl::InvalidArgumentError(absl::StrCat(what, ".", key, " must be a boolean (what the engine holds "
                                                     "after its proposer shared the target's tensors)"));
  }
  out.own_embed_tokens = d["own_embed_tokens"].get<bool>();
  out.own_lm_head = d["own_lm_head"].get<bool>();
  out.config = std::make_shared<const ModelConfig>(std::move(draft));
  c->separate_draft = std::move(out);
  return absl::OkStatus();
}

}  // namespace

bool HasDraft(const ModelConfig& config) {
  return config.num_nextn_predict_layers > 0 || config.separate_draft.has_value();
}

bool ModelConfig::IsMoeLayer(int64_t layer) const {
  if (num_experts <= 0) return false;
  if (family == Family::kQwen3Moe) {
    for (int64_t l : mlp_only_layers) {
      if (l == layer) return false;
    }
    return (layer + 1) % moe_layer_freq == 0;
  }
  return layer >= first_k_dense && layer % moe_layer_freq == 0;
}

absl::StatusOr<ModelConfig> ModelConfig::FromJson(absl::string_view json_text) {
  Json j = Json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError("config.json: not a JSON object");
  }
  ModelConfig c;
  if (!j.contains("architectures") || !j["architectures"].is_array() || j["architectures"].empty() ||
      !j["architectures"][0].is_string()) {
    return absl::InvalidArgumentError("config.json: missing required key 'architectures' (a non-empty list)");
  }
  c.architecture = j["architectures"][0].get<std::string>();
  bool known = false;
  std::vector<std::string> names;
  for (const ArchEntry& a : kArchitectures) {
    names.push_back(a.name);
    if (c.architecture == a.name) {
      c.family = a.family;
      known = true;
    }
  }
  if (!known) {
    return absl::UnimplementedError(absl::StrCat("config.json: unsupported architecture '", c.architecture,
                                                 "' (supported: ", absl::StrJoin(names, ", "), ")"));
  }
  Reader r(j, c.architecture);
  c.model_type = r.Str("model_type");

  // transformers 5 renamed torch_dtype to dtype; both appear in published configs.
  std::string dt = r.Str("torch_dtype");
  if (dt.empty()) dt = r.Str("dtype");
  if (!dt.empty()) {
    WSYNC_ASSIGN_OR_RETURN(c.dtype, ParseDType(dt));
    if (c.dtype != DType::kBF16 && c.dtype != DType::kF16 && c.dtype != DType::kF32) {
      return absl::InvalidArgumentError(absl::StrCat("config.json (", c.architecture, "): unsupported dtype '", dt, "'"));
    }
  }

  WSYNC_ASSIGN_OR_RETURN(c.hidden_size, r.PositiveInt("hidden_size"));
  WSYNC_ASSIGN_OR_RETURN(c.num_layers, r.PositiveInt("num_hidden_layers"));
  WSYNC_ASSIGN_OR_RETURN(c.num_heads, r.PositiveInt("num_attention_heads"));
  WSYNC_ASSIGN_OR_RETURN(c.vocab_size, r.PositiveInt("vocab_size"));
  WSYNC_ASSIGN_OR_RETURN(c.intermediate_size, r.PositiveInt("intermediate_size"));
  WSYNC_ASSIGN_OR_RETURN(c.num_kv_heads, r.Int("num_key_value_heads", c.num_heads));
  const bool mla_family = c.family == Family::kDeepseekV2V3 || c.family == Family::kGlm4MoeLite;
  if (r.Has("head_dim")) {
    WSYNC_ASSIGN_OR_RETURN(c.head_dim, r.PositiveInt("head_dim"));
  } else if (!mla_family) {  // MLA head dims come from qk_nope/qk_rope below
    if (c.hidden_size % c.num_heads != 0) {
      return absl::InvalidArgumentError(absl::StrCat("config.json (", c.architecture, "): no 'head_dim' and hidden_size ",
                                                     c.hidden_size, " is not divisible by num_attention_heads ",
                                                     c.num_heads));
    }
    c.head_dim = c.hidden_size / c.num_heads;
  }
  WSYNC_ASSIGN_OR_RETURN(c.tie_word_embeddings, r.Bool("tie_word_embeddings", false));
  // Qwen2 always has a qkv bias (its config has no key for it); the others say so in attention_bias.
  WSYNC_ASSIGN_OR_RETURN(c.attention_bias, r.Bool("attention_bias", c.family == Family::kQwen2 ||
                                                                        c.family == Family::kGlm4));
  if (c.family == Family::kQwen2) c.attention_bias = true;
  WSYNC_ASSIGN_OR_RETURN(c.num_nextn_predict_layers, r.Int("num_nextn_predict_layers", 0));

  switch (c.family) {
    case Family::kLlama:
    case Family::kQwen2:
    case Family::kGlm4:
      break;
    case Family::kQwen3:
      c.qk_norm = true;
      break;
    case Family::kQwen3Moe: {
      c.qk_norm = true;
      WSYNC_ASSIGN_OR_RETURN(c.num_experts, r.PositiveInt("num_experts"));
      WSYNC_ASSIGN_OR_RETURN(c.moe_intermediate_size, r.PositiveInt("moe_intermediate_size"));
      WSYNC_ASSIGN_OR_RETURN(c.moe_layer_freq, r.Int("decoder_sparse_step", 1));
      if (r.Has("mlp_only_layers")) {
        const Json& v = j["mlp_only_layers"];
        if (!v.is_array()) return absl::InvalidArgumentError("config.json: 'mlp_only_layers' must be a list");
        for (const Json& e : v) {
          if (!e.is_number_integer()) return absl::InvalidArgumentError("config.json: 'mlp_only_layers' must hold integers");
          c.mlp_only_layers.push_back(e.get<int64_t>());
        }
      }
      break;
    }
    case Family::kGlm4Moe:
    case Family::kDeepseekV2V3:
    case Family::kGlm4MoeLite: {
      WSYNC_ASSIGN_OR_RETURN(c.num_experts, r.Int("n_routed_experts", 0));
      if (c.num_experts > 0) {
        WSYNC_ASSIGN_OR_RETURN(c.moe_intermediate_size, r.PositiveInt("moe_intermediate_size"));
        WSYNC_ASSIGN_OR_RETURN(c.num_shared_experts, r.Int("n_shared_experts", 0));
        WSYNC_ASSIGN_OR_RETURN(c.first_k_dense, r.Int("first_k_dense_replace", 0));
        WSYNC_ASSIGN_OR_RETURN(c.moe_layer_freq, r.Int("moe_layer_freq", 1));
      }
      // Glm4MoeGate always has the correction bias; DeepSeek's MoEGate only for noaux_tc routing.
      c.router_bias = c.family != Family::kDeepseekV2V3 || r.Str("topk_method") == "noaux_tc";
      // SGLang's Glm4MoeGate / Glm4MoeLiteGate hold the router weight in float32; DeepSeek's MoEGate only when the
      // config asks for router_fp32.
      if (c.family == Family::kDeepseekV2V3) {
        WSYNC_ASSIGN_OR_RETURN(c.router_fp32, r.Bool("router_fp32", false));
      } else {
        c.router_fp32 = true;
      }
      if (c.family == Family::kGlm4Moe) {
        WSYNC_ASSIGN_OR_RETURN(c.qk_norm, r.Bool("use_qk_norm", false));
      } else {
        WSYNC_ASSIGN_OR_RETURN(c.q_lora_rank, r.Int("q_lora_rank", 0));
        WSYNC_ASSIGN_OR_RETURN(c.kv_lora_rank, r.PositiveInt("kv_lora_rank"));
        WSYNC_ASSIGN_OR_RETURN(c.qk_nope_head_dim, r.PositiveInt("qk_nope_head_dim"));
        WSYNC_ASSIGN_OR_RETURN(c.qk_rope_head_dim, r.PositiveInt("qk_rope_head_dim"));
        WSYNC_ASSIGN_OR_RETURN(c.v_head_dim, r.PositiveInt("v_head_dim"));
        c.head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim;
      }
      break;
    }
  }
  if (c.moe_layer_freq <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("config.json (", c.architecture, "): moe layer frequency must be positive"));
  }
  if (c.num_kv_heads <= 0 || c.num_heads % c.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("config.json (", c.architecture, "): num_attention_heads ", c.num_heads,
                                                   " is not a multiple of num_key_value_heads ", c.num_kv_heads));
  }

  if (r.Has("quantization_config")) {
    const Json& q = j["quantization_config"];
    if (q.is_object() && q.contains("quant_method") && q["quant_method"] == "fp8" && q.contains("weight_block_size") &&
        q["weight_block_size"].is_array()) {
      for (const Json& e : q["weight_block_size"]) {
        if (!e.is_number_integer() || e.get<int64_t>() <= 0) {
          return absl::InvalidArgumentError("config.json: quantization_config.weight_block_size must hold positive integers");
        }
        c.weight_block_size.push_back(e.get<int64_t>());
      }
      if (c.weight_block_size.size() != 2) {
        return absl::InvalidArgumentError("config.json: quantization_config.weight_block_size must have 2 entries");
      }
    }
  }
  if (r.Has("lora_adapter")) WSYNC_RETURN_IF_ERROR(ParseLoraAdapter(j["lora_adapter"], &c));
  if (r.Has("speculative_draft")) WSYNC_RETURN_IF_ERROR(ParseSeparateDraft(j["speculative_draft"], &c));
  return c;
}

absl::StatusOr<ModelConfig> ModelConfig::FromFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open model config '", path, "'"));
  std::stringstream ss;
  ss << in.rdbuf();
  auto c = FromJson(ss.str());
  if (!c.ok()) return Annotate(c.status(), path);
  return c;
}

bool RankParallelism::operator==(const RankParallelism& o) const {
  return tp_size == o.tp_size && tp_rank == o.tp_rank && pp_size == o.pp_size && pp_rank == o.pp_rank &&
         ep_size == o.ep_size && ep_rank == o.ep_rank && moe_tp_size == o.moe_tp_size &&
         moe_tp_rank == o.moe_tp_rank && attn_tp_size == o.attn_tp_size && attn_tp_rank == o.attn_tp_rank &&
         attn_dp_size == o.attn_dp_size && attn_dp_rank == o.attn_dp_rank && dialect == o.dialect &&
         weights == o.weights && num_fused_shared_experts == o.num_fused_shared_experts;
}

absl::StatusOr<EngineDialect> DialectForEngineKind(absl::string_view kind) {
  if (kind.empty() || kind == "reference" || kind == "sglang") return EngineDialect::kSglang;
  if (kind == "vllm") return EngineDialect::kVllm;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown engine kind '", kind, "' (known: reference, sglang, vllm)"));
}

absl::string_view DialectName(EngineDialect d) { return d == EngineDialect::kVllm ? "vllm" : "sglang"; }

absl::string_view WeightSetName(WeightSet w) {
  switch (w) {
    case WeightSet::kTarget: return "target";
    case WeightSet::kDraft: return "draft";
    case WeightSet::kAll: return "all";
  }
  return "?";
}

RankParallelism RankParallelism::ForTp(int tp_size, int tp_rank, int ep_size) {
  RankParallelism r;
  r.tp_size = tp_size;
  r.tp_rank = tp_rank;
  r.ep_size = ep_size;
  // SGLang: moe_tp = tp / ep; ep_rank = tp_rank / moe_tp, moe_tp_rank = tp_rank % moe_tp.
  r.moe_tp_size = ep_size > 0 && tp_size % ep_size == 0 ? tp_size / ep_size : 1;
  r.ep_rank = tp_rank / r.moe_tp_size;
  r.moe_tp_rank = tp_rank % r.moe_tp_size;
  r.attn_tp_size = tp_size;
  r.attn_tp_rank = tp_rank;
  return r;
}

absl::StatusOr<int> SharedExpertsFusionFromParams(const ModelConfig& config,
                                                  const std::vector<std::string>& engine_param_names) {
  if (config.num_experts == 0 || config.num_shared_experts == 0) return 0;
  bool experts = false;
  for (const std::string& name : engine_param_names) {
    if (absl::StrContains(name, ".mlp.shared_experts.")) return 0;
    if (absl::EndsWith(name, ".mlp.experts.w13_weight")) experts = true;
  }
  if (experts) return static_cast<int>(config.num_shared_experts);
  return absl::InvalidArgumentError(absl::StrCat(
      "cannot tell the engine's shared-expert layout: its ", engine_param_names.size(),
      " parameters have neither mlp.shared_experts.* nor mlp.experts.w13_weight (", config.architecture, " has ",
      config.num_experts, " routed and ", config.num_shared_experts, " shared experts)"));
}

uint64_t TensorSpec::bytes() const {
  uint64_t n = DTypeSize(dtype);
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

}  // namespace wsync::replica
