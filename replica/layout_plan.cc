#include "replica/layout_plan.h"

#include <algorithm>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "base/status.h"

namespace wsync::replica {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A slice of one HF linear weight ([out, in]) and where it lands in the engine parameter.
struct Piece {
  std::string hf_prefix;  // "model.layers.0.self_attn.q_proj." (+ "weight" / "weight_scale_inv" / "bias")
  int64_t hf_rows = 0, hf_cols = 0;
  int64_t src_row0 = 0, src_col0 = 0, rows = 0, cols = 0;
  int64_t dst_row0 = 0, dst_col0 = 0;
  int64_t expert = 0;
  int64_t scale_dst_row0 = -1;  // -1: dst_row0 / block_n (must then be whole blocks)
};

class Walker {
 public:
  Walker(const ModelConfig& c, const RankParallelism& r, const QuantSpec& q, const PlanOptions& o)
      : c_(c), r_(r), q_(q), o_(o), fp8_(q.mode == QuantSpec::Mode::kFp8Block), bn_(q.block_n), bk_(q.block_k) {}

  absl::Status Run();
  LayoutPlan TakePlan() { return std::move(plan_); }

 private:
  // `name` is the checkpoint's (what the sources read); a draft's parameters take SGLang's draft names.
  int AddParam(std::string name, DType dtype, std::vector<int64_t> shape) {
    EngineParam p;
    p.name = separate_draft_ ? SeparateDraftParamName(name)
             : drafting_      ? DraftParamName(c_, name, r_.dialect)
                              : std::move(name);
    p.dtype = dtype;
    p.shape = std::move(shape);
    uint64_t n = DTypeSize(dtype);
    for (int64_t d : p.shape) n *= static_cast<uint64_t>(d);
    p.bytes = n;
    plan_.table.Add(std::move(p));
    plan_.expected.push_back(0);
    return static_cast<int>(plan_.table.params().size()) - 1;
  }

  void AddSource(SliceSource s) {
    plan_.expected[s.param]++;
    if (s.kind == SliceSource::Kind::kFp8Weight) plan_.expected[s.scale_param]++;
    plan_.sources.push_back(std::move(s));
  }

  // A parameter filled by one whole HF tensor of the same shape (norms, router, replicated vectors); the checkpoint
  // may hold it in another dtype (hf_dtype, kInvalid: the parameter's), converted when loaded.
  void Replicated(const std::string& name, std::vector<int64_t> shape, DType dtype, DType hf_dtype = DType::kInvalid) {
    const int p = AddParam(name, dtype, shape);
    SliceSource s;
    s.hf_name = name;
    s.hf_shape = shape;
    s.hf_dtype = hf_dtype == DType::kInvalid ? dtype : hf_dtype;
    s.param = p;
    s.rows = shape[0];
    s.cols = shape.size() > 1 ? shape[1] : 1;
    AddSource(std::move(s));
  }

  absl::Status Linear(const std::string& prefix, int64_t experts, int64_t out, int64_t in, bool quantizable,
                      const std::vector<Piece>& pieces, int64_t scale_rows = -1);
  void Bias(const std::string& name, int64_t out, const std::vector<Piece>& pieces);
  // vocab 0: the config's vocab_size
  absl::Status Embedding(const std::string& name, int tp, int rank, int64_t vocab = 0);
  // qkv_in 0: hidden_size (an EAGLE-3 layer's qkv_proj takes [embedding; hidden state], 2 × hidden_size)
  absl::Status Mha(const std::string& p, int64_t qkv_in = 0);
  absl::Status Mla(const std::string& p);
  absl::Status DenseMlp(const std::string& p, int64_t inter, bool fused_checkpoint);
  absl::Status Moe(const std::string& p);
  absl::Status CheckRank() const;
  absl::Status Draft();
  absl::Status SeparateDraft();
  // Walks a separate draft's own parameters (this walker's config is the draft's; `target` the target's).
  absl::Status Eagle3(const ModelConfig& target);
  absl::Status Adapter();

  // The vLLM dialect covers what has been compared with vLLM's own named_parameters() (tests/data/vllm,
  // tests/engines) or its own loaders (tests/replica/vllm_oracle.py): dense Llama/Qwen2/Qwen3, Qwen3-MoE and
  // DeepSeek-V3 (MLA with q_lora, its MTP draft), GLM-4.5/4.6 MoE (its MTP draft), unquantized; DeepSeek-V3 also
  // block-FP8 (vLLM's Fp8Config:
  // weight + float32 weight_scale_inv, the same names and block geometry as SGLang's, no KV-cache scale scalars on
  // its MLA attention). Anything else fails before any write.
  absl::Status CheckVllmSupport() const {
    const bool deepseek_ok = c_.family == Family::kDeepseekV2V3 && c_.q_lora_rank > 0 && !c_.router_fp32;
    const bool family_ok = c_.family == Family::kLlama || c_.family == Family::kQwen2 ||
                           c_.family == Family::kQwen3 || c_.family == Family::kQwen3Moe ||
                           c_.family == Family::kGlm4Moe || deepseek_ok;
    if (!family_ok)
      return absl::UnimplementedError(absl::StrCat("the vLLM layout of ", c_.architecture,
                                                   " has not been checked against vLLM's named_parameters(); "
                                                   "supported for vLLM: Llama, Qwen2, Qwen3, Qwen3-MoE, GLM-4.5/4.6 "
                                                   "MoE, DeepSeek-V3 (q_lora_rank set, bf16 router)"));
    if ((fp8_ || !c_.weight_block_size.empty()) && !deepseek_ok)
      return absl::UnimplementedError(absl::StrCat(
          "FP8 block-quantized layouts for vLLM engines have been checked for DeepSeek-V3 only, not for ",
          c_.architecture));
    return absl::OkStatus();
  }

  absl::Status Divisible(int64_t a, int64_t b, absl::string_view what) const {
    if (b <= 0 || a % b != 0) {
      return absl::InvalidArgumentError(absl::StrCat(what, " (", a, ") is not divisible by ", b, " for rank tp=",
                                                     r_.tp_size, "/", r_.tp_rank, " ep=", r_.ep_size, "/", r_.ep_rank,
                                                     " attn_tp=", r_.attn_tp_size));
    }
    return absl::OkStatus();
  }

  const ModelConfig& c_;
  const RankParallelism r_;
  const QuantSpec q_;
  const PlanOptions o_;
  const bool fp8_;
  const int64_t bn_, bk_;
  bool drafting_ = false;  // walking the draft (its parameters take SGLang's draft names)
  bool separate_draft_ = false;  // walking a separate draft checkpoint (SeparateDraftParamName)
  LayoutPlan plan_;
};

absl::Status Walker::Linear(const std::string& prefix, int64_t experts, int64_t out, int64_t in, bool quantizable,
                            const std::vector<Piece>& pieces, int64_t scale_rows) {
  const bool quant = fp8_ && quantizable;
  std::vector<int64_t> shape = {out, in};
  if (experts > 0) shape.insert(shape.begin(), experts);
  const int w = AddParam(prefix + "weight", quant ? DType::kF8E4M3 : c_.dtype, shape);
  int sp = -1;
  if (quant) {
    std::vector<int64_t> sshape = {scale_rows >= 0 ? scale_rows : CeilDiv(out, bn_), CeilDiv(in, bk_)};
    if (experts > 0) sshape.insert(sshape.begin(), experts);
    sp = AddParam(prefix + "weight_scale_inv", DType::kF32, sshape);
  }
  for (const Piece& pc : pieces) {
    SliceSource s;
    s.hf_name = pc.hf_prefix + "weight";
    s.hf_shape = {pc.hf_rows, pc.hf_cols};
    s.hf_dtype = c_.dtype;
    s.param = w;
    s.src_row0 = pc.src_row0;
    s.src_col0 = pc.src_col0;
    s.rows = pc.rows;
    s.cols = pc.cols;
    s.expert = pc.expert;
    s.dst_row0 = pc.dst_row0;
    s.dst_col0 = pc.dst_col0;
    if (!quant) {
      AddSource(std::move(s));
      continue;
    }
    // Whole blocks only, in the source and in the destination: then quantizing the slice equals quantizing the
    // full tensor and slicing, and fp8 pass-through can slice the published scales (SGLang raises otherwise).
    const bool rows_ok = pc.src_row0 % bn_ == 0 && (pc.rows % bn_ == 0 || pc.src_row0 + pc.rows == pc.hf_rows) &&
                         (pc.scale_dst_row0 >= 0 || pc.dst_row0 % bn_ == 0);
    const bool cols_ok = pc.src_col0 % bk_ == 0 && (pc.cols % bk_ == 0 || pc.src_col0 + pc.cols == pc.hf_cols) &&
                         pc.dst_col0 % bk_ == 0;
    if (o_.check_blocks && (!rows_ok || !cols_ok)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "FP8 block ", bn_, "x", bk_, ": the shard of '", s.hf_name, "' for '", prefix, "weight' (rows [", pc.src_row0,
          ", ", pc.src_row0 + pc.rows, ") cols [", pc.src_col0, ", ", pc.src_col0 + pc.cols, ") of [", pc.hf_rows, ", ",
          pc.hf_cols, "], at row ", pc.dst_row0, ") is not made of whole blocks at tp=", r_.tp_size,
          " ep=", r_.ep_size, "; use a smaller weight block size"));
    }
    s.kind = SliceSource::Kind::kFp8Weight;
    s.scale_param = sp;
    s.scale_dst_row0 = pc.scale_dst_row0 >= 0 ? pc.scale_dst_row0 : pc.dst_row0 / bn_;
    s.scale_dst_col0 = pc.dst_col0 / bk_;
    s.scale_src_row0 = pc.src_row0 / bn_;
    s.scale_src_col0 = pc.src_col0 / bk_;

    SliceSource sc;
    sc.kind = SliceSource::Kind::kFp8Scale;
    sc.hf_name = pc.hf_prefix + "weight_scale_inv";
    sc.hf_shape = {CeilDiv(pc.hf_rows, bn_), CeilDiv(pc.hf_cols, bk_)};
    sc.hf_dtype = DType::kF32;
    sc.param = sp;
    sc.src_row0 = s.scale_src_row0;
    sc.src_col0 = s.scale_src_col0;
    sc.rows = CeilDiv(pc.src_row0 + pc.rows, bn_) - sc.src_row0;
    sc.cols = CeilDiv(pc.src_col0 + pc.cols, bk_) - sc.src_col0;
    sc.expert = pc.expert;
    sc.dst_row0 = s.scale_dst_row0;
    sc.dst_col0 = s.scale_dst_col0;
    // The scale slot is counted once per weight slice (see AddSource), so the scale source adds nothing.
    plan_.sources.push_back(std::move(s));
    plan_.expected[w]++;
    plan_.expected[sp]++;
    plan_.sources.push_back(std::move(sc));
  }
  return absl::OkStatus();
}

void Walker::Bias(const std::string& name, int64_t out, const std::vector<Piece>& pieces) {
  const int b = AddParam(name, c_.dtype, {out});
  for (const Piece& pc : pieces) {
    SliceSource s;
    s.hf_name = pc.hf_prefix + "bias";
    s.hf_shape = {pc.hf_rows};
    s.hf_dtype = c_.dtype;
    s.param = b;
    s.src_row0 = pc.src_row0;
    s.rows = pc.rows;
    s.cols = 1;
    s.dst_row0 = pc.dst_row0;
    AddSource(std::move(s));
  }
}

// VocabParallelEmbedding / ParallelLMHead: vocab padded to a multiple of 64, split evenly; padding rows stay zero.
absl::Status Walker::Embedding(const std::string& name, int tp, int rank, int64_t vocab) {
  const int64_t v = vocab > 0 ? vocab : c_.vocab_size, h = c_.hidden_size;
  const int64_t vp = CeilDiv(v, 64) * 64;
  WSYNC_RETURN_IF_ERROR(Divisible(vp, tp, absl::StrCat(name, ": padded vocab")));
  const int64_t per = vp / tp, start = rank * per;
  const int64_t n = std::max<int64_t>(0, std::min(per, v - start));
  const int p = AddParam(name, c_.dtype, {per, h});
  if (n > 0) {
    SliceSource s;
    s.hf_name = name;
    s.hf_shape = {v, h};
    s.hf_dtype = c_.dtype;
    s.param = p;
    s.src_row0 = start;
    s.rows = n;
    s.cols = h;
    AddSource(std::move(s));
  }
  return absl::OkStatus();
}

absl::Status Walker::Mha(const std::string& p, int64_t qkv_in) {
  // SGLang's Llama, Qwen2 and GLM4 (dense) attention shard over the whole TP group even with DP attention; Qwen3,
  // Qwen3-MoE and GLM4-MoE over the attention-TP group.
  const bool full_tp = c_.family == Family::kLlama || c_.family == Family::kQwen2 || c_.family == Family::kGlm4;
  const int64_t atp = full_tp ? r_.tp_size : r_.attn_tp_size, ar = full_tp ? r_.tp_rank : r_.attn_tp_rank;
  const int64_t d = c_.head_dim, h = c_.hidden_size, in = qkv_in > 0 ? qkv_in : h;
  const int64_t heads = c_.num_heads, kv = c_.num_kv_heads;
  WSYNC_RETURN_IF_ERROR(Divisible(heads, atp, "num_attention_heads"));
  const int64_t hl = heads / atp;
  int64_t kvl, kv0;
  if (atp >= kv) {
    // More ranks than KV heads: each KV head is replicated on atp/kv consecutive ranks.
    WSYNC_RETURN_IF_ERROR(Divisible(atp, kv, "attention tp size vs num_key_value_heads"));
    kvl = 1;
    kv0 = ar / (atp / kv);
  } else {
    WSYNC_RETURN_IF_ERROR(Divisible(kv, atp, "num_key_value_heads"));
    kvl = kv / atp;
    kv0 = ar * kvl;
  }
  const std::string a = p + "self_attn.";
  std::vector<Piece> qkv = {
      {a + "q_proj.", heads * d, in, ar * hl * d, 0, hl * d, in, 0, 0},
      {a + "k_proj.", kv * d, in, kv0 * d, 0, kvl * d, in, hl * d, 0},
      {a + "v_proj.", kv * d, in, kv0 * d, 0, kvl * d, in, (hl + kvl) * d, 0},
  };
  WSYNC_RETURN_IF_ERROR(Linear(a + "qkv_proj.", 0, (hl + 2 * kvl) * d, in, true, qkv));
  if (c_.attention_bias) Bias(a + "qkv_proj.bias", (hl + 2 * kvl) * d, qkv);
  WSYNC_RETURN_IF_ERROR(
      Linear(a + "o_proj.", 0, h, hl * d, true, {{a + "o_proj.", h, heads * d, 0, ar * hl * d, h, hl * d, 0, 0}}));
  // Llama's attention_bias also covers o_proj (row-parallel: the bias is replicated).
  if (c_.attention_bias && c_.family == Family::kLlama) Replicated(a + "o_proj.bias", {h}, c_.dtype);
  if (c_.qk_norm) {
    Replicated(a + "q_norm.weight", {d}, c_.dtype);
    Replicated(a + "k_norm.weight", {d}, c_.dtype);
  }
  return absl::OkStatus();
}

absl::Status Walker::Mla(const std::string& p) {
  const int64_t atp = r_.attn_tp_size, ar = r_.attn_tp_rank, h = c_.hidden_size, heads = c_.num_heads;
  const int64_t qk = c_.qk_nope_head_dim + c_.qk_rope_head_dim, kvr = c_.kv_lora_rank, rope = c_.qk_rope_head_dim;
  const int64_t nv = c_.qk_nope_head_dim + c_.v_head_dim, v = c_.v_head_dim;
  WSYNC_RETURN_IF_ERROR(Divisible(heads, atp, "num_attention_heads"));
  const int64_t hl = heads / atp;
  const std::string a = p + "self_attn.";
  if (c_.q_lora_rank > 0) {
    const int64_t ql = c_.q_lora_rank;
    // ReplicatedLinear holding q_a_proj and kv_a_proj_with_mqa concatenated along dim 0 (vLLM names it
    // fused_qkv_a_proj).
    const char* fused = r_.dialect == EngineDialect::kVllm ? "fused_qkv_a_proj." : "fused_qkv_a_proj_with_mqa.";
    WSYNC_RETURN_IF_ERROR(Linear(a + fused, 0, ql + kvr + rope, h, true,
                                 {{a + "q_a_proj.", ql, h, 0, 0, ql, h, 0, 0},
                                  {a + "kv_a_proj_with_mqa.", kvr + rope, h, 0, 0, kvr + rope, h, ql, 0}}));
    Replicated(a + "q_a_layernorm.weight", {ql}, c_.dtype);
    WSYNC_RETURN_IF_ERROR(Linear(a + "q_b_proj.", 0, hl * qk, ql,
                                 true, {{a + "q_b_proj.", heads * qk, ql, ar * hl * qk, 0, hl * qk, ql, 0, 0}}));
  } else {
    WSYNC_RETURN_IF_ERROR(
        Linear(a + "q_proj.", 0, hl * qk, h, true, {{a + "q_proj.", heads * qk, h, ar * hl * qk, 0, hl * qk, h, 0, 0}}));
    WSYNC_RETURN_IF_ERROR(Linear(a + "kv_a_proj_with_mqa.", 0, kvr + rope, h, true,
                                 {{a + "kv_a_proj_with_mqa.", kvr + rope, h, 0, 0, kvr + rope, h, 0, 0}}));
  }
  Replicated(a + "kv_a_layernorm.weight", {kvr}, c_.dtype);
  WSYNC_RETURN_IF_ERROR(Linear(a + "kv_b_proj.", 0, hl * nv, kvr, true,
                               {{a + "kv_b_proj.", heads * nv, kvr, ar * hl * nv, 0, hl * nv, kvr, 0, 0}}));
  WSYNC_RETURN_IF_ERROR(
      Linear(a + "o_proj.", 0, h, hl * v, true, {{a + "o_proj.", h, heads * v, 0, ar * hl * v, h, hl * v, 0, 0}}));
  if (fp8_ && r_.dialect == EngineDialect::kSglang) {
    // Under an FP8 quantization config SGLang's two MLA RadixAttention modules get FP8 KV-cache scales: float32
    // scalars created at -1 and set to 1.0 after loading (the checkpoint has none); ready with the layer's kv_b_proj.
    for (const char* attn : {"attn_mqa.", "attn_mha."}) {
      for (const char* scale : {"k_scale", "v_scale"}) {
        SliceSource k;
        k.kind = SliceSource::Kind::kConstant;
        k.hf_name = a + "kv_b_proj.weight";
        k.hf_shape = {heads * nv, kvr};
        k.hf_dtype = c_.dtype;
        k.param = AddParam(absl::StrCat(a, attn, scale), DType::kF32, {});
        k.rows = k.cols = 1;
        k.value = 1.0f;
        AddSource(std::move(k));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Walker::DenseMlp(const std::string& m, int64_t inter, bool fused_checkpoint) {
  const int64_t tp = r_.tp_size, tr = r_.tp_rank, h = c_.hidden_size;
  WSYNC_RETURN_IF_ERROR(Divisible(inter, tp, absl::StrCat(m, " intermediate size")));
  const int64_t il = inter / tp;
  std::vector<Piece> gu;
  if (fused_checkpoint) {
    // GLM4 stores gate_up_proj already fused ([gate; up]); SGLang splits it by output_sizes and shards each half.
    gu = {{m + "gate_up_proj.", 2 * inter, h, tr * il, 0, il, h, 0, 0},
          {m + "gate_up_proj.", 2 * inter, h, inter + tr * il, 0, il, h, il, 0}};
  } else {
    gu = {{m + "gate_proj.", inter, h, tr * il, 0, il, h, 0, 0}, {m + "up_proj.", inter, h, tr * il, 0, il, h, il, 0}};
  }
  WSYNC_RETURN_IF_ERROR(Linear(m + "gate_up_proj.", 0, 2 * il, h, true, gu));
  WSYNC_RETURN_IF_ERROR(
      Linear(m + "down_proj.", 0, h, il, true, {{m + "down_proj.", h, inter, 0, tr * il, h, il, 0, 0}}));
  return absl::OkStatus();
}

absl::Status Walker::Moe(const std::string& p) {
  const int64_t e = c_.num_experts, h = c_.hidden_size, mi = c_.moe_intermediate_size;
  const std::string m = p + "mlp.";
  Replicated(m + "gate.weight", {e, h}, c_.router_fp32 ? DType::kF32 : c_.dtype, c_.dtype);
  if (c_.router_bias) Replicated(m + "gate.e_score_correction_bias", {e}, DType::kF32);

  WSYNC_RETURN_IF_ERROR(Divisible(e, r_.ep_size, "n_routed_experts"));
  const int64_t n = e / r_.ep_size, fused = r_.num_fused_shared_experts, el = n + fused;
  WSYNC_RETURN_IF_ERROR(Divisible(mi, r_.moe_tp_size, "moe_intermediate_size"));
  const int64_t is = mi / r_.moe_tp_size, i0 = r_.moe_tp_rank * is;
  const int64_t up_scale_row = CeilDiv(is, bn_);
  std::vector<Piece> w13, w2;
  for (int64_t le = 0; le < el; ++le) {
    const std::string hf = le < n ? absl::StrCat(m, "experts.", r_.ep_rank * n + le, ".") : m + "shared_experts.";
    w13.push_back({hf + "gate_proj.", mi, h, i0, 0, is, h, 0, 0, le, 0});
    w13.push_back({hf + "up_proj.", mi, h, i0, 0, is, h, is, 0, le, up_scale_row});
    w2.push_back({hf + "down_proj.", h, mi, 0, i0, h, is, 0, 0, le});
  }
  // vLLM keeps the stacked routed-expert weights in a RoutedExperts submodule of FusedMoE.
  const std::string ex = r_.dialect == EngineDialect::kVllm ? m + "experts.routed_experts." : m + "experts.";
  WSYNC_RETURN_IF_ERROR(Linear(ex + "w13_", el, 2 * is, h, true, w13, 2 * up_scale_row));
  WSYNC_RETURN_IF_ERROR(Linear(ex + "w2_", el, h, is, true, w2));
  if (c_.num_shared_experts > 0 && fused == 0) {
    WSYNC_RETURN_IF_ERROR(DenseMlp(m + "shared_experts.", mi * c_.num_shared_experts, false));
  }
  return absl::OkStatus();
}

absl::Status Walker::CheckRank() const {
  const RankParallelism& r = r_;
  if (r.pp_size != 1) return absl::UnimplementedError("pipeline-parallel engines (pp_size > 1) are not supported");
  if (r.tp_size <= 0 || r.tp_rank < 0 || r.tp_rank >= r.tp_size || r.ep_size <= 0 || r.tp_size % r.ep_size != 0 ||
      r.moe_tp_size * r.ep_size != r.tp_size || r.ep_rank < 0 || r.ep_rank >= r.ep_size || r.moe_tp_rank < 0 ||
      r.moe_tp_rank >= r.moe_tp_size || r.attn_tp_size <= 0 || r.attn_tp_rank < 0 ||
      r.attn_tp_rank >= r.attn_tp_size || r.attn_tp_size * r.attn_dp_size != r.tp_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "inconsistent rank parallelism: tp=", r.tp_size, "/", r.tp_rank, " ep=", r.ep_size, "/", r.ep_rank, " moe_tp=",
        r.moe_tp_size, "/", r.moe_tp_rank, " attn_tp=", r.attn_tp_size, "/", r.attn_tp_rank, " attn_dp=",
        r.attn_dp_size, " (need tp = ep * moe_tp = attn_tp * attn_dp and ranks in range)"));
  }
  if (fp8_ && (bn_ <= 0 || bk_ <= 0)) return absl::InvalidArgumentError("FP8 block size must be positive");
  if (r.dialect == EngineDialect::kVllm) WSYNC_RETURN_IF_ERROR(CheckVllmSupport());
  if (o_.check_blocks && r.dialect == EngineDialect::kSglang && c_.family == Family::kQwen3Moe &&
      (!c_.mlp_only_layers.empty() || c_.moe_layer_freq != 1)) {
    // SGLang 0.5.23's Qwen3-MoE decoder layers are all sparse (mlp_only_layers and decoder_sparse_step are ignored),
    // so such a checkpoint's dense layers have no parameter to land in.
    return absl::UnimplementedError(
        "Qwen3-MoE with mlp_only_layers or decoder_sparse_step != 1: SGLang builds every layer as MoE and cannot "
        "load this checkpoint's dense layers");
  }
  if (r.num_fused_shared_experts != 0 &&
      (r.num_fused_shared_experts != c_.num_shared_experts || c_.num_experts == 0 || r.num_fused_shared_experts != 1)) {
    return absl::InvalidArgumentError(absl::StrCat("shared-expert fusion of ", r.num_fused_shared_experts,
                                                   " experts needs a MoE model with exactly one shared expert, as "
                                                   "SGLang fuses only one (", c_.architecture, " has ",
                                                   c_.num_shared_experts, ")"));
  }
  return absl::OkStatus();
}

// SGLang 0.5.23's NextN draft (deepseek_nextn.py, glm4_moe_nextn.py, glm4_moe_lite_nextn.py): embed_tokens (the
// target's), enorm, hnorm, eh_proj, one decoder layer built as layer 0 with is_nextn (so always MoE),
// shared_head.norm, lm_head (the target's). Walked under the checkpoint's names; AddParam renames.
absl::Status Walker::Draft() {
  if (c_.separate_draft) return SeparateDraft();
  const int64_t d = DraftLayerIndex(c_);
  if (d < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        c_.architecture, " (model_type '", c_.model_type, "') has no draft to update: its config.json declares no "
        "next-n / MTP layer (num_nextn_predict_layers)"));
  }
  if (c_.num_nextn_predict_layers != 1) {
    return absl::UnimplementedError(absl::StrCat(c_.architecture, " declares ", c_.num_nextn_predict_layers,
                                                 " next-n layers; SGLang's NextN drafts load exactly one"));
  }
  const bool family_ok =
      c_.family == Family::kDeepseekV2V3 || c_.family == Family::kGlm4Moe || c_.family == Family::kGlm4MoeLite;
  if (!family_ok || c_.num_experts == 0) {
    return absl::UnimplementedError(absl::StrCat(
        "the draft layout of ", c_.architecture, " has not been checked against SGLang's NextN classes; drafts are "
        "supported for DeepSeek-V3 (DeepseekV3ForCausalLMNextN), GLM-4.5/4.6 MoE (Glm4MoeForCausalLMNextN) and "
        "GLM-4.7-Flash (Glm4MoeLiteForCausalLMNextN)"));
  }
  // vLLM 0.32's DeepSeekMTP (deepseek_mtp.py) holds the same tensors under the checkpoint's own layer index
  // (model.layers.<L>.{enorm,hnorm,eh_proj,shared_head.norm}, the decoder layer as model.layers.<L>.mtp_block.*),
  // its decoder layer built as layer L (MoE by the config's rule); it too shares the target's embedding and LM head
  // (its proposer's _maybe_share_embeddings / _maybe_share_lm_head). vLLM's Glm4MoeMTP (glm4_moe_mtp.py) holds
  // GLM-4.5/4.6's MTP layer under the same names (its mtp_block a Glm4MoeDecoderLayer). Checked for these two.
  const bool vllm = r_.dialect == EngineDialect::kVllm;
  if (vllm && ((c_.family != Family::kDeepseekV2V3 && c_.family != Family::kGlm4Moe) || d != c_.num_layers)) {
    return absl::UnimplementedError(absl::StrCat(
        "the vLLM draft layout of ", c_.architecture, " has not been checked against vLLM's drafter; drafts are "
        "supported for vLLM with DeepSeek-V3 (DeepSeekMTP) and GLM-4.5/4.6 MoE (Glm4MoeMTP), the MTP layer after "
        "the target's layers"));
  }
  const std::string p = absl::StrCat("model.layers.", d, ".");
  const int64_t h = c_.hidden_size;
  plan_.first_draft = static_cast<int>(plan_.table.params().size());
  plan_.table.set_first_draft(plan_.first_draft);
  Replicated(p + "enorm.weight", {h}, c_.dtype);
  Replicated(p + "hnorm.weight", {h}, c_.dtype);
  // A plain nn.Linear(2h, h): replicated on every rank and never quantized (the FP8 checkpoints store it bf16).
  WSYNC_RETURN_IF_ERROR(Linear(p + "eh_proj.", 0, h, 2 * h, false, {{p + "eh_proj.", h, 2 * h, 0, 0, h, 2 * h, 0, 0}}));
  WSYNC_RETURN_IF_ERROR(c_.is_mla() ? Mla(p) : Mha(p));
  if (vllm && !c_.IsMoeLayer(d)) {
    WSYNC_RETURN_IF_ERROR(DenseMlp(p + "mlp.", c_.intermediate_size, false));
  } else {
    WSYNC_RETURN_IF_ERROR(Moe(p));
  }
  Replicated(p + "input_layernorm.weight", {h}, c_.dtype);
  Replicated(p + "post_attention_layernorm.weight", {h}, c_.dtype);
  Replicated(p + "shared_head.norm.weight", {h}, c_.dtype);
  return absl::OkStatus();
}

// A draft that is a checkpoint of its own (ModelConfig::separate_draft): vLLM 0.32's EAGLE-3 drafter of Llama-style
// layers (llama_eagle3.py, Eagle3LlamaForCausalLM; vLLM picks it for LlamaForCausalLMEagle3 / Eagle3LlamaForCausalLM
// drafts under `"method": "eagle3"`, whatever the target). Everything that has not been compared with it is refused
// before any write, naming why.
absl::Status Walker::SeparateDraft() {
  const ModelConfig::SeparateDraft& sd = *c_.separate_draft;
  const std::string who = absl::StrCat("the ", sd.method, " draft ", sd.architecture, " of ", c_.architecture);
  // (a checkpoint listing, check_blocks false, is the trainer's side and has no engine dialect)
  if (o_.check_blocks && r_.dialect != EngineDialect::kVllm)
    return absl::UnimplementedError(absl::StrCat(who, ": separate draft checkpoints are planned for vLLM engines only "
                                                 "(SGLang's EAGLE drafters have not been compared)"));
  if (sd.method == "eagle")
    return absl::UnimplementedError(absl::StrCat(
        who, ": EAGLE-1 drafts (method \"eagle\", vLLM's llama_eagle.py: another fc and no hidden_norm) have not "
        "been compared with vLLM's drafter; EAGLE-3 drafts (method \"eagle3\") are supported"));
  if (sd.method != "eagle3")
    return absl::UnimplementedError(absl::StrCat(who, ": the speculative method '", sd.method,
                                                 "' with a draft checkpoint of its own is not supported (eagle3 is)"));
  if (sd.config->family != Family::kLlama)
    return absl::UnimplementedError(absl::StrCat(
        who, ": only EAGLE-3 drafts of Llama-style layers (LlamaForCausalLMEagle3, Eagle3LlamaForCausalLM: vLLM's "
        "Eagle3LlamaForCausalLM) have been compared with vLLM"));
  const bool target_ok = c_.family == Family::kLlama || c_.family == Family::kQwen2 || c_.family == Family::kQwen3 ||
                         c_.family == Family::kQwen3Moe;
  if (!target_ok)
    return absl::UnimplementedError(
        absl::StrCat(who, ": EAGLE-3 drafts are planned for Llama, Qwen2, Qwen3 and Qwen3-MoE targets"));
  if (!sd.unchecked.empty())
    return absl::UnimplementedError(absl::StrCat(who, ": its config sets ", absl::StrJoin(sd.unchecked, ", "),
                                                 ", which has not been compared with vLLM's Eagle3LlamaForCausalLM"));
  if (o_.check_blocks && (fp8_ || !c_.weight_block_size.empty()))
    return absl::UnimplementedError(
        absl::StrCat(who, ": FP8 engines with a separate draft checkpoint have not been compared with vLLM"));
  if (!sd.own_lm_head && sd.draft_vocab_size != c_.vocab_size)
    return absl::InvalidArgumentError(absl::StrCat(who, ": the engine reports the draft sharing the target's LM head, "
                                                   "but its draft_vocab_size ", sd.draft_vocab_size,
                                                   " is not the target's vocab_size ", c_.vocab_size));
  Walker sub(*sd.config, r_, QuantSpec{}, o_);  // an unquantized draft (FP8 is refused above)
  sub.drafting_ = sub.separate_draft_ = true;
  WSYNC_RETURN_IF_ERROR(sub.Eagle3(c_));
  LayoutPlan d = sub.TakePlan();
  const int base = static_cast<int>(plan_.table.params().size());
  plan_.first_draft = base;
  plan_.table.set_first_draft(base);
  for (const EngineParam& p : d.table.params()) plan_.table.Add(p);
  for (SliceSource& s : d.sources) {
    s.param += base;
    if (s.scale_param >= 0) s.scale_param += base;
    plan_.sources.push_back(std::move(s));
  }
  plan_.expected.insert(plan_.expected.end(), d.expected.begin(), d.expected.end());
  return absl::OkStatus();
}

// Eagle3LlamaForCausalLM's parameters: one Llama decoder layer (`midlayer.`, loaded as model.layers.0.) whose qkv_proj
// takes [embedding; hidden state] (2h) and which adds hidden_norm; fc (a ReplicatedLinear from the target's auxiliary
// hidden states to h: whole on every rank, unquantized here); the final norm; lm_head, a ParallelLMHead of
// draft_vocab_size rows (padded to 64, split over TP like the target's); draft_id_to_target_id (the checkpoint's d2t),
// an int64 nn.Parameter of draft_vocab_size entries, replicated, present only when draft_vocab_size differs from the
// target's vocab. The embedding and LM head are planned only where the draft keeps its own (the proposer points the
// draft at the target's otherwise); the checkpoint's t2d is not loaded by vLLM and not planned.
absl::Status Walker::Eagle3(const ModelConfig& target) {
  const ModelConfig::SeparateDraft& sd = *target.separate_draft;
  const int64_t h = c_.hidden_size;
  const std::string d(kDraftTensorPrefix), p = d + "midlayer.";
  if (sd.own_embed_tokens) WSYNC_RETURN_IF_ERROR(Embedding(d + "embed_tokens.weight", r_.tp_size, r_.tp_rank));
  WSYNC_RETURN_IF_ERROR(Mha(p, 2 * h));
  WSYNC_RETURN_IF_ERROR(DenseMlp(p + "mlp.", c_.intermediate_size, false));
  Replicated(p + "input_layernorm.weight", {h}, c_.dtype);
  Replicated(p + "hidden_norm.weight", {h}, c_.dtype);
  Replicated(p + "post_attention_layernorm.weight", {h}, c_.dtype);
  WSYNC_RETURN_IF_ERROR(Linear(d + "fc.", 0, h, sd.fc_in, false, {{d + "fc.", h, sd.fc_in, 0, 0, h, sd.fc_in, 0, 0}}));
  Replicated(d + "norm.weight", {h}, c_.dtype);
  if (sd.own_lm_head)
    WSYNC_RETURN_IF_ERROR(Embedding(d + "lm_head.weight", r_.tp_size, r_.tp_rank, sd.draft_vocab_size));
  if (sd.draft_vocab_size != target.vocab_size) Replicated(d + "d2t", {sd.draft_vocab_size}, DType::kI64);
  return absl::OkStatus();
}

// A PEFT LoRA adapter over a dense decoder (ModelConfig::lora_adapter): per layer and target module, lora_A [r, in]
// and lora_B [out, r] under PEFT's names, in the model dtype, whole on every rank (vLLM loads the full adapter on each
// TP rank and slices it itself). In and out are the base module's, from the same config the base layout uses.
absl::Status Walker::Adapter() {
  const ModelConfig::LoraAdapter& a = *c_.lora_adapter;
  if (HoldsDraft(r_.weights))
    return absl::InvalidArgumentError("a LoRA adapter has no draft: adapter-only models sync the adapter alone");
  // (a checkpoint listing, check_blocks false, is the trainer's side and has no engine dialect)
  if (o_.check_blocks && r_.dialect != EngineDialect::kVllm)
    return absl::UnimplementedError(absl::StrCat(
        "LoRA adapter updates are supported for vLLM engines only (", DialectName(r_.dialect),
        " engines load adapters from disk paths; docs/engines.md, \"LoRA adapters\")"));
  const bool family_ok = c_.family == Family::kLlama || c_.family == Family::kQwen2 || c_.family == Family::kQwen3;
  if (!family_ok || c_.num_experts > 0 || c_.is_mla())
    return absl::UnimplementedError(absl::StrCat("LoRA adapters are supported over dense Llama, Qwen2 and Qwen3 "
                                                 "models; ", c_.architecture, " is not one"));
  const int64_t h = c_.hidden_size, q = c_.num_heads * c_.head_dim, kv = c_.num_kv_heads * c_.head_dim;
  const int64_t inter = c_.intermediate_size;
  struct Module {
    const char* name;
    const char* block;
    int64_t out, in;
  };
  const Module kModules[] = {{"q_proj", "self_attn", q, h},        {"k_proj", "self_attn", kv, h},
                             {"v_proj", "self_attn", kv, h},       {"o_proj", "self_attn", h, q},
                             {"gate_proj", "mlp", inter, h},       {"up_proj", "mlp", inter, h},
                             {"down_proj", "mlp", h, inter}};
  std::vector<const Module*> targets;
  for (const Module& m : kModules)
    if (std::find(a.target_modules.begin(), a.target_modules.end(), m.name) != a.target_modules.end())
      targets.push_back(&m);
  for (const std::string& t : a.target_modules) {
    const bool known = std::any_of(std::begin(kModules), std::end(kModules),
                                   [&](const Module& m) { return t == m.name; });
    if (!known)
      return absl::InvalidArgumentError(absl::StrCat(
          "LoRA target module '", t, "' is not a linear layer of ", c_.architecture,
          "'s decoder (its modules: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)"));
  }
  for (int64_t i = 0; i < c_.num_layers; ++i) {
    for (const Module* m : targets) {
      const std::string p = absl::StrCat("base_model.model.model.layers.", i, ".", m->block, ".", m->name, ".");
      Replicated(p + "lora_A.weight", {a.rank, m->in}, c_.dtype);
      Replicated(p + "lora_B.weight", {m->out, a.rank}, c_.dtype);
    }
  }
  return absl::OkStatus();
}

absl::Status Walker::Run() {
  WSYNC_RETURN_IF_ERROR(CheckRank());
  if (c_.lora_adapter) return Adapter();
  if (r_.weights == WeightSet::kDraft) {
    drafting_ = true;
    return Draft();
  }
  const RankParallelism& r = r_;
  // With DP attention SGLang 0.5.23 splits embed_tokens over the attention-TP group (use_attn_tp_group), except
  // Llama's, which stays on the whole TP group. (SGLANG_ENABLE_EMBED_REPLICATION, which replicates DeepSeek's
  // embedding instead, is not modelled.)
  const bool embed_attn_tp = r.attn_dp_size > 1 && c_.family != Family::kLlama;
  WSYNC_RETURN_IF_ERROR(Embedding("model.embed_tokens.weight", embed_attn_tp ? r.attn_tp_size : r.tp_size,
                                  embed_attn_tp ? r.attn_tp_rank : r.tp_rank));
  const int64_t h = c_.hidden_size;
  for (int64_t i = 0; i < c_.num_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    WSYNC_RETURN_IF_ERROR(c_.is_mla() ? Mla(p) : Mha(p));
    if (c_.IsMoeLayer(i)) {
      WSYNC_RETURN_IF_ERROR(Moe(p));
    } else {
      WSYNC_RETURN_IF_ERROR(DenseMlp(p + "mlp.", c_.intermediate_size, c_.family == Family::kGlm4));
    }
    Replicated(p + "input_layernorm.weight", {h}, c_.dtype);
    Replicated(p + "post_attention_layernorm.weight", {h}, c_.dtype);
    if (c_.family == Family::kGlm4) {
      Replicated(p + "post_self_attn_layernorm.weight", {h}, c_.dtype);
      Replicated(p + "post_mlp_layernorm.weight", {h}, c_.dtype);
    }
  }
  Replicated("model.norm.weight", {h}, c_.dtype);
  if (!c_.tie_word_embeddings) WSYNC_RETURN_IF_ERROR(Embedding("lm_head.weight", r.tp_size, r.tp_rank));
  if (r_.weights == WeightSet::kAll) {  // the draft's parameters after the target's, in the same table
    drafting_ = true;
    return Draft();
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<LayoutPlan> PlanLayout(const ModelConfig& config, const RankParallelism& rank, const QuantSpec& quant,
                                      const PlanOptions& options) {
  Walker w(config, rank, quant, options);
  WSYNC_RETURN_IF_ERROR(w.Run());
  return w.TakePlan();
}

int64_t DraftLayerIndex(const ModelConfig& config) {
  if (config.num_nextn_predict_layers <= 0) return -1;
  return config.num_layers == 1 ? 0 : config.num_layers;
}

std::string DraftParamName(const ModelConfig& config, absl::string_view hf_name, EngineDialect dialect) {
  const int64_t d = DraftLayerIndex(config);
  if (d < 0 || LayerIndexOf(hf_name) != d) return "";
  const std::string prefix = absl::StrCat("model.layers.", d, ".");
  const absl::string_view rest = hf_name.substr(prefix.size());
  if (absl::StartsWith(rest, "embed_tokens.") || absl::StartsWith(rest, "shared_head.head.")) return "";
  const bool vllm = dialect == EngineDialect::kVllm;
  for (absl::string_view own : {"enorm.", "hnorm.", "eh_proj.", "shared_head.norm."}) {
    if (absl::StartsWith(rest, own)) return vllm ? std::string(hf_name) : absl::StrCat("model.", rest);
  }
  return vllm ? absl::StrCat(prefix, "mtp_block.", rest) : absl::StrCat("model.decoder.", rest);
}

std::string SeparateDraftParamName(absl::string_view hf_name) {
  if (!absl::ConsumePrefix(&hf_name, kDraftTensorPrefix)) return "";
  std::string vllm;
  if (hf_name == "d2t") {
    vllm = "draft_id_to_target_id";
  } else if (absl::StartsWith(hf_name, "lm_head.")) {
    vllm = std::string(hf_name);
  } else if (absl::ConsumePrefix(&hf_name, "midlayer.")) {
    vllm = absl::StrCat("model.layers.0.", hf_name);
  } else {
    vllm = absl::StrCat("model.", hf_name);
  }
  return absl::StrCat(kDraftTensorPrefix, vllm);
}

int64_t LayerIndexOf(absl::string_view hf_name) {
  constexpr absl::string_view kPrefix = "model.layers.";
  if (!absl::StartsWith(hf_name, kPrefix)) return -1;
  hf_name.remove_prefix(kPrefix.size());
  const size_t dot = hf_name.find('.');
  int64_t i = -1;
  if (dot == absl::string_view::npos || !absl::SimpleAtoi(hf_name.substr(0, dot), &i)) return -1;
  return i;
}

absl::StatusOr<std::vector<TensorSpec>> CheckpointTensors(const ModelConfig& config) {
  return CheckpointTensors(config, CheckpointFormat::kTrainer);
}

absl::StatusOr<std::vector<TensorSpec>> CheckpointTensors(const ModelConfig& config, CheckpointFormat format,
                                                          int block_n, int block_k, WeightSet weights) {
  QuantSpec q;
  if (format == CheckpointFormat::kFp8PassThrough) {
    q.mode = QuantSpec::Mode::kFp8Block;
    q.block_n = block_n;
    q.block_k = block_k;
  }
  PlanOptions o;
  o.check_blocks = false;
  // Unsharded walk (tp=1, ep=1): every source is a whole HF tensor, in checkpoint order.
  RankParallelism whole = RankParallelism::ForTp(1, 0, 1);
  whole.weights = weights;
  WSYNC_ASSIGN_OR_RETURN(LayoutPlan plan, PlanLayout(config, whole, q, o));
  std::vector<TensorSpec> out;
  out.reserve(plan.sources.size());
  absl::flat_hash_set<absl::string_view> seen;
  for (const SliceSource& s : plan.sources) {
    if (s.kind == SliceSource::Kind::kConstant) continue;
    if (!seen.insert(s.hf_name).second) continue;  // GLM4's fused gate_up_proj feeds two slices
    TensorSpec t;
    t.name = s.hf_name;
    t.dtype = s.kind == SliceSource::Kind::kFp8Weight ? DType::kF8E4M3 : s.hf_dtype;
    t.shape = s.hf_shape;
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace wsync::replica
