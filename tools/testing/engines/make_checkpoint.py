#!/usr/bin/env python3
"""Write a deterministic random-weight Hugging Face checkpoint (safetensors, bf16) for a tiny variant of a real model.

    python tools/testing/engines/make_checkpoint.py \
        --config tests/data/models/Qwen__Qwen3-0.6B/config.json --layers 2 --seed 1 --out /tmp/x/qwen3-a
    python tools/testing/engines/make_checkpoint.py \
        --config tests/data/models/Qwen__Qwen3-30B-A3B/config.json --layers 2 --experts 8 --experts-per-tok 2 \
        --hidden 256 --moe-intermediate 128 --heads 4 --kv-heads 2 --head-dim 64 --seed 1 --out /tmp/x/moe-a

The same arguments with another `--seed` give a new checkpoint of the same model (same names, shapes and config,
different values): the tests use one per update. Every tensor is drawn from its own generator seeded by
(seed, tensor name), so a checkpoint does not depend on the order tensors are written in.

Names follow the Hugging Face checkpoint layout of Llama-like decoders (Qwen2/Qwen3 dense, Qwen3-MoE): un-fused
q/k/v, gate/up/down and per-expert tensors. There is no tokenizer: start vLLM with `--skip-tokenizer-init` and send
token-id prompts (compare `token_ids`; decoded text of a random model is meaningless anyway).

Needs torch and safetensors (the vLLM venv has both).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from typing import Any

import torch
from safetensors.torch import save_file

SUPPORTED = {"qwen3", "qwen2", "llama", "qwen3_moe", "qwen2_moe"}


def tiny_config(cfg: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    """Apply the overrides and keep the config self-consistent for the smaller model."""
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}  # drop reconstruction notes
    model_type = cfg.get("model_type", "")
    if model_type not in SUPPORTED:
        sys.exit(f"make_checkpoint: model_type {model_type!r} not supported (supported: {sorted(SUPPORTED)})")
    if a.hidden is not None:
        cfg["hidden_size"] = a.hidden
    if a.heads is not None:
        cfg["num_attention_heads"] = a.heads
    if a.kv_heads is not None:
        cfg["num_key_value_heads"] = a.kv_heads
    if a.head_dim is not None:
        cfg["head_dim"] = a.head_dim
    elif a.hidden is not None or a.heads is not None:
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    if a.intermediate is not None:
        cfg["intermediate_size"] = a.intermediate
    if a.vocab is not None:
        cfg["vocab_size"] = a.vocab
    if a.layers is not None:
        cfg["num_hidden_layers"] = a.layers
    n = cfg["num_hidden_layers"]
    if "max_window_layers" in cfg:
        cfg["max_window_layers"] = n
    if "layer_types" in cfg:
        cfg["layer_types"] = cfg["layer_types"][:n]
    if "mlp_only_layers" in cfg:
        cfg["mlp_only_layers"] = [i for i in cfg["mlp_only_layers"] if i < n]
    if model_type.endswith("_moe"):
        if a.experts is not None:
            cfg["num_experts"] = a.experts
        if a.experts_per_tok is not None:
            cfg["num_experts_per_tok"] = a.experts_per_tok
        if a.moe_intermediate is not None:
            cfg["moe_intermediate_size"] = a.moe_intermediate
        cfg["num_experts_per_tok"] = min(cfg["num_experts_per_tok"], cfg["num_experts"])
    if a.max_position is not None:
        cfg["max_position_embeddings"] = a.max_position
    cfg["torch_dtype"] = "bfloat16"
    return cfg


def tensor_shapes(cfg: dict[str, Any]) -> list[tuple[str, list[int]]]:
    """HF checkpoint tensor names and shapes, in the order a checkpoint normally lists them."""
    h = cfg["hidden_size"]
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads", nh)
    hd = cfg.get("head_dim") or h // nh
    v = cfg["vocab_size"]
    model_type = cfg["model_type"]
    qk_norm = model_type in ("qwen3", "qwen3_moe")
    attn_bias = bool(cfg.get("attention_bias", model_type in ("qwen2", "qwen2_moe")))
    is_moe = model_type.endswith("_moe") and cfg.get("num_experts", 0) > 0
    out: list[tuple[str, list[int]]] = [("model.embed_tokens.weight", [v, h])]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.append((p + "input_layernorm.weight", [h]))
        out += [(p + "self_attn.q_proj.weight", [nh * hd, h]), (p + "self_attn.k_proj.weight", [nkv * hd, h]),
                (p + "self_attn.v_proj.weight", [nkv * hd, h]), (p + "self_attn.o_proj.weight", [h, nh * hd])]
        if attn_bias:
            out += [(p + "self_attn.q_proj.bias", [nh * hd]), (p + "self_attn.k_proj.bias", [nkv * hd]),
                    (p + "self_attn.v_proj.bias", [nkv * hd])]
        if qk_norm:
            out += [(p + "self_attn.q_norm.weight", [hd]), (p + "self_attn.k_norm.weight", [hd])]
        out.append((p + "post_attention_layernorm.weight", [h]))
        sparse = (is_moe and i not in cfg.get("mlp_only_layers", [])
                  and (i + 1) % cfg.get("decoder_sparse_step", 1) == 0)
        if sparse:
            e, mi = cfg["num_experts"], cfg["moe_intermediate_size"]
            out.append((p + "mlp.gate.weight", [e, h]))
            for j in range(e):
                q = f"{p}mlp.experts.{j}."
                out += [(q + "gate_proj.weight", [mi, h]), (q + "up_proj.weight", [mi, h]),
                        (q + "down_proj.weight", [h, mi])]
            if model_type == "qwen2_moe":
                si = cfg["shared_expert_intermediate_size"]
                out += [(p + "mlp.shared_expert.gate_proj.weight", [si, h]),
                        (p + "mlp.shared_expert.up_proj.weight", [si, h]),
                        (p + "mlp.shared_expert.down_proj.weight", [h, si]),
                        (p + "mlp.shared_expert_gate.weight", [1, h])]
        else:
            ff = cfg["intermediate_size"]
            out += [(p + "mlp.gate_proj.weight", [ff, h]), (p + "mlp.up_proj.weight", [ff, h]),
                    (p + "mlp.down_proj.weight", [h, ff])]
    out.append(("model.norm.weight", [h]))
    if not cfg.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", [v, h]))
    return out


def make_tensor(name: str, shape: list[int], seed: int, std: float) -> torch.Tensor:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    if name.endswith("norm.weight"):
        # RMSNorm scales around 1 (still seed-dependent, so an update changes them too).
        t = 1.0 + 0.1 * torch.randn(shape, generator=gen, dtype=torch.float32)
    elif name.endswith(".bias"):
        t = 0.02 * torch.randn(shape, generator=gen, dtype=torch.float32)
    else:
        t = std * torch.randn(shape, generator=gen, dtype=torch.float32)
    return t.to(torch.bfloat16)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="a real config.json (or a model directory holding one)")
    ap.add_argument("--out", required=True, help="output directory (created)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--head-dim", type=int)
    ap.add_argument("--intermediate", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--experts", type=int)
    ap.add_argument("--experts-per-tok", type=int)
    ap.add_argument("--moe-intermediate", type=int)
    ap.add_argument("--max-position", type=int)
    ap.add_argument("--std", type=float, default=None, help="weight std (default: config initializer_range or 0.02)")
    a = ap.parse_args()

    path = a.config
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        cfg = tiny_config(json.load(f), a)
    std = a.std if a.std is not None else float(cfg.get("initializer_range", 0.02))
    tensors = {name: make_tensor(name, shape, a.seed, std) for name, shape in tensor_shapes(cfg)}

    os.makedirs(a.out, exist_ok=True)
    save_file(tensors, os.path.join(a.out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"wrote {a.out}: {len(tensors)} tensors, {total / 2**20:.1f} MiB, seed {a.seed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
