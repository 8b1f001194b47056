#!/usr/bin/env python3
"""A source or target daemon or the engine killed mid-update, through real processes (docs/operations.md, "Coordinator restarts and daemon leases"):

Update 1 succeeds; then, for a source SIGKILLed, a target SIGKILLed, a source SIGSTOPped (hung: only the
coordinator's lease on it can tell) and the engine SIGKILLed (the writes land in the memory its target daemon still
maps; the commit's post-process finds the engine gone), an update is started with the source's writes slowed down
(WSYNC_FAULTS delay_ms) and the victim is hit mid-update. Each scenario asserts that
- the update fails within a bound (seconds, not the 120-300 s call timeouts), with an error naming the dead node;
- the coordinator records the failure, flags the engine as possibly holding partial writes and refuses to resume it,
  and the engine keeps its previous weight version label (never continued at the new one);
- after the daemon is restarted under the same node id, the next update succeeds and the engine's own loader
  verifies every byte.
Last, the engine is SIGKILLed between updates: the next update fails at its start (the pause), naming the engine,
within the bound; after the engine and its target daemon are restarted the next update is verified.
Prints each detection time.

  kill_test.py --bin build/bin --model tests/data/tiny/qwen3-tiny.json
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "engines"))
import harness  # noqa: E402

check = harness.Checks()
FAIL_BOUND_S = 20.0  # a dead daemon must fail the update well within this


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    args = ap.parse_args()
    b = os.path.abspath(args.bin)
    model = os.path.abspath(args.model)

    with harness.workdir("wsync-kill-", keep=bool(os.environ.get("WSYNC_KEEP"))) as wd:
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

            def nodes_up():
                rc, st = ctl("status")
                up = sorted(n["node_id"] for n in st.get("nodes", []) if n.get("reachable"))
                return up == ["infer0", "train0"] or None

            def start_target():
                procs.start("target", [f"{b}/wsyncd", "--listen", "127.0.0.1:0", "--role", "target", "--node-id",
                                       "infer0", "--coordinator", coord, "--engine", f"reference+grpc://{eng}",
                                       "--engine-socket", os.path.join(wd, "target.sock"),
                                       "--port-file", os.path.join(wd, "target.port")])
                port_of("target")

            def start_source(delay_ms=0):
                env = {"WSYNC_FAULTS": f"delay_ms={delay_ms}"} if delay_ms else None
                # A fixed port: the trainer rank dials the same address after the restart.
                procs.start("source", [f"{b}/wsyncd", "--listen", src_listen, "--role", "source", "--node-id", "train0",
                                       "--trainer-socket", src,
                                       "--coordinator", coord, "--trainer-ranks", "1", "--ring-mib", "64",
                                       "--port-file", os.path.join(wd, "source.port")], env=env)
                port_of("source")

            def trainer(v, background=False):
                argv = [f"{b}/wsync-trainer-demo", "--daemon", src, "--model", model, "--updates", "1",
                        "--first-version", str(v), "--drive", "--coordinator", coord, "--verify-engine", eng,
                        "--bucket-mib", "1"]
                if background:
                    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180)
                print(r.stdout.strip()[-1200:])
                return r.returncode == 0 and "MISMATCH" not in r.stdout

            def engine_states():
                rc, st = ctl("status")
                return [e.get("state", "") for n in st.get("nodes", []) for e in n.get("engine_details", [])]

            coord = f"127.0.0.1:{harness.free_port()}"
            src_listen = f"127.0.0.1:{harness.free_port()}"
            src = os.path.join(wd, "source.sock")  # trainer ranks reach their daemon through its local socket
            procs.start("coordinator", [f"{b}/wsync-coordinator", "--listen", coord])
            harness.wait_for("coordinator serving", lambda: ctl("status")[0] == 0 or None, 30, procs, ["coordinator"])
            eng = f"127.0.0.1:{harness.free_port()}"  # fixed: the target dials the same address after a restart

            def start_engine():
                procs.start("engine", [f"{b}/wsync-engine-ref", "--id", "engine0", "--model", model, "--tp", "2",
                                       "--listen", eng, "--port-file", os.path.join(wd, "engine.port")])
                port_of("engine")

            start_engine()
            start_target()
            start_source()
            harness.wait_for("both daemons registered", nodes_up, 30, procs, ["source", "target"])

            version = 1
            check(trainer(version), f"update {version} lands, verified by the engine")
            # (victim, node id, how): SIGKILL = the process died (its sockets close at once); SIGSTOP = it hangs
            # (nothing closes: only the coordinator's lease on the node can tell).
            for victim, node, how in (("source", "train0", "kill"), ("target", "infer0", "kill"),
                                      ("source", "train0", "stop"), ("engine", "engine0", "kill")):
                tag = f"{victim} {how}"
                # Slow the source's writes so the update is still moving data when the victim dies.
                procs.kill("source")
                start_source(delay_ms=2000)
                harness.wait_for("source registered", nodes_up, 30, procs, ["source"])
                version += 1
                t = trainer(version, background=True)

                # The ranks' pushes return once their batches are queued for the source's writers (issue 39): the
                # slowed writes may be drained while the coordinator commits.
                harness.wait_for(f"update {version} open",
                                 lambda: ctl("status")[1].get("state") in ("updating", "committing") or None,
                                 60, procs, ["source", "target"], 0.05)
                time.sleep(1.0)  # the source is now inside a slowed-down write
                t_kill = time.time()
                if how == "kill":
                    procs.kill(victim)
                    try:
                        out, _ = t.communicate(timeout=120)
                    except subprocess.TimeoutExpired:
                        t.kill()
                        out, _ = t.communicate()
                    took = time.time() - t_kill
                    print(out.strip()[-600:])
                    check(t.returncode != 0, f"[{tag}] update {version} failed (trainer exit {t.returncode})")
                else:
                    os.killpg(procs.procs[victim].pid, signal.SIGSTOP)
                    harness.wait_for(f"update {version} failed by the lease",
                                     lambda: ctl("status")[1].get("state") == "failed" or None, 60, None, None, 0.1)
                    took = time.time() - t_kill
                    t.kill()  # its pushes wait on the hung daemon
                    t.communicate()
                    os.killpg(procs.procs[victim].pid, signal.SIGCONT)
                    procs.kill(victim)
                print(f"kill_test: [{tag}] mid-update: the update failed {took:.2f} s after the {how}")
                check(took < FAIL_BOUND_S, f"[{tag}] failure reported {took:.1f} s after the {how} "
                      f"(bound {FAIL_BOUND_S:.0f} s)")
                rc, h = ctl("history")
                rec = next((r for r in h.get("records", []) if str(r.get("version")) == str(version)), {})
                check(rec.get("success") is False and node in rec.get("error", "")
                      and (how != "stop" or "lost its lease" in rec.get("error", "")),
                      f"[{tag}] history records update {version} as failed naming {node}: "
                      f"{rec.get('error', '')[:200]!r}")
                rc, st = ctl("status")
                check(st.get("state") == "failed", f"[{tag}] coordinator state failed: {st.get('state')!r}")
                states = engine_states()
                check((victim == "engine" or states) and all(not x.startswith("serving") for x in states),
                      f"[{tag}] engine not continued after the failed update: {states}")
                # A source was inside a write when the victim died: the coordinator cannot know no byte landed.
                check(st.get("engines_hold_partial_writes") is True,
                      f"[{tag}] engines flagged as possibly holding partial writes")
                rc, _ = ctl("resume")
                check(rc == 1, f"[{tag}] resume refused while the engine may hold partial writes (rc {rc})")

                # Restart the dead daemon under its node id; the next update must land bit-exact.
                if victim == "source":
                    procs.kill("source")
                    start_source()
                elif victim == "engine":
                    # A restarted engine attaches through a restarted target daemon (docs/operations.md).
                    procs.kill("target")
                    start_engine()
                    start_target()
                    procs.kill("source")
                    start_source()
                else:
                    start_target()
                    procs.kill("source")  # also drop the slowed-down source
                    start_source()
                harness.wait_for(f"{node} registered again", nodes_up, 30, procs, ["source", "target"])
                version += 1
                check(trainer(version), f"[{tag}] update {version} after the restart lands, verified by the "
                      f"engine")
                rc, st = ctl("status")
                check(st.get("current_version") == str(version) and not st.get("engines_hold_partial_writes"),
                      f"[{tag}] version {version}, engines clean: {st.get('current_version')!r}")

            # The engine dies between updates: the next update fails at the pause, naming it.
            procs.kill("engine")
            version += 1
            t_kill = time.time()
            ok = trainer(version)
            took = time.time() - t_kill
            print(f"kill_test: [engine kill] between updates: update {version} refused {took:.2f} s after its start")
            check(not ok, f"[engine kill] update {version} fails while the engine is dead")
            check(took < FAIL_BOUND_S, f"[engine kill] refused within {took:.1f} s (bound {FAIL_BOUND_S:.0f} s)")
            rec = harness.last_update_record(b, coord)
            check(str(rec.get("version")) == str(version) and rec.get("success") is False
                  and "pause engine engine0" in rec.get("error", ""),
                  f"[engine kill] history records update {version} as failed at the pause of engine0: "
                  f"{rec.get('error', '')[:200]!r}")
            rc, st = ctl("status")
            check(st.get("current_version") == str(version - 1),
                  f"[engine kill] version stays {version - 1}: {st.get('current_version')!r}")
            procs.kill("target")
            start_engine()
            start_target()
            harness.wait_for("infer0 registered again", nodes_up, 30, procs, ["source", "target"])
            version += 1
            check(trainer(version), f"[engine kill] update {version} after the engine's restart lands, verified")
        finally:
            procs.close()
    return check.verdict()


if __name__ == "__main__":
    sys.exit(main())
