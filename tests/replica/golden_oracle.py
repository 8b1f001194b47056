#!/usr/bin/env python3
"""Independent numpy model of the engine-side (SGLang) parameter layout, for the replica golden tests.

Written from the SGLang naming/fusion/sharding/FP8 rules (shared reference notes, section 3) and kept deliberately
simple: whole HF tensors are generated, sliced and concatenated with numpy; bf16 travels as uint16 bit patterns and
the e4m3fn encoder is a nearest-value search over the 127 positive codes. It shares no code with the C++ replica.

Usage: golden_oracle.py JOB.json OUT_DIR
  JOB.json: {"config": path to an HF config.json,
             "layouts": [{"tp_size", "tp_rank", "ep_size", "ep_rank", "moe_tp_size", "moe_tp_rank",
                          "attn_tp_size", "attn_tp_rank", "num_fused_shared_experts" (optional, 0 or 1)}, ...],
             "quant": {"mode": "none" | "fp8_block", "block_n", "block_k"}}
Writes OUT_DIR/manifest.json {"hf": [{name, dtype, shape}], "layouts": [[{name, dtype, shape, file}], ...]} and one
raw little-endian file per engine parameter of every layout (OUT_DIR/l<layout>/<index>.bin).

HF tensor contents follow one deterministic rule (the C++ test implements it again):
  seed(name)  = FNV-1a 64 of the UTF-8 name
  h(i)        = splitmix64 finaliser of (seed ^ (i * 0x9E3779B97F4A7C15)) for flat element index i
  e(h)        = 110 + min over j in 1..4 of ((h >> 8j) & 0xFF) % 24   (skewed low, so the largest magnitudes are
                rare and FP8 blocks get different scales)
  bfloat16    : sign = h bit 63, exponent = e(h), mantissa = h & 0x7F
  float32     : sign = h bit 63, exponent = e(h), mantissa = (h >> 40) & 0x7FFFFF
"""

import json
import os
import sys

import numpy as np

U64 = np.uint64
M64 = 0xFFFFFFFFFFFFFFFF


# ---------------------------------------------------------------------------------------------------------------------
# Deterministic tensor contents
# ---------------------------------------------------------------------------------------------------------------------
def fnv1a64(s):
    h = 0xCBF29CE484222325
    for b in s.encode("utf-8"):
        h ^= b
        h = (h * 0x100000001B3) & M64
    return h


def hash_stream(name, n):
    seed = U64(fnv1a64(name))
    i = np.arange(n, dtype=U64)
    with np.errstate(over="ignore"):
        z = seed ^ (i * U64(0x9E3779B97F4A7C15))
        z = (z ^ (z >> U64(30))) * U64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> U64(27))) * U64(0x94D049BB133111EB)
        z = z ^ (z >> U64(31))
    return z


def make_tensor(name, dtype, shape):
    n = int(np.prod(shape)) if shape else 1
    h = hash_stream(name, n)
    sign = h >> U64(63)
    exp = U64(110) + np.minimum.reduce([((h >> U64(8 * j)) & U64(0xFF)) % U64(24) for j in range(1, 5)])
    if dtype == "bfloat16":
        bits = (sign << U64(15)) | (exp << U64(7)) | (h & U64(0x7F))
        return bits.astype(np.uint16).reshape(shape)
    if dtype == "float32":
        bits = (sign << U64(31)) | (exp << U64(23)) | ((h >> U64(40)) & U64(0x7FFFFF))
        return bits.astype(np.uint32).view(np.float32).reshape(shape)
    raise ValueError("no generation rule for dtype " + dtype)


# ---------------------------------------------------------------------------------------------------------------------
# FP8 e4m3fn block quantization (DeepSeek/SGLang convention as RL trainers apply it: per block scale = amax/448 with
# amax floored at 1e-10, q = e4m3(clamp(x / scale, ±448)) rounding to nearest even, stored scale_inv = scale)
# ---------------------------------------------------------------------------------------------------------------------
def e4m3_value(code):
    e, m = (code >> 3) & 15, code & 7
    return m * 2.0 ** -9 if e == 0 else (1 + m / 8.0) * 2.0 ** (e - 7)


E4M3_POS = np.array([e4m3_value(c) for c in range(0x7F)], dtype=np.float64)  # codes 0..0x7E, increasing


def e4m3_encode(x):
    """float32 array (already clamped to ±448 or NaN) → uint8 codes, round to nearest, ties to even code."""
    x = np.asarray(x, dtype=np.float32)
    a = np.abs(x).astype(np.float64)
    hi = np.clip(np.searchsorted(E4M3_POS, a, side="left"), 0, 0x7E)  # first value >= a
    lo = np.clip(hi - 1, 0, 0x7E)
    d_hi = E4M3_POS[hi] - a
    d_lo = a - E4M3_POS[lo]
    pick_lo = (d_lo < d_hi) | ((d_lo == d_hi) & (lo % 2 == 0))
    code = np.where(pick_lo, lo, hi).astype(np.uint8)
    code = np.where(a > 448.0, np.uint8(0x7E), code)
    code = code | np.where(np.signbit(x), np.uint8(0x80), np.uint8(0))
    code = np.where(np.isnan(x), np.where(np.signbit(x), np.uint8(0xFF), np.uint8(0x7F)), code)
    return code.astype(np.uint8)


def bf16_to_f32(bits):
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def pow2_ceil(s):
    """UE8M0: a positive float32 rounded up to a power of two (itself when it is one), exactly."""
    if not np.isfinite(s):
        return np.float32(s)  # an inf scale (a block whose amax is inf) stays inf
    m, e = np.frexp(np.float32(s))  # s = m * 2**e, m in [0.5, 1)
    return np.float32(s) if m == 0.5 else np.float32(np.ldexp(np.float32(1.0), int(e)))


def quantize_fp8(w_bf16, bn, bk, ue8m0=False):
    """2-D bf16 bits [N, K] → (uint8 [N, K], float32 [ceil(N/bn), ceil(K/bk)]); blocks start at the tensor origin."""
    return quantize_fp8_f32(bf16_to_f32(w_bf16), bn, bk, ue8m0)


def quantize_fp8_f32(x, bn, bk, ue8m0=False):
    """quantize_fp8 of a float32 array (the values of a bf16, f16 or f32 tensor, exactly)."""
    x = np.asarray(x, dtype=np.float32)
    n, k = x.shape
    sr, sc = -(-n // bn), -(-k // bk)
    q = np.zeros((n, k), dtype=np.uint8)
    s = np.zeros((sr, sc), dtype=np.float32)
    for i in range(sr):
        for j in range(sc):
            blk = x[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            finite = blk[~np.isnan(blk)]
            amax = np.float32(np.max(np.abs(finite))) if finite.size else np.float32(0)
            scale = np.float32(max(amax, np.float32(1e-10))) / np.float32(448.0)
            if ue8m0:
                scale = pow2_ceil(scale)
            v = blk / scale  # float32 division, as torch's (w.float() / scale).to(torch.float8_e4m3fn)
            v = np.where(v < -448.0, np.float32(-448.0), v)
            v = np.where(v > 448.0, np.float32(448.0), v)
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = e4m3_encode(v)
            s[i, j] = scale
    return q, s


# ---------------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------------
class Cfg:
    def __init__(self, j):
        self.arch = j["architectures"][0]
        fam = {
            "LlamaForCausalLM": "llama",
            "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3",
            "Qwen3MoeForCausalLM": "qwen3_moe",
            "Glm4ForCausalLM": "glm4",
            "Glm4MoeForCausalLM": "glm4_moe",
            "DeepseekV2ForCausalLM": "deepseek",
            "DeepseekV3ForCausalLM": "deepseek",
            "Glm4MoeLiteForCausalLM": "deepseek",  # MLA + DeepSeek-style MoE
        }
        self.family = fam[self.arch]
        # Attention of SGLang's Llama, Qwen2 and GLM4 (dense) classes ignores DP attention (whole TP group).
        self.attn_full_tp = self.family in ("llama", "qwen2", "glm4")
        self.H = j["hidden_size"]
        self.L = j["num_hidden_layers"]
        self.heads = j["num_attention_heads"]
        self.kv_heads = j.get("num_key_value_heads") or self.heads
        self.head_dim = j.get("head_dim") or self.H // self.heads
        self.I = j["intermediate_size"]
        self.V = j["vocab_size"]
        self.tie = bool(j.get("tie_word_embeddings", False))
        # Qwen2 always has q/k/v biases; the others when attention_bias is set (GLM4 dense and GLM-4.5).
        self.qkv_bias = self.family == "qwen2" or (bool(j.get("attention_bias", False)) and not self.family == "deepseek")
        self.qk_norm = self.family in ("qwen3", "qwen3_moe") or (self.family == "glm4_moe" and
                                                                 bool(j.get("use_qk_norm", False)))
        self.mla = j.get("kv_lora_rank") is not None and self.family == "deepseek"
        if self.mla:
            self.q_lora = j.get("q_lora_rank") or 0
            self.kv_lora = j["kv_lora_rank"]
            self.nope = j["qk_nope_head_dim"]
            self.rope = j["qk_rope_head_dim"]
            self.v_dim = j["v_head_dim"]
        self.E = j.get("num_experts") or j.get("n_routed_experts") or 0
        self.moe_I = j.get("moe_intermediate_size") or 0
        self.n_shared = j.get("n_shared_experts") or 0
        self.first_dense = j.get("first_k_dense_replace") or 0
        self.moe_freq = j.get("moe_layer_freq") or 1
        self.sparse_step = j.get("decoder_sparse_step") or 1
        self.mlp_only = set(j.get("mlp_only_layers") or [])
        # Glm4MoeGate / Glm4MoeLiteGate hold the router in float32; DeepSeek's MoEGate only with router_fp32.
        self.router_fp32 = (self.family == "glm4_moe" or self.arch == "Glm4MoeLiteForCausalLM" or
                            bool(j.get("router_fp32", False)))
        if self.family == "glm4_moe":
            self.router_bias = True
        elif self.family == "deepseek":
            self.router_bias = j.get("topk_method") == "noaux_tc"
        else:
            self.router_bias = False

    def is_moe(self, i):
        if self.E == 0:
            return False
        if self.family == "qwen3_moe":
            return i not in self.mlp_only and (i + 1) % self.sparse_step == 0
        return i >= self.first_dense and i % self.moe_freq == 0


# ---------------------------------------------------------------------------------------------------------------------
# HF checkpoint (trainer format: every weight in bf16; the router correction bias in float32)
# ---------------------------------------------------------------------------------------------------------------------
def hf_tensors(c):
    t = []

    def add(name, shape, dtype="bfloat16"):
        t.append((name, dtype, list(shape)))

    H = c.H
    add("model.embed_tokens.weight", (c.V, H))
    for i in range(c.L):
        p = "model.layers.%d." % i
        add(p + "input_layernorm.weight", (H,))
        add(p + "post_attention_layernorm.weight", (H,))
        if c.family == "glm4":
            add(p + "post_self_attn_layernorm.weight", (H,))
            add(p + "post_mlp_layernorm.weight", (H,))
        a = p + "self_attn."
        if c.mla:
            qk = c.nope + c.rope
            if c.q_lora:
                add(a + "q_a_proj.weight", (c.q_lora, H))
                add(a + "q_a_layernorm.weight", (c.q_lora,))
                add(a + "q_b_proj.weight", (c.heads * qk, c.q_lora))
            else:
                add(a + "q_proj.weight", (c.heads * qk, H))
            add(a + "kv_a_proj_with_mqa.weight", (c.kv_lora + c.rope, H))
            add(a + "kv_a_layernorm.weight", (c.kv_lora,))
            add(a + "kv_b_proj.weight", (c.heads * (c.nope + c.v_dim), c.kv_lora))
            add(a + "o_proj.weight", (H, c.heads * c.v_dim))
        else:
            d = c.head_dim
            add(a + "q_proj.weight", (c.heads * d, H))
            add(a + "k_proj.weight", (c.kv_heads * d, H))
            add(a + "v_proj.weight", (c.kv_heads * d, H))
            if c.qkv_bias:
                add(a + "q_proj.bias", (c.heads * d,))
                add(a + "k_proj.bias", (c.kv_heads * d,))
                add(a + "v_proj.bias", (c.kv_heads * d,))
            add(a + "o_proj.weight", (H, c.heads * d))
            if c.qk_norm:
                add(a + "q_norm.weight", (d,))
                add(a + "k_norm.weight", (d,))
        m = p + "mlp."
        if c.is_moe(i):
            add(m + "gate.weight", (c.E, H))
            if c.router_bias:
                add(m + "gate.e_score_correction_bias", (c.E,), "float32")
            for e in range(c.E):
                add(m + "experts.%d.gate_proj.weight" % e, (c.moe_I, H))
                add(m + "experts.%d.up_proj.weight" % e, (c.moe_I, H))
                add(m + "experts.%d.down_proj.weight" % e, (H, c.moe_I))
            if c.n_shared:
                si = c.moe_I * c.n_shared
                add(m + "shared_experts.gate_proj.weight", (si, H))
                add(m + "shared_experts.up_proj.weight", (si, H))
                add(m + "shared_experts.down_proj.weight", (H, si))
        elif c.family == "glm4":
            add(m + "gate_up_proj.weight", (2 * c.I, H))  # GLM4 checkpoints store gate and up fused
            add(m + "down_proj.weight", (H, c.I))
        else:
            add(m + "gate_proj.weight", (c.I, H))
            add(m + "up_proj.weight", (c.I, H))
            add(m + "down_proj.weight", (H, c.I))
    add("model.norm.weight", (H,))
    if not c.tie:
        add("lm_head.weight", (c.V, H))
    return t


# ---------------------------------------------------------------------------------------------------------------------
# Engine parameters of one rank
# ---------------------------------------------------------------------------------------------------------------------
class Loader:
    """Assembles engine parameters from HF tensors; in FP8 mode quantizable weights are first quantized per HF
    tensor (what an FP8 checkpoint holds) and then sliced in whole blocks, as SGLang loads such a checkpoint."""

    def __init__(self, hf, quant):
        self.hf = hf
        self.fp8 = quant.get("mode") == "fp8_block"
        self.bn = quant.get("block_n", 128)
        self.bk = quant.get("block_k", 128)
        self._q = {}
        self.out = []

    def q(self, name):
        if name not in self._q:
            self._q[name] = quantize_fp8(self.hf[name], self.bn, self.bk)
        return self._q[name]

    def emit(self, name, dtype, arr):
        self.out.append((name, dtype, arr))

    def plain(self, name, src=None, widen=False):
        """Replicated, copied as is (norms, router, replicated biases); widen: a bf16 tensor held as float32."""
        src = src or name
        arr = self.hf[src]
        if widen and arr.dtype == np.uint16:
            arr = bf16_to_f32(arr)
        self.emit(name, "float32" if arr.dtype == np.float32 else "bfloat16", arr)

    def linear(self, name, pieces, quantize=True):
        """Engine linear `name`.weight = concat over dim 0 of pieces (hf_name, row_lo, row_hi, col_lo, col_hi)."""
        if self.fp8 and quantize:
            ws, ss = [], []
            for hf_name, r0, r1, c0, c1 in pieces:
                qw, sw = self.q(hf_name)
                for v, b in ((r0, self.bn), (r1, self.bn), (c0, self.bk), (c1, self.bk)):
                    full = qw.shape[0] if b == self.bn else qw.shape[1]
                    if v % b and v != full:
                        raise ValueError("%s: shard edge %d not on a %d block boundary" % (hf_name, v, b))
                ws.append(qw[r0:r1, c0:c1])
                ss.append(sw[r0 // self.bn:-(-r1 // self.bn), c0 // self.bk:-(-c1 // self.bk)])
            self.emit(name + ".weight", "float8_e4m3fn", np.concatenate(ws, axis=0))
            self.emit(name + ".weight_scale_inv", "float32", np.concatenate(ss, axis=0))
        else:
            w = np.concatenate([self.hf[n][r0:r1, c0:c1] for n, r0, r1, c0, c1 in pieces], axis=0)
            self.emit(name + ".weight", "bfloat16", w)

    def bias(self, name, pieces):
        self.emit(name + ".bias", "bfloat16", np.concatenate([self.hf[n][r0:r1] for n, r0, r1 in pieces]))

    def experts(self, name, per_expert):
        """Stacked expert parameter `name` ("...experts.w13" / ".w2"): per_expert is a list (one per local expert) of
        piece lists as for linear()."""
        if self.fp8:
            ws, ss = [], []
            for pieces in per_expert:
                w, s = [], []
                for hf_name, r0, r1, c0, c1 in pieces:
                    qw, sw = self.q(hf_name)
                    w.append(qw[r0:r1, c0:c1])
                    s.append(sw[r0 // self.bn:-(-r1 // self.bn), c0 // self.bk:-(-c1 // self.bk)])
                ws.append(np.concatenate(w, axis=0))
                ss.append(np.concatenate(s, axis=0))
            self.emit(name + "_weight", "float8_e4m3fn", np.stack(ws))
            self.emit(name + "_weight_scale_inv", "float32", np.stack(ss))
        else:
            ws = [np.concatenate([self.hf[n][r0:r1, c0:c1] for n, r0, r1, c0, c1 in pieces], axis=0)
                  for pieces in per_expert]
            self.emit(name + "_weight", "bfloat16", np.stack(ws))


def shard(n, size, rank):
    if n % size:
        raise ValueError("dimension %d not divisible by %d" % (n, size))
    s = n // size
    return rank * s, (rank + 1) * s


def vocab(ld, name, c, tp, rank):
    """VocabParallelEmbedding / ParallelLMHead: vocab padded to a multiple of 64, split on dim 0, padding rows 0."""
    vpad = -(-c.V // 64) * 64
    lo, hi = shard(vpad, tp, rank)
    w = np.zeros((hi - lo, c.H), dtype=np.uint16)
    src = ld.hf[name]
    if lo < c.V:
        w[:min(hi, c.V) - lo] = src[lo:min(hi, c.V)]
    ld.emit(name, "bfloat16", w)


def engine_params(c, L, hf, quant):
    tp, tpr = L["tp_size"], L["tp_rank"]
    atp, atr = L.get("attn_tp_size", tp), L.get("attn_tp_rank", tpr)
    ep, epr = L.get("ep_size", 1), L.get("ep_rank", 0)
    mtp, mtr = L.get("moe_tp_size", tp // ep), L.get("moe_tp_rank", tpr % (tp // ep))
    fused = L.get("num_fused_shared_experts", 0)
    dp_attention = atp < tp
    ld = Loader(hf, quant)
    H = c.H

    # Embedding: with DP attention SGLang 0.5.23 splits it over the attention-TP group (use_attn_tp_group), except
    # Llama's (whole TP group); lm_head stays split over the full tp group (enable_dp_lm_head off).
    if dp_attention and c.family != "llama":
        vocab(ld, "model.embed_tokens.weight", c, atp, atr)
    else:
        vocab(ld, "model.embed_tokens.weight", c, tp, tpr)
    if c.attn_full_tp:
        atp, atr = tp, tpr

    def dense_mlp(prefix, hf_prefix, inter, fused_ckpt=False):
        lo, hi = shard(inter, tp, tpr)
        if fused_ckpt:
            g = u = hf_prefix + "gate_up_proj.weight"
            pieces = [(g, lo, hi, 0, H), (u, inter + lo, inter + hi, 0, H)]
        else:
            pieces = [(hf_prefix + "gate_proj.weight", lo, hi, 0, H), (hf_prefix + "up_proj.weight", lo, hi, 0, H)]
        ld.linear(prefix + "gate_up_proj", pieces)
        ld.linear(prefix + "down_proj", [(hf_prefix + "down_proj.weight", 0, H, lo, hi)])

    for i in range(c.L):
        p = "model.layers.%d." % i
        ld.plain(p + "input_layernorm.weight")
        ld.plain(p + "post_attention_layernorm.weight")
        if c.family == "glm4":
            ld.plain(p + "post_self_attn_layernorm.weight")
            ld.plain(p + "post_mlp_layernorm.weight")
        a = p + "self_attn."
        if c.mla:
            qk = c.nope + c.rope
            h_lo, h_hi = shard(c.heads, atp, atr)
            if c.q_lora:
                ld.linear(a + "fused_qkv_a_proj_with_mqa",
                          [(a + "q_a_proj.weight", 0, c.q_lora, 0, H),
                           (a + "kv_a_proj_with_mqa.weight", 0, c.kv_lora + c.rope, 0, H)])
                ld.plain(a + "q_a_layernorm.weight")
                ld.linear(a + "q_b_proj", [(a + "q_b_proj.weight", h_lo * qk, h_hi * qk, 0, c.q_lora)])
            else:
                ld.linear(a + "q_proj", [(a + "q_proj.weight", h_lo * qk, h_hi * qk, 0, H)])
                ld.linear(a + "kv_a_proj_with_mqa", [(a + "kv_a_proj_with_mqa.weight", 0, c.kv_lora + c.rope, 0, H)])
            ld.plain(a + "kv_a_layernorm.weight")
            kvd = c.nope + c.v_dim
            ld.linear(a + "kv_b_proj", [(a + "kv_b_proj.weight", h_lo * kvd, h_hi * kvd, 0, c.kv_lora)])
            ld.linear(a + "o_proj", [(a + "o_proj.weight", 0, H, h_lo * c.v_dim, h_hi * c.v_dim)])
            if ld.fp8:
                # FP8 KV-cache scales of SGLang's two MLA attention modules: float32 scalars, 1.0 after loading.
                for mod in ("attn_mqa.", "attn_mha."):
                    for sc in ("k_scale", "v_scale"):
                        ld.emit(a + mod + sc, "float32", np.array(1.0, dtype=np.float32))
        else:
            d = c.head_dim
            q_lo, q_hi = shard(c.heads * d, atp, atr)
            if atp >= c.kv_heads:
                # KV heads replicated: atp / kv_heads ranks share one head.
                if atp % c.kv_heads:
                    raise ValueError("attn tp %d not a multiple of kv heads %d" % (atp, c.kv_heads))
                h = atr // (atp // c.kv_heads)
                k_lo, k_hi = h * d, (h + 1) * d
            else:
                k_lo, k_hi = shard(c.kv_heads * d, atp, atr)
            ld.linear(a + "qkv_proj", [(a + "q_proj.weight", q_lo, q_hi, 0, H), (a + "k_proj.weight", k_lo, k_hi, 0, H),
                                       (a + "v_proj.weight", k_lo, k_hi, 0, H)])
            if c.qkv_bias:
                ld.bias(a + "qkv_proj", [(a + "q_proj.bias", q_lo, q_hi), (a + "k_proj.bias", k_lo, k_hi),
                                         (a + "v_proj.bias", k_lo, k_hi)])
            ld.linear(a + "o_proj", [(a + "o_proj.weight", 0, H, q_lo, q_hi)])
            if c.qk_norm:
                ld.plain(a + "q_norm.weight")
                ld.plain(a + "k_norm.weight")
        m = p + "mlp."
        if c.is_moe(i):
            ld.plain(m + "gate.weight", widen=c.router_fp32)
            if c.router_bias:
                ld.plain(m + "gate.e_score_correction_bias")
            n_local = c.E // ep
            lo, hi = shard(c.moe_I, mtp, mtr)
            w13, w2 = [], []
            for le in range(n_local):
                e = epr * n_local + le
                x = m + "experts.%d." % e
                w13.append([(x + "gate_proj.weight", lo, hi, 0, H), (x + "up_proj.weight", lo, hi, 0, H)])
                w2.append([(x + "down_proj.weight", 0, H, lo, hi)])
            if fused:
                # Shared-expert fusion: the (single) shared expert is the last local expert, sliced like the others.
                if fused != 1 or c.n_shared != 1:
                    raise ValueError("shared-expert fusion needs exactly one shared expert")
                x = m + "shared_experts."
                w13.append([(x + "gate_proj.weight", lo, hi, 0, H), (x + "up_proj.weight", lo, hi, 0, H)])
                w2.append([(x + "down_proj.weight", 0, H, lo, hi)])
            ld.experts(m + "experts.w13", w13)
            ld.experts(m + "experts.w2", w2)
            if c.n_shared and not fused:
                dense_mlp(m + "shared_experts.", m + "shared_experts.", c.moe_I * c.n_shared)
        else:
            dense_mlp(m, m, c.I, fused_ckpt=c.family == "glm4")
    ld.plain("model.norm.weight")
    if not c.tie:
        vocab(ld, "lm_head.weight", c, tp, tpr)
    return ld.out


def main():
    if len(sys.argv) != 3:
        sys.stderr.write(__doc__)
        return 2
    job = json.load(open(sys.argv[1]))
    out_dir = sys.argv[2]
    c = Cfg(json.load(open(job["config"])))
    specs = hf_tensors(c)
    hf = {n: make_tensor(n, dt, sh) for n, dt, sh in specs}
    manifest = {"hf": [{"name": n, "dtype": dt, "shape": sh} for n, dt, sh in specs], "layouts": []}
    for li, L in enumerate(job["layouts"]):
        d = os.path.join(out_dir, "l%d" % li)
        os.makedirs(d, exist_ok=True)
        entries = []
        for k, (name, dtype, arr) in enumerate(engine_params(c, L, hf, job.get("quant", {}))):
            f = os.path.join("l%d" % li, "%d.bin" % k)
            np.ascontiguousarray(arr).tofile(os.path.join(out_dir, f))
            entries.append({"name": name, "dtype": dtype, "shape": list(arr.shape), "file": f})
        manifest["layouts"].append(entries)
    with open(os.path.join(out_dir, "manifest.json"), "w") as fh:
        json.dump(manifest, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
