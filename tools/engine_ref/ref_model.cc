#include "tools/engine_ref/ref_model.h"

#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "tools/weight_gen.h"

namespace wsync::engine_ref {
namespace {

int64_t Get(const nlohmann::json& j, const char* key, int64_t def = -1) {
  if (!j.contains(key) || j[key].is_null()) return def;
  return j[key].get<int64_t>();
}

// Naive 2-D block copy: rows [r0, r0+nr) and columns [c0, c0+nc) of a row-major [*, src_cols] source go to rows
// starting at `dst_row` of a row-major [*, dst_cols] destination, element by element.
void CopyBlock(const uint8_t* src, int64_t src_cols, int64_t r0, int64_t nr, int64_t c0, int64_t nc, size_t esz,
               uint8_t* dst, int64_t dst_cols, int64_t dst_row) {
  for (int64_t r = 0; r < nr; ++r) {
    for (int64_t c = 0; c < nc; ++c) {
      const uint8_t* s = src + ((r0 + r) * src_cols + (c0 + c)) * esz;
      uint8_t* d = dst + ((dst_row + r) * dst_cols + c) * esz;
      for (size_t b = 0; b < esz; ++b) d[b] = s[b];
    }
  }
}

}  // namespace

absl::StatusOr<RefConfig> ParseRefConfig(const std::string& json_text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("model config is not valid JSON: ", e.what()));
  }
  RefConfig c;
  if (!j.contains("architectures") || j["architectures"].empty())
    return absl::InvalidArgumentError("model config has no architectures");
  c.arch = j["architectures"][0].get<std::string>();
  if (c.arch != "LlamaForCausalLM" && c.arch != "Qwen2ForCausalLM" && c.arch != "Qwen3ForCausalLM" &&
      c.arch != "Qwen3MoeForCausalLM")
    return absl::UnimplementedError(
        absl::StrCat("reference engine supports Llama/Qwen2/Qwen3 and Qwen3-MoE, not ", c.arch));
  c.hidden = Get(j, "hidden_size");
  c.layers = Get(j, "num_hidden_layers");
  c.heads = Get(j, "num_attention_heads");
  c.kv_heads = Get(j, "num_key_value_heads", c.heads);
  c.head_dim = Get(j, "head_dim", c.heads > 0 ? c.hidden / c.heads : 0);
  c.inter = Get(j, "intermediate_size");
  c.vocab = Get(j, "vocab_size");
  c.tied = j.value("tie_word_embeddings", false);
  c.qkv_bias = c.arch == "Qwen2ForCausalLM" || j.value("attention_bias", false);
  c.qk_norm = c.arch == "Qwen3ForCausalLM" || c.arch == "Qwen3MoeForCausalLM";
  if (c.arch == "Qwen3MoeForCausalLM") {
    c.experts = Get(j, "num_experts", 0);
    c.moe_inter = Get(j, "moe_intermediate_size", 0);
    c.sparse_step = Get(j, "decoder_sparse_step", 1);
    if (j.contains("mlp_only_layers") && j["mlp_only_layers"].is_array())
      for (const auto& v : j["mlp_only_layers"]) c.mlp_only.push_back(v.get<int64_t>());
    if (c.experts <= 0 || c.moe_inter <= 0 || c.sparse_step <= 0)
      return absl::InvalidArgumentError("Qwen3-MoE config lacks num_experts/moe_intermediate_size");
  }
  if (c.hidden <= 0 || c.layers <= 0 || c.heads <= 0 || c.inter <= 0 || c.vocab <= 0)
    return absl::InvalidArgumentError("model config lacks hidden_size/num_hidden_layers/heads/intermediate/vocab");
  return c;
}

bool RefConfig::moe_layer(int64_t layer) const {
  if (experts <= 0) return false;
  for (int64_t l : mlp_only)
    if (l == layer) return false;
  return (layer + 1) % sparse_step == 0;
}

absl::StatusOr<RefLayout> BuildRefLayout(const RefConfig& c, int tp, int rank) {
  if (c.heads % tp != 0 || c.inter % tp != 0)
    return absl::InvalidArgumentError(absl::StrCat("tp=", tp, " does not divide heads/intermediate"));
  if (c.ep < 1 || tp % c.ep != 0 || (c.experts > 0 && (c.experts % c.ep != 0 || c.moe_inter % (tp / c.ep) != 0)))
    return absl::InvalidArgumentError(absl::StrCat("ep=", c.ep, " does not fit tp=", tp, " and ", c.experts,
                                                   " experts of intermediate ", c.moe_inter));
  if (c.kv_heads >= tp ? c.kv_heads % tp != 0 : tp % c.kv_heads != 0)
    return absl::InvalidArgumentError(absl::StrCat("tp=", tp, " incompatible with ", c.kv_heads, " kv heads"));
  RefLayout l;
  auto add = [&](const std::string& name, std::vector<int64_t> shape) {
    RefParam p;
    p.name = name;
    p.shape = std::move(shape);
    p.dtype = c.dtype;
    uint64_t n = 1;
    for (int64_t d : p.shape) n *= static_cast<uint64_t>(d);
    p.bytes = n * DTypeSize(c.dtype);
    p.offset = (l.total_bytes + 255) / 256 * 256;
    l.total_bytes = p.offset + p.bytes;
    l.params.push_back(std::move(p));
  };
  const int64_t vpad = (c.vocab + 63) / 64 * 64;
  const int64_t q_local = c.heads / tp;
  const int64_t kv_local = c.kv_heads >= tp ? c.kv_heads / tp : 1;
  add("model.embed_tokens.weight", {vpad / tp, c.hidden});
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    add(p + "self_attn.qkv_proj.weight", {(q_local + 2 * kv_local) * c.head_dim, c.hidden});
    if (c.qkv_bias) add(p + "self_attn.qkv_proj.bias", {(q_local + 2 * kv_local) * c.head_dim});
    add(p + "self_attn.o_proj.weight", {c.hidden, q_local * c.head_dim});
    if (c.qk_norm) {
      add(p + "self_attn.q_norm.weight", {c.head_dim});
      add(p + "self_attn.k_norm.weight", {c.head_dim});
    }
    if (c.moe_layer(i)) {
      const int64_t moe_tp = tp / c.ep, el = c.experts / c.ep, il = c.moe_inter / moe_tp;
      add(p + "mlp.gate.weight", {c.experts, c.hidden});
      add(p + "mlp.experts.w13_weight", {el, 2 * il, c.hidden});
      add(p + "mlp.experts.w2_weight", {el, c.hidden, il});
    } else {
      add(p + "mlp.gate_up_proj.weight", {2 * c.inter / tp, c.hidden});
      add(p + "mlp.down_proj.weight", {c.hidden, c.inter / tp});
    }
    add(p + "input_layernorm.weight", {c.hidden});
    add(p + "post_attention_layernorm.weight", {c.hidden});
  }
  add("model.norm.weight", {c.hidden});
  if (!c.tied) add("lm_head.weight", {vpad / tp, c.hidden});
  (void)rank;
  return l;
}

absl::Status ComputeExpected(const RefConfig& c, int tp, int rank, const RefLayout& layout, int64_t step,
                             uint8_t* out) {
  std::map<std::string, const RefParam*> by_name;
  for (const auto& p : layout.params) by_name[p.name] = &p;
  std::memset(out, 0, layout.total_bytes);
  const size_t esz = DTypeSize(c.dtype);
  const int64_t H = c.hidden, D = c.head_dim;
  const int64_t vpad = (c.vocab + 63) / 64 * 64;
  const int64_t q_local = c.heads / tp;
  const int64_t kv_local = c.kv_heads >= tp ? c.kv_heads / tp : 1;
  const int64_t kv_first = c.kv_heads >= tp ? rank * kv_local : rank / (tp / c.kv_heads);
  std::vector<uint8_t> full;

  // Generates the full HF tensor [rows, cols] and returns its bytes.
  auto gen = [&](const std::string& name, int64_t rows, int64_t cols) -> const uint8_t* {
    full.resize(static_cast<size_t>(rows * cols) * esz);
    tools::GenerateTensor(name, step, c.dtype, static_cast<uint64_t>(rows * cols), full.data());
    return full.data();
  };
  auto dst = [&](const std::string& name) -> std::pair<uint8_t*, const RefParam*> {
    const RefParam* p = by_name.at(name);
    return {out + p->offset, p};
  };
  auto vocab_parallel = [&](const std::string& name) {
    const uint8_t* s = gen(name, c.vocab, H);
    auto [d, p] = dst(name);
    const int64_t per = vpad / tp, first = rank * per;
    const int64_t n = std::max<int64_t>(0, std::min(c.vocab, first + per) - first);
    CopyBlock(s, H, first, n, 0, H, esz, d, H, 0);
  };
  auto replicated = [&](const std::string& hf, const std::string& engine, int64_t n) {
    const uint8_t* s = gen(hf, 1, n);
    auto [d, p] = dst(engine);
    CopyBlock(s, n, 0, 1, 0, n, esz, d, n, 0);
  };

  vocab_parallel("model.embed_tokens.weight");
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    {
      auto [d, prm] = dst(p + "self_attn.qkv_proj.weight");
      const uint8_t* q = gen(p + "self_attn.q_proj.weight", c.heads * D, H);
      CopyBlock(q, H, rank * q_local * D, q_local * D, 0, H, esz, d, H, 0);
      const uint8_t* k = gen(p + "self_attn.k_proj.weight", c.kv_heads * D, H);
      CopyBlock(k, H, kv_first * D, kv_local * D, 0, H, esz, d, H, q_local * D);
      const uint8_t* v = gen(p + "self_attn.v_proj.weight", c.kv_heads * D, H);
      CopyBlock(v, H, kv_first * D, kv_local * D, 0, H, esz, d, H, (q_local + kv_local) * D);
    }
    if (c.qkv_bias) {
      auto [d, prm] = dst(p + "self_attn.qkv_proj.bias");
      const uint8_t* q = gen(p + "self_attn.q_proj.bias", 1, c.heads * D);
      CopyBlock(q, c.heads * D, 0, 1, rank * q_local * D, q_local * D, esz, d, 0, 0);
      const uint8_t* k = gen(p + "self_attn.k_proj.bias", 1, c.kv_heads * D);
      CopyBlock(k, c.kv_heads * D, 0, 1, kv_first * D, kv_local * D, esz, d + q_local * D * esz, 0, 0);
      const uint8_t* v = gen(p + "self_attn.v_proj.bias", 1, c.kv_heads * D);
      CopyBlock(v, c.kv_heads * D, 0, 1, kv_first * D, kv_local * D, esz, d + (q_local + kv_local) * D * esz, 0, 0);
    }
    {
      auto [d, prm] = dst(p + "self_attn.o_proj.weight");
      const uint8_t* o = gen(p + "self_attn.o_proj.weight", H, c.heads * D);
      CopyBlock(o, c.heads * D, 0, H, rank * q_local * D, q_local * D, esz, d, q_local * D, 0);
    }
    if (c.qk_norm) {
      replicated(p + "self_attn.q_norm.weight", p + "self_attn.q_norm.weight", D);
      replicated(p + "self_attn.k_norm.weight", p + "self_attn.k_norm.weight", D);
    }
    if (c.moe_layer(i)) {
      // Router: whole, every rank. Experts: EP group rank / (tp/ep) holds experts [g*E/ep, (g+1)*E/ep); inside the
      // group, rank % (tp/ep) holds that slice of every expert's intermediate dimension. w13 = [gate; up] per expert.
      const int64_t moe_tp = tp / c.ep, el = c.experts / c.ep, I = c.moe_inter, il = I / moe_tp;
      const int64_t group = rank / moe_tp, part = rank % moe_tp;
      {
        auto [d, prm] = dst(p + "mlp.gate.weight");
        const uint8_t* g = gen(p + "mlp.gate.weight", c.experts, H);
        CopyBlock(g, H, 0, c.experts, 0, H, esz, d, H, 0);
      }
      auto [w13, p13] = dst(p + "mlp.experts.w13_weight");
      auto [w2, p2] = dst(p + "mlp.experts.w2_weight");
      for (int64_t e = 0; e < el; ++e) {
        const std::string x = absl::StrCat(p, "mlp.experts.", group * el + e, ".");
        uint8_t* d13 = w13 + static_cast<size_t>(e * 2 * il * H) * esz;
        const uint8_t* g = gen(x + "gate_proj.weight", I, H);
        CopyBlock(g, H, part * il, il, 0, H, esz, d13, H, 0);
        const uint8_t* u = gen(x + "up_proj.weight", I, H);
        CopyBlock(u, H, part * il, il, 0, H, esz, d13, H, il);
        const uint8_t* dn = gen(x + "down_proj.weight", H, I);
        CopyBlock(dn, I, 0, H, part * il, il, esz, w2 + static_cast<size_t>(e * H * il) * esz, il, 0);
      }
    } else {
      const int64_t I = c.inter, Il = c.inter / tp;
      auto [d, prm] = dst(p + "mlp.gate_up_proj.weight");
      const uint8_t* g = gen(p + "mlp.gate_proj.weight", I, H);
      CopyBlock(g, H, rank * Il, Il, 0, H, esz, d, H, 0);
      const uint8_t* u = gen(p + "mlp.up_proj.weight", I, H);
      CopyBlock(u, H, rank * Il, Il, 0, H, esz, d, H, Il);
      auto [dd, prm2] = dst(p + "mlp.down_proj.weight");
      const uint8_t* dn = gen(p + "mlp.down_proj.weight", H, I);
      CopyBlock(dn, I, 0, H, rank * Il, Il, esz, dd, Il, 0);
    }
    replicated(p + "input_layernorm.weight", p + "input_layernorm.weight", H);
    replicated(p + "post_attention_layernorm.weight", p + "post_attention_layernorm.weight", H);
  }
  replicated("model.norm.weight", "model.norm.weight", H);
  if (!c.tied) vocab_parallel("lm_head.weight");
  return absl::OkStatus();
}

}  // namespace wsync::engine_ref
