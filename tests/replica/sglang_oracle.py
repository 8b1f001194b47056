#!/usr/bin/env python3
"""SGLang itself as the layout oracle for the replica golden tests.

Same command line and output as golden_oracle.py (so golden_test.cc drives either):
  sglang_oracle.py JOB.json OUT_DIR
  sglang_oracle.py --serve     (what replica_sglang_oracle_test runs: one process for every job, see serve())
  JOB.json: {"config": path to an HF config.json,
             "layouts": [{"tp_size", "tp_rank", "ep_size", "ep_rank", "moe_tp_size", "moe_tp_rank",
                          "attn_tp_size", "attn_tp_rank", "attn_dp_size", "num_fused_shared_experts"}, ...],
             "quant": {"mode": "none" | "fp8_block", "block_n", "block_k"},
             "weights": "target" (default) | "draft"}
Writes OUT_DIR/manifest.json {"hf": [...], "layouts": [[{name, dtype, shape, file, loaded}], ...]} and one raw file
per parameter.

For every layout it builds SGLang's own model class on the CPU (bfloat16 default dtype, as SGLang's loader sets it)
under a published SGLang server configuration whose process groups are stand-ins carrying only rank and width, feeds
the model's own `load_weights` the HF tensors (the deterministic rule of golden_oracle.py) and dumps
`named_parameters()` as SGLang holds them after loading. Runs in the pinned venv sglang_venv.sh creates.

Draft ("weights": "draft"): the checkpoint also holds the next-n (MTP) layer model.layers.<num_hidden_layers>.* as the
published DeepSeek-V3 / GLM-4.5 checkpoints store it, and the model built is SGLang's NextN draft class for the
architecture (the class SGLang's ModelConfig picks for a draft of it), fed the whole checkpoint as SGLang's draft
loader is. Every floating parameter but the scalars (the FP8 KV-cache scales, which post-loading sets from their
initial value) is filled with NaN before loading; one still all-NaN afterwards was not loaded
(`loaded`: false), which is how the draft's embed_tokens and lm_head (the target's tensors in a running engine) show.

FP8 ("fp8_block"): the trainer's bf16 tensors are quantized with torch, `(w.float() / scale).to(float8_e4m3fn)` per
block with scale = max(amax, 1e-10) / 448 (the rule the replica implements), and SGLang loads the resulting FP8
checkpoint (weight + weight_scale_inv) through its Fp8Config with that block size.
"""

import copy
import json
import os
import sys

os.environ.setdefault("SGLANG_DISABLE_REQUEST_LOGGING", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import golden_oracle  # noqa: E402  (the HF tensor list and the deterministic contents; nothing of its layout)

import torch  # noqa: E402

CLASSES = {
    "LlamaForCausalLM": ("sglang.srt.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("sglang.srt.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("sglang.srt.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("sglang.srt.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "Glm4ForCausalLM": ("sglang.srt.models.glm4", "Glm4ForCausalLM"),
    "Glm4MoeForCausalLM": ("sglang.srt.models.glm4_moe", "Glm4MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("sglang.srt.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("sglang.srt.models.deepseek_v2", "DeepseekV3ForCausalLM"),
    "Glm4MoeLiteForCausalLM": ("sglang.srt.models.glm4_moe_lite", "Glm4MoeLiteForCausalLM"),
}

# SGLang's ModelConfig rewrites a draft's architecture to these classes (configs/model_config.py, is_draft_model).
DRAFT_CLASSES = {
    "DeepseekV3ForCausalLM": ("sglang.srt.models.deepseek_nextn", "DeepseekV3ForCausalLMNextN"),
    "Glm4MoeForCausalLM": ("sglang.srt.models.glm4_moe_nextn", "Glm4MoeForCausalLMNextN"),
    "Glm4MoeLiteForCausalLM": ("sglang.srt.models.glm4_moe_lite_nextn", "Glm4MoeLiteForCausalLMNextN"),
}

DTYPE_NAMES = {
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float16: "float16",
    torch.float8_e4m3fn: "float8_e4m3fn",
}


class Group:
    """Stand-in for SGLang's GroupCoordinator: placement only (no communication happens while loading)."""

    def __init__(self, rank, size):
        self.rank_in_group = rank
        self.world_size = size
        self.rank = rank
        self.ranks = list(range(size))
        self.local_rank = 0
        self.is_first_rank = rank == 0
        self.is_last_rank = rank == size - 1
        self.device_group = None
        self.cpu_group = None


def publish_layout(model_dir, L, fuse_shared, extra_args=None):
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    tp = L["tp_size"]
    ep = L.get("ep_size", 1)
    atp = L.get("attn_tp_size", tp)
    dp = tp // atp
    # Shared-expert fusion: SGLang decides it per model class and platform (never on a CPU); the layout under test
    # asks for it explicitly with SGLang's own flags, --enforce-shared-experts-fusion or
    # --disable-shared-experts-fusion.
    kwargs = dict(model_path=model_dir, tp_size=tp, ep_size=ep, device="cpu", skip_tokenizer_init=True,
                  disable_shared_experts_fusion=not fuse_shared, enforce_shared_experts_fusion=fuse_shared)
    if dp > 1:
        kwargs.update(dp_size=dp, enable_dp_attention=True)
    kwargs.update(extra_args or {})
    args = ServerArgs(**kwargs)
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=L["tp_rank"]))
    par = get_parallel()
    # The layout the test asked for must be the one SGLang derived from its own rank rules.
    want = {"tp_rank": L["tp_rank"], "attn_tp_size": atp, "attn_tp_rank": L.get("attn_tp_rank", L["tp_rank"]),
            "moe_ep_size": ep, "moe_ep_rank": L.get("ep_rank", 0), "moe_tp_size": L.get("moe_tp_size", tp // ep),
            "moe_tp_rank": L.get("moe_tp_rank", L["tp_rank"] % (tp // ep))}
    have = {k: getattr(par, k) for k in want}
    if have != want:
        raise SystemExit("SGLang derives a different placement: %s, the test asked for %s" % (have, want))
    groups = {}
    for g in ("tp", "attn_tp", "pp", "moe_ep", "moe_tp", "attn_cp", "moe_dp"):
        groups[g + "_group"] = Group(getattr(par, g + "_rank"), getattr(par, g + "_size"))
    par.override_permanently(**groups)
    # SGLang's own DP-attention runtime flags (is_dp_attention_enabled() reads them), as its model runner sets them.
    from sglang.srt.layers.dp_attention import initialize_dp_attention_flags
    initialize_dp_attention_flags(args)
    return args


def quantize(w, bn, bk):
    """torch's FP8 block quantization: codes and float32 scale_inv per (bn x bk) block."""
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    x = w.float()
    codes = torch.empty((n, k), dtype=torch.float8_e4m3fn)
    scales = torch.empty((nb, kb), dtype=torch.float32)
    for i in range(nb):
        for j in range(kb):
            blk = x[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            scale = torch.clamp(blk.abs().amax(), min=1e-10) / 448.0
            scales[i, j] = scale
            codes[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (blk / scale).clamp(-448.0, 448.0).to(
                torch.float8_e4m3fn)
    return codes, scales


def fp8_quantized(name, shape):
    """The HF tensors a block-FP8 checkpoint stores in FP8: linear weights inside the decoder layers (not the next-n
    layer's eh_proj, embed_tokens and shared_head.head, which DeepSeek-V3's FP8 checkpoint stores in bf16)."""
    if len(shape) != 2 or not name.startswith("model.layers.") or not name.endswith(".weight"):
        return False
    if any(s in name for s in (".eh_proj.", ".embed_tokens.", ".shared_head.head.")):
        return False
    return not name.endswith("mlp.gate.weight") and "layernorm" not in name and "norm.weight" not in name


def mtp_tensors(c):
    """The checkpoint's next-n layer model.layers.<L>.* (L = num_hidden_layers): embed_tokens, enorm, hnorm, eh_proj
    [H, 2H], a MoE decoder layer (golden_oracle's listing of a layer) and shared_head.{norm,head}, as DeepSeek-V3's
    published index.json lists it."""
    deeper = copy.copy(c)
    deeper.L = c.L + 1
    deeper.is_moe = lambda i: c.E > 0 if i == c.L else c.is_moe(i)
    p = "model.layers.%d." % c.L
    H = c.H
    own = [(p + "embed_tokens.weight", "bfloat16", [c.V, H]), (p + "enorm.weight", "bfloat16", [H]),
           (p + "hnorm.weight", "bfloat16", [H]), (p + "eh_proj.weight", "bfloat16", [H, 2 * H])]
    layer = [t for t in golden_oracle.hf_tensors(deeper) if t[0].startswith(p)]
    return own + layer + [(p + "shared_head.norm.weight", "bfloat16", [H]),
                          (p + "shared_head.head.weight", "bfloat16", [c.V, H])]


def checkpoint(hf_specs, quant, make=None):
    """The HF checkpoint as torch tensors; `make(name, dtype, shape)` gives each tensor's contents (numpy; bf16 as its
    uint16 bits), golden_oracle's deterministic rule by default."""
    for name, dtype, shape in hf_specs:
        arr = (make or golden_oracle.make_tensor)(name, dtype, shape)
        if dtype == "bfloat16":
            t = torch.from_numpy(arr.astype(np.uint16).view(np.int16).copy()).view(torch.bfloat16)
        else:
            t = torch.from_numpy(np.ascontiguousarray(arr).copy())
        if quant.get("mode") == "fp8_block" and fp8_quantized(name, shape):
            codes, scales = quantize(t, quant["block_n"], quant["block_k"])
            yield name, codes
            yield name[:-len(".weight")] + ".weight_scale_inv", scales
        else:
            yield name, t


def cpu_rope_without_scaling():
    """SGLang's CPU rotary-embedding factory (get_rope_wrapper with device "cpu") only handles configs with
    rope_scaling (Moonlight and the tiny configs have none) and asserts otherwise. The rotary embedding holds buffers,
    never parameters, so the MLA models without rope_scaling are built with the device-independent factory."""
    from sglang.srt.layers.rotary_embedding import factory

    def rope(*args, device=None, **kwargs):
        scaling = kwargs.get("rope_scaling", args[5] if len(args) > 5 else None)
        if scaling is None:
            return factory.get_rope(*args, **kwargs)
        return factory.get_rope_wrapper(*args, device=device, **kwargs)

    for name in ("sglang.srt.models.deepseek_v2", "sglang.srt.models.glm4_moe_lite"):
        mod = sys.modules.get(name)
        if mod is not None and hasattr(mod, "get_rope_wrapper"):
            mod.get_rope_wrapper = rope


def resolve_fusion(cls, hf_config, quant_config, fuse):
    """SGLang's own decision on shared-expert fusion. GLM-4.5's gate has no enforce flag and allows fusion only on a
    CUDA device of capability >= 8.0, so when the layout asks for fusion the gate is asked as on an sm90 GPU (only
    for this question; the model is still built on the CPU). DeepSeek's gate honours --enforce-shared-experts-fusion."""
    from sglang.srt.layers.moe.utils import resolve_shared_experts_config

    if not fuse:
        return resolve_shared_experts_config(cls, hf_config, quant_config)
    mod = sys.modules[cls.__module__]
    saved = (getattr(mod, "_is_cuda", None), torch.cuda.get_device_capability)
    mod._is_cuda = True
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    try:
        return resolve_shared_experts_config(cls, hf_config, quant_config)
    finally:
        mod._is_cuda, torch.cuda.get_device_capability = saved


def build_and_load(cfg_path, L, quant, hf_specs, extra_args=None, make=None, draft=False):
    """SGLang's model for layout L, loaded by SGLang's loader. `extra_args`: more ServerArgs fields; `make`: the
    checkpoint's contents (see checkpoint()); `draft`: the architecture's NextN draft class instead, its floating
    parameters NaN before loading (see the module doc)."""
    from transformers import AutoConfig

    model_dir = os.path.dirname(cfg_path)
    want_fused = L.get("num_fused_shared_experts", 0)
    publish_layout(model_dir, L, want_fused > 0, extra_args)
    hf_config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    quant_config = None
    if quant.get("mode") == "fp8_block":
        from sglang.srt.layers.quantization.fp8 import Fp8Config
        quant_config = Fp8Config(is_checkpoint_fp8_serialized=True,
                                 weight_block_size=[quant["block_n"], quant["block_k"]])
    from sglang.srt.model_loader.loader import DefaultModelLoader
    from sglang.srt.runtime_context import get_model

    if draft:
        module, cls_name = DRAFT_CLASSES[hf_config.architectures[0]]
        hf_config.architectures[0] = cls_name
    else:
        module, cls_name = CLASSES[hf_config.architectures[0]]
    cls = getattr(__import__(module, fromlist=[cls_name]), cls_name)
    cpu_rope_without_scaling()
    # As SGLang's model loader does: resolve the shared-expert layout, build under it with bf16 as the default dtype,
    # run the model's load_weights, then the quantization methods' post-load processing.
    shared = resolve_fusion(cls, hf_config, quant_config, want_fused > 0)
    if shared.num_fused_shared_experts != want_fused:
        raise SystemExit("SGLang resolves %d fused shared experts for %s, the layout asks for %d" %
                         (shared.num_fused_shared_experts, cls_name, want_fused))
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with get_model().override(shared_experts=shared):
            model = cls(hf_config, quant_config=quant_config)
    finally:
        torch.set_default_dtype(old)
    model.shared_experts_config = shared
    if draft:
        with torch.no_grad():
            for _, p in model.named_parameters():
                if p.numel() > 1 and p.dtype in (torch.bfloat16, torch.float16, torch.float32):
                    p.fill_(float("nan"))
    DefaultModelLoader.load_weights_and_postprocess(model, checkpoint(hf_specs, quant, make), torch.device("cpu"))
    return model


def run_job(job_path, out_dir):
    """One job: every layout of the job file built, loaded and dumped into out_dir (see the module doc)."""
    job = json.load(open(job_path))
    cfg_path = os.path.abspath(job["config"])
    c = golden_oracle.Cfg(json.load(open(cfg_path)))
    draft = job.get("weights", "target") == "draft"
    specs = golden_oracle.hf_tensors(c) + (mtp_tensors(c) if draft else [])
    manifest = {"hf": [{"name": n, "dtype": dt, "shape": sh} for n, dt, sh in specs], "layouts": []}
    quant = job.get("quant", {})
    for li, L in enumerate(job["layouts"]):
        d = os.path.join(out_dir, "l%d" % li)
        os.makedirs(d, exist_ok=True)
        model = build_and_load(cfg_path, L, quant, specs, draft=draft)
        entries = []
        for k, (name, p) in enumerate(model.named_parameters()):
            t = p.detach().contiguous().cpu()
            if t.dtype not in DTYPE_NAMES:
                raise SystemExit("parameter %s has dtype %s" % (name, t.dtype))
            f = os.path.join("l%d" % li, "%d.bin" % k)
            with open(os.path.join(out_dir, f), "wb") as fh:
                fh.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())
            loaded = not (draft and t.numel() > 1 and t.dtype in (torch.bfloat16, torch.float16, torch.float32) and
                          bool(torch.isnan(t.float()).all()))
            entries.append({"name": name, "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "file": f,
                            "loaded": loaded})
        manifest["layouts"].append(entries)
        del model
    with open(os.path.join(out_dir, "manifest.json"), "w") as fh:
        json.dump(manifest, fh)
    return 0


def serve():
    """`--serve`: torch and SGLang imported once, then one forked child per job, so that each job starts from the
    same freshly imported state as a process of its own would (nothing a job sets in SGLang's globals reaches the
    next) without paying the imports again. Requests on stdin, one per line: JOB.json<TAB>OUT_DIR<TAB>LOG; the job's
    output (stdout and stderr) goes to LOG; the reply on stdout is the job's exit status, one line."""
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever SGLang prints must not mix with the replies
    for module, _ in list(CLASSES.values()) + list(DRAFT_CLASSES.values()):
        __import__(module)
    import sglang.srt.layers.moe.utils  # noqa: F401
    import sglang.srt.layers.quantization.fp8  # noqa: F401
    import sglang.srt.model_loader.loader  # noqa: F401
    import sglang.srt.runtime_context  # noqa: F401
    import sglang.srt.server_args  # noqa: F401
    import transformers  # noqa: F401
    reply.write("ready\n")
    for line in sys.stdin:
        job_path, out_dir, log_path = line.rstrip("\n").split("\t")
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            rc = 1
            try:
                fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                rc = run_job(job_path, out_dir)
            except SystemExit as e:
                if isinstance(e.code, str):
                    sys.stderr.write(e.code + "\n")
                rc = e.code if isinstance(e.code, int) else 1
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(rc)
        _, status = os.waitpid(pid, 0)
        reply.write("%d\n" % (os.waitstatus_to_exitcode(status)))
    return 0


def main():
    if len(sys.argv) == 2 and sys.argv[1] == "--serve":
        return serve()
    if len(sys.argv) != 3:
        sys.stderr.write(__doc__)
        return 2
    return run_job(sys.argv[1], sys.argv[2])


if __name__ == "__main__":
    sys.exit(main())
