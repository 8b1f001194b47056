#!/usr/bin/env python3
"""bench/cluster: relay trees vs direct P2P vs the broadcast baseline on an emulated cluster (emucluster.py), per
shape S x T (trainer nodes x inference nodes, one engine instance per inference node), in one invocation over the
same namespaces and tc-shaped links (docs/planner.md, "Relay plans"):

  direct   the coordinator with --relay off: the sources write every engine instance
  relay    the coordinator with --relay RELAY (default auto: the link-rate model, planner/relay_shape.h, picks the
           degree, or direct): the sources write one instance per layout group, the target daemons forward
  bcast    torch.distributed broadcast (gloo) of every HF tensor from one head rank to every engine rank
           (bench_cluster.py's baseline, bcast_rank.py)

Each wsync row is the median of the steady-state updates (the first, which configures, is a warm-up), every one
verified bit-exact by every engine rank's own loader. Trainer egress is counted twice, independently: the
coordinator's record (MiB the sources sent, per update) and the source namespaces' NIC counters (eth0 tx_bytes,
TCP/IP headers and control traffic included) over all updates, divided by their count.

    bench_relay.py [--shapes 2x1,2x4,2x8] [--rate-mbit 400] [--updates 3] [--relay auto] [--no-bcast]
                   [--plot bench/cluster/results/relay.png] [--python /path/to/python-with-torch]

Prints a table and ends with one JSON line {"bench":"cluster_relay","value":relay s,"baseline":direct s,
"ratio":direct/relay,...} for the largest shape, every shape under "shapes". Needs root; exit 77 when namespaces
cannot be created. A bench, not a test: not run by CI.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_cluster as bc  # noqa: E402
import emucluster as emu  # noqa: E402


def tx_bytes(c, nodes):
    total = 0
    for n in nodes:
        r = subprocess.run(["ip", "netns", "exec", n.ns, "cat", "/sys/class/net/eth0/statistics/tx_bytes"],
                           capture_output=True, text=True, check=True)
        total += int(r.stdout.strip())
    return total


def wsync_updates(c, a, res, key, relay):
    """Starts wsync with --relay `relay`, runs the updates, fills res[key + "_*"]."""
    c.coordinator_args = ["--relay", relay]
    c.start_wsync()
    t0 = bc.cpu_times()
    tx0 = tx_bytes(c, c.sources)
    ups = c.run_updates(1, a.updates)
    tx1 = tx_bytes(c, c.sources)
    coord_log = c.log_tail("coordinator", 400)
    c.stop_wsync()
    res[f"{key}_cpu_cores"] = round(bc.cpu_busy(t0, bc.cpu_times()), 2)
    if len(ups) != a.updates or not all(u["verified"] for u in ups):
        raise emu.HarnessError(f"{res['shape']} {key}: updates not all verified bit-exact: {ups}")
    steady = ups[1:] or ups
    res[f"{key}_s"] = round(statistics.median(u["seconds"] for u in steady), 3)
    res[f"{key}_runs_s"] = [round(u["seconds"], 3) for u in ups]
    res[f"{key}_push_s"] = round(statistics.median(u["phases"].get("push", 0) for u in steady), 3)
    # Every phase of the coordinator's record (relay_drain: after the sources finished, until every relay checked
    # and forwarded everything), median over the steady updates.
    names = sorted({k for u in steady for k in u["phases"]})
    res[f"{key}_phases_s"] = {k: round(statistics.median(u["phases"].get(k, 0) for u in steady), 3) for k in names}
    res[f"{key}_egress_mib"] = ups[0]["mib"]
    res[f"{key}_nic_tx_mib"] = round((tx1 - tx0) / len(ups) / 2**20, 1)
    res["engine_ranks"] = ups[0]["engine_ranks"]
    # What the coordinator decided (relay_wiring.cc logs each group's choice, or why it was not relayed).
    res[f"{key}_decision"] = "; ".join(
        m.group(1).strip() for m in re.finditer(r"relay: (group .*)$", coord_log, re.M)) or (
        "off" if relay == "off" else "no relayed group")


def run_shape(a, S, T, py, manifest, raw):
    res = {"shape": f"{S}x{T}", "sources": S, "targets": T, "relay_mode": a.relay,
           "loadavg_before": round(os.getloadavg()[0], 2)}
    m0 = bc.machine_times()
    with emu.Cluster(S, T, a.rate_mbit, a.bin, a.model, a.tp, 0.0, trainer_ranks=1, keep_logs=a.keep,
                     log=lambda m: print(m, file=sys.stderr)) as c:
        c.network_up()
        mbit = c.measure_rate()
        res["iperf3_mbit"] = round(mbit, 1)
        wsync_updates(c, a, res, "direct", "off")
        wsync_updates(c, a, res, "relay", a.relay)
        if not a.no_bcast:
            bc.broadcast(c, res, py, manifest, raw)
    res["machine_cpu_cores"] = round(bc.cpu_busy(m0, bc.machine_times()), 2)
    res["loadavg_after"] = round(os.getloadavg()[0], 2)
    res["direct_over_relay"] = round(res["direct_s"] / res["relay_s"], 3)
    res["egress_direct_over_relay"] = round(res["direct_nic_tx_mib"] / res["relay_nic_tx_mib"], 3)
    if "bcast_s" in res:
        res["bcast_over_relay"] = round(res["bcast_s"] / res["relay_s"], 3)
    # The cost model for the same cluster at the measured rate (serial executor, no trainer gather, as bench_cluster).
    argv = [os.path.join(a.bin, "wsyncctl"), "plan", "--model", a.model, "--train", f"tp=1,pp=1,nodes={S},gpus=1",
            "--infer", f"instances={T},tp={a.tp},ep=1,nodes={T}", "--nic", emu.nic_spec(mbit), "--strategy",
            "balanced", "--executor", "serial", "--no-gather", "--relay", a.relay, "-w", "json"]
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode == 0:
        p = json.loads(r.stdout)
        rel = p.get("relay", {})
        res["predicted_direct_s"] = round(rel.get("direct_predicted_s", p["predicted_s"]), 3)
        res["predicted_relay_s"] = round(rel.get("predicted_s", p["predicted_s"]), 3)
    else:
        print(f"bench_relay: {' '.join(argv)}: {r.stderr.strip()}", file=sys.stderr)
    return res


def write_plot(path, rows, single):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"bench_relay: no matplotlib for this python ({sys.executable}); plot skipped", file=sys.stderr)
        return None
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    x = [r["targets"] for r in rows]
    ax.plot(x, [r["direct_s"] for r in rows], "o-", label="direct P2P")
    ax.plot(x, [r["relay_s"] for r in rows], "s-", label=f"relay ({rows[0]['relay_mode']})")
    if all("bcast_s" in r for r in rows):
        ax.plot(x, [r["bcast_s"] for r in rows], "^-", label="broadcast + load (gloo)")
    if single:
        ax.axhline(single * 1.15, color="k", ls="--", lw=0.8, label="1.15 x one instance")
    ax.set_xlabel("engine instances (2 trainer nodes)")
    ax.set_ylabel("update time (s)")
    ax.set_xticks(x)
    ax.grid(alpha=0.3)
    ax.legend()
    bx.plot(x, [r["direct_nic_tx_mib"] for r in rows], "o-", label="direct")
    bx.plot(x, [r["relay_nic_tx_mib"] for r in rows], "s-", label="relay")
    bx.set_xlabel("engine instances")
    bx.set_ylabel("trainer egress per update (MiB, NIC counters)")
    bx.set_xticks(x)
    bx.grid(alpha=0.3)
    bx.legend()
    fig.suptitle(f"relay trees vs direct, {rows[0]['iperf3_mbit']:.0f} Mbit/s emulated links, 2 CPU cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="2x1,2x4,2x8")
    ap.add_argument("--rate-mbit", type=float, default=400)
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--relay", default="auto", help="the coordinator's --relay for the relay rows (auto or a degree)")
    ap.add_argument("--model", default=emu.DEFAULT_MODEL)
    ap.add_argument("--bin", default=os.path.join(emu.ROOT, "build", "bin"))
    ap.add_argument("--python", default="")
    ap.add_argument("--no-bcast", action="store_true", help="leave the broadcast baseline out")
    ap.add_argument("--plot", default="")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    try:
        shapes = []
        for s in a.shapes.split(","):
            parts = s.lower().split("x")
            if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
                raise emu.HarnessError(f"--shapes: '{s}' is not SxT (e.g. 2x4)")
            shapes.append((int(parts[0]), int(parts[1])))
        if a.updates < 2:
            raise emu.HarnessError("--updates must be at least 2 (the first one is a warm-up)")
        emu.check_privileges()
        py = None if a.no_bcast else bc.torch_python(a.python)
        rows = []
        with tempfile.TemporaryDirectory(prefix="wsync-bench-relay-") as tmp:
            raw = os.path.join(tmp, "weights.bin")
            if not a.no_bcast:
                subprocess.run([os.path.join(a.bin, "bench_cluster_weights"), "--model", a.model, "--step",
                                str(a.updates + 1), "--out", raw], check=True)
            for S, T in shapes:
                t = time.time()
                rows.append(run_shape(a, S, T, py, raw + ".json", raw))
                print(f"bench_relay: {S}x{T} done in {time.time() - t:.0f} s: {json.dumps(rows[-1])}", file=sys.stderr)
    except emu.Unsupported as e:
        print(f"bench_relay: cannot run here: {e}", file=sys.stderr)
        return emu.SKIP
    except (emu.HarnessError, subprocess.CalledProcessError) as e:
        print(f"bench_relay: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench_relay: interrupted; cleaned up", file=sys.stderr)
        return 130

    ones = [r for r in rows if r["targets"] == 1]
    single = ones[0]["direct_s"] if ones else None
    hdr = ("shape", "Mbit/s", "direct s", "relay s (push + drain)", "direct/relay", "bcast s", "bcast/relay", "relay/one inst.",
           "egress MiB direct/relay (record)", "egress MiB direct/relay (NIC)", "pred direct/relay s", "relay decision",
           "machine cores")
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for r in rows:
        bcast = f"{r['bcast_s']:.2f}" if "bcast_s" in r else "-"
        bratio = f"{r['bcast_over_relay']:.2f}x" if "bcast_s" in r else "-"
        one = f"{r['relay_s'] / single:.2f}" if single else "-"
        pred = (f"{r['predicted_direct_s']:.2f}/{r['predicted_relay_s']:.2f}" if "predicted_relay_s" in r else "-")
        drain = r["relay_phases_s"].get("relay_drain")
        relay = f"{r['relay_s']:.2f}" + (f" ({r['relay_push_s']:.2f} + {drain:.2f})" if drain is not None else "")
        print(f"| {r['shape']} | {r['iperf3_mbit']:.0f} | {r['direct_s']:.2f} | {relay} | "
              f"{r['direct_over_relay']:.2f}x | {bcast} | {bratio} | {one} | "
              f"{r['direct_egress_mib']:.0f}/{r['relay_egress_mib']:.0f} | "
              f"{r['direct_nic_tx_mib']:.0f}/{r['relay_nic_tx_mib']:.0f} | {pred} | {r['relay_decision']} | "
              f"{r['machine_cpu_cores']:.2f} |")
    plot = write_plot(a.plot, rows, single) if a.plot else None
    if plot:
        print(f"bench_relay: plot written to {plot}", file=sys.stderr)
    main_row = max(rows, key=lambda r: r["targets"])
    print(json.dumps({"bench": "cluster_relay", "value": main_row["relay_s"], "baseline": main_row["direct_s"],
                      "ratio": main_row["direct_over_relay"], "unit": "s", "shape": main_row["shape"],
                      "relay": a.relay, "rate_mbit": a.rate_mbit, "tp": a.tp,
                      "relay_over_one_instance": round(main_row["relay_s"] / single, 3) if single else None,
                      "egress_relay_over_one_instance": round(main_row["relay_nic_tx_mib"] / ones[0]["direct_nic_tx_mib"], 3)
                      if ones else None,
                      "model": os.path.relpath(a.model, emu.ROOT), "shapes": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
