#!/usr/bin/env python3
"""bench/cluster, delta mode: delta updates vs dense updates of consecutive RL-like steps on the emulated cluster
(emucluster.py), per shape, model, learning rate and engine dtype, in one invocation over the same namespaces and
tc-shaped links.

For every model and learning rate, `wsync-rl-steps --out` writes steps 0..N of the RL step model
(tools/testdata/rl_steps.h: fp32 masters, Adam-like updates, cast to bf16; a model of a trainer, not a trainer). On
each shape the cluster then runs, per (model, lr, engine dtype), a fresh wsync (coordinator, engines, daemons) whose
trainer ranks push step k at update k (`wsync-trainer-demo --steps-dir`) and whose engines verify every update
against the same step file loaded by their own loader (`wsync-engine-ref --steps-dir`): update 1 (configures; dense:
nothing is held yet) is a warm-up, then updates alternate delta=off (dense) and delta=auto, --pairs times. Reported
per configuration (medians over the pairs):

Every engine verifies bit-exactly with its own loader, against the step file: bf16 engines after every update, FP8
engines after the last one (a delta update; --verify-all for every update).

  bytes   sent ÷ dense bytes of the delta updates (the coordinator's record: dense ranges + delta records written)
  time    delta update time ÷ dense update time (the record's total: pause → push → apply_delta → post-process →
          version → continue)

FP8 engines: the model's config with `quantization_config` fp8, block 128×128 (64×64 for qwen3-moe-2l, whose
trimmed experts of intermediate 384 are not a multiple of 128 rows); the trainer pushes the same bf16 steps and the
sources quantize. qwen3-moe-2l's engines run EP = TP (experts whole on a rank), as in bench_cluster's shard case.

    bench_cluster_delta.py [--shapes 2x2,4x4] [--models demo,moe] [--lrs 1e-6,1e-5] [--dtypes bf16,fp8] [--pairs 2]
                           [--rate-mbit 400] [--bin DIR] [--keep]

Ends with one JSON line {"bench":"cluster_delta","value":bytes ratio,"time_ratio":...,...} for the first shape,
the demo model, lr 1e-6, bf16 (the issue's goals: bytes <= 0.05, time <= 0.15 of dense), every row under "rows".
Needs root (network namespaces); exit 77 when they cannot be created.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import emucluster as emu  # noqa: E402

MODELS = {
    "demo": (emu.DEFAULT_MODEL, 1, [128, 128]),
    "moe": (os.path.join(emu.HERE, "models", "qwen3-moe-2l", "config.json"), 2, [64, 64]),
}


def fp8_config(src, block, out_dir):
    """The model's config with block FP8 quantization, as an FP8 checkpoint declares it."""
    with open(src) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": block}
    path = os.path.join(out_dir, f"{os.path.basename(os.path.dirname(src))}-fp8.json")
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    return path


def write_steps(bin_dir, model, lr, steps, out_dir):
    """Steps 0..steps of the RL step model in out_dir (kept from an earlier run when all are there, with the
    generator's output in log.txt); returns the fraction of elements changed per step it printed."""
    os.makedirs(out_dir, exist_ok=True)
    t = time.time()
    log = os.path.join(out_dir, "log.txt")
    have = all(os.path.exists(os.path.join(out_dir, f"step_{k:06d}.safetensors")) for k in range(steps + 1))
    if have and os.path.exists(log):
        with open(log) as f:
            out = f.read()
    else:
        r = subprocess.run([os.path.join(bin_dir, "wsync-rl-steps"), "--config", model, "--lr", str(lr), "--steps",
                            str(steps), "--out", out_dir], capture_output=True, text=True)
        if r.returncode != 0:
            raise emu.HarnessError(f"wsync-rl-steps {model} lr {lr}: exit {r.returncode}: {r.stderr.strip()}")
        out = r.stdout
        with open(log, "w") as f:
            f.write(out)
    changed = [line for line in out.splitlines() if line.startswith("all ")]
    print(f"bench_cluster_delta: {steps} steps of {os.path.relpath(model, emu.ROOT)} at lr {lr} in "
          f"{time.time() - t:.0f} s ({changed[0].split()[-1] if changed else '?'} of the elements change per step)",
          file=sys.stderr)
    return changed[0].split()[-1] if changed else None


def run_config(c, a, row, model, ep, steps_dir, verify_all):
    """One wsync on the running cluster: warm-up, then `pairs` x (dense, delta). Fills `row`. Every update is
    verified by every engine's loader when verify_all, else only the last one (a delta update: it applies only onto
    exactly the base it was encoded against, so it also vouches for the ones before it). FP8 engines verify slowly
    (the reference loader quantizes every weight: ~2 min per update here), hence the choice."""
    c.stop_wsync()
    c.model, c.ep = model, ep
    c.engine_args = ["--steps-dir", steps_dir]
    c.target_args = ["--delta-staging-fraction", str(a.staging_fraction)] if a.staging_fraction else []
    c.trainer_args = ["--steps-dir", steps_dir, "--delta", "auto,off"]  # update 1 auto (dense: nothing held yet)
    c.start_wsync()
    n = 1 + 2 * a.pairs
    if verify_all:
        ups = c.run_updates(1, n)
    else:
        ups = c.run_updates(1, n - 1, verify=False)
        c.trainer_args[-1] = "auto"  # the last update (odd: a delta one) in a run of its own, verified
        ups += c.run_updates(n, 1)
    c.stop_wsync()
    row["verified"] = "every update" if verify_all else "the last update"
    if len(ups) != n or not (all(u["verified"] for u in ups) if verify_all else ups[-1]["verified"]):
        raise emu.HarnessError(f"{row}: updates not verified bit-exact by the engines: {ups}")
    if any("sent_bytes" not in u for u in ups):
        raise emu.HarnessError(f"{row}: the trainer printed no bytes-sent line for some update: {ups}")
    dense, delta = ups[1::2], ups[2::2]
    for u in dense:
        if u["delta_mode"] != "off" or u["delta_ranks"] != 0 or u["sent_bytes"] != u["dense_bytes"]:
            raise emu.HarnessError(f"{row}: update {u['version']} was to be dense: {u}")
    for u in delta:
        if u["delta_ranks"] == 0 or u["dense_ranks"] != 0:
            raise emu.HarnessError(f"{row}: update {u['version']} was to take deltas on every rank: {u}")
    row["engine_ranks"] = ups[0]["engine_ranks"]
    row["dense_mib"] = round(statistics.median(u["dense_bytes"] for u in dense) / 2**20, 2)
    row["sent_mib"] = round(statistics.median(u["sent_bytes"] for u in delta) / 2**20, 3)
    row["bytes_ratio"] = round(statistics.median(u["sent_bytes"] / u["dense_bytes"] for u in delta), 4)
    row["dense_s"] = round(statistics.median(u["seconds"] for u in dense), 3)
    row["delta_s"] = round(statistics.median(u["seconds"] for u in delta), 3)
    row["time_ratio"] = round(row["delta_s"] / row["dense_s"], 3)
    row["delta_push_s"] = round(statistics.median(u["phases"].get("push", 0) for u in delta), 3)
    row["delta_apply_s"] = round(statistics.median(u["phases"].get("apply_delta", 0) for u in delta), 3)
    row["dense_push_s"] = round(statistics.median(u["phases"].get("push", 0) for u in dense), 3)
    row["updates"] = [{k: u[k] for k in ("version", "delta_mode", "seconds", "sent_bytes", "dense_bytes")}
                      for u in ups]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="2x2,4x4")
    ap.add_argument("--models", default="demo,moe", help="demo (models/qwen3-0.6b-4l), moe (models/qwen3-moe-2l)")
    ap.add_argument("--lrs", default="1e-6,1e-5")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--pairs", type=int, default=2, help="(dense, delta) update pairs after the warm-up")
    ap.add_argument("--rate-mbit", type=float, default=400)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--bin", default=os.path.join(emu.ROOT, "build", "bin"))
    ap.add_argument("--steps-cache", default="",
                    help="keep the generated steps in DIR/<model>-<lr> and reuse them (default: a temporary "
                         "directory in /dev/shm, removed after each learning rate)")
    ap.add_argument("--staging-fraction", type=float, default=0,
                    help="the targets' --delta-staging-fraction (0: wsyncd's default, 1/4): records that do not fit "
                         "a connection's staging region are written dense")
    ap.add_argument("--verify-all", action="store_true",
                    help="FP8 engines verify every update too (default: only the last, a delta update)")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    rows = []
    try:
        shapes = []
        for s in a.shapes.split(","):
            parts = s.lower().split("x")
            if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
                raise emu.HarnessError(f"--shapes: '{s}' is not SxT")
            shapes.append((int(parts[0]), int(parts[1])))
        models = [m for m in a.models.split(",") if m]
        if any(m not in MODELS for m in models):
            raise emu.HarnessError(f"--models: one of {', '.join(MODELS)}")
        dtypes = [d for d in a.dtypes.split(",") if d]
        if any(d not in ("bf16", "fp8") for d in dtypes):
            raise emu.HarnessError("--dtypes: bf16 and/or fp8")
        lrs = [float(x) for x in a.lrs.split(",") if x]
        if a.pairs < 1:
            raise emu.HarnessError("--pairs must be at least 1")
        if not os.access(os.path.join(a.bin, "wsync-rl-steps"), os.X_OK):
            raise emu.HarnessError(f"{a.bin}/wsync-rl-steps is missing; build first")
        emu.check_privileges()
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # ~200 MB per step: memory, not disk
        with tempfile.TemporaryDirectory(prefix="wsync-bench-cluster-delta-", dir=shm) as tmp:
            clusters = []
            try:
                # One cluster per shape for the whole run: the same links for every configuration.
                for S, T in shapes:
                    c = emu.Cluster(S, T, a.rate_mbit, a.bin, emu.DEFAULT_MODEL, a.tp, keep_logs=a.keep,
                                    log=lambda m: print(m, file=sys.stderr))
                    clusters.append(c)
                    c.network_up()
                    c.measure_rate()
                for m in models:
                    base, ep, block = MODELS[m]
                    cfgs = {"bf16": base, "fp8": fp8_config(base, block, tmp)}
                    for lr in lrs:
                        steps_dir = os.path.join(a.steps_cache or tmp, f"{m}-{lr:g}")
                        changed = write_steps(a.bin, base, lr, 1 + 2 * a.pairs, steps_dir)
                        for dt in dtypes:
                            for c in clusters:
                                row = {"shape": f"{c.S}x{c.T}", "model": m, "lr": lr, "dtype": dt,
                                       "staging_fraction": a.staging_fraction or 0.25,
                                       "iperf3_mbit": round(c.measured_mbit, 1), "elements_changed": changed}
                                t = time.time()
                                try:
                                    run_config(c, a, row, cfgs[dt], ep, steps_dir, dt == "bf16" or a.verify_all)
                                except emu.HarnessError as e:  # reported in its row; the other configurations run
                                    c.stop_wsync()
                                    row["error"] = str(e)[-1500:]
                                rows.append(row)
                                print(f"bench_cluster_delta: {json.dumps({k: v for k, v in row.items() if k != 'updates'})} "
                                      f"({time.time() - t:.0f} s)", file=sys.stderr)
                        if not a.steps_cache:
                            shutil.rmtree(steps_dir, ignore_errors=True)
            finally:
                for c in clusters:
                    c.close(failed=sys.exc_info()[0] is not None)
    except emu.Unsupported as e:
        print(f"bench_cluster_delta: cannot run here: {e}", file=sys.stderr)
        return emu.SKIP
    except emu.HarnessError as e:
        print(f"bench_cluster_delta: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench_cluster_delta: interrupted; cleaned up", file=sys.stderr)
        return 130

    hdr = ("shape", "model", "lr", "engines", "changed", "dense MiB", "sent MiB", "sent/dense", "dense s", "delta s",
           "delta/dense", "delta push s", "apply s")
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['model']} | {r['lr']:g} | {r['dtype']} | FAILED: "
                  f"{r['error'].splitlines()[0][:200]} |")
            continue
        print(f"| {r['shape']} | {r['model']} | {r['lr']:g} | {r['dtype']} | {r['elements_changed']} | "
              f"{r['dense_mib']:.1f} | {r['sent_mib']:.2f} | {r['bytes_ratio']:.4f} | {r['dense_s']:.2f} | "
              f"{r['delta_s']:.2f} | {r['time_ratio']:.3f} | {r['delta_push_s']:.2f} | {r['delta_apply_s']:.2f} |")
    ok = [r for r in rows if "error" not in r]
    if not ok:
        print("bench_cluster_delta: every configuration failed", file=sys.stderr)
        return 1
    main_row = next((r for r in ok if r["model"] == "demo" and r["lr"] == 1e-6 and r["dtype"] == "bf16"), ok[0])
    print(json.dumps({"bench": "cluster_delta", "value": main_row["bytes_ratio"], "time_ratio": main_row["time_ratio"],
                      "unit": "sent/dense", "shape": main_row["shape"], "model": main_row["model"],
                      "lr": main_row["lr"], "dtype": main_row["dtype"], "rate_mbit": a.rate_mbit, "rows": rows}))
    return 0 if len(ok) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
