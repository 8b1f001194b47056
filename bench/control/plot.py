#!/usr/bin/env python3
"""Plots bench_control's growth with N as a PNG: control overhead (median BeginUpdate -> CommitUpdate), its begin and
commit parts, and BeginUpdate after a membership change, against engine ranks, on log-log axes with the goals
(<= 100 ms at 256, <= 500 ms at 1024 engine ranks) marked. Reads the JSON line bench_control ends with; a second
JSON line (--before) is drawn dashed, for a before/after comparison measured the same way.

  bench_control --sizes 64:32,256:64,1024:256 | tee out.log
  bench/control/plot.py out.log --before before.log --out control_bench.png

Needs matplotlib (Debian: python3-matplotlib).
"""
import argparse
import json
import sys


def last_json(path):
    with open(path) as f:
        lines = [ln for ln in f if ln.startswith("{") and '"bench":"control"' in ln.replace(" ", "")]
    if not lines:
        sys.exit(f"plot.py: no bench_control JSON line in {path}")
    return json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("after", help="bench_control output (its last JSON line is used)")
    ap.add_argument("--before", help="an earlier bench_control output, drawn dashed")
    ap.add_argument("--out", default="control_bench.png")
    args = ap.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot.py: matplotlib is not installed (Debian: apt-get install python3-matplotlib)")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    runs = [(last_json(args.after), "-", "")]
    if args.before:
        runs.append((last_json(args.before), "--", " (before)"))
    series = [("overhead_ms", "overhead (begin→commit)", "C0"), ("begin_ms", "begin", "C1"),
              ("commit_ms", "commit", "C2"), ("replan_begin_ms", "begin after a membership change", "C3")]
    for run, style, tag in runs:
        sizes = sorted(run["sizes"], key=lambda s: s["target_ranks"])
        n = [s["target_ranks"] for s in sizes]
        for key, label, color in series:
            ax.plot(n, [max(s[key], 0.01) for s in sizes], style, marker="o", color=color, label=label + tag)
    ax.plot([256, 1024], [100, 500], "k*", markersize=12, label="goals (≤100 ms @256, ≤500 ms @1024)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("engine ranks")
    ax.set_ylabel("ms per update")
    ax.set_title(f"bench_control: control plane growth with N (RTT {runs[0][0]['rtt_ms']:.3f} ms)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
