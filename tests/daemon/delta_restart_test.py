#!/usr/bin/env python3
"""A restarted engine between two delta updates (docs/delta.md, "Fallback to dense"), through real processes.

Consecutive sparse steps (tools/testdata/weight_gen.h: ~2 % of the elements change per step) go to two reference
engines of TP 2 on two target daemons: the first update is dense (nothing held yet), the second takes deltas on
every rank. Then engine0 is SIGKILLed and started again on the same address with fresh memory, and its target daemon
with it (a restarted engine attaches through a restarted target daemon, docs/engines.md). The restarted daemon
registers new memory regions, so the coordinator configures the source again; only where engine0's memory is
changed, so the source keeps its delta base (docs/delta.md, "Delta base"). The next update must not send deltas onto
the restarted ranks (their memory no longer holds the base): both are written dense with the reason, while engine1,
untouched, keeps taking deltas; each engine's own loader verifies every byte; the update after it takes deltas on
every rank again, verified too. Every check that an engine holds step v also checks that it does not hold step v-1
(the check can fail).

  delta_restart_test.py --bin build/bin --model tests/data/tiny/qwen3-tiny.json
"""
import argparse
import json
import os
import signal
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "engines"))
import harness  # noqa: E402

check = harness.Checks()
BASE = 1000000  # tools/testdata/weight_gen.h kSparseStepBase: later steps change ~2 % of the elements
ALL = ["engine0/0", "engine0/1", "engine1/0", "engine1/1"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    args = ap.parse_args()
    b = os.path.abspath(args.bin)
    model = os.path.abspath(args.model)

    with harness.workdir("wsync-delta-restart-", keep=bool(os.environ.get("WSYNC_KEEP"))) as wd:
        procs = harness.Procs(wd)
        try:
            def port_of(name):
                path = os.path.join(wd, f"{name}.port")
                if os.path.exists(path):
                    os.unlink(path)
                return harness.wait_for(f"{name} port", lambda: harness.read_port_file(path), 60, procs, [name])

            def ctl(*a):
                r = subprocess.run([f"{b}/wsyncctl", *a, "--endpoints", coord, "-w", "json"], capture_output=True,
                                   text=True, timeout=30)
                return r.returncode, (json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else {})

            def engine_registered():
                rc, st = ctl("status")
                nodes = {n["node_id"]: n for n in st.get("nodes", []) if n.get("reachable")}
                return (sorted(nodes) == ["infer0", "infer1", "train0"] and
                        all(len(nodes[n].get("engine_details", [])) == 1 for n in ("infer0", "infer1"))) or None

            def start_engine(i=0):
                procs.start(f"engine{i}", [f"{b}/wsync-engine-ref", "--id", f"engine{i}", "--model", model, "--tp",
                                           "2", "--listen", engs[i], "--port-file",
                                           os.path.join(wd, f"engine{i}.port")])
                port_of(f"engine{i}")

            def start_target(i=0):
                procs.start(f"target{i}", [f"{b}/wsyncd", "--listen", "127.0.0.1:0", "--role", "target", "--node-id",
                                           f"infer{i}", "--coordinator", coord, "--engine",
                                           f"reference+grpc://{engs[i]}",
                                           "--engine-socket", os.path.join(wd, f"target{i}.sock"),
                                           "--port-file", os.path.join(wd, f"target{i}.port")])
                port_of(f"target{i}")

            def verify_one(i, step):
                r = subprocess.run([f"{b}/wsyncctl", "verify", "--engine", engs[i], "--step", str(step)],
                                   capture_output=True, text=True, timeout=60)
                return r.returncode == 0

            def verify(step):
                return all(verify_one(i, step) for i in (0, 1))

            def update(v):
                """Update v (delta=auto, the default) from the demo trainer; returns its history record."""
                r = subprocess.run([f"{b}/wsync-trainer-demo", "--daemon", src, "--model", model, "--updates", "1",
                                    "--first-version", str(v), "--drive", "--coordinator", coord],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
                check(r.returncode == 0, f"update {v} committed (rc {r.returncode}): {r.stdout.strip()[-600:]}")
                rec = harness.last_update_record(b, coord)
                check(str(rec.get("version")) == str(v) and rec.get("success") is True,
                      f"history: update {v} succeeded: {rec.get('error', '')}")
                for i in (0, 1):
                    check(verify_one(i, v) and not verify_one(i, v - 1), f"update {v}: engine{i}'s own loader "
                          f"verifies step {v} and refuses step {v - 1}")
                sent, dense = int(rec.get("sent_bytes", 0)), int(rec.get("dense_bytes", 0))
                print(f"update {v}: {sent} bytes sent for {dense} dense; delta ranks {rec.get('delta_ranks', [])}; "
                      f"fallbacks {rec.get('fallbacks', [])}")
                return rec, sent, dense

            def took_deltas(v, rec, sent, dense):
                check(sorted(rec.get("delta_ranks", [])) == ALL and not rec.get("fallbacks")
                      and 0 < sent < 0.1 * dense, f"update {v}: every rank took deltas ({sent} of {dense} bytes)")

            coord = f"127.0.0.1:{harness.free_port()}"
            # fixed: the restarted engine listens where the first did
            engs = [f"127.0.0.1:{harness.free_port()}", f"127.0.0.1:{harness.free_port()}"]
            src = os.path.join(wd, "source.sock")
            procs.start("coordinator", [f"{b}/wsync-coordinator", "--listen", coord])
            harness.wait_for("coordinator serving", lambda: ctl("status")[0] == 0 or None, 30, procs, ["coordinator"])
            for i in (0, 1):
                start_engine(i)
                start_target(i)
            procs.start("source", [f"{b}/wsyncd", "--listen", "127.0.0.1:0", "--role", "source", "--node-id",
                                   "train0", "--trainer-socket", src, "--coordinator", coord, "--trainer-ranks", "1",
                                   "--ring-mib", "16", "--port-file", os.path.join(wd, "source.port")])
            port_of("source")
            harness.wait_for("engine registered", engine_registered, 30, procs, ["source", "target0", "target1"])

            rec, sent, dense = update(BASE)
            check(not rec.get("delta_ranks") and sent == dense, f"update {BASE}: dense (nothing held yet)")
            took_deltas(BASE + 1, *update(BASE + 1))

            # The engine dies and comes back on the same address with fresh memory; its ranks attach through a
            # restarted target daemon under the same node id.
            procs.kill("engine0", signal.SIGKILL)
            procs.kill("target0", signal.SIGKILL)
            start_engine(0)
            check(not verify_one(0, BASE + 1), "the restarted engine does not hold the last update (fresh memory)")
            start_target(0)
            harness.wait_for("restarted engine registered", engine_registered, 60, procs, ["source", "target0", "target1"])

            v = BASE + 2
            rec, sent, dense = update(v)
            falls = {f.get("rank"): f.get("reason", "") for f in rec.get("fallbacks", [])}
            # The source was configured again (new region descriptors) and kept its base: the restarted ranks are
            # dense because they hold nothing, engine1's take deltas from the kept base.
            check(sorted(rec.get("delta_ranks", [])) == ["engine1/0", "engine1/1"]
                  and sorted(falls) == ["engine0/0", "engine0/1"]
                  and all("the rank holds no known version" in r for r in falls.values()) and sent < 0.6 * dense,
                  f"update {v} after the restart: engine0 dense with its reason, engine1 deltas: {falls}, "
                  f"{rec.get('delta_ranks', [])}, {sent} of {dense} bytes")
            took_deltas(v + 1, *update(v + 1))
        finally:
            procs.close()
    return check.verdict()


if __name__ == "__main__":
    sys.exit(main())
