#!/usr/bin/env python3
"""Turns kept bench_node outputs (the lines it prints, saved as bench/node/results/*.txt) into the node rates file
the planner reads (planner/node_rates.h: "curves" by WEIGHTS/TENSORS/PATH, "d2h_gbps").

For runs that ended before bench_node could write --results-out itself (a time limit): every figure comes from a
line bench_node printed, and each curve records the file and line of each of its points. Files are read in the
order given; a later file's figure for the same (curve, engine TP, R) replaces an earlier one (pass them oldest
first). Only the engine TP asked for (--tp) is kept.

  bench/node/rates_from_outputs.py --tp 8 --machine "..." --out bench/node/results/default.json \\
      bench/node/results/h200-2026-12-05-qwen3-8b.txt bench/node/results/h200-2026-12-05-dense-cuda-kimi.txt
"""

import argparse
import json
import os
import re
import sys

# "<case> <label> TP t[ EP e], R r, <mode>: X GB in Y s = Z GB/s, ..." (bench_node since its cases);
# "TP t, R r, <mode>: ..." (the first runs, the dense case of host tensors only).
CASE_LINE = re.compile(
    r"^(?P<case>dense|moe|tcp|cuda) (?P<label>.+?) TP (?P<tp>\d+)(?: EP \d+)?, R (?P<r>\d+), "
    r"(?P<path>ring|placement)(?: \((?P<copy>[a-z-]+)\))?: [\d.]+ GB in [\d.]+ s = (?P<gbps>[\d.]+) GB/s")
OLD_LINE = re.compile(
    r"^TP (?P<tp>\d+), R (?P<r>\d+), (?P<path>ring|placement): [\d.]+ GB in [\d.]+ s = (?P<gbps>[\d.]+) GB/s")
D2H_LINE = re.compile(r"pinned D2H of the same bytes (?P<one>[\d.]+) GB/s on 1 stream, (?P<many>[\d.]+) GB/s on \d+")


def weights_of(label):
    """The WEIGHTS part of a curve name for a workload label bench_node prints."""
    if "pass-through" in label:
        return "fp8-passthrough"
    if "FP8" in label or "fp8" in label:
        return "fp8-quantize"  # bf16 pushed, quantized by the node
    return "bf16"


def parse(paths, tp):
    points = {}  # curve name -> {R: (gbps, "file:line")}
    d2h = None
    for path in paths:
        name = os.path.relpath(path)
        with open(path, encoding="utf-8") as f:
            for no, line in enumerate(f, 1):
                line = line.strip()
                m = D2H_LINE.search(line)
                if m:
                    peak = max(float(m["one"]), float(m["many"]))
                    if d2h is None or peak > d2h[0]:
                        d2h = (peak, f"{name}:{no}")
                    continue
                m = CASE_LINE.match(line)
                if m:
                    case = m["case"]
                    if case == "tcp":
                        continue  # the send path, not a replica load
                    if m["copy"] == "per-region":
                        continue  # the comparison mode, not what the client does
                    tensors = "cuda" if case == "cuda" else "host"
                    curve = f"{weights_of(m['label'])}/{tensors}/{m['path']}"
                else:
                    m = OLD_LINE.match(line)
                    if not m:
                        continue
                    curve = f"bf16/host/{m['path']}"
                if int(m["tp"]) != tp:
                    continue
                points.setdefault(curve, {})[int(m["r"])] = (float(m["gbps"]), f"{name}:{no}")
    return points, d2h


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outputs", nargs="+", help="bench_node outputs, oldest first")
    ap.add_argument("--tp", type=int, default=8, help="engine TP whose figures are kept (default 8: the seed's)")
    ap.add_argument("--machine", required=True, help="what the outputs were measured on")
    ap.add_argument("--date", required=True, help="when")
    ap.add_argument("--note", default="", help="kept in the file for the reader")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    points, d2h = parse(a.outputs, a.tp)
    if not points:
        sys.exit(f"no bench_node figures at engine TP {a.tp} in {', '.join(a.outputs)}")
    curves = {}
    for curve in sorted(points):
        by_r = points[curve]
        files = sorted({where.rsplit(":", 1)[0] for _, where in by_r.values()})
        curves[curve] = {
            "gbps": [[r, by_r[r][0]] for r in sorted(by_r)],
            "tp": a.tp,
            "source": ", ".join(files),
            "points_from": {str(r): by_r[r][1] for r in sorted(by_r)},
        }
    out = {
        "machine": a.machine,
        "date": a.date,
        "command": "bench/node/rates_from_outputs.py --tp %d %s (from the bench_node command lines at the top of "
                   "each file)" % (a.tp, " ".join(os.path.relpath(p) for p in a.outputs)),
    }
    if a.note:
        out["note"] = a.note
    if d2h:
        out["d2h_gbps"] = d2h[0]
        out["d2h_from"] = d2h[1]
    out["curves"] = curves
    text = json.dumps(out, indent=2)
    # One line per curve's points: [[1, 5.63], [4, 13.52], [8, 17.65]].
    text = re.sub(r"\[\s*(\d+),\s*([\d.]+)\s*\]", r"[\1, \2]", text)
    text = re.sub(r"\[\s*(\[\d+, [\d.]+\](?:,\s*\[\d+, [\d.]+\])*)\s*\]",
                  lambda m: "[" + re.sub(r",\s+", ", ", m[1]) + "]", text)
    with open(a.out, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    for curve, c in curves.items():
        print(f"{curve}: {c['gbps']} ({c['source']})")
    if d2h:
        print(f"d2h_gbps: {d2h[0]} ({d2h[1]})")


if __name__ == "__main__":
    main()
