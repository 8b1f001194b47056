#include "tools/testing/engine_ref/ref_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "tools/testdata/weight_gen.h"

namespace wsync::engine_ref {
namespace {

int64_t Get(const nlohmann::json& j, const char* key, int64_t def = -1) {
  if (!j.contains(key) || j[key].is_null()) return def;
  return j[key].get<int64_t>();
}

// Naive 2-D block copy: rows [r0, r0+nr) and columns [c0, c0+nc) of a row-major [*, src_cols] source go to rows
// starting at `dst_row` of a row-major [*, dst_cols] destination, row by row.
void CopyBlock(const uint8_t* src, int64_t src_cols, int64_t r0, int64_t nr, int64_t c0, int64_t nc, size_t esz,
               uint8_t* dst, int64_t dst_cols, int64_t dst_row) {
  for (int64_t r = 0; r < nr; ++r)  // a row's run is contiguous on both sides
    std::memcpy(dst + (dst_row + r) * dst_cols * esz, src + ((r0 + r) * src_cols + c0) * esz, nc * esz);
}

// The engine's own FP8 e4m3fn encoder, written as naively as possible: the nearest of the 253 finite code values
// (ties to the even code), saturating at ±448. Nothing shared with replica/fp8.*.
uint8_t NaiveE4m3(float v) {
  static const std::vector<std::pair<float, uint8_t>> table = [] {
    std::vector<std::pair<float, uint8_t>> t;
    for (int code = 0; code < 0x7F; ++code) {  // 0x7F is NaN
      const int e = code >> 3, m = code & 7;
      const double value = e == 0 ? m * std::ldexp(1.0, -9) : (1.0 + m / 8.0) * std::ldexp(1.0, e - 7);
      t.push_back({static_cast<float>(value), static_cast<uint8_t>(code)});
    }
    return t;
  }();
  if (v != v) return 0x7F;
  const uint8_t sign = std::signbit(v) ? 0x80 : 0;
  const double a = std::fabs(static_cast<double>(v));
  uint8_t best = 0;
  double best_d = 1e300;
  for (const auto& [value, code] : table) {
    const double d = std::fabs(a - value);
    if (d < best_d || (d == best_d && (code & 1) == 0)) {
      best = code;
      best_d = d;
    }
  }
  return sign | best;
}

// FP8 block quantization of a whole [rows, cols] bf16 tensor, blocks from its origin (what a published FP8
// checkpoint holds): codes [rows, cols] and float32 scales [ceil(rows/bn), ceil(cols/bk)].
void NaiveQuantize(const uint8_t* bf16, int64_t rows, int64_t cols, int64_t bn, int64_t bk, std::vector<uint8_t>* codes,
                   std::vector<uint8_t>* scales) {
  const int64_t sr = (rows + bn - 1) / bn, sc = (cols + bk - 1) / bk;
  codes->assign(static_cast<size_t>(rows * cols), 0);
  scales->assign(static_cast<size_t>(sr * sc) * 4, 0);
  auto value = [&](int64_t r, int64_t c) {
    uint16_t b;
    std::memcpy(&b, bf16 + (r * cols + c) * 2, 2);
    const uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  };
  for (int64_t i = 0; i < sr; ++i)
    for (int64_t j = 0; j < sc; ++j) {
      float amax = 0;
      for (int64_t r = i * bn; r < std::min(rows, (i + 1) * bn); ++r)
        for (int64_t c = j * bk; c < std::min(cols, (j + 1) * bk); ++c) {
          const float a = std::fabs(value(r, c));
          if (a > amax) amax = a;
        }
      const float scale = std::max(amax, 1e-10f) / 448.0f;
      std::memcpy(scales->data() + (i * sc + j) * 4, &scale, 4);
      for (int64_t r = i * bn; r < std::min(rows, (i + 1) * bn); ++r)
        for (int64_t c = j * bk; c < std::min(cols, (j + 1) * bk); ++c) {
          volatile float q = value(r, c) / scale;  // one float32 division, nothing fused
          (*codes)[r * cols + c] = NaiveE4m3(q);
        }
    }
}

// A LoRA target module's base shape [out, in], from the engine's own reading of the config; false for a name that is
// not one of the decoder's linears.
bool LoraModuleShape(const RefConfig& c, const std::string& m, int64_t* out, int64_t* in) {
  const int64_t h = c.hidden, q = c.heads * c.head_dim, kv = c.kv_heads * c.head_dim;
  if (m == "q_proj") *out = q, *in = h;
  else if (m == "k_proj" || m == "v_proj") *out = kv, *in = h;
  else if (m == "o_proj") *out = h, *in = q;
  else if (m == "gate_proj" || m == "up_proj") *out = c.inter, *in = h;
  else if (m == "down_proj") *out = h, *in = c.inter;
  else return false;
  return true;
}

// The adapter a --lora-rank engine holds (RefConfig::lora_rank): layer by layer, the targets in LoraModules() order,
// lora_A then lora_B; the same on every rank.
absl::StatusOr<RefLayout> BuildAdapterLayout(const RefConfig& c) {
  if (c.mla || c.experts > 0 || c.fp8_bn > 0 || c.draft)
    return absl::UnimplementedError(absl::StrCat(
        "reference engine: LoRA adapters over dense, unquantized Llama/Qwen2/Qwen3 models without a draft only, not ",
        c.arch, c.fp8_bn > 0 ? " (FP8)" : "", c.draft ? " with --draft" : ""));
  if (c.lora_targets.empty()) return absl::InvalidArgumentError("a LoRA adapter needs at least one target module");
  for (const std::string& t : c.lora_targets) {
    int64_t o = 0, i = 0;
    if (!LoraModuleShape(c, t, &o, &i))
      return absl::InvalidArgumentError(absl::StrCat("LoRA target module '", t, "' is not one of ",
                                                     absl::StrJoin(LoraModules(), ", ")));
  }
  RefLayout l;
  auto add = [&](const std::string& name, std::vector<int64_t> shape) {
    RefParam p;
    p.name = name;
    p.shape = std::move(shape);
    p.dtype = c.dtype;
    p.bytes = static_cast<uint64_t>(p.shape[0] * p.shape[1]) * DTypeSize(p.dtype);
    p.offset = (l.total_bytes + 255) / 256 * 256;
    l.total_bytes = p.offset + p.bytes;
    l.params.push_back(std::move(p));
  };
  for (int64_t i = 0; i < c.layers; ++i)
    for (const std::string& m : LoraModules()) {
      if (std::find(c.lora_targets.begin(), c.lora_targets.end(), m) == c.lora_targets.end()) continue;
      int64_t out = 0, in = 0;
      LoraModuleShape(c, m, &out, &in);
      const bool mlp = m == "gate_proj" || m == "up_proj" || m == "down_proj";
      const std::string p = absl::StrCat("base_model.model.model.layers.", i, mlp ? ".mlp." : ".self_attn.", m, ".");
      add(p + "lora_A.weight", {c.lora_rank, in});
      add(p + "lora_B.weight", {out, c.lora_rank});
    }
  return l;
}

}  // namespace

const std::vector<std::string>& LoraModules() {
  static const std::vector<std::string> kModules = {"q_proj", "k_proj", "v_proj", "o_proj",
                                                    "gate_proj", "up_proj", "down_proj"};
  return kModules;
}

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
  const bool deepseek = c.arch == "DeepseekV2ForCausalLM" || c.arch == "DeepseekV3ForCausalLM";
  if (c.arch != "LlamaForCausalLM" && c.arch != "Qwen2ForCausalLM" && c.arch != "Qwen3ForCausalLM" &&
      c.arch != "Qwen3MoeForCausalLM" && !deepseek)
    return absl::UnimplementedError(
        absl::StrCat("reference engine supports Llama/Qwen2/Qwen3, Qwen3-MoE and DeepSeek-V2/V3, not ", c.arch));
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
  if (deepseek) {
    c.mla = true;
    c.qkv_bias = false;
    c.q_lora = Get(j, "q_lora_rank", 0);
    c.kv_lora = Get(j, "kv_lora_rank", 0);
    c.qk_nope = Get(j, "qk_nope_head_dim", 0);
    c.qk_rope = Get(j, "qk_rope_head_dim", 0);
    c.v_head = Get(j, "v_head_dim", 0);
    if (c.kv_lora <= 0 || c.qk_nope <= 0 || c.qk_rope <= 0 || c.v_head <= 0)
      return absl::InvalidArgumentError(
          "DeepSeek config lacks kv_lora_rank/qk_nope_head_dim/qk_rope_head_dim/v_head_dim");
    c.head_dim = c.qk_nope + c.qk_rope;
    c.experts = Get(j, "n_routed_experts", 0);
    if (c.experts > 0) {
      c.moe_inter = Get(j, "moe_intermediate_size", 0);
      c.shared_experts = Get(j, "n_shared_experts", 0);
      c.first_dense = Get(j, "first_k_dense_replace", 0);
      c.sparse_step = Get(j, "moe_layer_freq", 1);
      c.router_bias = j.value("topk_method", std::string()) == "noaux_tc";
      c.nextn = Get(j, "num_nextn_predict_layers", 0);
      if (c.moe_inter <= 0 || c.sparse_step <= 0)
        return absl::InvalidArgumentError("DeepSeek MoE config lacks moe_intermediate_size/moe_layer_freq");
    }
    if (j.value("router_fp32", false))
      return absl::UnimplementedError("reference engine: DeepSeek router_fp32 is not supported");
  }
  if (c.arch == "Qwen3MoeForCausalLM") {
    c.experts = Get(j, "num_experts", 0);
    c.moe_inter = Get(j, "moe_intermediate_size", 0);
    c.sparse_step = Get(j, "decoder_sparse_step", 1);
    if (j.contains("mlp_only_layers") && j["mlp_only_layers"].is_array())
      for (const auto& v : j["mlp_only_layers"]) c.mlp_only.push_back(v.get<int64_t>());
    if (c.experts <= 0 || c.moe_inter <= 0 || c.sparse_step <= 0)
      return absl::InvalidArgumentError("Qwen3-MoE config lacks num_experts/moe_intermediate_size");
  }
  if (j.contains("quantization_config") && j["quantization_config"].is_object()) {
    const auto& q = j["quantization_config"];
    if (q.value("quant_method", std::string()) != "fp8" || !q.contains("weight_block_size") ||
        q["weight_block_size"].size() != 2)
      return absl::UnimplementedError("reference engine: only fp8 block quantization (weight_block_size [n, k])");
    c.fp8_bn = q["weight_block_size"][0].get<int64_t>();
    c.fp8_bk = q["weight_block_size"][1].get<int64_t>();
    if (c.fp8_bn <= 0 || c.fp8_bk <= 0) return absl::InvalidArgumentError("weight_block_size must be positive");
  }
  if (c.hidden <= 0 || c.layers <= 0 || c.heads <= 0 || c.inter <= 0 || c.vocab <= 0)
    return absl::InvalidArgumentError("model config lacks hidden_size/num_hidden_layers/heads/intermediate/vocab");
  return c;
}

static int64_t q_local_rows(const RefConfig& c, int tp) { return c.heads / tp * c.head_dim; }

bool RefConfig::moe_layer(int64_t layer) const {
  if (experts <= 0) return false;
  if (mla) return layer >= first_dense && layer % sparse_step == 0;  // DeepSeek's rule, unlike Qwen3-MoE's below
  for (int64_t l : mlp_only)
    if (l == layer) return false;
  return (layer + 1) % sparse_step == 0;
}

absl::StatusOr<RefLayout> BuildRefLayout(const RefConfig& c, int tp, int rank) {
  if (c.heads % tp != 0 || c.inter % tp != 0 || (c.moe_inter * c.shared_experts) % tp != 0)
    return absl::InvalidArgumentError(absl::StrCat("tp=", tp, " does not divide heads/intermediate"));
  if (c.ep < 1 || tp % c.ep != 0 || (c.experts > 0 && (c.experts % c.ep != 0 || c.moe_inter % (tp / c.ep) != 0)))
    return absl::InvalidArgumentError(absl::StrCat("ep=", c.ep, " does not fit tp=", tp, " and ", c.experts,
                                                   " experts of intermediate ", c.moe_inter));
  if (!c.mla && (c.kv_heads >= tp ? c.kv_heads % tp != 0 : tp % c.kv_heads != 0))
    return absl::InvalidArgumentError(absl::StrCat("tp=", tp, " incompatible with ", c.kv_heads, " kv heads"));
  if (c.draft && (c.nextn != 1 || !c.mla || c.experts <= 0 || c.layers < 2))
    return absl::InvalidArgumentError(
        absl::StrCat(c.arch, " has no draft the reference engine can hold: a next-n draft needs a DeepSeek MoE config "
                             "of two or more layers with num_nextn_predict_layers 1 (it has ",
                     c.nextn, ")"));
  if (c.lora_rank > 0) return BuildAdapterLayout(c);
  RefLayout l;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, DType dtype) {
    RefParam p;
    p.name = name;
    p.shape = std::move(shape);
    p.dtype = dtype;
    uint64_t n = 1;
    for (int64_t d : p.shape) n *= static_cast<uint64_t>(d);
    p.bytes = n * DTypeSize(p.dtype);
    p.offset = (l.total_bytes + 255) / 256 * 256;
    l.total_bytes = p.offset + p.bytes;
    l.params.push_back(std::move(p));
  };
  // A linear weight [n, k]: the model dtype, or fp8 codes plus float32 block scales.
  const bool fp8 = c.fp8_bn > 0;
  if (fp8 && !c.mla) {  // SGLang shards block-quantized weights in whole blocks
    const int64_t q_rows = q_local_rows(c, tp), kv_rows = (c.kv_heads >= tp ? c.kv_heads / tp : 1) * c.head_dim;
    if (q_rows % c.fp8_bn || kv_rows % c.fp8_bn || (c.inter / tp) % c.fp8_bn || (c.inter / tp) % c.fp8_bk ||
        q_rows % c.fp8_bk)
      return absl::InvalidArgumentError(absl::StrCat("tp=", tp, " splits an FP8 block of ", c.fp8_bn, "x", c.fp8_bk));
  }
  if (fp8 && c.mla) {
    const int64_t hl = c.heads / tp, S = c.moe_inter * c.shared_experts;
    for (int64_t split : {hl * (c.qk_nope + c.qk_rope), hl * (c.qk_nope + c.v_head), c.inter / tp, S / tp, c.q_lora})
      if (split % c.fp8_bn)
        return absl::InvalidArgumentError(absl::StrCat("tp=", tp, " splits an FP8 block of ", c.fp8_bn, " rows"));
    for (int64_t split : {hl * c.v_head, c.inter / tp, S / tp, c.q_lora})
      if (split % c.fp8_bk)
        return absl::InvalidArgumentError(absl::StrCat("tp=", tp, " splits an FP8 block of ", c.fp8_bk, " columns"));
  }
  auto linear = [&](const std::string& name, int64_t n, int64_t k) {
    if (!fp8) return add(name, {n, k}, c.dtype);
    add(name, {n, k}, DType::kF8E4M3);
    add(name.substr(0, name.size() - 6) + "weight_scale_inv", {(n + c.fp8_bn - 1) / c.fp8_bn, (k + c.fp8_bk - 1) / c.fp8_bk},
        DType::kF32);
  };
  const int64_t vpad = (c.vocab + 63) / 64 * 64;
  const int64_t q_local = c.heads / tp;
  const int64_t kv_local = c.kv_heads >= tp ? c.kv_heads / tp : 1;
  // One decoder layer's parameters under engine prefix `p`.
  auto layer = [&](const std::string& p, bool moe) {
    if (c.mla) {
      // MLA: the low-rank projections are replicated (q_a and kv_a fused into one ReplicatedLinear), the per-head
      // up-projections split by heads over tp.
      const std::string a = p + "self_attn.";
      const int64_t qk = c.qk_nope + c.qk_rope;
      if (c.q_lora > 0) {
        linear(a + "fused_qkv_a_proj_with_mqa.weight", c.q_lora + c.kv_lora + c.qk_rope, c.hidden);
        add(a + "q_a_layernorm.weight", {c.q_lora}, c.dtype);
        linear(a + "q_b_proj.weight", q_local * qk, c.q_lora);
      } else {
        linear(a + "q_proj.weight", q_local * qk, c.hidden);
        linear(a + "kv_a_proj_with_mqa.weight", c.kv_lora + c.qk_rope, c.hidden);
      }
      add(a + "kv_a_layernorm.weight", {c.kv_lora}, c.dtype);
      linear(a + "kv_b_proj.weight", q_local * (c.qk_nope + c.v_head), c.kv_lora);
      linear(a + "o_proj.weight", c.hidden, q_local * c.v_head);
      if (fp8)  // SGLang's FP8 KV-cache scales of its two MLA attention modules: float32 scalars, 1.0 once loaded
        for (const char* m : {"attn_mqa.", "attn_mha."})
          for (const char* k : {"k_scale", "v_scale"}) add(absl::StrCat(a, m, k), {}, DType::kF32);
    } else {
      linear(p + "self_attn.qkv_proj.weight", (q_local + 2 * kv_local) * c.head_dim, c.hidden);
      if (c.qkv_bias) add(p + "self_attn.qkv_proj.bias", {(q_local + 2 * kv_local) * c.head_dim}, c.dtype);
      linear(p + "self_attn.o_proj.weight", c.hidden, q_local * c.head_dim);
    }
    if (c.qk_norm) {
      add(p + "self_attn.q_norm.weight", {c.head_dim}, c.dtype);
      add(p + "self_attn.k_norm.weight", {c.head_dim}, c.dtype);
    }
    if (moe) {
      const int64_t moe_tp = tp / c.ep, el = c.experts / c.ep, il = c.moe_inter / moe_tp;
      add(p + "mlp.gate.weight", {c.experts, c.hidden}, c.dtype);
      if (c.router_bias) add(p + "mlp.gate.e_score_correction_bias", {c.experts}, DType::kF32);
      if (fp8) {
        // Per expert: gate and up each in whole row blocks (the up half's scales start at its own block row).
        const int64_t bn = c.fp8_bn, bk = c.fp8_bk;
        add(p + "mlp.experts.w13_weight", {el, 2 * il, c.hidden}, DType::kF8E4M3);
        add(p + "mlp.experts.w13_weight_scale_inv", {el, 2 * ((il + bn - 1) / bn), (c.hidden + bk - 1) / bk},
            DType::kF32);
        add(p + "mlp.experts.w2_weight", {el, c.hidden, il}, DType::kF8E4M3);
        add(p + "mlp.experts.w2_weight_scale_inv", {el, (c.hidden + bn - 1) / bn, (il + bk - 1) / bk}, DType::kF32);
      } else {
        add(p + "mlp.experts.w13_weight", {el, 2 * il, c.hidden}, c.dtype);
        add(p + "mlp.experts.w2_weight", {el, c.hidden, il}, c.dtype);
      }
      if (c.shared_experts > 0) {
        const int64_t sl = c.moe_inter * c.shared_experts / tp;
        linear(p + "mlp.shared_experts.gate_up_proj.weight", 2 * sl, c.hidden);
        linear(p + "mlp.shared_experts.down_proj.weight", c.hidden, sl);
      }
    } else {
      linear(p + "mlp.gate_up_proj.weight", 2 * c.inter / tp, c.hidden);
      linear(p + "mlp.down_proj.weight", c.hidden, c.inter / tp);
    }
    add(p + "input_layernorm.weight", {c.hidden}, c.dtype);
    add(p + "post_attention_layernorm.weight", {c.hidden}, c.dtype);
  };
  add("model.embed_tokens.weight", {vpad / tp, c.hidden}, c.dtype);
  for (int64_t i = 0; i < c.layers; ++i) layer(absl::StrCat("model.layers.", i, "."), c.moe_layer(i));
  add("model.norm.weight", {c.hidden}, c.dtype);
  if (!c.tied) add("lm_head.weight", {vpad / tp, c.hidden}, c.dtype);
  if (c.draft) {
    // The next-n draft as SGLang's NextN model holds it (its embed_tokens and lm_head are the target's): after the
    // target's parameters, marked as the draft's.
    const size_t first = l.params.size();
    add("model.enorm.weight", {c.hidden}, c.dtype);
    add("model.hnorm.weight", {c.hidden}, c.dtype);
    add("model.eh_proj.weight", {c.hidden, 2 * c.hidden}, c.dtype);  // a plain linear: never FP8
    layer("model.decoder.", true);                                    // always MoE
    add("model.shared_head.norm.weight", {c.hidden}, c.dtype);
    for (size_t k = first; k < l.params.size(); ++k) l.params[k].draft = true;
  }
  (void)rank;
  return l;
}

absl::Status ComputeExpected(const RefConfig& c, int tp, int rank, const RefLayout& layout, int64_t step,
                             uint8_t* out) {
  std::vector<uint8_t> generated;
  return LoadHfTensors(
      c, tp, rank, layout,
      [&](const std::string& name, DType dtype, uint64_t bytes) -> const uint8_t* {
        generated.resize(bytes);
        tools::GenerateTensor(name, step, dtype, bytes / DTypeSize(dtype), generated.data());
        return generated.data();
      },
      out);
}

absl::Status LoadHfTensors(const RefConfig& c, int tp, int rank, const RefLayout& layout, const HfTensorSource& src,
                           uint8_t* out) {
  std::memset(out, 0, layout.total_bytes);
  if (c.lora_rank > 0) {
    // An adapter: every PEFT tensor whole, as vLLM's LoRAModel.from_lora_tensors takes it on each rank.
    absl::Status missing;
    for (const RefParam& p : layout.params) {
      const uint8_t* t = src(p.name, p.dtype, p.bytes);
      if (t == nullptr) {
        if (missing.ok())
          missing = absl::NotFoundError(absl::StrCat("adapter tensor ", p.name, " (", p.shape[0], "x", p.shape[1], ", ",
                                                     p.bytes, " bytes) is not among the tensors to load"));
        continue;
      }
      std::memcpy(out + p.offset, t, p.bytes);
    }
    return missing;
  }
  std::map<std::string, const RefParam*> by_name;
  for (const auto& p : layout.params) by_name[p.name] = &p;
  const size_t esz = DTypeSize(c.dtype);
  const int64_t H = c.hidden, D = c.head_dim;
  const int64_t vpad = (c.vocab + 63) / 64 * 64;
  const int64_t q_local = c.heads / tp;
  const int64_t kv_local = c.kv_heads >= tp ? c.kv_heads / tp : 1;
  const int64_t kv_first = c.kv_heads >= tp ? rank * kv_local : rank / (tp / c.kv_heads);
  std::vector<uint8_t> full;

  absl::Status missing;
  // The full HF tensor [rows, cols] from the source; a missing one reads as zeros and fails the load at the end.
  auto gen = [&](const std::string& name, int64_t rows, int64_t cols) -> const uint8_t* {
    const uint64_t bytes = static_cast<uint64_t>(rows * cols) * esz;
    if (const uint8_t* p = src(name, c.dtype, bytes)) return p;
    if (missing.ok())
      missing = absl::NotFoundError(absl::StrCat("HF tensor ", name, " (", rows, "x", cols, ", ", bytes,
                                                 " bytes) is not among the tensors to load"));
    full.assign(bytes, 0);
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

  // A linear weight's slice: rows [r0, r0+nr) x cols [c0, c0+nc) of HF tensor `hf` [rows, cols] into `engine` from
  // row `dst_row`; with FP8, the codes and block scales of the whole HF tensor quantized by the engine's own encoder.
  const bool fp8 = c.fp8_bn > 0;
  std::vector<uint8_t> codes, scales;
  // The same into explicit destinations: `d` [*, d_cols] from row `dst_row`; with FP8 the scales into `ds`
  // [*, s_cols] from row `scale_row`.
  auto place_at = [&](uint8_t* d, int64_t d_cols, int64_t dst_row, uint8_t* ds, int64_t s_cols, int64_t scale_row,
                      const std::string& hf, int64_t rows, int64_t cols, int64_t r0, int64_t nr, int64_t c0,
                      int64_t nc) {
    const uint8_t* s = gen(hf, rows, cols);
    if (!fp8) {
      CopyBlock(s, cols, r0, nr, c0, nc, esz, d, d_cols, dst_row);
      return;
    }
    const int64_t bn = c.fp8_bn, bk = c.fp8_bk;
    NaiveQuantize(s, rows, cols, bn, bk, &codes, &scales);
    CopyBlock(codes.data(), cols, r0, nr, c0, nc, 1, d, d_cols, dst_row);
    CopyBlock(scales.data(), (cols + bk - 1) / bk, r0 / bn, (nr + bn - 1) / bn, c0 / bk, (nc + bk - 1) / bk, 4, ds,
              s_cols, scale_row);
  };
  auto place = [&](const std::string& engine, const std::string& hf, int64_t rows, int64_t cols, int64_t r0,
                   int64_t nr, int64_t c0, int64_t nc, int64_t dst_row) {
    auto [d, prm] = dst(engine);
    uint8_t* ds = nullptr;
    int64_t s_cols = 0;
    if (fp8) {
      auto [sd, sp] = dst(engine.substr(0, engine.size() - 6) + "weight_scale_inv");
      ds = sd;
      s_cols = sp->shape[1];
    }
    place_at(d, prm->shape[1], dst_row, ds, s_cols, fp8 ? dst_row / c.fp8_bn : 0, hf, rows, cols, r0, nr, c0, nc);
  };

  // One decoder layer: engine parameters under `p`, loaded from the checkpoint's tensors under `hp`.
  auto load_layer = [&](const std::string& p, const std::string& hp, bool moe) {
    if (c.mla) {
      const std::string a = p + "self_attn.", ha = hp + "self_attn.";
      const int64_t qk = c.qk_nope + c.qk_rope, nv = c.qk_nope + c.v_head, kva = c.kv_lora + c.qk_rope;
      if (c.q_lora > 0) {
        // [q_a_proj; kv_a_proj_with_mqa] stacked along the rows, whole on every rank.
        place(a + "fused_qkv_a_proj_with_mqa.weight", ha + "q_a_proj.weight", c.q_lora, H, 0, c.q_lora, 0, H, 0);
        place(a + "fused_qkv_a_proj_with_mqa.weight", ha + "kv_a_proj_with_mqa.weight", kva, H, 0, kva, 0, H, c.q_lora);
        replicated(ha + "q_a_layernorm.weight", a + "q_a_layernorm.weight", c.q_lora);
        place(a + "q_b_proj.weight", ha + "q_b_proj.weight", c.heads * qk, c.q_lora, rank * q_local * qk, q_local * qk,
              0, c.q_lora, 0);
      } else {
        place(a + "q_proj.weight", ha + "q_proj.weight", c.heads * qk, H, rank * q_local * qk, q_local * qk, 0, H, 0);
        place(a + "kv_a_proj_with_mqa.weight", ha + "kv_a_proj_with_mqa.weight", kva, H, 0, kva, 0, H, 0);
      }
      replicated(ha + "kv_a_layernorm.weight", a + "kv_a_layernorm.weight", c.kv_lora);
      place(a + "kv_b_proj.weight", ha + "kv_b_proj.weight", c.heads * nv, c.kv_lora, rank * q_local * nv,
            q_local * nv, 0, c.kv_lora, 0);
      place(a + "o_proj.weight", ha + "o_proj.weight", H, c.heads * c.v_head, 0, H, rank * q_local * c.v_head,
            q_local * c.v_head, 0);
      if (fp8)
        for (const char* m : {"attn_mqa.", "attn_mha."})
          for (const char* k : {"k_scale", "v_scale"}) {
            const float one = 1.0f;
            std::memcpy(dst(absl::StrCat(a, m, k)).first, &one, 4);
          }
    } else {
      const std::string qkv = p + "self_attn.qkv_proj.weight";
      place(qkv, hp + "self_attn.q_proj.weight", c.heads * D, H, rank * q_local * D, q_local * D, 0, H, 0);
      place(qkv, hp + "self_attn.k_proj.weight", c.kv_heads * D, H, kv_first * D, kv_local * D, 0, H, q_local * D);
      place(qkv, hp + "self_attn.v_proj.weight", c.kv_heads * D, H, kv_first * D, kv_local * D, 0, H,
            (q_local + kv_local) * D);
    }
    if (c.qkv_bias) {
      auto [d, prm] = dst(p + "self_attn.qkv_proj.bias");
      const uint8_t* q = gen(hp + "self_attn.q_proj.bias", 1, c.heads * D);
      CopyBlock(q, c.heads * D, 0, 1, rank * q_local * D, q_local * D, esz, d, 0, 0);
      const uint8_t* k = gen(hp + "self_attn.k_proj.bias", 1, c.kv_heads * D);
      CopyBlock(k, c.kv_heads * D, 0, 1, kv_first * D, kv_local * D, esz, d + q_local * D * esz, 0, 0);
      const uint8_t* v = gen(hp + "self_attn.v_proj.bias", 1, c.kv_heads * D);
      CopyBlock(v, c.kv_heads * D, 0, 1, kv_first * D, kv_local * D, esz, d + (q_local + kv_local) * D * esz, 0, 0);
    }
    if (!c.mla)
      place(p + "self_attn.o_proj.weight", hp + "self_attn.o_proj.weight", H, c.heads * D, 0, H, rank * q_local * D,
            q_local * D, 0);
    if (c.qk_norm) {
      replicated(hp + "self_attn.q_norm.weight", p + "self_attn.q_norm.weight", D);
      replicated(hp + "self_attn.k_norm.weight", p + "self_attn.k_norm.weight", D);
    }
    if (moe) {
      // Router: whole, every rank. Experts: EP group rank / (tp/ep) holds experts [g*E/ep, (g+1)*E/ep); inside the
      // group, rank % (tp/ep) holds that slice of every expert's intermediate dimension. w13 = [gate; up] per expert.
      const int64_t moe_tp = tp / c.ep, el = c.experts / c.ep, I = c.moe_inter, il = I / moe_tp;
      const int64_t group = rank / moe_tp, part = rank % moe_tp;
      {
        auto [d, prm] = dst(p + "mlp.gate.weight");
        const uint8_t* g = gen(hp + "mlp.gate.weight", c.experts, H);
        CopyBlock(g, H, 0, c.experts, 0, H, esz, d, H, 0);
      }
      if (c.router_bias) {
        // float32 in the checkpoint and in the engine.
        auto [d, prm] = dst(p + "mlp.gate.e_score_correction_bias");
        const std::string name = hp + "mlp.gate.e_score_correction_bias";
        const uint64_t bytes = static_cast<uint64_t>(c.experts) * 4;
        const uint8_t* bias = src(name, DType::kF32, bytes);
        if (bias == nullptr) {
          if (missing.ok())
            missing = absl::NotFoundError(absl::StrCat("HF tensor ", name, " (float32, ", bytes,
                                                       " bytes) is not among the tensors to load"));
          full.assign(bytes, 0);
          bias = full.data();
        }
        CopyBlock(bias, c.experts, 0, 1, 0, c.experts, 4, d, c.experts, 0);
      }
      if (c.shared_experts > 0) {
        // The shared experts as one dense MLP of intermediate moe_inter * n_shared, split over all tp ranks.
        const int64_t S = c.moe_inter * c.shared_experts, sl = S / tp;
        const std::string x = p + "mlp.shared_experts.", hx = hp + "mlp.shared_experts.";
        place(x + "gate_up_proj.weight", hx + "gate_proj.weight", S, H, rank * sl, sl, 0, H, 0);
        place(x + "gate_up_proj.weight", hx + "up_proj.weight", S, H, rank * sl, sl, 0, H, sl);
        place(x + "down_proj.weight", hx + "down_proj.weight", H, S, 0, H, rank * sl, sl, 0);
      }
      auto [w13, p13] = dst(p + "mlp.experts.w13_weight");
      auto [w2, p2] = dst(p + "mlp.experts.w2_weight");
      // FP8: per expert, codes [2*il, H] then scales [2*ceil(il/bn), ceil(H/bk)] (w13) and [H, il] / [ceil(H/bn),
      // ceil(il/bk)] (w2); the up half's scales start at row ceil(il/bn).
      const size_t wsz = fp8 ? 1 : esz;
      const int64_t bn = std::max<int64_t>(c.fp8_bn, 1), bk = std::max<int64_t>(c.fp8_bk, 1);
      const int64_t s13r = 2 * ((il + bn - 1) / bn), s13c = (H + bk - 1) / bk;
      const int64_t s2r = (H + bn - 1) / bn, s2c = (il + bk - 1) / bk;
      uint8_t* sc13 = fp8 ? dst(p + "mlp.experts.w13_weight_scale_inv").first : nullptr;
      uint8_t* sc2 = fp8 ? dst(p + "mlp.experts.w2_weight_scale_inv").first : nullptr;
      for (int64_t e = 0; e < el; ++e) {
        const std::string x = absl::StrCat(hp, "mlp.experts.", group * el + e, ".");
        uint8_t* d13 = w13 + static_cast<size_t>(e * 2 * il * H) * wsz;
        uint8_t* e13 = fp8 ? sc13 + static_cast<size_t>(e * s13r * s13c) * 4 : nullptr;
        place_at(d13, H, 0, e13, s13c, 0, x + "gate_proj.weight", I, H, part * il, il, 0, H);
        place_at(d13, H, il, e13, s13c, s13r / 2, x + "up_proj.weight", I, H, part * il, il, 0, H);
        uint8_t* e2 = fp8 ? sc2 + static_cast<size_t>(e * s2r * s2c) * 4 : nullptr;
        place_at(w2 + static_cast<size_t>(e * H * il) * wsz, il, 0, e2, s2c, 0, x + "down_proj.weight", H, I, 0, H,
                 part * il, il);
      }
    } else {
      const int64_t I = c.inter, Il = c.inter / tp;
      place(p + "mlp.gate_up_proj.weight", hp + "mlp.gate_proj.weight", I, H, rank * Il, Il, 0, H, 0);
      place(p + "mlp.gate_up_proj.weight", hp + "mlp.up_proj.weight", I, H, rank * Il, Il, 0, H, Il);
      place(p + "mlp.down_proj.weight", hp + "mlp.down_proj.weight", H, I, 0, H, rank * Il, Il, 0);
    }
    replicated(hp + "input_layernorm.weight", p + "input_layernorm.weight", H);
    replicated(hp + "post_attention_layernorm.weight", p + "post_attention_layernorm.weight", H);
  };
  vocab_parallel("model.embed_tokens.weight");
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    load_layer(p, p, c.moe_layer(i));
  }
  replicated("model.norm.weight", "model.norm.weight", H);
  if (!c.tied) vocab_parallel("lm_head.weight");
  if (c.draft) {
    // The next-n draft from the checkpoint's layer `layers` (SGLang's NextN rename): its own norms and eh_proj, the
    // layer as an MoE decoder layer; its embed_tokens and shared_head.head are not loaded (the target's serve).
    const std::string hp = absl::StrCat("model.layers.", c.layers, ".");
    replicated(hp + "enorm.weight", "model.enorm.weight", H);
    replicated(hp + "hnorm.weight", "model.hnorm.weight", H);
    {
      auto [d, prm] = dst("model.eh_proj.weight");  // whole on every rank, the model dtype even with FP8
      CopyBlock(gen(hp + "eh_proj.weight", H, 2 * H), 2 * H, 0, H, 0, 2 * H, esz, d, 2 * H, 0);
    }
    load_layer("model.decoder.", hp, true);
    replicated(hp + "shared_head.norm.weight", "model.shared_head.norm.weight", H);
  }
  return missing;
}

}  // namespace wsync::engine_ref
